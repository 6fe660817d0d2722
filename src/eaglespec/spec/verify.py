"""Verification of a draft tree against the target: greedy and lossless sampling.

Vocabulary (as in vLLM): along the walk from the root, drafted nodes the target agrees with are *accepted*;
the token the target chooses after the last accepted node is the *bonus* token (when the target rejected every
child there, it is also called the recovered token). Both paths emit accepted + 1 tokens per target forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..errors import EagleSpecError
from .tree import DraftTree


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None

    def __post_init__(self) -> None:
        if not (0.0 <= self.temperature <= 100.0) or self.temperature != self.temperature:
            raise EagleSpecError(f"temperature must be between 0 and 100 (0 = greedy), got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise EagleSpecError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise EagleSpecError(f"top_k must be >= 0 (0 = off), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def generator(self) -> torch.Generator:
        """A CPU generator, also when the model runs on a GPU: the draws are made from probabilities moved to the
        CPU, so a seed gives the same draws wherever the same probabilities come from."""
        g = torch.Generator()
        g.manual_seed(self.seed if self.seed is not None else int(torch.randint(0, 2**62, (1,))))
        return g


def target_probs(logits: Tensor, params: SamplingParams) -> Tensor:
    """[N, V] logits -> [N, V] float32 probabilities after temperature, top-k and top-p (in that order)."""
    logits = logits.float() / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]  # [N, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = sorted_p.cumsum(-1) - sorted_p  # probability of strictly more likely tokens
        drop_sorted = mass_before >= params.top_p  # the most likely token is never dropped
        drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


@dataclass
class Verdict:
    accepted: list[int]  # node indices of the accepted path, starting with the root (0)
    bonus: int  # token id chosen by the target after the last accepted node

    @property
    def accepted_tokens(self) -> int:
        """Drafted tokens accepted (not counting the root or the bonus)."""
        return len(self.accepted) - 1


def walk_greedy(tree: DraftTree, best: list[int]) -> Verdict:
    """Greedy verification: walk from the root, following the child equal to the target's greedy token at the node
    (`best` [N]: `TargetOutput.greedy()`, the argmax of each row's logits)."""
    tokens = tree.token_list()
    kids = tree.children()
    node, path = 0, [0]
    while True:
        nxt = next((c for c in kids[node] if tokens[c] == best[node]), None)
        if nxt is None:
            return Verdict(path, best[node])
        node = nxt
        path.append(node)


def verify_sample(tree: DraftTree, probs: Tensor, generator: torch.Generator) -> Verdict:
    """Lossless recursive rejection for deterministic (top-k) proposals. `probs`: [N, V] target probabilities.

    At each accepted node, try its children in order: accept child x with probability p(x) / sum(p); on
    rejection set p(x) = 0 (and renormalise implicitly); if all children are rejected, the bonus token is
    sampled from what is left of p. Since a proposal is a fixed function of the context, this emits exactly a
    sample from p at every position.
    """
    tokens = tree.token_list()
    kids = tree.children()
    node, path = 0, [0]
    while True:
        p = probs[node].to("cpu", copy=True)  # [V], on the CPU: the generator is a CPU one on any device
        nxt = None
        for child in kids[node]:
            x = tokens[child]
            total = float(p.sum())
            if total <= 0.0:
                break
            if float(torch.rand((), generator=generator)) * total < float(p[x]):
                nxt = child
                break
            p[x] = 0.0
        if nxt is None:
            bonus = int(torch.multinomial(p, 1, generator=generator))
            return Verdict(path, bonus)
        node = nxt
        path.append(node)


def sample_token(logits: Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token from [V] logits (argmax when greedy)."""
    if params.greedy:
        return int(logits.argmax())
    probs = target_probs(logits[None], params)[0].cpu()  # [V], on the CPU like the generator
    return int(torch.multinomial(probs, 1, generator=generator))
