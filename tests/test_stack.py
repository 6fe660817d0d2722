"""The kernels' decoder stack (backends.cpu.stack, csrc/common/decoder_stack.h): a target's layers in one call into
the kernels. It computes the model the layers in Python compute (close logits and features, the same greedy
tokens: other roundings, RMSNorm's sums in another order), keeps every row's bits its own (verify rows against
one-token steps: test_tree_attention.py; batched rows against batch-1 steps and prompts read in pieces:
test_batch.py), takes over `--compile`'s work on a target (nothing compiled, plain decoding's tokens), and rejects
bad arguments with a clear error. Skipped where the kernels do not build."""

import dataclasses
import time

import pytest
import torch
from conftest import TinyTokenizer, make_cpu_model
from test_engine import PROMPTS, random_head
from test_fastpath import PROMPT, TREE

from eaglespec import Engine, TreeSettings
from eaglespec.backends.cpu import kernels as bf16gemm
from eaglespec.backends.cpu import q4, q6
from eaglespec.backends.cpu.stack import Q4_KIND, Q6_KIND, KernelStack
from eaglespec.targets.fast import FastTarget

pytestmark = [
    pytest.mark.skipif(not bf16gemm.cpu_supported(), reason="this CPU has neither AVX-512 BF16 nor AVX2 + FMA"),
    pytest.mark.skipif(not bf16gemm.can_build(), reason="building the kernels needs a C++ compiler and ninja"),
]


@pytest.fixture(scope="module")
def model():
    return make_cpu_model("qwen2", layers=3).to(torch.bfloat16)  # q/k/v biases, GQA, untied LM head


def targets(model, monkeypatch, feature_kind: str = "eagle3") -> tuple[FastTarget, FastTarget]:
    """(the default target: its layers as the kernel stack, the same target with its layers in Python)."""
    stacked = FastTarget(model, feature_kind)
    monkeypatch.setenv("EAGLESPEC_STACK", "0")
    python = FastTarget(model, feature_kind)
    monkeypatch.delenv("EAGLESPEC_STACK")
    assert stacked.kernel_stack is not None and python.kernel_stack is None
    return stacked, python


def test_the_stack_computes_what_the_layers_in_python_compute(model, monkeypatch):
    stacked, python = targets(model, monkeypatch)
    outs = []
    for t in (stacked, python):
        t.reset()
        prefill = t.forward(PROMPT)
        t.commit()
        step = t.forward(torch.tensor([7]))
        t.commit()
        verify = t.forward(TREE.tokens, TREE.positions(t.cache_len), TREE.ancestor_mask())
        outs.append((prefill, step, verify))
    for a, b in zip(*outs):
        # bfloat16 activations rounded at other places: close, not equal
        torch.testing.assert_close(a.logits, b.logits, atol=0.1, rtol=0.05)
        assert a.features.shape == b.features.shape  # three layers' inputs side by side (EAGLE-3)
        torch.testing.assert_close(a.features.float(), b.features.float(), atol=0.05, rtol=0.05)
        assert torch.equal(a.logits.argmax(-1), b.logits.argmax(-1))
    c = stacked.cache_len
    torch.testing.assert_close(stacked.keys[:, :, :c].float(), python.keys[:, :, :c].float(), atol=0.05, rtol=0.05)
    torch.testing.assert_close(stacked.values[:, :, :c].float(), python.values[:, :, :c].float(), atol=0.05,
                               rtol=0.05)


