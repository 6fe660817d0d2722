"""Online adaptation (eaglespec.spec.adaptive): the switch policy follows measured speeds, and switching between
drafting and plain decoding never changes the output (greedy: token for token; sampled: the distribution)."""

import pytest
from conftest import TinyTokenizer, make_model
from test_engine import PROMPTS, random_head, vanilla_tokens
from test_sampling import (
    PARAMS,
    PROMPT,
    RUNS,
    WorstFirstDrafter,
    chi_square_p_value,
    exact_distribution,
)

from eaglespec import Engine, TreeSettings
from eaglespec.spec.adaptive import DRAFT, PLAIN, AdaptiveDrafter, SwitchPolicy, chain_policy
from eaglespec.spec.decode import SpecDecoder
from eaglespec.targets.hf import TargetModel


def feed(policy: SwitchPolicy, seconds: dict[str, float], tokens: dict[str, int], rounds: int) -> list[str]:
    """Run `rounds` rounds with fixed per-mode costs; return the mode of each."""
    modes = []
    for _ in range(rounds):
        mode = policy.next_mode()
        modes.append(mode)
        policy.observe(mode, tokens[mode], seconds[mode])
    return modes


def test_policy_settles_on_the_faster_mode_and_probes_the_other_every_period():
    policy = SwitchPolicy(start=DRAFT, window=4, period=40, max_period=40)  # (no back-off here)
    # drafting: 2 tokens in 15 ms (133/s); plain: 1 token in 10 ms (100/s)
    modes = feed(policy, {DRAFT: 0.015, PLAIN: 0.010}, {DRAFT: 2, PLAIN: 1}, 200)
    assert modes[:4] == [DRAFT] * 4 and modes[4:8] == [PLAIN] * 4  # measure the start mode, then probe the other
    assert policy.chosen == DRAFT and policy.speed(DRAFT) == pytest.approx(2 / 0.015)
    assert modes[8:28] == [DRAFT] * 20  # 40 tokens at 2 a round before the next probe
    assert modes[28:32] == [PLAIN] * 4
    assert 0.1 < modes.count(PLAIN) / len(modes) < 0.2  # one probe of 4 rounds per 20 drafted ones


def test_confirming_probes_back_off_and_a_switch_resets_the_period():
    policy = SwitchPolicy(start=DRAFT, window=4, period=16, max_period=64)
    modes = feed(policy, {DRAFT: 0.015, PLAIN: 0.010}, {DRAFT: 2, PLAIN: 1}, 400)
    runs, run = [], 0  # lengths of the drafted stretches between plain probes
    for mode in modes[8:]:
        if mode == DRAFT:
            run += 1
        elif run:
            runs, run = runs + [run], 0
    # the first probe confirms the start: 32 tokens (2 a round) to the next, then 64, the cap
    assert runs[:4] == [16, 32, 32, 32] and policy.period == 64
    feed(policy, {DRAFT: 0.015, PLAIN: 0.010}, {DRAFT: 1, PLAIN: 1}, 200)  # drafting stops paying
    assert policy.chosen == PLAIN and policy.switches == 1 and policy.period <= 64


def test_policy_switches_when_the_speeds_change():
    policy = SwitchPolicy(start=DRAFT, window=4, period=20, memory=4, max_period=20)
    feed(policy, {DRAFT: 0.015, PLAIN: 0.010}, {DRAFT: 2, PLAIN: 1}, 60)
    assert policy.chosen == DRAFT
    # the text gets harder to predict: drafting now commits 1 token a round
    modes = feed(policy, {DRAFT: 0.015, PLAIN: 0.010}, {DRAFT: 1, PLAIN: 1}, 60)
    assert policy.chosen == PLAIN and policy.switches >= 1
    assert modes[-30:].count(PLAIN) > modes[-30:].count(DRAFT)
    # and easier again
    feed(policy, {DRAFT: 0.015, PLAIN: 0.010}, {DRAFT: 3, PLAIN: 1}, 80)
    assert policy.chosen == DRAFT


