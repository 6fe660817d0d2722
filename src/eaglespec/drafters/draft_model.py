"""Classic speculative sampling (SpS) with a smaller draft model that shares the target's tokenizer.

The draft model proposes a greedy chain of `depth` tokens; the target verifies it like any other draft tree (for
sampling too: the verifier's rejection rule treats the greedy chain as a deterministic proposal).

The caller builds the draft model's target with `targets.fast.make_target`, so a Llama / Qwen2 draft gets the same lean
forward, static KV cache and CPU kernels as the target (greedy steps through the kernels' greedy head, without full
logits); other architectures fall back to the generic transformers path.

Cache across rounds (fast path, which can `truncate` its cache): every drafted token is run once, as a one-token
step on top of the draft cache, and its row stays committed there. The next round rolls the cache back to the
longest prefix the target committed (accepted drafts keep their rows, rejected ones are dropped by shortening the
cache) and runs only what is missing, ending with the new root, whose row proposes the first draft token: one
forward per drafted token, `depth` per round.

Generic fallback (a model without `truncate`): the cache holds committed tokens only; each draft step runs the
drafted tokens so far on top of it and drops their rows again, and the next round recomputes the accepted drafts
from the common prefix.
"""

from __future__ import annotations

import copy
import time

import torch
from torch import Tensor

from ..spec.tree import DraftTree, chain
from ..targets.hf import TargetModel
from .base import Drafter, DraftWork, TreeSettings
from .chain_length import ChainLength, accepted_of

_EMPTY = torch.zeros(0, dtype=torch.long)


class DraftModelDrafter(Drafter):
    """Greedy chain drafts from a small causal LM sharing the target's tokenizer, run as a `TargetModel` without
    features (`make_target(draft_hf_model, feature_kind=None, exact=False)`: on the target's device and in its
    dtype; not exact, since a draft's bits only change which tokens are proposed, never the output)."""

    name = "sps"
    needs_features = False

    def __init__(self, draft_target: TargetModel, settings: TreeSettings | None = None, dynamic: bool = False):
        self.settings = settings or TreeSettings()
        self.model = draft_target
        # dynamic: each round's chain length by drafters.chain_length (at most `length`), else always `length`
        self.dynamic = dynamic
        # can drop committed rows: drafted tokens then stay in the cache instead of being re-run at every step
        self.rolls_back = callable(getattr(self.model, "truncate", None))
        self.forwards = 0  # draft-model forwards so far (each round's cost, for tests and benchmarks)
        self.forward_bytes = self.model.weight_bytes()  # weights one draft-model forward reads
        self.chain_length = ChainLength(self.length) if dynamic else None  # (kept across generations: its costs)
        self.reset()

    @property
    def length(self) -> int:
        """Drafted tokens per round (the chain below the root)."""
        return min(self.settings.depth, self.settings.total_tokens - 1)

    def fork(self) -> "DraftModelDrafter":
        """`Drafter.fork`: the draft model's weights shared, its own KV cache (a sibling target)."""
        clone = copy.copy(self)
        clone.model = self.model.sibling()
        clone.forwards = 0
        clone.chain_length = ChainLength(self.length) if self.dynamic else None  # its own, from scratch
        clone.reset()
        return clone

    def work(self) -> DraftWork:
        return DraftWork(self.forwards, self.forwards * self.forward_bytes)

    def reset(self) -> None:
        self.model.reset()
        self.seen: list[int] = []  # tokens whose KV rows are committed in the draft model's cache, in order
        self._last: tuple[int, list[int], float] | None = None  # last round: (context length, proposal, end time)

    def _round_length(self, ids: list[int], now: float) -> int:
        """This round's chain length; with `dynamic`, first tell `chain_length` how the last round went (its
        proposal against what the sequence committed since)."""
        if self.chain_length is None:
            return self.length
        if self._last is not None:
            start, proposal, ended = self._last
            committed = ids[start:]
            if 1 <= len(committed) <= len(proposal) + 1:  # one round since (not a plain round between)
                self.chain_length.observe_round(len(proposal), accepted_of(proposal, committed), now - ended)
        return self.chain_length.next()

    def _drafted(self, ids: list[int], proposal: list[int], started: float) -> None:
        if self.chain_length is not None:
            now = time.perf_counter()
            if self._last is not None:  # (a generation's first draft also reads the whole prompt: not a round's cost)
                self.chain_length.observe_draft(len(proposal), now - started)
            self._last = (len(ids), list(proposal), now)

    def _sync(self, tokens: list[int]) -> int:
        """Cut the cache back to its longest prefix shared with `tokens` minus its last token (so that one is always
        run, giving the first proposal); return that prefix's length."""
        common = 0
        limit = min(len(self.seen), len(tokens) - 1)
        while common < limit and self.seen[common] == tokens[common]:
            common += 1
        if common < len(self.seen):
            if self.rolls_back:  # rejected drafts (or another sequence): drop their rows, keep the shared prefix
                self.model.truncate(common)
                del self.seen[common:]
            else:  # the generic cache cannot drop committed rows: start over
                self.reset()
                common = 0
        return common

    def _next(self, tokens: list[int], keep: bool) -> int:
        """Run `tokens` on top of the cache and return the greedy token after the last one; `keep`: commit their
        rows (else drop them)."""
        out = self.model.forward(torch.tensor(tokens), logits_rows=slice(-1, None), greedy=True)
        self.model.commit(None if keep else _EMPTY)
        self.forwards += 1
        if keep:
            self.seen.extend(tokens)
        return out.greedy()[-1]

    @torch.inference_mode()
    def draft(self, tokens: Tensor, new_features: Tensor | None) -> DraftTree:
        started = time.perf_counter()
        ids = tokens.tolist()
        root = ids[-1]
        room = self.model.max_context - len(ids)  # draft positions still inside the draft model's context
        length = min(self._round_length(ids, started), room)
        if length < 1:
            return DraftTree.root_only(root)
        start = self._sync(ids)
        proposal = [self._next(ids[start:], keep=True)]  # catch up on the committed tokens, root included
        while len(proposal) < length:
            if self.rolls_back:  # one token on top of the cache; its row stays until the target rejects it
                proposal.append(self._next(proposal[-1:], keep=True))
            else:  # every drafted token so far on top of the committed prefix, rows dropped again
                proposal.append(self._next(proposal, keep=False))
        self._drafted(ids, proposal, started)
        return chain([root] + proposal)
