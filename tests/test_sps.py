"""Draft-model speculative decoding (sps): greedy equality with vanilla, the draft model on the fast path, its cache
rolled back to what the target committed (drafted rows kept, rejected ones dropped), one draft forward per drafted
token, and the generic fallback for architectures the fast path does not cover."""

from __future__ import annotations

import pytest
import torch
from conftest import TinyTokenizer, make_cpu_model, make_model

from eaglespec.api import Engine
from eaglespec.backends.cpu import kernels as bf16gemm
from eaglespec.backends.cpu import q4
from eaglespec.drafters import TreeSettings
from eaglespec.drafters.draft_model import DraftModelDrafter
from eaglespec.targets.fast import FastTarget, make_target

PROMPT = [3, 14, 15, 92, 65, 35, 89, 79]


def vanilla(target, prompt: list[int], n: int) -> list[int]:
    return Engine.from_model(target, TinyTokenizer(), method="vanilla").generate(prompt, max_new_tokens=n).tokens


def record_forwards(drafter: DraftModelDrafter) -> list[int]:
    """Spy on the draft model: the number of tokens of each forward, in order."""
    sizes: list[int] = []
    forward = drafter.model.forward

    def counted(tokens, *args, **kwargs):
        sizes.append(tokens.numel())
        return forward(tokens, *args, **kwargs)

    drafter.model.forward = counted
    return sizes


