"""What this machine is: CPU model and flags, CUDA devices, the dtype `auto` means, the cache folder.

A leaf module: it imports nothing else of eaglespec but `errors` and `envs`, so everything may depend on it.
"""

from __future__ import annotations

import ctypes
import os
import platform as _system
import shutil
import sys
from pathlib import Path

import torch

from . import envs
from .errors import EagleSpecError

_MADV_DONTNEED = 4  # <sys/mman.h> on Linux


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
    return _cpuinfo_field("model name") or _system.processor() or _system.machine()


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


def auto_dtype(device: str | torch.device = "cpu", bf16_kernels: bool = False) -> torch.dtype:
    """"auto": bfloat16 on a GPU (float16 on one without native bfloat16, before Ampere: a T4, a V100), on a CPU
    with native bfloat16 arithmetic, and where `bf16_kernels` (eaglespec's bfloat16 kernels run on this CPU: with
    AVX2 + FMA they read bfloat16 weights and multiply in float32, and a decode step on a few cores is bound by
    reading the weights); float32 elsewhere."""
    if str(device).startswith("cuda"):
        return torch.float16 if gpu_lacks_native_bf16() else torch.bfloat16
    return torch.bfloat16 if cpu_has_native_bf16() or bf16_kernels else torch.float32


def parse_dtype(dtype: str | torch.dtype, device: str | torch.device = "cpu", bf16_kernels: bool = False
                ) -> torch.dtype:
    """A dtype name (or "auto", see `auto_dtype`)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return auto_dtype(device, bf16_kernels)
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if dtype not in table:
        raise EagleSpecError(f"unknown dtype '{dtype}'; use one of auto, float32, bfloat16, float16")
    return table[dtype]


def cache_root() -> Path:
    """Where converted models, calibrations and kernel choices are kept: $EAGLESPEC_CACHE, else
    $XDG_CACHE_HOME/eaglespec, else ~/.cache/eaglespec (eaglespec.envs)."""
    return envs.cache_dir()


def cpu_compiler_available() -> bool:
    """True where torch.compile's CPU backend finds a C++ compiler."""
    return any(c and shutil.which(c) for c in (os.environ.get("CXX"), "g++", "c++", "clang++"))


def evict_mapped_pages(address: int, nbytes: int, files: list[Path], equal_to_file: bool = False) -> int:
    """Linux: take the whole pages inside bytes [address, address + nbytes) out of this process's resident set where
    they lie in a mapping of one of `files` (as torch maps a safetensors checkpoint) that is read-only, or private
    and `equal_to_file` (the caller has compared the bytes with the file's: a page written since would go back to
    the file's bytes). Nothing is lost: the pages are read back from the file if touched again; only the resident
    size changes. Returns the bytes evicted (0 where the range is not such a mapping, or on another system)."""
    if nbytes <= 0 or not sys.platform.startswith("linux"):
        return 0
    names = {str(path.resolve()) for path in files}
    try:
        with open("/proc/self/maps", encoding="utf-8") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                span, perms = fields[0], fields[1]
                start, end = (int(v, 16) for v in span.split("-"))
                if start <= address < end:
                    mapped = len(fields) == 6 and fields[5].strip() in names and address + nbytes <= end
                    if not mapped or ("w" in perms and not (perms[3] == "p" and equal_to_file)):
                        return 0
                    break
            else:
                return 0
    except OSError:
        return 0
    page = os.sysconf("SC_PAGE_SIZE")
    first, last = -(-address // page) * page, (address + nbytes) // page * page  # whole pages inside the range
    if last <= first:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return last - first if libc.madvise(first, last - first, _MADV_DONTNEED) == 0 else 0
