"""The one generation loop: prefill -> (draft -> verify -> commit)*, as a generator of typed steps.

Every method (EAGLE-2, EAGLE-1, chain, vanilla, ...) runs through this loop; only the drafter differs.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..drafters import Drafter
from ..errors import EagleSpecError
from ..targets.hf import TargetModel, TargetOutput
from .tree import DraftTree
from .verify import (
    SamplingParams,
    sample_token,
    target_probs,
    verify_sample,
    walk_greedy,
)

MAX_NEW_TOKENS_LIMIT = 1 << 20


@dataclass
class Step:
    """One target forward's worth of output."""

    tokens: list[int]  # tokens emitted by this step (after EOS/stop/length trimming)
    text: str  # new text, safe to print (held back while it could still become a stop string)
    accepted: int  # drafted tokens the target accepted (the bonus token is extra)
    tree_size: int  # nodes verified, root included (1 for the prefill / vanilla)
    draft_time: float  # seconds
    verify_time: float  # seconds
    tree_depth: int = 0  # deepest draft level verified (0 for the prefill / vanilla)


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    target_forwards: int = 0  # verify forwards after the prefill
    drafted_forwards: int = 0  # of those, forwards of a drafted tree (the others: plain steps, e.g. adaptive)
    accept_lengths: list[int] = field(default_factory=list)  # accepted + 1 per verify forward
    drafted_per_depth: list[int] = field(default_factory=list)  # [d-1]: verify steps whose tree reached depth d
    accepted_per_depth: list[int] = field(default_factory=list)  # [d-1]: of those, steps that accepted depth d
    draft_forwards: int = 0  # forwards of the draft model or head (staged: the draft model's, not stage 2's)
    stage2_guessed: int = 0  # staged: tokens stage 2 proposed to the draft model
    stage2_accepted: int = 0  # of them, those the draft model agreed with
    weight_bytes: int = 0  # weights read by the verify and draft forwards (the prefill excluded)
    target_weight_bytes: int = 0  # weights one target forward reads (0: not known)
    prefill_time: float = 0.0
    draft_time: float = 0.0
    verify_time: float = 0.0
    total_time: float = 0.0
    finish_reason: str = "length"  # "stop" (EOS or stop string) or "length"

    @property
    def tau(self) -> float:
        """Mean accepted length per target forward, bonus token included (plain decoding: 1.0)."""
        return sum(self.accept_lengths) / len(self.accept_lengths) if self.accept_lengths else 1.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_time if self.total_time > 0 else 0.0

    @property
    def traffic(self) -> float | None:
        """Weights read per token the verify forwards produced, as a share of plain decoding's (one target forward
        a token: 1.0); the memory traffic of staged speculative decoding's paper. None where not known."""
        produced = self.new_tokens - 1  # the first token comes from the prefill
        if not self.target_weight_bytes or produced < 1:
            return None
        return self.weight_bytes / (produced * self.target_weight_bytes)

    def acceptance_per_depth(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_depth, self.drafted_per_depth)]

    def record(self, accepted: int, tree_depth: int) -> None:
        self.accept_lengths.append(accepted + 1)
        while len(self.drafted_per_depth) < tree_depth:
            self.drafted_per_depth.append(0)
            self.accepted_per_depth.append(0)
        for d in range(tree_depth):
            self.drafted_per_depth[d] += 1
            self.accepted_per_depth[d] += int(accepted > d)


@dataclass
class Finished:
    """The last item of a stream."""

    tokens: list[int]
    text: str
    stats: GenerationStats


