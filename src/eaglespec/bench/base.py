"""The benchmark's common types: sampling settings, one timed generation (`RunOutput`), the `BenchMethod` interface
and `LoopMethod`, one of our methods through an `Engine` (eaglespec.bench.methods builds them; eaglespec.bench.oracle
adds the ceiling's variants)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class Sampling:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0


@dataclass
class RunOutput:
    """One timed generation."""

    tokens: list[int]  # new tokens, up to and including the first EOS
    wall_time: float  # seconds, whole call
    tau: float | None = None  # tokens per target forward (bonus included); None when the method cannot tell
    target_forwards: int | None = None
    drafted_forwards: int | None = None  # target forwards of a drafted tree (adaptive variants also run plain ones)
    drafted_per_depth: list[int] | None = None
    accepted_per_depth: list[int] | None = None
    accept_lengths: list[int] | None = None
    prefill_time: float | None = None
    draft_time: float | None = None
    verify_time: float | None = None
    peak_rss_mb: float | None = None  # a method run in another process: that process's peak (else the bench's)
    draft_forwards: int | None = None  # forwards of the draft model or head
    stage2_guessed: int | None = None  # staged: stage-2 tokens proposed to the draft model
    stage2_accepted: int | None = None  # of them, those the draft model agreed with
    weight_bytes: int | None = None  # weights read by the verify and draft forwards (GenerationStats)
    target_weight_bytes: int | None = None  # weights one target forward reads


@dataclass
class BenchMethod:
    """A named way to generate. `name` labels rows (e.g. "eagle2" or "eagle2@total_tokens=8" in a sweep);
    `method` is the base method; `settings` describes its configuration for the run record."""

    name: str
    method: str
    kind: str  # "ours" or "peer"
    settings: dict = field(default_factory=dict)
    sweep: dict | None = None  # {tree key: value} for sweep variants

    def generate(self, prompt_ids: list[int], max_new_tokens: int, sampling: Sampling) -> RunOutput:
        raise NotImplementedError


def cut_after_eos(tokens: list[int], eos: set[int]) -> list[int]:
    for i, tok in enumerate(tokens):
        if tok in eos:
            return tokens[: i + 1]
    return tokens


class LoopMethod(BenchMethod):
    """One of our methods: an `Engine` around the shared model."""

    def __init__(self, name: str, method: str, engine, settings: dict, sweep: dict | None = None, drafter=None,
                 record_answers: dict | None = None):
        """`drafter`: this variant's drafter in the engine's loop (default: the engine's own), e.g. the adaptive
        one over the same EAGLE drafter, so variants share one compiled target. `record_answers`: where greedy
        answers are kept, keyed by (prompt ids, max_new_tokens) (vanilla's, for the oracle)."""
        super().__init__(name, method, "ours", settings, sweep)
        self.engine, self.drafter = engine, drafter or engine.drafter
        self.record_answers = record_answers

    def generate(self, prompt_ids: list[int], max_new_tokens: int, sampling: Sampling) -> RunOutput:
        self.engine.decoder.drafter = self.drafter
        t0 = time.perf_counter()
        result = self.engine.generate(list(prompt_ids), max_new_tokens=max_new_tokens,
                                      temperature=sampling.temperature, top_p=sampling.top_p,
                                      top_k=sampling.top_k, seed=sampling.seed)
        wall = time.perf_counter() - t0
        s = result.stats
        if self.record_answers is not None and sampling.greedy:
            self.record_answers[(tuple(prompt_ids), max_new_tokens)] = list(result.tokens)
        return RunOutput(tokens=list(result.tokens), wall_time=wall, tau=s.tau, target_forwards=s.target_forwards,
                         drafted_forwards=s.drafted_forwards,
                         drafted_per_depth=list(s.drafted_per_depth), accepted_per_depth=list(s.accepted_per_depth),
                         accept_lengths=list(s.accept_lengths), prefill_time=s.prefill_time,
                         draft_time=s.draft_time, verify_time=s.verify_time, draft_forwards=s.draft_forwards,
                         stage2_guessed=s.stage2_guessed, stage2_accepted=s.stage2_accepted,
                         weight_bytes=s.weight_bytes, target_weight_bytes=s.target_weight_bytes or None)
