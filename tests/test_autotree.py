"""`--tree auto`: the replay of smaller trees from one large calibration tree, the choice, the cache."""

import random

import pytest
import torch
from conftest import TinyTokenizer, make_model
from test_engine import random_head, vanilla_tokens

from eaglespec import Engine, TreeSettings
from eaglespec.cpuload import LoadMonitor, LoadReading
from eaglespec.drafters import EagleDrafter, autotree
from eaglespec.drafters.autotree import (
    Candidates,
    TreeChoice,
    _candidates,
    auto_tree,
    cache_path,
    check_by_decoding,
    choose,
    keep_fastest,
    verify_costs,
)
from eaglespec.targets.fast import make_target


def accepted_in(tree, truth: list[int]) -> int:
    """Accepted length (bonus included) of a drafted DraftTree when the target's continuation is `truth`."""
    node, depth = 0, 0
    tokens, kids = tree.tokens.tolist(), tree.children()
    while depth < len(truth):
        nxt = [c for c in kids[node] if tokens[c] == truth[depth]]
        if not nxt:
            break
        node, depth = nxt[0], depth + 1
    return depth + 1


def test_replay_on_a_hand_built_tree():
    # root -> a (-0.1), b (-1.0); a -> c (-0.3), d (-0.5); b -> e (-1.2); c -> f (-0.4). Truth follows a, c, f.
    parents = [-1, 0, 0, 1, 1, 2, 3]
    scores = [0.0, -0.1, -1.0, -0.3, -0.5, -1.2, -0.4]
    depths = [0, 1, 1, 2, 2, 2, 3]
    correct = [True, True, False, True, False, False, True]
    kids = [[1, 2], [3, 4], [5], [6], [], [], []]
    c = Candidates(parents, depths, scores, correct, kids)
    assert c.accepted_length(total_tokens=2, depth=1, top_k=1) == 2  # a
    assert c.accepted_length(total_tokens=4, depth=3, top_k=1) == 4  # a, c, f
    assert c.accepted_length(total_tokens=3, depth=3, top_k=1) == 3  # f cut by the size limit
    # top_k=2: level 2 = c, d, e; frontier c, d; f (-0.4) outranks d (-0.5) and b (-1.0).
    assert c.accepted_length(total_tokens=4, depth=3, top_k=2) == 4  # keeps a, c, f
    assert c.accepted_length(total_tokens=8, depth=2, top_k=2) == 3  # depth 2 never reaches f


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
def test_replay_matches_the_tree_actually_drafted(kind):
    model = make_model("llama")
    head = random_head(model, kind)
    target = make_target(model, feature_kind="eagle3" if kind == "eagle3" else "final")
    drafter = EagleDrafter(head, target.embed_tokens, target.lm_head, "dynamic")
    prompt = [5, 17, 33, 2, 9, 40]
    seq = prompt + vanilla_tokens(model, prompt, 30)
    rng = random.Random(0)
    big_depth, big_k = 4, 4
    with torch.inference_mode():
        features = target.forward(torch.tensor(seq)).features
        target.reset()
        seen, checked, nontrivial = 0, 0, 0
        for p in range(len(prompt), len(seq) - big_depth):
            grow = drafter.start_round(torch.tensor(seq[: p + 1]), features[seen:p])
            seen = p
            settings = [(12, 4, 4), (6, 3, 4), (9, 4, 2), (4, 2, 3), (5, 4, 1)]
            small = {}
            for t, d, k in settings:
                small[(t, d, k)] = grow.restart().dynamic(t, d, k)
            grow = grow.restart()
            grow.dynamic(total_tokens=2, depth=big_depth, top_k=big_k)
            for (t, d, k), tree in small.items():
                # A continuation that follows a random path of the drafted tree, then leaves it.
                node = rng.randrange(len(tree))
                truth = [int(tree.tokens[i]) for i in tree.path(node)[1:]] + [rng.randrange(96)] * 4
                expected = accepted_in(tree, truth)
                replayed = _candidates(grow, truth).accepted_length(t, d, k)
                if k == big_k:  # same frontier as the large tree: exact by construction
                    assert replayed == expected, (p, t, d, k)
                else:
                    assert replayed <= expected
                    checked += replayed == expected
                nontrivial += expected > 2
    assert nontrivial > 20  # the check covered real multi-token acceptances
    assert checked >= 0.9 * 3 * (len(seq) - big_depth - len(prompt))