class TextStream:
    """Incremental detokenisation with stop strings: only text that can no longer change is released.

    The text of all tokens so far is needed at every step (stop strings, the released part), but decoding them all
    each step costs O(n) (~0.2 ms at 256 tokens on 2 cores, more for long answers). So the text before an anchor is
    kept and only the tokens after it are decoded. The anchor moves every ANCHOR_EVERY tokens to ANCHOR_WINDOW
    tokens before the end, and only where decoding the two sides apart gives exactly the whole decode (with that
    window of tokens after it: a cut inside a character's bytes, or tokenizers that strip a leading space or clean
    up spaces across the cut, fail the check and the anchor stays; with those tokenizers it stays at 0, decoding
    everything as before). Each check also compares the anchored text with the whole decode.
    """

    ANCHOR_EVERY = 64
    ANCHOR_WINDOW = 16

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.tokens: list[int] = []
        self.released = ""
        self.stopped = False
        self.anchor, self.anchor_text, self.anchoring = 0, "", True  # text of tokens[:anchor]
        self.next_check = self.ANCHOR_EVERY + self.ANCHOR_WINDOW  # token count at which to try moving the anchor

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def text(self) -> str:
        """The decoded text of every token pushed so far."""
        text = self.anchor_text + self._decode(self.tokens[self.anchor:])
        if self.anchoring and len(self.tokens) >= self.next_check:
            self.next_check = len(self.tokens) + self.ANCHOR_EVERY
            whole = self._decode(self.tokens)
            if whole != text:  # (never seen) the anchor did not hold: decode everything from now on
                self.anchor, self.anchor_text, self.anchoring = 0, "", False
            else:
                cut = len(self.tokens) - self.ANCHOR_WINDOW
                left = self._decode(self.tokens[:cut])
                if left + self._decode(self.tokens[cut:]) == whole:  # else the anchor stays where it is
                    self.anchor, self.anchor_text = cut, left
            text = whole
        return text

    def push(self, tokens: list[int]) -> str:
        self.tokens.extend(tokens)
        text = self.text()
        hits = [text.find(s, max(0, len(self.released) - len(s))) for s in self.stop]
        hits = [h for h in hits if h >= 0]
        if hits:
            self.stopped = True
            text = text[: min(hits)]
            return self._release(text, len(text))
        safe = len(text)
        if text.endswith("\ufffd"):  # an incomplete multi-byte character: wait for the rest
            safe = len(text.rstrip("\ufffd"))
        for s in self.stop:  # hold back a tail that could be the start of a stop string
            for n in range(min(len(s) - 1, safe), 0, -1):
                if text[:safe].endswith(s[:n]):
                    safe -= n
                    break
        return self._release(text, max(safe, len(self.released)))

    def _release(self, text: str, upto: int) -> str:
        piece = text[len(self.released) : upto]
        self.released = text[:upto]
        return piece

    def flush(self) -> str:
        text = self.text()
        if self.stopped:
            return ""
        return self._release(text, len(text))


