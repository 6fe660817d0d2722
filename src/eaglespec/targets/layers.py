"""The layer math of a Llama-style decoder step, shared by the eager fast path (eaglespec.targets.fast) and its compiled
form (eaglespec.backends.cpu.compiled): RMSNorm, RoPE, one decoder layer, and the decode step's attention with its
KV-cache write. Pure functions of tensors; the products and the attention are passed in, so the same code runs on
torch's operators or on eaglespec's kernels."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

Linear = Callable[[Tensor], Tensor]  # x [..., K] -> [..., N]
Attend = Callable[[Tensor, Tensor, Tensor], Tensor]  # (q [H, n, hd], k, v [Hkv, n, hd]) -> [H, n, hd]


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm as transformers' Llama computes it. x [n, d] -> [n, d]."""
    if x.dtype == torch.float32:  # one fused kernel; the same numbers as the three-step form below
        return F.rms_norm(x, x.shape[-1:], weight, eps)
    # transformers' form, normalise in float32, round, then scale: x * rsqrt(mean(x^2) + eps) is one fused kernel
    # with the same bits as the three-step form (~1 ms less per bfloat16 step over 30 layers).
    return weight * F.rms_norm(x.float(), x.shape[-1:], None, eps).to(x.dtype)


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE (rotate-half form). x [heads, n, hd]; cos, sin [1, n, hd]."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def decoder_layer(layer, x: Tensor, cos: Tensor, sin: Tensor, heads: tuple[int, int, int], eps: float,
                  attention_dtype: torch.dtype, attend: Attend) -> Tensor:
    """One Llama decoder layer over this step's n rows: x [n, d] -> [n, d]. `layer` has the fields of `_Layer`
    (its products may be packed, quantized, plain or `nn.Linear`); heads = (H, Hkv, hd); `attend` writes this
    step's keys and values to the cache and attends (torch.compile traces this same function,
    eaglespec.backends.cpu.compiled)."""
    n = x.shape[0]
    H, Hkv, hd = heads
    qkv = layer.qkv(rms_norm(x, layer.input_norm, eps))  # [n, (H + 2Hkv) hd]
    qk, v = qkv.view(n, H + 2 * Hkv, hd).transpose(0, 1).split([H + Hkv, Hkv], dim=0)  # [heads, n, hd]
    q, k = rotate(qk, cos, sin).to(attention_dtype).split([H, Hkv], dim=0)  # one RoPE call
    attn = attend(q, k, v.to(attention_dtype))  # [H, n, hd]
    x = x + layer.o(attn.transpose(0, 1).reshape(n, H * hd).to(x.dtype))
    gate, up = layer.gate_up(rms_norm(x, layer.post_norm, eps)).chunk(2, dim=-1)  # [n, I] each
    return x + layer.down(F.silu(gate) * up)


def write_and_attend(q: Tensor, k: Tensor, v: Tensor, keys: Tensor, values: Tensor, c: int,
                     mask: Tensor | None, keys_transposed: bool = False) -> Tensor:
    """Write this step's keys and values to cache rows c..c+n-1 of one layer, then attend over rows [0, c + n).
    q [H, n, hd]; k, v [Hkv, n, hd]; keys, values [Hkv, capacity, hd] (one layer's cache, written in place; keys
    [Hkv, hd, capacity] with `keys_transposed`, the layout of `write_and_attend_tree`); mask [1, 1, n, c + n] bool
    or None (a one-token step sees every row). Returns [H, n, hd]."""
    n = q.shape[1]
    if keys_transposed:
        keys[:, :, c : c + n] = k.transpose(1, 2)
        seen_keys = keys[:, :, : c + n].transpose(1, 2).contiguous()  # (attention's result depends on the layout)
    else:
        keys[:, c : c + n] = k
        seen_keys = keys[:, : c + n]
    values[:, c : c + n] = v
    seen_keys, seen_values = seen_keys.to(q.dtype), values[:, : c + n].to(q.dtype)  # (a bfloat16 cache widened)
    return F.scaled_dot_product_attention(q[None], seen_keys[None], seen_values[None], attn_mask=mask,
                                          enable_gqa=q.shape[0] != k.shape[0])[0]
