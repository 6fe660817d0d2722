"""Load-aware speculation for a batch: per step, which sequences draft and how many of their draft nodes the
target verifies, from what the rows cost at the current batch width and what each sequence has been accepting.

A batched verify pass costs T(N) seconds for N rows in all. On a memory-bound model T barely grows for the first
rows (the weights are read once for all of them) and then grows about linearly once the arithmetic dominates; so
a draft node that pays at batch 1 may not at batch 16, where the other sequences' rows already use the arithmetic
the weights' reading leaves spare. `StepCosts` fits T(N) = a + b N online from the batched forwards' times, prompt
pieces' rows counted with the decode rows (a prompt row costs a little less: no LM head): a batch filling up reads
prompts in every step, and knowing nothing of its costs until a forward without one it drafted for everyone (16
sequences: 0.82x plain batched decoding), while the pieces' rows give the fit the spread of widths it needs.

A step emits K tokens in T seconds (one per sequence, plus the accepted drafts). Drafting for a sequence adds its
draft time d and r rows (b r seconds) and is expected to add g accepted tokens; it raises the batch's throughput
iff g / (d + b r) > K / T. `LoadPolicy.plan` admits the sequences in order of g while that holds. After drafting,
`LoadPolicy.prune` keeps, of each tree, the nodes worth their row: a node's chance of being accepted is estimated
from its draft score (EAGLE-2's path probability) scaled by how well the sequence's scores have predicted its
acceptance so far, and a node is kept while that chance exceeds b K / T. A tree without scores (a draft model's or
prompt lookup's chain) is cut at the first depth whose measured chance of acceptance (how often the sequence's
drafts that reached that depth had it accepted, and the batch's, until the sequence has its own) falls below
b K / T; a probe drafts its whole chain, so the chances of the deeper nodes stay measured. At batch 1 this is the
choice `spec.adaptive` makes between drafting and plain decoding; plain batched decoding (nobody drafts) is always
one of the choices, so the policy only drafts where its measurements say it is faster.

What a drafting sequence costs is measured, not assumed: besides the forwards' T(N), the policy times whole rounds
(drafting, the verify forward, acceptance). Plain rounds give the round time of n sequences without drafts; every
drafted round's excess over that, less its extra rows' T(N) cost, divided by its drafting sequences, is the overhead
d of one drafting sequence (the head's run, its catch-up over positions it skipped, what its weights push out of the
CPU's caches, the bookkeeping of a tree). Until a drafted round has been timed against a plain one, d is the draft
call's own time. A round without drafts is forced every `plain_every` rounds while everybody drafts, so the plain
round time stays current.

A sequence that did not draft in its last step catches up when it drafts again: its drafter reads the positions
it skipped (the prompt, for a new sequence). That is a cost once per switch, not per round, so rounds with such a
sequence do not feed d; their excess over d is the catch-up cost c, charged to probes (below).

What a sequence accepts per drafted step is a running mean that starts from the batch's (as if seen `prior_weight`
times) and then weighs each step 1/n, down to a floor of `smoothing`: the accepted count of one step is a coin flip
per draft depth, and a short memory turns drafting off after a few unlucky steps and keeps it off (a sequence that
does not draft is measured only by its probes): with EAGLE-2's first draft token accepted about half the time, an
average weighing each step 1/4 drafted 9-58% of steps at batch 1 where always drafting ran 1.47x plain decoding
(simulated with the 1.5B's costs on a 2-core AMX machine, as `simulate` in tests/test_load_policy.py does).

A sequence that has not drafted for a while drafts once to refresh what it accepts (the text changes): after
`probe_every` of its plain steps, and after twice as many each time a probe did not make drafting pay (up to 16x),
as spec.adaptive backs off its probes. A new sequence is judged by the batch's acceptance: it drafts at once where
that pays, and otherwise waits for its first probe like the others (with every newcomer probed at once and the
budget below uncapped, the batch ran 6% below plain batched decoding where requests came and went, simulated with
the 1.5B's costs at 8 sequences; see `simulate` in tests/test_load_policy.py).
At most one sequence probes a round, so a busy batch does not pay for many catch-ups at once. Probes are an
exploration budget, bounded in time: a probe's expected loss (its cost, catch-up included, less the time its
expected tokens are worth at the step's rate) is paid from a credit that grows by `probe_share` of each round's
time and holds at most `probe_share` of `probe_horizon` seconds. So where drafting pays nobody, probes cost the
batch about that share of its speed against plain batched decoding, however many sequences come due and however
much a probe's head must catch up on (the catch-up cost is an estimate, from earlier catch-ups); and a long spell
in which drafting paid (no probes) does not bank a burst of probes for when the load rises.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from .tree import DraftTree

# the weight of a new measurement in the estimates that must follow the text quickly: a catch-up's cost (it grows with
# the plain steps skipped) and the chances of acceptance by depth of a chain without scores
QUICK = 0.25


class StepCosts:
    """T(N) = a + b N, fitted by least squares over the last `memory` batched forwards. Until forwards of at least
    two widths have been timed, b = `prior_slope` a (on a 2-core CPU a verify row of the 1.5B cost ~0.15 of a
    one-row step; a prior that errs on the side of plain decoding)."""

    def __init__(self, memory: int = 256, prior_slope: float = 0.15):
        self.samples: deque[tuple[int, float]] = deque(maxlen=memory)
        self.prior_slope = prior_slope
        self.a, self.b = 0.0, 0.0

    @property
    def known(self) -> bool:
        return bool(self.samples)

    def observe(self, rows: int, seconds: float) -> None:
        self.samples.append((rows, seconds))
        n = len(self.samples)
        mean_rows = sum(r for r, _ in self.samples) / n
        mean_time = sum(t for _, t in self.samples) / n
        spread = sum((r - mean_rows) ** 2 for r, _ in self.samples)
        if spread > 0:
            b = sum((r - mean_rows) * (t - mean_time) for r, t in self.samples) / spread
            b = max(b, 0.0)
            a = max(mean_time - b * mean_rows, 0.0)
        else:  # one width timed: split its time between the fixed part and its rows with the prior slope
            a = mean_time / (1.0 + self.prior_slope * mean_rows)
            b = self.prior_slope * a
        self.a, self.b = a, b

    def time(self, rows: int) -> float:
        return self.a + self.b * rows


@dataclass
class Outlook:
    """What one sequence's drafting has been worth lately (exponential moving averages)."""

    accepted: float  # draft tokens accepted per drafted step
    predicted: float = 0.0  # what its trees' scores predicted for the verified nodes
    rows: float = 0.0  # draft rows verified per drafted step
    since_draft: int = 0  # steps since it last drafted
    drafted: int = 0  # drafted steps so far
    probe_period: int = 0  # plain steps before its next probe (0: the policy's probe_every)
    # [d-1]: of its drafts that reached depth d, the share that had depth d accepted (a tree without scores)
    depth_chances: list[float] = field(default_factory=list)

    @property
    def calibration(self) -> float:
        """Accepted per predicted acceptance: how far to trust its draft scores (1 until known)."""
        return min(self.accepted / self.predicted, 2.0) if self.predicted > 0 else 1.0


