"""Replay a head's tau for many EAGLE-2 tree settings from one drafting pass over stored greedy answers.

A bench folder's vanilla rows hold plain decoding's answers (greedy, token for token). At every `--stride`-th answer
position the head drafts one large tree (depth 10, top_k 10) and every node is marked accepted when its path equals
the answer's continuation; each smaller setting's accepted length (bonus included) is then replayed exactly from
that tree (`eaglespec.drafters.autotree.Candidates`). It measures drafting quality only (no timing): use it to compare
heads or tree shapes in minutes, then confirm with `eaglespec bench`, whose tau counts the positions decoding lands on.

    python benchmarks/tools/tree_tau.py --reference benchmarks/runs/2026-11-22-float32 \
        --head src/eaglespec/shipped_heads/smollm2-135m-eagle1 --questions 16 --threads 2

`--dtype bfloat16 --compile` drafts as `bench --compile` does on a CPU with AVX-512 BF16 (the head's products
through eaglespec's kernels, int8 copies unless EAGLESPEC_DRAFT_INT8=0); the reference's answers stay the targets.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from eaglespec import Engine, TreeSettings
from eaglespec.bench.datasets import load_questions
from eaglespec.drafters.autotree import record_candidates

SETTINGS = ((2, 1, 1), (3, 2, 1), (3, 1, 2), (4, 2, 4), (6, 2, 4), (6, 3, 4), (8, 3, 4), (16, 5, 4), (24, 6, 6),
            (32, 6, 8), (48, 7, 8), (60, 6, 10), (60, 8, 10), (64, 10, 10))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reference", required=True, help="bench folder with vanilla rows (greedy answers, turn 1)")
    p.add_argument("--head", required=True)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dataset", default="mt-bench")
    p.add_argument("--questions", type=int, default=16, help="spread evenly over the reference's questions")
    p.add_argument("--stride", type=int, default=2, help="draft at every N-th answer position")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--compile", action="store_true")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    rows = [json.loads(line) for line in (Path(args.reference) / "results.jsonl").read_text().splitlines()]
    answers = {r["question_id"]: r for r in rows if r["method"] == "vanilla" and r["turn"] == 1}
    questions = [q for q in load_questions(args.dataset) if q.question_id in answers]
    questions = questions[:: max(1, len(questions) // args.questions)][: args.questions]
    engine = Engine(model=args.model, head=args.head, method="eagle2", dtype=args.dtype,
                    compile=args.compile, tree=TreeSettings())
    sequences = []
    for q in questions:
        ids = engine.encode([{"role": "user", "content": q.turns[0]}])
        row = answers[q.question_id]
        if len(ids) != row["prompt_tokens"]:
            raise SystemExit(f"question {q.question_id}: {len(ids)} prompt tokens here, {row['prompt_tokens']} in "
                             "the reference (another model, template or system prompt?)")
        sequences.append((ids + row["tokens"], len(ids)))
    rounds, _ = record_candidates(engine.drafter, engine.target, sequences, stride=args.stride, depth=10, top_k=10,
                                  progress=True)
    print(f"{args.head}: {len(questions)} questions, {len(rounds)} positions\n")
    print("| total_tokens | depth | top_k | replayed tau |\n|---|---|---|---|")
    for total, depth, top_k in SETTINGS:
        tau = sum(r.accepted_length(total, depth, top_k) for r in rounds) / len(rounds)
        print(f"| {total} | {depth} | {top_k} | {tau:.3f} |")


if __name__ == "__main__":
    main()
