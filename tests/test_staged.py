"""Staged speculative decoding (`staged`): the draft model verifies stage-2 guesses in one forward, and its greedy
chain with its likeliest alternatives forms a tree for the target. Greedy output equals plain decoding; the chain is
the draft model's own greedy chain (that of `sps`) with fewer draft-model forwards when the guesses are right and no
more when they are wrong; the tree's leaves are the draft model's ranked alternatives, kept by path probability;
sampled output follows the target distribution (statistical test, with the power to catch a broken acceptance
rule)."""

from __future__ import annotations

import argparse

import pytest
import torch
from conftest import TinyTokenizer, make_model
from test_sampling import (
    PARAMS,
    RUNS,
    accept_first_in_support,
    chi_square_p_value,
    model_and_exact,  # noqa: F401 (a fixture: the tiny target and its exact distribution)
)
from test_sampling import PROMPT as SAMPLING_PROMPT
from test_sps import PROMPT, record_forwards, vanilla

from eaglespec.api import Engine
from eaglespec.drafters import TreeSettings
from eaglespec.drafters.draft_model import DraftModelDrafter
from eaglespec.drafters.staged import StagedDrafter, context_lookup
from eaglespec.spec.decode import SpecDecoder
from eaglespec.spec.verify import SamplingParams, verify_sample
from eaglespec.targets.fast import FastTarget, make_target
from eaglespec.targets.hf import TargetModel


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("depth,top_k", [(1, 4), (3, 4), (5, 4), (5, 1)])
def test_greedy_output_equals_vanilla(arch, depth, top_k):
    target, tok = make_model(arch, seed=0), TinyTokenizer()
    draft = make_model(arch, seed=1, layers=2)
    expected = vanilla(target, PROMPT * 3, 32)  # a repetitive prompt: prompt lookup has something to guess
    engine = Engine.from_model(target, tok, method="staged", tree=TreeSettings(depth=depth, top_k=top_k),
                               draft_hf_model=draft)
    assert isinstance(engine.drafter, StagedDrafter)
    assert engine.drafter.rolls_back == (arch != "gemma3")  # gemma3: drafts as sps does, one token a forward
    assert engine.generate(PROMPT * 3, max_new_tokens=32).tokens == expected
    assert engine.generate(PROMPT * 3, max_new_tokens=32).tokens == expected  # and again on the same engine


def greedy_continuation(model, ids: list[int], n: int) -> list[int]:
    """The model's own argmax continuation of `ids`, end-of-sequence tokens included (transformers, no cache)."""
    seq = list(ids)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq], device=model.device)).logits[0, -1].argmax()))
    return seq[len(ids):]


def oracle_stage2(draft_model, wrong: bool = False):
    """A stage 2 that guesses the draft model's own greedy continuation (or, with `wrong`, a token it never
    chooses first), to pin down how many forwards a round takes."""
    def guess(tokens: torch.Tensor, length: int) -> list[int]:
        if length < 1:
            return []
        right = greedy_continuation(draft_model, tokens.tolist(), length)
        return [(right[0] + 1) % draft_model.config.vocab_size] * length if wrong else right

    return guess


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("wrong", [False, True])
def test_drafts_are_the_draft_models_chain_in_fewer_forwards(arch, wrong):
    draft = make_model(arch, seed=1, layers=2)
    depth, guesses = 5, 4  # (guesses = depth - 1: a round of right guesses fits one forward)
    staged = StagedDrafter(make_target(draft, feature_kind=None, exact=True), TreeSettings(depth=depth, top_k=1),
                           stage2=oracle_stage2(draft, wrong), guesses=guesses)
    sps = DraftModelDrafter(make_target(draft, feature_kind=None, exact=True), TreeSettings(depth=depth))
    assert isinstance(staged.model, FastTarget)
    sizes = record_forwards(staged)
    ids = [4, 5, 6, 7]
    for accepted in (2, 0, depth, 1):  # rounds: the target accepts some drafts, then adds its bonus token
        sizes.clear()
        common = 0  # what the draft cache already holds of the sequence (all but the root at least)
        while common < min(len(staged.seen), len(ids) - 1) and staged.seen[common] == ids[common]:
            common += 1
        missing = len(ids) - common  # the catch-up's tokens: the root, and the chain's last token if it was accepted
        trees = [d.draft(torch.tensor(ids), None) for d in (staged, sps)]
        drafts = trees[0].tokens[1:].tolist()
        assert drafts == trees[1].tokens[1:].tolist() == greedy_continuation(draft, ids, depth)
        if wrong:  # every guess rejected: one token a forward, as sps, each forward wider by the guesses it tried
            assert len(sizes) == depth
            assert sizes[0] == missing + min(guesses, depth - 1)
            assert sizes[1:] == [1 + min(guesses, depth - 2 - i) for i in range(depth - 1)]
        else:  # one forward: the catch-up with the depth - 1 right guesses after the root
            assert sizes == [missing + depth - 1]
        # the draft cache keeps the sequence and the drafts but the last, as sps's does
        assert staged.model.cache_len == sps.model.cache_len == len(ids) + depth - 1
        assert staged.seen == sps.seen == ids + drafts[:-1]
        bonus = 7 if accepted == depth or drafts[accepted] != 7 else 8
        ids = ids + drafts[:accepted] + [bonus]
    assert staged.guesses_accepted == (0 if wrong else staged.guessed) and staged.guessed > 0


