"""Draft-model speculative decoding (sps): greedy equality with vanilla, cache reuse across rounds and requests."""

from __future__ import annotations

import pytest
import torch

from conftest import TinyTokenizer, make_model
from eaglespec.api import Engine
from eaglespec.drafters import TreeSettings
from eaglespec.sps import DraftModelDrafter


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_greedy_output_equals_vanilla_with_an_unrelated_draft_model(arch):
    target, tok = make_model(arch, seed=0), TinyTokenizer()
    draft = make_model(arch, seed=1, layers=2)
    prompt = [3, 14, 15, 92, 65, 35, 89, 79]
    vanilla = Engine.from_model(target, tok, method="vanilla").generate(prompt, max_new_tokens=16)
    engine = Engine.from_model(target, tok, method="sps", tree=TreeSettings(depth=3), draft_hf_model=draft)
    out = engine.generate(prompt, max_new_tokens=16)
    assert out.tokens == vanilla.tokens
    again = engine.generate(prompt, max_new_tokens=16)  # a second request on the same engine starts clean
    assert again.tokens == vanilla.tokens


def test_target_as_its_own_draft_accepts_every_drafted_token():
    target, tok = make_model("llama"), TinyTokenizer()
    prompt = [1, 2, 3, 4, 5]
    engine = Engine.from_model(target, tok, method="sps", tree=TreeSettings(depth=4), draft_hf_model=target)
    out = engine.generate(prompt, max_new_tokens=21)
    vanilla = Engine.from_model(target, tok, method="vanilla").generate(prompt, max_new_tokens=21)
    assert out.tokens == vanilla.tokens
    # prefill gives 1 token, then every forward accepts 4 drafts + 1 bonus: 20 tokens in 4 forwards
    assert out.stats.accept_lengths == [5, 5, 5, 5]
    assert out.stats.tau == 5.0


def test_drafter_keeps_only_committed_rows_in_its_cache():
    target = make_model("llama", seed=0)
    drafter = DraftModelDrafter(target, TreeSettings(depth=3))
    tree = drafter.draft(torch.tensor([4, 5, 6]), None)
    assert tree.tokens[0].item() == 6 and len(tree) == 4
    assert drafter.model.cache_len == 3  # prompt + root; the drafted tokens' rows were dropped
    # next round: two of the drafts were accepted, then a bonus token
    nxt = [4, 5, 6] + tree.tokens[1:3].tolist() + [7]
    drafter.draft(torch.tensor(nxt), None)
    assert drafter.model.cache_len == len(nxt)
    assert drafter.seen == nxt
    # an unrelated sequence (a new request without reset) is detected and handled from scratch
    tree = drafter.draft(torch.tensor([9, 8]), None)
    assert drafter.model.cache_len == 2 and tree.tokens[0].item() == 8
