"""`--compile`: the fast path's decode steps through torch.compile give the eager fast path's logits, features,
cache and tokens (float32, tiny models). Compiling takes ~30 s on 2 cores, so the tests share a few targets."""

import shutil

import pytest
import torch
from conftest import TinyTokenizer, make_cpu_model
from test_engine import PROMPTS, random_head
from test_fastpath import PROMPT, TREE
from torch._dynamo.eval_frame import _debug_get_cache_entry_list

from eaglespec import Engine, TreeSettings
from eaglespec.backends.cpu.apply import eagle_drafter
from eaglespec.backends.cpu.compiled import (
    SMALL_TREE,
    DecodeStack,
    HeadStep,
    cpu_compiler_available,
    graph_kind,
)
from eaglespec.errors import EagleSpecError
from eaglespec.targets.fast import FastTarget, make_target

needs_compiler = pytest.mark.skipif(not cpu_compiler_available(),
                                    reason="torch.compile's CPU backend needs a C++ compiler")


@pytest.fixture(scope="module")
def model():
    return make_cpu_model("qwen2", layers=3)  # q/k/v biases and GQA


@pytest.fixture(scope="module")
def compiled(model):
    target = FastTarget(model, "eagle3", initial_capacity=16, compile=True)  # capacity 16: the cache grows below
    target.warm_up()
    return target


