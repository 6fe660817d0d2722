"""Exact 4-bit block weights (eaglespec.backends.cpu.q4, csrc/common/q4_gemm.h with the build's micro-kernels): finding
llama.cpp's Q4_1 form in float32 weights (checked against gguf's own quantizer), the packing, the product (the exact
product rounded once to bfloat16 up to float32 rounding, row-invariant), and a compiled bfloat16 target whose layers use
it, decoding speculatively to plain decoding's tokens. The kernel tests need a build of the kernels (AVX2, or AVX-512,
which compiles the same 4-bit source: `q4.available()`) and a compiler; the form and packing checks run everywhere."""

import numpy as np
import pytest
import torch
from conftest import TinyTokenizer, make_cpu_model
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from test_engine import PROMPTS, random_head
from test_fastpath import PROMPT

from eaglespec.api import Engine, TreeSettings
from eaglespec.backends.cpu import kernels as bf16gemm
from eaglespec.backends.cpu import q4
from eaglespec.targets.fast import FastTarget

needs_kernel = pytest.mark.skipif(not (q4.available() and bf16gemm.can_build()),
                                  reason="the 4-bit product needs a CPU with AVX2 + FMA + F16C and a C++ compiler")


def q4_1(weight: torch.Tensor) -> torch.Tensor:
    """gguf's Q4_1 quantization and float32 dequantization of a [N, K] weight: what eaglespec.models' converted GGUF
    folders hold."""
    data = weight.detach().float().numpy()
    return torch.from_numpy(np.ascontiguousarray(dequantize(quantize(data, GGMLQuantizationType.Q4_1),
                                                            GGMLQuantizationType.Q4_1))).reshape(weight.shape)


def test_blocks_are_found_exactly_in_gguf_q4_1_weights():
    torch.manual_seed(0)
    weight = q4_1(torch.randn(200, 256) * 0.05)
    weight[3, :32] = 0.25  # a constant block (d = 0)
    blocks = q4.find_blocks(weight)
    assert blocks is not None and blocks.q.max() <= 15
    assert torch.equal(blocks.weight(), weight)  # every weight, bit for bit
    assert q4.find_blocks(torch.randn(64, 64)) is None  # plain float32 weights
    assert q4.find_blocks(weight.bfloat16().float()) is None  # rounded: no longer the form
    assert q4.find_blocks(weight[:, :48]) is None  # K not a multiple of 32
    broken = weight.clone()
    broken[5, 7] = float("nan")
    assert q4.find_blocks(broken) is None


