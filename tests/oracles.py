"""Test drafters that know the target's greedy continuation (so acceptance is predictable)."""

from __future__ import annotations

import torch

from eaglespec.drafters import Drafter
from eaglespec.spec.tree import DraftTree, chain


class OracleChain(Drafter):
    """Proposes the next `depth` tokens of a known greedy continuation: everything is accepted."""

    name = "oracle-chain"

    def __init__(self, prompt_len: int, continuation: list[int], depth: int):
        self.prompt_len, self.continuation, self.depth = prompt_len, continuation, depth

    def draft(self, tokens: torch.Tensor, new_features) -> DraftTree:
        done = tokens.numel() - self.prompt_len  # generated so far, root included
        return chain([int(tokens[-1])] + self.continuation[done : done + self.depth])


class OracleTreeWithDecoys(Drafter):
    """A tree where the true next token is always the *second* child and the first child is a decoy with its own
    decoy subtree; the true path runs `depth` levels deep. Verification must find it among the branches, and the KV
    commit must gather non-contiguous rows."""

    name = "oracle-tree"

    def __init__(self, prompt_len: int, continuation: list[int], depth: int, vocab: int):
        self.prompt_len, self.continuation, self.depth, self.vocab = prompt_len, continuation, depth, vocab

    def draft(self, tokens: torch.Tensor, new_features) -> DraftTree:
        done = tokens.numel() - self.prompt_len
        truth = self.continuation[done : done + self.depth]
        toks, parents = [int(tokens[-1])], [-1]
        parent = 0
        for t in truth:
            decoy = (t + 1) % self.vocab
            toks += [decoy, t, (t + 2) % self.vocab]  # decoy child, true child, grandchild under the decoy
            parents += [parent, parent, len(toks) - 3]
            parent = len(toks) - 2
        return DraftTree(torch.tensor(toks), torch.tensor(parents))


def tree_rows_and_steps(target, prompt: torch.Tensor, path: list[int], decoys: tuple[int, int] = (11, 5)):
    """Verify a small branching tree after `prompt`, then decode `path` one token at a time from the same prefix.

    Tree rows: 0 = path[0] (root), 1 = decoys[0] (child of 0), 2 = path[1] (child of 0), 3 = path[2] (child of 2),
    4 = decoys[1] (child of 1): rows 2 and 3 see non-contiguous cache rows. Returns (the tree's logits at rows
    0, 2, 3, the one-token steps' logits for path[0..2], a chain verify's logits for path): [3, V] each."""
    parents = [-1, 0, 0, 2, 1]
    mask = torch.zeros(5, 5, dtype=torch.bool)
    for r in range(5):
        p = r
        while p >= 0:
            mask[r, p], p = True, parents[p]
    c = prompt.numel()

    def fresh():
        target.reset()
        target.forward(prompt)
        target.commit()

    fresh()
    tokens = torch.tensor([path[0], decoys[0], path[1], path[2], decoys[1]])
    tree = target.forward(tokens, torch.tensor([c, c + 1, c + 1, c + 2, c + 2]), mask).logits[[0, 2, 3]]
    target.commit(torch.zeros(0, dtype=torch.long))
    steps = []
    for i, token in enumerate(path[:3]):
        steps.append(target.forward(torch.tensor([token]), torch.tensor([c + i]), mask[:1, :1]).logits[0])
        target.commit()
    fresh()
    chain_logits = target.forward(torch.tensor(path[:3]), torch.arange(c, c + 3),
                                  torch.ones(3, 3, dtype=torch.bool).tril()).logits
    target.commit()
    return tree, torch.stack(steps), chain_logits
