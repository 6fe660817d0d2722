"""A second stage for an EAGLE head (`extend`): stage-2 guesses merged into the draft tree as a chain from the root.
The tree keeps its nodes, the guesses run through the nodes they match and on as new ones scoring below their
parents, under --tree auto only as many as are worth their verify rows, greedy output equals plain decoding, and
where the text repeats itself the target accepts guesses the head did not draft."""

from __future__ import annotations

import argparse

import pytest
import torch
from conftest import TinyTokenizer, make_model
from test_engine import random_head, vanilla_tokens

from eaglespec import Engine, TreeSettings
from eaglespec.cli import check_options
from eaglespec.drafters.chain_length import GuessCount
from eaglespec.drafters.eagle import GUESS_LOGP, EagleDrafter, append_chain, matched_guesses
from eaglespec.errors import EagleSpecError
from eaglespec.spec.tree import DraftTree


def merge_guesses(tree: DraftTree, guesses: list[int], length: int) -> DraftTree:
    """What `EagleDrafter._guess` does with `length` new nodes: down through the nodes the guesses match, then on."""
    node, matched = matched_guesses(tree, guesses)
    return append_chain(tree, node, guesses[matched : matched + length])


def test_guesses_run_through_the_nodes_they_match_then_hang_as_a_chain():
    # root 9 -> (1: -0.2, 2: -0.9); 1 -> (3: -0.6, 4: -0.4); 2 -> (5: -1.0)
    tree = DraftTree.from_lists([9, 1, 2, 3, 4, 5], [-1, 0, 0, 1, 1, 2], [0.0, -0.2, -0.9, -0.6, -0.4, -1.0])
    assert matched_guesses(tree, [1, 4, 7, 8, 6]) == (4, 2)
    out = merge_guesses(tree, [1, 4, 7, 8, 6], 2)
    assert out.token_list()[:6] == tree.token_list() and out.parents.tolist()[:6] == tree.parents.tolist()
    assert out.token_list()[6:] == [7, 8] and out.parents.tolist()[6:] == [4, 6]  # under 9 -> 1 -> 4; 2 new nodes
    assert out.scores.tolist()[6:] == pytest.approx([-0.4 + GUESS_LOGP, -0.4 + 2 * GUESS_LOGP])
    assert out.prune(3).token_list() == [9, 1, 4]  # guesses score below every node they hang under
    apart = merge_guesses(tree, [3, 1], 4)  # no child of the root is 3
    assert apart.token_list()[6:] == [3, 1] and apart.parents.tolist()[6:] == [0, 6]
    assert merge_guesses(tree, [], 3) is tree
    assert merge_guesses(tree, [2, 5], 3) is tree  # all matched: nothing new
    assert merge_guesses(tree, [1, 4, 7], 0) is tree
    root = merge_guesses(DraftTree.root_only(9), [3, 4], 2)
    assert root.token_list() == [9, 3, 4] and root.parents.tolist() == [-1, 0, 1]