def test_timing_the_draft_rounds_leaves_the_candidates_alone():
    # Timing runs extra target forwards (to flush the CPU caches) and restarts of the tree; neither may change what
    # the head drafts or what is recorded as accepted.
    from eaglespec.drafters.autotree import record_candidates

    model = make_model("llama")
    head = random_head(model, "eagle1")
    target = make_target(model, feature_kind="final")
    drafter = EagleDrafter(head, target.embed_tokens, target.lm_head, "dynamic")
    prompt = [5, 17, 33, 2, 9, 40]
    sequences = [(prompt + vanilla_tokens(model, prompt, 24), len(prompt))]
    plain, none = record_candidates(drafter, target, sequences, depth=4, top_k=4)
    timed, draft_ms = record_candidates(drafter, target, sequences, depth=4, top_k=4,
                                        time_settings=[(1, 1), (3, 2)], time_rounds=2)
    assert none == {} and set(draft_ms) == {"1,1", "3,2"} and all(ms > 0 for ms in draft_ms.values())
    assert [(r.parents, r.scores, r.correct) for r in timed] == [(r.parents, r.scores, r.correct) for r in plain]


def test_choice_follows_the_cost_of_verifying():
    # One position where a chain of 6 would be accepted entirely, and the second-ranked branch never.
    n = 1 + 2 * 6
    parents, depths, scores, correct, kids = [-1], [0], [0.0], [True], [[]]
    prev = 0
    for d in range(1, 7):
        for rank in range(2):
            parents.append(prev)
            depths.append(d)
            scores.append(scores[prev] - 0.1 - rank)
            correct.append(correct[prev] and rank == 0)
            kids.append([])
            kids[prev].append(len(parents) - 1)
        prev = kids[prev][0]
    assert len(parents) == n
    rounds = [Candidates(parents, depths, scores, correct, kids)]
    draft = {f"{d},{k}": 1.0 * d for d in range(1, 9) for k in (1, 2, 3, 4, 6, 8)}
    flat = {t: 10.0 for t in (1, 2, 3, 4, 6, 8, 10, 12, 16)}
    steep = {t: 10.0 * t for t in (1, 2, 3, 4, 6, 8, 10, 12, 16)}
    deep = choose(rounds, flat, draft)
    assert deep.expected_tau == 7.0 and deep.settings.depth == 6
    shallow = choose(rounds, steep, draft)
    assert shallow.settings.total_tokens == 2 and shallow.expected_tau == 2.0
    assert shallow.ranking[0]["tokens_per_s"] >= shallow.ranking[-1]["tokens_per_s"]


def test_verify_costs_cover_the_sizes_that_fit():
    model = make_model("llama")  # context 512
    costs = verify_costs(make_target(model, feature_kind=None), sizes=(2, 8, 32), context=64, repeats=1)
    assert set(costs) == {1, 2, 8, 32} and all(v > 0 for v in costs.values())
    assert [costs[n] for n in sorted(costs)] == sorted(costs.values())  # a bigger tree never costs less
    small = make_model("llama", max_position_embeddings=48)
    assert max(verify_costs(make_target(small, feature_kind=None), sizes=(2, 8, 32), context=64, repeats=1)) == 8