@needs_compiler
def test_compiled_steps_match_eager_steps(model, compiled):
    eager = FastTarget(model, "eagle3", initial_capacity=16)
    for t in (eager, compiled):
        t.reset()
        t.forward(PROMPT)
        t.commit()
    for step in range(3):  # tree verify, commit of a path, one-token steps, a cache that grows past 16 rows
        outs = [t.forward(TREE.tokens, TREE.positions(t.cache_len), TREE.ancestor_mask()) for t in (eager, compiled)]
        torch.testing.assert_close(outs[1].logits, outs[0].logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(outs[1].features, outs[0].features, atol=1e-5, rtol=1e-5)
        for t in (eager, compiled):
            t.commit(torch.tensor([0, 1, 3]))
        outs = [t.forward(torch.tensor([7 + step])) for t in (eager, compiled)]
        torch.testing.assert_close(outs[1].logits, outs[0].logits, atol=1e-5, rtol=1e-5)
        for t in (eager, compiled):
            t.commit()
    assert compiled.cache_len == eager.cache_len == PROMPT.numel() + 12 > 16
    assert compiled.compiled_steps >= 6  # every decode step above ran through the compiled layers
    c = compiled.cache_len
    torch.testing.assert_close(compiled.keys[:, :, :c], eager.keys[:, :, :c], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(compiled.values[:, :, :c], eager.values[:, :, :c], atol=1e-5, rtol=1e-5)


@needs_compiler
def test_every_graph_kind_matches_eager_steps(model, compiled):
    """One-token steps, small trees (inductor's own GEMM kernels on a CPU) and larger trees each run their own
    compiled graph; all give the eager logits, features and cache rows."""
    sizes = (1, 2, SMALL_TREE, SMALL_TREE + 1, 2 * SMALL_TREE + 3)
    assert [graph_kind(n) for n in sizes] == ["one", "small", "small", "large", "large"]
    eager = FastTarget(model, "eagle3", initial_capacity=16)
    for t in (eager, compiled):
        t.reset()
        t.forward(PROMPT)
        t.commit()
    for n in sizes:
        tokens = torch.arange(3, 3 + n)
        outs = [t.forward(tokens, tree_mask=torch.ones(n, n, dtype=torch.bool).tril_()) for t in (eager, compiled)]
        torch.testing.assert_close(outs[1].logits, outs[0].logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(outs[1].features, outs[0].features, atol=1e-5, rtol=1e-5)
        for t in (eager, compiled):
            t.commit(torch.arange(n // 2 + 1))
    c = compiled.cache_len
    torch.testing.assert_close(compiled.keys[:, :, :c], eager.keys[:, :, :c], atol=1e-5, rtol=1e-5)


@needs_compiler
def test_compiled_head_step_drafts_the_eager_trees(model):
    """With --compile the draft head's layer steps are compiled too: the same trees as the eager drafter, round
    after round, from the graphs compiled when the drafter was made (no recompiles while drafting)."""
    head = random_head(model, "eagle3")
    target = FastTarget(model, "eagle3")
    settings = TreeSettings(total_tokens=6, depth=3, top_k=2)
    before = len(_debug_get_cache_entry_list(HeadStep.forward.__code__))
    eager = eagle_drafter(head, target.embed_tokens, target.lm_head, "dynamic", settings)
    compiled_drafter = eagle_drafter(head, target.embed_tokens, target.lm_head, "dynamic", settings, compile=True)
    graphs = len(_debug_get_cache_entry_list(HeadStep.forward.__code__))
    assert graphs >= before + 2  # compiled by the drafter: one row, several rows
    gen = torch.Generator().manual_seed(0)
    features = 3 * model.config.hidden_size
    tokens = torch.randint(0, model.config.vocab_size, (10,), generator=gen)  # 9 committed tokens + the root
    new_features = torch.randn(9, features, generator=gen)  # the prompt's catch-up (eager)
    for k in (1, 3, 2, 1, 4):  # rounds that committed k tokens
        trees = [d.draft(tokens, new_features) for d in (eager, compiled_drafter)]
        assert torch.equal(trees[1].tokens, trees[0].tokens) and torch.equal(trees[1].parents, trees[0].parents)
        torch.testing.assert_close(trees[1].scores, trees[0].scores, atol=1e-4, rtol=1e-4)
        tokens = torch.cat([tokens, torch.randint(0, model.config.vocab_size, (k,), generator=gen)])
        new_features = torch.randn(k, features, generator=gen)
    assert len(_debug_get_cache_entry_list(HeadStep.forward.__code__)) == graphs  # no recompiles


@needs_compiler
def test_two_compiled_heads_keep_their_own_weights(model):
    """Guards on the head's module are dropped (compiled.without_module_guards): each head step's `owner` keeps a
    second head from running the first one's frozen graph."""
    target = FastTarget(model, "eagle3")
    settings = TreeSettings(total_tokens=6, depth=3, top_k=2)
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, model.config.vocab_size, (10,), generator=gen)
    new_features = torch.randn(9, 3 * model.config.hidden_size, generator=gen)
    more = torch.randint(0, model.config.vocab_size, (1,), generator=gen)
    more_features = torch.randn(1, 3 * model.config.hidden_size, generator=gen)
    trees = []
    for seed in (5, 6):
        head = random_head(model, "eagle3", seed=seed)
        pair = [eagle_drafter(head, target.embed_tokens, target.lm_head, "dynamic", settings, compile=compile)
                for compile in (False, True)]
        for d in pair:
            d.draft(tokens, new_features)  # the prompt's catch-up (eager)
        eager, compiled_tree = (d.draft(torch.cat([tokens, more]), more_features) for d in pair)  # compiled steps
        assert torch.equal(compiled_tree.tokens, eager.tokens)
        torch.testing.assert_close(compiled_tree.scores, eager.scores, atol=1e-4, rtol=1e-4)
        trees.append(eager)
    assert not torch.equal(trees[0].scores, trees[1].scores)  # two different heads


@needs_compiler
def test_compiled_speculative_decoding_gives_plain_decodings_tokens(model):
    head = random_head(model, "eagle3")
    plain = Engine.from_model(model, TinyTokenizer(), method="vanilla", backend="fast")
    # float32 graphs are not row-invariant (inductor's products): compiling them is an explicit --no-exact
    with pytest.raises(EagleSpecError, match="--no-exact"):
        Engine.from_model(model, TinyTokenizer(), head=head, method="eagle2", compile=True)
    spec = Engine.from_model(model, TinyTokenizer(), head=head, method="eagle2", compile=True, exact=False,
                             tree=TreeSettings(total_tokens=10, depth=4, top_k=3))
    assert spec.target.compiled and spec.target.stack is not None
    for prompt in PROMPTS:
        assert spec.generate(prompt, max_new_tokens=24).tokens == plain.generate(prompt, max_new_tokens=24).tokens
    assert spec.target.compiled_steps > len(PROMPTS)


def test_compile_is_refused_where_it_cannot_apply(model):
    with pytest.raises(EagleSpecError, match="--compile needs the fast path"):
        make_target(make_cpu_model("gemma3"), "final", compile=True)
    with pytest.raises(EagleSpecError, match="--compile needs the fast path"):
        make_target(model, "final", backend="hf", compile=True)
    with pytest.raises(EagleSpecError, match="not --quantize"):
        FastTarget(model, "final", quantize="int8", compile=True)
    with pytest.raises(EagleSpecError, match="add --no-exact"):  # float32: no kernels to keep it exact
        FastTarget(model, "final", row_invariant=True, compile=True)


def test_a_missing_compiler_is_reported(model, monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(EagleSpecError, match="needs a C.. compiler"):
        FastTarget(model, "final", compile=True)


@needs_compiler
def test_two_compiled_targets_in_one_process_keep_their_own_weights(compiled):
    """Each target's compiled layers are its own: a second model does not reuse the first one's frozen graph."""
    other = make_cpu_model("llama", seed=1, layers=3)
    eager, second = FastTarget(other, "final"), FastTarget(other, "final", compile=True)
    graphs = len(_debug_get_cache_entry_list(DecodeStack.forward.__code__))
    second.warm_up()
    assert len(_debug_get_cache_entry_list(DecodeStack.forward.__code__)) == graphs + 3  # one per graph kind
    for t in (eager, second, compiled):
        t.reset()
        t.forward(PROMPT)
        t.commit()
    outs = [t.forward(torch.tensor([9])) for t in (eager, second, compiled)]
    torch.testing.assert_close(outs[1].logits, outs[0].logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outs[1].features, outs[0].features, atol=1e-5, rtol=1e-5)
    assert outs[2].features.shape[-1] == 3 * outs[0].features.shape[-1]  # the first target still saves 3 layers
    assert second.compiled_steps == 4  # warm-up (one graph per kind: 3) + this step


def test_compile_settings_are_entered_only_where_dynamo_compiles():
    """call_compiled: a call whose graph exists runs without the (costly) settings context; a first call and a new
    shape compile inside it; an error of the function itself is raised once, not retried."""
    from contextlib import contextmanager

    from eaglespec.backends.cpu.compiled import call_compiled

    entered = []

    @contextmanager
    def settings():
        entered.append(True)
        yield

    compiled = torch.compile(lambda x: x * 2, backend="eager", dynamic=False)
    assert torch.equal(call_compiled(compiled, settings, torch.ones(3)), torch.full((3,), 2.0))
    assert len(entered) == 1  # the first call compiled inside the settings
    for _ in range(3):
        assert torch.equal(call_compiled(compiled, settings, torch.ones(3)), torch.full((3,), 2.0))
    assert len(entered) == 1  # warm calls did not enter them
    assert torch.equal(call_compiled(compiled, settings, torch.ones(5)), torch.full((5,), 2.0))
    assert len(entered) == 2  # a new (static) shape: compiled inside them

    calls = []

    def broken(x):
        calls.append(x)
        raise RuntimeError("out of memory")

    with pytest.raises(RuntimeError, match="out of memory"):
        call_compiled(broken, settings, torch.ones(3))
    assert len(calls) == 1 and len(entered) == 2