def test_guess_count_takes_the_guesses_worth_their_rows():
    """alpha^d T / E > b, depth by depth: all guesses where they hold and rows are cheap, none where they rarely
    hold or rows cost much; every guess until a round has been timed."""
    count = GuessCount(8)
    assert count.next(0, 4) == 8
    for rows in (4, 12, 8, 12, 4, 8):  # a round of R rows takes 0.1 + 0.001 R s and commits 5 tokens
        count.observe_round(8, 6, rows, 5, 0.1 + 0.001 * rows)
    assert count.alpha > 0.7 and count.costs.b == pytest.approx(0.001)
    assert count.next(0, 4) == 8
    for _ in range(30):  # guesses rarely hold
        count.observe_round(8, 0, 12, 2, 0.112)
    # alpha ~0.11 and T / E ~0.052 s: the first guess (0.0057 s of tokens) still pays its 1 ms row, the second not
    assert count.alpha < 0.15 and count.next(0, 4) == 1 and count.next(1, 4) == 0
    costly = GuessCount(8, prior_alpha=0.6, prior_weight=1e6)  # alpha pinned at 0.6
    for rows in (4, 12, 8, 12, 4, 8):  # each row costs 2% of a round committing 2 tokens
        costly.observe_round(8, 0, rows, 2, 0.1 + 0.002 * rows)
    # T / E ~ 0.056 s a token: 0.6^d * 0.056 > 0.002 while d <= 6; three of them already matched head nodes
    assert costly.next(0, 4) == 6 and costly.next(3, 4) == 3


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("method", ["eagle2", "chain", "eagle1"])
def test_extended_drafts_keep_greedy_output(arch, method):
    model = make_model(arch)
    prompt = [5, 17, 33, 2, 9, 40] * 4  # repetitive: the context's n-grams guess something
    tree = None if method == "eagle1" else TreeSettings(total_tokens=6, depth=2, top_k=2)
    engine = Engine.from_model(model, TinyTokenizer(), head=random_head(model, "eagle3"), method=method, tree=tree,
                               adapt=False, extend=6)
    drafter = engine.drafter
    assert isinstance(drafter, EagleDrafter) and drafter.extend == 6
    for p in (prompt, [60, 61, 62, 63, 64, 60, 61, 62]):
        assert engine.generate(p, max_new_tokens=40).tokens == vanilla_tokens(model, p, 40), (arch, method, p)


def test_guesses_are_accepted_past_the_heads_depth_where_the_text_repeats():
    """A random head's drafts are rarely accepted; on a context that the target continues by repeating itself, the
    guesses are, so tau rises above what the head's depth allows alone."""
    model = make_model("llama")
    prompt = list(range(10, 30))
    continuation = vanilla_tokens(model, prompt, 48)
    looped = prompt + continuation  # the target's own text, so its n-grams recur in what follows
    expected = vanilla_tokens(model, looped + continuation, 40)
    tree = TreeSettings(total_tokens=3, depth=1, top_k=2)
    plain = Engine.from_model(model, TinyTokenizer(), head=random_head(model, "eagle3"), method="eagle2", tree=tree,
                              adapt=False)
    extended = Engine.from_model(model, TinyTokenizer(), head=random_head(model, "eagle3"), method="eagle2",
                                 tree=tree, adapt=False, extend=8)
    without = plain.generate(looped + continuation, max_new_tokens=40)
    with_guesses = extended.generate(looped + continuation, max_new_tokens=40)
    assert with_guesses.tokens == without.tokens == expected
    assert with_guesses.stats.tau > max(2.0, without.stats.tau)  # depth 1 alone gives at most 2


def test_bad_extend_is_refused_with_what_to_do():
    model = make_model("llama")
    with pytest.raises(EagleSpecError, match="positive count"):
        Engine.from_model(model, TinyTokenizer(), head=random_head(model, "eagle3"), extend=-1)
    with pytest.raises(EagleSpecError, match="has no head"):
        Engine.from_model(model, TinyTokenizer(), method="vanilla", extend=4)
    base = dict(temperature=0.0, top_p=1.0, top_k=0, seed=None, max_new_tokens=8, device=None, draft_vocab=None,
                tree="auto", head="auto", prompt="hi", draft_model=None, ngram=None, extend=4)
    with pytest.raises(EagleSpecError, match="--extend continues an EAGLE head's draft"):
        check_options(argparse.Namespace(**{**base, "method": "pld"}))
    with pytest.raises(EagleSpecError, match="--ngram is the second stage"):
        check_options(argparse.Namespace(**{**base, "method": "eagle2", "extend": 0, "ngram": "x.safetensors"}))
    check_options(argparse.Namespace(**{**base, "method": "eagle2", "ngram": "x.safetensors"}))  # with --extend


