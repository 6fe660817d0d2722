"""The layer products of one SmolLM2-135M decode step (30 layers' fused QKV, O, gate/up and down: the real weights of
the default model, read back as float32 from its converted GGUF folder) for M rows, through the exact 4-bit block
kernel (eaglespec.backends.cpu.q4, 66 MB) and the bfloat16 kernel (eaglespec.backends.cpu.kernels, 212 MB), interleaved.
Either build (AVX2, AVX-512).

    python benchmarks/microbench/q4_cost.py [--threads 2] [--rows 1,2,3,4,6,8] [--repeats 9]

Prints the median milliseconds of all layer products of a step (the LM head is not included) for each kernel.
"""

import argparse
import statistics
import time

import torch
from step_matrices import step_matrices

from eaglespec.backends.cpu import kernels as bf16gemm
from eaglespec.backends.cpu import q4

p = argparse.ArgumentParser()
p.add_argument("--threads", type=int, default=2)
p.add_argument("--rows", default="1,2,3,4,6,8")
p.add_argument("--repeats", type=int, default=9)
args = p.parse_args()
torch.set_num_threads(args.threads)
if not q4.available():
    raise SystemExit("the 4-bit block product needs a CPU with AVX2 + FMA + F16C (or AVX-512), and EAGLESPEC_Q4 not 0")
matrices = step_matrices()
blocks = [q4.find_blocks(w) for w in matrices]
if any(b is None for b in blocks):
    raise SystemExit("these weights are not all exact 4-bit blocks")
kernels = {"q4": [q4.Q4Linear(b) for b in blocks], "bf16": [bf16gemm.Bf16Linear(w) for w in matrices]}
print(f"{len(matrices)} products, {sum(k.packed.numel() for k in kernels['q4']) / 1e6:.0f} MB as 4-bit blocks, "
      f"{sum(w.numel() * 2 for w in matrices) / 1e6:.0f} MB in bfloat16; {args.threads} threads")
inputs = {k: torch.randn(max(int(r) for r in args.rows.split(",")), k).bfloat16() for k in (576, 1536)}
for rows in (int(r) for r in args.rows.split(",")):
    times: dict[str, list[float]] = {name: [] for name in kernels}
    for _ in range(args.repeats + 1):  # the first round warms up
        for name, layers in kernels.items():
            start = time.perf_counter()
            for layer in layers:  # the operators themselves, as the compiled graphs call them
                x = inputs[layer.in_features][:rows]
                if name == "q4":
                    torch.ops.eaglespec.q4_linear(x, layer.packed, layer.out_features, None)
                else:
                    torch.ops.eaglespec.bf16_linear(x, layer.packed, layer.out_features, None, layer.variant)
            times[name].append((time.perf_counter() - start) * 1e3)
    print(f"rows {rows}: " + ", ".join(f"{name} {statistics.median(t[1:]):.2f} ms" for name, t in times.items()))
