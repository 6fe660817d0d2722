"""The defaults are exact: `Engine()` as a user gets it on the machine running the tests (whatever dtype, kernels and
tree `auto` pick here), on the real SmolLM2-135M, gives plain decoding's greedy tokens, across adaptive switches
between drafting and plain rounds, and the server's streamed and non-streamed answers are the same."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from test_serve import LiveServer

from eaglespec import Engine
from eaglespec.spec.adaptive import DRAFT, PLAIN, AdaptiveDrafter, SwitchPolicy

pytestmark = pytest.mark.real_model

# chat prompts whose answers run past 128 tokens
PROMPTS = [
    "Name three colours.",
    "Explain how a hash table works and give a small Python example.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are the main causes of the French Revolution?",
]
NEW_TOKENS = 160


class FlipFlop(SwitchPolicy):
    """Alternates drafting and plain rounds in runs of `run` rounds: every kind of switch, many times, on purpose."""

    def __init__(self, run: int = 3):
        super().__init__(DRAFT)
        self.run, self.rounds = run, 0

    def next_mode(self) -> str:
        self.rounds += 1
        return DRAFT if (self.rounds // self.run) % 2 == 0 else PLAIN


@pytest.fixture(scope="module")
def default_engine():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    engine = Engine()  # every setting at its default
    yield engine
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def plain_answers(default_engine):
    vanilla = Engine.from_model(default_engine.target.model, default_engine.tokenizer, method="vanilla",
                                backend="auto")
    return {p: vanilla.generate(p, max_new_tokens=NEW_TOKENS) for p in PROMPTS}


def test_the_default_engine_drafts_with_the_fast_exact_path(default_engine):
    engine = default_engine
    assert engine.method == "eagle2" and isinstance(engine.drafter, AdaptiveDrafter)
    assert engine.target.dtype == engine.target.model.dtype
    target = engine.target
    # exact by construction: eaglespec's kernels where they run (every layer in one call into them), else
    # row-by-row attention
    assert target.bf16_gemm or target.row_invariant
    assert (target.kernel_stack is not None) == target.tree_kernel


def test_default_greedy_equals_plain_decoding(default_engine, plain_answers):
    engine = default_engine
    long = 0
    for prompt in PROMPTS:
        got = engine.generate(prompt, max_new_tokens=NEW_TOKENS)
        assert got.tokens == plain_answers[prompt].tokens, prompt
        long += len(got.tokens) >= 128
    assert long >= 3  # most answers run 128 tokens or more


@pytest.mark.parametrize("policy", [FlipFlop(3), FlipFlop(1), SwitchPolicy(DRAFT, window=2, period=4, memory=2,
                                                                            max_period=8)],
                         ids=["runs-of-3", "every-round", "adaptive-quick"])
def test_default_greedy_equals_plain_decoding_across_switches(default_engine, plain_answers, policy):
    engine = default_engine
    adaptive = engine.drafter
    saved = adaptive.policy
    adaptive.policy = policy
    try:
        for prompt in PROMPTS[:2]:
            got = engine.generate(prompt, max_new_tokens=NEW_TOKENS)
            assert got.tokens == plain_answers[prompt].tokens, prompt
            assert 0 < got.stats.drafted_forwards < got.stats.target_forwards  # both kinds of rounds ran
    finally:
        adaptive.policy = saved
    if isinstance(policy, FlipFlop):
        assert policy.rounds > 2 * policy.run  # it really switched, several times


def test_served_streamed_and_whole_answers_are_identical(default_engine, plain_answers):
    server = LiveServer(default_engine)
    try:
        with httpx.Client(timeout=120) as http:
            headers = {"Authorization": "Bearer test-key"}
            for prompt in PROMPTS[:3]:
                body = {"model": "tiny-test", "messages": [{"role": "user", "content": prompt}],
                        "max_tokens": NEW_TOKENS, "temperature": 0}
                whole = http.post(server.url + "/v1/chat/completions", json=body, headers=headers).json()
                pieces = []
                with http.stream("POST", server.url + "/v1/chat/completions", json={**body, "stream": True},
                                 headers=headers) as response:
                    for line in response.iter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            chunk = json.loads(line[6:])
                            for choice in chunk.get("choices", []):
                                pieces.append(choice["delta"].get("content") or "")
                text = whole["choices"][0]["message"]["content"]
                assert "".join(pieces) == text == plain_answers[prompt].text, prompt
    finally:
        server.close()