@dataclass
class Plan:
    """The policy's choice for one step: which sequences draft, and the throughput it expects."""

    draft: set = field(default_factory=set)
    probes: set = field(default_factory=set)  # of them, those drafting to measure, not because it pays
    tokens: float = 0.0  # expected tokens of the step
    seconds: float = 0.0  # expected seconds of the step


class LoadPolicy:
    """Chooses, each step, the sequences that draft and the nodes they verify (module docstring). Sequences are
    keyed by any hashable id; `forget` one that leaves."""

    def __init__(self, tree_rows: int, probe_every: int = 16, smoothing: float = 1 / 32, prior_accepted: float = 1.0,
                 plain_every: int = 64, probe_share: float = 0.01, prior_weight: int = 4,
                 probe_horizon: float = 5.0):
        """`tree_rows`: draft rows of a full tree (the drafter's total_tokens - 1); `probe_share`: the share of the
        rounds' time that probes may lose; `probe_horizon`: the seconds of rounds whose share the probes' credit can
        hold; `smoothing`: the least weight of a new measurement in the running means; `prior_weight`: how many
        steps the batch's acceptance counts for in a new sequence's."""
        self.tree_rows = max(tree_rows, 1)
        self.probe_every, self.smoothing, self.plain_every = probe_every, smoothing, plain_every
        self.prior_weight = prior_weight
        self.probe_share, self.probe_horizon = probe_share, probe_horizon
        self.elapsed = 0.0  # seconds of the rounds timed so far
        self.probe_loss = 0.0  # what the probes so far were expected to lose against plain steps
        self.credit = 0.0  # what probes may still lose: probe_share of the rounds' time, capped (module docstring)
        self.costs = StepCosts()  # verify forwards: seconds by rows (prompt pieces' rows included)
        self.rounds = StepCosts()  # plain rounds: seconds by sequences
        self.draft_seconds = 0.0  # per drafting sequence, the draft call alone (moving average; 0 until measured)
        self.overhead: float | None = None  # per drafting sequence, all it adds to a round but its rows' forward cost
        self.catch_up = 0.0  # what a sequence drafting after plain steps adds beyond `overhead` (0 until measured)
        self.catch_ups = 0  # catch-up rounds measured
        self.since_plain = 0  # rounds since the last one without drafts
        self.prior_accepted = prior_accepted  # what a new sequence is expected to accept (the batch's average)
        self.prior_depth_chances: list[float] = []  # the batch's depth_chances (Outlook), for new sequences
        self.outlooks: dict = {}

    def _outlook(self, key) -> Outlook:
        if key not in self.outlooks:
            self.outlooks[key] = Outlook(accepted=self.prior_accepted, rows=float(self.tree_rows))
        return self.outlooks[key]

    def forget(self, key) -> None:
        self.outlooks.pop(key, None)

    def _blend(self, old: float, new: float, weight: float | None = None) -> float:
        return old + (self.smoothing if weight is None else weight) * (new - old)

    def _weight(self, seen: int) -> float:
        """The weight of a sequence's next measurement after `seen` of its own (its first from the batch's prior)."""
        return max(1.0 / (seen + 1 + self.prior_weight), self.smoothing)

    def catching_up(self, key) -> bool:
        """Whether the sequence's drafter has positions to catch up on if it drafts now (it did not draft in its
        last step, or never drafted)."""
        o = self._outlook(key)
        return o.drafted == 0 or o.since_draft > 0

    # ---- decisions -----------------------------------------------------------------------------------------
    def plan(self, keys: list) -> Plan:
        """Which of the sequences `keys` (all taking part in the next step) draft."""
        n = len(keys)
        base = self.rounds.time(n) if self.rounds.known else self.costs.time(n) if self.costs.known else 0.0
        plan = Plan(tokens=float(n), seconds=base)
        if not self.costs.known:  # nothing timed yet: draft, and learn what it costs
            plan.draft = set(keys)
            return plan
        if self.since_plain >= (self.plain_every if self.rounds.known else 8):
            return plan  # a round without drafts, to time one
        overhead = self.draft_seconds if self.overhead is None else self.overhead
        rows, probed = n, False
        for key in sorted(keys, key=lambda k: -self._outlook(k).accepted):
            o = self._outlook(key)
            extra_rows = max(round(o.rows), 1)
            added = overhead + self.costs.time(rows + extra_rows) - self.costs.time(rows)
            pays = o.accepted * plan.seconds > plan.tokens * added  # g / (d + b r) > K / T
            period = o.probe_period or self.probe_every
            # at most one probe a round: a busy batch does not pay for many sequences' catch-up at once
            probe = not pays and not probed and o.since_draft >= period
            # what the probe costs beyond its worth
            loss = max(added + self.catch_up - o.accepted * plan.seconds / plan.tokens, 0.0)
            # (a probe dearer than the credit can hold waits for a full credit)
            if probe and self.credit < min(loss, self.probe_share * self.probe_horizon):
                probe = False  # the exploration budget is spent: wait
            elif probe:
                self.probe_loss += loss
                self.credit -= loss
            if pays:
                o.probe_period = self.probe_every
            elif probe and o.drafted:  # the next probe of this sequence waits twice as long
                o.probe_period = min(2 * period, 16 * self.probe_every)
            if pays or probe:
                probed |= probe
                plan.draft.add(key)
                if probe and not pays:
                    plan.probes.add(key)
                plan.tokens += o.accepted
                plan.seconds += added
                rows += extra_rows
        return plan

    def prune(self, key, tree: DraftTree, plan: Plan) -> DraftTree:
        """The nodes of `tree` worth verifying in the planned step."""
        if len(tree) <= 2 or not self.costs.known or plan.seconds <= 0:
            return tree
        threshold = self.costs.b * plan.tokens / plan.seconds  # accepted tokens a row must bring
        if tree.scores is None:
            return self._cut_chain(key, tree, threshold, probe=key in plan.probes)
        trust = self._outlook(key).calibration
        chances = sorted((trust * math.exp(s) for s in tree.scores.tolist()[1:]), reverse=True)
        keep = 1 + sum(1 for p in chances if p > threshold)
        return tree.prune(max(keep, 2))  # a drafting sequence verifies one draft node at least

    def _cut_chain(self, key, tree: DraftTree, threshold: float, probe: bool) -> DraftTree:
        """A tree without scores, cut at the first depth whose measured chance of acceptance is below `threshold`
        (whole for a probe, and at depths not measured yet)."""
        if probe:
            return tree
        o = self._outlook(key)
        chances = o.depth_chances or self.prior_depth_chances
        depth = 0
        while depth < tree.max_depth and (depth >= len(chances) or chances[depth] > threshold):
            depth += 1
        return tree if depth == tree.max_depth else tree.truncate_depth(max(depth, 1))

    def _observe_depths(self, chances: list[float], depth: int, accepted: int) -> None:
        """A draft reaching `depth` had `accepted` of its depths accepted: fold it into `chances` in place (a depth
        seen for the first time starts from certainty)."""
        for d in range(depth):
            if d == len(chances):
                chances.append(1.0)
            chances[d] = self._blend(chances[d], float(accepted > d), weight=QUICK)

    # ---- what happened -------------------------------------------------------------------------------------
    def observe_step(self, rows: int, seconds: float, prompt_rows: int = 0) -> None:
        """A batched forward of `rows` decode rows and `prompt_rows` prompt rows took `seconds`."""
        self.costs.observe(rows + prompt_rows, seconds)

    def observe_round(self, sequences: int, drafting: int, rows: int, seconds: float, catching_up: int = 0) -> None:
        """A whole round (drafting, the verify forward of `rows` rows, acceptance) of `sequences` sequences, of which
        `drafting` drafted (`catching_up` of them after plain steps, see `catching_up`), took `seconds`."""
        self.elapsed += seconds
        self.credit = min(self.credit + self.probe_share * seconds, self.probe_share * self.probe_horizon)
        if drafting == 0:
            self.rounds.observe(sequences, seconds)
            self.since_plain = 0
            return
        self.since_plain += 1
        if not self.rounds.known:
            return
        excess = seconds - self.rounds.time(sequences) - (self.costs.time(rows) - self.costs.time(sequences))
        if catching_up:  # a once-per-switch cost: the catch-up estimate, not the steady overhead
            steady = self.draft_seconds if self.overhead is None else self.overhead
            each = max((excess - drafting * steady) / catching_up, 0.0)
            # (the first measurement is taken whole: a cost assumed 0 would let the first probes overspend)
            self.catch_up = self._blend(self.catch_up, each, weight=QUICK if self.catch_ups else 1.0)
            self.catch_ups += 1
            return
        each = max(excess / drafting, 0.0)
        self.overhead = each if self.overhead is None else self._blend(self.overhead, each)

    def observe_draft(self, seconds: float, catching_up: bool = False) -> None:
        """One sequence's drafting took `seconds` (`catching_up`: see `catching_up`; such a draft's time is not the
        steady draft time, and is left out)."""
        if catching_up:
            return
        self.draft_seconds = seconds if self.draft_seconds == 0.0 else self._blend(self.draft_seconds, seconds)

    def observe_sequence(self, key, tree: DraftTree, accepted: int) -> None:
        """The sequence's step verified `tree` (root only when it did not draft) and accepted `accepted` drafts."""
        o = self._outlook(key)
        if len(tree) == 1:
            o.since_draft += 1
            return
        predicted = sum(math.exp(s) for s in tree.scores.tolist()[1:]) if tree.scores is not None else 0.0
        if tree.scores is None:
            if not o.depth_chances:
                o.depth_chances = list(self.prior_depth_chances)  # the batch's, until it has its own
            self._observe_depths(o.depth_chances, tree.max_depth, accepted)
            self._observe_depths(self.prior_depth_chances, tree.max_depth, accepted)
        weight = self._weight(o.drafted)
        o.accepted = self._blend(o.accepted, accepted, weight)
        o.predicted = self._blend(o.predicted, predicted, weight) if o.drafted else predicted
        o.rows = self._blend(o.rows, len(tree) - 1, weight) if o.drafted else float(len(tree) - 1)
        o.drafted += 1
        o.since_draft = 0
        self.prior_accepted = self._blend(self.prior_accepted, accepted)
