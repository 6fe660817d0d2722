"""The EAGLE-3 reduced draft vocabulary: the most frequent target tokens of the training answers."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..errors import EagleSpecError
from .data import Example


def token_counts(examples: Iterable[Example], vocab_size: int) -> torch.Tensor:
    """How often each target token id occurs among the loss-masked (assistant) tokens: [V] long."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ex in examples:
        ids = ex.input_ids[ex.loss_mask]
        counts += torch.bincount(ids, minlength=vocab_size)[:vocab_size]
    return counts


def select_draft_vocab(counts: torch.Tensor, draft_vocab_size: int) -> torch.Tensor:
    """The `draft_vocab_size` most frequent ids (ties broken by lower id), ascending: [Vd] long. When fewer
    distinct tokens occur, the rest is filled with the lowest unused ids so the size is exact."""
    vocab_size = counts.numel()
    if not 0 < draft_vocab_size <= vocab_size:
        raise EagleSpecError(f"draft vocabulary size must be in 1..{vocab_size}, got {draft_vocab_size}")
    if int(counts.sum()) == 0:
        raise EagleSpecError("no assistant tokens to choose a draft vocabulary from")
    # Stable sort on -count keeps lower ids first among equal counts.
    order = torch.sort(-counts, stable=True).indices
    return torch.sort(order[:draft_vocab_size]).values


def coverage(counts: torch.Tensor, target_ids: torch.Tensor) -> float:
    """Fraction of counted tokens that the draft vocabulary contains."""
    total = int(counts.sum())
    return float(counts[target_ids].sum()) / total if total else 0.0
