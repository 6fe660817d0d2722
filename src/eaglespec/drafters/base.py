"""The drafting interface the verifier does not look behind (`Drafter`), the tree settings, and `VanillaDrafter`,
which proposes nothing (root only), so plain decoding runs through the very same loop."""

from __future__ import annotations

import copy
from dataclasses import astuple, dataclass

from torch import Tensor

from ..errors import EagleSpecError
from ..spec.tree import DraftTree

METHODS = ("eagle2", "eagle1", "chain", "vanilla", "pld", "sps", "staged")
HEAD_METHODS = ("eagle2", "eagle1", "chain")  # methods that draft with an EAGLE head
DRAFT_MODEL_METHODS = ("sps", "staged")  # methods that draft with a smaller model sharing the tokenizer


@dataclass(frozen=True)
class DraftWork:
    """What a drafter has done since it was made (cumulative; subtract two to get a generation's share)."""

    forwards: int = 0  # forwards of its draft model or head
    weight_bytes: int = 0  # bytes of weights those forwards read (targets.traffic)
    guessed: int = 0  # stage-2 tokens proposed to the draft model (staged)
    guesses_accepted: int = 0  # of them, those the draft model agreed with

    def __sub__(self, other: "DraftWork") -> "DraftWork":
        return DraftWork(*(a - b for a, b in zip(astuple(self), astuple(other))))


class Drafter:
    """Proposes a tree rooted at the last committed token.

    `draft(tokens, new_features)`: `tokens` [n + 1] is the whole committed sequence ending with the root (the
    token the target chose last, not yet run through the target); `new_features` [k, F] are the target features
    of the last k committed positions the drafter has not seen yet (positions n - k .. n - 1), or None.
    """

    name = "drafter"
    needs_features = False

    def reset(self) -> None:
        """Forget the sequence (called before each new generation)."""

    def work(self) -> DraftWork:
        """Its forwards, weight bytes read and stage-2 guesses so far (none for a drafter without a model)."""
        return DraftWork()

    def draft(self, tokens: Tensor, new_features: Tensor | None) -> DraftTree:
        raise NotImplementedError

    def fork(self) -> "Drafter":
        """A drafter of the same kind and settings, sharing its weights, with its own empty state: one for each
        sequence of a batch (eaglespec.spec.batch)."""
        clone = copy.copy(self)
        clone.reset()
        return clone


class VanillaDrafter(Drafter):
    name = "vanilla"

    def draft(self, tokens: Tensor, new_features: Tensor | None) -> DraftTree:
        return DraftTree.root_only(int(tokens[-1]))


@dataclass
class TreeSettings:
    """EAGLE-2 dynamic tree: `total_tokens` nodes verified (root included), `depth` draft levels, `top_k`
    children per expanded node. EAGLE-1 static tree: `choices` (rank paths). Chain: `depth` top-1 steps."""

    total_tokens: int = 16
    depth: int = 5
    top_k: int = 4
    choices: list[list[int]] | None = None

    def __post_init__(self) -> None:
        for name in ("total_tokens", "depth", "top_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1 or value > 1024:
                raise EagleSpecError(f"tree setting {name} must be an integer between 1 and 1024, got {value!r}")
        if self.total_tokens < 2:
            raise EagleSpecError("tree setting total_tokens must be at least 2 (the root and one draft token)")


def tree_chosen_by_run(tree: "TreeSettings | str | None") -> bool:
    """Whether the trees are chosen as decoding goes ('auto', or 'calibrate' then auto's policy) rather than given
    (settings, or None for the defaults). Only then is a draft model's chain length chosen each round, so only then
    can `longest` (`--longest-chain`, a bench variant's `@longest=`) cap it."""
    return isinstance(tree, str)
