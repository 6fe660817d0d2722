"""`EagleDrafter`: an EAGLE head drafting an EAGLE-2 dynamic tree, an EAGLE-1 static tree, or a chain, over the
target's features (Li et al., 2024: arXiv 2401.15077, 2406.16858, 2503.01840).

A second stage for an EAGLE head (`extend`). Staged decoding's second stage (drafters.staged) speeds up a draft
model by checking several guessed tokens in one of its forwards; an EAGLE head cannot be sped up that way, because
its step at position t + 1 reads its own output feature at t (feature-level autoregression): a guessed token's row
needs the row before it computed first, so a forward still adds one token. What a stage-2 drafter can do for an
EAGLE head is add to its draft at no head forward: its guesses for what follows the context (the context's n-grams,
then a corpus n-gram model) are merged into the tree as a chain from the root, down through the head's nodes that
they match and on past them as new nodes, for the target to verify in the same pass. Where the head's likeliest
path and the guesses agree, the guesses carry it deeper; where the head is wrong and the context repeats itself,
they are a branch of their own. It pays where verify rows are cheap and the text repeats itself (code that restates
its task).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial

import torch
from torch import Tensor

from ..heads.base import DraftHead
from ..spec.tree import EAGLE1_CHOICES, DraftTree, validate_choices
from ..targets.traffic import tensor_bytes
from .base import Drafter, DraftWork, TreeSettings
from .chain_length import GuessCount, accepted_of
from .lookup import Stage2

# the score step of each appended stage-2 guess (a nominal log-probability: the guesses have no draft distribution,
# and a chain's scores must fall down the tree)
GUESS_LOGP = -0.7


class EagleDrafter(Drafter):
    """Drafts with an EAGLE head over the target's features. `mode`: "dynamic" (EAGLE-2), "static" (EAGLE-1
    choices) or "chain" (top-1 only)."""

    needs_features = True

    def __init__(self, head: DraftHead, embed_tokens, lm_head, mode: str = "dynamic",
                 settings: TreeSettings | None = None, step: Callable | None = None,
                 topk: Callable[[Tensor, int], tuple[Tensor, Tensor]] | None = None,
                 stage2: Stage2 | None = None, extend: int = 0, dynamic: bool = False):
        """`head` as it runs (a backend may have swapped its products: eaglespec.backends.cpu.apply); `step` its
        decoder-layer step, (hidden, token_embeds, positions, cache, mask) -> [T, d] (default `head.step`; a
        compiled one); `topk` the k best children of each row, (scores [N, V], k) -> (values, indices) with equal
        scores in any order (default torch.topk); `extend`: up to this many `stage2` guesses merged into each tree
        as new nodes (module docstring), as many as are worth their verify rows with `dynamic`."""
        if mode not in ("dynamic", "static", "chain"):
            raise ValueError(f"unknown draft mode {mode}")
        if extend < 0 or (extend and stage2 is None):
            raise ValueError(f"extend must be >= 0 and needs a stage-2 drafter, got {extend}")
        self.stage2, self.extend = stage2, extend
        # dynamic: each round's count of new guess nodes by drafters.chain_length (at most `extend`), else `extend`
        self.guess_count = GuessCount(extend) if extend and dynamic else None
        self.head = head
        self.step = step or head.step
        self.topk = topk or partial(torch.topk, dim=-1)
        self.embed_tokens, self.lm_head, self.mode = embed_tokens, lm_head, mode
        self.settings = settings or TreeSettings()
        self.name = {"dynamic": "eagle2", "static": "eagle1", "chain": "chain"}[mode]
        self.choices = validate_choices(self.settings.choices or EAGLE1_CHOICES) if mode == "static" else None
        self.forwards = 0  # head forwards so far: each round's catch-up and one per tree level
        self.forward_bytes: int | None = None  # weights one head forward reads (`work`)
        self.reset()

    def work(self) -> DraftWork:
        if self.forward_bytes is None and self.forwards:  # once the head has run (a backend packs on first use)
            lm = 0
            if getattr(self.head, "vocab_ids", False) is None:  # EAGLE-1 over the full vocabulary: the target's
                w = self.lm_head.weight  # [V, d]
                lm = w.numel() * w.element_size()
            self.forward_bytes = tensor_bytes(self.head) + lm
        return DraftWork(self.forwards, self.forwards * (self.forward_bytes or 0))

    def reset(self) -> None:
        self.cache = self.head.new_cache()
        self.consumed = 0  # committed positions the head has run over
        # last round's (context length, guesses on the tree, verify rows, depth, end of drafting), for `guess_count`
        self._last: tuple[int, list[int], int, int, float] | None = None

    def fork(self) -> "EagleDrafter":
        """`Drafter.fork`, with its own guess count."""
        clone = super().fork()
        clone.guess_count = GuessCount(self.extend) if self.guess_count is not None else None
        return clone

    # ---- head calls ------------------------------------------------------------------------------------
    def _catch_up(self, tokens: Tensor, features: Tensor) -> Tensor:
        """Run the head over the newly committed positions; return the last step's output hidden [d]."""
        k = features.shape[0]
        start = self.consumed
        if start + k != tokens.numel() - 1:
            raise RuntimeError(f"drafter out of sync: consumed {start} + {k} new != {tokens.numel() - 1} committed")
        self.cache.rollback()  # drop last round's tree entries
        ids = tokens[start + 1 : start + 1 + k].to(features.device)  # token one step ahead of each feature
        hidden = self.head.lift(features)  # [k, d]
        positions = torch.arange(start, start + k, device=features.device)
        mask = torch.ones(k, start + k, dtype=torch.bool, device=features.device)
        mask[:, start:] = torch.ones(k, k, dtype=torch.bool, device=features.device).tril_()
        out = self.step(hidden, self.embed_tokens(ids), positions, self.cache, mask)  # [k, d]
        self.forwards += 1
        self.cache.commit()
        self.consumed += k
        return out[-1]

    def _log_probs(self, hidden: Tensor) -> Tensor:
        """[T, d] -> [T, draft_vocab] float32 log-probabilities."""
        return torch.log_softmax(self.head.logits(hidden, self.lm_head).float(), dim=-1)

    # ---- tree growth -----------------------------------------------------------------------------------
    def start_round(self, tokens: Tensor, new_features: Tensor | None) -> "TreeGrowth":
        """Catch up on the newly committed positions and return an empty tree rooted at tokens[-1]."""
        if new_features is None or new_features.shape[0] == 0:
            raise RuntimeError("the EAGLE drafter needs the target features of the newly committed positions")
        return TreeGrowth(self, int(tokens[-1]), self._catch_up(tokens, new_features))

    @torch.inference_mode()
    def draft(self, tokens: Tensor, new_features: Tensor | None) -> DraftTree:
        grow = self.start_round(tokens, new_features)
        s = self.settings
        if self.mode == "static":
            tree = grow.static(self.choices)
        elif self.mode == "chain":
            tree = grow.dynamic(total_tokens=s.depth + 1, depth=s.depth, top_k=1)
        else:
            tree = grow.dynamic(total_tokens=s.total_tokens, depth=s.depth, top_k=s.top_k)
        return self._guess(tokens, tree) if self.extend else tree

    def _guess(self, tokens: Tensor, tree: DraftTree) -> DraftTree:
        """`tree` with the stage-2 guesses merged in: `extend` new nodes at most, as many as `guess_count` finds
        worth their rows where it is set (`dynamic`); first, tell it how the last round's guesses went."""
        now = time.perf_counter()
        if self.guess_count is not None and self._last is not None:
            start, guesses, rows, depth, ended = self._last
            committed = tokens[start:].tolist()  # accepted tokens, then the new root
            if 1 <= len(committed) <= depth + 1:  # one round since (not plain rounds between)
                accepted = accepted_of(guesses, committed)
                self.guess_count.observe_round(len(guesses), accepted, rows, len(committed), now - ended)
        guesses = self.stage2(tokens.cpu(), self.extend + tree.max_depth)
        node, matched = matched_guesses(tree, guesses)
        length = self.extend if self.guess_count is None else self.guess_count.next(matched, len(tree))
        new = guesses[matched : matched + length]
        tree = append_chain(tree, node, new)
        self._last = (tokens.numel(), guesses[: matched + len(new)], len(tree), tree.max_depth, time.perf_counter())
        return tree


