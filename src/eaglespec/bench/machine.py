"""What a benchmark ran on: CPU, threads, GPU, memory, library versions; and per-run peak memory."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import re
import resource
import subprocess
from pathlib import Path

import torch

from ..platform import cpu_model

_PACKAGES = ("eaglespec", "torch", "transformers", "tokenizers", "numpy", "accelerate", "llama_cpp_python")


def total_memory_gb() -> float | None:
    try:
        text = Path("/proc/meminfo").read_text()
    except OSError:
        return None
    match = re.search(r"^MemTotal:\s*(\d+) kB", text, re.MULTILINE)
    return round(int(match.group(1)) / 2**20, 1) if match else None


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in _PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def git_commit() -> str | None:
    """The commit of the eaglespec source tree when it is a git checkout (editable installs), else None."""
    folder = Path(__file__).resolve().parent
    try:
        result = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=folder, capture_output=True, text=True,
                                timeout=5, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    if result.returncode != 0:
        return None
    return result.stdout.strip() or None


def describe_machine() -> dict:
    gpu = None
    if torch.cuda.is_available():
        gpu = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory_gb": total_memory_gb(),
        "gpu": gpu,
        "os": f"{platform.system()} {platform.release()}",
        "versions": versions(),
        "git_commit": git_commit(),
    }


class PeakMemory:
    """Peak memory of one generation call.

    On Linux the process's resident-set high-water mark (VmHWM) is reset before each run (writing 5 to
    /proc/self/clear_refs) and read after it, so each row gets its own peak ("rss_hwm"). Where that is not
    possible the process-wide maximum RSS since start (getrusage ru_maxrss) is reported instead ("ru_maxrss"),
    which never goes down. On CUDA the peak allocated device memory is reported as well.
    """

    def __init__(self) -> None:
        self.method = "rss_hwm" if self._reset_hwm() else "ru_maxrss"

    @staticmethod
    def _reset_hwm() -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            return _read_hwm_kb() is not None
        except OSError:
            return False

    def start(self) -> None:
        if self.method == "rss_hwm":
            self._reset_hwm()
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()

    def peak_mb(self) -> float:
        """Peak resident memory in MiB since `start` (or since process start, see class doc)."""
        kb = _read_hwm_kb() if self.method == "rss_hwm" else None
        if kb is None:
            kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # kilobytes on Linux
        return round(kb / 1024, 1)

    @staticmethod
    def cuda_peak_mb() -> float | None:
        if not torch.cuda.is_available():
            return None
        return round(torch.cuda.max_memory_allocated() / 2**20, 1)


def _read_hwm_kb() -> int | None:
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return None
    match = re.search(r"^VmHWM:\s*(\d+) kB", text, re.MULTILINE)
    return int(match.group(1)) if match else None