def test_branched_chain_keeps_the_likeliest_nodes_as_a_tree():
    import math

    from eaglespec.drafters.staged import branched_chain

    log = math.log
    proposal = [10, 11, 12]
    ranked = [([log(.5), log(.4), log(.1)], [10, 20, 21]),  # depth 1: chain .5, alternatives .4 and .1
              ([log(.9), log(.1)], [11, 22]),  # depth 2: chain .45, alternative .05 (under chain node 10)
              ([log(.6), log(.4)], [12, 23])]  # depth 3: chain .27, alternative .18 (under chain node 11)
    tree = branched_chain(9, proposal, ranked, total_tokens=5)  # keeps .5, .45, .4, .27
    assert tree.token_list() == [9, 10, 20, 11, 12] and tree.parents.tolist() == [-1, 0, 0, 1, 3]
    assert [round(math.exp(v), 6) for v in tree.scores.tolist()] == [1.0, 0.5, 0.4, 0.45, 0.27]
    tree = branched_chain(9, proposal, ranked, total_tokens=6)  # and .18, a sibling of the chain's last node
    assert tree.token_list() == [9, 10, 20, 11, 12, 23] and tree.parents.tolist() == [-1, 0, 0, 1, 3, 3]
    tree = branched_chain(9, proposal, ranked, total_tokens=3)  # a chain can lose its tail to a likelier branch
    assert tree.token_list() == [9, 10, 11]  # .45 > .4
    every = branched_chain(9, proposal, ranked, total_tokens=64)  # all 7 candidates, children chain first
    assert every.token_list() == [9, 10, 20, 21, 11, 22, 12, 23]
    assert every.parents.tolist() == [-1, 0, 0, 0, 1, 1, 4, 4]


def test_the_tree_hangs_the_draft_models_likeliest_alternatives_off_its_chain():
    import math

    draft = make_model("llama", seed=1, layers=2)
    depth, top_k, total = 4, 3, 9
    ids = [4, 5, 6, 7]
    tree_drafter = StagedDrafter(make_target(draft, feature_kind=None, exact=True),
                                 TreeSettings(total_tokens=total, depth=depth, top_k=top_k),
                                 stage2=oracle_stage2(draft), guesses=4)
    chain_drafter = StagedDrafter(make_target(draft, feature_kind=None, exact=True),
                                  TreeSettings(total_tokens=total, depth=depth, top_k=1),
                                  stage2=oracle_stage2(draft), guesses=4)
    sizes = [record_forwards(d) for d in (tree_drafter, chain_drafter)]
    tree = tree_drafter.draft(torch.tensor(ids), None)
    spine = chain_drafter.draft(torch.tensor(ids), None).token_list()[1:]
    assert sizes[0] == sizes[1]  # the leaves cost no draft-model forward
    assert spine == greedy_continuation(draft, ids, depth)
    # every candidate from the draft model itself (transformers, no cache): its log-probabilities after ids + the
    # chain so far; a leaf scores its chain parent's path plus its own
    candidates, path = {}, 0.0
    with torch.no_grad():
        for d in range(depth):
            logp = torch.log_softmax(draft(torch.tensor([ids + spine[:d]])).logits[0, -1].float(), -1)
            top = torch.topk(logp, top_k)
            for lp, t in zip(top.values.tolist(), top.indices.tolist()):
                if t != spine[d]:
                    candidates[tuple(spine[:d]) + (t,)] = path + lp
            path += float(logp[spine[d]])
            candidates[tuple(spine[: d + 1])] = path
    best = sorted(candidates.values(), reverse=True)
    assert best[total - 2] - best[total - 1] > 1e-4  # no near-tie at the cut (a fixed seed)
    expected = {p for p, v in candidates.items() if v >= best[total - 2]}
    got = {tuple(tree.token_list()[i] for i in tree.path(n)[1:]): float(tree.scores[n]) for n in range(1, len(tree))}
    assert set(got) == expected and len(tree) == total
    assert all(math.isclose(got[p], candidates[p], abs_tol=1e-4) for p in got)
    assert tuple(spine[:1]) in got  # the chain's first node always stays (it outscores every other candidate)


