"""One 4-bit block product (eaglespec.backends.cpu.q4) of one row, called from Python, for the first N columns of
SmolLM2-135M's first gate/up matrix (held in cache: the same matrix again and again), on 1 and on 2 threads, alternated.

    python benchmarks/microbench/q4_call_cost.py [--columns 64,256,1024,3072] [--calls 200] [--rounds 30]

Prints the median microseconds a call: with 64 columns the work is nil and what is left is the call's fixed cost;
with 3072 the product itself (docs/benchmarks.md, "The ceiling"). Either build (AVX2, AVX-512).
"""

import argparse
import statistics
import time

import torch
from step_matrices import step_matrices

from eaglespec.backends.cpu import kernels as bf16gemm
from eaglespec.backends.cpu import q4

p = argparse.ArgumentParser()
p.add_argument("--columns", default="64,256,1024,3072")
p.add_argument("--calls", type=int, default=200)
p.add_argument("--rounds", type=int, default=30)
args = p.parse_args()
if not q4.available():
    raise SystemExit("the 4-bit block product needs a CPU with AVX2 + FMA + F16C (or AVX-512), and EAGLESPEC_Q4 not 0")
bf16gemm.load()
gate_up = step_matrices()[2]  # [3072, 576]
x = torch.randn(1, gate_up.shape[1]).bfloat16()
for columns in (int(c) for c in args.columns.split(",")):
    layer = q4.Q4Linear(q4.find_blocks(gate_up[:columns].contiguous()))
    cells = []
    for threads in (1, 2, 1, 2):
        torch.set_num_threads(threads)
        times = []
        for _ in range(args.rounds):
            start = time.perf_counter()
            for _ in range(args.calls):
                torch.ops.eaglespec.q4_linear(x, layer.packed, layer.out_features, None)
            times.append((time.perf_counter() - start) / args.calls * 1e6)
        cells.append(f"{threads} thread(s) {statistics.median(times[1:]):.1f}")
    print(f"{columns} x {gate_up.shape[1]}: " + ", ".join(cells) + " us a call")
