"""Fast-path target forward time vs number of tokens on top of a short cached prefix, and an op profile.

    python benchmarks/microbench/forward_cost.py [--quantize int8|int4] [--dtype float32|bfloat16] [--threads 2]
        [--batched-attention] [--no-pack] [--attention-dtype bfloat16] [--context 105] [--compile]

Each forward is a decode step as the decoding loop makes it (positions and a causal tree mask). With --quantize,
decode steps attend row by row (bit-exact, see eaglespec/fastpath.py); --batched-attention times the single
batched attention call instead, to see what that costs.
"""

import argparse
import statistics
import time

import torch

from eaglespec.models import load_target
from eaglespec.targets.fast import FastTarget

p = argparse.ArgumentParser()
p.add_argument("--quantize", default=None)
p.add_argument("--dtype", default="float32")
p.add_argument("--threads", type=int, default=2)
p.add_argument("--profile", action="store_true")
p.add_argument("--batched-attention", action="store_true", help="quantized: one batched attention call per layer")
p.add_argument("--no-pack", action="store_true",
               help="leave the weights unpacked (F.linear), to see what packing gains")
p.add_argument("--attention-dtype", default=None, help="KV cache / attention dtype (default: the fast path's choice)")
p.add_argument("--compile", action="store_true",
               help="decode steps through torch.compile (eaglespec.backends.cpu.compiled)")
p.add_argument("--context", type=int, default=105, help="cached tokens before the timed forwards")
p.add_argument("--sizes", default="1,2,4,8,16,32,64", help="comma-separated numbers of tokens per timed forward")
args = p.parse_args()
torch.set_num_threads(args.threads)
model, tokenizer = load_target("smollm2-135m", dtype=args.dtype)
attention_dtype = getattr(torch, args.attention_dtype) if args.attention_dtype else None
target = FastTarget(model, None, quantize=args.quantize, pack=False if args.no_pack else None,
                    attention_dtype=attention_dtype, compile=args.compile)
if args.compile:
    print(f"compiled in {target.warm_up():.1f} s")
prefix = tokenizer("Write a poem about the sea and the sky and the stars. " * (args.context // 10 + 1))["input_ids"]
target.forward(torch.tensor(prefix[: args.context]))
target.commit()
if args.batched_attention:
    target.row_invariant = False
weight_mb = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "embed" not in n) / 1e6
if model.config.tie_word_embeddings:
    weight_mb += model.lm_head.weight.numel() * model.lm_head.weight.element_size() / 1e6
print(f"dtype {args.dtype}, quantize {args.quantize}, packed {target.pack}, {args.threads} threads, "
      f"{target.cache_len} cached tokens, compiled {target.compiled}, attention in {target.attention_dtype}, "
      f"row-invariant attention {target.row_invariant}, "
      f"{weight_mb:.0f} MB of weights read per forward (unquantized)")
c = target.cache_len
for n in [int(v) for v in args.sizes.split(",")]:
    tokens = torch.randint(0, 1000, (n,))
    times = []
    for _ in range(12):
        start = time.perf_counter()
        target.forward(tokens, torch.arange(c, c + n), torch.ones(n, n, dtype=torch.bool).tril())
        target.commit(torch.tensor([], dtype=torch.long))  # keep nothing: the prefix stays as it was
        times.append(time.perf_counter() - start)
    ms = statistics.median(times[2:]) * 1000
    print(f"forward {n:2d} tokens: median {ms:.1f} ms ({weight_mb / ms:.1f} GB/s of weights)")
if args.profile:
    with torch.profiler.profile() as prof:
        for _ in range(5):
            target.forward(torch.tensor([5]), torch.tensor([c]), torch.ones(1, 1, dtype=torch.bool))
            target.commit(torch.tensor([], dtype=torch.long))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