def test_verify_costs_time_passes_over_the_given_text(monkeypatch):
    """With real text, the context and each timed tree are that text's tokens (greedy decoding's screened LM head
    does its usual work only on real hidden states); too short a text falls back to random tokens."""
    target = make_target(make_model("llama"), feature_kind=None)
    seen = []
    forward = target.forward
    monkeypatch.setattr(target, "forward",
                        lambda tokens, *a, **k: seen.append(tokens.tolist()) or forward(tokens, *a, **k))
    text = [(7 * i + 3) % target.vocab_size for i in range(100)]
    verify_costs(target, sizes=(2, 8), context=64, repeats=1, text=text)
    assert seen[0] == text[:64] and {tuple(s) for s in seen[1:]} == {tuple(text[64 : 64 + n]) for n in (1, 2, 8)}
    seen.clear()
    verify_costs(target, sizes=(2, 8), context=64, repeats=1, text=text[:70])
    assert len(seen[0]) == 64 and seen[0] != text[:64]


class QuietMonitor(LoadMonitor):
    """A LoadMonitor whose reading says nothing else ran (the machine running the tests may be busy)."""

    def __exit__(self, *exc) -> None:
        self.reading = LoadReading(0.0, 1.0)


class BusyMonitor(LoadMonitor):
    def __exit__(self, *exc) -> None:
        self.reading = LoadReading(0.9, 1.0)


def test_auto_tree_engine_is_lossless_and_cached(monkeypatch):
    model = make_model("llama")
    head = random_head(model, "eagle3")
    from eaglespec.models import cache_root

    monkeypatch.setattr(autotree, "LoadMonitor", QuietMonitor)
    verify_files = set((cache_root() / "trees").glob("verify-*.json"))  # other tests may have measured this target
    engine = Engine.from_model(model, TinyTokenizer(), head=head, method="eagle2")
    choice = auto_tree(engine, prompts=[[5, 17, 33, 2, 9, 40], [60, 61, 62]], new_tokens=24, calibrate=True)
    assert not choice.cached and choice.positions == 2 * 8  # (24 - 8) / 2 positions per prompt
    assert choice.measured_tokens_per_s > 0 and choice.measured_vanilla_tokens_per_s > 0  # checked by decoding
    assert choice.settings == engine.drafter.settings
    # the cost model's pick was decoded beside the CPU class's default (where they differ), and the faster kept
    default = autotree.DEFAULT_TREES[autotree.cpu_class(engine.target)]
    picked = TreeSettings(**{k: choice.checked[0][k] for k in ("total_tokens", "depth", "top_k")})
    assert len(choice.checked) == (1 if picked == default else 2)
    fastest = max(choice.checked, key=lambda c: c["tokens_per_s"])
    kept = choice.settings
    assert (kept.total_tokens, kept.depth, kept.top_k) == tuple(fastest[k] for k in ("total_tokens", "depth", "top_k"))
    assert choice.measured_tokens_per_s == pytest.approx(fastest["tokens_per_s"], abs=0.01)
    s = engine.drafter.settings
    assert 2 <= s.total_tokens <= 64 and 1 <= s.depth <= 8 and 1 <= s.top_k <= 8
    assert cache_path(engine, "dynamic").is_file()
    again = Engine.from_model(model, TinyTokenizer(), head=head, method="eagle2", tree="auto",
                              adapt=False)  # reads the cache; always drafts
    assert again.tree_choice.cached and again.drafter.settings == s
    prompt = [5, 17, 33, 2, 9, 40]
    assert engine.generate(prompt, max_new_tokens=20).tokens == vanilla_tokens(model, prompt, 20)
    chain = Engine.from_model(model, TinyTokenizer(), head=head, method="chain")
    auto_tree(chain, prompts=[[5, 17, 33, 2, 9, 40]], new_tokens=24, calibrate=True)
    new_files = set((cache_root() / "trees").glob("verify-*.json")) - verify_files
    assert len(new_files) <= 1  # verify costs measured once per target, shared by both drafters
    assert chain.drafter.settings.top_k == 1 and chain.drafter.settings.total_tokens == chain.drafter.settings.depth + 1


