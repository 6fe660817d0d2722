"""A target's decoder layers as one call into eaglespec's kernels (csrc/common/decoder_stack.h): the whole step of a
Llama-style target whose products all run on the kernels, with no Python between them.

The layers in Python (eaglespec.targets.layers) call ~40 torch operators a layer around the kernels' products: ~0.3 ms
a layer on 2 cores, half of a SmolLM2-135M decode step. The stack does the same arithmetic in C++ (RMSNorm, RoPE,
the attention's cache write, residual adds, SiLU), each row on its own and rounded to bfloat16 where the model's
bfloat16 operators round, so every row keeps the property the exactness of speculative decoding rests on: its bits
do not depend on the other rows of the step (a verified tree row equals the one-token step that would compute it;
a batch's row equals its batch-1 step). Its bits are its own, not those of the layers in Python (RMSNorm's sum is
taken in another order), so one target uses one or the other for every step.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ... import envs
from . import kernels, q4, q6

Q4_KIND = 2  # a product's kind in the stack: 0 / 1 the bfloat16 kernel's loop (kernels.VARIANTS), 2 the 4-bit one,
Q6_KIND = 3  # 3 the 6-bit codes,
INT8_INPUTS = 2  # + 2: the same with int8 inputs (4: the 4-bit product's q4_q8_linear, 5: the 6-bit one's)


def _parts(linear) -> tuple:
    """A layer product's parts (q4.SplitLinear: its runs of rows, each its own product; else the product itself)."""
    return tuple(linear.parts) if isinstance(linear, q4.SplitLinear) else (linear,)


def _kind(linear) -> int | None:
    if isinstance(linear, (q4.Q4Linear, q6.Q6Linear)):
        return (Q4_KIND if isinstance(linear, q4.Q4Linear) else Q6_KIND) + INT8_INPUTS * linear.int8_inputs
    if isinstance(linear, kernels.Bf16Linear):
        return linear.variant
    return None


class KernelStack:
    """A FastTarget's layers (their `_Layer` fields) as the kernels' decoder stack. Build with `KernelStack.of`."""

    def __init__(self, layers: list, heads: tuple[int, int, int], eps: float):
        self.heads, self.eps = heads, eps
        self.norms = [w.contiguous() for layer in layers for w in (layer.input_norm, layer.post_norm)]  # 2L x [d]
        products = [_parts(m) for layer in layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down)]  # 4L
        self.parts = [len(p) for p in products]  # each product's parts, their outputs side by side
        matrices = [m for p in products for m in p]  # sum(parts)
        self.packed = [m.packed for m in matrices]
        self.outs = [m.out_features for m in matrices]
        self.kinds = [_kind(m) for m in matrices]
        self.biases = [m.bias for m in matrices]

    @classmethod
    def of(cls, layers: list, heads: tuple[int, int, int], eps: float) -> "KernelStack | None":
        """The stack of these layers, or None where it does not apply: a product off the kernels, weights not
        bfloat16, or $EAGLESPEC_STACK=0."""
        if not envs.stack_enabled() or not layers:
            return None
        for layer in layers:
            linears = [m for linear in (layer.qkv, layer.o, layer.gate_up, layer.down) for m in _parts(linear)]
            if any(_kind(m) is None for m in linears) or any(
                    w.dtype != torch.bfloat16 for w in (layer.input_norm, layer.post_norm)):
                return None
        return cls(layers, heads, eps)

    def __call__(self, x: Tensor, cos: Tensor, sin: Tensor, keys: list[list[Tensor]], values: list[list[Tensor]],
                 cached: list[int], sizes: list[int], step_masks: list[Tensor | None],
                 saved: tuple[int, ...] = ()) -> tuple[Tensor, list[Tensor]]:
        """One step of every layer over x [N, d] (the rows of len(sizes) sequences, one after another), cos, sin
        [N, hd] at their positions. Sequence s: keys[s] / values[s] its per-layer caches (the kernel's layout:
        keys [Hkv, hd, capacity], values [Hkv, capacity, hd]), written at rows cached[s] on; step_masks[s] [n, n]
        bool or None (causal). Returns (x [N, d] after the last layer, the inputs of the layers in `saved`, in
        ascending layer order)."""
        H, Hkv, _ = self.heads
        layers = len(self.norms) // 2
        keys_t = [keys[s][layer] for layer in range(layers) for s in range(len(sizes))]  # [L S], layer-major
        values_t = [values[s][layer] for layer in range(layers) for s in range(len(sizes))]
        out = torch.ops.eaglespec.decoder_stack(x, cos, sin, self.norms, self.packed, self.outs, self.kinds,
                                                self.biases, self.parts, keys_t, values_t, cached, sizes, step_masks,
                                                H, Hkv, self.eps, sorted(set(saved)))
        return out[0], out[1:]
