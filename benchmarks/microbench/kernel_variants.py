"""The bfloat16 kernel's two multiply loops (vdpbf16ps and float32 FMAs, `eaglespec.backends.cpu.kernels.VARIANTS`),
interleaved.

    python benchmarks/microbench/kernel_variants.py [--threads 2] [--rows 1,2,4,6,8,10,12,16] [--repeats 7]

1. One 1536 x 576 weight (1.7 MB, stays in L2): the loops' arithmetic rate.
2. All matrix products of one SmolLM2-135M decode step (random bfloat16 weights of its shapes, 269 MB): what a step
   or a tree verification pays.
Prints median ms per call (1) or per step (2) for each loop, their ratio, and which loop `bf16gemm.variant()`
picks on this machine.
"""

import argparse
import statistics
import time

import torch

from eaglespec.backends.cpu import kernels as bf16gemm

p = argparse.ArgumentParser()
p.add_argument("--threads", type=int, default=2)
p.add_argument("--rows", default="1,2,4,6,8,10,12,16")
p.add_argument("--repeats", type=int, default=7)
args = p.parse_args()
torch.set_num_threads(args.threads)
bf16gemm.load()
ops = torch.ops.eaglespec
torch.manual_seed(0)
d, inter, qkv, vocab, layers = 576, 1536, 960, 49152, 30
cases = [("one 1536x576 weight (L2)", [(inter, d)], 100),
         ("all products of a step (269 MB)", [(qkv, d), (d, d), (2 * inter, d), (d, inter)] * layers + [(vocab, d)],
          2)]
print(f"{torch.get_num_threads()} threads; bf16gemm.variant() picks {bf16gemm.variant()!r} here")
for label, shapes, calls in cases:
    weights = [torch.randn(n, k).bfloat16() * 0.05 for n, k in shapes]
    packs = [ops.bf16_pack(w) for w in weights]
    print(f"\n{label}, median ms of {args.repeats}")
    print("| rows | dpbf16 | fma | dpbf16 / fma |\n|---|---|---|---|")
    for m in [int(r) for r in args.rows.split(",")]:
        xs = {k: torch.randn(m, k).bfloat16() for k in {k for _, k in shapes}}
        times: dict[int, list[float]] = {code: [] for code in bf16gemm.VARIANTS.values()}
        for _ in range(args.repeats):
            for code in times:
                start = time.perf_counter()
                for _ in range(calls):
                    for weight, packed_weight in zip(weights, packs):
                        ops.bf16_linear(xs[weight.shape[1]], packed_weight, weight.shape[0], None, code)
                times[code].append((time.perf_counter() - start) * 1e3 / calls)
        dp, fma = (statistics.median(times[bf16gemm.VARIANTS[name]]) for name in ("dpbf16", "fma"))
        print(f"| {m} | {dp:.3f} | {fma:.3f} | {dp / fma:.2f} |")
