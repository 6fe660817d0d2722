"""The model folders the bench's out-of-process peers read (eaglespec.bench.peers): a view of a transformers folder
that vLLM and older transformers read as ours do, our EAGLE-3 head in vLLM's layout, and OpenVINO exports; each
made once and kept in eaglespec's cache."""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tqdm.auto import tqdm

from ..errors import EagleSpecError
from .peer_process import log_tail

OPENVINO_WEIGHTS = ("int4", "int8", "fp16", "fp32")
EXPORT_TIMEOUT_S = 3600.0
# model_type -> the architecture vLLM needs in config.json (converted folders leave it empty)
MODEL_TYPE_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                            "gemma3_text": "Gemma3ForCausalLM", "mistral": "MistralForCausalLM"}


def hf_folder(model_name: str) -> Path:
    """The transformers folder of a model: a GGUF model's converted copy (made once, as load_target does)."""
    from .. import models

    folder, gguf = models.resolve_model(model_name)
    if gguf:
        folder = models._ensure_converted(folder, gguf, models.REGISTRY.get(model_name))
    return folder


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def peer_ready_folder(folder: Path, architecture: str | None = None) -> Path:
    """A view of a transformers folder that other transformers versions read the same way: config.json with
    `architectures` (vLLM needs it), `rope_theta` beside transformers 5's `rope_parameters`, `torch_dtype`
    beside `dtype`, and a tokenizer class every version knows; the weights and other files are links.
    Kept under the cache (peers/hf/), rebuilt when the source config changes."""
    from ..platform import cache_root

    folder = Path(folder).resolve()
    config = json.loads((folder / "config.json").read_text())
    out = cache_root() / "peers" / "hf" / f"{folder.name}-{_digest(str(folder))}"
    out.mkdir(parents=True, exist_ok=True)
    arch = architecture or MODEL_TYPE_ARCHITECTURES.get(config.get("model_type", ""))
    if not config.get("architectures"):
        if not arch:
            raise EagleSpecError(f"'{folder}': config.json names no architecture and model type "
                                 f"'{config.get('model_type')}' has no known one for the peers")
        config["architectures"] = [arch]
    rope = config.get("rope_parameters") or {}
    if "rope_theta" not in config and "rope_theta" in rope:
        config["rope_theta"] = rope["rope_theta"]
    if rope and rope.get("rope_type", "default") != "default" and not config.get("rope_scaling"):
        config["rope_scaling"] = rope
    if "dtype" in config and "torch_dtype" not in config:
        config["torch_dtype"] = config["dtype"]
    links = {item.name: item for item in folder.iterdir()
             if item.name not in ("config.json", "tokenizer_config.json") and not item.name.startswith(".")}
    weights = folder / "model.safetensors"
    if config.get("tie_word_embeddings") and weights.is_file() and _tied_embedding_missing(weights):
        # transformers 5 saves a tied embedding once, as lm_head.weight; vLLM and older transformers read the
        # embedding itself (and drop lm_head): give them a shard holding it, listed with the rest in an index
        del links["model.safetensors"]
        links[SHARDS[0]] = weights
        _write_embedding_shard(weights, out)
    for stale in out.iterdir():  # a link of an earlier view (e.g. model.safetensors before the shards)
        if stale.is_symlink() and stale.name not in links:
            stale.unlink()
    for name, item in links.items():
        link = out / name
        if not link.is_symlink() or os.readlink(link) != str(item):
            if link.is_symlink() or link.exists():
                link.unlink()
            link.symlink_to(item)
    _write_if_changed(out / "config.json", json.dumps(config, indent=2) + "\n")
    if (folder / "tokenizer_config.json").is_file():
        tok = json.loads((folder / "tokenizer_config.json").read_text())
        if tok.get("tokenizer_class") == "TokenizersBackend":  # transformers 5's name for a tokenizer.json one
            tok["tokenizer_class"] = "PreTrainedTokenizerFast"
        _write_if_changed(out / "tokenizer_config.json", json.dumps(tok, indent=2) + "\n")
    return out


EMBEDDING = "model.embed_tokens.weight"
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


def _tied_embedding_missing(weights: Path) -> bool:
    from safetensors import safe_open

    with safe_open(str(weights), "pt") as f:
        keys = set(f.keys())
    return EMBEDDING not in keys and "lm_head.weight" in keys


