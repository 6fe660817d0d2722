"""A compiled bfloat16 decode step of SmolLM2-135M split into its matrix products, its attention and the rest, for
1 and 4 tokens (a plain step and a 4-token verify pass), interleaved in one process.

    python benchmarks/microbench/forward_parts.py [--threads 2] [--context 300] [--rows 1,4] [--repeats 12] [--greedy]

"products" runs the target's own packed products (the same weights, in the step's order: bfloat16 or, on AVX2, exact
4-bit blocks, eaglespec.backends.cpu.q4) on random rows, calling the operator directly (still ~1-3 us of Python a call
more than the graph: "other" is a lower estimate); "LM head" is the full LM head's logits, or with --greedy (the steps
greedy decoding runs, as the bench's) the screened greedy head (eaglespec.backends.cpu.kernels.GreedyHead); "attention"
the decode-step attention kernel over the target's cache for 30 layers; "other" is the step's time left (norms, RoPE,
cache writes, the compiled call, the Python around it). Needs the bfloat16 kernels (AVX-512 BF16 or AVX2 + FMA).
"""

import argparse
import statistics
import time

import torch

from eaglespec.backends.cpu import q4
from eaglespec.models import load_target
from eaglespec.targets.fast import FastTarget

p = argparse.ArgumentParser()
p.add_argument("--threads", type=int, default=2)
p.add_argument("--context", type=int, default=300)
p.add_argument("--rows", default="1,4")
p.add_argument("--repeats", type=int, default=12)
p.add_argument("--greedy", action="store_true")
args = p.parse_args()
torch.set_num_threads(args.threads)
model, tokenizer = load_target("smollm2-135m", dtype="bfloat16")
target = FastTarget(model, None, compile=True)
assert target.bf16_gemm, "needs the bfloat16 kernels (AVX-512 BF16 or AVX2 + FMA, a C++ compiler)"
target.warm_up()
prefix = tokenizer("Write a poem about the sea and the sky and the stars. " * (args.context // 10 + 1))["input_ids"]
target.forward(torch.tensor(prefix[: args.context]))
target.commit()
c = target.cache_len
products = [(linear, 576 if name != "down" else 1536) for layer in target.layers
            for name, linear in (("qkv", layer.qkv), ("o", layer.o), ("gate_up", layer.gate_up), ("down", layer.down))]
print(f"layer matrices as exact 4-bit blocks: {target.q4_matrices}")


def step(n: int) -> None:
    target.forward(torch.randint(0, 1000, (n,)), torch.arange(c, c + n), torch.ones(n, n, dtype=torch.bool).tril(),
                   greedy=args.greedy)
    target.commit(torch.zeros(0, dtype=torch.long))  # keep nothing: the prefix stays as it was


def matmuls(n: int) -> None:
    xs = {576: torch.randn(n, 576).bfloat16(), 1536: torch.randn(n, 1536).bfloat16()}
    for linear, k in products:  # the operator itself, as the compiled graph calls it (no module call around it)
        if isinstance(linear, q4.Q4Linear):
            torch.ops.eaglespec.q4_linear(xs[k], linear.packed, linear.out_features, linear.bias)
        else:
            torch.ops.eaglespec.bf16_linear(xs[k], linear.packed, linear.out_features, linear.bias, linear.variant)


def lm_head(n: int) -> None:
    x = torch.randn(n, 576).bfloat16()
    if args.greedy:
        target.greedy_head(x)
    else:
        head = target.logits_head
        torch.ops.eaglespec.bf16_linear(x, head.packed, head.out_features, head.bias, head.variant)


def attention(n: int) -> None:
    q, mask = torch.randn(9, n, 64), torch.ones(n, n, dtype=torch.bool).tril() if n > 1 else None
    for keys, values in zip(target.layer_keys, target.layer_values):
        torch.ops.eaglespec.tree_attention(q, keys[:, :, : c + n], values[:, : c + n], mask)


rows = [int(r) for r in args.rows.split(",")]
times: dict[tuple[int, str], list[float]] = {}
with torch.inference_mode():
    for _ in range(args.repeats):
        for n in rows:
            for name, fn in (("step", step), ("products", matmuls), ("head", lm_head), ("attention", attention)):
                start = time.perf_counter()
                fn(n)
                times.setdefault((n, name), []).append(1e3 * (time.perf_counter() - start))
print(f"{args.threads} threads, {c} cached tokens, median ms of {args.repeats - 2} (first two dropped)")
print("| tokens | step | layer products | LM head | attention | other |\n|---|---|---|---|---|---|")
for n in rows:
    step_ms, prod_ms, head_ms, attn_ms = (statistics.median(times[(n, k)][2:])
                                          for k in ("step", "products", "head", "attention"))
    print(f"| {n} | {step_ms:.2f} | {prod_ms:.2f} | {head_ms:.2f} | {attn_ms:.2f} | "
          f"{step_ms - prod_ms - head_ms - attn_ms:.2f} |")