def greedy_continuation(model, ids: list[int], n: int) -> list[int]:
    """The draft model's own greedy continuation of `ids` (transformers, no cache tricks)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([ids], device=model.device), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("depth", [1, 3, 5])
def test_greedy_output_equals_vanilla_with_an_unrelated_draft_model(arch, depth):
    target, tok = make_model(arch, seed=0), TinyTokenizer()
    draft = make_model(arch, seed=1, layers=2)
    expected = vanilla(target, PROMPT, 24)
    engine = Engine.from_model(target, tok, method="sps", tree=TreeSettings(depth=depth), draft_hf_model=draft)
    drafter = engine.drafter
    assert isinstance(drafter.model, FastTarget) == (arch != "gemma3")  # gemma3: the generic fallback
    assert drafter.rolls_back == (arch != "gemma3")
    sizes = record_forwards(drafter)
    out = engine.generate(PROMPT, max_new_tokens=24)
    assert out.tokens == expected
    # one draft forward per drafted token, whatever was accepted (no re-runs of earlier drafts as extra forwards)
    assert len(sizes) == depth * out.stats.target_forwards
    if arch != "gemma3":
        # per round: a catch-up forward of the bonus token (and of the last draft, which had no row yet, when the
        # target accepted every draft), then depth - 1 one-token steps; the prompt and root once at the start
        expected_sizes = [len(PROMPT) + 1] + [1] * (depth - 1)
        for accepted in out.stats.accept_lengths[:-1]:
            expected_sizes += [1 + (accepted == depth + 1)] + [1] * (depth - 1)
        assert sizes == expected_sizes
    again = engine.generate(PROMPT, max_new_tokens=24)  # a second request on the same engine starts clean
    assert again.tokens == expected


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("depth", [1, 4])
def test_target_as_its_own_draft_accepts_every_drafted_token(arch, depth):
    target, tok = make_model(arch), TinyTokenizer()
    prompt = [1, 2, 3, 4, 5]
    rounds = 4
    n = 1 + rounds * (depth + 1)  # prefill gives 1 token, then every forward accepts depth drafts + 1 bonus
    engine = Engine.from_model(target, tok, method="sps", tree=TreeSettings(depth=depth), draft_hf_model=target)
    sizes = record_forwards(engine.drafter)
    out = engine.generate(prompt, max_new_tokens=n)
    assert out.tokens == vanilla(target, prompt, n)
    assert out.stats.accept_lengths == [depth + 1] * rounds
    assert out.stats.tau == depth + 1
    assert len(sizes) == depth * rounds
    # the prompt + root once; then per round the last draft + the bonus (with depth 1: the root's previous
    # draft and the bonus), then depth - 1 one-token steps
    assert sizes == [len(prompt) + 1] + [1] * (depth - 1) + ([2] + [1] * (depth - 1)) * (rounds - 1)
    # the draft cache: the committed sequence (prompt + emitted tokens but the last) and the last round's chain rows
    drafter = engine.drafter
    committed = prompt + out.tokens[:-(depth + 1)]  # what the last round drafted on, root included
    assert drafter.model.cache_len == len(committed) + depth - 1
    assert drafter.seen == committed + out.tokens[-(depth + 1):-2]  # the drafts but the last


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_draft_cache_rolls_back_to_the_committed_prefix(arch):
    draft = make_model(arch, seed=1, layers=2)
    depth = 3
    drafter = DraftModelDrafter(make_target(draft, feature_kind=None, exact=False), TreeSettings(depth=depth))
    sizes = record_forwards(drafter)

    def round_(ids: list[int]) -> list[int]:
        sizes.clear()
        tree = drafter.draft(torch.tensor(ids), None)
        drafts = tree.tokens[1:].tolist()
        assert tree.tokens[0].item() == ids[-1] and len(drafts) == depth
        assert drafts == greedy_continuation(draft, ids, depth)  # the rolled-back cache drafts as a fresh one would
        assert len(sizes) == depth  # one forward per drafted token
        # committed rows: the sequence, root included, and every drafted token but the last (never run)
        assert drafter.model.cache_len == len(ids) + depth - 1
        assert drafter.seen == ids + drafts[:-1]
        return drafts

    def bonus(avoid: int) -> int:
        return 7 if avoid != 7 else 8  # a target token other than the rejected draft

    ids = [4, 5, 6]
    drafts = round_(ids)
    assert sizes[0] == 3  # the prompt and root in one forward
    # two drafts accepted, the third rejected: the rows of both accepted drafts stay, only the bonus is run
    ids = ids + drafts[:2] + [bonus(drafts[2])]
    drafts = round_(ids)
    assert sizes == [1] * depth
    # none accepted: the drafted rows are all dropped
    ids = ids + [bonus(drafts[0])]
    drafts = round_(ids)
    assert sizes == [1] * depth
    # all accepted: the last draft had no row yet, so it runs beside the bonus
    ids = ids + drafts + [5]
    drafts = round_(ids)
    assert sizes == [2] + [1] * (depth - 1)
    # an unrelated sequence (a new request without reset): nothing shared, everything run again
    round_([9, 8])
    assert sizes[0] == 2


def test_generic_fallback_keeps_only_committed_rows():
    draft = make_model("gemma3", seed=1, layers=2)
    drafter = DraftModelDrafter(make_target(draft, feature_kind=None, exact=False), TreeSettings(depth=3))
    assert not isinstance(drafter.model, FastTarget) and not drafter.rolls_back
    tree = drafter.draft(torch.tensor([4, 5, 6]), None)
    assert tree.tokens[0].item() == 6 and len(tree) == 4
    assert drafter.model.cache_len == 3  # prompt + root; the drafted tokens' rows were dropped
    nxt = [4, 5, 6] + tree.tokens[1:3].tolist() + [7]  # two drafts accepted, then a bonus token
    drafter.draft(torch.tensor(nxt), None)
    assert drafter.model.cache_len == len(nxt) and drafter.seen == nxt
    tree = drafter.draft(torch.tensor([9, 8]), None)  # another sequence: started over
    assert drafter.model.cache_len == 2 and tree.tokens[0].item() == 8


def test_sampling_with_a_draft_model_runs_through_the_rejection_rule():
    target, draft = make_model("qwen2", seed=0), make_model("qwen2", seed=1, layers=2)
    engine = Engine.from_model(target, TinyTokenizer(), method="sps", tree=TreeSettings(depth=3), draft_hf_model=draft)
    out = engine.generate(PROMPT, max_new_tokens=20, temperature=0.8, seed=3)
    assert len(out.tokens) == 20 and all(1 <= a <= 4 for a in out.stats.accept_lengths)
    assert out.tokens == engine.generate(PROMPT, max_new_tokens=20, temperature=0.8, seed=3).tokens


@pytest.mark.skipif(not bf16gemm.available(torch.bfloat16, "cpu"),
                    reason="eaglespec's bfloat16 kernels need AVX-512 BF16 or AVX2 + FMA and a C++ compiler")
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("requantize", [True, False])
def test_bfloat16_draft_runs_on_the_kernels(arch, requantize, monkeypatch):
    """A bfloat16 draft model's steps run on the kernels: by default as 4-bit blocks, greedy tokens the argmax of
    their logits; with $EAGLESPEC_DRAFT_Q4=0 on its own weights, through the greedy head without full logits."""
    monkeypatch.setenv(bf16gemm.DRAFT_Q4_ENV, "1" if requantize else "0")
    target = make_cpu_model(arch, seed=0).to(torch.bfloat16)
    draft = make_cpu_model(arch, seed=1, layers=2).to(torch.bfloat16)
    engine = Engine.from_model(target, TinyTokenizer(), method="sps", tree=TreeSettings(depth=4), draft_hf_model=draft)
    model = engine.drafter.model
    assert isinstance(model, FastTarget) and model.bf16_gemm
    assert model.requantized == (requantize and q4.available()) and (model.greedy_head is None) == model.requantized
    outputs = []
    forward = model.forward

    def spied(*args, **kwargs):
        outputs.append(forward(*args, **kwargs))
        return outputs[-1]

    model.forward = spied
    out = engine.generate(PROMPT, max_new_tokens=24)
    assert out.tokens == vanilla(target, PROMPT, 24)
    full_logits = [o.head_logits is not None for o in outputs]
    assert outputs and full_logits == [model.requantized] * len(outputs)
    assert all(o.greedy_tokens is not None or o.head_logits is not None for o in outputs)
