"""Replays the context lookup (`drafters.lookup.find_continuation`, the second stage of `staged` and of an EAGLE head's
`--extend` guesses, and `pld`) over a bench folder's plain-decoding answers, for several longest / shortest n-gram
sizes, without running a model: at every `--every`-th position of each answer, the lookup over the prompt and the
answer so far guesses up to `--guesses` tokens, scored against what the answer really says next.

    python benchmarks/tools/lookup_replay.py benchmarks/runs/2026-12-07-zen5-1.5b-humaneval-164-screen16 \
        [--dataset humaneval] [--model qwen2.5-coder-1.5b] [--sizes 3-1,6-1,8-1,12-1,8-2,12-2] [--guesses 8]

The folder must hold `vanilla` rows (their `tokens`) and come from `--dataset` (first turns; the prompts are rebuilt
with the model's chat template, as `bench` builds them). Prints, per size, the guessed tokens that matched a position
(the prefix of the guesses equal to the answer), the tokens guessed a position, and their ratio (precision). Plain
decoding's answer stands in for the draft model's greedy chain, which it mostly equals.
"""

import argparse
import json
from pathlib import Path

import torch
from tqdm import tqdm

from eaglespec.bench.datasets import load_questions
from eaglespec.drafters.lookup import find_continuation
from eaglespec.models import load_tokenizer

p = argparse.ArgumentParser()
p.add_argument("folder", type=Path)
p.add_argument("--dataset", default="humaneval")
p.add_argument("--model", default="qwen2.5-coder-1.5b")
p.add_argument("--sizes", default="3-1,6-1,8-1,12-1,8-2,12-2", help="longest-shortest n-gram pairs")
p.add_argument("--guesses", type=int, default=8)
p.add_argument("--every", type=int, default=3)
args = p.parse_args()

tokenizer, _ = load_tokenizer(args.model)
questions = {q.question_id: q for q in load_questions(args.dataset)}
rows = [json.loads(line) for line in (args.folder / "results.jsonl").open()]
rows = [r for r in rows if r["method"] == "vanilla" and r.get("turn", 1) == 1]
if not rows:
    raise SystemExit(f"{args.folder}/results.jsonl has no first-turn vanilla rows")
sizes = [tuple(int(v) for v in s.split("-")) for s in args.sizes.split(",")]
totals = {size: [0, 0, 0] for size in sizes}  # matched, guessed, positions
for row in tqdm(rows, desc="answers", unit="answer"):
    messages = [{"role": "user", "content": questions[row["question_id"]].turns[0]}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    sequence = torch.tensor(prompt + row["tokens"])
    for position in range(len(prompt), sequence.numel() - 1, args.every):
        truth = sequence[position : position + args.guesses].tolist()
        for size in sizes:
            guess = find_continuation(sequence[:position], size[0], size[1], args.guesses)
            matched = 0
            while matched < min(len(guess), len(truth)) and guess[matched] == truth[matched]:
                matched += 1
            total = totals[size]
            total[0] += matched
            total[1] += len(guess)
            total[2] += 1
print(f"{len(rows)} answers of {args.folder}, up to {args.guesses} guesses at every {args.every}rd position")
print("| longest-shortest n-gram | matched a position | guessed a position | precision |")
print("|---|---|---|---|")
for (longest, shortest), (matched, guessed, positions) in totals.items():
    print(f"| {longest}-{shortest} | {matched / positions:.3f} | {guessed / positions:.2f} | {matched / max(guessed, 1):.3f} |")
