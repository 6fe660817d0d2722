"""EAGLE-3 head: fused low/mid/high target features, a layer fed concat(norm(embed), norm(hidden)), its own
norm + LM head over a reduced draft vocabulary (target id = draft id + d2t[draft id])."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .base import DraftHead
from .config import HeadConfig
from .layer import DecoderLayer, RMSNorm


class FusedInputLayer(DecoderLayer):
    """The EAGLE-3 `midlayer`: normalises the token embedding and the hidden state separately, then attends
    over their concatenation (2d); the residual stream is the hidden state."""

    def __init__(self, config: HeadConfig):
        super().__init__(config.layer_shape())
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def fuse(self, token_embeds: Tensor, hidden: Tensor) -> Tensor:
        return torch.cat([self.input_layernorm(token_embeds), self.hidden_norm(hidden)], dim=-1)  # [T, 2d]


class Eagle3Head(DraftHead):
    def __init__(self, config: HeadConfig):
        super().__init__()
        if not config.draft_vocab_size:
            raise ValueError("an EAGLE-3 head needs draft_vocab_size")
        self.config = config
        d = config.hidden_size
        self.fc = nn.Linear(3 * d, d, bias=False)
        self.midlayer = FusedInputLayer(config)
        self.norm = RMSNorm(d, config.rms_norm_eps)
        self.lm_head = nn.Linear(d, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))  # [Vd]
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))  # [V]

    def set_vocab(self, target_ids: Tensor) -> None:
        """Use these target token ids (ascending) as the draft vocabulary."""
        target_ids = torch.sort(target_ids.long()).values
        if target_ids.numel() != self.config.draft_vocab_size:
            raise ValueError("need exactly draft_vocab_size ids")
        self.d2t.copy_(target_ids - torch.arange(target_ids.numel()))
        self.t2d.zero_()
        self.t2d[target_ids] = True

    def lift(self, features: Tensor) -> Tensor:
        return self.fc(features)  # [T, 3d] -> [T, d]

    def layer_inputs(self, hidden: Tensor, token_embeds: Tensor) -> tuple[Tensor, Tensor]:
        return self.midlayer.fuse(token_embeds, hidden), hidden  # [..., 2d] attention input, [..., d] residual

    def decoder_layer(self) -> DecoderLayer:
        return self.midlayer

    def logits(self, hidden: Tensor, target_lm_head: nn.Module) -> Tensor:
        return self.lm_head(self.norm(hidden))  # [T, Vd]

    def to_target_ids(self, draft_ids: Tensor) -> Tensor:
        return draft_ids + self.d2t[draft_ids]
