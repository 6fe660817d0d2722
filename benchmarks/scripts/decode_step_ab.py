"""Compiled decode-step cost of SmolLM2-135M (bfloat16, `--compile`) in three variants, timed interleaved in one
process: today's graphs (eaglespec's attention kernel, eager's bfloat16 roundings), the kernel with inductor's own
roundings, and session 15's graphs (torch's attention, inductor's roundings).

    python benchmarks/scripts/decode_step_ab.py [--threads 2] [--context 300] [--sizes 1,2,4,6,8,16] [--repeats 15]

Each forward is a decode step as the decoding loop makes it (tree positions, a chain mask) over `context` cached
tokens; prints the median milliseconds per size and variant.
"""

import argparse
import statistics
import time

import torch

from eaglespec import compiled
from eaglespec.fastpath import FastTarget
from eaglespec.models import load_target

p = argparse.ArgumentParser()
p.add_argument("--threads", type=int, default=2)
p.add_argument("--context", type=int, default=300)
p.add_argument("--sizes", default="1,2,4,6,8,16")
p.add_argument("--repeats", type=int, default=15)
args = p.parse_args()
torch.set_num_threads(args.threads)
model, _ = load_target("smollm2-135m", dtype=torch.bfloat16)


def variant(tree_kernel: bool, eager_roundings: bool) -> FastTarget:
    target = FastTarget(model, "final", compile=True)
    target.tree_kernel = tree_kernel
    target.stack = compiled.compile_stack(target.layers, (target.n_heads, target.n_kv, target.head_dim), target.eps,
                                          target.attention_dtype, (), target.device, autotune=False,
                                          tree_kernel=tree_kernel, eager_roundings=eager_roundings)
    target.warm_up()
    return target


variants = {"kernel, eager roundings (default)": variant(True, True),
            "kernel, inductor roundings": variant(True, False),
            "torch attention, inductor roundings (session 15)": variant(False, False)}
prompt = torch.randint(0, model.config.vocab_size, (args.context,))
sizes = [int(s) for s in args.sizes.split(",")]
times = {(name, n): [] for name in variants for n in sizes}
for repeat in range(args.repeats + 2):  # two untimed rounds
    for n in sizes:
        tokens = torch.randint(0, model.config.vocab_size, (n,))
        mask = torch.ones(n, n, dtype=torch.bool).tril()
        for name, target in variants.items():
            target.reset()
            target.forward(prompt)
            target.commit()
            start = time.perf_counter()
            target.forward(tokens, torch.arange(args.context, args.context + n), mask)
            if repeat >= 2:
                times[name, n].append(1e3 * (time.perf_counter() - start))
            target.commit()
print(f"ms per decode step over {args.context} cached tokens, {args.threads} threads, median of {args.repeats}")
print("| variant | " + " | ".join(f"{n} tokens" for n in sizes) + " |")
print("|---|" + "---|" * len(sizes))
for name in variants:
    print(f"| {name} | " + " | ".join(f"{statistics.median(times[name, n]):.2f}" for n in sizes) + " |")
