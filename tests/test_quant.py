"""Weight-only int8 / int4 targets: quantization error, row-invariant kernels, lossless speculative output."""

import pytest
import torch
from conftest import TinyTokenizer, make_cpu_model
from oracles import tree_rows_and_steps
from test_engine import PROMPTS, random_head

from eaglespec import Engine, TreeSettings
from eaglespec.backends.cpu.quant import (
    check_mode,
    quantize,
    quantize_int4,
    quantize_int8,
)
from eaglespec.errors import EagleSpecError
from eaglespec.targets.fast import FastTarget, make_target


def test_quantized_weights_stay_close_to_the_original():
    torch.manual_seed(0)
    w = torch.randn(96, 128)
    for layer, tolerance in ((quantize_int8(w), 0.01), (quantize_int4(w, group=32), 0.12)):
        err = (layer.dequantized() - w).abs().max() / w.abs().max()
        assert 0 < err < tolerance, (layer.mode, err)  # lossy, but within the format's resolution
        assert layer.nbytes < w.numel() * (1.1 if layer.mode == "int8" else 0.65)  # bytes per weight


def test_kernel_matches_the_dequantized_product_and_adds_the_bias():
    torch.manual_seed(0)
    w, b, x = torch.randn(64, 96), torch.randn(64), torch.randn(5, 96)
    for mode in ("int8", "int4"):
        layer = quantize(w, b, mode)
        expected = x.to(torch.bfloat16).float() @ layer.dequantized().T + b
        torch.testing.assert_close(layer(x), expected, atol=0.05, rtol=0.02)
        assert layer(x[None]).shape == (1, 5, 64) and layer(x).dtype == torch.float32


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_each_row_is_computed_the_same_whatever_the_number_of_rows(mode):
    """What makes a verified tree give bit-identical logits to one-token steps."""
    torch.manual_seed(0)
    layer = quantize(torch.randn(160, 128), None, mode)
    x = torch.randn(24, 128)
    full = layer(x)
    for rows in (1, 2, 3, 5, 8, 16):
        assert torch.equal(torch.cat([layer(x[i:i + rows]) for i in range(0, 24, rows)]), full)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_a_verified_tree_row_is_bit_identical_to_the_one_token_step(arch, mode):
    """Quantized decode steps are row-invariant: each tree row's logits equal, bit for bit, those of one-token steps
    along its path, for branching rows (paths copied after the prefix) and a chain (cache slices). The tiny model rarely
    shows the difference without it; tests/test_real_model.py checks the real one, where it is ~0.2 of a logit."""
    target = make_target(make_cpu_model(arch), "final", quantize=mode)
    assert target.row_invariant
    tree, steps, chain = tree_rows_and_steps(target, torch.tensor(PROMPTS[1]), [7, 3, 9])
    assert torch.equal(tree, steps) and torch.equal(chain, steps)


def test_int4_falls_back_to_int8_where_the_group_does_not_divide_the_input():
    assert quantize(torch.randn(32, 48), None, "int4").mode == "int8"
    assert quantize(torch.randn(32, 64), None, "int4").mode == "int4"


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("method", ["eagle2", "eagle1", "pld"])
def test_speculative_output_equals_plain_decoding_of_the_quantized_target(arch, mode, method):
    model = make_cpu_model(arch)
    head = None if method == "pld" else random_head(model, "eagle3" if method == "eagle2" else "eagle1")
    plain = Engine.from_model(model, TinyTokenizer(), method="vanilla", quantize=mode)
    spec = Engine.from_model(model, TinyTokenizer(), head=head, method=method, quantize=mode,
                             tree=TreeSettings(total_tokens=10, depth=4, top_k=3))
    assert spec.target.quantize == mode
    drafted = 0
    for prompt in PROMPTS:
        result = spec.generate(prompt, max_new_tokens=24)
        assert result.tokens == plain.generate(prompt, max_new_tokens=24).tokens
        drafted += sum(result.stats.drafted_per_depth)
    assert drafted > 0  # the trees were really verified, not skipped


def test_quantize_none_is_the_float_target():
    model = make_cpu_model("llama")
    engine = Engine.from_model(model, TinyTokenizer(), head=random_head(model, "eagle1"), method="eagle2",
                               quantize="none", tree=TreeSettings(total_tokens=4, depth=2, top_k=2))
    assert engine.target.quantize is None and engine.target.row_invariant  # float32 on a CPU: exact by default


def test_quantized_logits_track_the_float_model():
    model = make_cpu_model("llama")
    exact, quant = make_target(model, "final"), make_target(model, "final", quantize="int8")
    prompt = torch.tensor(PROMPTS[2])
    a, b = exact.forward(prompt).logits, quant.forward(prompt).logits
    assert not torch.equal(a, b)
    assert (a - b).abs().max() < 0.05 * a.abs().max()
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.9


def test_bad_quantize_options_are_clear_errors():
    assert check_mode("none") is None and check_mode(None) is None
    with pytest.raises(EagleSpecError, match="unknown quantization 'int3'"):
        check_mode("int3")
    with pytest.raises(EagleSpecError, match="GPU"):
        check_mode("int8", "cuda")
    with pytest.raises(EagleSpecError, match="fast path"):
        make_target(make_cpu_model("gemma3"), "final", quantize="int8")
    with pytest.raises(EagleSpecError, match="fast path"):
        make_target(make_cpu_model("llama"), "final", backend="hf", quantize="int4")
    assert isinstance(make_target(make_cpu_model("llama"), "final", quantize="int4"), FastTarget)
