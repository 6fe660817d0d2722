"""The 4-bit block and 6-bit code products with int8 inputs (`--activations int8`: q4_q8_linear, q6_q8_linear), as
llama.cpp multiplies its blocks: each row's inputs quantized per block of 32 (sx = max |x| / 127, xq = x / sx rounded
to nearest even), integer sums, then the blocks' scales in float32. They compute exactly the product of the weights
with the rounded inputs (up to float32 and bfloat16 rounding), give a row the same bits alone or in any call
(row-invariant) and on every build of the kernels, and a target running them decodes speculatively to its own plain
decoding's tokens; draft models run them by default. Needs a build of the kernels and a compiler, like test_q4.py."""

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import TinyTokenizer, make_cpu_model
from gguf import GGMLQuantizationType
from test_engine import PROMPTS, random_head
from test_kquant import (  # noqa: F401 (fixtures)
    assert_exact_and_row_invariant,
    gguf_weight,
    mixed_model,
    q4_k_model,
    random_q4_k,
    random_q5_0,
    random_q6_k,
)

from eaglespec import cli, platform
from eaglespec.api import Engine, TreeSettings
from eaglespec.backends.cpu import apply, kquant, q4, q6, stack
from eaglespec.backends.cpu import kernels as bf16gemm
from eaglespec.backends.cpu.apply import wants_int8_inputs
from eaglespec.bench.methods import MethodContext, build_methods
from eaglespec.errors import EagleSpecError
from eaglespec.targets import source
from eaglespec.targets.fast import FastTarget, make_target

needs_kernel = pytest.mark.skipif(not (q4.available() and bf16gemm.can_build()),
                                  reason="the 4-bit product needs a CPU with AVX2 + FMA + F16C and a C++ compiler")


