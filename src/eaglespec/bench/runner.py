"""The benchmark run: every method on every prompt, in one process, written to `DIR/results.jsonl` as it goes.

Order: for each question, for each turn, every method in turn (vanilla first), `repeats` timed runs each. Each
method gets one untimed warm-up generation first. Turn 2 and later carry the model's own earlier answers in
the chat history: vanilla's answer, so that every method sees the very same prompt tokens.
"""

from __future__ import annotations

import json
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm.auto import tqdm

from ..errors import EagleSpecError
from .datasets import Question
from .machine import PeakMemory, describe_machine
from .methods import BenchMethod, RunOutput, Sampling
from .metrics import make_row

RESULTS = "results.jsonl"
RUN_INFO = "run.json"
WARMUP_TOKENS = 16


@dataclass
class BenchConfig:
    dataset: str
    max_new_tokens: int = 128
    sampling: Sampling = field(default_factory=Sampling)
    repeats: int = 3
    warmup: int = 1
    system: str | None = None
    settings: dict = field(default_factory=dict)  # everything else worth recording (model, dtype, tree, ...)


Encoder = Callable[[list[dict]], list[int]]  # chat messages -> prompt token ids
Decoder = Callable[[list[int]], str]  # new token ids -> text


def _messages(question: Question, turn: int, answers: list[str], system: str | None) -> list[dict]:
    messages = [{"role": "system", "content": system}] if system else []
    for i in range(turn):
        messages.append({"role": "user", "content": question.turns[i]})
        if i < turn - 1:
            messages.append({"role": "assistant", "content": answers[i]})
    return messages


def _timed(method: BenchMethod, ids: list[int], config: BenchConfig, seed: int | None,
           memory: PeakMemory) -> tuple[RunOutput, float]:
    sampling = Sampling(config.sampling.temperature, config.sampling.top_p, config.sampling.top_k, seed)
    memory.start()
    out = method.generate(ids, config.max_new_tokens, sampling)
    return out, memory.peak_mb()


def run_benchmark(methods: list[BenchMethod], questions: list[Question], encode: Encoder, decode: Decoder,
                  config: BenchConfig, out_dir: str | Path, progress: bool = True,
                  command: list[str] | None = None) -> Path:
    """Run and record the benchmark; returns the results file. `methods[0]` must be vanilla."""
    if not methods or methods[0].name != "vanilla":
        raise EagleSpecError("the benchmark needs vanilla as its first method (the speedup denominator)")
    if config.repeats < 1 or config.warmup < 0:
        raise EagleSpecError("--repeats must be at least 1 and --warmup at least 0")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    memory = PeakMemory()
    info = {
        "command": shlex.join(command if command is not None else sys.argv),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "dataset": config.dataset,
        "questions": len(questions),
        "prompts": sum(len(q.turns) for q in questions),
        "max_new_tokens": config.max_new_tokens,
        "sampling": asdict(config.sampling),
        "greedy": config.sampling.greedy,
        "repeats": config.repeats,
        "warmup_runs": config.warmup,
        "system": config.system,
        "settings": config.settings,
        "methods": [{"name": m.name, "method": m.method, "kind": m.kind, "settings": m.settings} for m in methods],
        "memory": {"rss_hwm": "peak resident set (VmHWM) of the process, reset before each run",
                   "ru_maxrss": "process-wide peak resident set since start (getrusage ru_maxrss)"}[memory.method],
        "token_counting": "new tokens up to and including the first end-of-sequence token",
        "machine": describe_machine(),
    }
    (out_dir / RUN_INFO).write_text(json.dumps(info, indent=2) + "\n")
    results = out_dir / RESULTS
    total = len(methods) * (config.warmup + config.repeats * info["prompts"])
    bar = tqdm(total=total, desc="bench", unit="run", disable=not progress, dynamic_ncols=True)
    try:
        warm_ids = encode(_messages(questions[0], 1, [], config.system))
        for m in methods:
            for _ in range(config.warmup):
                bar.set_postfix_str(f"warm-up {m.name}")
                m.generate(warm_ids, min(WARMUP_TOKENS, config.max_new_tokens), config.sampling)
                bar.update()
        with results.open("w", encoding="utf-8") as f:
            for qi, q in enumerate(questions):
                answers: list[str] = []
                for turn in range(1, len(q.turns) + 1):
                    ids = encode(_messages(q, turn, answers, config.system))
                    seed = None if config.sampling.seed is None else config.sampling.seed + 1000 * qi + turn
                    reference, base_speed = None, None
                    for m in methods:
                        bar.set_postfix_str(f"q {q.question_id} turn {turn} {m.name}")
                        runs, peaks = [], []
                        for _ in range(config.repeats):
                            out, peak = _timed(m, ids, config, seed, memory)
                            runs.append(out)
                            peaks.append(peak)
                            bar.update()
                        if m is methods[0]:
                            reference = runs[0].tokens
                        row = make_row(m, q, turn, len(ids), runs, peaks, reference, config.sampling.greedy)
                        if m is methods[0]:
                            base_speed = row["tokens_per_s"]
                            answers.append(decode(reference))
                        row["speedup"] = row["tokens_per_s"] / base_speed if base_speed else None
                        f.write(json.dumps(row) + "\n")
                        f.flush()
    finally:
        bar.close()
    return results