def test_generation_stats_count_draft_forwards_guesses_and_the_weights_read(capsys):
    from eaglespec.cli import _stream_to_terminal

    target, tok = make_model("qwen2", seed=0), TinyTokenizer()
    draft = make_model("qwen2", seed=1, layers=2)
    engine = Engine.from_model(target, tok, method="staged", tree=TreeSettings(depth=4), draft_hf_model=draft)
    drafter = engine.drafter
    before = drafter.forwards
    s = engine.generate(PROMPT * 3, max_new_tokens=24).stats
    assert s.draft_forwards == drafter.forwards - before > 0
    assert s.stage2_guessed == drafter.guessed > 0 and s.stage2_accepted == drafter.guesses_accepted <= s.stage2_guessed
    target_bytes, draft_bytes = engine.target.weight_bytes(), drafter.model.weight_bytes()
    assert s.target_weight_bytes == target_bytes and draft_bytes < target_bytes  # a 2-layer draft, a 4-layer target
    assert s.weight_bytes == s.target_forwards * target_bytes + s.draft_forwards * draft_bytes
    assert s.traffic == s.weight_bytes / ((s.new_tokens - 1) * target_bytes)
    plain = Engine.from_model(target, tok, method="vanilla").generate(PROMPT * 3, max_new_tokens=24).stats
    assert plain.traffic == 1.0 and plain.draft_forwards == 0
    # the generate command's stats line
    _stream_to_terminal(engine, PROMPT * 3, argparse.Namespace(max_new_tokens=24, temperature=0.0, top_p=1.0, top_k=0,
                                                               seed=None, stop=None, system=None, raw=True))
    line = capsys.readouterr().err
    assert "draft forwards a step" in line and "guesses accepted" in line and "x plain decoding's" in line


def test_guesses_past_the_chain_are_not_asked_for():
    draft = make_model("llama", seed=1, layers=2)
    asked: list[int] = []

    def stage2(tokens, length):
        asked.append(length)
        return [1] * (length + 3)  # more than asked: cut to what fits the chain

    staged = StagedDrafter(make_target(draft, feature_kind=None), TreeSettings(depth=3, top_k=1), stage2=stage2,
                           guesses=8)
    tree = staged.draft(torch.tensor([4, 5, 6]), None)
    assert len(tree) == 4 and asked and all(0 <= n <= 2 for n in asked)  # (the round's first forward: 2 at most)
    with pytest.raises(ValueError, match="guesses"):
        StagedDrafter(make_target(draft, feature_kind=None), stage2=stage2, guesses=0)


def sample_sequences(model, verifier, runs: int) -> list[tuple[int, ...]]:
    # the target drafts for itself through the staged drafter: long accepted chains (and the tree's leaves where
    # sampling leaves the chain), so a wrong rule shows
    drafter = StagedDrafter(make_target(model, feature_kind=None, exact=False), TreeSettings(total_tokens=8, depth=3),
                            stage2=context_lookup(max_ngram=2), guesses=2)
    decoder = SpecDecoder(TargetModel(model, feature_kind=None), TinyTokenizer(), drafter, eos_token_ids=[],
                          sample_verifier=verifier)
    out = []
    for seed in range(runs):
        params = SamplingParams(PARAMS.temperature, PARAMS.top_p, PARAMS.top_k, seed=seed)
        *_, finished = decoder.stream(SAMPLING_PROMPT, max_new_tokens=3, sampling=params)
        out.append(tuple(finished.tokens))
    return out


