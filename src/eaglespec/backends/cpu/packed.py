"""Linear layers with their weights pre-packed for oneDNN: the CPU fast path's default for float32 targets, and for
bfloat16 ones on CPUs that compute in bfloat16 natively (AVX-512 BF16 or AMX).

`F.linear` on a float32 CPU tensor goes to MKL, which repacks the weight matrix on every call with more than one
row. For a small model that is bound by reading its weights, this makes a 2-row product cost about twice a 1-row
one (SmolLM2-135M, 2 cores: 82 ms of matrix products for 2 rows against 42 ms for 1). oneDNN's linear with a weight
reordered once into its blocked layout reads the weights once per call, so 1-8 rows cost about the same (31-42 ms
there), which is what makes verifying a draft tree cheap on a CPU (docs/cpu.md).

It also gives each row the same bits whatever the number of rows in the call (checked in tests/test_packed.py;
not for every shape: on an AVX-512 CPU with torch 2.13 one with 1536 input channels is not, hence `pack_row_invariant`),
which, with the fast path's row-by-row attention, makes a verified row bit-identical to a one-token step.

The packed copy takes as much memory as the weight it packs. The two oneDNN ops are the ones torch.compile's CPU
backend emits for frozen linear layers; they are underscore (internal) ops, so `available` checks they exist and
tests/test_packed.py must pass again after a torch upgrade.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn


@functools.cache  # called on every draft step (heads/eagle1.py): answer once per dtype and device
def available(dtype: torch.dtype, device: torch.device | str) -> bool:
    """True where packing applies: float32 weights, or bfloat16 ones on a CPU with native bfloat16 arithmetic, on a
    CPU whose torch build has oneDNN (mkldnn)."""
    if not (torch.device(device).type == "cpu" and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    if dtype == torch.bfloat16:
        from ...platform import cpu_has_native_bf16

        return cpu_has_native_bf16() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return dtype == torch.float32


@dataclass
class PackedLinear:
    """y = x W^T (+ b), W held in oneDNN's blocked layout. Call it like `F.linear(x, W, b)`: x [..., K] -> [..., N]."""

    weight: Tensor  # [N, K] float32 or bfloat16, mkldnn layout
    bias: Tensor | None  # [N]

    def __call__(self, x: Tensor) -> Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


def pack(weight: Tensor, bias: Tensor | None = None) -> PackedLinear:
    """Reorder a [N, K] weight once into oneDNN's layout (a copy; the input is left as it is). bfloat16 stays
    bfloat16 (call it with bfloat16 inputs); any other dtype is packed as float32."""
    dtype = torch.bfloat16 if weight.dtype == torch.bfloat16 else torch.float32
    w = weight.detach().to(dtype).contiguous()
    packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
    return PackedLinear(packed, None if bias is None else bias.detach().to(dtype).contiguous())


# The widest input (K) measured row-invariant at 1-64 rows (float32 and bfloat16, AVX-512 CPU, torch 2.13): K = 1536
# is not (a row gets other bits once 2+ float32 / 4+ bfloat16 rows share the call), 256-1024 are.
ROW_INVARIANT_K = 1024


@dataclass
class ChunkedPackedLinear:
    """y = x W^T (+ b) as a fixed-order float32 sum of packed products over input chunks of at most ROW_INVARIANT_K
    channels: row-invariant where one wide packed product is not. x [..., K] -> [..., N] in x.dtype."""

    parts: list[PackedLinear]
    bounds: list[tuple[int, int]]  # input channel range of each part
    bias: Tensor | None  # [N]

    def __call__(self, x: Tensor) -> Tensor:
        y = None
        for (start, end), part in zip(self.bounds, self.parts):
            out = part(x[..., start:end].contiguous()).float()  # [..., N]
            y = out if y is None else y + out
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype)


def pack_row_invariant(weight: Tensor, bias: Tensor | None = None) -> PackedLinear | ChunkedPackedLinear:
    """`pack`, split into equal input chunks when K exceeds ROW_INVARIANT_K (a little slower; for --exact)."""
    k = weight.shape[1]
    if k <= ROW_INVARIANT_K:
        return pack(weight, bias)
    chunks = -(-k // ROW_INVARIANT_K)
    size = -(-k // chunks)
    bounds = [(start, min(start + size, k)) for start in range(0, k, size)]
    parts = [pack(weight[:, start:end]) for start, end in bounds]
    return ChunkedPackedLinear(parts, bounds, None if bias is None else bias.detach())


class PackedLinearModule(nn.Module):
    """Inference-only stand-in for an `nn.Linear` (no gradients flow through oneDNN's packed weight)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.linear = pack(linear.weight, linear.bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear(x)


def replace_linears(module: nn.Module, make: Callable[[nn.Linear], nn.Module | None]) -> nn.Module:
    """A copy of `module` in which every `nn.Linear` is replaced by `make(linear)`, where that is not None."""
    out = copy.deepcopy(module)
    for parent in out.modules():
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and (replacement := make(child)) is not None:
                setattr(parent, name, replacement)
    return out


def pack_linears(module: nn.Module) -> nn.Module:
    """A copy of `module` for inference in which every CPU `nn.Linear` that `available` allows is packed (the rest
    is as it was). The draft heads use it: a draft step multiplies 1-10 rows, where unpacked products cost most."""
    return replace_linears(module, lambda linear: PackedLinearModule(linear)
                           if available(linear.weight.dtype, linear.weight.device) else None)
