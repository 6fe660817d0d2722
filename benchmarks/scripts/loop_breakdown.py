"""Where a compiled bfloat16 round's time goes inside the decoding loop, against the same target forwards outside it.

    python benchmarks/scripts/loop_breakdown.py [--threads 2] [--tree 6,2,4] [--tokens 256]

1. Outside the loop: a compiled SmolLM2-135M target alone over 200 cached tokens, steps of 1 and of n tree tokens
   (n = the tree's total_tokens) alternating; median ms of each.
2. Inside the loop: one eagle2 generation (`--tree`) and one plain generation of the first MT-bench writing prompt
   through the same compiled target, under cProfile; cumulative ms per round of the target forward, the commit,
   greedy acceptance, the text stream and the drafter's parts (cProfile adds its own overhead to Python calls).
"""

import argparse
import cProfile
import pstats
import statistics
import time

import torch

from eaglespec import Engine, TreeSettings
from eaglespec.decode import SpecDecoder
from eaglespec.drafters import VanillaDrafter

PROMPT = ("Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural experiences "
          "and must-see attractions.")
PARTS = {  # (file suffix, function name) -> label
    ("fastpath.py", "forward"): "target forward",
    ("fastpath.py", "commit"): "target commit",
    ("verify.py", "walk_greedy"): "greedy acceptance",
    ("decode.py", "push"): "text stream",
    ("drafters.py", "draft"): "draft (all)",
    ("drafters.py", "_catch_up"): "  head catch-up",
    ("drafters.py", "__init__"): "  root log-probs (TreeGrowth)",
    ("drafters.py", "_expand"): "  frontier expansions",
    ("drafters.py", "_top_children"): "  top-k",
    ("drafters.py", "_rerank"): "  rerank",
}

p = argparse.ArgumentParser()
p.add_argument("--threads", type=int, default=2)
p.add_argument("--tree", default="6,2,4")
p.add_argument("--tokens", type=int, default=256)
args = p.parse_args()
torch.set_num_threads(args.threads)
settings = TreeSettings(*(int(v) for v in args.tree.split(",")))
engine = Engine(method="eagle2", compile=True, tree=settings)
target = engine.target

# 1. outside the loop
n = settings.total_tokens
prompt = torch.randint(0, target.config.vocab_size, (200,))
target.reset()
target.forward(prompt)
target.commit()
times: dict[int, list[float]] = {1: [], n: []}
for i in range(70):
    size = (1, n)[i % 2]
    tokens = torch.randint(0, target.config.vocab_size, (size,))
    start = time.perf_counter()
    target.forward(tokens, torch.arange(target.cache_len, target.cache_len + size),
                   torch.ones(size, size, dtype=torch.bool).tril())
    if i >= 10:
        times[size].append(1e3 * (time.perf_counter() - start))
    target.commit(torch.tensor([0]) if size > 1 else None)
print(f"outside the loop (200+ cached tokens): 1 token {statistics.median(times[1]):.2f} ms, "
      f"{n} tokens {statistics.median(times[n]):.2f} ms")

# 2. inside the loop
ids = engine.encode(PROMPT)
for name, decoder in (("eagle2", engine.decoder), ("vanilla", SpecDecoder(target, engine.tokenizer, VanillaDrafter()))):
    list(decoder.stream(ids, max_new_tokens=64))  # warm-up
    profiler = cProfile.Profile()
    profiler.enable()
    *_, last = decoder.stream(ids, max_new_tokens=args.tokens)
    profiler.disable()
    rounds = last.stats.target_forwards
    print(f"\n{name}: {last.stats.new_tokens} tokens, {rounds} rounds, tau {last.stats.tau:.2f}, "
          f"{1e3 * last.stats.total_time / rounds:.2f} ms a round under cProfile")
    stats = pstats.Stats(profiler).stats  # {(file, line, function): (calls, primitive, tottime, cumtime, callers)}
    for (suffix, function), label in PARTS.items():
        found = [(v[0], v[3]) for (file, _, fn), v in stats.items() if file.endswith(suffix) and fn == function]
        if found:
            calls, cumulative = map(sum, zip(*found))
            print(f"  {label:32s} {1e3 * cumulative / rounds:6.3f} ms a round ({calls / rounds:.1f} calls)")