def test_sampled_output_follows_the_target_distribution(model_and_exact):  # noqa: F811
    model, exact = model_and_exact
    assert chi_square_p_value(sample_sequences(model, verify_sample, RUNS), exact) > 1e-3


def test_the_statistical_test_catches_a_broken_rule_with_staged_drafts(model_and_exact):  # noqa: F811
    model, exact = model_and_exact
    assert chi_square_p_value(sample_sequences(model, accept_first_in_support, RUNS), exact) < 1e-3


# ---- the corpus n-gram model (stage 2) -----------------------------------------------------------------------
def test_ngram_model_keeps_each_contexts_most_frequent_next_token_and_backs_off():
    from eaglespec.drafters.ngram import NgramModel

    seqs = [[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 6], [1, 2, 3], [7, 2, 9], [7, 2, 9], [8, 8]]
    model = NgramModel.build(seqs, vocab_size=10, min_count=2)
    assert model.next_token(1, 2) == 3  # (1, 2) -> 3 three times, 6 once
    assert model.next_token(7, 2) == 9
    assert model.next_token(4, 2) == 3  # (4, 2) never seen: back off to 2 -> 3 (3 of 6 times)
    assert model.next_token(2, 3) == 4  # (2, 3) -> 4 and 5 once each: the tie goes to the lower id
    assert model.next_token(None, 8) is None and model.next_token(9, 8) is None  # 8 -> 8 once: below min_count
    assert model(torch.tensor([5, 1, 2]), 3) == [3, 4]  # (1, 2) -> 3, (2, 3) -> 4, then nothing after (3, 4) or 4
    every = NgramModel.build(seqs, vocab_size=10, min_count=1)
    assert every.next_token(2, 3) == 4 and every.next_token(None, 8) == 8
    assert every(torch.tensor([1, 2]), 3) == [3, 4]  # chained argmaxes: (1,2)->3, (2,3)->4, then (3,4) unseen, 4 unseen
    with pytest.raises(ValueError, match="vocabulary"):
        NgramModel.build([[1, 12]], vocab_size=10)


