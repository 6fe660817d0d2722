"""Target adapter: tree forwards match sequential forwards, and KV commit equals recomputing the cache."""

import pytest
import torch
from conftest import make_model

from eaglespec.spec.tree import DraftTree
from eaglespec.targets.hf import TargetModel

PROMPT = torch.tensor([3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26])
TREE = DraftTree(tokens=torch.tensor([5, 11, 12, 13, 14, 15, 16]), parents=torch.tensor([-1, 0, 0, 1, 1, 2, 3]))


def _fresh_logits(model, tokens):
    """Plain full-sequence forward without our cache: logits [n, V]."""
    with torch.no_grad():
        return model(tokens[None].to(model.device)).logits[0]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_tree_logits_equal_each_path_run_alone(arch):
    model = make_model(arch)
    target = TargetModel(model, feature_kind="final")
    target.forward(PROMPT)
    target.commit()
    out = target.forward(TREE.tokens, TREE.positions(target.cache_len), TREE.ancestor_mask())
    for path in TREE.leaf_paths():
        reference = _fresh_logits(model, torch.cat([PROMPT, TREE.tokens[path]]))[len(PROMPT):]
        torch.testing.assert_close(out.logits[path], reference, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("path", [[0, 1, 3, 6], [0, 2, 5], [0]])
def test_commit_equals_recomputed_cache(arch, path):
    model = make_model(arch)
    target = TargetModel(model, feature_kind="final")
    target.forward(PROMPT)
    target.commit()
    target.forward(TREE.tokens, TREE.positions(target.cache_len), TREE.ancestor_mask())
    target.commit(torch.tensor(path))
    accepted_sequence = torch.cat([PROMPT, TREE.tokens[path]])
    assert target.cache_len == accepted_sequence.numel()

    fresh = TargetModel(model, feature_kind="final")
    fresh.forward(accepted_sequence)
    fresh.commit()
    for ours, theirs in zip(target.cache.layers, fresh.cache.layers):
        torch.testing.assert_close(ours.keys, theirs.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ours.values, theirs.values, atol=1e-5, rtol=1e-5)
    # and the next step sees the same context
    nxt = torch.tensor([7])
    a, b = target.forward(nxt), fresh.forward(nxt)
    torch.testing.assert_close(a.logits, b.logits, atol=1e-4, rtol=1e-4)


def test_sliding_window_is_applied_beyond_the_window():
    """Gemma3 tiny config has a window of 8: a 20-token context must give the same logits as HF's own masks."""
    model = make_model("gemma3")
    target = TargetModel(model, feature_kind=None)
    seq = torch.arange(20) % 90 + 3
    target.forward(seq[:14])
    target.commit()
    out = target.forward(seq[14:])
    torch.testing.assert_close(out.logits, _fresh_logits(model, seq)[14:], atol=1e-4, rtol=1e-4)


def test_eagle3_features_are_three_layer_inputs():
    model = make_model("llama", layers=6)
    target = TargetModel(model, feature_kind="eagle3")
    out = target.forward(PROMPT)
    with torch.no_grad():
        hs = model(PROMPT[None].to(model.device), output_hidden_states=True).hidden_states
    assert target.eagle3_layers() == (2, 3, 3)
    expected = torch.cat([hs[2][0], hs[3][0], hs[3][0]], dim=-1)
    torch.testing.assert_close(out.features, expected, atol=1e-5, rtol=1e-5)
    assert out.features.shape == (PROMPT.numel(), 3 * target.hidden_size)


def test_final_features_are_post_norm_hidden_states():
    model = make_model("qwen2")
    target = TargetModel(model, feature_kind="final")
    out = target.forward(PROMPT)
    with torch.no_grad():
        last = model.model(PROMPT[None].to(model.device)).last_hidden_state[0]
    torch.testing.assert_close(out.features, last, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.logits, model.lm_head(last), atol=1e-4, rtol=1e-4)