def test_packing_layout():
    """q4_pack's bytes: per 32-column group and 32-k block, d, m, then words whose nibble i holds k = 8 j + i."""
    torch.manual_seed(1)
    n, k = 40, 64
    d = (torch.rand(n, k // 32) * 0.01).half()
    m = (-torch.rand(n, k // 32)).half()
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    packed = q4.q4_pack(q4.Blocks(d, m, q))
    assert packed.shape == (2, 2, 640) and packed.dtype == torch.uint8
    group, block, column, octet, i = 1, 1, 5, 2, 3  # column 32 + 5 = 37, k = 32 + 16 + 3
    assert packed[group, block, :64].view(torch.float16)[column] == d[37, 1]
    assert packed[group, block, 64:128].view(torch.float16)[column] == m[37, 1]
    word = int(packed[group, block, 128:].view(torch.int32).view(4, 32)[octet, column]) & 0xFFFFFFFF
    assert (word >> (4 * i)) & 0xF == q[37, 32 + 8 * octet + i]
    assert packed[1, :, 128:].view(torch.int32).view(2, 4, 32)[:, :, 8:].eq(0).all()  # padded columns: q = 0


@needs_kernel
@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (40, 64)])
def test_kernel_rebuilds_the_weights_and_is_row_invariant(n, k):
    bf16gemm.load()
    torch.manual_seed(n)
    weight = q4_1(torch.randn(n, k) * 0.05)
    blocks = q4.find_blocks(weight)
    packed = q4.q4_pack(blocks)
    assert torch.equal(torch.ops.eaglespec.q4_unpack(packed, n, k), weight)
    bias = torch.randn(n)
    layer = q4.Q4Linear(blocks, bias)
    x = torch.randn(70, k).bfloat16()
    whole = layer(x)  # [70, n] bfloat16
    exact = x.double() @ weight.double().T + bias.double()
    bound = exact.abs() * 2**-8 + 1e-5 * k * (x.double().abs() @ weight.double().abs().T)
    assert whole.dtype == torch.bfloat16 and ((whole.double() - exact).abs() <= bound).all()
    # AVX2: passes of up to 4 rows (5 = 2 + 3, 9 = 3 + 3 + 3), 1-4 rows with their own loops; AVX-512: tiles of up to
    # 8 rows; AMX: tiles of up to 16, and 17-64 rows in up to 4 tiles sharing each block's unpacking; any build: passes
    # of up to 64 rows over the weights (65-70 take two)
    for rows in [*range(1, 20), 31, 32, 33, 47, 48, 49, 63, 64, 65, 70]:
        assert torch.equal(layer(x[:rows]), whole[:rows]), rows
    for row in (7, 17, 40, 66):
        assert torch.equal(layer(x[row : row + 1]), whole[row : row + 1]), row
    assert torch.equal(layer(x[3:40]), whole[3:40])
    assert torch.equal(layer(x.view(1, 70, k))[0], whole)


@needs_kernel
def test_kernel_rounds_the_exact_product_to_bfloat16():
    """d sum(x q) + m sum(x) in float32 and then one rounding to bfloat16: against the exact product (float64, then
    rounded to bfloat16), every output is that value or its bfloat16 neighbour, and nearly all are that value. Inputs
    of every magnitude, sums that cancel (m = -8 d), a zero block (d = 0) and a bias."""
    torch.manual_seed(2)
    n, k = 96, 256
    d = (torch.rand(n, k // 32) * 0.02 + 1e-4).half()
    d[5, 3] = 0
    m = (-8 * d.float() + torch.randn(n, k // 32) * 1e-3).half()
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    blocks = q4.Blocks(d, m, q)
    x = (torch.randn(9, k) * 10.0 ** torch.randint(-3, 3, (9, k)).float()).bfloat16()
    bias = torch.randn(n) * 0.01
    ours = q4.Q4Linear(blocks, bias)(x).double()
    exact = x.double() @ blocks.weight().double().T + bias.double()
    nearest = exact.bfloat16().double()
    ulp = (nearest.abs() * 2.0**-7).clamp_min(2.0**-133)
    assert ((ours - nearest).abs() <= ulp).all()
    assert (ours == nearest).double().mean() > 0.99


def test_off_switch(monkeypatch):
    monkeypatch.setenv(q4.ENV, "0")
    assert not q4.available()


@pytest.fixture(scope="module")
def q4_folder(tmp_path_factory):
    """A tiny Llama whose layer matrices are Q4_1 weights, saved as float32 safetensors (as a converted GGUF)."""
    model = make_cpu_model("llama", layers=2)
    with torch.no_grad():
        for layer in model.model.layers:
            for linear in (*[getattr(layer.self_attn, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj")],
                           layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
                linear.weight.copy_(q4_1(linear.weight))
    folder = tmp_path_factory.mktemp("q4") / "model"
    model.save_pretrained(folder)
    return folder


def load(folder, dtype=torch.bfloat16):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval().requires_grad_(False)


@needs_kernel
def test_compiled_target_reads_its_layers_as_blocks(q4_folder):
    model = load(q4_folder)
    target = FastTarget(model, "final", compile=True)
    assert target.q4_matrices == 8 and all(isinstance(layer.down, q4.Q4Linear) for layer in target.layers)
    reference = FastTarget(load(q4_folder, torch.float32), "final")  # the float32 model, eager
    target.warm_up()
    outs = []
    for t in (reference, target):
        t.reset()
        t.forward(PROMPT)
        t.commit()
        outs.append(t.forward(torch.tensor([5, 9, 11]), None, None).logits.float())
    torch.testing.assert_close(outs[1], outs[0], atol=0.1, rtol=0.05)  # bfloat16 activations
    # a weight changed after loading no longer matches its file: that matrix stays on the bfloat16 kernel
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[0, 0] += 1
    changed = FastTarget(model, "final", compile=True)
    assert changed.q4_matrices == 7 and isinstance(changed.layers[1].down, bf16gemm.Bf16Linear)


@needs_kernel
def test_speculative_decoding_on_blocks_gives_plain_decodings_tokens(q4_folder):
    model = load(q4_folder)
    plain = Engine.from_model(model, TinyTokenizer(), method="vanilla", compile=True)
    spec = Engine.from_model(model, TinyTokenizer(), head=random_head(model, "eagle1").to(torch.bfloat16),
                             method="eagle2", compile=True, tree=TreeSettings(total_tokens=8, depth=3, top_k=3))
    assert plain.target.q4_matrices == spec.target.q4_matrices == 8
    for prompt in PROMPTS:
        assert spec.generate(prompt, max_new_tokens=20).tokens == plain.generate(prompt, max_new_tokens=20).tokens
