"""How many tokens a draft model's chain drafts this round (`--tree auto` with `sps` and `staged`), from what the
chains have been accepting and what drafting and verifying have cost.

A fixed chain is right for one text only: on code that copies its prompt a 0.5B draft of a 1.5B target has 90%+
of 15 tokens accepted, on prose it loses its way after two or three, and every token past that costs a draft-model
forward (staged: part of one) and a verify row for nothing. `ChainLength` models acceptance as a constant chance
alpha per drafted token (a token is accepted only if its predecessors were), estimated from the recent rounds (each
round tried its chain up to the first rejected token), so a chain of L tokens is expected to yield

    E(L) = 1 + alpha + ... + alpha^L   tokens (the bonus token included)

in D L + T(L + 1) seconds: D the measured draft time per drafted token, T(rows) the measured time of the rest of a
round (the target's verify pass, acceptance, the loop) by its verify rows, fitted as `spec.load.StepCosts` fits a
batched forward. Each round drafts the L (1 .. `longest`) that maximises E(L) / (D L + T(L + 1)). Where the verify
rows are nearly free (a GPU; AMX tiles for a few rows) and alpha is high, that is the longest chain; where rows cost
(AVX2) or alpha is low, a short one. The chain length never changes what the target accepts, only how much is
proposed, so the output is unchanged.
"""

from __future__ import annotations

from ..spec.load import StepCosts


def accepted_of(proposal: list[int], committed: list[int]) -> int:
    """How many tokens of a round's chain `proposal` (what it drafted after the root) the sequence accepted, read
    from `committed`: the tokens it committed since that round (the accepted drafts, then the new root: the bonus
    token or a correction)."""
    accepted, limit = 0, min(len(committed) - 1, len(proposal))
    while accepted < limit and committed[accepted] == proposal[accepted]:
        accepted += 1
    return accepted


class ChainLength:
    """The chain length of each round. `observe_draft` after drafting, `observe_round` once the round's outcome is
    known (at the next draft call), `next()` before drafting."""

    def __init__(self, longest: int, start: int | None = None, decay: float = 0.9, prior_alpha: float = 0.6,
                 prior_weight: float = 2.0):
        if longest < 1:
            raise ValueError(f"longest must be at least 1, got {longest}")
        self.longest = longest
        self.start = min(start or longest, longest)
        self.decay = decay
        self.accepted = prior_alpha * prior_weight  # decayed sums over rounds: tokens accepted,
        self.tried = prior_weight  # and tokens tried (up to and including the first rejected one)
        self.draft_seconds = 0.0  # decayed sums: draft time, and tokens drafted in it
        self.drafted = 0.0
        self.costs = StepCosts(memory=64)  # the rest of a round by its verify rows

    @property
    def alpha(self) -> float:
        """The estimated chance that a drafted token is accepted, given its predecessors were."""
        return min(max(self.accepted / self.tried, 0.01), 0.99)

    def observe_draft(self, tokens: int, seconds: float) -> None:
        """A draft call that proposed `tokens` tokens in `seconds`."""
        if tokens > 0:
            self.draft_seconds = self.decay * self.draft_seconds + seconds
            self.drafted = self.decay * self.drafted + tokens

    def observe_round(self, proposed: int, accepted: int, seconds: float) -> None:
        """A verified chain of `proposed` tokens, `accepted` of them accepted; `seconds` from the end of its drafting
        to the next draft call (the verify pass and the rest of the round)."""
        if proposed < 1:
            return
        self.accepted = self.decay * self.accepted + accepted
        self.tried = self.decay * self.tried + accepted + (accepted < proposed)
        self.costs.observe(proposed + 1, seconds)

    def expected_tokens(self, length: int) -> float:
        """E(length): tokens a round with a chain of `length` is expected to commit, the bonus token included."""
        a = self.alpha
        return sum(a ** d for d in range(length + 1))

    def next(self) -> int:
        """The chain length of the next round: `start` until a draft and a round have been timed."""
        if not self.costs.known or self.drafted <= 0:
            return self.start
        per_token = self.draft_seconds / self.drafted

        def speed(length: int) -> float:
            return self.expected_tokens(length) / max(per_token * length + self.costs.time(length + 1), 1e-9)

        return max(range(1, self.longest + 1), key=lambda length: (speed(length), -length))


class GuessCount:
    """How many stage-2 guesses an EAGLE draft takes on as new nodes this round (`EagleDrafter`'s `extend` under
    `--tree auto`). The guesses form a chain from the root (running through the head's nodes they match first);
    as in `ChainLength`, a guess is accepted with a constant chance alpha given its predecessors were, estimated from
    the recent rounds, so the guess at depth d is accepted with chance alpha^d. A guess costs no draft time, only its
    verify row: b seconds, the slope of the round's time by its verify rows (`StepCosts`, fitted online). A round
    that commits E tokens in T seconds is worth T / E seconds a token, so the d-th guess is worth its row while
    alpha^d T / E > b: new nodes are added, depth by depth, while that holds (at most `most`). On text that repeats
    itself (code restating its task) alpha is high and the rows cheap on AMX, so the whole chain; on prose guesses
    rarely hold and none are added. The count never changes what the target accepts."""

    def __init__(self, most: int, decay: float = 0.9, prior_alpha: float = 0.5, prior_weight: float = 2.0):
        if most < 1:
            raise ValueError(f"most must be at least 1, got {most}")
        self.most, self.decay = most, decay
        self.accepted = prior_alpha * prior_weight  # decayed sums over rounds: guesses accepted,
        self.tried = prior_weight  # and guesses tried (up to and including the first rejected one)
        self.tokens = 0.0  # decayed sums: tokens committed by the rounds, and rounds
        self.rounds = 0.0
        self.costs = StepCosts(memory=64)  # the rest of a round (verify pass, acceptance, loop) by its verify rows

    @property
    def alpha(self) -> float:
        return min(max(self.accepted / self.tried, 0.01), 0.99)

    def observe_round(self, guessed: int, accepted: int, rows: int, committed: int, seconds: float) -> None:
        """A round whose guess chain had `guessed` tokens (matched head nodes included), `accepted` of them accepted,
        verified `rows` rows and committed `committed` tokens (the bonus included); `seconds` from the end of its
        drafting to the next draft call."""
        if guessed > 0:
            self.accepted = self.decay * self.accepted + accepted
            self.tried = self.decay * self.tried + accepted + (accepted < guessed)
        self.tokens = self.decay * self.tokens + committed
        self.rounds = self.decay * self.rounds + 1
        self.costs.observe(rows, seconds)

    def next(self, matched: int, rows: int) -> int:
        """New guess nodes for a round whose tree has `rows` verify rows and whose guess chain runs through `matched`
        of the head's nodes first: all (`most`) until a round has been timed."""
        if not self.costs.known or self.rounds <= 0:
            return self.most
        per_token = self.costs.time(rows) * self.rounds / max(self.tokens, 1e-9)  # T / E
        count = 0
        while count < self.most and self.alpha ** (matched + count + 1) * per_token > self.costs.b:
            count += 1
        return count
