"""EAGLE-1 head: fc(concat(embed(x_{t+1}), f_t)) -> one decoder layer (no input norm) -> predicted feature;
token logits through the target's frozen LM head, optionally restricted to a frequency-ranked subset of the
vocabulary (`set_draft_vocab`): on a small model the full-vocabulary LM head dominates a draft step, and the subset
only changes which tokens the draft may propose, never what the target accepts."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .base import DraftHead
from .config import HeadConfig
from .layer import DecoderLayer


class Eagle1Head(DraftHead):
    def __init__(self, config: HeadConfig):
        super().__init__()
        self.config = config
        d = config.hidden_size
        self.fc = nn.Linear(2 * d, d, bias=config.bias)
        self.layers = nn.ModuleList([DecoderLayer(config.layer_shape())])
        # Target ids the draft scores ([Vd] long), None = the full vocabulary. Not part of the published weights.
        self.register_buffer("vocab_ids", None, persistent=False)
        # ((weight storage, dtype, packer), [T, d] -> [T, Vd] product with the LM head's rows of the draft vocabulary)
        self._rows: tuple[tuple, Callable[[Tensor], Tensor]] | None = None
        # How those rows are packed in inference mode: None = a plain product; the CPU backend sets oneDNN packing or
        # eaglespec's kernels (eaglespec.backends.cpu.apply.eagle_drafter)
        self.pack_rows: Callable[[Tensor, Tensor | None], Callable[[Tensor], Tensor]] | None = None

    def set_draft_vocab(self, target_ids: Tensor | None) -> None:
        """Draft over these target token ids only ([Vd] long), or over the full vocabulary (None)."""
        if target_ids is not None:
            target_ids = target_ids.long().flatten()
            if target_ids.numel() == 0 or int(target_ids.min()) < 0 or int(target_ids.max()) >= self.config.vocab_size:
                raise ValueError(f"draft vocabulary ids must lie in 0..{self.config.vocab_size - 1}")
            target_ids = target_ids.to(next(self.parameters()).device)  # (fc may be packed: no .weight)
        self.vocab_ids = target_ids
        self._rows = None

    @property
    def draft_vocab_size(self) -> int:
        return self.config.vocab_size if self.vocab_ids is None else self.vocab_ids.numel()

    def lift(self, features: Tensor) -> Tensor:
        return features  # the target's post-norm last hidden state is already the head's hidden

    def layer_inputs(self, hidden: Tensor, token_embeds: Tensor) -> tuple[Tensor, Tensor]:
        x = self.fc(torch.cat([token_embeds, hidden], dim=-1))  # [..., d], embedding first as in EAGLE
        return x, x

    def decoder_layer(self) -> DecoderLayer:
        return self.layers[0]

    def logits(self, hidden: Tensor, target_lm_head: nn.Module) -> Tensor:
        """[T, d] -> [T, Vd] (Vd = V without a draft vocabulary). In inference mode on a CPU the rows are packed
        once with `pack_rows` (set by the CPU backend: its kernel or oneDNN): a draft step multiplies a few rows,
        where that is 2-3x faster than torch's product."""
        weight = target_lm_head.weight  # [V, d]
        pack = self._row_packer(weight)
        if self.vocab_ids is None and pack is None:
            return target_lm_head(hidden)
        key = (weight.data_ptr(), weight.dtype, pack)
        if self._rows is None or self._rows[0] != key:
            bias = getattr(target_lm_head, "bias", None)
            rows, bias = weight.detach(), None if bias is None else bias.detach()  # [V, d], [V]
            if self.vocab_ids is not None:
                rows, bias = rows.index_select(0, self.vocab_ids), None if bias is None else bias[self.vocab_ids]
            project = pack(rows, bias) if pack is not None else partial(F.linear, weight=rows.contiguous(), bias=bias)
            self._rows = (key, project)
        return self._rows[1](hidden)

    def _row_packer(self, weight: Tensor) -> Callable[[Tensor, Tensor | None], Callable[[Tensor], Tensor]] | None:
        """How to pack the LM head's rows for this call: only in inference mode (training needs their gradient
        path), with `pack_rows` where the backend set it, else not at all."""
        return self.pack_rows if torch.is_inference_mode_enabled() else None

    def share_packed_lm_head(self, weight: Tensor, project: Callable[[Tensor], Tensor]) -> None:
        """Draft over the full vocabulary with the target's own packed LM head (`project`, packed from `weight`)
        instead of packing a second copy of it. A later set_draft_vocab drops it."""
        if self.vocab_ids is None and self.pack_rows is not None:
            self._rows = ((weight.data_ptr(), weight.dtype, self.pack_rows), project)

    def to_target_ids(self, draft_ids: Tensor) -> Tensor:
        return draft_ids if self.vocab_ids is None else self.vocab_ids[draft_ids]