def simulated_speed(policy: SwitchPolicy, draft_ms: float, rounds: int = 20000) -> float:
    """Tokens/s of `policy` when a drafted round commits 1 or 2 tokens at random (tau 1.5) in `draft_ms` and a
    plain round 1 token in 10 ms, every round time with 5% noise."""
    import random

    rng, tokens, seconds = random.Random(0), 0, 0.0
    for _ in range(rounds):
        mode = policy.next_mode()
        t = 1 + (rng.random() < 0.5) if mode == DRAFT else 1
        dt = (draft_ms if mode == DRAFT else 10.0) * 1e-3 * (1 + 0.05 * rng.gauss(0, 1))
        policy.observe(mode, t, dt)
        tokens, seconds = tokens + t, seconds + dt
    return tokens / seconds


@pytest.mark.parametrize("draft_ms", [12.0, 14.0, 15.5, 17.0, 25.0])
def test_adaptive_speed_is_close_to_the_faster_mode(draft_ms):
    best = max(1.5 / draft_ms, 1 / 10.0) * 1e3  # tokens/s of always drafting or never
    for start in (DRAFT, PLAIN):
        assert simulated_speed(SwitchPolicy(start), draft_ms) > 0.98 * best


def test_a_long_token_memory_makes_fewer_wrong_switches():
    """Drafting at 14 ms a round (107 tokens/s) against plain decoding at 100: tokens per drafted round are a coin
    flip, so a memory of 8 rounds switches on streaks far more often than one of 64."""
    short, long = SwitchPolicy(DRAFT, memory=8), SwitchPolicy(DRAFT, memory=64)
    simulated_speed(short, 14.0), simulated_speed(long, 14.0)
    assert long.switches < 0.5 * short.switches


def test_policy_ignores_a_stalled_round():
    policy = SwitchPolicy(start=PLAIN, window=5, period=1000)
    feed(policy, {DRAFT: 0.015, PLAIN: 0.010}, {DRAFT: 1, PLAIN: 1}, 10)
    assert policy.chosen == PLAIN
    policy.observe(DRAFT, 1, 0.014)
    policy.observe(PLAIN, 1, 5.0)  # the caller paused once
    assert policy.speed(PLAIN) == pytest.approx(100.0) and policy.next_mode() == PLAIN


def test_mean_timing_sees_the_costly_kind_of_a_mixed_mode():
    """Prompt lookup in draft mode: most rounds find no match and cost a plain step, a few verify a long chain that
    is rejected. The median round time hides those; the mean does not, and then plain decoding is chosen."""
    for timing, chosen in (("median", DRAFT), ("mean", PLAIN)):
        policy = SwitchPolicy(start=DRAFT, window=8, period=16, timing=timing)
        for i in range(64):
            mode = policy.next_mode()
            policy.observe(mode, 1, 0.30 if mode == DRAFT and i % 4 == 0 else 0.08)
        assert policy.chosen == chosen, timing
    with pytest.raises(ValueError, match="timing"):
        SwitchPolicy(timing="mode")


@pytest.mark.parametrize("method", ["pld", "sps"])
def test_chain_methods_adapt_by_default(method):
    """pld, sps and staged switch between drafting and plain decoding with tree auto (the default of Engine()),
    greedy output unchanged; adapt=False keeps them drafting."""
    model = make_model("llama")
    draft = {"draft_hf_model": make_model("llama", seed=1)} if method == "sps" else {}
    engine = Engine.from_model(model, TinyTokenizer(), method=method, tree="auto", **draft)
    assert isinstance(engine.drafter, AdaptiveDrafter) and "adaptive" in engine.notice
    assert engine.drafter.policy.timing == ("mean" if method == "pld" else "median")
    for prompt in PROMPTS[:2]:
        assert engine.generate(prompt, max_new_tokens=20).tokens == vanilla_tokens(model, prompt, 20)
    fixed = Engine.from_model(model, TinyTokenizer(), method=method, tree="auto", adapt=False, **draft)
    assert not isinstance(fixed.drafter, AdaptiveDrafter)


