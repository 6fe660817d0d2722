"""The context lookup's longest n-gram (`drafters.lookup.MAX_NGRAM`) against another, inside real decoding: one
engine, two drafters that differ only in the longest suffix their stage-2 lookup matches (`staged`'s second stage
and an EAGLE head's `--extend` guesses; the draft model or head, the trees and the target are the same), taking
turns prompt by prompt, which one goes first alternating, so that a VM whose speed drifts affects both alike. Both
are lossless, so every answer of one must equal the other's; only speed, tau and draft work can differ.

    python benchmarks/microbench/lookup_ab.py [--method eagle2|staged] [--against 3] [--model qwen2.5-coder-1.5b]
        [--dataset humaneval] [--limit 16] [--max-new-tokens 256]

Prints, after each prompt, each drafter's running tokens/s, tau (tokens a target pass) and, for `staged`, draft-model
forwards a pass. Both run with the engine's defaults (tree auto, the adaptive policy off so that both always draft).
"""

import argparse
import copy
import time

import torch

from eaglespec.api import Engine
from eaglespec.bench.datasets import load_questions
from eaglespec.drafters.lookup import MAX_NGRAM, context_lookup
from eaglespec.drafters.ngram import Stage2Chain

p = argparse.ArgumentParser()
p.add_argument("--method", default="eagle2", choices=["eagle2", "staged"])
p.add_argument("--against", type=int, default=3, help="the other drafter's longest n-gram")
p.add_argument("--model", default="qwen2.5-coder-1.5b")
p.add_argument("--draft-model", default="qwen2.5-coder-0.5b", help="for --method staged")
p.add_argument("--dataset", default="humaneval")
p.add_argument("--limit", type=int, default=16)
p.add_argument("--max-new-tokens", type=int, default=256)
p.add_argument("--threads", type=int, default=2)
args = p.parse_args()
torch.set_num_threads(args.threads)

engine = Engine(args.model, method=args.method, adapt=False,
                draft_model=args.draft_model if args.method == "staged" else None)
ours = engine.drafter
if getattr(ours, "stage2", None) is None:
    raise SystemExit(f"{args.method} on {args.model} drafts without a stage-2 lookup here (no --extend guesses)")
other = copy.copy(ours)  # the same head or draft model and settings; its own state from here on
if args.method == "staged":
    other.model = ours.model.sibling()  # its own draft-model cache
other.reset()
if getattr(ours, "guess_count", None) is not None:
    other.guess_count = copy.deepcopy(ours.guess_count)
if getattr(ours, "chain_length", None) is not None:
    other.chain_length = copy.deepcopy(ours.chain_length)
lookup = context_lookup(max_ngram=args.against)
other.stage2 = Stage2Chain([lookup, *ours.stage2.stages[1:]]) if isinstance(ours.stage2, Stage2Chain) else lookup
drafters = {f"up to {MAX_NGRAM}": ours, f"up to {args.against}": other}

questions = load_questions(args.dataset)[: args.limit]
engine.generate(questions[0].turns[0], max_new_tokens=32)  # warm-up
totals = {name: [0.0, 0, 0, 0] for name in drafters}  # seconds, new tokens, target passes, draft-model forwards
for i, question in enumerate(questions):
    names = list(drafters) if i % 2 == 0 else list(reversed(drafters))
    answers = {}
    for name in names:
        drafter = drafters[name]
        drafter.reset()
        engine.decoder.drafter = drafter
        start = time.perf_counter()
        result = engine.generate(question.turns[0], max_new_tokens=args.max_new_tokens)
        total = totals[name]
        total[0] += time.perf_counter() - start
        total[1] += result.stats.new_tokens
        total[2] += result.stats.target_forwards
        total[3] += result.stats.draft_forwards
        answers[name] = result.tokens
    if len({tuple(a) for a in answers.values()}) != 1:
        raise SystemExit(f"{question.question_id}: the two drafters' answers differ (both must equal plain decoding's)")
    print(i + 1, "; ".join(f"{name}: {t[1] / t[0]:.2f} tokens/s, tau {t[1] / t[2]:.3f}"
                           + (f", {t[3] / t[2]:.2f} draft forwards a pass" if args.method == "staged" else "")
                           for name, t in totals.items()), flush=True)
