"""Test drafters that know the target's greedy continuation (so acceptance is predictable)."""

from __future__ import annotations

import torch

from eaglespec.drafters import Drafter
from eaglespec.tree import DraftTree, chain


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
