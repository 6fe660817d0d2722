"""Exact 6-bit codes: products that read a GGUF file's Q6_K and Q5_0 matrices as they are, losslessly.

A Q6_K row is, per 16 consecutive input channels, s (q - 32) with q a 6-bit code and s = d sc (d float16 per 256
channels, sc a signed byte per 16: exact in float32); a Q5_0 row is d (q - 16) per 32 with a 5-bit q, the same form
with the code q + 16. eaglespec.backends.cpu.kquant reads both from the file as `Codes` (every weight rebuilt bit
for bit against gguf's dequantization, `Codes.weight`); `Q6Linear` multiplies through csrc/common/q6_gemm.h, reading
8 bits a weight (6 bits and a float32 scale per 16) instead of bfloat16's 16, every product x (q - 32) exact and a
row's sums in a fixed order whatever else is in the call (row-invariant). Qwen2.5-Coder-1.5B's Q4_K_M file keeps
half of its ffn_down matrices in Q6_K; its 0.5B sibling keeps most of its matrices in Q5_0.

Used by bfloat16 fast targets wherever eaglespec's kernels run (`available`, as eaglespec.backends.cpu.q4); the
builds' sums (AVX2, AVX-512, AMX) differ in the last bits, each row-invariant. $EAGLESPEC_Q4=0 turns it off with the
4-bit product. With `int8_inputs` (eaglespec.backends.cpu.q4) it runs q6_q8_linear: int8 inputs, integer sums.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ... import envs
from . import kernels
from .q4 import PackedLinear

SCALE_K = 16  # input channels per scale
BLOCK = 32  # input channels per packed block
COLUMNS = 32  # output columns per packed group (csrc/common/shared.h)
OFFSET = 32  # a weight is s (q - OFFSET)
PAIR_BYTES = 48  # a k-pair's 64 codes: 32 bytes of low nibbles, 16 of high 2-bit pieces
PACKED_BYTES = 256 + 16 * PAIR_BYTES  # a packed group-block: 2 x 32 float32 scales, then 16 k-pairs' codes


def available() -> bool:
    """True where Q6Linear runs: this CPU loads a build of the kernels with the 6-bit product and $EAGLESPEC_Q4 is
    not 0."""
    build = kernels.isa()
    return build is not None and build.has_q6 and envs.q4_enabled()


@dataclass(frozen=True)
class Codes:
    """W [N, K] = s (q - 32) per 16 input channels, exactly (one float32 product per weight)."""

    s: Tensor  # [N, K/16] float32
    q: Tensor  # [N, K] uint8 in [0, 63]

    def weight(self) -> Tensor:
        """The float32 weights [N, K] they stand for."""
        n, k = self.q.shape
        q = self.q.view(n, k // SCALE_K, SCALE_K).float() - OFFSET  # [N, K/16, 16]
        return (self.s[..., None] * q).view(n, k)

    @staticmethod
    def cat(parts: list["Codes"]) -> "Codes":
        """Matrices stacked along N (a fused q/k/v)."""
        return Codes(torch.cat([p.s for p in parts]), torch.cat([p.q for p in parts]))


def q6_pack(codes: Codes) -> Tensor:
    """csrc/common/shared.h's layout (every build's micro-kernels read it): [ceil(N/32), K/32, 1024] uint8; per
    group-block the scales of its 32 columns for its first 16 k, then for the next 16 (float32), then the codes, 48
    bytes per k-pair. The pair's 64 codes Q in kernel order (in each 16-byte lane j the pair's two codes of columns
    4 j .. 4 j + 3, then of 16 + 4 j .. 16 + 4 j + 3, so that the AVX-512 kernel's byte unpack yields 16 columns in
    order) are stored as 32 bytes of low nibbles (Q[t] and Q[32 + t] in byte t) and 16 bytes of high 2-bit pieces
    (Q[16 s + t] >> 4 in bits 2 s, 2 s + 1 of byte t)."""
    n, k = codes.q.shape
    if k % BLOCK or codes.s.shape != (n, k // SCALE_K) or codes.s.dtype != torch.float32:
        raise ValueError(f"6-bit codes need K divisible by {BLOCK} and float32 scales [N, K/16], not K = {k} and "
                         f"{codes.s.dtype} {tuple(codes.s.shape)}")
    pad = -n % COLUMNS
    groups, blocks = (n + pad) // COLUMNS, k // BLOCK
    s = nn.functional.pad(codes.s, (0, 0, 0, pad)).view(groups, COLUMNS, blocks, 2)  # [G, col, B, half]
    s = s.permute(0, 2, 3, 1).contiguous().view(torch.uint8).view(groups, blocks, -1)  # [G, B, 256]
    # column 16 u + 4 j + i, k 2 p + e -> byte 64 p + 16 j + 8 u + 2 i + e of the block's codes
    q = nn.functional.pad(codes.q, (0, 0, 0, pad)).view(groups, 2, 4, 4, blocks, BLOCK // 2, 2)  # [G, u, j, i, B, p, e]
    q = q.permute(0, 4, 5, 2, 1, 3, 6).reshape(groups, blocks, BLOCK // 2, 64)  # [G, B, p, j u i e] -> [G, B, p, 64]
    low = q[..., :32] & 15 | (q[..., 32:] & 15) << 4  # [G, B, p, 32]
    high = q.view(groups, blocks, BLOCK // 2, 4, 16) >> 4  # [G, B, p, s, 16]
    high = high[..., 0, :] | high[..., 1, :] << 2 | high[..., 2, :] << 4 | high[..., 3, :] << 6  # [G, B, p, 16]
    codes = torch.cat([low, high], dim=-1).view(groups, blocks, -1)  # [G, B, 16 x 48]
    return torch.cat([s, codes], dim=-1).contiguous()


class Q6Linear(PackedLinear):
    """y = x W^T (+ b) with W read as exact 6-bit codes. x [..., K] -> [..., N] bfloat16."""

    op = "q6_linear"
    int8_op = "q6_q8_linear"

    def __init__(self, codes: Codes, bias: Tensor | None = None, int8_inputs: bool = False):
        super().__init__(q6_pack(codes), tuple(codes.q.shape), bias, int8_inputs)