def test_the_models_default_applies_to_heads_only(monkeypatch):
    """`extend=None` (the API's and the CLI's default) takes the registry model's default for a head's drafts, and
    none for methods without a head; an explicit count wins."""
    import eaglespec.api as api
    from eaglespec.models import default_extend

    assert default_extend("qwen2.5-coder-1.5b") == 8
    assert default_extend("smollm2-135m") == default_extend("qwen2.5-coder-0.5b") == default_extend("/a/folder") == 0
    model = make_model("llama")
    monkeypatch.setattr(api, "load_target", lambda *a, **k: (model, TinyTokenizer()))
    monkeypatch.setattr(api, "load_head", lambda *a, **k: random_head(model, "eagle3"))
    monkeypatch.setattr(api, "default_extend", lambda name: 5 if name == "coder" else 0)
    assert Engine(model="coder", head="h", method="eagle2", tree=None).extend == 5
    assert Engine(model="coder", head="h", method="eagle2", tree=None, extend=0).extend == 0
    assert Engine(model="other", head="h", method="eagle2", tree=None).extend == 0
    assert Engine(model="coder", method="pld", tree=None).extend == 0
    base = dict(temperature=0.0, top_p=1.0, top_k=0, seed=None, max_new_tokens=8, device=None, draft_vocab=None,
                tree="auto", head="auto", prompt="hi", draft_model=None, extend=None)
    # --ngram goes with the 1.5B's eagle2 (its default guesses) and not with SmolLM2's (none by default)
    check_options(argparse.Namespace(**{**base, "model": "qwen2.5-coder-1.5b", "method": "eagle2", "ngram": "x"}))
    with pytest.raises(EagleSpecError, match="--ngram is the second stage"):
        check_options(argparse.Namespace(**{**base, "model": "smollm2-135m", "method": "eagle2", "ngram": "x"}))


def test_bench_sweeps_extend_over_the_heads_methods():
    from eaglespec.bench.methods import SWEEP_AFFECTS, parse_sweep

    assert parse_sweep("extend=0,8") == ("extend", [0, 8])
    assert "eagle2" in SWEEP_AFFECTS["extend"] and "sps" not in SWEEP_AFFECTS["extend"]
    with pytest.raises(EagleSpecError, match="0 or more"):
        parse_sweep("extend=-1")


def test_under_tree_auto_the_drafter_counts_its_guesses_by_what_they_bring():
    """With a tree given by the caller the extension is fixed; under tree auto each drafter (and each fork) has a
    GuessCount, fed by the rounds: on a looping text its guesses hold, so its alpha rises."""
    model = make_model("llama")
    head = random_head(model, "eagle3")
    fixed = Engine.from_model(model, TinyTokenizer(), head=head, method="eagle2", adapt=False, extend=4,
                              tree=TreeSettings(total_tokens=3, depth=1, top_k=2))
    assert fixed.drafter.guess_count is None
    auto = Engine.from_model(model, TinyTokenizer(), head=head, method="eagle2", adapt=False, extend=4, tree="auto")
    drafter = auto.drafter.inner if hasattr(auto.drafter, "inner") else auto.drafter
    assert isinstance(drafter.guess_count, GuessCount)
    assert drafter.fork().guess_count is not drafter.guess_count
    prompt = list(range(10, 30))
    looped = prompt + vanilla_tokens(model, prompt, 48)
    looped += vanilla_tokens(model, looped, 48)
    before = drafter.guess_count.tried
    result = auto.generate(looped, max_new_tokens=40)
    assert result.tokens == vanilla_tokens(model, looped, 40)
    assert drafter.guess_count.tried > before and drafter.guess_count.alpha > 0.5


def test_a_round_whose_head_path_outran_its_guesses_is_counted():
    """The head's own path can be accepted past the end of the guess chain: the guesses count as accepted up to
    their length (a regression: this once indexed past the guesses)."""
    model = make_model("llama")
    engine = Engine.from_model(model, TinyTokenizer(), head=random_head(model, "eagle3"), method="eagle2",
                               adapt=False, extend=4, tree="auto")
    drafter = engine.drafter.inner if hasattr(engine.drafter, "inner") else engine.drafter
    drafter.stage2 = lambda context, length: []
    drafter._last = (3, [7], 5, 3, 0.0)  # last round: context of 3, guess chain [7], 5 rows, depth 3
    seen = []
    drafter.guess_count.observe_round = lambda *args: seen.append(args[:4])
    tree = DraftTree.root_only(9)
    assert drafter._guess(torch.tensor([1, 2, 3, 7, 8, 9]), tree) is tree  # committed 7, 8, then the root 9
    assert seen == [(1, 1, 5, 3)]
