"""Benchmark rows: building one per (method, prompt), reading them back, and aggregating them.

A row is one method on one prompt (one turn of one question), over `repeats` timed runs. The representative run
is the one with the median tokens/s; its counts, tau and time split fill the row, and every run's wall time is
kept for the spread.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from ..errors import EagleSpecError
from .base import RunOutput
from .datasets import parse_json_line

REQUIRED_FIELDS = {
    "method": str, "variant": str, "kind": str, "question_id": (str, int), "category": str, "turn": int,
    "new_tokens": int, "wall_time": (int, float), "tokens_per_s": (int, float),
}
OPTIONAL_NUMBER_FIELDS = ("tau", "speedup", "target_forwards", "drafted_forwards", "draft_time", "verify_time",
                          "prefill_time", "peak_rss_mb", "wall_time_min", "wall_time_max", "draft_forwards",
                          "stage2_guessed", "stage2_accepted", "weight_bytes", "target_weight_bytes")


def representative(runs: list[RunOutput]) -> int:
    """Index of the run with the median tokens/s (the lower middle one for an even count)."""
    speeds = [len(r.tokens) / r.wall_time if r.wall_time > 0 else 0.0 for r in runs]
    order = sorted(range(len(runs)), key=lambda i: speeds[i])
    return order[(len(order) - 1) // 2]


def first_mismatch(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (or the shorter length when one is a prefix of the other), None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def make_row(method, question, turn: int, prompt_tokens: int, runs: list[RunOutput], peaks_mb: list[float],
             reference: list[int] | None, greedy: bool) -> dict:
    """One JSONL row. `reference`: vanilla's tokens for this prompt (the equality check, greedy runs only)."""
    rep = runs[representative(runs)]
    walls = [r.wall_time for r in runs]
    n = len(rep.tokens)
    row = {
        "method": method.method,
        "variant": method.name,
        "kind": method.kind,
        "question_id": question.question_id,
        "category": question.category,
        "turn": turn,
        "prompt_tokens": prompt_tokens,
        "new_tokens": n,
        "wall_time": rep.wall_time,
        "wall_time_median": statistics.median(walls),
        "wall_time_min": min(walls),
        "wall_time_max": max(walls),
        "wall_times": walls,
        "tokens_per_s": n / rep.wall_time if rep.wall_time > 0 else 0.0,
        "speedup": None,  # filled by the runner once vanilla's row for this prompt is known
        "tau": rep.tau,
        "target_forwards": rep.target_forwards,
        "drafted_forwards": rep.drafted_forwards,
        "accept_lengths": rep.accept_lengths,
        "drafted_per_depth": rep.drafted_per_depth,
        "accepted_per_depth": rep.accepted_per_depth,
        "acceptance_per_depth": None if rep.drafted_per_depth is None else [
            a / d if d else 0.0 for a, d in zip(rep.accepted_per_depth, rep.drafted_per_depth)],
        "prefill_time": rep.prefill_time,
        "draft_time": rep.draft_time,
        "verify_time": rep.verify_time,
        "peak_rss_mb": max(peaks_mb) if peaks_mb else None,
        "draft_forwards": rep.draft_forwards,
        "stage2_guessed": rep.stage2_guessed,
        "stage2_accepted": rep.stage2_accepted,
        "weight_bytes": rep.weight_bytes,
        "target_weight_bytes": rep.target_weight_bytes,
        "sweep": method.sweep,
        "equal_to_vanilla": None,
        "first_mismatch": None,
        "repeats_identical": all(r.tokens == runs[0].tokens for r in runs),
        "tokens": rep.tokens,
    }
    if greedy and reference is not None:
        mismatches = [first_mismatch(r.tokens, reference) for r in runs]
        bad = [m for m in mismatches if m is not None]
        row["equal_to_vanilla"] = not bad
        row["first_mismatch"] = min(bad) if bad else None
    return row


