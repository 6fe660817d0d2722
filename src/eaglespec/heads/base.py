"""What every draft head offers the drafter (EAGLE-1 and EAGLE-3 differ only behind these methods)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .config import HeadConfig
from .layer import DecoderLayer, KVCache, rope_tables


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

    def layer_inputs(self, hidden: Tensor, token_embeds: Tensor) -> tuple[Tensor, Tensor]:
        """(attention input [..., d_in], residual [..., d]) of the decoder layer for these inputs [..., d]."""
        raise NotImplementedError

    def decoder_layer(self) -> DecoderLayer:
        raise NotImplementedError

    def step(self, hidden: Tensor, token_embeds: Tensor, positions: Tensor, cache: KVCache, mask: Tensor) -> Tensor:
        """hidden, token_embeds: [T, d]; positions: [T]; mask: [T, len(cache) + T] bool. Returns [T, d]."""
        x, residual = self.layer_inputs(hidden, token_embeds)
        return self.decoder_layer()(x, residual, self.rope(positions, x.dtype), cache, 0, mask)

    def forward(self, features: Tensor, next_embeds: Tensor, steps: int) -> list[Tensor]:
        """Training entry point (what `accelerate` / DDP wrap): `unroll(lift(features), next_embeds, steps)`."""
        return self.unroll(self.lift(features), next_embeds, steps)

    def unroll(self, hidden: Tensor, next_embeds: Tensor, steps: int) -> list[Tensor]:
        """Training / evaluation forward over a batch of whole sequences, `steps` draft steps deep.

        hidden: [B, T, d] head hidden of slot t from the target (`lift(features)`, f_t); next_embeds: [B, T, d]
        embedding of token x_{t+1}. Step j (0-based) of slot t reads x_{t+1+j} and, for j >= 1, the head's own
        output of step j-1 at that slot, sits at position t + j, and attends to the real prefix (step-0 keys of
        slots <= t) and its own earlier steps at slot t: exactly what a depth-j draft node sees at inference.
        Its output predicts x_{t+2+j}. Slots past the end read zero embeddings; mask them in the loss.
        Returns one [B, T, d] output per step.
        """
        b, t, _ = hidden.shape
        layer = self.decoder_layer()
        positions = torch.arange(t, device=hidden.device)
        outputs: list[Tensor] = []
        prefix: tuple[Tensor, Tensor] | None = None
        diagonal: list[tuple[Tensor, Tensor]] = []
        for j in range(steps):
            embeds = next_embeds if j == 0 else torch.cat(
                [next_embeds[:, j:], next_embeds.new_zeros(b, j, next_embeds.shape[-1])], 1)
            x, residual = self.layer_inputs(hidden, embeds)
            out, kv = layer.forward_unrolled(x, residual, self.rope(positions + j, x.dtype), prefix, diagonal)
            if prefix is None:
                prefix = kv
            else:
                diagonal.append(kv)
            outputs.append(out)
            hidden = out
        return outputs

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