def test_ngram_model_round_trips_through_its_file_and_refuses_others(tmp_path):
    from safetensors.torch import save_file

    from eaglespec.drafters.ngram import NgramModel
    from eaglespec.errors import CheckpointError

    model = NgramModel.build([[1, 2, 3, 1, 2, 3, 1, 2]], vocab_size=151936, min_count=1)
    model.save(tmp_path / "ngram.safetensors")
    loaded = NgramModel.load(tmp_path / "ngram.safetensors")
    assert loaded.vocab_size == 151936
    assert loaded(torch.tensor([9, 1]), 4) == model(torch.tensor([9, 1]), 4) == [2, 3, 1, 2]
    save_file({"x": torch.zeros(2)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(CheckpointError, match="not an eaglespec n-gram model"):
        NgramModel.load(tmp_path / "other.safetensors")
    with pytest.raises(CheckpointError, match="train ngram"):
        NgramModel.load(tmp_path / "missing.safetensors")


def test_stage2_chain_takes_the_first_stage_that_guesses():
    from eaglespec.drafters.ngram import Stage2Chain

    chain_ = Stage2Chain([lambda t, n: [], lambda t, n: [7] * n, lambda t, n: [8] * n])
    assert chain_(torch.tensor([1]), 2) == [7, 7] and Stage2Chain([])(torch.tensor([1]), 2) == []


def test_staged_engine_with_a_corpus_model_equals_vanilla(tmp_path):
    from eaglespec.drafters.ngram import NgramModel, Stage2Chain

    target, tok = make_model("qwen2", seed=0), TinyTokenizer()
    draft = make_model("qwen2", seed=1, layers=2)
    expected = vanilla(target, PROMPT, 24)
    corpus = [greedy_continuation(draft, PROMPT[:k], 12) for k in range(2, len(PROMPT))]  # text the draft wrote
    NgramModel.build(corpus, target.config.vocab_size, min_count=1).save(tmp_path / "ngram.safetensors")
    engine = Engine.from_model(target, tok, method="staged", tree=TreeSettings(depth=4), draft_hf_model=draft,
                               ngram=tmp_path / "ngram.safetensors")
    assert isinstance(engine.drafter.stage2, Stage2Chain)
    assert engine.generate(PROMPT, max_new_tokens=24).tokens == expected
    assert engine.drafter.guessed > 0  # the corpus model guessed (the prompt alone has no repeated n-gram)


def test_tree_auto_gives_staged_its_hardware_class_tree():
    """--tree auto: the class's STAGED_TREES entry (a CPU: the bare chain); a fixed or absent tree stays as given."""
    from eaglespec.drafters.autotree import STAGED_TREES, cpu_class
    from eaglespec.spec.adaptive import AdaptiveDrafter

    target, tok = make_model("qwen2", seed=0), TinyTokenizer()
    draft = make_model("qwen2", seed=1, layers=2)
    expected = vanilla(target, PROMPT, 24)
    auto = Engine.from_model(target, tok, method="staged", tree="auto", draft_hf_model=draft)
    assert isinstance(auto.drafter, AdaptiveDrafter)  # (and adaptive, as generate runs it)
    chosen = auto.drafter.settings
    assert chosen == STAGED_TREES[cpu_class(auto.target)]
    if auto.target.device.type == "cpu":
        assert chosen.top_k == 1 and auto.drafter.inner.branches == 1  # the draft model's chain
    assert auto.generate(PROMPT, max_new_tokens=24).tokens == expected
    fixed = Engine.from_model(target, tok, method="staged", tree=TreeSettings(8, 3, 4), draft_hf_model=draft)
    assert fixed.drafter.settings == TreeSettings(8, 3, 4) and fixed.drafter.branches == 4
    assert Engine.from_model(target, tok, method="staged", draft_hf_model=draft).drafter.settings == TreeSettings()


def test_cli_builds_an_ngram_model_and_refuses_it_without_staged(tmp_path, capsys):
    from test_train import conversations, make_tokenizer, write_sharegpt

    from eaglespec.cli import main
    from eaglespec.drafters.ngram import NgramModel

    model_dir = tmp_path / "tiny-model"
    make_model("llama", seed=1, vocab=48, layers=2).save_pretrained(model_dir)
    make_tokenizer().save_pretrained(model_dir)
    data = write_sharegpt(tmp_path / "data.json", conversations(8, seed=2))
    out = tmp_path / "ngram.safetensors"
    assert main(["train", "ngram", "--model", str(model_dir), "--data", data, "--out", str(out),
                 "--min-count", "1"]) == 0
    assert NgramModel.load(out).contexts > 0 and "n-gram model of" in capsys.readouterr().err
    assert main(["generate", "hi", "--ngram", str(out)]) == 2
    assert "--method staged" in capsys.readouterr().err


def test_the_ngram_model_shipped_for_the_05b_is_stageds_default():
    """--ngram auto (the default): --method staged with a registry draft model reads the n-gram model shipped for it;
    other methods, other draft models, None and "none" read the context's n-grams alone; a path is that file."""
    from pathlib import Path

    from eaglespec.drafters.ngram import NgramModel
    from eaglespec.models import NGRAMS_DIR, REGISTRY, resolve_ngram, shipped_ngram

    shipped = shipped_ngram("qwen2.5-coder-0.5b")
    assert shipped is not None and shipped.parent == NGRAMS_DIR
    model = NgramModel.load(shipped)
    assert model.vocab_size == 151936 and model.contexts > 0  # the 0.5B's (and 1.5B's) vocabulary
    assert all((NGRAMS_DIR / spec.ngram).is_file() for spec in REGISTRY.values() if spec.ngram)
    assert resolve_ngram("auto", "staged", "qwen2.5-coder-0.5b") == shipped
    assert resolve_ngram("auto", "eagle2", "qwen2.5-coder-0.5b") is None  # a head's --extend: the context alone
    assert resolve_ngram("auto", "staged", "smollm2-135m") is None and shipped_ngram(None) is None
    assert resolve_ngram("none", "staged", "qwen2.5-coder-0.5b") is None
    assert resolve_ngram(None, "staged", "qwen2.5-coder-0.5b") is None
    assert resolve_ngram("my.safetensors", "eagle2", None) == Path("my.safetensors")


def test_engine_and_cli_take_the_draft_models_shipped_ngram_by_default(tmp_path, monkeypatch):
    import eaglespec.api as api
    import eaglespec.models as models
    from eaglespec.cli import check_options
    from eaglespec.drafters.ngram import NgramModel, Stage2Chain
    from eaglespec.errors import EagleSpecError

    target, tok = make_model("qwen2", seed=0), TinyTokenizer()
    draft = make_model("qwen2", seed=1, layers=2)
    expected = vanilla(target, PROMPT, 24)
    corpus = [greedy_continuation(draft, PROMPT[:k], 12) for k in range(2, len(PROMPT))]
    NgramModel.build(corpus, target.config.vocab_size, min_count=1).save(tmp_path / "tiny.safetensors")
    monkeypatch.setattr(models, "NGRAMS_DIR", tmp_path)
    monkeypatch.setitem(models.REGISTRY, "tiny-draft",
                        models.ModelSpec("tiny-draft", "a test's draft model", ngram="tiny.safetensors"))
    monkeypatch.setattr(api, "load_target", lambda name, *a, **k: (draft if name == "tiny-draft" else target, tok))
    engine = Engine(model="tiny-target", method="staged", draft_model="tiny-draft", tree=TreeSettings(depth=4))
    assert engine.ngram == tmp_path / "tiny.safetensors" and isinstance(engine.drafter.stage2, Stage2Chain)
    assert engine.generate(PROMPT, max_new_tokens=24).tokens == expected
    assert engine.drafter.guessed > 0  # the shipped model guessed (the prompt alone has no repeated n-gram)
    off = Engine(model="tiny-target", method="staged", draft_model="tiny-draft", tree=TreeSettings(depth=4),
                 ngram="none")
    assert off.ngram is None and not isinstance(off.drafter.stage2, Stage2Chain)
    assert off.generate(PROMPT, max_new_tokens=24).tokens == expected
    base = dict(temperature=0.0, top_p=1.0, top_k=0, seed=None, max_new_tokens=8, device=None, draft_vocab=None,
                tree="auto", head="auto", prompt="hi", draft_model=None, extend=0, model="smollm2-135m")
    for value in ("auto", "none"):  # the default and its opposite go with any method
        check_options(argparse.Namespace(**{**base, "method": "eagle2", "ngram": value}))
    with pytest.raises(EagleSpecError, match="--ngram is the second stage"):
        check_options(argparse.Namespace(**{**base, "method": "eagle2", "ngram": "x.safetensors"}))


def test_longest_chain_caps_the_draft_models_chain_under_tree_auto_and_is_refused_elsewhere(capsys):
    from eaglespec.cli import check_options, main
    from eaglespec.errors import EagleSpecError

    base = dict(temperature=0.0, top_p=1.0, top_k=0, seed=None, max_new_tokens=8, device=None, draft_vocab=None,
                tree="auto", head="auto", prompt="hi", draft_model="tiny-draft", extend=None, ngram="auto",
                model="smollm2-135m", longest_chain=9)
    for method in ("sps", "staged"):
        check_options(argparse.Namespace(**{**base, "method": method}))
    with pytest.raises(EagleSpecError, match="--longest-chain caps the draft model's chain of --method sps or staged"):
        check_options(argparse.Namespace(**{**base, "method": "pld", "draft_model": None}))
    with pytest.raises(EagleSpecError, match="--tree 16,5,1 fixes it"):
        check_options(argparse.Namespace(**{**base, "method": "staged", "tree": "16,5,1"}))
    with pytest.raises(SystemExit) as exc:
        main(["generate", "hi", "--longest-chain", "0"])
    assert exc.value.code == 2 and "--longest-chain: expected a positive integer, got 0" in capsys.readouterr().err
    for argv in (["bench", "--methods", "pld", "--longest-chain", "4"],
                 ["bench", "--methods", "staged,staged@longest=9", "--tree", "8,3,1"],
                 ["bench", "--methods", "staged", "--tree", "8,3,1", "--longest-chain", "4"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "longest" in err and len(err.strip().splitlines()) == 1, err