def test_plain_window_shortens_the_probes_of_plain_decoding():
    """A draft model's chain commits many tokens a round: its policy times drafted rounds over 16 and plain ones over
    4, so each probe of plain decoding costs 4 slow rounds, and the choice is the same as with a window of 16."""
    policy = chain_policy("sps")
    assert policy.windows == {DRAFT: 16, PLAIN: 4}
    # drafting: 12 tokens in 200 ms (60/s); plain: 1 token in 80 ms (12.5/s)
    modes = feed(policy, {DRAFT: 0.2, PLAIN: 0.08}, {DRAFT: 12, PLAIN: 1}, 200)
    assert modes[:16] == [DRAFT] * 16 and modes[16:21] == [PLAIN] * 4 + [DRAFT]
    assert policy.chosen == DRAFT and policy.switches == 0
    probes = sum(1 for a, b in zip(modes, modes[1:]) if a == DRAFT and b == PLAIN)
    assert modes.count(PLAIN) == 4 * probes
    # plain decoding faster: the short window still sees it
    modes = feed(chain_policy("sps"), {DRAFT: 0.2, PLAIN: 0.01}, {DRAFT: 1, PLAIN: 1}, 60)
    assert modes[16:20] == [PLAIN] * 4 and modes[-20:].count(PLAIN) > 15
    with pytest.raises(ValueError, match="plain_window"):
        SwitchPolicy(plain_window=0)


def test_policy_rejects_bad_settings():
    with pytest.raises(ValueError, match="start"):
        SwitchPolicy(start="fast")
    with pytest.raises(ValueError, match="positive"):
        SwitchPolicy(window=0)
    with pytest.raises(ValueError, match="positive"):
        SwitchPolicy(memory=0)


class StepClock:
    """A fake clock: each round costs what its mode costs (read from the drafter when the next round starts)."""

    def __init__(self, costs: dict[str, float]):
        self.costs, self.now, self.drafter = costs, 0.0, None

    def __call__(self) -> float:
        if self.drafter.last_mode is not None:
            self.now += self.costs[self.drafter.last_mode]
        return self.now


def adaptive_engine(model, head, costs: dict[str, float], window=2, period=3) -> Engine:
    engine = Engine.from_model(model, TinyTokenizer(), head=head, tree=TreeSettings(total_tokens=6, depth=3, top_k=2))
    clock = StepClock(costs)
    engine.decoder.drafter = clock.drafter = AdaptiveDrafter(engine.drafter, SwitchPolicy(DRAFT, window, period),
                                                             clock=clock)
    return engine


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
def test_switching_modes_keeps_greedy_output_equal_to_vanilla(arch, kind):
    model = make_model(arch)
    # equal costs: drafting wins whenever it commits more than one token a round, so the modes keep alternating
    engine = adaptive_engine(model, random_head(model, kind), {DRAFT: 1.0, PLAIN: 1.0})
    drafted = plain = 0
    for prompt in PROMPTS:
        result = engine.generate(prompt, max_new_tokens=30)
        assert result.tokens == vanilla_tokens(model, prompt, 30), (arch, kind, prompt)
        drafted += result.stats.drafted_forwards
        plain += result.stats.target_forwards - result.stats.drafted_forwards
    assert drafted > 5 and plain > 5  # both modes ran, and the head caught up across plain stretches


def test_adaptive_engine_prefers_plain_decoding_when_drafting_is_slow():
    model = make_model("llama")
    engine = adaptive_engine(model, random_head(model, "eagle1"), {DRAFT: 10.0, PLAIN: 1.0}, window=2, period=12)
    result = engine.generate(PROMPTS[0], max_new_tokens=60)
    assert result.tokens == vanilla_tokens(model, PROMPTS[0], 60)
    assert engine.drafter.policy.chosen == PLAIN
    assert result.stats.drafted_forwards < 0.4 * result.stats.target_forwards  # probes only


class Alternating(SwitchPolicy):
    """Plain and drafted rounds in turn, whatever they measure (a generation here is only one or two rounds)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def next_mode(self) -> str:
        self.count += 1
        return (DRAFT, PLAIN)[self.count % 2]


def test_switching_modes_keeps_the_sampled_distribution():
    model = make_model("llama", seed=7, layers=2)
    exact = exact_distribution(model, 3)
    drafter = AdaptiveDrafter(WorstFirstDrafter(model), Alternating())
    decoder = SpecDecoder(TargetModel(model, feature_kind=None), TinyTokenizer(), drafter, eos_token_ids=[])
    samples, trees = [], []
    for seed in range(RUNS):
        params = type(PARAMS)(PARAMS.temperature, PARAMS.top_p, PARAMS.top_k, seed=seed)
        *steps, finished = decoder.stream(PROMPT, max_new_tokens=3, sampling=params)
        samples.append(tuple(finished.tokens))
        trees += [s.tree_size for s in steps[1:]]
    assert chi_square_p_value(samples, exact) > 1e-3
    assert trees.count(1) > 0.2 * len(trees) and len(trees) - trees.count(1) > 0.2 * len(trees)