def read_rows(path: str | Path) -> list[dict]:
    """Rows of a results.jsonl file; a malformed line is an error naming its number."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise EagleSpecError(f"could not read '{path}': {exc}") from exc
    rows = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        row = parse_json_line(path, number, line)
        for name, kind in REQUIRED_FIELDS.items():
            if name not in row:
                raise EagleSpecError(f"{path} line {number}: missing field '{name}'")
            if not isinstance(row[name], kind) or isinstance(row[name], bool):
                raise EagleSpecError(f"{path} line {number}: field '{name}' has the wrong type ({row[name]!r})")
        for name in OPTIONAL_NUMBER_FIELDS:
            value = row.get(name)
            if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)):
                raise EagleSpecError(f"{path} line {number}: field '{name}' must be a number or null")
        if row["wall_time"] < 0 or row["new_tokens"] < 0:
            raise EagleSpecError(f"{path} line {number}: negative wall_time or new_tokens")
        rows.append(row)
    if not rows:
        raise EagleSpecError(f"'{path}' holds no result rows")
    return rows


@dataclass
class Summary:
    """Aggregate of a group of rows (one variant, optionally one category)."""

    variant: str
    method: str
    kind: str
    prompts: int
    new_tokens: int
    wall_time: float
    tokens_per_s: float
    tokens_per_s_low: float  # with every prompt at its slowest repeat
    tokens_per_s_high: float  # with every prompt at its fastest repeat
    speedup: float | None
    tau: float | None
    equal: int | None  # prompts equal to vanilla (greedy runs)
    compared: int  # prompts with an equality verdict
    acceptance_per_depth: list[float] | None
    draft_share: float | None  # fraction of wall time spent drafting
    verify_share: float | None  # verify forwards, prefill included
    peak_rss_mb: float | None
    sweep: dict | None
    draft_forwards_per_pass: float | None = None  # draft-model or head forwards per target forward
    stage2_acceptance: float | None = None  # staged: share of stage-2 guesses the draft model agreed with
    traffic: float | None = None  # weights read per token, as a share of plain decoding's (GenerationStats)


def _sum(values: Iterable[float | None]) -> float | None:
    values = list(values)
    return None if any(v is None for v in values) else float(sum(values))


def summarise(rows: list[dict], variant: str, baseline: dict[tuple, dict] | None) -> Summary:
    """Aggregate `rows` (all of one variant). Tokens/s is total tokens over total time; speedup compares with
    vanilla's rows for the same prompts (`baseline`: (question_id, turn) -> vanilla row); tau is weighted by
    target forwards (tokens per forward over the whole group)."""
    tokens = sum(r["new_tokens"] for r in rows)
    wall = sum(r["wall_time"] for r in rows)
    slow = sum(r.get("wall_time_max", r["wall_time"]) for r in rows)
    fast = sum(r.get("wall_time_min", r["wall_time"]) for r in rows)
    speedup = None
    if baseline is not None:
        base = [baseline.get((r["question_id"], r["turn"])) for r in rows]
        if base and all(b is not None for b in base):
            base_tokens = sum(b["new_tokens"] for b in base)
            base_wall = sum(b["wall_time"] for b in base)
            if base_wall > 0 and base_tokens > 0 and wall > 0:
                speedup = (tokens / wall) / (base_tokens / base_wall)
    tau = None
    if all(r.get("tau") is not None and r.get("target_forwards") is not None for r in rows):
        forwards = sum(r["target_forwards"] for r in rows)
        tau = sum(r["tau"] * r["target_forwards"] for r in rows) / forwards if forwards else 1.0
    verdicts = [r.get("equal_to_vanilla") for r in rows if r.get("equal_to_vanilla") is not None]
    acceptance = None
    if all(r.get("drafted_per_depth") is not None for r in rows):
        depth = max((len(r["drafted_per_depth"]) for r in rows), default=0)
        drafted, accepted = [0] * depth, [0] * depth
        for r in rows:
            for i, (d, a) in enumerate(zip(r["drafted_per_depth"], r["accepted_per_depth"])):
                drafted[i] += d
                accepted[i] += a
        acceptance = [a / d if d else 0.0 for a, d in zip(accepted, drafted)]
    draft = _sum(r.get("draft_time") for r in rows)
    verify = _sum((r.get("verify_time") or 0.0) + (r.get("prefill_time") or 0.0)
                  if r.get("verify_time") is not None else None for r in rows)
    peaks = [r["peak_rss_mb"] for r in rows if r.get("peak_rss_mb") is not None]
    forwards = _sum(r.get("target_forwards") for r in rows)
    drafts = _sum(r.get("draft_forwards") for r in rows)
    guessed, agreed = _sum(r.get("stage2_guessed") for r in rows), _sum(r.get("stage2_accepted") for r in rows)
    read = _sum(r.get("weight_bytes") for r in rows)
    plain = _sum(None if r.get("target_weight_bytes") is None  # one target forward a token after the prefill's
                 else max(r["new_tokens"] - 1, 0) * r["target_weight_bytes"] for r in rows)
    return Summary(
        variant=variant, method=rows[0]["method"], kind=rows[0]["kind"], prompts=len(rows), new_tokens=tokens,
        wall_time=wall, tokens_per_s=tokens / wall if wall > 0 else 0.0,
        tokens_per_s_low=tokens / slow if slow > 0 else 0.0, tokens_per_s_high=tokens / fast if fast > 0 else 0.0,
        speedup=speedup, tau=tau, equal=sum(verdicts) if verdicts else None, compared=len(verdicts),
        acceptance_per_depth=acceptance,
        draft_share=None if draft is None or wall <= 0 else draft / wall,
        verify_share=None if verify is None or wall <= 0 else verify / wall,
        peak_rss_mb=max(peaks) if peaks else None, sweep=rows[0].get("sweep"),
        draft_forwards_per_pass=None if drafts is None or not forwards else drafts / forwards,
        stage2_acceptance=None if not guessed else agreed / guessed,
        traffic=None if read is None or not plain else read / plain,
    )


def group(rows: list[dict], key) -> dict:
    """Rows grouped by key(row), groups in order of first appearance."""
    out: dict = {}
    for r in rows:
        out.setdefault(key(r), []).append(r)
    return out


def vanilla_index(rows: list[dict]) -> dict[tuple, dict] | None:
    base = {(r["question_id"], r["turn"]): r for r in rows if r["variant"] == "vanilla"}
    return base or None


# A peer's speculative method and the same engine's plain decoding. Greedy, lossless speculation inside that engine
# gives its plain answers, whatever they are against ours (the peers run other arithmetic than ours).
ENGINE_PLAIN = {"vllm-ngram": "vllm", "vllm-draft": "vllm", "vllm-eagle3": "vllm", "openvino-draft": "openvino",
                "hf-pld": "hf", "hf-assisted": "hf"}


@dataclass
class EngineAgreement:
    variant: str  # the speculative peer method
    plain: str  # its engine's plain decoding
    equal: int  # prompts whose answers are equal
    compared: int  # prompts both ran, greedy
    first_mismatch: int | None  # the earliest token where an answer parted, None if none did


def engine_agreement(rows: list[dict]) -> list[EngineAgreement]:
    """Each speculative peer's greedy answers against its own engine's plain ones on the same prompts (rows of a
    run that holds both; greedy rows are those with an `equal_to_vanilla` verdict)."""
    plain_rows = {(r["variant"], r["question_id"], r["turn"]): r for r in rows
                  if r["variant"] in ENGINE_PLAIN.values() and r.get("equal_to_vanilla") is not None}
    out = []
    for variant, rs in group([r for r in rows if r["variant"] in ENGINE_PLAIN], lambda r: r["variant"]).items():
        plain = ENGINE_PLAIN[variant]
        pairs = [(r, plain_rows.get((plain, r["question_id"], r["turn"]))) for r in rs
                 if r.get("equal_to_vanilla") is not None]
        pairs = [(r, p) for r, p in pairs if p is not None]
        if not pairs:
            continue
        parted = [m for m in (first_mismatch(r["tokens"], p["tokens"]) for r, p in pairs) if m is not None]
        out.append(EngineAgreement(variant, plain, len(pairs) - len(parted), len(pairs),
                                   min(parted) if parted else None))
    return out
