"""Greedy speculative output equals vanilla greedy output, token for token (float32, tiny random models)."""

import pytest
import torch
from conftest import VOCAB, TinyTokenizer, make_model
from oracles import OracleChain, OracleTreeWithDecoys

from eaglespec import Engine, TreeSettings
from eaglespec.heads import HeadConfig, build_head
from eaglespec.spec.decode import SpecDecoder
from eaglespec.targets.hf import TargetModel

PROMPTS = [[5, 17, 33, 2, 9, 40], [1, 2, 3], [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71, 72, 73], [88]]


def random_head(model, kind, seed=1):
    torch.manual_seed(seed)
    target = TargetModel(model)
    extra = {"draft_vocab_size": 48} if kind == "eagle3" else {}
    head = build_head(HeadConfig.for_target(target, kind, **extra)).eval()
    if kind == "eagle3":
        head.set_vocab(torch.randperm(VOCAB)[:48])
    return head.to(model.device)


def vanilla_tokens(model, prompt, n):
    return Engine.from_model(model, TinyTokenizer(), method="vanilla").generate(prompt, max_new_tokens=n).tokens


def test_vanilla_loop_equals_transformers_generate():
    model = make_model("llama")
    prompt = PROMPTS[0]
    ours = vanilla_tokens(model, prompt, 30)
    with torch.no_grad():
        hf = model.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False, min_new_tokens=30)
    assert ours == hf[0, len(prompt):].tolist()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
@pytest.mark.parametrize("method", ["eagle2", "eagle1", "chain"])
def test_random_head_greedy_equals_vanilla(arch, kind, method):
    model = make_model(arch)
    engine = Engine.from_model(model, TinyTokenizer(), head=random_head(model, kind), method=method,
                               tree=TreeSettings(total_tokens=12, depth=4, top_k=3))
    for prompt in PROMPTS:
        result = engine.generate(prompt, max_new_tokens=24)
        assert result.tokens == vanilla_tokens(model, prompt, 24), (arch, kind, method, prompt)
        assert result.stats.new_tokens == 24
        assert 1.0 <= result.stats.tau <= 5.0


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("depth", [1, 3, 6])
def test_oracle_chain_accepts_everything(arch, depth):
    model = make_model(arch)
    prompt, n = PROMPTS[0], 1 + 5 * (depth + 1)  # 1 token from the prefill, then 5 full steps
    reference = vanilla_tokens(model, prompt, n + depth + 1)
    decoder = SpecDecoder(TargetModel(model, feature_kind=None), TinyTokenizer(),
                          OracleChain(len(prompt), reference, depth), eos_token_ids=[])
    *_, finished = decoder.stream(prompt, max_new_tokens=n)
    assert finished.tokens == reference[:n]
    assert finished.stats.tau == depth + 1
    assert finished.stats.accept_lengths == [depth + 1] * 5
    assert finished.stats.acceptance_per_depth() == [1.0] * depth


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_oracle_tree_with_decoys_finds_the_true_branch(arch):
    model = make_model(arch)
    prompt, depth, n = PROMPTS[2], 4, 1 + 6 * 5
    reference = vanilla_tokens(model, prompt, n + depth + 1)
    decoder = SpecDecoder(TargetModel(model, feature_kind=None), TinyTokenizer(),
                          OracleTreeWithDecoys(len(prompt), reference, depth, VOCAB), eos_token_ids=[])
    *_, finished = decoder.stream(prompt, max_new_tokens=n)
    assert finished.tokens == reference[:n]
    assert finished.stats.accept_lengths == [depth + 1] * 6


