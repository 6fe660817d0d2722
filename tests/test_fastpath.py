"""The Llama/Qwen2 fast path reproduces the generic transformers path (logits, features, commits, tokens)."""

import pytest
import torch
from conftest import TinyTokenizer, make_model
from test_engine import PROMPTS, random_head

from eaglespec import Engine, TreeSettings
from eaglespec.errors import EagleSpecError
from eaglespec.spec.tree import DraftTree
from eaglespec.targets.fast import FastTarget, make_target, supports
from eaglespec.targets.hf import TargetModel

PROMPT = torch.tensor([3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26])
TREE = DraftTree(tokens=torch.tensor([5, 11, 12, 13, 14, 15, 16]), parents=torch.tensor([-1, 0, 0, 1, 1, 2, 3]))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("kind", ["final", "eagle3"])
def test_fast_forward_and_commit_match_generic(arch, kind):
    model = make_model(arch, layers=6)
    fast, slow = FastTarget(model, kind, initial_capacity=8), TargetModel(model, kind)  # capacity 8 forces growth
    for t in (fast, slow):
        t.forward(PROMPT)
        t.commit()
    outs = [t.forward(TREE.tokens, TREE.positions(t.cache_len), TREE.ancestor_mask()) for t in (fast, slow)]
    torch.testing.assert_close(outs[0].logits, outs[1].logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(outs[0].features, outs[1].features, atol=1e-4, rtol=1e-4)
    for t in (fast, slow):
        t.commit(torch.tensor([0, 2, 5]))
    nxt = [t.forward(torch.tensor([7, 8])) for t in (fast, slow)]
    torch.testing.assert_close(nxt[0].logits, nxt[1].logits, atol=1e-4, rtol=1e-4)
    assert fast.cache_len == slow.cache_len == PROMPT.numel() + 3


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("method", ["vanilla", "eagle2", "eagle1"])
def test_fast_engine_tokens_equal_generic_vanilla(arch, method):
    model = make_model(arch)
    head = None if method == "vanilla" else random_head(model, "eagle3")
    slow = Engine.from_model(model, TinyTokenizer(), method="vanilla", backend="hf")
    fast = Engine.from_model(model, TinyTokenizer(), head=head, method=method, backend="fast",
                             tree=TreeSettings(total_tokens=10, depth=4, top_k=3))
    assert isinstance(fast.target, FastTarget)
    for prompt in PROMPTS:
        assert fast.generate(prompt, max_new_tokens=20).tokens == slow.generate(prompt, max_new_tokens=20).tokens


def test_backend_selection():
    assert supports(make_model("llama")) and supports(make_model("qwen2"))
    gemma = make_model("gemma3")
    assert not supports(gemma)
    assert type(make_target(gemma, "final", "auto")) is TargetModel
    assert type(make_target(make_model("llama"), "final", "hf")) is TargetModel
    with pytest.raises(EagleSpecError, match="backend hf"):
        make_target(gemma, "final", "fast")


def test_a_wide_tree_at_the_end_of_the_context_fits():
    """A tree needs a cache row per node even where node positions stay inside the context."""
    model = make_model("llama", max_position_embeddings=40)
    prompt = list(range(1, 31))
    tree = TreeSettings(total_tokens=24, depth=3, top_k=8)
    fast = Engine.from_model(model, TinyTokenizer(), head=random_head(model, "eagle1"), tree=tree, backend="fast")
    generic = Engine.from_model(model, TinyTokenizer(), method="vanilla", backend="hf")
    assert fast.generate(prompt, max_new_tokens=10).tokens == generic.generate(prompt, max_new_tokens=10).tokens


def test_targets_of_one_model_and_plan_share_their_packed_weights():
    """The bench's methods (and engines sharing a model) build one fast target each: with the same plan they hold
    one copy of the fused, packed weights between them, and still answer as a target of their own."""
    model = make_model("qwen2", seed=0)
    first, second = (FastTarget(model, "final") for _ in range(2))
    assert second.layers is first.layers and second.logits_head is first.logits_head
    assert all(a.qkv is b.qkv for a, b in zip(first.layers, second.layers))
    other_plan = FastTarget(model, "final", row_invariant=True)  # another plan: its own weights
    assert other_plan.layers is not first.layers
    assert FastTarget(make_model("qwen2", seed=0), "final").layers is not first.layers  # another model
    tokens = torch.tensor(PROMPTS[0])
    logits = []
    for target in (first, second):
        logits.append(target.forward(tokens).logits)
        target.commit()
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=0)
    assert first.cache_len == second.cache_len == tokens.numel()  # each its own cache
    with torch.no_grad():  # a weight changed in place: a target built now reads the new weights
        model.model.layers[0].mlp.down_proj.weight[0, 0] += 1
    changed = FastTarget(model, "final")
    assert changed.layers is not first.layers
    assert FastTarget(model, "final").layers is changed.layers


def test_weight_bytes_count_what_a_forward_reads_as_stored():
    model = make_model("qwen2", seed=0)  # float32, untied LM head
    params = sum(p.numel() for p in model.parameters())
    embedding = model.get_input_embeddings().weight.numel()
    assert TargetModel(model).weight_bytes() == 4 * (params - embedding)  # the embedding is read a row at a time
    fast = make_target(model, feature_kind=None, exact=False)
    assert fast.weight_bytes() == 4 * (params - embedding)  # fused and packed: the same bytes
    int8 = make_target(model, feature_kind=None, quantize="int8").weight_bytes()
    linear = sum(m.weight.numel() for name, m in model.named_modules()
                 if isinstance(m, torch.nn.Linear) and "lm_head" not in name)
    assert int8 < fast.weight_bytes() - 2 * linear  # a byte a layer weight (plus scales) instead of four
    tied = make_model("llama", seed=0)
    tied.lm_head.weight = tied.get_input_embeddings().weight  # an LM head that is the embedding: read whole
    assert TargetModel(tied).weight_bytes() == 4 * sum(p.numel() for p in tied.parameters())
