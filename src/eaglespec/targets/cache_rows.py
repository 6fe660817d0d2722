"""A target's KV-cache rows taken out of it (`FastTarget.cached_rows`) and put back (`FastTarget.load_rows`): what the
batch decoder's prefix cache stores. The rows keep the layout of the cache they came from, which only they know."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


@dataclass(frozen=True)
class CacheRows:
    """The first `length` rows of every layer's cache."""

    keys: list[Tensor]  # per layer [kv_heads, length, head_dim]; [kv_heads, head_dim, length] with keys_transposed
    values: list[Tensor]  # per layer [kv_heads, length, head_dim]
    keys_transposed: bool = False  # the kernel's key layout

    @property
    def length(self) -> int:
        return self.values[0].shape[1]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    def clone(self) -> CacheRows:
        """Copies of these rows (that outlive the cache they came from)."""
        return CacheRows([k.clone() for k in self.keys], [v.clone() for v in self.values], self.keys_transposed)

    def prefix(self, length: int) -> CacheRows:
        """The first `length` rows (views, not copies)."""
        if not 0 < length <= self.length:
            raise ValueError(f"cannot take {length} rows of {self.length}")
        keys = [k[..., :length] if self.keys_transposed else k[:, :length] for k in self.keys]
        return CacheRows(keys, [v[:, :length] for v in self.values], self.keys_transposed)
