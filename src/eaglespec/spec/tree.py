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
    # tokens, parents and depths as Python lists, made once: the decoding loop reads them on every step, and
    # each tensor round trip costs microseconds that add up on a ~10 ms step
    _lists: tuple[list[int], list[int], list[int]] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self._lists is not None:  # from_lists checked them
            return
        if self.tokens.shape != self.parents.shape or self.tokens.dim() != 1:
            raise ValueError("tokens and parents must be 1-D tensors of the same length")
        if int(self.parents[0]) != -1:
            raise ValueError("node 0 must be the root (parent -1)")
        idx = torch.arange(self.tokens.numel())
        if bool((self.parents[1:] >= idx[1:]).any()) or bool((self.parents[1:] < 0).any()):
            raise ValueError("every non-root node's parent must come before it")

    @classmethod
    def from_lists(cls, tokens: list[int], parents: list[int], scores: list[float] | None = None) -> "DraftTree":
        """A tree from Python lists (what drafters build), checked on the lists."""
        if len(tokens) != len(parents) or not tokens:
            raise ValueError("tokens and parents must be non-empty lists of the same length")
        if parents[0] != -1:
            raise ValueError("node 0 must be the root (parent -1)")
        depths = [0] * len(parents)
        for i in range(1, len(parents)):
            p = parents[i]
            if not 0 <= p < i:
                raise ValueError("every non-root node's parent must come before it")
            depths[i] = depths[p] + 1
        return cls(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long),
                   None if scores is None else torch.tensor(scores), _lists=(list(tokens), list(parents), depths))

    @classmethod
    def root_only(cls, token: int) -> "DraftTree":
        return cls.from_lists([token], [-1])

    def __len__(self) -> int:
        return self.tokens.numel()

    def _as_lists(self) -> tuple[list[int], list[int], list[int]]:
        if self._lists is None:
            parents = self.parents.tolist()
            depths = [0] * len(parents)
            for i in range(1, len(parents)):
                depths[i] = depths[parents[i]] + 1
            self._lists = (self.tokens.tolist(), parents, depths)
        return self._lists

    def token_list(self) -> list[int]:
        """The node tokens as a list (made once)."""
        return self._as_lists()[0]

    @property
    def max_depth(self) -> int:
        return max(self._as_lists()[2])

    @property
    def depths(self) -> Tensor:
        """[N] distance from the root (root = 0), computed once per tree."""
        if self._depths is None:
            self._depths = torch.tensor(self._as_lists()[2], dtype=torch.long)
        return self._depths

    def positions(self, start: int) -> Tensor:
        """[N] position ids: siblings share one, = start + depth."""
        return self.depths + start

    def ancestor_mask(self) -> Tensor:
        """[N, N] bool: row i is True at i and at every ancestor of i (what node i may attend to)."""
        parents = self._as_lists()[1]
        n = len(parents)
        seen: list[list[int]] = []  # seen[i]: node i's ancestors and itself
        rows: list[int] = []
        for i in range(n):
            seen.append((seen[parents[i]] if i else []) + [i])
            rows += [i] * len(seen[i])
        mask = torch.zeros(n, n, dtype=torch.bool)
        mask[rows, [j for path in seen for j in path]] = True
        return mask

    def children(self) -> list[list[int]]:
        """children()[i] = node indices whose parent is i, in node order (= draft preference order)."""
        if self._children is None:
            kids: list[list[int]] = [[] for _ in range(len(self))]
            for i, p in enumerate(self._as_lists()[1]):
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

    def prune(self, size: int) -> "DraftTree":
        """The best `size` nodes (root included): by path score where the tree has scores (a child never outscores
        its parent, and ties keep the earlier node, so they form a tree), else the first `size` nodes (a prefix
        of the node list is a tree). Node order is kept."""
        if size >= len(self):
            return self
        tokens, parents, _ = self._as_lists()
        if self.scores is None or size < 2:
            chosen = list(range(max(size, 1)))
        else:
            scores = self.scores.tolist()
            best = sorted(range(1, len(tokens)), key=lambda i: (-scores[i], i))[: size - 1]
            chosen = [0] + sorted(best)
        index = {old: new for new, old in enumerate(chosen)}
        if any(parents[i] not in index for i in chosen[1:]):
            raise ValueError("the pruned nodes do not form a tree: a child scores above its parent")
        return DraftTree.from_lists([tokens[i] for i in chosen], [-1] + [index[parents[i]] for i in chosen[1:]],
                                    None if self.scores is None else [float(self.scores[i]) for i in chosen])

    def path(self, node: int) -> list[int]:
        """Node indices from the root to `node`, inclusive."""
        parents = self._as_lists()[1]
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
    return DraftTree.from_lists(list(tokens), list(range(-1, len(tokens) - 1)))


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
