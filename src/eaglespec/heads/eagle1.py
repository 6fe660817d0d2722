"""EAGLE-1 head: fc(concat(embed(x_{t+1}), f_t)) -> one decoder layer (no input norm) -> predicted feature;
token logits through the target's frozen LM head."""

from __future__ import annotations

import torch
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

    def lift(self, features: Tensor) -> Tensor:
        return features  # the target's post-norm last hidden state is already the head's hidden

    def layer_inputs(self, hidden: Tensor, token_embeds: Tensor) -> tuple[Tensor, Tensor]:
        x = self.fc(torch.cat([token_embeds, hidden], dim=-1))  # [..., d], embedding first as in EAGLE
        return x, x

    def decoder_layer(self) -> DecoderLayer:
        return self.layers[0]

    def logits(self, hidden: Tensor, target_lm_head: nn.Module) -> Tensor:
        return target_lm_head(hidden)
