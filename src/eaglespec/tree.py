"""Draft trees as tensors: tokens, parents, depths -> position ids, the 4D ancestor mask, paths.

Node 0 is the root (the last committed token, not yet seen by the target). Parents always precede their
children, so every prefix of the node list is itself a tree.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

# The 26-node static tree of EAGLE-1 (top-k rank paths below the root; root not listed).
EAGLE1_CHOICES: list[list[int]] = [
    [0], [1], [2], [3], [0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [2, 0], [2, 1], [3, 0], [0, 0, 0], [0, 0, 1],
    [0, 0, 2], [0, 1, 0], [0, 1, 1], [0, 2, 0], [0, 2, 1], [1, 0, 0], [0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 0, 2],
    [0, 0, 0, 0, 0], [0, 0, 0, 0, 1],
]


@dataclass
class DraftTree:
    tokens: Tensor  # [N] long, node 0 = root
    parents: Tensor  # [N] long, parent node index, -1 for the root
    scores: Tensor | None = None  # [N] draft path log-prob (root 0), for ordering and statistics
    _children: list[list[int]] | None = field(default=None, repr=False)
    _depths: Tensor | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.tokens.shape != self.parents.shape or self.tokens.dim() != 1:
            raise ValueError("tokens and parents must be 1-D tensors of the same length")
        if int(self.parents[0]) != -1:
            raise ValueError("node 0 must be the root (parent -1)")
        idx = torch.arange(self.tokens.numel())
        if bool((self.parents[1:] >= idx[1:]).any()) or bool((self.parents[1:] < 0).any()):
            raise ValueError("every non-root node's parent must come before it")

    @classmethod
    def root_only(cls, token: int) -> "DraftTree":
        return cls(torch.tensor([token]), torch.tensor([-1]))

    def __len__(self) -> int:
        return self.tokens.numel()

    @property
    def depths(self) -> Tensor:
        """[N] distance from the root (root = 0), computed once per tree."""
        if self._depths is None:
            depth = [0] * len(self)
            for i, p in enumerate(self.parents.tolist()[1:], start=1):
                depth[i] = depth[p] + 1
            self._depths = torch.tensor(depth, dtype=torch.long)
        return self._depths

    def positions(self, start: int) -> Tensor:
        """[N] position ids: siblings share one, = start + depth."""
        return self.depths + start

    def ancestor_mask(self) -> Tensor:
        """[N, N] bool: row i is True at i and at every ancestor of i (what node i may attend to)."""
        n = len(self)
        mask = torch.zeros(n, n, dtype=torch.bool)
        parents = self.parents.tolist()
        mask[0, 0] = True
        for i in range(1, n):
            mask[i] = mask[parents[i]]
            mask[i, i] = True
        return mask

    def children(self) -> list[list[int]]:
        """children()[i] = node indices whose parent is i, in node order (= draft preference order)."""
        if self._children is None:
            kids: list[list[int]] = [[] for _ in range(len(self))]
            for i, p in enumerate(self.parents.tolist()):
                if p >= 0:
                    kids[p].append(i)
            self._children = kids
        return self._children

    def truncate_depth(self, max_depth: int) -> "DraftTree":
        """The subtree of nodes at most `max_depth` below the root."""
        keep = (self.depths <= max_depth).nonzero().flatten()  # ascending, so parents still precede children
        new_index = torch.full((len(self),), -1, dtype=torch.long)
        new_index[keep] = torch.arange(keep.numel())
        parents = self.parents[keep]
        parents = torch.where(parents >= 0, new_index[parents.clamp(min=0)], parents)
        scores = None if self.scores is None else self.scores[keep]
        return DraftTree(self.tokens[keep], parents, scores)

    def path(self, node: int) -> list[int]:
        """Node indices from the root to `node`, inclusive."""
        parents = self.parents.tolist()
        out = [node]
        while parents[out[-1]] >= 0:
            out.append(parents[out[-1]])
        return out[::-1]

    def leaf_paths(self) -> list[list[int]]:
        """Every root-to-leaf path (node indices)."""
        kids = self.children()
        return [self.path(i) for i in range(len(self)) if not kids[i]]


def chain(tokens: list[int]) -> DraftTree:
    """A single path: tokens[0] is the root."""
    n = len(tokens)
    return DraftTree(torch.tensor(tokens, dtype=torch.long), torch.arange(-1, n - 1, dtype=torch.long))


def validate_choices(choices: list[list[int]]) -> list[list[int]]:
    """Sort static-tree choices so parents precede children; reject lists with a missing parent."""
    ordered = sorted((list(c) for c in choices), key=lambda c: (len(c), c))
    seen = {()}
    for c in ordered:
        if not c or any(r < 0 for r in c):
            raise ValueError(f"invalid tree choice {c}: ranks must be non-negative and non-empty")
        if tuple(c[:-1]) not in seen:
            raise ValueError(f"tree choice {c} has no parent {c[:-1]} in the list")
        seen.add(tuple(c))
    return ordered
