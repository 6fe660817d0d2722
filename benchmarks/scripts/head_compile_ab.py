"""Interleaved A/B of the draft head's step: eager (oneDNN packed) against compiled, on one compiled target.

    python benchmarks/scripts/head_compile_ab.py [--head DIR] [--max-new-tokens 128] [--threads 2]

One `Engine(compile=True)` (its drafter's head step is compiled); a second drafter over the same head runs the
eager step. The first MT-bench question of each category, both drafters in alternating order, two passes; the
second is reported (tokens/s, draft ms per step, tau, identical answers, compiled head graphs).
"""

import argparse
import time

import torch
from torch._dynamo.eval_frame import _debug_get_cache_entry_list

from eaglespec import Engine, TreeSettings
from eaglespec.bench.datasets import load_questions
from eaglespec.compiled import HeadStep
from eaglespec.drafters import EagleDrafter

p = argparse.ArgumentParser()
p.add_argument("--head", default="src/eaglespec/shipped_heads/smollm2-135m-eagle3")
p.add_argument("--max-new-tokens", type=int, default=128)
p.add_argument("--threads", type=int, default=2)
args = p.parse_args()
torch.set_num_threads(args.threads)


def head_graphs() -> int:
    return len(_debug_get_cache_entry_list(HeadStep.forward.__code__))


start = time.perf_counter()
engine = Engine(head=args.head, tree=TreeSettings(total_tokens=4, depth=2, top_k=2), dtype="bfloat16", compile=True)
print(f"engine built in {time.perf_counter() - start:.0f} s, {head_graphs()} head graphs")
drafters = {"compiled": engine.drafter,
            "eager": EagleDrafter(engine.head, engine.target.embed_tokens, engine.target.lm_head, "dynamic",
                                  engine.drafter.settings)}
prompts, seen = [], set()
for q in load_questions("mt-bench"):
    if q.category not in seen:
        seen.add(q.category)
        prompts.append(q.turns[0])
totals = {name: [0, 0.0, 0.0, 0] for name in drafters}  # new tokens, seconds, draft seconds, target forwards
answers: dict[int, dict[str, list[int]]] = {}
for rep in range(2):
    for i, prompt in enumerate(prompts):
        order = ["eager", "compiled"] if (i + rep) % 2 == 0 else ["compiled", "eager"]
        for name in order:
            engine.decoder.drafter = drafters[name]
            result = engine.generate(prompt, max_new_tokens=args.max_new_tokens)
            if rep == 1:
                t = totals[name]
                t[0] += result.stats.new_tokens
                t[1] += result.stats.total_time
                t[2] += result.stats.draft_time
                t[3] += result.stats.target_forwards
                answers.setdefault(i, {})[name] = result.tokens
for name, (tokens, seconds, draft, forwards) in totals.items():
    print(f"{name}: {tokens / seconds:.2f} tokens/s, draft {1e3 * draft / forwards:.2f} ms a step, "
          f"tau {tokens / forwards:.2f}")
same = sum(a["eager"] == a["compiled"] for a in answers.values())
print(f"identical answers {same}/{len(answers)}; {head_graphs()} head graphs after decoding")
