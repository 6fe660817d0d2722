"""The draft head's products two ways: eaglespec's bfloat16 kernel (`bf16gemm.Bf16Linear`) against the int8 copies
(`bf16gemm.Int8Linear`, AVX-512 VNNI, input quantized per block of 32 channels), for the weight shapes of
SmolLM2-135M's EAGLE heads, interleaved A/B, median us per call.

    python benchmarks/scripts/int8_linear_cost.py [--threads 2] [--rows 1,4] [--repeats 300]

"cold": a 64 MB buffer is read between calls (the weights come from memory, as in a draft round after a verify
pass); "hot": the same call again right away. Random weights and inputs (the cost does not depend on the values).
"""

import argparse
import statistics
import time

import torch

from eaglespec import bf16gemm

SHAPES = {"fc": (576, 1152), "q / o": (576, 576), "k / v": (192, 576), "gate / up": (1536, 576),
          "down": (576, 1536), "draft LM head": (8192, 576)}

p = argparse.ArgumentParser()
p.add_argument("--threads", type=int, default=2)
p.add_argument("--rows", default="1,4")
p.add_argument("--repeats", type=int, default=300)
args = p.parse_args()
torch.set_num_threads(args.threads)
flush = torch.ones(16 * 1024 * 1024)
print(f"{args.threads} threads, median us per call: bfloat16 kernel / int8 (cold), bfloat16 / int8 (hot)")
with torch.inference_mode():
    for rows in (int(r) for r in args.rows.split(",")):
        for name, (n, k) in SHAPES.items():
            w = (torch.randn(n, k) * 0.05).bfloat16()
            layers = {"bf16": bf16gemm.Bf16Linear(w), "int8": bf16gemm.Int8Linear(w)}
            x = torch.randn(rows, k).bfloat16()
            cold = {key: [] for key in layers}
            hot = {key: [] for key in layers}
            for _ in range(args.repeats):
                for key, layer in layers.items():
                    float(flush.sum())
                    start = time.perf_counter()
                    layer(x)
                    cold[key].append(1e6 * (time.perf_counter() - start))
                    start = time.perf_counter()
                    layer(x)
                    hot[key].append(1e6 * (time.perf_counter() - start))
            c = {key: statistics.median(v) for key, v in cold.items()}
            h = {key: statistics.median(v) for key, v in hot.items()}
            print(f"{rows} rows, {name} [{n} x {k}]: cold {c['bf16']:.1f} / {c['int8']:.1f}, "
                  f"hot {h['bf16']:.1f} / {h['int8']:.1f}")