def matched_guesses(tree: DraftTree, guesses: list[int]) -> tuple[int, int]:
    """How far the chain `guesses` runs through `tree` from the root along nodes whose tokens it matches: (the last
    such node, how many guesses matched)."""
    ids, kids = tree.token_list(), tree.children()
    node = 0
    for matched, token in enumerate(guesses):
        nxt = next((c for c in kids[node] if ids[c] == token), None)
        if nxt is None:
            return node, matched
        node = nxt
    return node, len(guesses)


def append_chain(tree: DraftTree, node: int, chain: list[int]) -> DraftTree:
    """`tree` with `chain` hung under `node`, each token scoring `GUESS_LOGP` below its parent (`tree` itself when
    `chain` is empty)."""
    if not chain:
        return tree
    ids, parents = list(tree.token_list()), tree.parents.tolist()  # (copies: appended to)
    scores = [0.0] * len(ids) if tree.scores is None else tree.scores.tolist()
    for token in chain:
        ids.append(int(token))
        parents.append(node)
        scores.append(scores[node] + GUESS_LOGP)
        node = len(ids) - 1
    return DraftTree.from_lists(ids, parents, scores)


class TreeGrowth:
    """One round of tree drafting. Candidate 0 is the root; every candidate has a parent, a target token id, a
    path score (sum of draft log-probs), and, once expanded, a head-cache entry and an output hidden."""

    def __init__(self, drafter: EagleDrafter, root_token: int, root_hidden: Tensor):
        self.d = drafter
        self.tokens = [root_token]
        self.parents = [-1]
        self.depths = [0]
        self.scores = [0.0]
        self.entry: dict[int, int] = {}  # candidate -> index of its entry among this round's head-cache rows
        self.out_hidden: dict[int, Tensor] = {}  # candidate -> head output after consuming it ([d])
        self.out_hidden[0] = root_hidden  # the root's children consume the last catch-up step's output
        self.root_logp = drafter._log_probs(root_hidden[None])[0]  # [Vd]: root's children distribution

    def restart(self) -> "TreeGrowth":
        """Drop this round's tree entries from the head cache and return an empty tree from the same root (to
        draft the same round again with other settings)."""
        self.d.cache.rollback()
        return TreeGrowth(self.d, self.tokens[0], self.out_hidden[0])

    def _add(self, parent: int, token: int, score: float) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(self.depths[parent] + 1)
        self.scores.append(score)
        return len(self.tokens) - 1

    def _ancestors(self, node: int) -> list[int]:
        out = []
        while node > 0:
            out.append(node)
            node = self.parents[node]
        return out

    def _expand(self, nodes: list[int]) -> Tensor:
        """Run the head on `nodes` (all at one depth), each consuming (parent's output hidden, its token) and
        attending to the committed prefix plus its own ancestors' entries. Returns log-probs [len(nodes), Vd]."""
        d = self.d
        dev = d.cache.keys[0].device
        committed, prior = d.cache.committed, len(d.cache) - d.cache.committed
        k = len(nodes)
        hidden = torch.stack([self.out_hidden[self.parents[n]] for n in nodes])  # [k, d]
        ids = torch.tensor([self.tokens[n] for n in nodes], device=dev)
        positions = torch.tensor([d.consumed + self.depths[n] - 1 for n in nodes], device=dev)
        mask = torch.zeros(k, committed + prior + k, dtype=torch.bool, device=dev)
        mask[:, :committed] = True
        rows, cols = [], []  # each node's ancestors' entries and its own, set in one indexing call
        for row, n in enumerate(nodes):
            for a in self._ancestors(self.parents[n]) + [None]:
                rows.append(row)
                cols.append(committed + (prior + row if a is None else self.entry[a]))
        mask[rows, cols] = True
        out = d.step(hidden, d.embed_tokens(ids), positions, d.cache, mask)  # [k, d]
        d.forwards += 1
        for row, n in enumerate(nodes):
            self.entry[n] = prior + row
            self.out_hidden[n] = out[row]
        return d._log_probs(out)

    def _top_children(self, logp: Tensor, k: int) -> tuple[list, list]:
        """The k best children of each row of `logp` [..., Vd]: target ids and log-probs, as (nested) lists."""
        values, draft_ids = self.d.topk(logp, min(k, logp.shape[-1]))
        return self.d.head.to_target_ids(draft_ids).tolist(), values.tolist()

    def dynamic(self, total_tokens: int, depth: int, top_k: int) -> DraftTree:
        """EAGLE-2: expand the top_k best-scoring frontier nodes per level, then keep the total_tokens - 1
        best candidates overall (a child never outscores its parent, so they form a tree)."""
        if depth == 1:  # the root's best children, best first, are that tree (CPU trees often are): no bookkeeping
            ids, vals = self._top_children(self.root_logp, min(top_k, total_tokens - 1))
            return DraftTree.from_lists([self.tokens[0]] + ids, [-1] + [0] * len(ids), [0.0] + vals)
        frontier = []
        ids, vals = self._top_children(self.root_logp, top_k)
        for t, v in zip(ids, vals):
            frontier.append(self._add(0, t, v))
        for _ in range(depth - 1):
            ids_per_row, vals_per_row = self._top_children(self._expand(frontier), top_k)  # from [K, Vd]
            children = []
            for parent, ids, vals in zip(frontier, ids_per_row, vals_per_row):
                for t, v in zip(ids, vals):
                    children.append(self._add(parent, t, self.scores[parent] + v))
            children.sort(key=lambda c: -self.scores[c])  # stable: earlier candidates win ties
            frontier = children[:top_k]
        return self._rerank(total_tokens - 1)

    def static(self, choices: list[list[int]]) -> DraftTree:
        """EAGLE-1: a fixed tree of top-k rank paths, grown level by level."""
        node_of: dict[tuple[int, ...], int] = {(): 0}
        max_depth = max(len(c) for c in choices)
        for level in range(1, max_depth + 1):
            level_choices = [c for c in choices if len(c) == level]
            parents = sorted({node_of[tuple(c[:-1])] for c in level_choices})
            if level == 1:
                logps = {0: self.root_logp}
            else:
                out = self._expand(parents)
                logps = {p: out[row] for row, p in enumerate(parents)}
            ranked = {p: self._top_children(logps[p], 1 + max(c[-1] for c in level_choices
                                                                 if node_of[tuple(c[:-1])] == p)) for p in parents}
            for c in level_choices:
                p = node_of[tuple(c[:-1])]
                ids, vals = ranked[p]
                if c[-1] < len(ids):
                    node_of[tuple(c)] = self._add(p, ids[c[-1]], self.scores[p] + vals[c[-1]])
        return self._rerank(len(self.tokens) - 1)

    def _rerank(self, keep: int) -> DraftTree:
        """The `keep` best candidates by path score (ties: earlier first), ordered by depth so parents precede
        children, with the root in front."""
        order = sorted(range(1, len(self.tokens)), key=lambda c: -self.scores[c])[:keep]
        chosen = sorted(order, key=lambda c: (self.depths[c], -self.scores[c], c))
        index = {0: 0}
        for i, c in enumerate(chosen, start=1):
            index[c] = i
        parents = [-1] + [index[self.parents[c]] for c in chosen]
        return DraftTree.from_lists([self.tokens[0]] + [self.tokens[c] for c in chosen], parents,
                                    [0.0] + [self.scores[c] for c in chosen])
