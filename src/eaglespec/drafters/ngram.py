"""A corpus n-gram model as a stage-2 drafter (staged speculative decoding's second stage).

Built once from token sequences (text the draft model, or its family, wrote): for every context of two tokens the
most frequent next token (a trigram), and for every single token the most frequent next one (the bigram it backs
off to, Katz-style, when the two-token context was never seen). Guessing chains these argmaxes, which is what a
greedy draft model most often does after common code and prose fragments.

Stored as one safetensors file of sorted int64 context keys and int32 next tokens (16 bytes a context); looked up
with a binary search (`torch.searchsorted`), so loading is a memory map and a lookup costs a few microseconds.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from ..errors import CheckpointError

FORMAT = "eaglespec-ngram-1"


class NgramModel:
    """Trigram argmaxes with a bigram fallback over a vocabulary of `vocab_size` tokens."""

    def __init__(self, vocab_size: int, tri_keys: Tensor, tri_next: Tensor, bi_keys: Tensor, bi_next: Tensor):
        self.vocab_size = vocab_size
        self.tri_keys, self.tri_next = tri_keys, tri_next  # [C3] int64 sorted (a * V + b), [C3] int32
        self.bi_keys, self.bi_next = bi_keys, bi_next  # [C2] int64 sorted (a), [C2] int32

    # ---- building ------------------------------------------------------------------------------------
    @classmethod
    def build(cls, sequences: Iterable[list[int]], vocab_size: int, min_count: int = 2) -> "NgramModel":
        """Count every trigram and bigram of `sequences` and keep, per context seen at least `min_count` times with
        its best next token, that token (ties: the lowest id)."""
        firsts, seconds, thirds = [], [], []
        for seq in sequences:
            if len(seq) >= 2:
                arr = np.asarray(seq, dtype=np.int64)
                firsts.append(arr[:-1])
                seconds.append(arr[1:])
                thirds.append(np.append(arr[2:], -1))  # -1: no third token after the last pair
        if not firsts:
            raise ValueError("no sequence of two or more tokens to count")
        a, b, c = (np.concatenate(x) for x in (firsts, seconds, thirds))
        if int(max(a.max(), b.max())) >= vocab_size:
            raise ValueError(f"a token id is beyond the vocabulary of {vocab_size}")
        bi_keys, bi_next = _best_next(a, b, min_count)
        has_third = c >= 0
        tri_keys, tri_next = _best_next(a[has_third] * vocab_size + b[has_third], c[has_third], min_count)
        return cls(vocab_size, *(torch.from_numpy(x) for x in (tri_keys, tri_next, bi_keys, bi_next)))

    # ---- storing -------------------------------------------------------------------------------------
    def save(self, path: str | Path) -> None:
        from safetensors.torch import save_file

        save_file({"tri_keys": self.tri_keys, "tri_next": self.tri_next, "bi_keys": self.bi_keys,
                   "bi_next": self.bi_next}, str(path), metadata={"format": FORMAT, "vocab_size": str(self.vocab_size)})

    @classmethod
    def load(cls, path: str | Path) -> "NgramModel":
        from safetensors import SafetensorError, safe_open

        path = Path(os.path.expanduser(str(path)))
        if not path.is_file():
            raise CheckpointError(f"n-gram model '{path}' does not exist (build one with `eaglespec train ngram`)")
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                if meta.get("format") != FORMAT:
                    raise CheckpointError(f"'{path}' is not an eaglespec n-gram model (format {meta.get('format')})")
                tensors = {name: f.get_tensor(name) for name in ("tri_keys", "tri_next", "bi_keys", "bi_next")}
        except (SafetensorError, OSError, KeyError, ValueError) as exc:
            raise CheckpointError(f"could not read the n-gram model '{path}': {exc}") from exc
        return cls(int(meta["vocab_size"]), **tensors)

    # ---- guessing ------------------------------------------------------------------------------------
    @staticmethod
    def _lookup(keys: Tensor, values: Tensor, key: int) -> int | None:
        i = int(torch.searchsorted(keys, torch.tensor(key, dtype=torch.int64)))
        return int(values[i]) if i < keys.numel() and int(keys[i]) == key else None

    def next_token(self, a: int | None, b: int) -> int | None:
        """The most frequent token after (a, b), else after b, else None."""
        if a is not None:
            found = self._lookup(self.tri_keys, self.tri_next, a * self.vocab_size + b)
            if found is not None:
                return found
        return self._lookup(self.bi_keys, self.bi_next, b)

    def __call__(self, tokens: Tensor, length: int) -> list[int]:
        """Stage 2: up to `length` tokens continuing `tokens` [L] by the chained argmaxes."""
        seq = tokens[-2:].tolist()
        guess: list[int] = []
        while len(guess) < length and seq:
            nxt = self.next_token(seq[-2] if len(seq) > 1 else None, seq[-1])
            if nxt is None:
                break
            guess.append(nxt)
            seq.append(nxt)
        return guess

    @property
    def contexts(self) -> int:
        return self.tri_keys.numel() + self.bi_keys.numel()


def _best_next(context: np.ndarray, nxt: np.ndarray, min_count: int) -> tuple[np.ndarray, np.ndarray]:
    """Per distinct context (int64), its most frequent next token (ties: the lowest id) if the context occurs
    `min_count` times or more. Returns (sorted contexts int64, next tokens int32)."""
    pairs, counts = np.unique(np.stack([context, nxt], axis=1), axis=0, return_counts=True)  # sorted by context
    # within each context: the highest count first, then the lowest next token
    order = np.lexsort((pairs[:, 1], -counts, pairs[:, 0]))
    pairs, counts = pairs[order], counts[order]
    first = np.ones(len(pairs), dtype=bool)
    first[1:] = pairs[1:, 0] != pairs[:-1, 0]
    totals = np.add.reduceat(counts, np.flatnonzero(first))  # occurrences of each context
    keep = totals >= min_count
    return pairs[first, 0][keep].astype(np.int64), pairs[first, 1][keep].astype(np.int32)


class Stage2Chain:
    """Stage-2 drafters tried in order (say, the context's n-grams, then a corpus model): the first that guesses
    anything wins."""

    def __init__(self, stages):
        self.stages = list(stages)

    def __call__(self, tokens: Tensor, length: int) -> list[int]:
        for stage in self.stages:
            guess = stage(tokens, length)
            if guess:
                return guess
        return []
