"""Where a draft round's time goes inside real decoding, by wall clock (no profiler), and how much of it is the
head's weights coming from memory: the catch-up step and the root's log-probs are each run a second time right
after the first (same inputs, head cache rolled back), when their weights are in the CPU caches.

    python benchmarks/microbench/draft_round_parts.py [--threads 2] [--tree 6,2,4] [--tokens 200]

A compiled bfloat16 target and EAGLE-1 head (`--compile`, as `bench`), the first two calibration prompts. The
timed round does what `EagleDrafter.draft` does for an EAGLE-2 tree, split into parts; prints the mean and median
ms of each part per round (the repeated calls are not counted in "draft total").
"""

import argparse
import statistics
import time
from collections import defaultdict

import torch

from eaglespec import Engine, TreeSettings
from eaglespec.drafters import Drafter, TreeGrowth
from eaglespec.drafters.autotree import CALIBRATION_PROMPTS
from eaglespec.spec.decode import SpecDecoder

p = argparse.ArgumentParser()
p.add_argument("--threads", type=int, default=2)
p.add_argument("--tree", default="6,2,4")
p.add_argument("--tokens", type=int, default=200)
args = p.parse_args()
torch.set_num_threads(args.threads)
settings = TreeSettings(*(int(v) for v in args.tree.split(",")))
engine = Engine(method="eagle2", compile=True, tree=settings)
parts: dict[str, list[float]] = defaultdict(list)


class TimedDrafter(Drafter):
    """Drafts as the engine's EagleDrafter does (dynamic tree), timing each part."""

    name, needs_features = "eagle2-timed", True

    def __init__(self, inner):
        self.d = inner

    def reset(self) -> None:
        self.d.reset()

    @torch.inference_mode()
    def draft(self, tokens, new_features):
        d, clock = self.d, time.perf_counter
        t0 = clock()
        k, start = new_features.shape[0], d.consumed
        d.cache.rollback()
        ids = tokens[start + 1 : start + 1 + k]
        hidden, embeds = d.head.lift(new_features), d.embed_tokens(ids)
        positions = torch.arange(start, start + k)
        mask = torch.ones(k, start + k, dtype=torch.bool)
        mask[:, start:] = torch.ones(k, k, dtype=torch.bool).tril_()
        t1 = clock()
        out = d.step(hidden, embeds, positions, d.cache, mask)  # weights as the verify pass left the caches
        t2 = clock()
        d.cache.rollback()
        again = clock()
        out = d.step(hidden, embeds, positions, d.cache, mask)  # the same step again, weights now cached
        parts["catch-up head step, again"].append(clock() - again)
        t2b = clock()
        d.cache.commit()
        d.consumed += k
        grow = TreeGrowth(d, int(tokens[-1]), out[-1])  # the root's log-probs
        t3 = clock()
        d._log_probs(out[-1][None])
        parts["root log-probs, again"].append(clock() - t3)
        t3b = clock()
        frontier = []
        ids_, vals = grow._top_children(grow.root_logp, settings.top_k)
        for token, value in zip(ids_, vals):
            frontier.append(grow._add(0, token, value))
        t4 = clock()
        for _ in range(settings.depth - 1):
            a = clock()
            logp = grow._expand(frontier)
            b = clock()
            ids_per_row, vals_per_row = grow._top_children(logp, settings.top_k)
            children = []
            for parent, row_ids, row_vals in zip(frontier, ids_per_row, vals_per_row):
                for token, value in zip(row_ids, row_vals):
                    children.append(grow._add(parent, token, grow.scores[parent] + value))
            children.sort(key=lambda c: -grow.scores[c])
            frontier = children[: settings.top_k]
            parts["expansion (head step + log-probs)"].append(b - a)
            parts["expansion top-k + bookkeeping"].append(clock() - b)
        t5 = clock()
        tree = grow._rerank(settings.total_tokens - 1)
        t6 = clock()
        parts["catch-up inputs"].append(t1 - t0)
        parts["catch-up head step"].append(t2 - t1)
        parts["root log-probs"].append(t3 - t2b)
        parts["root top-k"].append(t4 - t3b)
        parts["rerank"].append(t6 - t5)
        parts["draft total"].append((t6 - t0) - (t2b - t2) - (t3b - t3))
        return tree


decoder = SpecDecoder(engine.target, engine.tokenizer, TimedDrafter(engine.drafter))
for _ in range(2):  # the first pass warms up
    parts.clear()
    for prompt in CALIBRATION_PROMPTS[:2]:
        *_, last = decoder.stream(engine.encode(prompt), max_new_tokens=args.tokens)
print(f"tree {args.tree}, {args.threads} threads, {len(parts['draft total'])} rounds (last prompt: tau "
      f"{last.stats.tau:.2f})")
for name, values in parts.items():
    print(f"  {name:36s} {1e3 * statistics.mean(values):6.3f} ms mean {1e3 * statistics.median(values):6.3f} median")
