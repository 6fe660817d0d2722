"""Q4_K matrices read from a GGUF file as exact 4-bit blocks (eaglespec.backends.cpu.kquant): the blocks rebuild
gguf's own dequantization bit for bit, the header index agrees with gguf's reader, the super-block packing (the
file's float16 d and dmin, 6-bit sc and mn) unpacks to those weights and runs through the 4-bit product
row-invariantly, and a tiny Qwen2 (the 1.5B's shape features: biased q/k/v, untied LM
head, grouped KV heads) whose layer matrices are Q4_K in its GGUF decodes speculatively to plain decoding's tokens
on them. The kernel tests need a build of the kernels and a compiler, like tests/test_q4.py."""

import numpy as np
import pytest
import torch
from conftest import TinyTokenizer, make_cpu_model
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import dequantize
from test_engine import PROMPTS, random_head

from eaglespec import envs
from eaglespec.api import Engine, TreeSettings
from eaglespec.backends.cpu import kernels as bf16gemm
from eaglespec.backends.cpu import kquant, q4, q6
from eaglespec.targets import source
from eaglespec.targets.fast import FastTarget

needs_kernel = pytest.mark.skipif(not (q4.available() and bf16gemm.can_build()),
                                  reason="the 4-bit product needs a CPU with AVX2 + FMA + F16C and a C++ compiler")


