"""Linear layers pre-packed for oneDNN (eaglespec.backends.cpu.packed) and their use in the fast path and the
drafter."""

from functools import partial

import pytest
import torch
import torch.nn.functional as F
from conftest import VOCAB, make_cpu_model
from oracles import tree_rows_and_steps
from test_engine import PROMPTS
from torch import nn

from eaglespec import envs
from eaglespec.backends.cpu import packed
from eaglespec.backends.cpu.apply import eagle_drafter
from eaglespec.errors import EagleSpecError
from eaglespec.heads import HeadConfig, build_head
from eaglespec.platform import cpu_has_native_bf16
from eaglespec.targets.fast import FastTarget, make_target
from eaglespec.targets.hf import TargetModel

pytestmark = pytest.mark.skipif(not packed.available(torch.float32, "cpu"), reason="this torch has no oneDNN")


def test_packed_product_matches_f_linear_with_and_without_bias():
    torch.manual_seed(0)
    w, b, x = torch.randn(96, 80), torch.randn(96), torch.randn(7, 80)
    torch.testing.assert_close(packed.pack(w, b)(x), F.linear(x, w, b), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed.pack(w)(x), F.linear(x, w), atol=1e-5, rtol=1e-5)
    assert packed.pack(w)(x[None]).shape == (1, 7, 96)


def test_each_row_is_computed_the_same_whatever_the_number_of_rows():
    """What lets a packed float32 target verify a tree bit-identically to one-token steps."""
    torch.manual_seed(0)
    layer = packed.pack(torch.randn(160, 128), torch.randn(160))
    x = torch.randn(48, 128)
    full = layer(x)
    for rows in (1, 2, 3, 5, 8, 16, 24):
        assert torch.equal(torch.cat([layer(x[i:i + rows]) for i in range(0, 48, rows)]), full)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_wide_products_are_split_so_every_row_is_computed_the_same(dtype):
    """SmolLM2's down projection (1536 -> 576): one packed product is not row-invariant on every CPU; the chunked
    form `--exact` uses is, and stays a faithful product."""
    if not packed.available(dtype, "cpu"):
        pytest.skip(f"no packed {dtype} on this CPU")
    torch.manual_seed(0)
    weight, bias = (torch.randn(576, 1536) * 0.05).to(dtype), torch.randn(576).to(dtype)
    layer = packed.pack_row_invariant(weight, bias)
    assert isinstance(layer, packed.ChunkedPackedLinear) and [b - a for a, b in layer.bounds] == [768, 768]
    x = torch.randn(64, 1536).to(dtype)
    single = torch.cat([layer(x[i:i + 1]) for i in range(64)])  # [64, 576]
    for rows in (2, 3, 4, 6, 8, 16, 64):
        assert torch.equal(torch.cat([layer(x[i:i + rows]) for i in range(0, 64, rows)]), single)
    reference = F.linear(x.float(), weight.float(), bias.float())
    assert torch.allclose(single.float(), reference, atol=0.05 if dtype == torch.bfloat16 else 1e-4, rtol=0.02)
    assert isinstance(packed.pack_row_invariant(weight[:, :1024]), packed.PackedLinear)  # narrow enough: one product


def test_availability_follows_dtype_and_device():
    assert packed.available(torch.float32, "cpu")
    assert not packed.available(torch.float16, "cpu") and not packed.available(torch.float32, "meta")
    assert not packed.available(torch.bfloat16, "meta")
    if not cpu_has_native_bf16():  # emulated bfloat16 products would be slower than unpacked ones
        assert not packed.available(torch.bfloat16, "cpu")


needs_bf16 = pytest.mark.skipif(not packed.available(torch.bfloat16, "cpu"),
                                reason="packing bfloat16 needs a CPU with native bfloat16 (AVX-512 BF16 or AMX)")


@needs_bf16
def test_packed_bfloat16_equals_f_linear_and_is_row_invariant():
    """Packing a bfloat16 weight changes the speed, not the numbers: the same bits as `F.linear`, for any rows."""
    torch.manual_seed(0)
    w, b = torch.randn(160, 128).bfloat16(), torch.randn(160).bfloat16()
    x = torch.randn(48, 128).bfloat16()
    layer = packed.pack(w, b)
    assert layer.weight.dtype == torch.bfloat16
    full = layer(x)
    assert full.dtype == torch.bfloat16 and torch.equal(full, F.linear(x, w, b))
    for rows in (1, 3, 8, 16):
        assert torch.equal(torch.cat([layer(x[i:i + rows]) for i in range(0, 48, rows)]), full)


