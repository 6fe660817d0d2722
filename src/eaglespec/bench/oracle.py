"""The ceiling of speculation on this machine: a drafter that already knows plain decoding's answer.

`oracle` proposes a chain of the next `depth` tokens of plain greedy decoding's answer to the same prompt, so
every draft token is accepted (tau = depth + 1 but at the end) and drafting costs nothing. Its tokens/s is
what a perfect drafter with chains of that length would give on this target and machine: no head, tree or
draft model can beat it with as many draft tokens per verify pass (a tree's accepted length is at most its
depth + 1, and its pass verifies at least as many tokens). It is a measurement for `eaglespec bench`
(`--methods vanilla,oracle --sweep depth=1,2,4,8`), not a way to generate: it needs the answer first.
"""

from __future__ import annotations

from torch import Tensor

from ..drafters import Drafter, TreeSettings
from ..errors import EagleSpecError
from ..spec.tree import DraftTree, chain
from .base import LoopMethod, RunOutput, Sampling

Answers = dict[tuple[tuple[int, ...], int], list[int]]  # (prompt ids, max_new_tokens) -> plain greedy answer


class OracleDrafter(Drafter):
    """Proposes the `settings.depth` tokens that follow the committed ones in `sequence` (prompt + known answer); the
    root alone where the committed tokens have left it or it has no more tokens."""

    name = "oracle"

    def __init__(self, settings: TreeSettings | None = None):
        self.settings = settings or TreeSettings()
        self.sequence: list[int] = []

    def draft(self, tokens: Tensor, new_features: Tensor | None) -> DraftTree:
        n = tokens.numel()  # tokens [n]: committed sequence ending with the root
        root = int(tokens[-1])
        if n > len(self.sequence) or self.sequence[n - 1] != root:
            return DraftTree.root_only(root)
        return chain([root] + self.sequence[n : n + self.settings.depth])


class OracleMethod(LoopMethod):
    """`oracle` in the bench loop: plain decoding's answer to each prompt (from `answers`, which the vanilla method
    fills as it runs; else an untimed plain run of the same engine first), then a timed run drafting it."""

    def __init__(self, name: str, engine, settings: dict, tree: TreeSettings, answers: Answers,
                 sweep: dict | None = None):
        self.plain = engine.drafter  # the engine's own drafter: vanilla
        super().__init__(name, "oracle", engine, settings, sweep, drafter=OracleDrafter(tree))
        self.answers = answers

    def generate(self, prompt_ids: list[int], max_new_tokens: int, sampling: Sampling) -> RunOutput:
        if not sampling.greedy:
            raise EagleSpecError("method 'oracle' needs greedy decoding (--temperature 0): it drafts plain greedy "
                                 "decoding's answer")
        key = (tuple(prompt_ids), max_new_tokens)
        if key not in self.answers:
            self.engine.decoder.drafter = self.plain
            self.answers[key] = list(self.engine.generate(list(prompt_ids), max_new_tokens=max_new_tokens).tokens)
        self.drafter.sequence = list(prompt_ids) + self.answers[key]
        return super().generate(prompt_ids, max_new_tokens, sampling)
