"""Decode-step attention of SmolLM2-135M's shapes (9 query heads, 3 key/value heads, head_dim 64, float32, 30
layers) over c cached keys for n query rows with a chain mask: eaglespec's kernel (csrc/tree_attention.cpp) against
torch's scaled_dot_product_attention (GQA, boolean mask), interleaved.

    python benchmarks/microbench/attention_cost.py [--threads 2] [--contexts 100,400] [--rows 1,2,4,6,8,16]
        [--repeats 15]

Prints the median milliseconds for all 30 layers: the kernel over a float32 cache, over a bfloat16 cache (the
cache of a bfloat16 target under --compile), and torch's attention over the float32 cache.
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from eaglespec.backends.cpu import kernels as bf16gemm

p = argparse.ArgumentParser()
p.add_argument("--threads", type=int, default=2)
p.add_argument("--contexts", default="100,400")
p.add_argument("--rows", default="1,2,4,6,8,16")
p.add_argument("--repeats", type=int, default=15)
args = p.parse_args()
torch.set_num_threads(args.threads)
bf16gemm.load()
heads, kv_heads, hd, layers, capacity = 9, 3, 64, 30, 1024
keys = [torch.randn(kv_heads, capacity, hd) for _ in range(layers)]
values = [torch.randn(kv_heads, capacity, hd) for _ in range(layers)]
keys16, values16 = [k.bfloat16() for k in keys], [v.bfloat16() for v in values]
# the kernel takes keys transposed, [kv_heads, head_dim, capacity], as FastTarget caches them for it
keys_t, keys16_t = ([k.transpose(1, 2).contiguous() for k in ks] for ks in (keys, keys16))

print(f"ms for {layers} layers, {args.threads} threads, median of {args.repeats}")
print("| cached keys | query rows | kernel, float32 cache | kernel, bfloat16 cache | torch, float32 cache |")
print("|---|---|---|---|---|")
for c in (int(v) for v in args.contexts.split(",")):
    for n in (int(v) for v in args.rows.split(",")):
        q = torch.randn(heads, n, hd)
        step_mask = torch.ones(n, n, dtype=torch.bool).tril()
        visible = torch.ones(1, 1, n, c + n, dtype=torch.bool)
        visible[..., c:] = step_mask

        def kernel():
            for k, v in zip(keys_t, values):
                torch.ops.eaglespec.tree_attention(q, k[..., : c + n], v[:, : c + n], step_mask if n > 1 else None)

        def kernel16():
            for k, v in zip(keys16_t, values16):
                torch.ops.eaglespec.tree_attention(q, k[..., : c + n], v[:, : c + n], step_mask if n > 1 else None)

        def reference():
            for k, v in zip(keys, values):
                F.scaled_dot_product_attention(q[None], k[None, :, : c + n], v[None, :, : c + n],
                                               attn_mask=visible if n > 1 else None, enable_gqa=True)

        times = {kernel: [], kernel16: [], reference: []}
        for repeat in range(args.repeats + 3):
            for run in times:
                start = time.perf_counter()
                run()
                if repeat >= 3:
                    times[run].append(1e3 * (time.perf_counter() - start))
        print(f"| {c} | {n} | " + " | ".join(f"{statistics.median(t):.3f}" for t in times.values()) + " |")
