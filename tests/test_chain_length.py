"""A draft model's chain length under `--tree auto` (drafters.chain_length): the acceptance estimate, the length it
chooses from measured costs, and the drafters that use it (output unchanged, lengths that follow acceptance)."""

from __future__ import annotations

import pytest
from conftest import TinyTokenizer, make_model

from eaglespec.api import Engine
from eaglespec.drafters import TreeSettings
from eaglespec.drafters.chain_length import ChainLength, accepted_of

PROMPT = [3, 14, 15, 92, 65, 35, 89, 79]


def vanilla(target, prompt: list[int], n: int) -> list[int]:
    return Engine.from_model(target, TinyTokenizer(), method="vanilla").generate(prompt, max_new_tokens=n).tokens


def test_alpha_is_accepted_over_tried_tokens_up_to_the_first_rejection():
    c = ChainLength(8, decay=1.0, prior_weight=0.0)
    c.observe_round(5, 2, 0.1)  # tried 3 (2 accepted, the third rejected)
    c.observe_round(4, 4, 0.1)  # all accepted: tried 4
    assert c.alpha == pytest.approx(6 / 7)
    assert c.expected_tokens(0) == 1.0
    assert c.expected_tokens(2) == pytest.approx(1 + 6 / 7 + (6 / 7) ** 2)


def test_starts_at_the_given_length_until_drafting_and_a_round_are_timed():
    c = ChainLength(10, start=4)
    assert c.next() == 4
    c.observe_round(4, 1, 0.1)
    assert c.next() == 4  # no draft timed yet
    assert ChainLength(10).next() == 10  # start defaults to the longest
    with pytest.raises(ValueError):
        ChainLength(0)


def timed(c: ChainLength, alpha_rounds: list[tuple[int, int]], draft_per_token: float, verify) -> None:
    """Feed rounds (proposed, accepted), each drafted at `draft_per_token` s a token and verified in verify(rows) s."""
    for proposed, accepted in alpha_rounds:
        c.observe_draft(proposed, draft_per_token * proposed)
        c.observe_round(proposed, accepted, verify(proposed + 1))


def test_long_chains_where_acceptance_is_high_and_rows_cheap():
    c = ChainLength(15)
    timed(c, [(15, 15), (12, 12), (8, 8), (15, 14)] * 4, draft_per_token=0.02, verify=lambda rows: 0.09)
    assert c.alpha > 0.9
    assert c.next() == 15


def test_short_chains_where_acceptance_is_low_or_drafts_cost():
    low = ChainLength(15)
    timed(low, [(5, 0), (3, 1), (2, 0), (4, 1)] * 4, draft_per_token=0.03, verify=lambda rows: 0.09)
    assert low.alpha < 0.4
    assert low.next() == 1
    # the same good acceptance, but each verify row costs a fifth of a step (AVX2-like): a shorter chain than free rows
    rows_cost, rows_free = ChainLength(15), ChainLength(15)
    rounds = [(6, 4), (3, 3), (8, 5), (4, 2), (2, 2), (10, 6)] * 3
    timed(rows_cost, rounds, draft_per_token=0.03, verify=lambda rows: 0.09 + 0.02 * rows)
    timed(rows_free, rounds, draft_per_token=0.03, verify=lambda rows: 0.09)
    assert 1 <= rows_cost.next() < rows_free.next()


class TickingClock:
    """perf_counter for the drafters: each call 1 ms later, so a draft call and the rest of a round each take 1 ms
    (a draft model whose chains cost little against a verify pass, as a 0.5B drafting for a 1.5B on AMX)."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        self.now += 1e-3
        return self.now


@pytest.mark.parametrize("method", ["sps", "staged"])
def test_tree_auto_chains_follow_acceptance_and_keep_the_output(method, monkeypatch):
    """With itself as its draft model every token is accepted and the chain grows to the longest; with an unrelated
    draft model it shrinks; greedy output equals plain decoding either way. A fixed tree stays fixed."""
    clock = TickingClock()
    monkeypatch.setattr("eaglespec.drafters.draft_model.time", clock)
    monkeypatch.setattr("eaglespec.drafters.staged.time", clock)
    target, tok = make_model("qwen2", seed=0), TinyTokenizer()
    expected = vanilla(target, PROMPT, 48)
    same = Engine.from_model(target, tok, method=method, tree="auto", draft_hf_model=target, adapt=False)
    lengths = same.drafter.chain_length
    assert same.drafter.dynamic and lengths.longest == same.drafter.length
    lengths.longest = lengths.start = 6
    out = same.generate(PROMPT, max_new_tokens=48)
    assert out.tokens == expected
    assert lengths.alpha > 0.9 and lengths.next() == 6

    other = Engine.from_model(target, tok, method=method, tree="auto", adapt=False,
                              draft_hf_model=make_model("qwen2", seed=1, layers=2))
    lengths = other.drafter.chain_length
    lengths.longest = lengths.start = 6
    out = other.generate(PROMPT, max_new_tokens=48)
    assert out.tokens == expected
    assert lengths.alpha < 0.5 and lengths.next() < 6
    assert max(out.stats.accept_lengths) <= 7

    fixed = Engine.from_model(target, tok, method=method, tree=TreeSettings(8, 3, 1), draft_hf_model=target)
    assert not fixed.drafter.dynamic and fixed.drafter.chain_length is None


def test_a_plain_round_between_drafts_is_not_counted_as_a_drafted_round():
    target, tok = make_model("qwen2", seed=0), TinyTokenizer()
    engine = Engine.from_model(target, tok, method="sps", tree="auto", draft_hf_model=target, adapt=False)
    drafter = engine.drafter
    seen: list[tuple] = []
    drafter.chain_length.observe_round = lambda *a: seen.append(a)
    drafter._last = (3, [7, 8], 0.0)
    drafter._round_length([1, 2, 3, 7, 8, 9], 1.0)  # both drafts accepted, 9 the bonus
    drafter._round_length([1, 2, 3, 7, 5, 6, 4, 2], 2.0)  # more tokens than one round commits: skipped
    assert seen == [(2, 2, 1.0)]


def test_accepted_of_reads_a_rounds_outcome_from_the_committed_tokens():
    """The committed tokens since a round are its accepted drafts, then the new root (the bonus token or a
    correction): the drafts accepted are their common prefix with the proposal, the new root never counted."""
    assert accepted_of([5, 6, 7], [5, 6, 7, 8]) == 3  # all accepted, then the bonus token
    assert accepted_of([5, 6, 7], [5, 6, 9]) == 2  # the third corrected
    assert accepted_of([5, 6, 7], [9]) == 0  # the first rejected: only the correction
    assert accepted_of([5, 6, 7], [5]) == 0  # the root equal to the first draft is not an acceptance
    assert accepted_of([], [4]) == 0