def test_a_disturbed_calibration_is_used_but_not_cached(monkeypatch, capsys):
    model = make_model("llama", seed=5)
    head = random_head(model, "eagle1")
    monkeypatch.setattr(autotree, "LoadMonitor", BusyMonitor)
    engine = Engine.from_model(model, TinyTokenizer(), head=head, method="eagle2")
    choice = auto_tree(engine, prompts=[[5, 17, 33, 2, 9, 40]], new_tokens=24, calibrate=True)
    assert choice.source == "calibrated" and engine.drafter.settings == choice.settings
    assert not cache_path(engine, "dynamic").is_file()
    assert "not cached: other processes used 0.90 cores" in capsys.readouterr().err
    assert "0.90 cores" in choice.load
    # the next run starts from the CPU class's default again, without measuring
    again = Engine.from_model(model, TinyTokenizer(), head=head, tree="auto", adapt=False)
    assert again.tree_choice.source == "default" and not again.tree_choice.cached


def test_first_run_uses_the_cpu_class_default_without_measuring(monkeypatch):
    """No calibration on this machine yet: `--tree auto` starts at once from DEFAULT_TREES and drafts, adapting."""
    from eaglespec.spec.adaptive import DRAFT, AdaptiveDrafter

    def never(*args, **kwargs):
        raise AssertionError("measured on a first run")

    monkeypatch.setattr(autotree, "verify_costs", never)
    monkeypatch.setattr(autotree, "record_candidates", never)
    model = make_model("llama", seed=6)
    head = random_head(model, "eagle1")
    engine = Engine.from_model(model, TinyTokenizer(), head=head, tree="auto")
    choice = engine.tree_choice
    assert choice.source == "default" and choice.speculate
    assert engine.drafter.settings == autotree.DEFAULT_TREES[autotree.cpu_class(engine.target)]
    assert isinstance(engine.drafter, AdaptiveDrafter) and engine.drafter.policy.chosen == DRAFT
    assert "not yet calibrated" in engine.notice and "--tree calibrate" in engine.notice
    chain = Engine.from_model(model, TinyTokenizer(), head=head, method="chain", tree="auto")
    assert chain.drafter.settings.top_k == 1
    prompt = [5, 17, 33, 2, 9, 40]
    assert engine.generate(prompt, max_new_tokens=16).tokens == vanilla_tokens(model, prompt, 16)


def test_tree_must_be_auto_or_settings():
    from eaglespec.errors import EagleSpecError

    model = make_model("llama")
    with pytest.raises(EagleSpecError, match="auto"):
        Engine.from_model(model, TinyTokenizer(), head=random_head(model, "eagle1"), tree="big")
    fixed = Engine.from_model(model, TinyTokenizer(), head=random_head(model, "eagle1"),
                              tree=TreeSettings(total_tokens=8, depth=3, top_k=2))
    assert fixed.tree_choice is None and fixed.drafter.settings.total_tokens == 8


@pytest.mark.parametrize("expected, speculates", [(50.0, False), (150.0, True)])
def test_auto_adapts_starting_from_the_calibrated_choice(expected, speculates):
    import json

    from eaglespec.spec.adaptive import DRAFT, PLAIN, AdaptiveDrafter

    model = make_model("llama", seed=3)
    head = random_head(model, "eagle1")
    probe = Engine.from_model(model, TinyTokenizer(), head=head)
    choice = TreeChoice(TreeSettings(total_tokens=4, depth=2, top_k=2), 1.5, expected, {1: 10.0, 4: 12.0},
                        {"2,2": 1.0}, [], 10)
    path = cache_path(probe, "dynamic")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(choice.to_json()))
    engine = Engine.from_model(model, TinyTokenizer(), head=head, tree="auto")
    assert engine.tree_choice.cached and engine.tree_choice.speculate == speculates
    assert isinstance(engine.drafter, AdaptiveDrafter) and engine.method == "eagle2"
    assert engine.drafter.policy.chosen == (DRAFT if speculates else PLAIN)
    assert engine.drafter.settings == choice.settings
    forced = Engine.from_model(model, TinyTokenizer(), head=head, tree="auto", adapt=False)
    assert forced.drafter.settings == choice.settings and isinstance(forced.drafter, EagleDrafter)
    prompt = [5, 17, 33, 2, 9, 40]
    assert engine.generate(prompt, max_new_tokens=12).tokens == vanilla_tokens(model, prompt, 12)


