"""Print what `--tree auto` measured and chose for a model + head, as Markdown. Without a calibration cached for this
machine `--tree auto` measures nothing (it takes the CPU class's default tree, and the tables stay empty);
`--calibrate` measures first, as `--tree calibrate` does, and caches the result.

    python benchmarks/tools/tree_auto_table.py [--model NAME] [--head DIR] [--method eagle2|chain] [--dtype float32]
        [--compile] [--threads 2] [--calibrate]
"""

import argparse

from eaglespec import Engine
from eaglespec.drafters.autotree import settings_of

parser = argparse.ArgumentParser()
parser.add_argument("--model", default="smollm2-135m")
parser.add_argument("--head", default="auto")
parser.add_argument("--method", default="eagle2")
parser.add_argument("--dtype", default="auto")
parser.add_argument("--compile", action="store_true")
parser.add_argument("--threads", type=int, default=None)
parser.add_argument("--calibrate", action="store_true", help="measure this machine first (--tree calibrate)")
args = parser.parse_args()
if args.threads:
    import torch

    torch.set_num_threads(args.threads)

engine = Engine(model=args.model, head=args.head, method=args.method, dtype=args.dtype,
                tree="calibrate" if args.calibrate else "auto",
                compile=args.compile)
choice = engine.tree_choice
print(choice.summary(), f"(cached: {choice.cached}, {choice.positions} calibration positions)\n")
sizes = sorted(choice.verify_ms)
print("| tree tokens | " + " | ".join(str(n) for n in sizes) + " |")
print("|---|" + "---|" * len(sizes))
print("| verify ms | " + " | ".join(f"{choice.verify_ms[n]:.1f}" for n in sizes) + " |\n")
print("| total_tokens | depth | top_k | replayed tau | draft ms | verify ms | expected tokens/s |")
print("|---|---|---|---|---|---|---|")
for r in choice.ranking:
    print(f"| {r['total_tokens']} | {r['depth']} | {r['top_k']} | {r['tau']:.2f} | {r['draft_ms']:.1f} | "
          f"{r['verify_ms']:.1f} | {r['tokens_per_s']:.1f} |")
if choice.checked:
    print(f"\nChecked by decoding (plain decoding {choice.measured_vanilla_tokens_per_s:.1f} tokens/s):\n")
    print("| total_tokens | depth | top_k | tokens/s | kept |")
    print("|---|---|---|---|---|")
    for r in choice.checked:
        kept = "yes" if settings_of(r) == choice.settings else ""
        print(f"| {r['total_tokens']} | {r['depth']} | {r['top_k']} | {r['tokens_per_s']:.1f} | {kept} |")
