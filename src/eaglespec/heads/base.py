"""What every draft head offers the drafter (EAGLE-1 and EAGLE-3 differ only behind these methods)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .config import HeadConfig
from .layer import KVCache, rope_tables


class DraftHead(nn.Module):
    """A one-layer draft model over the target's features.

    Step at position t: input (hidden h_t, token x_{t+1}) -> output hidden h'_{t+1}, whose logits predict x_{t+2}.
    For committed positions h_t comes from the target (`lift(features)`); inside a draft tree it is the output
    of the parent node's step.
    """

    config: HeadConfig

    def lift(self, features: Tensor) -> Tensor:
        """Target features [T, F] -> head hidden [T, d]."""
        raise NotImplementedError

    def step(self, hidden: Tensor, token_embeds: Tensor, positions: Tensor, cache: KVCache, mask: Tensor) -> Tensor:
        """hidden, token_embeds: [T, d]; positions: [T]; mask: [T, len(cache) + T] bool. Returns [T, d]."""
        raise NotImplementedError

    def logits(self, hidden: Tensor, target_lm_head: nn.Module) -> Tensor:
        """[T, d] -> [T, draft_vocab] log-space scores."""
        raise NotImplementedError

    def to_target_ids(self, draft_ids: Tensor) -> Tensor:
        """Map draft-vocabulary ids to target ids (identity for a full-vocabulary head)."""
        return draft_ids

    def new_cache(self) -> KVCache:
        return KVCache(num_layers=1)

    def rope(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        c = self.config
        return rope_tables(positions, c.head_dim, c.rope_theta, dtype)
