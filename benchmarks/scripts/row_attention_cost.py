"""Target forward time on branching draft trees, row-by-row attention (bit-exact decode steps) against one batched
attention call, sizes and modes interleaved so drift hits both alike. SmolLM2-135M over ~260 cached tokens.

    python benchmarks/scripts/row_attention_cost.py [--quantize int8|int4] [--threads 2]
"""

import argparse
import statistics
import time

import torch

from eaglespec.fastpath import FastTarget
from eaglespec.models import load_target

p = argparse.ArgumentParser()
p.add_argument("--quantize", default=None)
p.add_argument("--threads", type=int, default=2)
args = p.parse_args()
torch.set_num_threads(args.threads)
model, tokenizer = load_target("smollm2-135m", dtype="float32")
target = FastTarget(model, None, quantize=args.quantize)
target.forward(torch.tensor(tokenizer("Write a poem about the sea and the sky and the stars. " * 20)["input_ids"]))
target.commit()
c = target.cache_len


def tree_mask(n: int) -> torch.Tensor:
    """A binary tree in breadth-first order (the parent of row i is (i - 1) // 2): [n, n] bool."""
    mask = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        mask[i] |= mask[(i - 1) // 2]
    return mask


sizes = [1, 4, 8, 16, 24]
times: dict[tuple[int, bool], list[float]] = {}
for _ in range(10):
    for n in sizes:
        for row_by_row in (True, False):
            target.row_invariant = row_by_row
            mask = tree_mask(n)
            start = time.perf_counter()
            target.forward(torch.randint(0, 1000, (n,)), c + mask.sum(1) - 1, mask)
            target.commit(torch.tensor([], dtype=torch.long))
            times.setdefault((n, row_by_row), []).append(time.perf_counter() - start)
print(f"quantize {args.quantize}, {args.threads} threads, {c} cached tokens; median of 8 after 2 warm-ups")
for n in sizes:
    row, batched = (statistics.median(times[(n, r)][2:]) * 1000 for r in (True, False))
    print(f"{n:2d} tree tokens: row by row {row:6.1f} ms   batched {batched:6.1f} ms")
