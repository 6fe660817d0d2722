"""The one decoder layer a draft head is made of (Llama-style: RMSNorm, GQA attention with RoPE, SwiGLU MLP),
plus the head's own KV cache. Parameter names follow transformers/EAGLE so checkpoints load by name."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


@dataclass
class LayerShape:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    hidden_act: str = "silu"
    attention_bias: bool = False
    attn_input_size: int | None = None  # EAGLE-3 feeds 2d into q/k/v; EAGLE-1 feeds d


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_tables(positions: Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos, sin: [T, head_dim] for integer `positions` [T] (the standard rotate-half RoPE)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    angles = positions.float()[:, None] * inv_freq[None]  # [T, head_dim/2]
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class KVCache:
    """Per-layer keys/values [1, kv_heads, T, head_dim]. Rows up to `committed` belong to the committed prefix;
    rows after it are this round's draft-tree entries and are thrown away by `rollback`."""

    def __init__(self, num_layers: int = 1):
        self.keys: list[Tensor | None] = [None] * num_layers
        self.values: list[Tensor | None] = [None] * num_layers
        self.committed = 0

    def __len__(self) -> int:
        return 0 if self.keys[0] is None else self.keys[0].shape[-2]

    def append(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        if self.keys[layer] is None:
            self.keys[layer], self.values[layer] = k, v
        else:
            self.keys[layer] = torch.cat([self.keys[layer], k], dim=-2)
            self.values[layer] = torch.cat([self.values[layer], v], dim=-2)
        return self.keys[layer], self.values[layer]

    def rollback(self) -> None:
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            if k is not None:
                self.keys[i], self.values[i] = k[:, :, : self.committed], v[:, :, : self.committed]

    def commit(self) -> None:
        self.committed = len(self)


class Attention(nn.Module):
    def __init__(self, s: LayerShape):
        super().__init__()
        d_in = s.attn_input_size or s.hidden_size
        self.s = s
        self.q_proj = nn.Linear(d_in, s.num_attention_heads * s.head_dim, bias=s.attention_bias)
        self.k_proj = nn.Linear(d_in, s.num_key_value_heads * s.head_dim, bias=s.attention_bias)
        self.v_proj = nn.Linear(d_in, s.num_key_value_heads * s.head_dim, bias=s.attention_bias)
        self.o_proj = nn.Linear(s.num_attention_heads * s.head_dim, s.hidden_size, bias=False)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], cache: KVCache, layer: int, mask: Tensor) -> Tensor:
        """x: [T, d_in]; mask: [T, len(cache) + T] bool (True = attend). Appends this call's keys to `cache`."""
        s, t = self.s, x.shape[0]
        q = self.q_proj(x).view(t, s.num_attention_heads, s.head_dim).transpose(0, 1)  # [H, T, hd]
        k = self.k_proj(x).view(t, s.num_key_value_heads, s.head_dim).transpose(0, 1)  # [Hkv, T, hd]
        v = self.v_proj(x).view(t, s.num_key_value_heads, s.head_dim).transpose(0, 1)
        cos, sin = rope
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        keys, values = cache.append(layer, k[None], v[None])  # [1, Hkv, S, hd]
        out = F.scaled_dot_product_attention(
            q[None], keys, values, attn_mask=mask[None, None], enable_gqa=s.num_key_value_heads != s.num_attention_heads
        )  # [1, H, T, hd]
        return self.o_proj(out[0].transpose(0, 1).reshape(t, -1))

    def forward_unrolled(
        self, x: Tensor, rope: tuple[Tensor, Tensor], prefix: tuple[Tensor, Tensor] | None,
        diagonal: list[tuple[Tensor, Tensor]],
    ) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """Training forward over a batch of whole sequences, one unrolled draft step at a time.

        x: [B, T, d_in]; rope: cos, sin [T, head_dim] (step j of slot t sits at position t + j).
        Step 0 (`prefix` None): plain causal attention; its keys/values become the `prefix` of later steps.
        Step j >= 1: slot t attends to the prefix keys of slots <= t (the real sequence) and to its own keys of
        steps 1..j at the same slot (`diagonal` holds steps 1..j-1; this call adds step j), which is what a draft
        node at depth j sees at inference: the committed prefix and its ancestors.
        Returns the output [B, T, d] and this step's (keys, values) [B, H_kv, T, head_dim].
        """
        s = self.s
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, s.num_attention_heads, s.head_dim).transpose(1, 2)  # [B, H, T, hd]
        k = self.k_proj(x).view(b, t, s.num_key_value_heads, s.head_dim).transpose(1, 2)  # [B, Hkv, T, hd]
        v = self.v_proj(x).view(b, t, s.num_key_value_heads, s.head_dim).transpose(1, 2)
        cos, sin = rope
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        gqa = s.num_key_value_heads != s.num_attention_heads
        if prefix is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)  # [B, H, T, hd]
        else:
            rep = s.num_attention_heads // s.num_key_value_heads
            k0, v0 = (z.repeat_interleave(rep, dim=1) for z in prefix)  # [B, H, T, hd]
            diag_k = torch.stack(
                [dk.repeat_interleave(rep, dim=1) for dk, _ in diagonal] + [k.repeat_interleave(rep, 1)], -2)
            diag_v = torch.stack(
                [dv.repeat_interleave(rep, dim=1) for _, dv in diagonal] + [v.repeat_interleave(rep, 1)], -2)
            scale = s.head_dim ** -0.5
            causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            scores0 = (q @ k0.transpose(-1, -2) * scale).masked_fill(~causal, float("-inf"))  # [B, H, T, T]
            scores_d = (q[..., None, :] * diag_k).sum(-1) * scale  # [B, H, T, j]
            weights = torch.softmax(torch.cat([scores0, scores_d], dim=-1).float(), dim=-1).to(q.dtype)
            out = weights[..., :t] @ v0 + (weights[..., t:, None] * diag_v).sum(-2)  # [B, H, T, hd]
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1)), (k, v)


class MLP(nn.Module):
    def __init__(self, s: LayerShape):
        super().__init__()
        self.gate_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.up_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.down_proj = nn.Linear(s.intermediate_size, s.hidden_size, bias=False)
        self.act = ACTIVATIONS[s.hidden_act]

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Attention + MLP residual block without an attention input norm: EAGLE-1 feeds the fc output straight
    in, EAGLE-3 normalises its two inputs itself before fusing them (see eagle3.py)."""

    def __init__(self, s: LayerShape):
        super().__init__()
        self.self_attn = Attention(s)
        self.mlp = MLP(s)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)

    def forward(
        self, x: Tensor, residual: Tensor, rope: tuple[Tensor, Tensor], cache: KVCache, layer: int, mask: Tensor
    ) -> Tensor:
        """x: [T, d_in] attention input; residual: [T, d]. Returns [T, d]."""
        h = residual + self.self_attn(x, rope, cache, layer, mask)
        return h + self.mlp(self.post_attention_layernorm(h))

    def forward_unrolled(
        self, x: Tensor, residual: Tensor, rope: tuple[Tensor, Tensor], prefix: tuple[Tensor, Tensor] | None,
        diagonal: list[tuple[Tensor, Tensor]],
    ) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """Batched training forward of one unrolled step (see `Attention.forward_unrolled`). x: [B, T, d_in];
        residual: [B, T, d]. Returns [B, T, d] and this step's (keys, values)."""
        a, kv = self.self_attn.forward_unrolled(x, rope, prefix, diagonal)
        h = residual + a
        return h + self.mlp(self.post_attention_layernorm(h)), kv
