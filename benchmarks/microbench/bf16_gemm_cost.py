"""All matrix products of one SmolLM2-135M decode step (30 layers' fused QKV, O, gate/up and down, then the LM
head; random bfloat16 weights of those shapes, 270 MB, more than the L3 cache) for M rows, through eaglespec's
kernel (eaglespec.backends.cpu.kernels) and through oneDNN's packed products (eaglespec.backends.cpu.packed),
interleaved.

    python benchmarks/microbench/bf16_gemm_cost.py [--threads 2] [--rows 1,2,3,4,6,8,12,16] [--repeats 9]

Prints the median milliseconds per step's products and the weight bytes read per second.
"""

import argparse
import statistics
import time

import torch

from eaglespec.backends.cpu import kernels as bf16gemm
from eaglespec.backends.cpu import packed

p = argparse.ArgumentParser()
p.add_argument("--threads", type=int, default=2)
p.add_argument("--rows", default="1,2,3,4,6,8,12,16")
p.add_argument("--repeats", type=int, default=9)
args = p.parse_args()
torch.set_num_threads(args.threads)
if not bf16gemm.available(torch.bfloat16, "cpu"):
    raise SystemExit("the kernel needs a CPU with AVX-512 BF16 and a C++ compiler")
torch.manual_seed(0)
d, inter, qkv, vocab, layers = 576, 1536, 960, 49152, 30
shapes = [(qkv, d), (d, d), (2 * inter, d), (d, inter)] * layers + [(vocab, d)]
weights = [torch.randn(n, k).bfloat16() * 0.05 for n, k in shapes]
gigabytes = sum(w.numel() * 2 for w in weights) / 1e9
kernel = [bf16gemm.Bf16Linear(w) for w in weights]
onednn = [packed.pack(w) for w in weights]
print(f"{len(weights)} products, {gigabytes * 1e3:.0f} MB of weights, {args.threads} threads")


def step_ms(products, inputs) -> float:
    start = time.perf_counter()
    for product, w in zip(products, weights):
        product(inputs[w.shape[1]])
    return (time.perf_counter() - start) * 1e3


for m in [int(v) for v in args.rows.split(",")]:
    inputs = {k: torch.randn(m, k).bfloat16() for k in (d, inter)}
    times = {"kernel": [], "onednn": []}
    for _ in range(args.repeats + 1):  # the first round warms up, interleaved so drift hits both
        for name, products in (("kernel", kernel), ("onednn", onednn)):
            times[name].append(step_ms(products, inputs))
    ours, theirs = (statistics.median(times[name][1:]) for name in ("kernel", "onednn"))
    print(f"{m:2d} rows: kernel {ours:6.2f} ms ({gigabytes / ours * 1e3:5.1f} GB/s), "
          f"oneDNN {theirs:6.2f} ms ({gigabytes / theirs * 1e3:5.1f} GB/s)")
