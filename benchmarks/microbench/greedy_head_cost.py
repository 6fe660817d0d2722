"""Greedy decoding's LM head, two ways, on SmolLM2-135M's real final hidden states: the bfloat16 logits through
eaglespec's kernel plus their argmax (what a greedy step did before git 9b9a05f; sampling steps still do), and the
screened int8 argmax (`bf16gemm.GreedyHead`, csrc/screened_argmax.cpp), for 1-8 rows; and whether the two pick the
same tokens.

    python benchmarks/microbench/greedy_head_cost.py [--threads 2] [--repeats 200]

Median ms per call, interleaved A/B, the head's weights evicted from the CPU caches between calls (a 64 MB buffer is
read), as in a decode step where the layers' weights pass through the caches first. The screened answer is the
argmax of float32 logits summed in another order, without bfloat16 rounding: it may differ from the bfloat16
logits' argmax where two logits round to the same bfloat16 value (the lower id wins there).
"""

import argparse
import statistics
import time

import torch

from eaglespec import Engine, TreeSettings
from eaglespec.backends.cpu import kernels as bf16gemm

p = argparse.ArgumentParser()
p.add_argument("--threads", type=int, default=2)
p.add_argument("--repeats", type=int, default=200)
args = p.parse_args()
torch.set_num_threads(args.threads)
engine = Engine(method="eagle2", tree=TreeSettings(4, 2, 2))
target = engine.target
weight = target.lm_head.weight.detach().bfloat16()
logits_head = bf16gemm.Bf16Linear(weight)
greedy_head = bf16gemm.GreedyHead(weight)
rows = []
for prompt in ["Compose an engaging travel blog post about a recent trip to Hawaii.", "Explain quicksort in Python."]:
    ids = engine.encode(prompt)
    answer = engine.generate(prompt, max_new_tokens=60).tokens
    target.reset()
    rows.append(target.forward(torch.tensor(ids + answer[:-1])).features.bfloat16())  # final hidden states [L, K]
    target.commit()
x = torch.cat(rows)[-96:]  # [96, K]: answer positions
flush = torch.ones(16 * 1024 * 1024)  # 64 MB


def timed(fn, *a) -> float:
    float(flush.sum())
    start = time.perf_counter()
    fn(*a)
    return 1000 * (time.perf_counter() - start)


same = sum(int(bf16gemm.argmax_rows(logits_head(x[i : i + 1]))[0]) == int(greedy_head(x[i : i + 1])[0])
           for i in range(x.shape[0]))
print(f"{args.threads} threads; {x.shape[0]} hidden states: screened argmax equals the bfloat16 logits' argmax for "
      f"{same}/{x.shape[0]}")
with torch.inference_mode():
    for m in (1, 2, 4, 8):
        plain, screened = [], []
        for i in range(args.repeats):
            rows_i = x[(i * m) % (x.shape[0] - m):][:m].contiguous()
            plain.append(timed(lambda r: bf16gemm.argmax_rows(logits_head(r)), rows_i))
            screened.append(timed(greedy_head, rows_i))
        print(f"{m} rows: logits + argmax {statistics.median(plain):.3f} ms, "
              f"screened {statistics.median(screened):.3f} ms")
