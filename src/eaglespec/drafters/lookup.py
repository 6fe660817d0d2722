"""Prompt lookup decoding (PLD): draft by copying what followed the last n-gram the last time it appeared.

No model runs to draft: the committed tokens are searched for the most recent earlier occurrence of their own
last n tokens (n from `max_ngram` down to `min_ngram`), and the tokens that followed that occurrence are
proposed as a chain. It pays off when the answer repeats the prompt (code edits, extraction, summaries).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from ..spec.tree import DraftTree, chain
from .base import Drafter, TreeSettings

# a stage-2 drafter (staged decoding's second stage, or an EAGLE draft's continuation): (the tokens so far [L], how
# many to guess at most) -> guessed continuation (possibly empty)
Stage2 = Callable[[Tensor, int], list[int]]


def find_continuation(tokens: Tensor, max_ngram: int = 3, min_ngram: int = 1, length: int = 5) -> list[int]:
    """The up to `length` tokens that followed the most recent earlier occurrence of the last n-gram of
    `tokens` [L], trying n = max_ngram .. min_ngram; [] when no n-gram recurs.

    "Earlier" means the occurrence ends before the last token, so at least one continuation token exists."""
    total = tokens.numel()
    if length < 1:
        return []
    for n in range(max_ngram, min_ngram - 1, -1):
        if n < 1 or total < n + 1:
            continue
        suffix = tokens[total - n :]  # [n]
        windows = tokens[: total - 1].unfold(0, n, 1)  # [total - n, n]: every n-gram ending before the last token
        hits = (windows == suffix).all(dim=1).nonzero().flatten()
        if hits.numel():
            start = int(hits[-1]) + n  # first token after the most recent occurrence
            return tokens[start : start + length].tolist()
    return []


def context_lookup(max_ngram: int = 3, min_ngram: int = 1) -> Stage2:
    """Stage 2 from the context itself: what followed the most recent earlier occurrence of its last n-gram."""
    def guess(tokens: Tensor, length: int) -> list[int]:
        return find_continuation(tokens, max_ngram, min_ngram, length)

    return guess


class PromptLookupDrafter(Drafter):
    """Proposes a chain copied from earlier in the context (`depth` tokens at most, never more than
    `total_tokens - 1`); the root alone when nothing matches."""

    name = "pld"
    needs_features = False

    def __init__(self, settings: TreeSettings | None = None, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.settings = settings or TreeSettings()
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    @property
    def length(self) -> int:
        return min(self.settings.depth, self.settings.total_tokens - 1)

    def draft(self, tokens: Tensor, new_features: Tensor | None) -> DraftTree:
        tokens = tokens.cpu()
        proposal = find_continuation(tokens, self.max_ngram, self.min_ngram, self.length)
        return chain([int(tokens[-1])] + proposal)