@needs_bf16
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_packed_bfloat16_target_with_row_invariant_attention_is_bit_exact(arch, monkeypatch):
    """bfloat16: packed products, float32 attention over a float32 cache, row by row: bit-identical tree rows.
    A 300-token prefix and head size 64: there the batched attention call differs from one-token steps in bfloat16
    (by ~0.016 of a logit on this model with torch 2.13), which is what row-by-row attention removes. (Where
    eaglespec's kernels build, the default target runs on them instead: this is the path without them.)"""
    monkeypatch.setenv(envs.BF16_GEMM, "0")  # no kernels: neither their products nor their attention
    model = make_cpu_model(arch, hidden_size=256, max_position_embeddings=1024).to(torch.bfloat16)
    target = make_target(model, "final")
    assert isinstance(target, FastTarget) and target.pack and target.attention_dtype == torch.float32
    assert target.row_invariant and not target.attention_kernel
    assert target.keys.dtype == torch.float32
    prompt = torch.randint(0, VOCAB, (300,), generator=torch.Generator().manual_seed(0))
    tree, steps, chain = tree_rows_and_steps(target, prompt, [7, 3, 9])
    assert torch.equal(tree, steps) and torch.equal(chain, steps)


@needs_bf16
def test_bfloat16_target_is_packed_and_matches_the_unpacked_one():
    model = make_cpu_model("llama").to(torch.bfloat16)
    prompt = torch.tensor(PROMPTS[0])
    on, off = FastTarget(model, "final"), FastTarget(model, "final", pack=False)
    assert on.pack and not off.pack
    a, b = on.forward(prompt), off.forward(prompt)
    assert torch.equal(a.logits, b.logits) and torch.equal(a.features, b.features)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_packed_float32_target_with_row_invariant_attention_is_bit_exact(arch):
    """Packed layers plus row-by-row attention: a verified tree row equals the one-token steps bit for bit."""
    target = make_target(make_cpu_model(arch), "final")
    assert isinstance(target, FastTarget) and target.pack and target.row_invariant  # the float32 defaults: exact
    assert not make_target(make_cpu_model(arch), "final", exact=False).row_invariant  # --no-exact: batched
    tree, steps, chain = tree_rows_and_steps(target, torch.tensor(PROMPTS[1]), [7, 3, 9])
    assert torch.equal(tree, steps) and torch.equal(chain, steps)


