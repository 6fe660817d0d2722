"""Staged speculative decoding, its second stage (Spector and Re, 2023, arXiv 2308.04623): the draft model's own
autoregressive steps are speculated too.

`DraftModelDrafter` runs the draft model once per drafted token. Here a stage-2 drafter, with no model, guesses how
the draft model's chain goes on (the n-grams of the context: prompt lookup), and the draft model checks every
guess in one forward, as the target checks the draft model: its greedy token after each row is computed at once,
the guesses it agrees with are kept with its own next token as a bonus, and the rows of the rest are dropped. A
forward then adds 1 + accepted guesses to the chain instead of 1.

What the target sees is unchanged in kind: a chain of the draft model's greedy tokens (the same chain as
`DraftModelDrafter` wherever the draft model's multi-row steps give a row the bits of a one-token step, as they do
on eaglespec's CPU kernels), verified like any other draft, so the output stays exactly plain decoding's, or its
distribution when sampling. The stage costs only where guesses are wrong: a forward of 1 + g rows instead of 1.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ..spec.tree import DraftTree, chain
from ..targets.hf import TargetModel
from .base import TreeSettings
from .draft_model import DraftModelDrafter
from .lookup import find_continuation

# stage 2: (the tokens so far [L], how many to guess at most) -> guessed continuation (possibly empty)
Stage2 = Callable[[Tensor, int], list[int]]


def context_lookup(max_ngram: int = 3, min_ngram: int = 1) -> Stage2:
    """Stage 2 from the context itself: what followed the most recent earlier occurrence of its last n-gram."""
    def guess(tokens: Tensor, length: int) -> list[int]:
        return find_continuation(tokens, max_ngram, min_ngram, length)

    return guess


class StagedDrafter(DraftModelDrafter):
    """`DraftModelDrafter` whose draft model verifies stage-2 guesses (`stage2`, up to `guesses` a forward) instead
    of stepping one token at a time. Needs a draft target that can drop committed rows (the fast path); on another
    it drafts as `DraftModelDrafter` does."""

    name = "staged"

    def __init__(self, draft_target: TargetModel, settings: TreeSettings | None = None,
                 stage2: Stage2 | None = None, guesses: int = 4):
        super().__init__(draft_target, settings)
        if guesses < 1:
            raise ValueError(f"guesses must be at least 1, got {guesses}")
        self.stage2 = stage2 or context_lookup()
        self.guesses = guesses
        self.guessed = 0  # stage-2 tokens proposed so far
        self.guesses_accepted = 0  # of them, those the draft model agreed with

    def fork(self) -> "StagedDrafter":
        clone = super().fork()
        clone.guessed = clone.guesses_accepted = 0
        return clone

    def _extend(self, context: list[int], proposal: list[int], length: int) -> list[int]:
        """Run the last proposed token with stage 2's guesses after it in one forward; return the draft model's
        greedy tokens it confirms (1 + accepted guesses, at most `length - len(proposal)`)."""
        want = length - len(proposal)
        guess = self.stage2(torch.tensor(context + proposal), min(self.guesses, want - 1))[: max(want - 1, 0)]
        rows = proposal[-1:] + guess  # [1 + g]
        out = self.model.forward(torch.tensor(rows), greedy=True)
        greedy = out.greedy()  # the draft model's next token after each row
        accepted = 0
        while accepted < len(guess) and guess[accepted] == greedy[accepted]:
            accepted += 1
        # keep the rows of the last proposal and the accepted guesses (a prefix of the step: nothing moves)
        self.model.commit(torch.arange(accepted + 1))
        self.forwards += 1
        self.guessed += len(guess)
        self.guesses_accepted += accepted
        self.seen.extend(rows[: accepted + 1])
        return greedy[: accepted + 1]

    @torch.inference_mode()
    def draft(self, tokens: Tensor, new_features: Tensor | None) -> DraftTree:
        if not self.rolls_back:
            return super().draft(tokens, new_features)
        ids = tokens.tolist()
        root = ids[-1]
        length = min(self.length, self.model.max_context - len(ids))
        if length < 1:
            return DraftTree.root_only(root)
        start = self._sync(ids)
        proposal = [self._next(ids[start:], keep=True)]  # catch up on the committed tokens, root included
        while len(proposal) < length:
            proposal.extend(self._extend(ids, proposal, length))
        return chain([root] + proposal[:length])