def codes_near(weight: torch.Tensor) -> q6.Codes:
    """6-bit codes close to a weight [N, K]: s = max |w| / 31 per 16 input channels."""
    n, k = weight.shape
    blocks = weight.float().view(n, k // 16, 16)
    s = (blocks.abs().amax(-1) / 31).clamp_min(1e-8)  # [N, K/16]
    q = (blocks / s[..., None]).round().clamp(-32, 31) + 32
    return q6.Codes(s.contiguous(), q.to(torch.uint8).view(n, k))


def blocks_near(weight: torch.Tensor) -> q4.Blocks:
    """4-bit blocks close to a weight [N, K] (Q4_1: d, m float16 per 32 input channels)."""
    n, k = weight.shape
    blocks = weight.float().view(n, k // 32, 32)
    low, high = blocks.amin(-1), blocks.amax(-1)
    d, m = ((high - low) / 15).clamp_min(1e-6).half(), low.half()
    q = ((blocks - m.float()[..., None]) / d.float()[..., None]).round().clamp(0, 15)
    return q4.Blocks(d, m, q.to(torch.uint8).view(n, k))


@pytest.mark.skipif(not (q4.available() and q6.available()), reason="the 4-bit and 6-bit products are off here")
def test_the_stack_runs_4_bit_and_6_bit_products_as_the_layers_in_python_do(model, monkeypatch):
    """Products of every kind in one stack (a GGUF target's mix: bfloat16 q/k/v, 4-bit blocks, 6-bit codes, a q/k/v
    split into a 4-bit q and k and a 6-bit v): the stack's logits and features are the Python layers' over the same
    packed weights, and the greedy tokens equal."""
    stacked, python = targets(model, monkeypatch)
    attention = model.model.layers[0].self_attn  # layer 0's q and k as 4-bit blocks, its v as codes (q4.SplitLinear)
    qkv = q4.SplitLinear([q4.Q4Linear(blocks_near(torch.cat([attention.q_proj.weight, attention.k_proj.weight])),
                                      torch.cat([attention.q_proj.bias, attention.k_proj.bias])),
                          q6.Q6Linear(codes_near(attention.v_proj.weight), attention.v_proj.bias)])
    mlps = [layer.mlp for layer in model.model.layers]
    down = [q6.Q6Linear(codes_near(mlp.down_proj.weight)) for mlp in mlps]  # [d, I]
    gate_up = [q4.Q4Linear(blocks_near(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))) for mlp in mlps]
    for t in (stacked, python):  # (new layer records: targets of one model share theirs)
        t.layers = [dataclasses.replace(layer, down=down[i], gate_up=gate_up[i] if i % 2 else layer.gate_up,
                                        qkv=qkv if i == 0 else layer.qkv) for i, layer in enumerate(t.layers)]
    stacked.kernel_stack = KernelStack.of(stacked.layers, (stacked.n_heads, stacked.n_kv, stacked.head_dim),
                                          stacked.eps)
    s = stacked.kernel_stack
    assert s.parts[:5] == [2, 1, 1, 1, 1] and s.kinds[:2] == [Q4_KIND, Q6_KIND]
    assert s.kinds[4] == Q6_KIND and s.kinds[7] == Q4_KIND  # layer 0's down, layer 1's gate/up
    outs = []
    for t in (stacked, python):
        t.reset()
        prefill = t.forward(PROMPT)
        t.commit()
        verify = t.forward(TREE.tokens, TREE.positions(t.cache_len), TREE.ancestor_mask())
        outs.append((prefill, verify))
    for a, b in zip(*outs):
        torch.testing.assert_close(a.logits, b.logits, atol=0.1, rtol=0.05)
        torch.testing.assert_close(a.features.float(), b.features.float(), atol=0.05, rtol=0.05)
        assert torch.equal(a.logits.argmax(-1), b.logits.argmax(-1))


def test_the_stack_saves_the_inputs_of_the_feature_layers(model, monkeypatch):
    """EAGLE-3's features are the inputs of three layers: the first of them is the embedding itself (layer 0)."""
    stacked, _ = targets(model, monkeypatch)
    layers = stacked.eagle3_layers()
    out = stacked.forward(PROMPT)
    d = model.config.hidden_size
    by_layer = dict(zip(layers, out.features.split(d, dim=-1)))
    if 0 in by_layer:
        assert torch.equal(by_layer[0], stacked.embed_tokens(PROMPT))


@pytest.mark.parametrize("method", ["eagle2", "vanilla"])
def test_compile_leaves_a_stacked_target_uncompiled_and_exact(model, method):
    """With the stack, --compile compiles no target graph (as fast without: the stack has no Python between the
    kernels) and decoding still gives plain decoding's tokens."""
    plain = Engine.from_model(model, TinyTokenizer(), method="vanilla")
    head = random_head(model, "eagle3").to(torch.bfloat16) if method == "eagle2" else None
    start = time.perf_counter()
    engine = Engine.from_model(model, TinyTokenizer(), head=head, method=method, compile=True,
                               tree=TreeSettings(total_tokens=8, depth=4, top_k=3))
    target = engine.target
    assert target.compiled and target.kernel_stack is not None and target.stack is None
    assert target.warm_up() == 0.0
    for prompt in PROMPTS[:2]:
        assert engine.generate(prompt, max_new_tokens=24).tokens == plain.generate(prompt, max_new_tokens=24).tokens
    assert target.compiled_steps == 0
    assert time.perf_counter() - start < 600  # (a draft head's steps do compile)


def test_it_applies_only_where_every_product_runs_on_the_kernels(model, monkeypatch):
    stacked, _ = targets(model, monkeypatch)
    heads = (stacked.n_heads, stacked.n_kv, stacked.head_dim)
    assert KernelStack.of(stacked.layers, heads, stacked.eps) is not None
    oneDNN = FastTarget(model, "final", kernels=False)  # torch's products
    assert oneDNN.kernel_stack is None
    assert KernelStack.of(oneDNN.layers, heads, oneDNN.eps) is None
    assert FastTarget(make_cpu_model("llama", layers=2), "final").kernel_stack is None  # float32: no kernels


def test_bad_arguments_are_a_clear_error(model, monkeypatch):
    stacked, _ = targets(model, monkeypatch, "final")
    s = stacked.kernel_stack
    x = stacked.embed_tokens(PROMPT)  # [n, d]
    n = x.shape[0]
    cos, sin = stacked.cos[:n], stacked.sin[:n]
    caches = ([stacked.layer_keys], [stacked.layer_values])
    good = dict(cached=[0], sizes=[n], step_masks=[None])
    s(x, cos, sin, *caches, **good)  # (works)
    with pytest.raises(RuntimeError, match="bfloat16"):
        s(x.float(), cos, sin, *caches, **good)
    with pytest.raises(RuntimeError, match="one cache per layer and sequence"):
        torch.ops.eaglespec.decoder_stack(x, cos, sin, s.norms, s.packed, s.outs, s.kinds, s.biases, s.parts,
                                          stacked.layer_keys[:1], stacked.layer_values[:1], [0], [n], [None],
                                          *s.heads[:2], s.eps, [])
    with pytest.raises(RuntimeError, match="cos and sin"):
        s(x, cos[:1], sin[:1], *caches, **good)
    with pytest.raises(RuntimeError, match="sizes add up"):
        s(x, cos, sin, *caches, cached=[0], sizes=[n - 1], step_masks=[None])
    with pytest.raises(RuntimeError, match="two norms and four products"):
        torch.ops.eaglespec.decoder_stack(x, cos, sin, s.norms[:1], s.packed, s.outs, s.kinds, s.biases, s.parts,
                                          stacked.layer_keys, stacked.layer_values, [0], [n], [None], *s.heads[:2],
                                          s.eps, [])
    with pytest.raises(RuntimeError, match="one packed weight, output size, kind and bias per part"):
        torch.ops.eaglespec.decoder_stack(x, cos, sin, s.norms, s.packed, s.outs, s.kinds, s.biases,
                                          [2] + s.parts[1:], stacked.layer_keys, stacked.layer_values, [0], [n],
                                          [None], *s.heads[:2], s.eps, [])


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """bf16(bf16(g / (1 + e^-g)) * up), each step in float64 then rounded as the kernels round it."""
    inter = gate_up.shape[1] // 2
    g, up = gate_up[:, :inter].double(), gate_up[:, inter:].float()
    act = (g / (1 + torch.exp(-g))).float().bfloat16().float()
    return (act * up).bfloat16()


def test_the_stack_s_silu_is_the_formula_and_each_value_s_own():
    """The SwiGLU activation between the gate/up and down products (a vector exp, ~1 ulp): the formula's bfloat16
    value for all but a few values a float32 ulp of e^-g moves across a rounding boundary, those one bfloat16 step
    off; extreme gates (below e^88's range, infinities, NaN) as the formula's limits; and a value's bits the same
    wherever it lies (row, lane, a row's tail past the last whole vector)."""
    bf16gemm.load()
    torch.manual_seed(0)
    inter = 8960 + 13  # (a tail of 13 values past the last whole vector of 16 or 8)
    gate_up = torch.cat([torch.randn(6, inter) * 4, torch.randn(6, inter)], 1).bfloat16()
    got = torch.ops.eaglespec.silu_mul(gate_up)
    want = silu_mul_reference(gate_up)
    off = got != want
    assert off.float().mean() < 1e-3  # the vector exp's last bit, rarely past a bfloat16 rounding boundary
    steps = (got[off].view(torch.int16).int() - want[off].view(torch.int16).int()).abs()
    assert steps.numel() == 0 or steps.max() == 1
    # each value's bits are its own: rows alone, and a value moved to another lane and row
    for r in range(6):
        assert torch.equal(torch.ops.eaglespec.silu_mul(gate_up[r:r + 1]), got[r:r + 1])
    shifted = torch.cat([gate_up[:, 5:inter], gate_up[:, inter + 5:]], 1)
    assert torch.equal(torch.ops.eaglespec.silu_mul(shifted), got[:, 5:])
    # the formula's limits
    gates = torch.tensor([-1000.0, -100.0, -88.5, -87.0, -20.0, 0.0, 20.0, 100.0, float("inf"), float("-inf"),
                          float("nan")])
    y = torch.ops.eaglespec.silu_mul(torch.cat([gates, torch.full_like(gates, 3.0)])[None].bfloat16())[0].float()
    assert (y[:4].abs() < 1e-30).all() and y[4].item() == pytest.approx(-20 * 3 / (1 + 4.85e8), rel=0.01)
    assert y[5] == 0 and y[6] == 60 and y[7] == 300 and y[8] == float("inf") and y[10].isnan()
    assert y[9] == float("-inf")  # (e^-g clamped to e^88: -inf / e^88, where the formula's -inf / inf is NaN)
    with pytest.raises(RuntimeError, match=r"\[N, 2 I\] bfloat16"):
        torch.ops.eaglespec.silu_mul(torch.randn(2, 7).bfloat16())
