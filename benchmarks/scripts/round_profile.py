"""Where a speculative round's time goes: torch.profiler's per-operator table (self CPU time) and cProfile's
Python functions over one 256-token generation of the first MT-bench writing prompt, after a warm-up generation.

    python benchmarks/scripts/round_profile.py [--method eagle2] [--head PATH] [--no-compile] [--threads 2]
        [--tree 4,2,3]

--tree total_tokens,depth,top_k drafts with that tree (default: `--tree auto`'s choice, which may be no draft).

Divide an operator's total by the printed number of target forwards for its cost per round.
"""

import argparse
import cProfile
import pstats
import time

import torch

from eaglespec import Engine, TreeSettings

PROMPT = ("Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural experiences "
          "and must-see attractions.")

p = argparse.ArgumentParser()
p.add_argument("--method", default="eagle2")
p.add_argument("--head", default="auto")
p.add_argument("--no-compile", action="store_true")
p.add_argument("--threads", type=int, default=2)
p.add_argument("--tree", default="auto")
args = p.parse_args()
torch.set_num_threads(args.threads)
tree = "auto" if args.tree == "auto" else TreeSettings(*(int(v) for v in args.tree.split(",")))
engine = Engine(method=args.method, head=args.head, compile=not args.no_compile, tree=tree)
engine.generate(PROMPT, max_new_tokens=64)  # warm-up
start = time.perf_counter()
result = engine.generate(PROMPT, max_new_tokens=256)
seconds = time.perf_counter() - start
print(f"{result.stats.new_tokens} tokens, {result.stats.new_tokens / seconds:.1f} tokens/s, "
      f"{result.stats.target_forwards} target forwards (tau {result.stats.tau:.2f})")
with torch.profiler.profile() as prof:
    engine.generate(PROMPT, max_new_tokens=256)
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
profiler = cProfile.Profile()
profiler.enable()
engine.generate(PROMPT, max_new_tokens=256)
profiler.disable()
pstats.Stats(profiler).sort_stats("tottime").print_stats(20)
