"""Batched speculative decoding with continuous batching: many sequences, each with its own draft tree (or none),
verified together in one target forward per step.

A step of `BatchDecoder`:
1. admission: waiting requests take free slots of the target's pool (`targets.pool.TargetPool`: one KV cache per
   slot, shared weights). Their prompts are read in pieces of at most `prefill_chunk` rows a step in all, riding in
   the step's forward beside the running sequences' trees (chunked prefill), so a long prompt never stalls the
   others for more than a piece; where the pool cannot cut a prompt without changing its bits
   (`pool.chunked_prefill`), prompts are read whole, at least one a step. When nothing else runs, prompts are read
   whole. A request emits its first token in the step that reads the last of its prompt. Where prompts are read in
   pieces, a prompt starting with the tokens of one read before (a chat template's system prompt) takes those rows
   from the prefix cache (spec/prefix.py) instead of reading them;
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

A prompt row gets the same bits whether its prompt was read whole or in pieces (targets.fast: the kernels' attention
is row-invariant for prompts too), so chunking changes no token.

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
from ..targets.hf import TargetOutput
from .adaptive import DRAFT, PLAIN, AdaptiveDrafter
from .decode import Finished, Sequence, Step, check_request
from .load import LoadPolicy
from .prefix import DEFAULT_BYTES, PrefixCache
from .tree import DraftTree
from .verify import SamplingParams, verify_sample

SPECULATE = ("auto", "always", "never")
PREFILL_CHUNK = 32  # prompt rows a step reads while other sequences decode (their step grows by about that many rows)
WHOLE_PROMPT_ROWS = 512  # prompt rows a step reads when nothing decodes (a bound on one call's square-sized masks)


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
    prefills: int = 0  # requests whose prompt was read to its end (each emitted its first token)
    prefill_rows: int = 0  # prompt rows the forward read
    prefix_rows: int = 0  # prompt rows of requests admitted this step taken from the prefix cache
    seconds: float = 0.0
    forward_seconds: float = 0.0  # of them, the target's forward


class _Active:
    def __init__(self, key: Hashable, slot: int, seq: Sequence, drafter: AdaptiveDrafter, started: float):
        self.key, self.slot, self.seq, self.drafter, self.started = key, slot, seq, drafter, started
        self.prompt = torch.tensor(seq.prompt_ids)  # [P]
        self.read = 0  # prompt rows in the slot's cache
        self.pieces: list[TargetOutput] = []  # the target features of those rows, piece by piece (EAGLE heads)


class BatchDecoder:
    """Continuous batching over a `TargetPool` (see the module docstring). Submit with `add`, drive with `step`
    (or `run`), stop one with `cancel`."""

    def __init__(self, pool, tokenizer, drafter: Drafter, eos_token_ids: list[int], speculate: str = "auto",
                 prefill_chunk: int = PREFILL_CHUNK, sample_verifier=verify_sample, policy: LoadPolicy | None = None,
                 prefix_cache_bytes: int = DEFAULT_BYTES):
        """`pool`: a `targets.pool.TargetPool` (acquire, release, forward, pool[slot], chunked_prefill).
        `drafter`: the engine's drafter (not an adaptive wrapper); each slot drafts with its own fork of it.
        `prefill_chunk`: prompt rows a step reads, in all, while other sequences decode (module docstring).
        `prefix_cache_bytes`: the budget of the prefix cache's stored rows (0: none; only where prompts are read in
        pieces)."""
        if speculate not in SPECULATE:
            raise EagleSpecError(f"speculate must be one of {', '.join(SPECULATE)}, got {speculate!r}")
        if not isinstance(prefill_chunk, int) or prefill_chunk < 1:
            raise EagleSpecError(f"prefill_chunk must be a positive number of prompt rows, got {prefill_chunk!r}")
        self.pool, self.tokenizer, self.eos = pool, tokenizer, set(eos_token_ids)
        self.speculate = "never" if isinstance(drafter, VanillaDrafter) else speculate
        self.prefill_chunk, self.sample_verifier = prefill_chunk, sample_verifier
        self.chunked = bool(getattr(pool, "chunked_prefill", False))
        self.prefixes = PrefixCache(prefix_cache_bytes) if self.chunked and prefix_cache_bytes > 0 else None
        settings = getattr(drafter, "settings", None)
        tree_rows = (settings.total_tokens - 1) if settings is not None else 1
        self.policy = policy or LoadPolicy(tree_rows=tree_rows)
        # one drafter per slot, gated by the batch's plan each step
        self.drafters = [AdaptiveDrafter(drafter.fork(), _Directed()) for _ in range(pool.size)]
        self.waiting: OrderedDict[Hashable, tuple] = OrderedDict()
        self.prefilling: OrderedDict[Hashable, _Active] = OrderedDict()  # holding a slot, their prompts being read
        self.active: OrderedDict[Hashable, _Active] = OrderedDict()  # decoding
        self.cancelled: set = set()  # requests cancelled since the last step began (`run` drops their events)
        self.last_report = StepReport()

    # ---- requests ----------------------------------------------------------------------------------------------
    def add(self, key: Hashable, prompt_ids: list[int], max_new_tokens: int = 256,
            sampling: SamplingParams | None = None, stop: list[str] | None = None) -> None:
        """Queue a request under `key` (unique among those not finished); it joins the batch when a slot frees."""
        if key in self.waiting or key in self.prefilling or key in self.active:
            raise EagleSpecError(f"request {key!r} is already in the batch")
        check_request(len(prompt_ids), max_new_tokens, self.pool[0].max_context)
        self.waiting[key] = (list(prompt_ids), max_new_tokens, sampling or SamplingParams(), stop, time.perf_counter())

    def cancel(self, key: Hashable) -> bool:
        """Drop a waiting or running request; its slot is free at once. False when it is unknown (or finished)."""
        if self.waiting.pop(key, None) is not None:
            return True
        entry = self.active.pop(key, None) or self.prefilling.pop(key, None)
        if entry is None:
            return False
        self._free(entry)
        self.cancelled.add(key)
        return True

    @property
    def busy(self) -> bool:
        """Whether anything is waiting or running."""
        return bool(self.waiting or self.prefilling or self.active)

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
        while self.waiting and self.pool.free:
            report.prefix_rows += self._admit()
        if self.active or self.prefilling:
            self._decode(events, report)
        report.seconds = time.perf_counter() - t_step
        self.last_report = report
        return events

    def _admit(self) -> int:
        """Give the longest-waiting request a slot; returns its prompt rows taken from the prefix cache."""
        key, (prompt_ids, max_new_tokens, sampling, stop, arrived) = self.waiting.popitem(last=False)
        slot = self.pool.acquire()
        drafter = self.drafters[slot]
        drafter.reset()
        seq = Sequence(prompt_ids, max_new_tokens, sampling, self.tokenizer, stop, self.eos, drafter,
                       self.sample_verifier, self.pool[slot].weight_bytes())  # traffic as if it ran alone
        entry = self.prefilling[key] = _Active(key, slot, seq, drafter, time.perf_counter())
        hit = self.prefixes.lookup(prompt_ids, drafter.needs_features) if self.prefixes is not None else None
        if hit is not None:  # those rows as reading them would give them (spec/prefix.py)
            self.pool[slot].load_rows(hit.rows)
            entry.read = hit.length
            entry.pieces.append(TargetOutput(None, hit.features))
            return hit.length
        return 0

    def _prompt_pieces(self, decoding: bool) -> list[tuple[_Active, int]]:
        """This step's prompt pieces: (request, rows to read), first come first served within the step's budget."""
        budget = self.prefill_chunk if decoding else WHOLE_PROMPT_ROWS
        pieces: list[tuple[_Active, int]] = []
        for e in self.prefilling.values():
            left = e.prompt.numel() - e.read
            if self.chunked:
                take = min(left, budget)
            else:  # whole prompts only: at least one a step, more while they fit the budget
                take = left if left <= budget or not pieces else 0
            if take <= 0:
                break
            pieces.append((e, take))
            budget -= take
        return pieces

    def _prefilled(self, e: _Active, out: TargetOutput, events: list, report: StepReport) -> None:
        """A piece of `e`'s prompt was read (`out`: its forward's output); at the prompt's end, the first token."""
        self.pool[e.slot].commit()
        if not e.seq.drafter.needs_features:
            out = TargetOutput(out.head_logits, None, out.greedy_tokens, out.argmax_rows)
        if e.read < e.prompt.numel():
            e.pieces.append(TargetOutput(None, out.features))  # the features only: no head rows before the last
            return
        del self.prefilling[e.key]
        read = TargetOutput.join(e.pieces + [out], heads="last")  # features [P, F] as one forward gives them
        if self.prefixes is not None and (length := self.prefixes.blocks_to_store(e.seq.prompt_ids)):
            self.prefixes.store(e.seq.prompt_ids, self.pool[e.slot].cached_rows(length),
                                None if read.features is None else read.features[:length].clone())
        e.seq.start(read, time.perf_counter() - e.started)
        e.pieces = []
        report.prefills += 1
        self._emit(e, events, report)
        if not e.seq.done:
            self.active[e.key] = e

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
        if self.speculate == "auto" and entries:
            plan = self.policy.plan(keys)
            drafting = plan.draft
        else:
            plan, drafting = None, set(keys) if self.speculate == "always" else set()
        trees: list[DraftTree] = []
        draft_times: list[float] = []
        catching_up = 0  # drafting sequences whose drafters read positions they skipped
        for e in entries:
            e.drafter.policy.mode = DRAFT if e.key in drafting else PLAIN
            target = self.pool[e.slot]
            fresh = e.key in drafting and self.policy.catching_up(e.key)
            t0 = time.perf_counter()
            tree = e.seq.draft(room=target.max_context - 1 - target.cache_len)
            seconds = time.perf_counter() - t0
            if e.key in drafting:
                catching_up += fresh
                self.policy.observe_draft(seconds, catching_up=fresh)
                if plan is not None:
                    tree = self.policy.prune(e.key, tree, plan)
            trees.append(tree)
            draft_times.append(seconds)
        greedy = [e.seq.sampling.greedy for e in entries]  # greedy sequences' tokens as their batch-1 steps get them
        steps = [(e.slot, tree.tokens, tree.positions(self.pool[e.slot].cache_len),
                  tree.ancestor_mask() if len(tree) > 1 else None) for e, tree in zip(entries, trees)]
        pieces = self._prompt_pieces(decoding=bool(entries))
        for e, take in pieces:  # causal rows on top of the prompt rows read so far; the last row's head only
            steps.append((e.slot, e.prompt[e.read : e.read + take], None, None, slice(-1, None)))
            greedy.append(e.seq.sampling.greedy)
        t0 = time.perf_counter()
        try:
            outputs = self.pool.forward(steps, greedy=greedy)
        except BaseException:  # (re-raised) requests whose prompt was being read must not keep their slots
            for e, _ in pieces:
                self.cancel(e.key)
            raise
        seconds = time.perf_counter() - t0
        rows = sum(len(t) for t in trees)
        prompt_rows = sum(take for _, take in pieces)
        self.policy.observe_step(rows, seconds, prompt_rows)
        report.sequences, report.rows, report.prefill_rows = len(entries), rows, prompt_rows
        report.forward_seconds = seconds
        report.drafted = sum(len(t) > 1 for t in trees)
        for (e, take), out in zip(pieces, outputs[len(entries):]):
            e.read += take
            self._prefilled(e, out, events, report)
        for e, tree, out, t_draft in zip(entries, trees, outputs, draft_times):
            keep = e.seq.accept(tree, out)
            self.pool[e.slot].commit(keep)
            e.seq.timed(t_draft, seconds)
            self.policy.observe_sequence(e.key, tree, e.seq.accepted)
            self._emit(e, events, report)
            if e.seq.done:
                del self.active[e.key]
        if entries and not prompt_rows:
            self.policy.observe_round(len(entries), report.drafted, rows, time.perf_counter() - t_round, catching_up)

    # ---- to completion -----------------------------------------------------------------------------------------
    def run(self) -> Iterator[tuple[Hashable, Step | Finished]]:
        """Step until nothing is waiting or running, yielding every event (none of a request after its `cancel`,
        even one its step made before)."""
        while self.busy:
            for key, event in self.step():
                if key not in self.cancelled:
                    yield key, event