def test_packed_and_unpacked_targets_agree():
    model = make_cpu_model("llama")
    prompt = torch.tensor(PROMPTS[0])
    on, off = FastTarget(model, "final"), FastTarget(model, "final", pack=False)
    assert on.pack and not off.pack
    a, b = on.forward(prompt), off.forward(prompt)
    torch.testing.assert_close(a.logits, b.logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(a.features, b.features, atol=1e-4, rtol=1e-4)


def test_packing_is_refused_where_it_cannot_apply():
    with pytest.raises(EagleSpecError, match="pack=True"):
        FastTarget(make_cpu_model("llama"), "final", quantize="int8", pack=True)


def test_pack_linears_copies_the_module_and_keeps_its_outputs():
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(32, 48), nn.SiLU(), nn.Sequential(nn.Linear(48, 16, bias=False)))
    fast = packed.pack_linears(block)
    assert isinstance(fast[0], packed.PackedLinearModule) and isinstance(fast[2][0], packed.PackedLinearModule)
    assert isinstance(block[0], nn.Linear)  # the original is untouched
    x = torch.randn(5, 32)
    with torch.inference_mode():
        torch.testing.assert_close(fast(x), block(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("vocab", [None, 40])
def test_eagle1_logits_are_packed_in_inference_mode_only(vocab):
    """The CPU backend (apply.eagle_drafter) has a float32 EAGLE-1 head pack its rows of the target's LM head for
    oneDNN; a head on its own, and any call outside inference mode, keeps torch's product."""
    model = make_cpu_model("llama")
    target = TargetModel(model)
    head = build_head(HeadConfig.for_target(target, "eagle1")).eval()
    if vocab:
        head.set_draft_vocab(torch.randperm(VOCAB)[:vocab])
    hidden = torch.randn(3, model.config.hidden_size)
    with torch.inference_mode():
        head.logits(hidden, target.lm_head)
    assert head._rows is None or not isinstance(head._rows[1], packed.PackedLinear)  # not applied: torch
    run = eagle_drafter(head, target.embed_tokens, target.lm_head).head
    with torch.no_grad():
        plain = run.logits(hidden, target.lm_head)
    with torch.inference_mode():
        fast = run.logits(hidden, target.lm_head)
    assert isinstance(run._rows[1], packed.PackedLinear)
    torch.testing.assert_close(fast, plain, atol=1e-5, rtol=1e-5)
    assert fast.shape == (3, vocab or VOCAB)


def test_eagle1_logits_use_the_packer_the_drafter_sets():
    """A drafter's kernel (bf16gemm.Int8Linear / Bf16Linear) packs the draft rows in inference mode whether or not
    oneDNN could (it cannot for bfloat16 on a CPU without native bfloat16); training calls keep torch's product."""
    model = make_cpu_model("llama")
    target = TargetModel(model)
    head = build_head(HeadConfig.for_target(target, "eagle1")).eval()
    head.set_draft_vocab(torch.arange(0, VOCAB, 3))
    packed_shapes = []

    def packer(rows, bias):
        packed_shapes.append(tuple(rows.shape))
        return partial(F.linear, weight=rows.clone(), bias=bias)

    head.pack_rows = packer
    hidden = torch.randn(2, model.config.hidden_size)
    with torch.no_grad():
        plain = head.logits(hidden, target.lm_head)
    assert packed_shapes == []
    with torch.inference_mode():
        first, again = head.logits(hidden, target.lm_head), head.logits(hidden, target.lm_head)
    assert packed_shapes == [(len(range(0, VOCAB, 3)), model.config.hidden_size)]  # packed once, then reused
    assert torch.equal(first, again)
    torch.testing.assert_close(first, plain)


def test_row_by_row_attention_leaves_every_step_key_in_its_row():
    """Branching rows borrow the cache rows after the prefix for their paths; afterwards every tree token's key and
    value must be back in its own row, as the batched step leaves them, or committing the accepted path breaks."""
    model = make_cpu_model("llama")
    exact, batched = FastTarget(model, "final", row_invariant=True), FastTarget(model, "final")
    parents = [-1, 0, 0, 2, 1, 3]  # rows 2, 3, 5 (and 4) see non-contiguous step rows
    mask = torch.eye(6, dtype=torch.bool)
    for r in range(6):
        p = parents[r]
        while p >= 0:
            mask[r, p], p = True, parents[p]
    depth = mask.sum(1) - 1
    prompt, tokens = torch.tensor(PROMPTS[2]), torch.tensor([5, 9, 11, 3, 7, 2])
    c = prompt.numel()
    for target in (exact, batched):
        target.forward(prompt)
        target.commit()
        target.forward(tokens, c + depth, mask)
    rows = slice(c, c + 6)
    assert torch.equal(exact.keys[0, :, rows], batched.keys[0, :, rows])  # layer 0: the same numbers in both
    assert torch.equal(exact.values[0, :, rows], batched.values[0, :, rows])
    torch.testing.assert_close(exact.keys[:, :, rows], batched.keys[:, :, rows], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(exact.values[:, :, rows], batched.values[:, :, rows], atol=1e-5, rtol=1e-5)


def test_full_vocabulary_eagle1_drafter_shares_the_targets_packed_lm_head():
    from conftest import TinyTokenizer
    from test_engine import random_head

    from eaglespec.api import Engine

    model = make_cpu_model("llama", seed=3)
    head = random_head(model, "eagle1")
    head.set_draft_vocab(None)
    engine = Engine.from_model(model, TinyTokenizer(), head=head, tree=None)
    drafter_head = engine.drafter.head
    assert engine.target.pack and drafter_head._rows[1] is engine.target.logits_head  # no second packed copy
    hidden = torch.randn(3, model.config.hidden_size)
    with torch.inference_mode():
        shared = drafter_head.logits(hidden, engine.target.lm_head)
    assert drafter_head._rows[1] is engine.target.logits_head
    torch.testing.assert_close(shared, F.linear(hidden, model.lm_head.weight), atol=1e-5, rtol=1e-5)
    drafter_head.set_draft_vocab(torch.arange(10))  # a subset packs its own rows
    with torch.inference_mode():
        assert drafter_head.logits(hidden, engine.target.lm_head).shape == (3, 10)
    assert drafter_head._rows[1] is not engine.target.logits_head


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exact_engine_gives_plain_decodings_tokens(dtype):
    """`exact=True` (--exact): row-by-row verify passes, so a random head's trees reproduce plain decoding."""
    if not packed.available(dtype, "cpu"):
        pytest.skip("bit-exact products need packed weights: bfloat16 ones need a CPU with native bfloat16")
    from conftest import TinyTokenizer
    from test_engine import random_head

    from eaglespec import Engine, TreeSettings

    model = make_cpu_model("qwen2").to(dtype)
    head = random_head(model, "eagle1").to(dtype)
    engine = Engine.from_model(model, TinyTokenizer(), head=head, method="eagle2", exact=True,
                               tree=TreeSettings(total_tokens=12, depth=4, top_k=3))
    plain = Engine.from_model(model, TinyTokenizer(), method="vanilla", exact=False)
    assert engine.target.row_invariant and not plain.target.row_invariant
    for prompt in PROMPTS:
        assert engine.generate(prompt, max_new_tokens=24).tokens == plain.generate(prompt, max_new_tokens=24).tokens


def test_exact_needs_the_fast_path():
    from conftest import TinyTokenizer

    from eaglespec import Engine

    with pytest.raises(EagleSpecError, match="--exact needs the fast path"):
        Engine.from_model(make_cpu_model("llama"), TinyTokenizer(), method="vanilla", backend="hf", exact=True)
    with pytest.raises(EagleSpecError, match="--exact needs the fast path"):
        Engine.from_model(make_cpu_model("gemma3"), TinyTokenizer(), method="vanilla", exact=True)
