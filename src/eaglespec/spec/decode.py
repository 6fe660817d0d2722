"""The one generation loop: prefill -> (draft -> verify -> commit)*, as a generator of typed steps.

Every method (EAGLE-2, EAGLE-1, chain, vanilla, ...) runs through this loop; only the drafter differs.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from ..drafters import Drafter
from ..errors import EagleSpecError
from ..targets.hf import TargetModel
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
        if prompt_len == 0:
            raise EagleSpecError("the prompt is empty: give at least one token of input")
        if not isinstance(max_new_tokens, int) or not (1 <= max_new_tokens <= MAX_NEW_TOKENS_LIMIT):
            raise EagleSpecError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        if prompt_len + max_new_tokens > self.target.max_context:
            raise EagleSpecError(
                f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's context of "
                f"{self.target.max_context} tokens; shorten the prompt or lower max_new_tokens"
            )

    def stream(
        self,
        prompt_ids: list[int],
        max_new_tokens: int = 256,
        sampling: SamplingParams | None = None,
        stop: list[str] | None = None,
    ) -> Iterator[Step | Finished]:
        sampling = sampling or SamplingParams()
        self.check_request(len(prompt_ids), max_new_tokens)
        gen = None if sampling.greedy else sampling.generator()
        target, drafter = self.target, self.drafter
        stats = GenerationStats(prompt_tokens=len(prompt_ids))
        text = TextStream(self.tokenizer, stop or [])
        generated: list[int] = []
        t_start = time.perf_counter()
        target.reset()
        drafter.reset()

        # Prefill: the target reads the prompt and chooses the first new token (the first root); only the last row
        # needs logits (a whole prompt's rows through the LM head cost ~7 ms for 70 tokens on 2 cores).
        out = target.forward(torch.tensor(prompt_ids), logits_rows=slice(-1, None), greedy=sampling.greedy)
        target.commit()
        root = out.greedy()[-1] if sampling.greedy else sample_token(out.head_logits[-1], sampling, gen)
        new_features = out.features if drafter.needs_features else None
        stats.prefill_time = time.perf_counter() - t_start
        pending = [root]
        # prompt + generated tokens, written in place as they are emitted (a tensor built from the whole list on
        # every step cost ~0.1 ms at a few hundred tokens); drafters get the view of the committed part + root.
        sequence = torch.empty(len(prompt_ids) + max_new_tokens, dtype=torch.long)
        sequence[: len(prompt_ids)] = torch.tensor(prompt_ids)
        length = len(prompt_ids)
        accepted = 0
        tree_size, tree_depth, t_draft, t_verify = 1, 0, 0.0, stats.prefill_time

        while True:
            # Emit what the last forward produced, trimmed at EOS and at the length budget.
            emit = []
            for tok in pending:
                if len(generated) + len(emit) >= max_new_tokens:
                    break
                emit.append(tok)
                if tok in self.eos:
                    stats.finish_reason = "stop"
                    break
            generated.extend(emit)
            sequence[length : length + len(emit)] = torch.tensor(emit, dtype=torch.long)
            length += len(emit)
            piece = text.push(emit)
            done = stats.finish_reason == "stop" or text.stopped or len(generated) >= max_new_tokens
            if text.stopped:
                stats.finish_reason = "stop"
            if done:
                piece += text.flush()
            yield Step(emit, piece, accepted, tree_size, t_draft, t_verify, tree_depth)
            if done:
                break

            t0 = time.perf_counter()
            tree = drafter.draft(sequence[:length], new_features)  # committed tokens + the root
            room = target.max_context - 1 - target.cache_len  # deepest node position allowed
            if tree.max_depth > room:
                tree = tree.truncate_depth(max(room, 0))
            t1 = time.perf_counter()
            positions = tree.positions(target.cache_len)
            out = target.forward(tree.tokens, positions, tree.ancestor_mask(), greedy=sampling.greedy)
            if sampling.greedy:
                verdict = walk_greedy(tree, out.greedy())
            else:
                verdict = self.sample_verifier(tree, target_probs(out.logits, sampling), gen)
            keep = torch.tensor(verdict.accepted)
            target.commit(keep)
            new_features = out.features[keep] if drafter.needs_features else None
            t2 = time.perf_counter()

            accepted = verdict.accepted_tokens
            tree_size = len(tree)
            t_draft, t_verify = t1 - t0, t2 - t1
            stats.target_forwards += 1
            stats.drafted_forwards += tree_size > 1
            stats.draft_time += t_draft
            stats.verify_time += t_verify
            tree_depth = tree.max_depth
            stats.record(accepted, tree_depth)
            tokens = tree.token_list()
            pending = [tokens[node] for node in verdict.accepted[1:]] + [verdict.bonus]

        stats.new_tokens = len(generated)
        stats.total_time = time.perf_counter() - t_start
        yield Finished(generated, text.released, stats)


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
