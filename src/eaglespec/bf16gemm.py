"""eaglespec's own few-row bfloat16 products for CPUs with AVX-512 BF16 (csrc/bf16_gemm.cpp), used by `--compile`.

A decode step or a draft-tree verification multiplies 1-16 rows by each weight matrix. oneDNN's packed bfloat16
products cost ~13 us a call and stream these shapes at 17-22 GB/s, and inductor's C++ GEMM kernels compute in
float32 FMAs (4.7x slower than oneDNN at 8 rows; benchmarks/RESULTS.md, session 14). This kernel reads the packed
weight once per call and multiplies with vdpbf16ps: all matrix products of a SmolLM2-135M step (2 cores, called
from Python, `benchmarks/scripts/bf16_gemm_cost.py`) take ~10-10.6 ms for 1-6 rows and 11.7 ms for 8, against
13.4-15.5 ms with oneDNN (RESULTS.md, session 15). Calls of 7-64 rows run several register tiles over each weight
block while it is in L1 and prefetch the next, so the weights still stream once (session 17, a Zen 5 machine: 16
rows 7.31 -> 5.56 ms against 3.81 for one row; `benchmarks/scripts/kernel_ab.py`). Each row gets the same bits
whatever the number of rows in the call.

The C++ source is compiled on first use with torch's extension builder (g++, ~10-30 s, cached under
~/.cache/torch_extensions) and registers `torch.ops.eaglespec.bf16_linear`, an operator torch.compile keeps as one
call in its graphs (`register_fake` below gives it shapes).
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import torch
from torch import Tensor, nn

from .errors import EagleSpecError

# The bfloat16 products, the decode-step attention (csrc/tree_attention.cpp) and the KV-cache commit of an accepted
# path (csrc/commit_rows.cpp), built as one extension.
SOURCES = [Path(__file__).parent / "csrc" / name
           for name in ("bf16_gemm.cpp", "tree_attention.cpp", "commit_rows.cpp")]
FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mfma", "-fopenmp"]


def cpu_supported() -> bool:
    """True on a CPU with AVX-512 BF16 (the kernel's only instruction set)."""
    from .models import cpu_flags

    flags = cpu_flags()
    return {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"} <= flags


def can_build() -> bool:
    """True where torch's extension builder can compile the kernel: a C++ compiler and ninja (a dependency)."""
    from torch.utils.cpp_extension import is_ninja_available

    from .compiled import cpu_compiler_available

    return cpu_compiler_available() and is_ninja_available()


def available(dtype: torch.dtype, device: torch.device | str) -> bool:
    """True where `--compile` uses this kernel: bfloat16 weights on a CPU with AVX-512 BF16, and `can_build`
    (set EAGLESPEC_BF16_GEMM=0 to use oneDNN / inductor's products instead)."""
    return (dtype == torch.bfloat16 and torch.device(device).type == "cpu" and cpu_supported() and can_build()
            and os.environ.get("EAGLESPEC_BF16_GEMM", "1") != "0")


@functools.cache
def load() -> None:
    """Build (first time only) and load the kernels; registers torch.ops.eaglespec.bf16_*, tree_attention and
    commit_rows."""
    from torch.utils.cpp_extension import load as build

    if not cpu_supported():
        raise EagleSpecError("eaglespec's bfloat16 kernel needs a CPU with AVX-512 BF16")
    print("eaglespec: loading its bfloat16 kernel (built on first use, ~10-30 s)", file=sys.stderr, flush=True)
    try:
        build("eaglespec_kernels", [str(source) for source in SOURCES], extra_cflags=FLAGS,
              extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
    except (RuntimeError, OSError) as error:
        raise EagleSpecError(f"could not build eaglespec's bfloat16 kernel ({error}); set EAGLESPEC_BF16_GEMM=0 "
                             "to run without it") from error

    @torch.library.register_fake("eaglespec::bf16_linear")
    def _(x: Tensor, packed: Tensor, n: int, bias: Tensor | None) -> Tensor:
        return x.new_empty(x.shape[0], n)

    @torch.library.register_fake("eaglespec::tree_attention")
    def _(q: Tensor, keys: Tensor, values: Tensor, step_mask: Tensor | None) -> Tensor:
        return q.new_empty(q.shape)


class Bf16Linear(nn.Module):
    """y = x W^T (+ b) through the kernel, W packed once (as much memory as W). x [..., K] -> [..., N] bfloat16."""

    def __init__(self, weight: Tensor, bias: Tensor | None = None):
        super().__init__()
        load()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.register_buffer("packed", torch.ops.eaglespec.bf16_pack(weight.detach().to(torch.bfloat16).contiguous()))
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())

    def forward(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, self.in_features)  # [M, K]
        y = torch.ops.eaglespec.bf16_linear(rows, self.packed, self.out_features, self.bias)  # [M, N]
        return y.view(*x.shape[:-1], self.out_features)


def with_kernel(module: nn.Module) -> nn.Module:
    """A copy of `module` whose bfloat16 CPU `nn.Linear` layers run through the kernel (the draft heads under
    `--compile`: their layer step, EAGLE-3's fusion and draft LM head)."""
    from .packed import replace_linears

    return replace_linears(module, lambda linear: Bf16Linear(linear.weight, linear.bias)
                           if available(linear.weight.dtype, linear.weight.device) else None)