class Sequence:
    """One sequence's decoding state between target forwards: what was generated, the tokens the last forward
    produced (`pending`), its drafter and statistics. `SpecDecoder` runs one at a time; `spec.batch.BatchDecoder`
    runs many, verifying all their trees in one target forward. Both call, in this order: `start` (with the prefill's
    output), then `emit` -> `draft` -> (the target's forward) -> `accept` until `emit` says `done`, then `finish`."""

    def __init__(self, prompt_ids: list[int], max_new_tokens: int, sampling: SamplingParams, tokenizer,
                 stop: list[str] | None, eos: set[int], drafter: Drafter, sample_verifier=verify_sample,
                 target_bytes: int = 0):
        """`target_bytes`: the weights one target forward reads (`TargetModel.weight_bytes`; 0 = not known)."""
        self.prompt_ids, self.max_new_tokens, self.sampling = prompt_ids, max_new_tokens, sampling
        self.eos, self.drafter, self.sample_verifier = eos, drafter, sample_verifier
        self.gen = None if sampling.greedy else sampling.generator()
        self.stats = GenerationStats(prompt_tokens=len(prompt_ids), target_weight_bytes=target_bytes)
        self.work_before = drafter.work()  # the drafter's counters before this sequence
        self.text = TextStream(tokenizer, stop or [])
        self.generated: list[int] = []
        # prompt + generated tokens, written in place as they are emitted (a tensor built from the whole list on
        # every step cost ~0.1 ms at a few hundred tokens); drafters get the view of the committed part + root.
        self.sequence = torch.empty(len(prompt_ids) + max_new_tokens, dtype=torch.long)
        self.sequence[: len(prompt_ids)] = torch.tensor(prompt_ids)
        self.length = len(prompt_ids)
        self.pending: list[int] = []  # tokens the last forward produced, not emitted yet
        self.new_features: Tensor | None = None  # target features of the positions the drafter has not seen
        self.done = False
        # what the next `Step` reports of the forward that produced `pending`
        self.accepted, self.tree_size, self.tree_depth, self.t_draft, self.t_verify = 0, 1, 0, 0.0, 0.0

    def start(self, out: TargetOutput, prefill_time: float) -> None:
        """The prefill's output (its last row's logits or greedy token) gives the first root."""
        greedy = self.sampling.greedy
        root = out.greedy()[-1] if greedy else sample_token(out.head_logits[-1], self.sampling, self.gen)
        self.new_features = out.features if self.drafter.needs_features else None
        self.stats.prefill_time = self.t_verify = prefill_time
        self.pending = [root]

    def emit(self) -> Step:
        """Emit what the last forward produced, trimmed at EOS, at a stop string and at the length budget."""
        stats, text = self.stats, self.text
        emit = []
        for tok in self.pending:
            if len(self.generated) + len(emit) >= self.max_new_tokens:
                break
            emit.append(tok)
            if tok in self.eos:
                stats.finish_reason = "stop"
                break
        self.generated.extend(emit)
        self.sequence[self.length : self.length + len(emit)] = torch.tensor(emit, dtype=torch.long)
        self.length += len(emit)
        piece = text.push(emit)
        if text.stopped:
            stats.finish_reason = "stop"
        self.done = stats.finish_reason == "stop" or len(self.generated) >= self.max_new_tokens
        if self.done:
            piece += text.flush()
        return Step(emit, piece, self.accepted, self.tree_size, self.t_draft, self.t_verify, self.tree_depth)

    def draft(self, room: int) -> DraftTree:
        """The drafter's tree for the next forward, cut to `room` levels (the deepest position the target's context
        still has, counted from the root)."""
        tree = self.drafter.draft(self.sequence[: self.length], self.new_features)  # committed tokens + the root
        if tree.max_depth > room:
            tree = tree.truncate_depth(max(room, 0))
        return tree

    def accept(self, tree: DraftTree, out: TargetOutput) -> Tensor:
        """Verify `tree` against the target's output for it; returns the accepted nodes [m] (the target commits
        their rows) and sets `pending` to the accepted tokens and the bonus token."""
        if self.sampling.greedy:
            verdict = walk_greedy(tree, out.greedy())
        else:
            verdict = self.sample_verifier(tree, target_probs(out.logits, self.sampling), self.gen)
        keep = torch.tensor(verdict.accepted)
        self.new_features = out.features[keep] if self.drafter.needs_features else None
        self.accepted, self.tree_size, self.tree_depth = verdict.accepted_tokens, len(tree), tree.max_depth
        stats = self.stats
        stats.target_forwards += 1
        stats.drafted_forwards += self.tree_size > 1
        stats.record(self.accepted, self.tree_depth)
        tokens = tree.token_list()
        self.pending = [tokens[node] for node in verdict.accepted[1:]] + [verdict.bonus]
        return keep

    def timed(self, draft_time: float, verify_time: float) -> None:
        """The last round's draft and verify seconds (what the next `Step` reports)."""
        self.t_draft, self.t_verify = draft_time, verify_time
        self.stats.draft_time += draft_time
        self.stats.verify_time += verify_time

    def finish(self, total_time: float) -> Finished:
        work = self.drafter.work() - self.work_before
        self.stats.draft_forwards = work.forwards
        self.stats.weight_bytes = self.stats.target_forwards * self.stats.target_weight_bytes + work.weight_bytes
        self.stats.stage2_guessed, self.stats.stage2_accepted = work.guessed, work.guesses_accepted
        self.stats.new_tokens = len(self.generated)
        self.stats.total_time = total_time
        return Finished(self.generated, self.text.released, self.stats)


