"""Sampled speculative decoding follows the target distribution exactly (statistical test), and the test has the
power to catch a broken acceptance rule."""

import pytest
import torch
from conftest import TinyTokenizer, make_model

from eaglespec.drafters import Drafter
from eaglespec.errors import EagleSpecError
from eaglespec.spec.decode import SpecDecoder
from eaglespec.spec.tree import DraftTree
from eaglespec.spec.verify import SamplingParams, Verdict, target_probs, verify_sample
from eaglespec.targets.hf import TargetModel

PARAMS = SamplingParams(temperature=0.9, top_p=0.95, top_k=4)
PROMPT = [5, 17, 33, 2]
RUNS = 2500


class WorstFirstDrafter(Drafter):
    """Proposes the target's 3 most likely next tokens in *ascending* order of probability, two levels deep, so the
    order of trial matters and a wrong acceptance rule shows."""

    name = "worst-first"

    def __init__(self, model):
        self.model = model

    def _children(self, seq: list[int]) -> list[int]:
        with torch.no_grad():
            logits = self.model(torch.tensor([seq], device=self.model.device)).logits[0, -1]
        return torch.topk(logits, 3).indices.flip(0).tolist()

    def draft(self, tokens, new_features) -> DraftTree:
        seq = tokens.tolist()
        toks, parents = [seq[-1]], [-1]
        for child in self._children(seq):
            toks.append(child)
            parents.append(0)
            me = len(toks) - 1
            for grandchild in self._children(seq + [child]):
                toks.append(grandchild)
                parents.append(me)
        return DraftTree(torch.tensor(toks), torch.tensor(parents))


def exact_distribution(model, n_tokens: int) -> dict[tuple[int, ...], float]:
    """P(t1..tn) under temperature/top-p/top-k sampling of the target, by enumeration."""
    out = {(): 1.0}
    for _ in range(n_tokens):
        nxt = {}
        for prefix, p in out.items():
            with torch.no_grad():
                logits = model(torch.tensor([PROMPT + list(prefix)], device=model.device)).logits[0, -1]
            probs = target_probs(logits[None], PARAMS)[0]
            for tok in probs.nonzero().flatten().tolist():
                nxt[prefix + (tok,)] = p * float(probs[tok])
        out = nxt
    return out


def chi_square_p_value(samples: list[tuple[int, ...]], exact: dict[tuple[int, ...], float]) -> float:
    """Pearson chi-square goodness of fit; cells expected below 5 are pooled."""
    n = len(samples)
    counts = {k: 0 for k in exact}
    for s in samples:
        counts[s] = counts.get(s, 0) + 1  # an impossible sequence gets a cell with expectation 0
    big = [k for k in exact if exact[k] * n >= 5]
    observed = [counts[k] for k in big] + [n - sum(counts[k] for k in big)]
    expected = [exact[k] * n for k in big] + [n * (1 - sum(exact[k] for k in big))]
    if expected[-1] < 1e-9:
        if observed[-1] > 0:
            return 0.0
        observed, expected = observed[:-1], expected[:-1]
    chi2 = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
    df = len(observed) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64),
                                         torch.tensor(chi2 / 2.0, dtype=torch.float64)))


def sample_sequences(model, verifier, runs: int) -> list[tuple[int, ...]]:
    decoder = SpecDecoder(TargetModel(model, feature_kind=None), TinyTokenizer(), WorstFirstDrafter(model),
                          eos_token_ids=[], sample_verifier=verifier)
    out = []
    for seed in range(runs):
        params = SamplingParams(PARAMS.temperature, PARAMS.top_p, PARAMS.top_k, seed=seed)
        *_, finished = decoder.stream(PROMPT, max_new_tokens=3, sampling=params)
        out.append(tuple(finished.tokens))
    return out


def accept_first_in_support(tree, probs, generator) -> Verdict:
    """A deliberately broken rule: accepts any child the target could produce, without the p(x) coin."""
    tokens, kids = tree.tokens.tolist(), tree.children()
    node, path = 0, [0]
    while True:
        nxt = next((c for c in kids[node] if probs[node, tokens[c]] > 0), None)
        if nxt is None:
            return Verdict(path, int(torch.multinomial(probs[node].cpu(), 1, generator=generator)))
        node = nxt
        path.append(node)


def skip_renormalisation(tree, probs, generator) -> Verdict:
    """A subtler broken rule: the residual is not renormalised after a rejection (rejected token may be resampled)."""
    tokens, kids = tree.tokens.tolist(), tree.children()
    node, path = 0, [0]
    while True:
        p = probs[node].cpu()
        nxt = next((c for c in kids[node] if float(torch.rand((), generator=generator)) < float(p[tokens[c]])), None)
        if nxt is None:
            return Verdict(path, int(torch.multinomial(p, 1, generator=generator)))
        node = nxt
        path.append(node)


@pytest.fixture(scope="module")
def model_and_exact():
    model = make_model("llama", seed=7, layers=2)
    return model, exact_distribution(model, 3)


def test_speculative_sampling_matches_target_distribution(model_and_exact):
    model, exact = model_and_exact
    samples = sample_sequences(model, verify_sample, RUNS)
    assert chi_square_p_value(samples, exact) > 1e-3
    # the drafts were actually used: many first-step trees accepted at least one token
    assert len(exact) > 8


@pytest.mark.parametrize("broken", [accept_first_in_support, skip_renormalisation])
def test_statistical_test_catches_broken_acceptance_rules(model_and_exact, broken):
    model, exact = model_and_exact
    samples = sample_sequences(model, broken, RUNS)
    assert chi_square_p_value(samples, exact) < 1e-3


def test_verify_sample_unit_distribution():
    """One node with children [a, b]: the emitted token is distributed as p, whatever the proposals."""
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(4)
    single = DraftTree(torch.tensor([0, 3, 1]), torch.tensor([-1, 0, 0]))
    for _ in range(20000):
        v = verify_sample(single, torch.cat([probs, probs, probs]), gen)
        tok = single.tokens[v.accepted[1]].item() if len(v.accepted) > 1 else v.bonus
        counts[tok] += 1
    torch.testing.assert_close(counts / counts.sum(), probs[0], atol=0.015, rtol=0)


@pytest.mark.parametrize("kwargs", [dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1),
                                    dict(temperature=float("nan"))])
def test_invalid_sampling_parameters(kwargs):
    with pytest.raises(EagleSpecError):
        SamplingParams(**kwargs)


def test_top_p_and_top_k_filtering():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    p = target_probs(logits, SamplingParams(temperature=1.0, top_p=0.65))
    torch.testing.assert_close(p[0], torch.tensor([0.4, 0.3, 0.0, 0.0]) / 0.7)
    p = target_probs(logits, SamplingParams(temperature=1.0, top_k=3))
    torch.testing.assert_close(p[0], torch.tensor([0.4, 0.3, 0.2, 0.0]) / 0.9)
