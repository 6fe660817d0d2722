"""The real SmolLM2-135M-Instruct (the embedded default): speculative greedy equals vanilla greedy."""

import pytest
import torch
from oracles import tree_rows_and_steps

from eaglespec import Engine, TreeSettings
from eaglespec.heads import load_head
from eaglespec.models import load_target, shipped_head_dir
from eaglespec.targets.fast import make_target

pytestmark = pytest.mark.real_model

PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain what a binary search does, step by step.",
    "Give me three tips for staying focused while studying.",
    "Write a Python function that reverses a string.",
]


@pytest.fixture(scope="module")
def smol():
    torch.set_num_threads(2)
    model, tokenizer = load_target("smollm2-135m", dtype="float32")
    yield model, tokenizer
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def smol_auto():
    """The model in the dtype `auto` picks here (bfloat16 wherever eaglespec's kernels run): the engine's defaults, fast
    and exact; the float32 one decodes exactly too, through row-by-row attention, but several times slower."""
    from eaglespec.backends.cpu import kernels as bf16gemm
    from eaglespec.platform import parse_dtype

    torch.set_num_threads(2)
    dtype = parse_dtype("auto", "cpu", bf16_kernels=bf16gemm.available(torch.bfloat16, "cpu"))
    model, tokenizer = load_target("smollm2-135m", dtype=dtype)
    yield model, tokenizer
    torch.set_num_threads(1)


def _head(model, kind: str | None = None):
    """The shipped head (the default one, or of `kind`): real acceptance, so trees are accepted deep."""
    folder = shipped_head_dir("smollm2-135m", kind)
    assert folder is not None, "the shipped heads are part of the package"
    return load_head(folder, dtype=next(model.parameters()).dtype)  # the head drafts in the target's dtype


def test_registry_model_loads_with_chat_template(smol):
    model, tokenizer = smol
    assert model.config.model_type == "llama" and model.config.num_hidden_layers == 30
    engine = Engine.from_model(model, tokenizer, method="vanilla")
    ids = engine.encode("Hello!")
    assert tokenizer.decode(ids).startswith("<|im_start|>system")
    assert engine.encode("Hello!", chat=False) == tokenizer("Hello!")["input_ids"]


@pytest.mark.parametrize("kind, prompts", [("eagle1", PROMPTS), ("eagle3", PROMPTS[::2])])
def test_speculative_greedy_equals_vanilla_on_chat_prompts(smol_auto, kind, prompts):
    model, tokenizer = smol_auto
    vanilla = Engine.from_model(model, tokenizer, method="vanilla")
    spec = Engine.from_model(model, tokenizer, head=_head(model, kind), method="eagle2",
                             tree=TreeSettings(total_tokens=16, depth=5, top_k=4))
    taus = []
    for prompt in prompts:
        want = vanilla.generate(prompt, max_new_tokens=128)
        got = spec.generate(prompt, max_new_tokens=128)
        assert got.tokens == want.tokens, prompt
        assert got.text == want.text
        taus.append(got.stats.tau)
    assert sum(taus) / len(taus) > 1.3  # a trained head: drafts are accepted (a random head gives ~1.0)


def test_int4_tree_rows_are_bit_identical_to_one_token_steps(smol):
    """With --quantize, bfloat16 re-rounding turns the attention kernel's last-bit differences between one row and
    several into ~0.2 of a logit on this model; decode steps attend row by row, so none is left."""
    model, tokenizer = smol
    target = make_target(model, "final", quantize="int4")
    prompt = torch.tensor(tokenizer("Explain how a bicycle works in simple terms. A bicycle is")["input_ids"])
    path = tokenizer(" a mechanical device", add_special_tokens=False)["input_ids"][:3]
    tree, steps, chain = tree_rows_and_steps(target, prompt, path)
    assert torch.equal(tree, steps) and torch.equal(chain, steps)
    target.row_invariant = False  # the batched kernel: the same rows differ (what the test above guards against)
    tree, steps, _ = tree_rows_and_steps(target, prompt, path)
    assert not torch.equal(tree, steps)


def test_int4_speculative_greedy_equals_int4_vanilla(smol):
    model, tokenizer = smol
    vanilla = Engine.from_model(model, tokenizer, method="vanilla", quantize="int4")
    spec = Engine.from_model(model, tokenizer, head=_head(model), method="eagle2", quantize="int4",
                             tree=TreeSettings(total_tokens=12, depth=4, top_k=4))
    for prompt in PROMPTS[1:4]:
        assert spec.generate(prompt, max_new_tokens=96).tokens == vanilla.generate(prompt, max_new_tokens=96).tokens


def test_text_stream_decodes_past_its_anchor_and_still_gives_the_whole_text(smol):
    """SmolLM2's byte-level tokenizer: the stream keeps the text before an anchor and decodes only the tokens after
    it, yet at every step its text is the decode of all tokens (multi-byte characters cut between tokens, clean-up
    spaces, arbitrary ids included), and the released pieces add up to it."""
    import random

    from eaglespec.spec.decode import TextStream

    _, tokenizer = smol
    rng = random.Random(0)
    ids = tokenizer("Héllo wörld, isn't it ? Yes ! 日本語のテキスト ✓ naïve café — " * 10)["input_ids"]
    ids += [rng.randrange(len(tokenizer)) for _ in range(300)]
    stream, pieces, i = TextStream(tokenizer, []), [], 0
    while i < len(ids):
        k = rng.randint(1, 5)
        pieces.append(stream.push(ids[i : i + k]))
        i += k
        assert stream.text() == tokenizer.decode(ids[:i], skip_special_tokens=True)
    pieces.append(stream.flush())
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True)
    assert stream.anchoring and stream.anchor >= len(ids) - 3 * TextStream.ANCHOR_EVERY
