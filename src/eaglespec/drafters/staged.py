"""Staged speculative decoding, its second stage (Spector and Re, 2023, arXiv 2308.04623): the draft model's own
autoregressive steps are speculated too.

`DraftModelDrafter` runs the draft model once per drafted token. Here a stage-2 drafter, with no model, guesses how
the draft model's chain goes on (the n-grams of the context: prompt lookup), and the draft model checks every
guess in one forward, as the target checks the draft model: its greedy token after each row is computed at once,
the guesses it agrees with are kept with its own next token as a bonus, and the rows of the rest are dropped. A
forward then adds 1 + accepted guesses to the chain instead of 1. A round's first forward, which runs what the draft
model has not seen of the committed sequence (the root, and the last accepted draft where the whole chain was),
carries guesses too, so a round whose guesses are right costs one draft-model forward.

What the target sees is unchanged in kind: a chain of the draft model's greedy tokens (the same chain as
`DraftModelDrafter` wherever the draft model's multi-row steps give a row the bits of a one-token step, as they do
on eaglespec's CPU kernels), verified like any other draft, so the output stays exactly plain decoding's, or its
distribution when sampling. The stage costs only where guesses are wrong: a forward of 1 + g rows instead of 1.

The first stage's speculative batch is a tree, the paper's other idea (with `top_k` > 1 in the tree settings, the
default): the draft model's greedy chain is its spine, and every row that chose a chain token also ranks the draft
model's other likely tokens there. Each of them is a leaf hanging off the chain one level up, the branch the target
takes when it rejects the chain's token at that depth. Chain nodes and leaves compete for the `total_tokens` node
budget by draft path probability (as EAGLE-2's reranking does): a leaf scores the chain's probability down to its
parent times its own, so branching happens where the draft model is uncertain and where the chain is likely to be
reached. The leaves cost no draft-model forward, only the draft model's full logits for the rows that chose chain
tokens, and the target verifies them in the same pass. `top_k` = 1 drafts the bare chain.
"""

from __future__ import annotations

import dataclasses
import time

import torch
from torch import Tensor

from ..spec.tree import DraftTree, chain
from ..targets.hf import TargetModel
from .base import DraftWork, TreeSettings
from .draft_model import DraftModelDrafter
from .lookup import Stage2, context_lookup

# the draft model's likeliest tokens after one row: (log-probabilities [k], token ids [k]), the likeliest first
Ranked = tuple[list[float], list[int]]