def test_measured_rates_decide_over_the_cost_model():
    import json

    choice = TreeChoice(TreeSettings(total_tokens=4, depth=2, top_k=2), 1.5, 150.0, {1: 10.0, 4: 12.0},
                        {"2,2": 1.0}, [], 10)
    assert choice.speculate  # expected 150 tokens/s against 100 for one-token forwards
    choice.measured_tokens_per_s, choice.measured_vanilla_tokens_per_s = 90.0, 100.0
    assert not choice.speculate and "measured by decoding: 90.0 against 100.0" in choice.summary()
    assert not TreeChoice.from_json(json.loads(json.dumps(choice.to_json()))).speculate


def test_check_by_decoding_times_every_way_and_keeps_the_engines_drafter():
    model = make_model("llama", seed=3)
    engine = Engine.from_model(model, TinyTokenizer(), head=random_head(model, "eagle1"))
    drafter = engine.decoder.drafter
    before = drafter.settings
    used = []
    draft = drafter.draft
    drafter.draft = lambda *a: used.append(drafter.settings) or draft(*a)  # (instance attribute: this engine only)
    candidates = [TreeSettings(total_tokens=4, depth=2, top_k=2), TreeSettings(total_tokens=2, depth=1, top_k=1)]
    trees, plain = check_by_decoding(engine, candidates, prompts=[[5, 17, 33, 2], [60, 61, 62]], new_tokens=8)
    assert len(trees) == 2 and all(rate > 0 for rate in trees) and plain > 0
    assert set(map(repr, used)) == set(map(repr, candidates))  # each candidate drafted
    assert engine.decoder.drafter is drafter and drafter.settings == before


def _choice(settings: TreeSettings) -> TreeChoice:
    """A calibrated choice of `settings` with made-up costs (expected tau 2.5)."""
    return TreeChoice(settings, 2.5, 150.0, {1: 10.0, 4: 12.0, 6: 13.0}, {"2,2": 2.0, "2,4": 3.0}, [], 1)


def test_decoding_keeps_the_class_default_where_it_measured_faster():
    # one calibration position: a chain of 2 correct nodes under the root's best child
    rounds = [Candidates([-1, 0, 0, 1, 1], [0, 1, 1, 2, 2], [0.0, -0.1, -1.0, -0.2, -1.5],
                         [True, True, False, True, False], [[1, 2], [3, 4], [], [], []])]
    pick, default = TreeSettings(total_tokens=6, depth=2, top_k=4), TreeSettings(total_tokens=4, depth=2, top_k=2)
    slower = keep_fastest(_choice(pick), [pick, default], [40.0, 45.0], 30.0, rounds)
    assert slower.settings == default and slower.measured_tokens_per_s == 45.0
    assert slower.measured_vanilla_tokens_per_s == 30.0 and slower.speculate
    assert slower.expected_tau == 3.0  # replayed for the default: root, then both chain nodes
    assert slower.expected_tokens_per_s == round(1000 * 3.0 / (2.0 + 12.0), 2)
    assert [c["tokens_per_s"] for c in slower.checked] == [40.0, 45.0]
    assert "the cost model's pick, total_tokens=6 depth=2 top_k=4, decoded at 40.0" in slower.summary()
    faster = keep_fastest(_choice(pick), [pick, default], [45.0, 40.0], 30.0, rounds)
    assert faster.settings == pick and faster.expected_tau == 2.5 and "the cost model's pick" not in faster.summary()
    tied = keep_fastest(_choice(pick), [pick, default], [45.0, 45.0], 30.0, rounds)
    assert tied.settings == pick  # the pick where tied
    import json

    again = TreeChoice.from_json(json.loads(json.dumps(slower.to_json())))
    assert again.settings == default and again.checked == slower.checked
