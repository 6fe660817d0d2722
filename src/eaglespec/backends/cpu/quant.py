"""Weight-only quantized linear layers for the CPU fast path (`--quantize int8|int4`).

On a few CPU cores a decode step of a small model is bound by reading the weights, and float32 matrix products of
2-16 rows (a draft tree) cost 2-3x one row. torch's weight-only kernels (`_weight_int8pack_mm`,
`_weight_int4pack_mm_for_cpu`) read 1 or 0.5 byte per weight, take bfloat16 activations, accumulate in float32,
and give each row the same result whatever the number of rows (checked in tests/test_quant.py), so verifying a
tree costs little more than one token and speculative output stays identical to plain decoding of the same
quantized model.

Quantizing changes the model (like llama.cpp's Q8_0 / Q4_1 files do): output is lossless with respect to the
quantized target, not to the float32 one. It is therefore off by default.

- int8: symmetric, one scale per output channel: w ~ q * s, q in [-127, 127].
- int4: asymmetric groups of `group` input channels (Q4_1-style): w ~ q * s + m, q in [0, 15]; the kernel's form
  is (q - 8) * s + z with z = m + 8 s.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ...errors import EagleSpecError

MODES = ("int8", "int4")
INT4_GROUPS = (32, 64, 128, 256)


def check_mode(mode: str | None, device: torch.device | str = "cpu") -> str | None:
    """Validate a --quantize value; returns None for no quantization."""
    if mode in (None, "", "none"):
        return None
    if mode not in MODES:
        raise EagleSpecError(f"unknown quantization '{mode}'; use none, {' or '.join(MODES)}")
    if torch.device(device).type != "cpu":
        raise EagleSpecError(f"--quantize {mode} uses torch's CPU kernels; on a GPU use --dtype bfloat16 instead, "
                             "or run on the CPU with --device cpu")
    return mode


@dataclass
class QuantLinear:
    """y = x W^T (+ b) with W stored quantized. Call it like `F.linear(x, W, b)`: x [..., K] -> [..., N] in x.dtype."""

    mode: str
    weight: Tensor  # int8: [N, K] int8; int4: packed by _convert_weight_to_int4pack_for_cpu
    scales: Tensor  # int8: [N] bfloat16; int4: [K / group, N, 2] bfloat16 (scale, zero)
    bias: Tensor | None  # [N]
    out_features: int
    group: int = 0

    def __call__(self, x: Tensor) -> Tensor:
        lead = x.shape[:-1]
        a = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)  # [M, K]
        if self.mode == "int8":
            y = torch.ops.aten._weight_int8pack_mm(a, self.weight, self.scales)  # [M, N]
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(a, self.weight, self.group, self.scales)
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*lead, self.out_features)

    def dequantized(self) -> Tensor:
        """The weight [N, K] this layer multiplies by, as float32 rounded to bfloat16 (for error measurements)."""
        eye = torch.eye(self.in_features, dtype=torch.bfloat16)
        bias, self.bias = self.bias, None
        try:
            return self(eye).float().T.contiguous()
        finally:
            self.bias = bias

    @property
    def in_features(self) -> int:
        return self.weight.shape[1] if self.mode == "int8" else self.scales.shape[0] * self.group

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size() + self.scales.numel() * self.scales.element_size()


def quantize_int8(weight: Tensor, bias: Tensor | None = None) -> QuantLinear:
    """Per-output-channel symmetric int8 of a [N, K] weight."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12).to(torch.bfloat16)  # [N]
    q = torch.round(w / scale.float()[:, None]).clamp_(-127, 127).to(torch.int8)  # [N, K]
    return QuantLinear("int8", q.contiguous(), scale, _bias(bias), w.shape[0])


def quantize_int4(weight: Tensor, bias: Tensor | None = None, group: int = 32) -> QuantLinear:
    """Asymmetric int4 in groups of `group` input channels of a [N, K] weight (K must be divisible by group)."""
    n, k = weight.shape
    if group not in INT4_GROUPS:
        raise EagleSpecError(f"int4 group size must be one of {INT4_GROUPS}, got {group}")
    if k % group:
        raise EagleSpecError(f"int4 needs the input size ({k}) to be a multiple of the group size ({group})")
    w = weight.detach().float().reshape(n, k // group, group)  # [N, G, group]
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)  # [N, G]
    scale = ((hi - lo) / 15.0).clamp_min(1e-12).to(torch.bfloat16)
    zero = (lo + 8.0 * scale.float()).to(torch.bfloat16)  # dequant: (q - 8) * scale + zero
    q = torch.round((w - zero.float()[..., None]) / scale.float()[..., None] + 8.0).clamp_(0, 15)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.reshape(n, k).to(torch.int32), 1)
    scales = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()  # [G, N, 2]
    return QuantLinear("int4", packed, scales, _bias(bias), n, group)


def quantize(weight: Tensor, bias: Tensor | None, mode: str, group: int = 32) -> QuantLinear:
    """int4 where the input size allows the group size, int8 otherwise."""
    if mode == "int4" and weight.shape[1] % group == 0:
        return quantize_int4(weight, bias, group)
    return quantize_int8(weight, bias)


def _bias(bias: Tensor | None) -> Tensor | None:
    return None if bias is None else bias.detach()
