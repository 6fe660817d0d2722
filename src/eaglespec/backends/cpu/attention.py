"""The decode-step attention and KV-cache commit of eaglespec's kernels, in the form the layer math takes
(eaglespec.targets.layers.write_and_attend's)."""

from __future__ import annotations

import torch
from torch import Tensor


def write_and_attend_tree(q: Tensor, k: Tensor, v: Tensor, keys: Tensor, values: Tensor, c: int,
                          step_mask: Tensor | None) -> Tensor:
    """`write_and_attend` through eaglespec's decode-step attention (csrc/common/tree_attention.h, float32, AVX-512 or
    AVX2): each query row attends over the cached prefix and then its own path of step rows, in sequence order, so a
    verified tree row gets the bits of the one-token step that would compute it. keys: [Hkv, hd, capacity], the cache's
    keys transposed (the kernel scores 16 keys as one vector); values [Hkv, capacity, hd]. step_mask [n, n] bool (row r
    sees step row s: its ancestors and itself) or None (causal; a one-token step). Returns [H, n, hd]."""
    n = q.shape[1]
    keys[:, :, c : c + n] = k.transpose(1, 2)
    values[:, c : c + n] = v
    return torch.ops.eaglespec.tree_attention(q, keys[:, :, : c + n], values[:, : c + n], step_mask)


def write_and_attend_batch(q: Tensor, k: Tensor, v: Tensor, keys: list[Tensor], values: list[Tensor],
                           cached: list[int], sizes: list[int], step_masks: list[Tensor | None]) -> Tensor:
    """`write_and_attend_tree` for the sequences of a batch at once (eaglespec.targets.pool), in one call: q [H, N, hd],
    k, v [Hkv, N, hd] the rows of every sequence, one after another (sizes[i] rows each); sequence i's rows are
    written to its cache (keys[i] [Hkv, hd, capacity], values[i] [Hkv, capacity, hd]) at rows cached[i] on and attend
    over it with step_masks[i], each row with the bits `write_and_attend_tree` gives it. Returns [H, N, hd]."""
    return torch.ops.eaglespec.tree_attention_batch(q, k, v, keys, values, cached, sizes, step_masks)


def commit_rows(layer_keys: list[Tensor], layer_values: list[Tensor], c: int, kept: list[int]) -> None:
    """Keep the accepted path in every layer's cache at once (csrc/common/commit_rows.h): rows c + kept[i] ->
    c + i of each layer's transposed keys [Hkv, hd, capacity] and values [Hkv, capacity, hd]."""
    torch.ops.eaglespec.commit_rows(layer_keys, layer_values, c, kept)
