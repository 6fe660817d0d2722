"""Batched speculation against plain batched decoding at a steady batch width, the configurations stepped in turn.

    python benchmarks/microbench/batch_interleaved.py [--model qwen2.5-coder-1.5b] [--width 1,4,8,16] [--steps 200]
        [--threads 2] [--json FILE]

For each width B, three batch decoders over the same model (the engine's `BatchDecoder`, no server): `plain`
(`--method vanilla`), `never` (the model's default method with `speculate="never"`: the head loaded and fed, never
drafting) and `auto` (the default method, load-aware, as `serve` runs it). Each keeps B requests (MT-bench first
turns through the chat template, 128 new tokens, greedy) in its batch: a new one joins as soon as one finishes, so
prompts are read beside running sequences as on a busy server. The three take one step each in turn, so a drift of
the machine's speed (a 2-vCPU VM moves by 10% from one minute to the next) weighs on all three alike, which
`benchmarks/concurrency.py`, timing each configuration for minutes at a time, cannot ensure.

Reports per configuration and width: tokens per second over all steps (prompt steps included), the median decode
step (all B sequences decoding, no prompt rows) and its forward, the mean time of the rest of a step (drafting,
acceptance, bookkeeping), sequence steps drafted, and tokens/s against `plain`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from eaglespec.api import Engine
from eaglespec.bench.datasets import load_questions
from eaglespec.bench.machine import describe_machine


class Timed:
    """A batch decoder kept at `width` requests, its steps timed (`StepReport`)."""

    def __init__(self, engine: Engine, speculate: str, width: int, prompts: list[list[int]]):
        self.batch = engine.batch_decoder(width, speculate)
        self.width, self.prompts, self.sent = width, prompts, 0
        self.steps: list[tuple[int, int, int, float, float]] = []  # sequences, drafted, prompt rows, s, forward s
        self.tokens, self.seconds = 0, 0.0
        self.top_up()

    def top_up(self) -> None:
        b = self.batch
        while len(b.active) + len(b.prefilling) + len(b.waiting) < self.width:
            b.add(self.sent, self.prompts[self.sent % len(self.prompts)], max_new_tokens=128)
            self.sent += 1

    def step(self) -> None:
        t0 = time.perf_counter()
        self.batch.step()
        self.top_up()
        self.seconds += time.perf_counter() - t0
        r = self.batch.last_report
        self.tokens += r.tokens
        self.steps.append((r.sequences, r.drafted, r.prefill_rows, r.seconds, r.forward_seconds))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--width", default="1,4,8,16", help="comma-separated batch widths")
    p.add_argument("--steps", type=int, default=200, help="steps of each configuration per width")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    plain, spec = Engine(args.model, method="vanilla"), Engine(args.model)
    prompts = [list(plain.tokenizer.apply_chat_template([{"role": "user", "content": q.turns[0]}],
                                                        add_generation_prompt=True, tokenize=True, return_dict=False))
               for q in load_questions("mt-bench")]
    rows = []
    for width in (int(w) for w in args.width.split(",") if w.strip()):
        configs = {"plain": Timed(plain, "auto", width, prompts), "never": Timed(spec, "never", width, prompts),
                   "auto": Timed(spec, "auto", width, prompts)}
        for _ in tqdm(range(args.steps), desc=f"width {width}", file=sys.stderr):
            for timed in configs.values():
                timed.step()
        for name, timed in configs.items():
            decode = [s for s in timed.steps[args.steps // 10:] if s[0] == width and s[2] == 0]
            n_decode, decode = len(decode), decode or [(0, 0, 0, 0.0, 0.0)]
            rows.append({
                "width": width, "config": name, "steps": len(timed.steps),
                "tokens_per_s": round(timed.tokens / timed.seconds, 2),
                "decode_steps": n_decode,
                "median_decode_step_ms": round(1000 * statistics.median(s[3] for s in decode), 1),
                "median_decode_forward_ms": round(1000 * statistics.median(s[4] for s in decode), 1),
                "mean_decode_rest_ms": round(1000 * statistics.mean(s[3] - s[4] for s in decode), 2),
                "sequence_steps_drafted": sum(s[1] for s in timed.steps),
                "sequence_steps": sum(s[0] for s in timed.steps),
            })
        base = next(r["tokens_per_s"] for r in rows if r["width"] == width and r["config"] == "plain")
        for r in rows:
            if r["width"] == width:
                r["x_plain"] = round(r["tokens_per_s"] / base, 3)
        del configs
    print("| width | config | tokens/s | x plain | median decode step ms | its forward ms | rest ms | drafted |\n"
          "|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['width']} | {r['config']} | {r['tokens_per_s']} | {r['x_plain']} | {r['median_decode_step_ms']} | "
              f"{r['median_decode_forward_ms']} | {r['mean_decode_rest_ms']} | "
              f"{r['sequence_steps_drafted']} / {r['sequence_steps']} |")
    if args.json:
        command = "python benchmarks/microbench/batch_interleaved.py " + " ".join(argv or sys.argv[1:])
        args.json.write_text(json.dumps({"machine": describe_machine(), "model": args.model, "command": command,
                                         "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
