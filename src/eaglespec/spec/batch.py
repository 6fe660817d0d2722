"""Batched speculative decoding with continuous batching: many sequences, each with its own draft tree (or none),
verified together in one target forward per step.

A step of `BatchDecoder`:
1. admission: waiting requests take free slots of the target's pool (`targets.pool.TargetPool`: one KV cache per
   slot, shared weights); each new request's prompt is prefilled alone, as batch-1 decoding does it (at most
   `prefills_per_step` a step, so a long prompt stalls the running sequences for one prefill at most), and emits
   its first token;
2. planning: `spec.load.LoadPolicy` chooses which sequences draft this step, from the measured cost of rows at the
   current batch width and each sequence's recent acceptance (with `speculate="always"` all draft, "never" none);
3. drafting: each drafting sequence's own drafter grows its tree (its own state: a fork of the engine's drafter),
   pruned to the nodes worth their rows at this width; the others propose their root only;
4. verification: one target forward over every sequence's tree (ragged: each with its own size, positions and
   ancestor mask, attending over its own cache), then each sequence accepts its own path (`Sequence.accept`: the
   same greedy walk or lossless rejection sampling as batch-1 decoding, with its own random generator) and its
   slot commits those rows.
Finished sequences (EOS, stop string, length) and cancelled ones give their slot back at once; waiting requests
join at the next step.

Every sequence is decoded by the same `Sequence` state machine as `SpecDecoder` (spec/decode.py), so its tokens are
exactly those of batch-1 decoding wherever the batched forward gives each row the bits of its batch-1 step (the
pool's docstring says where), whatever the batch's composition and whoever joins or leaves.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Hashable, Iterator
from dataclasses import dataclass

import torch

from ..drafters import Drafter, VanillaDrafter
from ..errors import EagleSpecError
from .adaptive import DRAFT, PLAIN, AdaptiveDrafter
from .decode import Finished, Sequence, Step, check_request
from .load import LoadPolicy
from .tree import DraftTree
from .verify import SamplingParams, verify_sample

SPECULATE = ("auto", "always", "never")


class _Directed:
    """An `AdaptiveDrafter` policy whose mode the batch sets each step (the drafter keeps what it needs across
    plain steps: the target features it has not read)."""

    def __init__(self) -> None:
        self.mode = DRAFT

    def next_mode(self) -> str:
        return self.mode

    def observe(self, mode: str, tokens: int, seconds: float) -> None:
        """(The batch measures for itself.)"""


@dataclass
class StepReport:
    """What one batched step did (for metrics)."""

    sequences: int = 0  # sequences in the verify forward
    drafted: int = 0  # of them, those that drafted a tree
    rows: int = 0  # rows the target verified
    tokens: int = 0  # tokens emitted (prefills' first tokens included)
    prefills: int = 0  # requests admitted
    seconds: float = 0.0


class _Active:
    def __init__(self, key: Hashable, slot: int, seq: Sequence, drafter: AdaptiveDrafter, started: float):
        self.key, self.slot, self.seq, self.drafter, self.started = key, slot, seq, drafter, started


class BatchDecoder:
    """Continuous batching over a `TargetPool` (see the module docstring). Submit with `add`, drive with `step`
    (or `run`), stop one with `cancel`."""

    def __init__(self, pool, tokenizer, drafter: Drafter, eos_token_ids: list[int], speculate: str = "auto",
                 prefills_per_step: int = 1, sample_verifier=verify_sample, policy: LoadPolicy | None = None):
        """`pool`: a `targets.pool.TargetPool` (acquire, release, forward, pool[slot]). `drafter`: the engine's
        drafter (not an adaptive wrapper); each slot drafts with its own fork of it."""
        if speculate not in SPECULATE:
            raise EagleSpecError(f"speculate must be one of {', '.join(SPECULATE)}, got {speculate!r}")
        if prefills_per_step < 1:
            raise EagleSpecError(f"prefills_per_step must be at least 1, got {prefills_per_step}")
        self.pool, self.tokenizer, self.eos = pool, tokenizer, set(eos_token_ids)
        self.speculate = "never" if isinstance(drafter, VanillaDrafter) else speculate
        self.prefills_per_step, self.sample_verifier = prefills_per_step, sample_verifier
        settings = getattr(drafter, "settings", None)
        tree_rows = (settings.total_tokens - 1) if settings is not None else 1
        self.policy = policy or LoadPolicy(tree_rows=tree_rows)
        # one drafter per slot, gated by the batch's plan each step
        self.drafters = [AdaptiveDrafter(drafter.fork(), _Directed()) for _ in range(pool.size)]
        self.waiting: OrderedDict[Hashable, tuple] = OrderedDict()
        self.active: OrderedDict[Hashable, _Active] = OrderedDict()
        self.cancelled: set = set()  # requests cancelled since the last step began (`run` drops their events)
        self.last_report = StepReport()

    # ---- requests ----------------------------------------------------------------------------------------------
    def add(self, key: Hashable, prompt_ids: list[int], max_new_tokens: int = 256,
            sampling: SamplingParams | None = None, stop: list[str] | None = None) -> None:
        """Queue a request under `key` (unique among those not finished); it joins the batch when a slot frees."""
        if key in self.waiting or key in self.active:
            raise EagleSpecError(f"request {key!r} is already in the batch")
        check_request(len(prompt_ids), max_new_tokens, self.pool[0].max_context)
        self.waiting[key] = (list(prompt_ids), max_new_tokens, sampling or SamplingParams(), stop, time.perf_counter())

    def cancel(self, key: Hashable) -> bool:
        """Drop a waiting or running request; its slot is free at once. False when it is unknown (or finished)."""
        if self.waiting.pop(key, None) is not None:
            return True
        entry = self.active.pop(key, None)
        if entry is None:
            return False
        self._free(entry)
        self.cancelled.add(key)
        return True

    @property
    def busy(self) -> bool:
        """Whether anything is waiting or running."""
        return bool(self.waiting or self.active)

    def _free(self, entry: _Active) -> None:
        entry.drafter.reset()  # (a draft model's cache rows too)
        self.pool.release(entry.slot)
        self.policy.forget(entry.key)

    # ---- one step ----------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[tuple[Hashable, Step | Finished]]:
        """Admit, draft, verify and accept once; returns the events of this step in order: each request's `Step`,
        and a `Finished` after the last `Step` of a request that ended."""
        t_step = time.perf_counter()
        self.cancelled.clear()
        events: list[tuple[Hashable, Step | Finished]] = []
        report = StepReport()
        while self.waiting and self.pool.free and report.prefills < self.prefills_per_step:
            self._admit(events, report)
        if self.active:
            self._decode(events, report)
        report.seconds = time.perf_counter() - t_step
        self.last_report = report
        return events

    def _admit(self, events: list, report: StepReport) -> None:
        key, (prompt_ids, max_new_tokens, sampling, stop, arrived) = self.waiting.popitem(last=False)
        slot = self.pool.acquire()
        drafter = self.drafters[slot]
        drafter.reset()
        seq = Sequence(prompt_ids, max_new_tokens, sampling, self.tokenizer, stop, self.eos, drafter,
                       self.sample_verifier)
        target = self.pool[slot]
        t0 = time.perf_counter()
        try:
            out = target.forward(torch.tensor(prompt_ids), logits_rows=slice(-1, None), greedy=sampling.greedy)
            target.commit()
        except BaseException:  # (re-raised) the request is gone from the queue: its slot must not stay taken
            self.pool.release(slot)
            raise
        seq.start(out, time.perf_counter() - t0)
        entry = _Active(key, slot, seq, drafter, t0)
        report.prefills += 1
        self._emit(entry, events, report)
        if not seq.done:
            self.active[key] = entry

    def _emit(self, entry: _Active, events: list, report: StepReport) -> None:
        step = entry.seq.emit()
        report.tokens += len(step.tokens)
        events.append((entry.key, step))
        if entry.seq.done:
            events.append((entry.key, entry.seq.finish(time.perf_counter() - entry.started)))
            self._free(entry)

    def _decode(self, events: list, report: StepReport) -> None:
        t_round = time.perf_counter()
        entries = list(self.active.values())
        keys = [e.key for e in entries]
        if self.speculate == "auto":
            plan = self.policy.plan(keys)
            drafting = plan.draft
        else:
            plan, drafting = None, set(keys) if self.speculate == "always" else set()
        trees: list[DraftTree] = []
        draft_times: list[float] = []
        for e in entries:
            e.drafter.policy.mode = DRAFT if e.key in drafting else PLAIN
            target = self.pool[e.slot]
            t0 = time.perf_counter()
            tree = e.seq.draft(room=target.max_context - 1 - target.cache_len)
            seconds = time.perf_counter() - t0
            if e.key in drafting:
                self.policy.observe_draft(seconds)
                if plan is not None:
                    tree = self.policy.prune(e.key, tree, plan)
            trees.append(tree)
            draft_times.append(seconds)
        greedy = [e.seq.sampling.greedy for e in entries]  # greedy sequences' tokens as their batch-1 steps get them
        steps = [(e.slot, tree.tokens, tree.positions(self.pool[e.slot].cache_len),
                  tree.ancestor_mask() if len(tree) > 1 else None) for e, tree in zip(entries, trees)]
        t0 = time.perf_counter()
        outputs = self.pool.forward(steps, greedy=greedy)
        seconds = time.perf_counter() - t0
        rows = sum(len(t) for t in trees)
        self.policy.observe_step(rows, seconds)
        report.sequences, report.rows = len(entries), rows
        report.drafted = sum(len(t) > 1 for t in trees)
        for e, tree, out, t_draft in zip(entries, trees, outputs, draft_times):
            keep = e.seq.accept(tree, out)
            self.pool[e.slot].commit(keep)
            e.seq.timed(t_draft, seconds)
            self.policy.observe_sequence(e.key, tree, e.seq.accepted)
            self._emit(e, events, report)
            if e.seq.done:
                del self.active[e.key]
        self.policy.observe_round(len(entries), report.drafted, rows, time.perf_counter() - t_round)

    # ---- to completion -----------------------------------------------------------------------------------------
    def run(self) -> Iterator[tuple[Hashable, Step | Finished]]:
        """Step until nothing is waiting or running, yielding every event (none of a request after its `cancel`,
        even one its step made before)."""
        while self.busy:
            for key, event in self.step():
                if key not in self.cancelled:
                    yield key, event
