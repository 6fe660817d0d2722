"""Greedy verification's argmax over SmolLM2-135M's vocabulary (49152 logits a row): torch.argmax against
eaglespec's operator (csrc/argmax_rows.cpp), bfloat16 and float32 logits.

    python benchmarks/scripts/argmax_cost.py [--threads 2] [--rows 1,6,16]

Prints the median microseconds per call and checks that both give the same indices.
"""

import argparse
import statistics
import time

import torch

from eaglespec import bf16gemm

p = argparse.ArgumentParser()
p.add_argument("--threads", type=int, default=2)
p.add_argument("--rows", default="1,6,16")
args = p.parse_args()
torch.set_num_threads(args.threads)
bf16gemm.load()


def median_us(fn, calls: int = 200, repeats: int = 7) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) * 1e6 / calls)
    return statistics.median(times)


print(f"{torch.get_num_threads()} threads, median us per call\n| logits | rows | torch.argmax | argmax_rows | same |")
print("|---|---|---|---|---|")
for dtype in (torch.bfloat16, torch.float32):
    for n in (int(r) for r in args.rows.split(",")):
        logits = torch.randn(n, 49152).to(dtype)
        same = torch.equal(logits.argmax(-1), torch.ops.eaglespec.argmax_rows(logits))
        ours = median_us(lambda: torch.ops.eaglespec.argmax_rows(logits))
        theirs = median_us(lambda: logits.argmax(-1))
        print(f"| {str(dtype).removeprefix('torch.')} | {n} | {theirs:.1f} | {ours:.1f} | {same} |")
