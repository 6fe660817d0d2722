"""A bfloat16 decode step of a target (SmolLM2-135M by default) split into its matrix products, its attention and the
rest, for 1 and 4 tokens (a plain step and a 4-token verify pass), interleaved in one process.

    python benchmarks/microbench/forward_parts.py [--model smollm2-135m] [--threads 2] [--context 300] [--rows 1,4]
        [--repeats 12] [--greedy] [--features eagle3] [--activations int8] [--requantize]

"products" runs the target's own packed products (the same weights, in the step's order: bfloat16 or, on AVX2, exact
4-bit blocks, eaglespec.backends.cpu.q4, or a GGUF's 4- and 6-bit blocks for a model converted from one) on random
rows, calling each product module (~1-3 us of Python a call more than the kernels' decoder stack: "other" is a lower
estimate); "LM head" is the full LM head's logits, or with --greedy (the steps
greedy decoding runs, as the bench's) the screened greedy head (eaglespec.backends.cpu.kernels.GreedyHead); "attention"
the decode-step attention kernel over the target's cache for every layer; "other" is the step's time left (norms, RoPE,
cache writes, the features a draft head reads (--features), the Python around it). --requantize builds it as a
draft model's target is built (`sps`, `staged`): layers and LM head as 4-bit blocks (FastTarget's `requantize`). Needs the bfloat16 kernels
(AVX-512 BF16 or AVX2 + FMA). Where the layers run as the kernels' decoder stack (the default there), --compile is
not needed; the target is built as `make_target` builds it.
"""

import argparse
import statistics
import time

import torch

from eaglespec.models import load_target
from eaglespec.targets.fast import FastTarget

p = argparse.ArgumentParser()
p.add_argument("--model", default="smollm2-135m")
p.add_argument("--features", choices=["none", "final", "eagle3"], default="none",
               help="what the step also returns for a draft head (eagle2 with an EAGLE-3 head: eagle3)")
p.add_argument("--threads", type=int, default=2)
p.add_argument("--context", type=int, default=300)
p.add_argument("--rows", default="1,4")
p.add_argument("--repeats", type=int, default=12)
p.add_argument("--greedy", action="store_true")
p.add_argument("--activations", choices=["bfloat16", "int8"], default="bfloat16",
               help="int8: the 4-bit and 6-bit block products with int8 inputs (FastTarget's `activations`)")
p.add_argument("--requantize", action="store_true",
               help="layers and LM head as 4-bit blocks, as a draft model runs (FastTarget's `requantize`)")
args = p.parse_args()
torch.set_num_threads(args.threads)
model, tokenizer = load_target(args.model, dtype="bfloat16")
target = FastTarget(model, None if args.features == "none" else args.features, compile=True,
                    activations=args.activations, requantize=args.requantize)
assert target.bf16_gemm, "needs the bfloat16 kernels (AVX-512 BF16 or AVX2 + FMA, a C++ compiler)"
target.warm_up()
d, (H, _, hd) = target.hidden_size, (target.n_heads, target.n_kv, target.head_dim)
prefix = tokenizer("Write a poem about the sea and the sky and the stars. " * (args.context // 10 + 1))["input_ids"]
target.forward(torch.tensor(prefix[: args.context]))
target.commit()
c = target.cache_len
products = [linear for layer in target.layers for linear in (layer.qkv, layer.o, layer.gate_up, layer.down)]
print(f"{args.model}: layer matrices as exact 4-bit blocks: {target.q4_matrices}, as 6-bit codes: "
      f"{target.q6_matrices}; layers as one kernel call: {target.kernel_stack is not None}; "
      f"rounded to 4-bit blocks: {target.requantized}")


def step(n: int) -> None:
    target.forward(torch.randint(0, 1000, (n,)), torch.arange(c, c + n), torch.ones(n, n, dtype=torch.bool).tril(),
                   greedy=args.greedy)
    target.commit(torch.zeros(0, dtype=torch.long))  # keep nothing: the prefix stays as it was


def matmuls(n: int) -> None:
    xs = {k: torch.randn(n, k).bfloat16() for k in {linear.in_features for linear in products}}
    for linear in products:
        linear(xs[linear.in_features])


def lm_head(n: int) -> None:
    x = torch.randn(n, d).bfloat16()
    if args.greedy and target.greedy_head is not None:
        target.greedy_head(x)
    else:  # (a requantized target's greedy steps take the argmax of its logits)
        logits = target.logits_head(x)
        if args.greedy:
            target.kernels.argmax_rows(logits.float())


def attention(n: int) -> None:
    q, mask = torch.randn(H, n, hd), torch.ones(n, n, dtype=torch.bool).tril() if n > 1 else None
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