@pytest.mark.parametrize("total_tokens,top_k", [(2, 8), (4, 3), (6, 10), (12, 4)])
def test_depth_one_trees_are_the_roots_best_children(total_tokens, top_k):
    """EAGLE-2 at depth 1 takes the root's best children directly: the tree the general expand-and-rerank path
    builds from the same distribution, and greedy output still equals plain decoding."""
    model = make_model("llama")
    engine = Engine.from_model(model, TinyTokenizer(), head=random_head(model, "eagle1"), method="eagle2",
                               tree=TreeSettings(total_tokens=total_tokens, depth=1, top_k=top_k))
    with torch.inference_mode():
        engine.target.reset()
        prompt = torch.tensor(PROMPTS[0])
        out = engine.target.forward(prompt)
        root = int(out.logits[-1].argmax())
        grow = engine.drafter.start_round(torch.cat([prompt, torch.tensor([root])]), out.features)
        fast = grow.dynamic(total_tokens=total_tokens, depth=1, top_k=top_k)
        general = grow.restart()
        ids, vals = general._top_children(general.root_logp, top_k)
        for token, value in zip(ids, vals):
            general._add(0, token, value)
        reference = general._rerank(total_tokens - 1)
    assert fast.tokens.tolist() == reference.tokens.tolist() and fast.parents.tolist() == reference.parents.tolist()
    assert torch.equal(fast.scores, reference.scores)
    assert len(fast.tokens) == min(total_tokens, top_k + 1)
    for prompt in PROMPTS:
        assert engine.generate(prompt, max_new_tokens=16).tokens == vanilla_tokens(model, prompt, 16)


def test_many_prompts_eagle2_equals_vanilla():
    model = make_model("qwen2", seed=3)
    engine = Engine.from_model(model, TinyTokenizer(), head=random_head(model, "eagle1", seed=4), method="eagle2",
                               tree=TreeSettings(total_tokens=8, depth=3, top_k=2))
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        prompt = torch.randint(0, VOCAB, (int(torch.randint(1, 30, (1,), generator=gen)),), generator=gen).tolist()
        assert engine.generate(prompt, max_new_tokens=12).tokens == vanilla_tokens(model, prompt, 12), prompt


def test_eos_and_max_new_tokens_are_honoured():
    model = make_model("llama")
    prompt = PROMPTS[0]
    reference = vanilla_tokens(model, prompt, 20)
    eos = reference[7]
    first = reference.index(eos)
    decoder = SpecDecoder(TargetModel(model, feature_kind=None), TinyTokenizer(),
                          OracleChain(len(prompt), reference, 4), eos_token_ids=[eos])
    *_, finished = decoder.stream(prompt, max_new_tokens=20)
    assert finished.tokens == reference[: first + 1]
    assert finished.stats.finish_reason == "stop"
    decoder.eos = set()
    *_, finished = decoder.stream(prompt, max_new_tokens=9)
    assert finished.tokens == reference[:9] and finished.stats.finish_reason == "length"


def test_text_stream_keeps_its_anchor_where_decoding_apart_differs():
    """A tokenizer whose text of two parts is not the two texts joined (here: words joined with spaces) never moves
    the stream's anchor (it decodes everything each step), and its text and pieces stay exact."""
    from eaglespec.spec.decode import TextStream

    class Spaced:
        def decode(self, ids, skip_special_tokens=True):
            return " ".join(f"w{i}" for i in ids)

    ids = list(range(200))
    stream, pieces = TextStream(Spaced(), ["w150 w151"]), []
    for i in range(0, 200, 3):
        pieces.append(stream.push(ids[i : i + 3]))
        if stream.stopped:
            break
    assert stream.anchor == 0 and stream.next_check > TextStream.ANCHOR_EVERY + TextStream.ANCHOR_WINDOW  # tried
    whole = Spaced().decode(ids)
    assert "".join(pieces) == stream.released == whole[: whole.index("w150 w151")]


def test_stop_string_truncates_text_and_stream_pieces_add_up():
    model = make_model("llama")
    prompt = PROMPTS[0]
    reference = vanilla_tokens(model, prompt, 20)
    stop = f"<{reference[5]}><{reference[6]}>"
    engine = Engine.from_model(model, TinyTokenizer(), method="vanilla")
    pieces, finished = [], None
    for item in engine.stream(prompt, max_new_tokens=20, stop=[stop]):
        if hasattr(item, "stats"):
            finished = item
        else:
            pieces.append(item.text)
    full = TinyTokenizer().decode(reference)
    assert finished.text == full[: full.index(stop)]
    assert "".join(pieces) == finished.text
    assert finished.stats.finish_reason == "stop"
