"""Per decoding step of a bench run: tokens, draft, verify (the target's pass, acceptance, cache commit, features)
and the rest (emitting and streaming the tokens, the call around the loop) in milliseconds, from its results.jsonl
(our own methods, one line per variant, e.g. eagle2 and eagle2+adapt; the prefill is left out; "drafted": the
share of steps that verified a drafted tree, recorded by bench from 2026-11-26 on). Versions of this script before
2026-11-25 (git ec1e219) subtracted the prefill from the verify time, which never included it, so "verify" was
short and "rest" long by prefill / steps (~0.3-0.6 ms).

    python benchmarks/tools/step_breakdown.py benchmarks/runs/2026-11-26-zen3-compile-adapt
"""

import json
import sys
from collections import defaultdict
from pathlib import Path

totals: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
for line in (Path(sys.argv[1]) / "results.jsonl").read_text().splitlines():
    row = json.loads(line)
    if row.get("kind") != "ours" or not row.get("target_forwards"):
        continue
    t = totals[row.get("variant", row["method"])]
    t["steps"] += row["target_forwards"]
    t["drafted"] += row.get("drafted_forwards") or 0
    t["tokens"] += row["new_tokens"]
    t["wall"] += row["wall_time"] - row["prefill_time"]
    t["draft"] += row["draft_time"]
    t["verify"] += row["verify_time"]  # (the loop's verify passes; the prefill is timed on its own)

print("| method | tokens per step | drafted | draft | verify | rest | total (ms) |\n|---|---|---|---|---|---|---|")
for method, t in totals.items():
    ms = {k: 1e3 * t[k] / t["steps"] for k in ("draft", "verify", "wall")}
    drafted = f"{t['drafted'] / t['steps']:.0%}" if t["drafted"] or method == "vanilla" else "-"
    print(f"| {method} | {t['tokens'] / t['steps']:.2f} | {drafted} | {ms['draft']:.2f} | {ms['verify']:.2f} | "
          f"{ms['wall'] - ms['draft'] - ms['verify']:.2f} | {ms['wall']:.2f} |")