class SpecDecoder:
    """Speculative decoding of one sequence at a time with any `Drafter`."""

    def __init__(self, target: TargetModel, tokenizer, drafter: Drafter, eos_token_ids: list[int] | None = None,
                 sample_verifier=verify_sample):
        self.target, self.tokenizer, self.drafter = target, tokenizer, drafter
        self.sample_verifier = sample_verifier  # the acceptance rule for sampling (tests swap in broken ones)
        if eos_token_ids is None:
            eos_token_ids = eos_ids_of(target.model, tokenizer)
        self.eos = set(eos_token_ids)

    def check_request(self, prompt_len: int, max_new_tokens: int) -> None:
        check_request(prompt_len, max_new_tokens, self.target.max_context)

    def new_sequence(self, prompt_ids: list[int], max_new_tokens: int, sampling: SamplingParams,
                     stop: list[str] | None, drafter: Drafter) -> Sequence:
        return Sequence(prompt_ids, max_new_tokens, sampling, self.tokenizer, stop, self.eos, drafter,
                        self.sample_verifier, self.target.weight_bytes())

    def stream(
        self,
        prompt_ids: list[int],
        max_new_tokens: int = 256,
        sampling: SamplingParams | None = None,
        stop: list[str] | None = None,
    ) -> Iterator[Step | Finished]:
        sampling = sampling or SamplingParams()
        self.check_request(len(prompt_ids), max_new_tokens)
        target, drafter = self.target, self.drafter
        t_start = time.perf_counter()
        target.reset()
        drafter.reset()
        seq = self.new_sequence(prompt_ids, max_new_tokens, sampling, stop, drafter)

        # Prefill: the target reads the prompt and chooses the first new token (the first root); only the last row
        # needs logits (a whole prompt's rows through the LM head cost ~7 ms for 70 tokens on 2 cores).
        out = target.forward(torch.tensor(prompt_ids), logits_rows=slice(-1, None), greedy=sampling.greedy)
        target.commit()
        seq.start(out, time.perf_counter() - t_start)
        while True:
            yield seq.emit()
            if seq.done:
                break
            t0 = time.perf_counter()
            tree = seq.draft(room=target.max_context - 1 - target.cache_len)  # deepest node position allowed
            t1 = time.perf_counter()
            out = target.forward(tree.tokens, tree.positions(target.cache_len), tree.ancestor_mask(),
                                 greedy=sampling.greedy)
            target.commit(seq.accept(tree, out))
            seq.timed(t1 - t0, time.perf_counter() - t1)
        yield seq.finish(time.perf_counter() - t_start)


def check_request(prompt_len: int, max_new_tokens: int, max_context: int) -> None:
    """A clear error for a request no decoder can serve."""
    if prompt_len == 0:
        raise EagleSpecError("the prompt is empty: give at least one token of input")
    if not isinstance(max_new_tokens, int) or not (1 <= max_new_tokens <= MAX_NEW_TOKENS_LIMIT):
        raise EagleSpecError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if prompt_len + max_new_tokens > max_context:
        raise EagleSpecError(
            f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's context of "
            f"{max_context} tokens; shorten the prompt or lower max_new_tokens"
        )


def eos_ids_of(model, tokenizer) -> list[int]:
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    config_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(config_eos, int):
        ids.add(config_eos)
    elif config_eos:
        ids.update(int(i) for i in config_eos)
    return sorted(ids)