def random_q4_k(n: int, k: int, seed: int, scale: float = 2e-4) -> np.ndarray:
    """Random Q4_K bytes of a [n, k] matrix: [n, k / 256 * 144] uint8, with finite positive d and dmin of about
    `scale` and random 6-bit scales, mins and 4-bit q."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n * k // 256, 144), dtype=np.uint8)
    raw[:, 0:2] = (rng.random((n * k // 256, 1)) * scale + scale / 4).astype(np.float16).view(np.uint8)
    raw[:, 2:4] = (rng.random((n * k // 256, 1)) * scale * 4).astype(np.float16).view(np.uint8)
    return raw.reshape(n, k // 256 * 144)


def gguf_weight(raw: np.ndarray, n: int, k: int, kind=GGMLQuantizationType.Q4_K) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(dequantize(raw, kind))).reshape(n, k)


def random_q6_k(n: int, k: int, seed: int, scale: float = 1e-4) -> np.ndarray:
    """Random Q6_K bytes of a [n, k] matrix: [n, k / 256 * 210] uint8 (random codes and signed scales, d ~ scale)."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n * k // 256, 210), dtype=np.uint8)
    raw[:, 208:210] = (rng.random((n * k // 256, 1)) * scale + scale / 4).astype(np.float16).view(np.uint8)
    return raw.reshape(n, k // 256 * 210)


def random_q5_0(n: int, k: int, seed: int, scale: float = 1e-3) -> np.ndarray:
    """Random Q5_0 bytes of a [n, k] matrix: [n, k / 32 * 22] uint8 (random codes, d ~ scale)."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n * k // 32, 22), dtype=np.uint8)
    raw[:, 0:2] = (rng.random((n * k // 32, 1)) * scale + scale / 4).astype(np.float16).view(np.uint8)
    return raw.reshape(n, k // 32 * 22)


def test_blocks_rebuild_gguf_dequantization_bit_for_bit():
    n, k = 48, 512
    raw = random_q4_k(n, k, seed=0)
    blocks = kquant.q4_k_blocks(raw, n, k)
    assert blocks.d.dtype == blocks.dmin.dtype == torch.float16 and blocks.d.shape == (n, k // 256)
    assert blocks.sc.shape == blocks.mn.shape == (n, k // 32) and int(max(blocks.sc.max(), blocks.mn.max())) <= 63
    assert blocks.q.shape == (n, k) and int(blocks.q.max()) <= 15
    assert torch.equal(blocks.weight(), gguf_weight(raw, n, k))
    with pytest.raises(ValueError, match="not a Q4_K matrix"):
        kquant.q4_k_blocks(raw[:, :-1], n, k)


def test_names_of_layer_matrices():
    assert kquant.gguf_name("model.layers.3.mlp.up_proj.weight") == "blk.3.ffn_up.weight"
    assert kquant.gguf_name("model.layers.12.self_attn.o_proj.weight") == "blk.12.attn_output.weight"
    assert kquant.gguf_name("model.layers.0.self_attn.q_proj.bias") is None
    assert kquant.gguf_name("lm_head.weight") is None


def write_gguf(path, tensors: dict[str, np.ndarray], alignment: int | None = None) -> None:
    """A GGUF file with tokenizer-like metadata (a string array) and `tensors` (uint8 arrays are Q4_K bytes; a
    (bytes, GGMLQuantizationType) pair another block type's)."""
    writer = GGUFWriter(str(path), "qwen2")
    writer.add_array("tokenizer.ggml.tokens", ["<a>", "bb", "ccc"] * 50)
    writer.add_uint32("qwen2.block_count", 2)
    writer.add_string("general.name", "tiny")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    for name, data in tensors.items():
        kind = GGMLQuantizationType.Q4_K
        if isinstance(data, tuple):  # (bytes, their block type)
            data, kind = data
        if data.dtype == np.uint8:
            writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=kind)
        else:
            writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("alignment", [None, 64])
def test_tensor_index_agrees_with_gguf_reader(tmp_path, alignment):
    path = tmp_path / "tiny.gguf"
    write_gguf(path, {"blk.0.ffn_up.weight": random_q4_k(8, 256, seed=1),
                      "blk.0.attn_norm.weight": np.ones(24, dtype=np.float32),
                      "blk.1.ffn_up.weight": random_q4_k(16, 512, seed=2)}, alignment)
    index = kquant.tensor_index(path)
    reader = GGUFReader(path)
    assert set(index) == {t.name for t in reader.tensors}
    for t in reader.tensors:
        info = index[t.name]
        assert (info.kind, info.shape, info.offset) == (int(t.tensor_type), tuple(int(s) for s in t.shape),
                                                        t.data_offset)
    (tmp_path / "bad.gguf").write_bytes(b"GGML" + bytes(20))
    with pytest.raises(ValueError, match="not a little-endian GGUF"):
        kquant.tensor_index(tmp_path / "bad.gguf")


@needs_kernel
@pytest.mark.parametrize("n,k", [(96, 256), (40, 512)])
def test_super_blocks_pack_rebuild_the_weights_and_are_row_invariant(n, k):
    bf16gemm.load()
    raw = random_q4_k(n, k, seed=n)
    blocks = kquant.q4_k_blocks(raw, n, k)
    packed = q4.q4_pack(blocks)
    assert packed.shape == ((n + 31) // 32, k // 256, 4736)  # 18.5 bytes per 32 weights
    stacked = q4.SuperBlocks.cat([blocks, kquant.q4_k_blocks(random_q4_k(24, k, seed=1), 24, k)])
    assert torch.equal(torch.ops.eaglespec.q4_unpack(q4.q4_pack(stacked), n + 24, k), stacked.weight())
    weight = gguf_weight(raw, n, k)
    assert torch.equal(torch.ops.eaglespec.q4_unpack(packed, n, k), weight)
    bias = torch.randn(n)
    assert_exact_and_row_invariant(q4.Q4Linear(blocks, bias), weight, bias)


def assert_exact_and_row_invariant(layer, weight: torch.Tensor, bias: torch.Tensor) -> None:
    """The product of 70 bfloat16 rows is the exact one (float64) up to bfloat16 and float32 rounding, and each row's
    bits are the same alone, in the first r rows or after other rows (tiles of 8 rows on AVX-512: 9-16 take two; of
    16 rows in the AMX build: 17-64 rows in up to 4 tiles sharing each block's unpacking; passes of up to 64 rows over
    the weights in every build: 65-70 take two)."""
    k = weight.shape[1]
    x = torch.randn(70, k).bfloat16()
    whole = layer(x)
    exact = x.double() @ weight.double().T + bias.double()
    bound = exact.abs() * 2**-8 + 1e-5 * k * (x.double().abs() @ weight.double().abs().T)
    assert ((whole.double() - exact).abs() <= bound).all()
    for rows in range(1, 19):
        assert torch.equal(layer(x[:rows]), whole[:rows]), rows
        assert torch.equal(layer(x[rows : rows + 1]), whole[rows : rows + 1]), rows
    for rows in (31, 32, 33, 48, 49, 64, 65, 70):
        assert torch.equal(layer(x[:rows]), whole[:rows]), rows
    assert torch.equal(layer(x[5:50]), whole[5:50])
    assert torch.equal(layer(x[66:67]), whole[66:67])


@pytest.mark.parametrize("kind", ["Q6_K", "Q5_0"])
def test_codes_rebuild_gguf_dequantization_bit_for_bit(kind):
    n, k = 40, 512
    raw = random_q6_k(n, k, seed=3) if kind == "Q6_K" else random_q5_0(n, k, seed=3)
    codes = (kquant.q6_k_codes if kind == "Q6_K" else kquant.q5_0_codes)(raw, n, k)
    assert codes.s.dtype == torch.float32 and codes.s.shape == (n, k // 16)
    assert codes.q.shape == (n, k) and int(codes.q.max()) <= 63
    assert torch.equal(codes.weight(), gguf_weight(raw, n, k, GGMLQuantizationType[kind]))
    with pytest.raises(ValueError, match=f"not a {kind} matrix"):
        (kquant.q6_k_codes if kind == "Q6_K" else kquant.q5_0_codes)(raw[:, :-1], n, k)


@needs_kernel
@pytest.mark.parametrize("n,k", [(96, 256), (40, 512)])
def test_six_bit_codes_unpack_to_the_weights_and_multiply_row_invariantly(n, k):
    bf16gemm.load()
    raw = random_q6_k(n, k, seed=n)
    codes = kquant.q6_k_codes(raw, n, k)
    packed = q6.q6_pack(codes)
    assert packed.shape == ((n + 31) // 32, k // 32, 1024)
    weight = gguf_weight(raw, n, k, GGMLQuantizationType.Q6_K)
    assert torch.equal(torch.ops.eaglespec.q6_unpack(packed, n, k), weight)
    stacked = q6.Codes.cat([codes, kquant.q5_0_codes(random_q5_0(24, k, seed=1), 24, k)])
    assert torch.equal(torch.ops.eaglespec.q6_unpack(q6.q6_pack(stacked), n + 24, k), stacked.weight())
    bias = torch.randn(n)
    assert_exact_and_row_invariant(q6.Q6Linear(codes, bias), weight, bias)
    with pytest.raises(ValueError, match="float32 scales"):
        q6.q6_pack(q6.Codes(codes.s.half(), codes.q))


def test_pack_rejects_other_scale_dtypes():
    blocks = q4.Blocks(torch.ones(32, 1), torch.ones(32, 1).half(), torch.zeros(32, 32, dtype=torch.uint8))
    with pytest.raises(ValueError, match="float16 d and m"):
        q4.q4_pack(blocks)
    q = torch.zeros(32, 32, dtype=torch.uint8)
    with pytest.raises(ValueError, match="divisible by 256"):
        q4.q4_pack(q4.SuperBlocks(torch.ones(32, 1).half(), torch.ones(32, 1).half(), q[:, :1], q[:, :1], q))


MATRICES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
            "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
            "mlp.down_proj": "ffn_down"}


@pytest.fixture(scope="module")
def q4_k_model(tmp_path_factory):
    """A tiny bfloat16 Qwen2 (K multiple of 256) whose layer matrices are the bfloat16 rounding of Q4_K ones, as
    eaglespec's bfloat16 cache of a Q4_K GGUF holds them, and that GGUF file."""
    model = make_cpu_model("qwen2", layers=2, hidden_size=256, intermediate_size=512).to(torch.bfloat16)
    tensors = {}
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            for seed, (attr, name) in enumerate(MATRICES.items()):
                linear = layer.get_submodule(attr)
                n, k = linear.weight.shape
                raw = random_q4_k(n, k, seed=100 * i + seed, scale=1e-3)
                linear.weight.copy_(gguf_weight(raw, n, k))
                tensors[f"blk.{i}.{name}.weight"] = raw
    path = tmp_path_factory.mktemp("q4k") / "tiny.gguf"
    write_gguf(path, tensors)
    return model, path


@needs_kernel
def test_fast_target_reads_q4_k_matrices_from_the_gguf(q4_k_model):
    model, path = q4_k_model
    assert FastTarget(model, "final").q4_matrices == 0  # not known to come from a GGUF file: bfloat16 kernel
    source.note_gguf(model, path)
    target = FastTarget(model, "final")
    assert target.q4_matrices == 8  # fused q/k/v, o, fused gate/up and down of both layers
    assert all(isinstance(layer.gate_up, q4.Q4Linear) for layer in target.layers)


@needs_kernel
def test_speculative_decoding_on_q4_k_blocks_gives_plain_decodings_tokens(q4_k_model):
    model, path = q4_k_model
    source.note_gguf(model, path)
    plain = Engine.from_model(model, TinyTokenizer(), method="vanilla")
    spec = Engine.from_model(model, TinyTokenizer(), head=random_head(model, "eagle1").to(torch.bfloat16),
                             method="eagle2", tree=TreeSettings(total_tokens=8, depth=3, top_k=3))
    assert plain.target.q4_matrices == spec.target.q4_matrices == 8
    for prompt in PROMPTS:
        assert spec.generate(prompt, max_new_tokens=20).tokens == plain.generate(prompt, max_new_tokens=20).tokens


@pytest.fixture(scope="module")
def mixed_model(tmp_path_factory):
    """A tiny bfloat16 Qwen2 whose GGUF mixes block types as llama.cpp's Q4_K_M files do: layer 0 Q4_K but for a
    Q6_K v and down; layer 1 Q5_0 but for a Q4_K down (the 0.5B's pattern)."""
    model = make_cpu_model("qwen2", layers=2, hidden_size=256, intermediate_size=512).to(torch.bfloat16)
    kinds = [{"self_attn.v_proj": "Q6_K", "mlp.down_proj": "Q6_K"},
             {attr: "Q5_0" for attr in MATRICES if attr != "mlp.down_proj"}]
    makers = {"Q4_K": random_q4_k, "Q6_K": random_q6_k, "Q5_0": random_q5_0}
    tensors = {}
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            for seed, (attr, name) in enumerate(MATRICES.items()):
                linear = layer.get_submodule(attr)
                n, k = linear.weight.shape
                kind = kinds[i].get(attr, "Q4_K")
                raw = makers[kind](n, k, seed=100 * i + seed)
                linear.weight.copy_(gguf_weight(raw, n, k, GGMLQuantizationType[kind]))
                tensors[f"blk.{i}.{name}.weight"] = (raw, GGMLQuantizationType[kind])
    path = tmp_path_factory.mktemp("mixed") / "tiny.gguf"
    write_gguf(path, tensors)
    source.note_gguf(model, path)
    return model


@needs_kernel
def test_q6_k_and_q5_0_matrices_run_as_codes_and_decode_speculatively_to_plain_decodings_tokens(mixed_model):
    target = FastTarget(mixed_model, "final")
    first, second = target.layers
    # a Q6_K v beside Q4_K q and k: q and k as one 4-bit product, v as 6-bit codes, outputs side by side
    assert isinstance(first.qkv, q4.SplitLinear) and [type(p) for p in first.qkv.parts] == [q4.Q4Linear, q6.Q6Linear]
    attention = mixed_model.model.layers[0].self_attn
    x = torch.randn(3, 256).bfloat16()
    want = torch.cat([attention.q_proj(x), attention.k_proj(x), attention.v_proj(x)], dim=-1)  # torch's bfloat16
    torch.testing.assert_close(first.qkv(x).float(), want.float(), atol=0.02, rtol=0.02)
    assert isinstance(first.o, q4.Q4Linear) and isinstance(first.down, q6.Q6Linear)
    assert all(isinstance(m, q6.Q6Linear) for m in (second.qkv, second.o, second.gate_up))
    assert isinstance(second.down, q4.Q4Linear)
    assert (target.q4_matrices, target.q6_matrices) == (4, 5)
    plain = Engine.from_model(mixed_model, TinyTokenizer(), method="vanilla")
    spec = Engine.from_model(mixed_model, TinyTokenizer(), head=random_head(mixed_model, "eagle1").to(torch.bfloat16),
                             method="eagle2", tree=TreeSettings(total_tokens=8, depth=3, top_k=3))
    assert plain.target.kernel_stack is not None or not envs.stack_enabled()  # the stack runs kind 3 products
    for prompt in PROMPTS:
        assert spec.generate(prompt, max_new_tokens=20).tokens == plain.generate(prompt, max_new_tokens=20).tokens


@needs_kernel
def test_a_changed_matrix_stays_on_the_bfloat16_kernel(q4_k_model, tmp_path):
    model, path = q4_k_model
    changed = make_cpu_model("qwen2", layers=2, hidden_size=256, intermediate_size=512).to(torch.bfloat16)
    changed.load_state_dict(model.state_dict())
    with torch.no_grad():
        changed.model.layers[1].mlp.down_proj.weight[0, 0] += 1
    source.note_gguf(changed, path)
    target = FastTarget(changed, "final")
    assert target.q4_matrices == 7 and isinstance(target.layers[1].down, bf16gemm.Bf16Linear)


@needs_kernel
def test_a_missing_or_broken_gguf_leaves_every_matrix_on_the_bfloat16_kernel(q4_k_model, tmp_path):
    model, _ = q4_k_model
    for path, content in ((tmp_path / "gone.gguf", None), (tmp_path / "broken.gguf", b"GGUF\x03\x00\x00\x00")):
        if content is not None:
            path.write_bytes(content)
        copy = make_cpu_model("qwen2", layers=2, hidden_size=256, intermediate_size=512).to(torch.bfloat16)
        copy.load_state_dict(model.state_dict())
        source.note_gguf(copy, path)
        assert FastTarget(copy, "final").q4_matrices == 0