class StagedDrafter(DraftModelDrafter):
    """`DraftModelDrafter` whose draft model verifies stage-2 guesses (`stage2`, up to `guesses` a forward) instead
    of stepping one token at a time. Needs a draft target that can drop committed rows (the fast path); on another
    it drafts as `DraftModelDrafter` does."""

    name = "staged"

    def __init__(self, draft_target: TargetModel, settings: TreeSettings | None = None,
                 stage2: Stage2 | None = None, guesses: int = 4, dynamic: bool = False):
        super().__init__(draft_target, settings, dynamic)
        if guesses < 1:
            raise ValueError(f"guesses must be at least 1, got {guesses}")
        self.stage2 = stage2 or context_lookup()
        self.guesses = guesses
        self.guessed = 0  # stage-2 tokens proposed so far
        self.guesses_accepted = 0  # of them, those the draft model agreed with
        # the draft model's likely tokens after every row that chose a chain token, for the tree's leaves:
        # (log-probabilities [k], token ids [k]) in chain order; empty when drafting bare chains (top_k = 1)
        self._ranked: list[Ranked] = []

    @property
    def branches(self) -> int:
        """Tokens ranked at each chain position (the chain's own and top_k - 1 alternatives); 1 = a bare chain."""
        return self.settings.top_k if self.settings.choices is None else 1

    def _run(self, rows: list[int], logits_rows: slice | None = None) -> tuple[list[int], list[Ranked]]:
        """Forward `rows` on top of the draft cache; return the draft model's greedy token after each row of
        `logits_rows` (all rows by default) and, when growing trees, its top tokens there (else an empty list)."""
        out = self.model.forward(torch.tensor(rows), logits_rows=logits_rows, greedy=self.branches == 1)
        if self.branches == 1:
            return out.greedy(), []
        logp = torch.log_softmax(out.logits, dim=-1)  # [r, V] float32
        top = torch.topk(logp, min(self.branches, logp.shape[-1]), dim=-1)  # [r, k], the argmax first
        return top.indices[:, 0].tolist(), list(zip(top.values.tolist(), top.indices.tolist()))

    def work(self) -> DraftWork:
        return dataclasses.replace(super().work(), guessed=self.guessed, guesses_accepted=self.guesses_accepted)

    def fork(self) -> "StagedDrafter":
        clone = super().fork()
        clone.guessed = clone.guesses_accepted = 0
        return clone

    def _step(self, context: list[int], tokens: list[int], want: int) -> list[int]:
        """One draft-model forward: `tokens`, the end of `context` the cache lacks (a round's first forward: the
        committed tokens not yet run, the root last; later ones: the last proposed token), then stage 2's guesses of
        how the draft model goes on after them. Keep the rows of `tokens` and of the accepted guesses; return the
        draft model's greedy tokens the forward confirms: its next token, one per accepted guess (at most `want`)."""
        guess = self.stage2(torch.tensor(context), min(self.guesses, want - 1))[: max(want - 1, 0)]
        missing = len(tokens)
        # the draft model's next token after the last of `tokens` and after each guess
        greedy, ranks = self._run(tokens + guess, logits_rows=slice(missing - 1, None))  # [1 + g]
        accepted = 0
        while accepted < len(guess) and guess[accepted] == greedy[accepted]:
            accepted += 1
        self.model.commit(torch.arange(missing + accepted))  # (a prefix of the step: nothing moves)
        self.forwards += 1
        self.guessed += len(guess)
        self.guesses_accepted += accepted
        self.seen.extend(tokens + guess[:accepted])
        self._ranked.extend(ranks[: accepted + 1])
        return greedy[: accepted + 1]

    @torch.inference_mode()
    def draft(self, tokens: Tensor, new_features: Tensor | None) -> DraftTree:
        if not self.rolls_back:
            return super().draft(tokens, new_features)
        started = time.perf_counter()
        ids = tokens.tolist()
        root = ids[-1]
        length = min(self._round_length(ids, started), self.model.max_context - len(ids))
        if length < 1:
            return DraftTree.root_only(root)
        start = self._sync(ids)
        self._ranked = []
        proposal = self._step(ids, ids[start:], length)  # what the cache lacks, the root last, and guesses
        while len(proposal) < length:
            proposal.extend(self._step(ids + proposal, proposal[-1:], length - len(proposal)))
        proposal = proposal[:length]
        self._drafted(ids, proposal, started)
        if self.branches == 1:
            return chain([root] + proposal)
        return branched_chain(root, proposal, self._ranked[:length], self.settings.total_tokens)


def branched_chain(root: int, proposal: list[int], ranked: list[Ranked], total_tokens: int) -> DraftTree:
    """The draft tree of a chain and its alternatives: `proposal` [D] the chain below `root`; `ranked[i]`
    (log-probabilities, tokens) the draft model's likely tokens at chain depth i + 1 (after the root and
    proposal[:i]). Chain node i scores sum(log q(proposal[j]), j <= i); an alternative at depth i + 1 hangs off
    chain node i - 1 (the root for i = 0) and scores that node's score plus its own log q. The best
    `total_tokens - 1` nodes are kept. A node never outscores its parent and ties go to the shallower node, so
    the kept nodes form a tree. Children are listed chain first, then alternatives from the likeliest."""
    candidates: list[tuple[float, int, int, int]] = []  # (score, depth, rank: 0 = the chain's token, token)
    score = 0.0
    for depth, (token, (logps, tokens)) in enumerate(zip(proposal, ranked), start=1):
        chain_logp = next((lp for lp, t in zip(logps, tokens) if t == token), None)
        if chain_logp is None:  # the chain's token was not among the ranked ones (a tie at the top): keep the chain
            chain_logp = logps[0]
        alternatives = [(lp, t) for lp, t in zip(logps, tokens) if t != token]
        for rank, (lp, t) in enumerate(alternatives, start=1):
            candidates.append((score + lp, depth, rank, t))
        score += chain_logp
        candidates.append((score, depth, 0, token))
    kept = sorted(candidates, key=lambda c: (-c[0], c[1], c[2]))[: max(total_tokens - 1, 0)]
    kept.sort(key=lambda c: (c[1], c[2]))  # by depth, the chain's node first: parents precede children
    tokens, parents, scores = [root], [-1], [0.0]
    chain_nodes = [0]  # node index of the chain's node at each depth placed so far (the root at depth 0)
    for score, depth, rank, token in kept:
        parents.append(chain_nodes[depth - 1])  # placed already: it outscores its children, or ties shallower
        tokens.append(token)
        scores.append(score)
        if rank == 0:
            chain_nodes.append(len(tokens) - 1)
    return DraftTree.from_lists(tokens, parents, scores)