def quantized(x: torch.Tensor) -> torch.Tensor:
    """The inputs as the int8 products see them, sx xq, in float64: per block of 32, sx = max |x| / 127 and
    xq = round(x / sx) (ties to even), both in float32 as the kernels compute them."""
    m, k = x.shape
    blocks = x.float().view(m, k // 32, 32)
    sx = blocks.abs().amax(-1, keepdim=True) / 127  # [M, B, 1]
    xq = torch.where(sx > 0, torch.round(blocks / sx), 0.0).clamp(-127, 127)
    return (xq.double() * sx.double()).view(m, k)


def assert_product_of_quantized_inputs(layer, weight: torch.Tensor, bias: torch.Tensor) -> None:
    """70 rows: the product is the float64 one of the quantized inputs up to float32 and bfloat16 rounding, and each
    row's bits are its own (alone, in the first r rows, after other rows)."""
    k = weight.shape[1]
    x = (torch.randn(70, k) * torch.rand(70, 1) * 4).bfloat16()
    x[3, :32] = 0  # a block of zeros (sx = 0)
    whole = layer(x)
    exact = quantized(x) @ weight.double().T + bias.double()
    bound = exact.abs() * 2**-8 + 1e-5 * k * (quantized(x).abs() @ weight.double().abs().T)
    assert ((whole.double() - exact).abs() <= bound).all()
    plain = x.double() @ weight.double().T + bias.double()
    assert not torch.equal(whole, plain.to(whole.dtype))  # (the inputs were rounded: another product)
    for rows in range(1, 19):
        assert torch.equal(layer(x[:rows]), whole[:rows]), rows
        assert torch.equal(layer(x[rows : rows + 1]), whole[rows : rows + 1]), rows
    for rows in (31, 32, 33, 64, 65, 70):
        assert torch.equal(layer(x[:rows]), whole[:rows]), rows
    assert torch.equal(layer(x[5:50]), whole[5:50])


@needs_kernel
@pytest.mark.parametrize("kind", ["Q4_K", "Q4_1", "Q6_K", "Q5_0"])
def test_int8_input_products_are_the_products_of_the_rounded_inputs_and_row_invariant(kind):
    bf16gemm.load()
    n, k = 72, 512
    generator = torch.Generator().manual_seed(0)
    if kind == "Q4_K":
        raw = random_q4_k(n, k, seed=5)
        layer_weight = (kquant.q4_k_blocks(raw, n, k), gguf_weight(raw, n, k))
    elif kind == "Q4_1":
        d = (0.004 + 0.008 * torch.rand(n, k // 32, generator=generator)).half()
        m = (-d.float() * (7 + 2 * torch.rand(d.shape, generator=generator))).half()
        blocks = q4.Blocks(d, m, torch.randint(0, 16, (n, k), generator=generator, dtype=torch.uint8))
        layer_weight = (blocks, blocks.weight())
    else:
        raw = random_q6_k(n, k, seed=5) if kind == "Q6_K" else random_q5_0(n, k, seed=5)
        codes = (kquant.q6_k_codes if kind == "Q6_K" else kquant.q5_0_codes)(raw, n, k)
        layer_weight = (codes, gguf_weight(raw, n, k, GGMLQuantizationType[kind]))
    packing, weight = layer_weight
    product = q6.Q6Linear if kind in ("Q6_K", "Q5_0") else q4.Q4Linear
    bias = torch.randn(n)
    layer = product(packing, bias, int8_inputs=True)
    assert layer.int8_inputs and stack._kind(layer) == stack._kind(product(packing, bias)) + stack.INT8_INPUTS
    assert_product_of_quantized_inputs(layer, weight, bias)
    # the same packing still multiplies bfloat16 inputs exactly where int8_inputs is off
    assert_exact_and_row_invariant(product.from_packed(layer.packed, (n, k), bias), weight, bias)


@needs_kernel
def test_a_non_finite_input_makes_its_row_nan_and_leaves_the_others():
    bf16gemm.load()
    n, k = 40, 256
    raw = random_q4_k(n, k, seed=2)
    for layer in (q4.Q4Linear(kquant.q4_k_blocks(raw, n, k), int8_inputs=True),
                  q6.Q6Linear(kquant.q6_k_codes(random_q6_k(n, k, seed=2), n, k), int8_inputs=True)):
        x = torch.randn(4, k).bfloat16()
        clean = layer(x)
        x[1, 70] = float("inf")
        x[2, 3] = float("nan")
        out = layer(x)
        assert out[1:3].float().isnan().all()
        assert torch.equal(out[0], clean[0]) and torch.equal(out[3], clean[3])


CROSS_BUILD = """
import json, sys, torch
from test_kquant import random_q4_k, random_q6_k
from eaglespec.backends.cpu import kernels, kquant, q4, q6
kernels.load()
n, k = 72, 512
x = (torch.randn(13, k, generator=torch.Generator().manual_seed(1)) * 3).bfloat16()
out = {}
out["q4"] = q4.Q4Linear(kquant.q4_k_blocks(random_q4_k(n, k, seed=7), n, k), int8_inputs=True)(x)
out["q6"] = q6.Q6Linear(kquant.q6_k_codes(random_q6_k(n, k, seed=7), n, k), int8_inputs=True)(x)
print(json.dumps({"isa": kernels.isa().name, **{key: y.view(torch.int16).tolist() for key, y in out.items()}}))
"""


@needs_kernel
def test_every_build_gives_the_same_bits():
    """The integer sums are exact in any order and the float steps after them are the same on every build, so the
    AVX2 build (forced here; on an AVX2-only CPU it is the only build) gives the AVX-512 (and AMX) build's bits."""
    outputs = []
    for isa in ("auto", "avx2"):
        env = {**os.environ, bf16gemm.ISA_ENV: isa,
               "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")])}
        done = subprocess.run([sys.executable, "-c", CROSS_BUILD], capture_output=True, text=True, env=env,
                              timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        outputs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    assert outputs[1]["isa"] == "avx2"
    assert outputs[0]["q4"] == outputs[1]["q4"] and outputs[0]["q6"] == outputs[1]["q6"]


@needs_kernel
def test_speculative_decoding_with_int8_inputs_gives_plain_decodings_tokens(mixed_model):  # noqa: F811
    """A target whose 4-bit and 6-bit products take int8 inputs (kinds 4 and 5 in the decoder stack, a Q6_K v beside
    Q4_K q and k split in two products) decodes speculatively to its own plain decoding's tokens; its logits are
    near the bfloat16-input target's, not equal."""
    target = FastTarget(mixed_model, "final", activations="int8")
    assert target.activations == "int8" and (target.q4_matrices, target.q6_matrices) == (4, 5)
    products = [p for layer in target.layers for linear in (layer.qkv, layer.o, layer.gate_up, layer.down)
                for p in (linear.parts if isinstance(linear, q4.SplitLinear) else (linear,))]
    assert all(p.int8_inputs for p in products)
    if target.kernel_stack is not None:
        assert set(target.kernel_stack.kinds) == {stack.Q4_KIND + stack.INT8_INPUTS, stack.Q6_KIND + stack.INT8_INPUTS}
    ids = torch.randint(0, mixed_model.config.vocab_size, (12,), generator=torch.Generator().manual_seed(0))
    bf16 = FastTarget(mixed_model, "final")
    assert bf16.activations == "bfloat16"
    want = bf16.forward(ids).logits.float()
    got = target.forward(ids).logits.float()
    assert not torch.equal(got, want) and (got - want).norm() < 0.05 * want.norm()

    plain = Engine.from_model(mixed_model, TinyTokenizer(), method="vanilla", activations="int8")
    spec = Engine.from_model(mixed_model, TinyTokenizer(), head=random_head(mixed_model, "eagle1").to(torch.bfloat16),
                             method="eagle2", tree=TreeSettings(total_tokens=8, depth=3, top_k=3),
                             activations="int8")
    assert plain.target.activations == spec.target.activations == "int8"
    for prompt in PROMPTS:
        assert spec.generate(prompt, max_new_tokens=20).tokens == plain.generate(prompt, max_new_tokens=20).tokens


@needs_kernel
def test_an_engine_takes_int8_inputs_for_a_gguf_model_where_they_measured_faster(mixed_model):  # noqa: F811
    """`activations="auto"`, an engine's default (the CLI's and the bench's too): int8 inputs for a GGUF model's block
    products on the kernels' AVX-512 and AVX2 builds, bfloat16 on the AMX build; the same tokens as asking for that
    arithmetic, and speculative output equal to plain decoding's. The bench records what ran, not "auto"."""
    want = "int8" if wants_int8_inputs("auto", bf16_gemm=True) else "bfloat16"
    plain = Engine.from_model(mixed_model, TinyTokenizer(), method="vanilla")
    spec = Engine.from_model(mixed_model, TinyTokenizer(), head=random_head(mixed_model, "eagle1").to(torch.bfloat16),
                             method="eagle2", tree=TreeSettings(total_tokens=8, depth=3, top_k=3))
    asked = Engine.from_model(mixed_model, TinyTokenizer(), method="vanilla", activations=want)
    assert plain.target.activations == spec.target.activations == asked.target.activations == want
    for prompt in PROMPTS:
        tokens = plain.generate(prompt, max_new_tokens=20).tokens
        assert spec.generate(prompt, max_new_tokens=20).tokens == tokens
        assert asked.generate(prompt, max_new_tokens=20).tokens == tokens
    ctx = MethodContext(model=mixed_model, tokenizer=TinyTokenizer(), model_name="tiny", tree=TreeSettings(4, 2, 2))
    vanilla = build_methods([], ctx)[0]
    assert vanilla.engine.target.activations == want
    assert vanilla.settings.get("activations", "bfloat16") == want


@needs_kernel
def test_a_draft_model_runs_int8_inputs_where_faster_and_the_output_stays_the_targets(
        q4_k_model, mixed_model, monkeypatch):  # noqa: F811
    """A draft model's arithmetic changes which tokens it proposes, never the output: its block products take int8
    inputs where they measured faster (`auto`: the AVX-512 and AVX2 builds, not the AMX one), whatever the target's
    ($EAGLESPEC_DRAFT_INT8=0: bfloat16 ones everywhere)."""
    want = "int8" if wants_int8_inputs("auto", bf16_gemm=True) else "bfloat16"
    model, path = q4_k_model
    source.note_gguf(model, path)
    plain = Engine.from_model(model, TinyTokenizer(), method="vanilla", activations="bfloat16")
    for method in ("sps", "staged"):
        spec = Engine.from_model(model, TinyTokenizer(), method=method, draft_hf_model=mixed_model,
                                 tree=TreeSettings(total_tokens=4, depth=3, top_k=1), activations="bfloat16")
        assert spec.target.activations == "bfloat16"
        assert spec.drafter.model.activations == want
        for prompt in PROMPTS:
            assert spec.generate(prompt, max_new_tokens=16).tokens == plain.generate(prompt, max_new_tokens=16).tokens
    monkeypatch.setenv(bf16gemm.DRAFT_INT8_ENV, "0")
    spec = Engine.from_model(model, TinyTokenizer(), method="sps", draft_hf_model=mixed_model,
                             tree=TreeSettings(total_tokens=4, depth=3, top_k=1))
    assert spec.drafter.model.activations == "bfloat16"


@needs_kernel
def test_int8_inputs_need_block_weights():
    model = make_cpu_model("qwen2", layers=1, hidden_size=64, intermediate_size=128).to(torch.bfloat16)
    with pytest.raises(EagleSpecError, match="applies to weights stored as 4-bit blocks or 6-bit codes"):
        FastTarget(model, "final", activations="int8")
    assert FastTarget(model, "final", activations="auto").activations == "bfloat16"  # (the default: no error)
    assert Engine.from_model(model, TinyTokenizer(), method="vanilla").target.activations == "bfloat16"
    with pytest.raises(EagleSpecError, match="unknown activations 'fp8'; use auto, bfloat16, int8"):
        make_target(model, activations="fp8")
    assert cli.ACTIVATIONS == apply.ACTIVATIONS  # the command line's choices (spelled there to keep --help light)
    with pytest.raises(EagleSpecError, match="--activations int8 needs the fast path"):
        make_target(model, backend="hf", activations="int8")


def test_drafts_take_int8_inputs_on_the_avx512_and_avx2_builds_not_the_amx_one(monkeypatch):
    """`auto` (a draft model's): int8 where it measured faster; the AMX build's tiles make its bfloat16 rows cheap and
    would not multiply int8 inputs (AVX-512 VNNI would). Asked for, int8 runs on every build."""
    monkeypatch.setattr(bf16gemm, "amx_tiles_granted", lambda: True)
    monkeypatch.delenv(bf16gemm.ISA_ENV, raising=False)
    monkeypatch.delenv(q4.ENV, raising=False)
    avx2 = {"avx", "avx2", "fma", "f16c"}
    avx512 = avx2 | {"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni"}
    try:
        for flags, auto in ((avx512 | {"amx_tile", "amx_bf16"}, False), (avx512, True), (avx2, True)):
            monkeypatch.setattr(platform, "cpu_flags", lambda flags=flags: set(flags))
            bf16gemm.isa.cache_clear()
            assert wants_int8_inputs("auto", bf16_gemm=True) is auto, flags
            assert wants_int8_inputs("int8", bf16_gemm=True) and not wants_int8_inputs("bfloat16", bf16_gemm=True)
            assert not wants_int8_inputs("auto", bf16_gemm=False)  # (no kernels: nothing to run them)
    finally:
        bf16gemm.isa.cache_clear()
