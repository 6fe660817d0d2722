"""Draft models read as 4-bit blocks (`FastTarget(requantize=True)`, the default for `sps` and `staged` drafts where
the kernels' 4-bit products run): every layer matrix and the LM head's logits as Q4_1 blocks rounded from the weights
(`q4.round_blocks`), or the GGUF file's own Q4_K blocks where it holds them. Another model, so only the drafts can
change: the target's output stays plain decoding's. Needs a build of the kernels and a compiler, like test_q4.py."""

import pytest
import torch
from conftest import TinyTokenizer, make_cpu_model
from test_engine import PROMPTS
from test_kquant import mixed_model, q4_k_model  # noqa: F401 (fixtures)

from eaglespec.api import Engine, TreeSettings
from eaglespec.backends.cpu import kernels, q4, q6
from eaglespec.targets import source
from eaglespec.targets.fast import FastTarget

needs_kernel = pytest.mark.skipif(not (q4.available() and kernels.can_build()),
                                  reason="the 4-bit product needs a CPU with AVX2 + FMA + F16C and a C++ compiler")


def test_round_blocks_are_within_half_a_step_of_the_weights():
    torch.manual_seed(0)
    weight = torch.randn(70, 96) * torch.rand(70, 1)
    weight[5, 32:64] = 0.5  # a constant block: d = 0, rebuilt exactly
    weight[6, :32] = torch.linspace(-1, 1, 32)  # a block whose extremes are q = 0 and q = 15
    blocks = q4.round_blocks(weight.bfloat16(), rows=16)  # (several row chunks)
    assert blocks.d.dtype == blocks.m.dtype == torch.float16 and blocks.q.dtype == torch.uint8
    assert blocks.q.shape == (70, 96) and int(blocks.q.max()) <= 15
    w = weight.bfloat16().float().view(70, 3, 32)
    rebuilt = blocks.weight().view(70, 3, 32)
    low = w.amin(-1, keepdim=True)
    step = blocks.d.float()[..., None]
    bound = step / 2 + (blocks.m.float()[..., None] - low).abs() + 1e-6
    assert bool(((rebuilt - w).abs() <= bound).all())
    assert float(blocks.d[5, 1]) == 0 and bool((rebuilt[5, 1] == 0.5).all())
    assert int(blocks.q[6, 0]) == 0 and int(blocks.q[6, 31]) == 15
    with pytest.raises(ValueError, match="divisible by 32"):
        q4.round_blocks(torch.randn(4, 40))


@needs_kernel
def test_a_requantized_target_reads_every_matrix_as_4_bit_blocks_and_stays_close():
    model = make_cpu_model("qwen2", layers=2, hidden_size=128, intermediate_size=256).to(torch.bfloat16)
    plain = FastTarget(model, None)
    draft = FastTarget(model, None, requantize=True)
    assert draft.requantized and not plain.requantized
    assert draft.q4_matrices == 8 and plain.q4_matrices == 0  # fused q/k/v, o, fused gate/up, down of both layers
    assert all(isinstance(getattr(layer, name), q4.Q4Linear) for layer in draft.layers
               for name in ("qkv", "o", "gate_up", "down"))
    assert isinstance(draft.logits_head, q4.Q4Linear) and draft.greedy_head is None  # (greedy: argmax of its logits)
    assert draft.weight_bytes() < 0.5 * plain.weight_bytes()
    assert "requantized" in draft.backend_signature() and "requantized" not in plain.backend_signature()
    tokens = torch.randint(0, model.config.vocab_size, (12,))
    want = plain.forward(tokens).logits.float()  # [12, V]
    got = draft.forward(tokens).logits.float()
    assert float(torch.nn.functional.cosine_similarity(got, want, dim=-1).min()) > 0.95
    sibling = draft.sibling()  # (a batch's or a fork's copy keeps the plan, and its weights)
    assert sibling.requantized and sibling.layers is draft.layers


@needs_kernel
def test_a_requantized_target_keeps_the_files_own_4_bit_blocks_and_rounds_the_rest(q4_k_model, mixed_model):  # noqa: F811
    model, path = q4_k_model
    source.note_gguf(model, path)
    exact, draft = FastTarget(model, None), FastTarget(model, None, requantize=True)
    x = torch.randn(5, 256).bfloat16()
    for a, b in zip(exact.layers, draft.layers):  # Q4_K in the file: the very same blocks, the same bits
        assert torch.equal(a.gate_up(x), b.gate_up(x)) and torch.equal(a.qkv(x), b.qkv(x))
    mixed = FastTarget(mixed_model, None, requantize=True)  # Q6_K, Q5_0 and Q4_K side by side: one 4-bit product each
    assert (mixed.q4_matrices, mixed.q6_matrices) == (8, 0)
    assert not any(isinstance(getattr(layer, name), (q4.SplitLinear, q6.Q6Linear)) for layer in mixed.layers
                   for name in ("qkv", "o", "gate_up", "down"))


@needs_kernel
@pytest.mark.parametrize("method", ["sps", "staged"])
def test_a_requantized_draft_model_changes_no_token(method, q4_k_model, mixed_model, monkeypatch):  # noqa: F811
    """The draft model (mixed block types, as the 0.5B's file) runs as 4-bit blocks by default; greedy output is
    plain decoding's token for token, with trees and chains; $EAGLESPEC_DRAFT_Q4=0 keeps its own weights."""
    model, path = q4_k_model
    source.note_gguf(model, path)
    plain = Engine.from_model(model, TinyTokenizer(), method="vanilla")
    for tree in (TreeSettings(total_tokens=4, depth=3, top_k=1), TreeSettings(total_tokens=8, depth=4, top_k=3)):
        spec = Engine.from_model(model, TinyTokenizer(), method=method, draft_hf_model=mixed_model, tree=tree)
        assert spec.drafter.model.requantized and not spec.target.requantized
        for prompt in PROMPTS:
            assert spec.generate(prompt, max_new_tokens=16).tokens == plain.generate(prompt, max_new_tokens=16).tokens
    monkeypatch.setenv(kernels.DRAFT_Q4_ENV, "0")
    spec = Engine.from_model(model, TinyTokenizer(), method=method, draft_hf_model=mixed_model,
                             tree=TreeSettings(total_tokens=4, depth=3, top_k=1))
    assert not spec.drafter.model.requantized and spec.drafter.model.q6_matrices == 5


def test_requantize_needs_the_4_bit_products(monkeypatch):
    """Where the 4-bit products do not run ($EAGLESPEC_Q4=0 here), `requantize` leaves the weights as they are."""
    monkeypatch.setenv(q4.ENV, "0")
    model = make_cpu_model("qwen2", layers=1, hidden_size=64, intermediate_size=128).to(torch.bfloat16)
    target = FastTarget(model, None, requantize=True)
    assert not target.requantized and target.q4_matrices == 0