def _write_embedding_shard(weights: Path, out: Path) -> None:
    """The second shard (the embedding, a copy of the tied lm_head.weight) and the index of both."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    index = out / "model.safetensors.index.json"
    if (out / SHARDS[1]).is_file() and index.is_file():
        return
    with safe_open(str(weights), "pt") as f:
        keys = list(f.keys())
        embedding = f.get_tensor("lm_head.weight")
    tmp = out / (SHARDS[1] + f".tmp{os.getpid()}")
    save_file({EMBEDDING: embedding.contiguous()}, str(tmp), metadata={"format": "pt"})
    tmp.replace(out / SHARDS[1])
    weight_map = {**{k: SHARDS[0] for k in keys}, EMBEDDING: SHARDS[1]}
    _write_if_changed(index, json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2) + "\n")


def _write_if_changed(path: Path, text: str) -> None:
    if not path.is_file() or path.read_text() != text:
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        tmp.write_text(text)
        tmp.replace(path)


def model_label(model_name: str) -> str:
    """A cache name for a model: the registry name, else the folder or file name and a digest of its path."""
    from ..models import REGISTRY

    if model_name in REGISTRY:
        return model_name
    path = Path(os.path.expanduser(model_name)).resolve()
    return f"{path.stem}-{_digest(str(path))}"


def vllm_eagle3_head(head_dir: Path) -> Path:
    """Our EAGLE-3 head in vLLM's layout (eaglespec export --to vllm), kept in the cache (peers/vllm-eagle3/)."""
    from ..platform import cache_root
    from ..train.export import export_head

    head_dir = Path(head_dir).resolve()
    stamp = "|".join(f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in sorted(head_dir.iterdir())
                     if p.is_file())
    out = cache_root() / "peers" / "vllm-eagle3" / f"{head_dir.name}-{_digest(str(head_dir) + stamp)}"
    if not (out / "config.json").is_file():
        tmp = out.with_name(out.name + f".tmp{os.getpid()}")
        export_head(head_dir, tmp, layout="vllm")
        _move_into_place(tmp, out)
    return out


def _move_into_place(tmp: Path, out: Path) -> None:
    """Rename a finished folder to its cache name; where another run got there first, keep theirs."""
    import shutil

    if out.exists():
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        tmp.replace(out)


INT4_GROUP = 128  # optimum-cli's default group size for int4 weights


def int4_group_size(folder: Path) -> int | None:
    """The int4 group size for a model whose matrix inputs (hidden size, heads x head size, FFN size) the default
    of 128 does not divide (e.g. SmolLM2-135M's 576): the largest of 64, 32, 16 that divides them all, else -1
    (one scale per output channel). None where the default fits."""
    config = json.loads((Path(folder) / "config.json").read_text())
    hidden = int(config.get("hidden_size") or 0)
    heads = int(config.get("num_attention_heads") or 1)
    sizes = [hidden, int(config.get("intermediate_size") or hidden),
             heads * int(config.get("head_dim") or hidden // heads)]
    if all(n % INT4_GROUP == 0 for n in sizes):
        return None
    return next((g for g in (64, 32, 16) if all(n % g == 0 for n in sizes)), -1)


def openvino_export(python: str, folder: Path, label: str, weights: str, progress: bool = True) -> Path:
    """The model in `folder` exported to OpenVINO with `weights` (optimum-cli export openvino, run with the
    peer's python), cached under openvino/LABEL-WEIGHTS."""
    from ..platform import cache_root

    if weights not in OPENVINO_WEIGHTS:
        raise EagleSpecError(f"--openvino-weights must be one of {', '.join(OPENVINO_WEIGHTS)}, got '{weights}'")
    out = cache_root() / "openvino" / f"{label}-{weights}"
    if (out / "openvino_model.xml").is_file():
        return out
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    command = [python, "-m", "optimum.commands.optimum_cli", "export", "openvino", "--model", str(folder),
               "--task", "text-generation-with-past", "--weight-format", weights]
    group = int4_group_size(folder) if weights == "int4" else None
    if group is not None:
        command += ["--group-size", str(group)]
    command.append(str(tmp))
    print(f"eaglespec: exporting {label} to OpenVINO ({weights} weights) in {out} (once): {shlex.join(command)}",
          file=sys.stderr)
    handle, log = tempfile.mkstemp(prefix=f"eaglespec-openvino-export-{label}-", suffix=".log")
    with os.fdopen(handle, "w") as stream:
        proc = subprocess.Popen(command, stdout=stream, stderr=subprocess.STDOUT)
        start = time.monotonic()
        with tqdm(desc=f"exporting {label} ({weights})", unit="s", disable=not progress, leave=False,
                  bar_format="{desc}: {elapsed}") as bar:
            while proc.poll() is None:
                time.sleep(1.0)
                bar.update()
                if time.monotonic() - start > EXPORT_TIMEOUT_S:
                    proc.kill()
                    break
    if proc.wait() != 0 or not (tmp / "openvino_model.xml").is_file():
        tail = log_tail(Path(log))
        raise EagleSpecError(f"optimum-cli could not export {label} to OpenVINO (exit code {proc.returncode}); "
                             f"log {log}" + (f", last lines:\n{tail}" if tail else ""))
    Path(log).unlink(missing_ok=True)
    (tmp / "eaglespec-export.json").write_text(json.dumps({"source": str(folder), "weights": weights,
                                                           "command": command}, indent=2) + "\n")
    _move_into_place(tmp, out)
    return out
