"""Prefix caching for the batch decoder: the target's KV-cache rows (and the features a draft head reads) of prompts
read before, so that a new prompt starting with the same tokens (a chat template's system prompt, a shared
instruction, an earlier turn of the conversation) reads only the rest.

Prompts are cut into blocks of `BLOCK` tokens; a stored prompt is reachable by every block-aligned prefix of it,
each keyed by a hash chained over its blocks (the hash of the prefix before it and the block's tokens), so a lookup
costs one pass over the prompt. A hit is checked token for token against the stored prompt (a hash collision can
only miss, never give another prompt's rows). The entries are kept least recently used first, within a budget of
bytes.

Exactness: a hit is used only where the pool reads prompts in pieces (`TargetPool.chunked_prefill`: the kernels give
a prompt row the same bits however the prompt is cut), so the rows copied in are bit for bit the rows reading the
prefix would compute, and every token after them is what reading the whole prompt gives.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from torch import Tensor

from ..targets.cache_rows import CacheRows

BLOCK = 8  # tokens per block: prefixes are reused in whole blocks
DEFAULT_BYTES = 256 * 2**20  # the cache's budget of stored rows


@dataclass
class Stored:
    """A prompt's first `rows.length` rows: its tokens, the target's cache rows (`FastTarget.cached_rows`) and the
    draft head's features [length, F] (None where the drafter reads none)."""

    tokens: tuple[int, ...]
    rows: CacheRows
    features: Tensor | None
    hashes: list[int] = field(default_factory=list)  # the chained hash of each of its blocks (the last is its key)
    nbytes: int = field(init=False)  # of its tensors, counted once: the budget adds and subtracts it

    def __post_init__(self) -> None:
        features = 0 if self.features is None else self.features.numel() * self.features.element_size()
        self.nbytes = self.rows.nbytes + features


@dataclass
class Hit:
    """`length` rows of a stored prompt that a new prompt starts with."""

    length: int
    rows: CacheRows
    features: Tensor | None


def _block_hashes(tokens: list[int], blocks: int) -> list[int]:
    """The chained hash of each of the first `blocks` blocks of `tokens`."""
    hashes, previous = [], 0
    for b in range(blocks):
        previous = hash((previous, tuple(tokens[b * BLOCK : (b + 1) * BLOCK])))
        hashes.append(previous)
    return hashes


class PrefixCache:
    """Stored prompts' rows by block-aligned prefix (module docstring), within `max_bytes`."""

    def __init__(self, max_bytes: int = DEFAULT_BYTES):
        if max_bytes < 0:
            raise ValueError(f"a prefix cache's budget must be 0 or more bytes, got {max_bytes}")
        self.max_bytes = max_bytes
        self.stored: OrderedDict[int, Stored] = OrderedDict()  # by the hash of its whole stored length, LRU first
        self.prefixes: dict[int, int] = {}  # a block-aligned prefix's hash -> the stored entry that holds it
        self.bytes = 0
        self.hits = 0  # lookups that found rows
        self.lookups = 0
        self.rows_reused = 0  # prompt rows not read thanks to the cache

    def lookup(self, prompt: list[int], needs_features: bool) -> Hit | None:
        """The longest block-aligned prefix of `prompt`, short of its last token (whose row must be read for the
        first token's logits), that a stored prompt starts with; None if none (or it lacks the features needed)."""
        self.lookups += 1
        blocks = (len(prompt) - 1) // BLOCK
        for b, h in reversed(list(enumerate(_block_hashes(prompt, blocks)))):
            key = self.prefixes.get(h)
            if key is None:
                continue
            entry, length = self.stored[key], (b + 1) * BLOCK
            if entry.tokens[:length] != tuple(prompt[:length]) or (needs_features and entry.features is None):
                continue
            self.stored.move_to_end(key)
            self.hits += 1
            self.rows_reused += length
            return Hit(length, entry.rows.prefix(length), None if entry.features is None else entry.features[:length])
        return None

    def blocks_to_store(self, prompt: list[int]) -> int:
        """Rows of `prompt` worth storing: its whole blocks short of the last token, 0 where a stored prompt already
        holds them all (or the budget is 0)."""
        blocks = (len(prompt) - 1) // BLOCK
        if blocks == 0 or self.max_bytes == 0:
            return 0
        last = _block_hashes(prompt, blocks)[-1]
        key = self.prefixes.get(last)
        if key is not None and self.stored[key].tokens[: blocks * BLOCK] == tuple(prompt[: blocks * BLOCK]):
            self.stored.move_to_end(key)
            return 0
        return blocks * BLOCK

    def store(self, prompt: list[int], rows: CacheRows, features: Tensor | None) -> None:
        """Keep the rows of the first `rows.length` (a whole number of blocks) tokens of `prompt`; the least recently
        used entries go to make room."""
        length = rows.length
        entry = Stored(tuple(prompt[:length]), rows, features)
        if length % BLOCK or entry.nbytes > self.max_bytes:
            return
        entry.hashes = hashes = _block_hashes(prompt, length // BLOCK)
        key = hashes[-1]
        if key in self.stored:
            self._drop(key)
        while self.stored and self.bytes + entry.nbytes > self.max_bytes:
            self._drop(next(iter(self.stored)))
        self.stored[key] = entry
        self.bytes += entry.nbytes
        for h in hashes:  # the newest entry holding a prefix answers for it
            self.prefixes[h] = key

    def clear(self) -> int:
        """Forget every stored prompt; returns the rows freed. (The entries go last: a reader on another thread that
        sees none sees the rest cleared too.)"""
        freed = sum(len(entry.tokens) for entry in self.stored.values())
        self.bytes = 0
        self.prefixes = {}
        self.stored = OrderedDict()
        return freed

    def _drop(self, key: int) -> None:
        entry = self.stored.pop(key)
        self.bytes -= entry.nbytes
        for h in entry.hashes:
            if self.prefixes.get(h) == key:
                del self.prefixes[h]
