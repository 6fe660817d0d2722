"""Online adaptation: draft or decode plainly, whichever the last rounds measured faster.

Whether drafting pays depends on the machine (how much a verify pass of several tokens costs against one) and on
the text (how much of it the head predicts): on a CPU where it is close, `--tree auto`'s one-off calibration can
be right for its prompts and wrong for the user's. `AdaptiveDrafter` wraps a drafter and, round by round,
either drafts with it or proposes nothing (a plain decoding step through the same loop). `SwitchPolicy` keeps the
speed of each mode over its recent rounds, stays with the faster one, and measures the other again every
`period` tokens. The output never depends on the mode (verification is lossless either way), only the speed.

While decoding plainly the head does not run: the target features of the committed tokens are kept, and the head
reads them all in one batched catch-up when drafting resumes.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections import deque
from collections.abc import Callable

import torch
from torch import Tensor

from ..drafters import DRAFT_MODEL_METHODS, Drafter, DraftWork
from .tree import DraftTree

DRAFT, PLAIN = "draft", "plain"
# methods whose drafts are chains without scores, adaptive by default too: on a CPU where a verify row costs a good
# part of a step, their drafts can slow decoding down where the context or the draft model predicts little
ADAPTIVE_CHAINS = ("pld", *DRAFT_MODEL_METHODS)


class SwitchPolicy:
    """Which mode the next round runs in, from the measured speed of recent rounds.

    A mode's speed is its mean tokens per round over its last `memory` rounds, divided by the median time of its
    last `window` rounds. The two parts get different memories because their noise differs: a round's time is
    steady (the median ignores a round stalled by the caller), but the tokens a drafted round commits are a coin
    flip per draft level (at 53% acceptance, 8 rounds give tau to +-12%, 64 rounds to +-4%), and the text changes
    its predictability slowly. The faster mode is `chosen`; after `period` tokens in it, the other mode's round
    time is measured afresh for `window` rounds (a probe), then the faster of the two is chosen. A probe costs
    `window` rounds at the slower speed, so each probe that confirms the choice doubles the period (up to
    `max_period`), and a change of choice resets it. `plain_window` (default: `window`) times plain rounds over
    fewer rounds where drafted ones vary more: a plain round is one target step, steady, while a drafted chain's
    length (and time) changes round to round; a probe of plain decoding then costs fewer slow rounds.

    `timing="mean"` takes a mode's speed as its last `window` rounds' tokens over their seconds instead: for
    drafters whose drafted rounds are of two kinds by design (prompt lookup drafts only where the context repeats
    itself, and its other rounds cost a plain step), the median round time would hide the costly kind.
    """

    def __init__(self, start: str = DRAFT, window: int = 8, period: int = 64, memory: int = 64,
                 max_period: int = 1024, timing: str = "median", plain_window: int | None = None):
        if start not in (DRAFT, PLAIN):
            raise ValueError(f"start must be '{DRAFT}' or '{PLAIN}', got {start!r}")
        if timing not in ("median", "mean"):
            raise ValueError(f"timing must be 'median' or 'mean', got {timing!r}")
        self.timing = timing
        plain_window = window if plain_window is None else plain_window
        if min(window, plain_window, period, memory) < 1 or max_period < period:
            raise ValueError("window, plain_window, period and memory must be positive, and max_period at least "
                             "period")
        self.windows = {DRAFT: window, PLAIN: plain_window}  # rounds timed per mode
        self.base_period, self.max_period = period, max_period
        self.period = period  # tokens in the chosen mode before the next probe
        self.seconds: dict[str, deque[float]] = {m: deque(maxlen=self.windows[m]) for m in (DRAFT, PLAIN)}
        memory = max(memory, window, plain_window)  # (mean timing reads the tokens of its timed rounds)
        self.tokens: dict[str, deque[int]] = {m: deque(maxlen=memory) for m in (DRAFT, PLAIN)}
        self.chosen = start
        self.probing: str | None = None
        self.since_probe = 0  # tokens committed since the other mode was last measured
        self.switches = 0  # changes of the chosen mode

    @staticmethod
    def other(mode: str) -> str:
        return PLAIN if mode == DRAFT else DRAFT

    def speed(self, mode: str) -> float | None:
        """Tokens per second of `mode` lately; None before a full window of its round times."""
        seconds, tokens = self.seconds[mode], self.tokens[mode]
        if len(seconds) < self.windows[mode]:
            return None
        if self.timing == "mean":  # the same rounds' tokens and seconds
            return sum(list(tokens)[-len(seconds):]) / max(sum(seconds), 1e-9)
        return (sum(tokens) / len(tokens)) / max(statistics.median(seconds), 1e-9)

    def observe(self, mode: str, tokens: int, seconds: float) -> None:
        """A round of `mode` committed `tokens` in `seconds` (from one draft call to the next)."""
        self.seconds[mode].append(seconds)
        self.tokens[mode].append(tokens)
        self.since_probe += tokens

    def next_mode(self) -> str:
        if self.probing is not None:
            if self.speed(self.probing) is None:
                return self.probing
            self.probing = None  # the probe is complete: choose again
            best = max((DRAFT, PLAIN), key=lambda m: self.speed(m) or 0.0)
            if best != self.chosen:
                self.chosen, self.switches, self.period = best, self.switches + 1, self.base_period
            else:
                self.period = min(2 * self.period, self.max_period)
            self.since_probe = 0
        other = self.other(self.chosen)
        stale = self.speed(other) is None or self.since_probe >= self.period
        if stale and self.speed(self.chosen) is not None:
            self.probing = other
            self.seconds[other].clear()  # time it afresh (its tokens per round keep their longer memory)
            return other
        return self.chosen



def chain_policy(method: str) -> SwitchPolicy:
    """The policy of a chain-drafting method (ADAPTIVE_CHAINS): it starts drafting; prompt lookup's drafted rounds
    are of two kinds (a match, or a plain step), so its speed is timed by the mean. Drafted rounds are timed over 16
    (a chain's length changes round to round), plain ones over 4: with a draft model's chains committing 10-15
    tokens a round, each probe of plain decoding costs 4 slow tokens, not 16."""
    return SwitchPolicy(DRAFT, window=16, plain_window=4, timing="mean" if method == "pld" else "median")

class AdaptiveDrafter(Drafter):
    """Drafts with `inner` (an `EagleDrafter`, or any drafter) or proposes only the root, as `policy` decides
    before each round.

    A round is timed from one `draft` call to the next, so it includes the verify pass and the loop's own work:
    the speed the caller sees. A drafted round right after the prefill or after plain rounds is not timed: its
    head catches up on the prompt or on the skipped positions in one batch, a cost once per switch, not per round.
    """

    def __init__(self, inner: Drafter, policy: SwitchPolicy | None = None,
                 clock: Callable[[], float] = time.perf_counter):
        self.inner, self.policy, self.clock = inner, policy or SwitchPolicy(), clock
        self.name, self.needs_features = inner.name, inner.needs_features
        self.reset()

    @property
    def settings(self):
        """The inner drafter's tree settings (None for drafters without)."""
        return getattr(self.inner, "settings", None)

    def reset(self) -> None:
        self.inner.reset()
        self.pending: list[Tensor] = []  # features [k, F] of committed positions the head has not read
        self.last_call: float | None = None
        self.last_mode: str | None = None
        self.last_length = 0  # tokens (committed + root) at the last call
        self.timed = False  # whether the round that ends at the next call is to be timed

    def work(self) -> DraftWork:
        return self.inner.work()

    def fork(self) -> "AdaptiveDrafter":
        """`Drafter.fork`: the inner drafter forked, a fresh copy of the policy."""
        return AdaptiveDrafter(self.inner.fork(), copy.deepcopy(self.policy), self.clock)

    def draft(self, tokens: Tensor, new_features: Tensor | None) -> DraftTree:
        now = self.clock()
        if self.timed:  # the round that just ended committed the tokens after the previous root
            self.policy.observe(self.last_mode, tokens.numel() - self.last_length, now - self.last_call)
        mode = self.policy.next_mode()
        if new_features is not None:
            self.pending.append(new_features)
        if mode == PLAIN:
            tree = DraftTree.root_only(int(tokens[-1]))
            self.timed = True
        else:
            features = None
            if self.pending:
                features = self.pending[0] if len(self.pending) == 1 else torch.cat(self.pending)
            self.pending = []
            tree = self.inner.draft(tokens, features)
            self.timed = self.last_mode == DRAFT  # else the head caught up on the prompt or on plain rounds
        self.last_mode, self.last_call, self.last_length = mode, now, tokens.numel()
        return tree
