"""The benchmark run: every method on every prompt, in one process, written to `DIR/results.jsonl` as it goes.

Order: for each question, for each turn, every method in turn (vanilla first), `repeats` timed runs each. Each
method gets one untimed warm-up generation first. Turn 2 and later carry the model's own earlier answers in
the chat history: vanilla's answer, so that every method sees the very same prompt tokens.

A run of hours can stop and go on (`resume`): the prompts all of whose methods are recorded are kept, any other
rows are dropped, and the rest run, so that a prompt's methods are always timed side by side in one process. Only
the same code on the same kind of machine continues a run (git commit, package versions, CPU, threads).
`run.json` lists the segments (when each started, on what machine).
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
from .base import BenchMethod, RunOutput, Sampling
from .datasets import Question
from .machine import PeakMemory, describe_machine
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
    return out, out.peak_rss_mb if out.peak_rss_mb is not None else memory.peak_mb()


# Run settings that must be the same for a reused vanilla baseline (`--reference`) to describe the same prompts.
REFERENCE_KEYS = ("dataset", "max_new_tokens", "sampling", "system")
REFERENCE_SETTINGS = ("model", "device", "dtype", "backend", "quantize", "activations")
SETTING_DEFAULTS = {"device": "cpu", "activations": "bfloat16"}  # what runs recorded before the setting existed used


def load_reference(folder: str | Path, config: BenchConfig) -> dict[tuple, dict]:
    """Vanilla's rows of an earlier bench folder, keyed by (question_id, turn), after checking that the run used
    the same prompts and target settings as `config`."""
    folder = Path(folder)
    try:
        info = json.loads((folder / RUN_INFO).read_text())
        rows = [json.loads(line) for line in (folder / RESULTS).read_text().splitlines() if line.strip()]
    except (OSError, json.JSONDecodeError) as exc:
        raise EagleSpecError(f"--reference '{folder}' is not a readable bench folder ({exc})") from exc
    ours = {"dataset": config.dataset, "max_new_tokens": config.max_new_tokens, "sampling": asdict(config.sampling),
            "system": config.system}
    differ = [k for k in REFERENCE_KEYS if info.get(k) != ours[k]]
    theirs, mine = ({**SETTING_DEFAULTS, **settings} for settings in (info.get("settings", {}), config.settings))
    differ += [k for k in REFERENCE_SETTINGS if theirs.get(k) != mine.get(k)]
    if differ:
        raise EagleSpecError(f"--reference '{folder}' was run with other settings: {', '.join(differ)}; "
                             "run vanilla again (drop --reference) or match them")
    return {(r["question_id"], r["turn"]): r for r in rows if r.get("method") == "vanilla"}


# What an interrupted run and the run that resumes it must share (run.json keys; and of its "machine": these, and the
# package versions it lists, so that no run's figures or answers mix two versions of the code or two machines).
RESUME_KEYS = ("dataset", "questions", "prompts", "max_new_tokens", "sampling", "repeats", "system", "settings",
               "methods", "reference")
RESUME_MACHINE_KEYS = ("git_commit", "cpu", "cpu_count", "torch_threads")


def _resumable(out_dir: Path, info: dict, methods: list[BenchMethod]) -> tuple[list[dict], list[dict]]:
    """For `resume`: the earlier segments of the run in `out_dir` and the rows of its complete prompts (every
    method recorded), after checking that it is the same run as `info` describes."""
    try:
        before = json.loads((out_dir / RUN_INFO).read_text())
        lines = (out_dir / RESULTS).read_text(encoding="utf-8").splitlines()
    except (OSError, json.JSONDecodeError) as exc:
        raise EagleSpecError(f"--resume: '{out_dir}' holds no bench run to continue ({exc}); drop --resume") from exc
    differ = [k for k in RESUME_KEYS if before.get(k) != json.loads(json.dumps(info[k]))]  # (as run.json holds it)
    if differ:
        raise EagleSpecError(f"--resume: the run in '{out_dir}' was started with other settings ({', '.join(differ)});"
                             " resume it with its own command (run.json) or pick another --out")
    then, now = before.get("machine") or {}, info["machine"]
    changed = [f"{k} {then.get(k)!r} -> {now.get(k)!r}" for k in RESUME_MACHINE_KEYS if then.get(k) != now.get(k)]
    changed += [f"{k} {v!r} -> {now['versions'].get(k)!r}" for k, v in (then.get("versions") or {}).items()
                if now["versions"].get(k) != v]
    if changed:
        raise EagleSpecError(f"--resume: the run in '{out_dir}' was made with other code or on another machine "
                             f"({'; '.join(changed)}): its figures would mix the two; continue it where it was made "
                             "(e.g. `git checkout` its commit) or start a new run")
    rows = []
    for line in lines:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # (a line cut off when the run was stopped)
            continue
    names = {m.name for m in methods}
    recorded: dict[tuple, set[str]] = {}
    for r in rows:
        recorded.setdefault((r["question_id"], r["turn"]), set()).add(r["method"])
    complete = {key for key, got in recorded.items() if got >= names}
    segments = before.get("segments") or [{k: before.get(k) for k in ("started", "command", "machine")}]
    return segments, [r for r in rows if (r["question_id"], r["turn"]) in complete]


def run_benchmark(methods: list[BenchMethod], questions: list[Question], encode: Encoder, decode: Decoder,
                  config: BenchConfig, out_dir: str | Path, progress: bool = True,
                  command: list[str] | None = None, reference: str | Path | None = None,
                  resume: bool = False) -> Path:
    """Run and record the benchmark; returns the results file. `methods[0]` must be vanilla. With `reference`
    (an earlier bench folder with the same prompts and target settings), vanilla's rows are taken from there
    instead of being run again: its answers still check every other method, but speedups then compare runs
    made at different times. `resume`: continue the run already in `out_dir` (module docstring)."""
    if not methods or methods[0].name != "vanilla":
        raise EagleSpecError("the benchmark needs vanilla as its first method (the speedup denominator)")
    if config.repeats < 1 or config.warmup < 0:
        raise EagleSpecError("--repeats must be at least 1 and --warmup at least 0")
    stored = None if reference is None else load_reference(reference, config)
    if stored is not None:
        missing = [(q.question_id, t) for q in questions for t in range(1, len(q.turns) + 1)
                   if (q.question_id, t) not in stored]
        if missing:
            raise EagleSpecError(f"--reference '{reference}' has no vanilla answer for question {missing[0][0]} "
                                 f"turn {missing[0][1]} ({len(missing)} missing)")
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
                   "ru_maxrss": "process-wide peak resident set since start (getrusage ru_maxrss)"}[memory.method]
                  + ("; peers run in their own processes: theirs (VmHWM of the peer's processes, reset before each run)"
                     if any(getattr(m, "process", None) is not None for m in methods) else ""),
        "token_counting": "new tokens up to and including the first end-of-sequence token",
        "machine": describe_machine(),
        "reference": None if reference is None else str(reference),
    }
    results = out_dir / RESULTS
    kept: dict[tuple, list[dict]] = {}  # (question_id, turn) -> the rows of a prompt an earlier segment completed
    segment = {"started": info["started"], "command": info["command"], "machine": info["machine"]}
    if resume:
        segments, rows = _resumable(out_dir, info, methods)
        info["segments"] = segments + [segment]
        info["started"] = segments[0]["started"]
        for r in rows:
            kept.setdefault((r["question_id"], r["turn"]), []).append(r)
        tmp = results.with_suffix(".tmp")  # the complete prompts' rows only, then the rest appended
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        tmp.replace(results)
    else:
        info["segments"] = [segment]
    (out_dir / RUN_INFO).write_text(json.dumps(info, indent=2) + "\n")
    run_methods = methods if stored is None else methods[1:]
    todo = info["prompts"] - len(kept)
    total = len(run_methods) * ((config.warmup if todo else 0) + config.repeats * todo)
    bar = tqdm(total=total, desc="bench", unit="run", disable=not progress, dynamic_ncols=True)
    try:
        warm_ids = encode(_messages(questions[0], 1, [], config.system))
        for m in run_methods if todo else []:
            for _ in range(config.warmup):
                bar.set_postfix_str(f"warm-up {m.name}")
                m.generate(warm_ids, min(WARMUP_TOKENS, config.max_new_tokens), config.sampling)
                bar.update()
        with results.open("a" if resume else "w", encoding="utf-8") as f:
            for qi, q in enumerate(questions):
                answers: list[str] = []
                for turn in range(1, len(q.turns) + 1):
                    done = kept.get((q.question_id, turn))
                    if done is not None:  # timed in an earlier segment: its vanilla answer carries the chat on
                        answers.append(decode(next(r for r in done if r["method"] == methods[0].name)["tokens"]))
                        continue
                    ids = encode(_messages(q, turn, answers, config.system))
                    seed = None if config.sampling.seed is None else config.sampling.seed + 1000 * qi + turn
                    reference_tokens, base_speed = None, None
                    for m in methods:
                        if m is methods[0] and stored is not None:
                            row = _reused_row(stored[(q.question_id, turn)], len(ids), reference)
                            reference_tokens, base_speed = row["tokens"], row["tokens_per_s"]
                            answers.append(decode(reference_tokens))
                            f.write(json.dumps(row) + "\n")
                            continue
                        bar.set_postfix_str(f"q {q.question_id} turn {turn} {m.name}")
                        runs, peaks = [], []
                        for _ in range(config.repeats):
                            out, peak = _timed(m, ids, config, seed, memory)
                            runs.append(out)
                            peaks.append(peak)
                            bar.update()
                        if m is methods[0]:
                            reference_tokens = runs[0].tokens
                        row = make_row(m, q, turn, len(ids), runs, peaks, reference_tokens, config.sampling.greedy)
                        if m is methods[0]:
                            base_speed = row["tokens_per_s"]
                            answers.append(decode(reference_tokens))
                        row["speedup"] = row["tokens_per_s"] / base_speed if base_speed else None
                        f.write(json.dumps(row) + "\n")
                        f.flush()
    finally:
        bar.close()
    return results


def _reused_row(row: dict, prompt_tokens: int, reference: str | Path) -> dict:
    if row["prompt_tokens"] != prompt_tokens:
        raise EagleSpecError(f"--reference '{reference}': question {row['question_id']} turn {row['turn']} had "
                             f"{row['prompt_tokens']} prompt tokens, this run has {prompt_tokens}: the prompts differ")
    return dict(row, reused_from=str(reference))
