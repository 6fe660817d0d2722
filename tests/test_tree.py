"""Table tests for draft trees: hand-drawn trees give the expected parents, positions, masks and paths."""

import pytest
import torch

from eaglespec.spec.tree import EAGLE1_CHOICES, DraftTree, chain, validate_choices

#        0 (root, token 10)
#       / \
#      1   2          depth 1: tokens 11, 12
#     / \   \
#    3   4   5        depth 2: tokens 13, 14, 15
#    |
#    6                depth 3: token 16
HAND_DRAWN = DraftTree(tokens=torch.tensor([10, 11, 12, 13, 14, 15, 16]),
                       parents=torch.tensor([-1, 0, 0, 1, 1, 2, 3]))


def test_depths_and_positions():
    assert HAND_DRAWN.depths.tolist() == [0, 1, 1, 2, 2, 2, 3]
    assert HAND_DRAWN.positions(100).tolist() == [100, 101, 101, 102, 102, 102, 103]


def test_ancestor_mask_matches_drawing():
    expected = torch.tensor([
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0, 0],
        [1, 1, 0, 1, 0, 0, 0],
        [1, 1, 0, 0, 1, 0, 0],
        [1, 0, 1, 0, 0, 1, 0],
        [1, 1, 0, 1, 0, 0, 1],
    ], dtype=torch.bool)
    assert torch.equal(HAND_DRAWN.ancestor_mask(), expected)


def test_children_paths_and_leaves():
    assert HAND_DRAWN.children() == [[1, 2], [3, 4], [5], [6], [], [], []]
    assert HAND_DRAWN.path(6) == [0, 1, 3, 6]
    assert HAND_DRAWN.path(5) == [0, 2, 5]
    assert HAND_DRAWN.leaf_paths() == [[0, 1, 4], [0, 2, 5], [0, 1, 3, 6]]


def test_chain_tree():
    t = chain([7, 8, 9, 4])
    assert t.parents.tolist() == [-1, 0, 1, 2]
    assert torch.equal(t.ancestor_mask(), torch.ones(4, 4, dtype=torch.bool).tril())
    assert t.positions(5).tolist() == [5, 6, 7, 8]


def test_truncate_depth_keeps_a_valid_subtree():
    t = HAND_DRAWN.truncate_depth(1)
    assert t.tokens.tolist() == [10, 11, 12]
    assert t.parents.tolist() == [-1, 0, 0]
    t2 = HAND_DRAWN.truncate_depth(2)
    assert t2.tokens.tolist() == [10, 11, 12, 13, 14, 15]
    assert t2.parents.tolist() == [-1, 0, 0, 1, 1, 2]


def test_a_tree_from_lists_equals_the_tree_from_tensors():
    tokens, parents = HAND_DRAWN.tokens.tolist(), HAND_DRAWN.parents.tolist()
    t = DraftTree.from_lists(tokens, parents, [0.0, -0.5, -1.0, -0.7, -0.9, -2.0, -1.1])
    assert torch.equal(t.tokens, HAND_DRAWN.tokens) and torch.equal(t.parents, HAND_DRAWN.parents)
    assert t.tokens.dtype == t.parents.dtype == torch.long and t.scores.dtype == torch.float32
    assert torch.equal(t.depths, HAND_DRAWN.depths) and t.max_depth == HAND_DRAWN.max_depth == 3
    assert torch.equal(t.ancestor_mask(), HAND_DRAWN.ancestor_mask())
    assert t.children() == HAND_DRAWN.children() and t.token_list() == tokens
    tokens.append(99)  # the tree keeps its own lists
    assert len(t.token_list()) == 7
    root = DraftTree.root_only(5)
    assert root.token_list() == [5] and root.max_depth == 0 and root.ancestor_mask().tolist() == [[True]]


@pytest.mark.parametrize("parents", [[0, 0], [-1, 2, 0], [-1, -1], [-1, 0, 3, 1]])
def test_invalid_lists_are_rejected(parents):
    with pytest.raises(ValueError):
        DraftTree.from_lists(list(range(len(parents))), parents)
    with pytest.raises(ValueError):
        DraftTree.from_lists([1, 2], [-1])


@pytest.mark.parametrize("parents", [[0, 0], [-1, 2, 0], [-1, -1]])
def test_invalid_trees_are_rejected(parents):
    with pytest.raises(ValueError):
        DraftTree(tokens=torch.arange(len(parents)), parents=torch.tensor(parents))


def test_eagle1_default_choices_form_26_node_tree():
    ordered = validate_choices(EAGLE1_CHOICES)
    assert len(ordered) + 1 == 26
    assert max(len(c) for c in ordered) == 5
    with pytest.raises(ValueError, match="no parent"):
        validate_choices([[0], [1, 0, 0]])
