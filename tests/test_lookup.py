"""Prompt lookup drafting: proposals on hand-made sequences, and greedy equality with vanilla decoding."""

from __future__ import annotations

import pytest
import torch
from conftest import TinyTokenizer, make_model

from eaglespec.api import Engine
from eaglespec.drafters import TreeSettings
from eaglespec.drafters.lookup import PromptLookupDrafter, find_continuation


def t(*ids: int) -> torch.Tensor:
    return torch.tensor(ids)


def test_longest_ngram_wins_over_a_more_recent_shorter_one():
    # last trigram (1, 2, 3) occurred at 0..2 (followed by 4, 5); the bigram (2, 3) recurs later, followed by 9
    seq = t(1, 2, 3, 4, 5, 7, 2, 3, 9, 8, 1, 2, 3)
    assert find_continuation(seq, max_ngram=3, min_ngram=1, length=3) == [4, 5, 7]
    assert find_continuation(seq, max_ngram=2, min_ngram=1, length=3) == [9, 8, 1]


def test_most_recent_occurrence_is_used():
    seq = t(5, 6, 1, 5, 7, 2, 5)  # unigram 5 occurs at 0 and 3; the later one is followed by 7, 2
    assert find_continuation(seq, max_ngram=1, min_ngram=1, length=4) == [7, 2, 5]


def test_no_match_gives_nothing_and_the_drafter_proposes_the_root_only():
    seq = t(1, 2, 3, 4)
    assert find_continuation(seq, 3, 1, 5) == []
    tree = PromptLookupDrafter(TreeSettings(depth=5)).draft(seq, None)
    assert tree.tokens.tolist() == [4]


def test_drafter_proposes_a_chain_capped_by_depth_and_tree_size():
    seq = t(8, 1, 2, 3, 4, 5, 6, 9, 1, 2)
    tree = PromptLookupDrafter(TreeSettings(total_tokens=16, depth=3)).draft(seq, None)
    assert tree.tokens.tolist() == [2, 3, 4, 5]
    assert tree.parents.tolist() == [-1, 0, 1, 2]
    tree = PromptLookupDrafter(TreeSettings(total_tokens=3, depth=5)).draft(seq, None)
    assert tree.tokens.tolist() == [2, 3, 4]


def reference_continuation(seq: list[int], max_ngram: int, min_ngram: int, length: int) -> list[int]:
    """By definition: for n = max_ngram .. min_ngram, the most recent earlier occurrence of the last n tokens."""
    for n in range(max_ngram, min_ngram - 1, -1):
        if n < 1 or len(seq) < n + 1 or length < 1:
            continue
        suffix = seq[-n:]
        for end in range(len(seq) - 2, n - 2, -1):  # the occurrence seq[end - n + 1 : end + 1], ending before the last
            if seq[end - n + 1 : end + 1] == suffix:
                return seq[end + 1 : end + 1 + length]
    return []


def test_the_scan_finds_what_the_definition_finds():
    gen = torch.Generator().manual_seed(0)
    for trial in range(400):
        size, vocab = int(torch.randint(1, 60, (1,), generator=gen)), int(torch.randint(2, 6, (1,), generator=gen))
        seq = torch.randint(0, vocab, (size,), generator=gen)
        max_ngram = int(torch.randint(1, 14, (1,), generator=gen))
        min_ngram = int(torch.randint(1, max_ngram + 1, (1,), generator=gen))
        length = int(torch.randint(0, 9, (1,), generator=gen))
        want = reference_continuation(seq.tolist(), max_ngram, min_ngram, length)
        assert find_continuation(seq, max_ngram, min_ngram, length) == want, (seq.tolist(), max_ngram, min_ngram)


def test_a_long_shared_suffix_beats_a_more_recent_short_one_by_default():
    # the last 5 tokens (1, 2, 3, 4, 5) occurred at the start, followed by 6; (3, 4, 5) alone recurs later, followed by 9
    seq = t(1, 2, 3, 4, 5, 6, 7, 3, 4, 5, 9, 8, 1, 2, 3, 4, 5)
    assert find_continuation(seq, length=2) == [6, 7]
    assert find_continuation(seq, max_ngram=3, length=2) == [9, 8]


def test_sequence_shorter_than_the_ngram():
    assert find_continuation(t(3), 3, 1, 5) == []
    assert find_continuation(t(3, 3), 3, 1, 5) == [3]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_output_equals_vanilla_and_drafts_get_accepted(arch):
    model, tok = make_model(arch), TinyTokenizer()
    # a repetitive prompt so lookups find matches
    prompt = [5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 8, 9, 10, 11, 5, 6, 7]
    vanilla = Engine.from_model(model, tok, method="vanilla").generate(prompt, max_new_tokens=24)
    pld = Engine.from_model(model, tok, method="pld", tree=TreeSettings(depth=4)).generate(prompt, max_new_tokens=24)
    assert pld.tokens == vanilla.tokens
    assert pld.stats.target_forwards < vanilla.stats.target_forwards  # some lookups were right
    assert pld.stats.tau > 1.0
