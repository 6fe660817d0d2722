"""Qwen2.5-Coder-1.5B's whole forward (a decode step over a 150-token prefix, greedy head) for N rows, two fast
targets of one model in one process, called alternately: its Q4_K matrices read from the GGUF file as exact 4-bit
blocks (the default where the kernels run) against every matrix on the bfloat16 kernel ($EAGLESPEC_Q4=0 at build).

    python benchmarks/microbench/q4k_target.py [--rows 1,2,3,4,5,8,64] [--repeats 10] [--threads 2]

Needs the 1.5B's parts (`pip install "eaglespec[qwen2.5-coder]"`) and eaglespec's kernels. Prints, per row count,
the median milliseconds of each target's forward (the first call of each count not counted) and their ratio."""

import argparse
import os
import statistics
import time

import torch

from eaglespec.models import load_target
from eaglespec.targets.fast import make_target

p = argparse.ArgumentParser()
p.add_argument("--rows", default="1,2,3,4,5,8,64")
p.add_argument("--repeats", type=int, default=10)
p.add_argument("--threads", type=int, default=2)
args = p.parse_args()
torch.set_num_threads(args.threads)
model, _ = load_target("qwen2.5-coder-1.5b", dtype="bfloat16")
os.environ["EAGLESPEC_Q4"] = "0"
bf16 = make_target(model)
os.environ["EAGLESPEC_Q4"] = "1"
q4k = make_target(model)
print(f"4-bit block matrices: {q4k.q4_matrices} (bfloat16 target: {bf16.q4_matrices})")
torch.manual_seed(0)
prompt = torch.randint(100, 5000, (150,))
for target in (bf16, q4k):
    target.reset()
    target.forward(prompt, greedy=True)
    target.commit()
for n in [int(v) for v in args.rows.split(",")]:
    tokens = torch.randint(100, 5000, (n,))
    times: dict[int, list[float]] = {id(bf16): [], id(q4k): []}
    for _ in range(args.repeats + 1):
        for target in (bf16, q4k):
            length = target.cache_len
            start = time.perf_counter()
            target.forward(tokens, greedy=True)
            times[id(target)].append((time.perf_counter() - start) * 1e3)
            target.commit()
            target.truncate(length)
    b, q = statistics.median(times[id(bf16)][1:]), statistics.median(times[id(q4k)][1:])
    print(f"{n} rows: bfloat16 {b:.0f} ms, Q4_K blocks {q:.0f} ms, ratio {q / b:.2f}", flush=True)
