"""`eaglespec serve`: the OpenAI-compatible server, started on a loopback port and driven with the official
`openai` client and raw httpx.

Most tests use tiny Llama targets with the real SmolLM2 tokenizer (so chat templates and detokenisation are
real). The main one is built so its draft head agrees with it by construction (the target is a bigram model
whose logits are W . norm(embed(x)); the head passes embed(x_{t+1}) through unchanged and its logits are
W . embed(x_{t+1}) with unit-RMS embeddings, the same), so speculative decoding accepts long chains and the
spec-decode counters are exercised for real. The others use a random head (little is accepted, generation is
slow enough to cancel or time out). A few tests run the real SmolLM2-135M.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
import torch
import transformers
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from eaglespec.api import Engine
from eaglespec.cli import build_parser
from eaglespec.heads import HeadConfig, build_head
from eaglespec.models import load_target, shipped_head_dir
from eaglespec.serve import ServerConfig, create_app
from eaglespec.serve.batch_worker import BatchWorker
from eaglespec.serve.thread import GenerationThread
from eaglespec.targets.hf import TargetModel

MODEL = "tiny-test"
KEY = "test-key"
CONTEXT = 256
HIDDEN = 32


# ---- fixtures ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models on a shared 2-core machine run far faster with one intra-op thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def smollm():
    return load_target("smollm2-135m")


@pytest.fixture(scope="module")
def tokenizer(smollm):
    return smollm[1]


def tiny_target(vocab: int, seed: int, agreeable: bool) -> transformers.LlamaForCausalLM:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CONTEXT)
    model = transformers.LlamaForCausalLM(config).eval().requires_grad_(False)
    with torch.no_grad():
        model.lm_head.weight.mul_(100.0)  # sharp next-token distributions
        if agreeable:
            for layer in model.model.layers:  # the residual stream stays embed(x): a bigram model
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
            emb = model.model.embed_tokens.weight
            emb.div_(emb.pow(2).mean(-1, keepdim=True).sqrt())  # unit RMS, so the final norm is the identity
    return model


def tiny_engine(tokenizer, seed: int = 0, agreeable: bool = True) -> Engine:
    model = tiny_target(len(tokenizer), seed, agreeable)
    head = build_head(HeadConfig.for_target(TargetModel(model), "eagle1", bias=False)).eval().requires_grad_(False)
    if agreeable:
        with torch.no_grad():  # head output = embed(x_{t+1}): the target's next feature exactly
            head.fc.weight.zero_()
            head.fc.weight[:, :HIDDEN] = torch.eye(HIDDEN)
            head.layers[0].self_attn.o_proj.weight.zero_()
            head.layers[0].mlp.down_proj.weight.zero_()
    return Engine.from_model(model, tokenizer, head=head, method="eagle2")


class LiveServer:
    """uvicorn serving an app on a free loopback port, in a background thread."""

    def __init__(self, engine: Engine, thread: GenerationThread | None = None, **config):
        self.engine = engine
        self.config = ServerConfig(model_name=MODEL, api_key=KEY, **config)
        self.app = create_app(engine, self.config, thread)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.02)

    def client(self, key: str = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=60)

    def post(self, path: str, body, key: str | None = KEY, **kwargs) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        content = body if isinstance(body, (bytes, str)) else json.dumps(body)
        return httpx.post(self.url + path, content=content, headers=headers, timeout=60, **kwargs)

    def get(self, path: str, key: str | None = KEY) -> httpx.Response:
        return httpx.get(self.url + path, headers={"Authorization": f"Bearer {key}"} if key else {}, timeout=30)

    def metrics(self) -> dict[tuple, float]:
        text = self.get("/metrics").text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                out[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name")))] = s.value
        return out

    def wait_idle(self, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            h = self.get("/health", key=None).json()
            if h["running"] == 0 and h["waiting"] == 0:
                return
            assert time.monotonic() < deadline, f"the worker is still busy: {h}"
            time.sleep(0.05)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def metric(values: dict, name: str, **labels) -> float:
    want = tuple(sorted(labels.items()))
    return sum(v for (n, lab), v in values.items() if n == name and all(item in lab for item in want))


def delta(after: dict, before: dict, name: str, **labels) -> float:
    return metric(after, name, **labels) - metric(before, name, **labels)


# Every test on `live` and `slow` runs against both workers: one request at a time, and the batch decoder
# (continuous batching). The batched one drafts for every sequence at every step ("always"), as the one-at-a-time
# engine with its fixed tree does, so seeded sampling draws the same random numbers in both.
@pytest.fixture(scope="module", params=[1, 4], ids=["one-at-a-time", "batched"])
def live(tokenizer, request):
    server = LiveServer(tiny_engine(tokenizer), max_batch=request.param, speculate="always")
    yield server
    server.close()


@pytest.fixture(scope="module", params=[1, 2], ids=["one-at-a-time", "batched"])
def slow(tokenizer, request):
    """A random-head engine (tau ~ 1, about one token per step) and a queue of one. Both workers draft at every step
    (the batched one too: "always"), so a generation takes as long on either and clients can leave mid-way."""
    server = LiveServer(tiny_engine(tokenizer, seed=1, agreeable=False), max_queue=1, max_batch=request.param,
                        speculate="always")
    yield server
    server.close()


@pytest.fixture()
def client(live):
    return live.client()


CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three birds."}]


@pytest.mark.parametrize("max_batch", [1, 2], ids=["one-at-a-time", "batched"])
def test_the_server_decodes_on_the_thread_that_built_its_engine(tokenizer, max_batch):
    """`serve` builds its engine on the generation thread and decodes there (serve/thread.py: with the engine built
    on another thread, a second OpenMP team made every decode step wait for sleeping threads: half the speed)."""
    thread = GenerationThread()
    engine = thread.call(tiny_engine, tokenizer)
    home = thread.call(threading.get_ident)
    server = LiveServer(engine, thread, max_batch=max_batch)
    seen = set()
    try:
        worker = server.app.state.server.worker
        assert worker.thread is thread
        target = worker.batch.pool if max_batch > 1 else engine.target
        forward = target.forward
        target.forward = lambda *a, **k: seen.add(threading.get_ident()) or forward(*a, **k)
        reply = server.client().chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0)
        assert reply.choices[0].message.content
    finally:
        server.close()
    assert seen == {home} and home != threading.get_ident()
    with pytest.raises(ZeroDivisionError):  # a failure on the thread reaches the caller; the thread goes on
        thread.call(lambda: 1 / 0)
    assert thread.call(lambda: 6 * 7) == 42


# ---- OpenAI client: chat and completions ---------------------------------------------------------------------
def test_chat_greedy_equals_library_and_vanilla(live, client, tokenizer):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=40, temperature=0)
    live.wait_idle()  # (the worker resets the engine's caches after it answers: not while we use the engine here)
    ref = live.engine.generate(CHAT, max_new_tokens=40)
    vanilla = Engine.from_model(live.engine.target.model, tokenizer, method="vanilla").generate(CHAT,
                                                                                              max_new_tokens=40)
    assert r.object == "chat.completion" and r.model == MODEL and r.id.startswith("chatcmpl-")
    choice = r.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == ref.text == vanilla.text
    assert choice.finish_reason == ref.stats.finish_reason
    u = r.usage
    assert u.prompt_tokens == len(live.engine.encode(CHAT)) == ref.stats.prompt_tokens
    assert u.completion_tokens == len(ref.tokens) and u.total_tokens == u.prompt_tokens + u.completion_tokens
    ext = u.model_extra["eaglespec"]
    assert ext["method"] == "eagle2"
    assert ext["target_forwards"] == ref.stats.target_forwards
    assert ext["tau"] == pytest.approx(ref.stats.tau, abs=1e-3) and ext["tau"] > 2.0  # the head agrees
    assert ext["accepted_tokens"] == sum(ref.stats.accept_lengths) - len(ref.stats.accept_lengths)
    assert ext["draft_tokens"] >= ext["accepted_tokens"] > 0


def test_chat_streaming_chunks_and_usage(live, client):
    full = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=30)
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=30, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    content = [c for c in chunks[:-1] if c.choices[0].delta.content]
    assert len(content) > 1  # streamed in pieces, not all at once
    assert "".join(c.choices[0].delta.content for c in content) == full.choices[0].message.content
    assert chunks[-2].choices[0].finish_reason == full.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-2])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])
    # Without include_usage no chunk carries usage.
    plain = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5, stream=True))
    assert all(c.usage is None and c.choices for c in plain)


def test_sse_wire_format(live):
    r = live.post("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 8, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [e for e in r.text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]" and r.text.endswith("data: [DONE]\n\n")
    for e in events[:-1]:
        json.loads(e.removeprefix("data: "))


def test_completions_raw_prompt(live, client):
    prompt = "The quick brown fox"
    live.wait_idle()  # (an earlier test's request may still be resetting the engine)
    ref = live.engine.generate(prompt, max_new_tokens=25, chat=False)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=25)
    assert r.object == "text_completion" and r.choices[0].text == ref.text
    assert r.usage.prompt_tokens == len(live.engine.encode(prompt, chat=False)) < 10  # no chat template
    streamed = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=25, stream=True,
                                              stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == ref.text
    assert streamed[-1].usage.completion_tokens == r.usage.completion_tokens
    ids = live.engine.encode(prompt, chat=False)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=25)
    assert by_ids.choices[0].text == ref.text
    # OpenAI's default max_tokens for completions is 16.
    assert client.completions.create(model=MODEL, prompt=prompt).usage.completion_tokens == 16


def test_stop_strings(live, client):
    base = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=30).choices[0].text
    words = base.split()
    stop = words[3]
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=30, stop=[stop, "zzzz"])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == base[: base.index(stop)]
    single = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=30, stop=stop)
    assert single.choices[0].text == r.choices[0].text


def test_seeded_sampling_is_reproducible(live, client):
    kwargs = dict(model=MODEL, messages=CHAT, max_tokens=12, temperature=0.9, top_p=0.95, seed=1234)
    a = client.chat.completions.create(**kwargs).choices[0].message.content
    b = client.chat.completions.create(**kwargs).choices[0].message.content
    c = client.chat.completions.create(**kwargs, extra_body={"top_k": 50}).choices[0].message.content
    live.wait_idle()
    ref = live.engine.generate(CHAT, max_new_tokens=12, temperature=0.9, top_p=0.95, seed=1234).text
    ref_k = live.engine.generate(CHAT, max_new_tokens=12, temperature=0.9, top_p=0.95, top_k=50, seed=1234).text
    assert a == b == ref and c == ref_k


def test_models_and_health(live, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].owned_by == "eaglespec" and models.data[0].model_extra["max_model_len"] == CONTEXT
    h = live.get("/health", key=None)
    assert h.status_code == 200 and h.json()["status"] == "ok" and h.json()["method"] == "eagle2"


def test_api_key_required_except_health(live):
    with pytest.raises(openai.AuthenticationError):
        live.client(key="wrong").chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2)
    for path in ("/v1/models", "/metrics"):
        for key in (None, "wrong", KEY + "x"):
            r = live.get(path, key=key)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = live.post("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2}, key=None)
    assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
    assert live.get("/health", key=None).status_code == 200
    assert live.post("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2}).status_code == 200


# ---- bad input -----------------------------------------------------------------------------------------------
LONG_PROMPT = "hello " * (CONTEXT + 10)
USER = [{"role": "user", "content": "hi"}]
BAD_REQUESTS = [
    # (endpoint, body, status, param, fragment of the message)
    ("chat", b'{"model": "tiny-test", "messages": [', 400, None, "not valid JSON"),
    ("chat", b"", 400, None, "not valid JSON"),
    ("chat", b"[1, 2]", 400, None, "JSON object"),
    ("chat", {"model": MODEL, "messages": "hi"}, 400, "messages", "valid array"),
    ("chat", {"model": MODEL, "messages": USER, "max_tokens": "5"}, 400, "max_tokens", "valid integer"),
    ("chat", {"model": MODEL, "messages": USER, "max_tokens": 5.5}, 400, "max_tokens", "valid integer"),
    ("chat", {"model": MODEL, "messages": USER, "stream": "yes"}, 400, "stream", "valid boolean"),
    ("chat", {"model": MODEL, "messages": USER, "temperature": "hot"}, 400, "temperature", "valid number"),
    ("chat", {"model": MODEL, "messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content", "string"),
    ("chat", {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role", "user"),
    ("chat", {"model": MODEL, "messages": USER, "max_tokens": -5}, 400, "max_tokens", "greater than or equal to 1"),
    ("chat", {"model": MODEL, "messages": USER, "max_tokens": 0}, 400, "max_tokens", "greater than or equal to 1"),
    ("chat", {"model": MODEL, "messages": USER, "max_tokens": 10**12}, 400, "max_tokens", "limit of 2048"),
    ("chat", {"model": MODEL, "messages": USER, "max_tokens": 2000}, 400, "messages", "context of 256"),
    ("chat", {"model": MODEL, "messages": USER, "temperature": 2.5}, 400, "temperature", "less than or equal to 2"),
    ("chat", {"model": MODEL, "messages": USER, "temperature": -0.1}, 400, "temperature", "greater than or equal"),
    ("chat", {"model": MODEL, "messages": USER, "top_p": 0}, 400, "top_p", "greater than 0"),
    ("chat", {"model": MODEL, "messages": USER, "top_k": -1}, 400, "top_k", "greater than or equal to 0"),
    ("chat", {"model": "gpt-4o", "messages": USER}, 404, "model", "does not exist"),
    ("chat", {"model": MODEL, "messages": USER, "logit_bias": {"1": 5}}, 400, "logit_bias", "Unsupported parameter"),
    ("chat", {"model": MODEL, "messages": USER, "tools": []}, 400, "tools", "Unsupported parameter"),
    ("chat", {"model": MODEL, "messages": [{"role": "user", "content": "hi", "name": "bob"}]}, 400,
     "messages[0].name", "Unsupported parameter"),
    ("chat", {"model": MODEL, "messages": USER, "presence_penalty": 0.5}, 400, "presence_penalty", "not supported"),
    ("chat", {"model": MODEL, "messages": USER, "logprobs": True}, 400, "logprobs", "not supported"),
    ("chat", {"model": MODEL, "messages": []}, 400, "messages", "at least 1"),
    ("chat", {"model": MODEL}, 400, "messages", "Missing required parameter"),
    ("chat", {"model": MODEL, "messages": USER, "n": 2}, 400, "n", "only n=1"),
    ("chat", {"model": MODEL, "messages": USER, "stream_options": {"include_usage": True}}, 400, None,
     "stream_options is only allowed"),
    ("chat", {"model": MODEL, "messages": USER, "stream": True, "stream_options": {"x": 1}}, 400,
     "stream_options.x", "Unsupported parameter"),
    ("chat", {"model": MODEL, "messages": USER, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", "at most 4"),
    ("chat", {"model": MODEL, "messages": [{"role": "user", "content": LONG_PROMPT}]}, 400, "messages",
     "context of 256"),
    ("completions", {"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 4}, 400, "prompt", "context of 256"),
    ("completions", {"model": MODEL, "prompt": "hi", "max_tokens": CONTEXT}, 400, "prompt", "context of 256"),
    ("completions", {"model": MODEL, "prompt": ""}, 400, "prompt", "empty"),
    ("completions", {"model": MODEL, "prompt": ["a", "b"]}, 400, "prompt", "one prompt per request"),
    ("completions", {"model": MODEL, "prompt": [1, 10**9]}, 400, "prompt", "outside the vocabulary"),
    ("completions", {"model": MODEL, "prompt": "hi", "echo": True}, 400, "echo", "not supported"),
    ("completions", {"model": MODEL, "prompt": "hi", "best_of": 3}, 400, "best_of", "best_of=1"),
    ("completions", {"model": MODEL, "prompt": "hi", "seed": 2**70}, 400, "seed", "less than or equal"),
]


@pytest.mark.parametrize("endpoint,body,status,param,fragment", BAD_REQUESTS,
                         ids=[f"{i}-{b[3] or b[4][:20]}" for i, b in enumerate(BAD_REQUESTS)])
def test_bad_input_is_rejected_and_server_keeps_serving(live, endpoint, body, status, param, fragment):
    r = live.post(f"/v1/{'chat/completions' if endpoint == 'chat' else 'completions'}", body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert fragment in err["message"], err["message"]
    assert live.get("/health", key=None).json()["running"] == 0  # rejected before any work
    ok = live.post("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 1


def test_neutral_values_of_unsupported_features_are_accepted(live):
    body = {"model": MODEL, "max_completion_tokens": 3, "presence_penalty": 0,
            "frequency_penalty": 0.0, "logprobs": False, "n": 1,
            "messages": [{"role": "developer", "content": [{"type": "text", "text": "Be brief."}]}, *USER]}
    r = live.post("/v1/chat/completions", body)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_unknown_endpoint_and_method_use_error_shape(live):
    r = live.get("/v1/embeddings")
    assert r.status_code == 404 and "error" in r.json()
    r = live.get("/v1/chat/completions")
    assert r.status_code == 405 and "error" in r.json()


def test_reset_prefix_cache_needs_the_key_and_says_whether_there_is_a_cache(live):
    assert live.post("/reset_prefix_cache", {}, key=None).status_code == 401
    r = live.post("/reset_prefix_cache", {})
    # (the tiny float32 target reads prompts whole: no prefix cache, spec/prefix.py)
    assert r.status_code == 200 and r.json() == {"object": "prefix_cache_reset", "reset": False}


# ---- metrics -------------------------------------------------------------------------------------------------
def test_metrics_add_up(live, client):
    before = live.metrics()
    usages = [client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=30).usage,
              client.completions.create(model=MODEL, prompt="Tell me", max_tokens=20).usage]
    stream = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=25, stream=True,
                                            stream_options={"include_usage": True})
    usages.append(list(stream)[-1].usage)
    assert live.post("/v1/chat/completions", {"model": "nope", "messages": USER}).status_code == 404
    live.wait_idle()
    after = live.metrics()
    ext = [u.model_extra["eaglespec"] for u in usages]
    assert delta(after, before, "eaglespec:requests_total") == 4
    assert delta(after, before, "eaglespec:request_errors_total", code="404") == 1
    assert delta(after, before, "eaglespec:request_success_total") == 3
    assert delta(after, before, "eaglespec:prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert delta(after, before, "eaglespec:generation_tokens_total") == sum(u.completion_tokens for u in usages)
    assert delta(after, before, "eaglespec:spec_decode_num_target_forwards_total") == sum(
        e["target_forwards"] for e in ext)
    assert delta(after, before, "eaglespec:spec_decode_num_draft_tokens_total") == sum(e["draft_tokens"] for e in ext)
    accepted = delta(after, before, "eaglespec:spec_decode_num_accepted_tokens_total")
    assert accepted == sum(e["accepted_tokens"] for e in ext) > 0
    per_pos = [delta(after, before, "eaglespec:spec_decode_num_accepted_tokens_per_pos_total", position=str(p))
               for p in range(8)]
    assert sum(per_pos) == accepted and per_pos[0] > 0 and per_pos == sorted(per_pos, reverse=True)
    drafts = delta(after, before, "eaglespec:spec_decode_num_drafts_total")
    assert drafts == delta(after, before, "eaglespec:spec_decode_num_drafts_per_pos_total", position="0")
    for p in range(8):  # a depth can only be accepted where it was drafted
        assert per_pos[p] <= delta(after, before, "eaglespec:spec_decode_num_drafts_per_pos_total", position=str(p))
    forwards = metric(after, "eaglespec:spec_decode_num_target_forwards_total")
    assert metric(after, "eaglespec:spec_decode_mean_accepted_length") == pytest.approx(
        (metric(after, "eaglespec:spec_decode_num_accepted_tokens_total") + forwards) / forwards)
    for name in ("e2e_request_latency_seconds", "time_to_first_token_seconds", "request_queue_time_seconds"):
        assert delta(after, before, f"eaglespec:{name}_count") == 3
    assert metric(after, "eaglespec:generation_tokens_per_second") > 0
    assert metric(after, "eaglespec:num_requests_running") == 0 == metric(after, "eaglespec:num_requests_waiting")


# ---- faults: disconnects, full queue, timeout, concurrency -----------------------------------------------------
def _stream(server: LiveServer, http: httpx.Client, max_tokens: int):
    return http.stream("POST", server.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                       json={"model": MODEL, "prompt": "Once upon a time", "max_tokens": max_tokens, "stream": True})


def _first_text(response: httpx.Response):
    """Read up to the first text chunk; return the line iterator, which the caller must keep referenced: an
    abandoned httpx line iterator closes its connection (the server would see the client leave)."""
    lines = response.iter_lines()
    for line in lines:
        if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["text"]:
            return lines
    raise AssertionError("the stream ended without text")


def _assert_freed(server: LiveServer) -> None:
    """The target's KV caches and the head's caches hold no sequence (reset right after the job ended); with the
    batch decoder, every slot is free."""
    worker = server.app.state.server.worker
    if isinstance(worker, BatchWorker):
        batch = worker.batch
        assert batch.pool.in_use == 0 and not batch.busy and not worker.jobs
        assert all(target.cache_len == 0 for target in batch.pool.targets)
        assert all(len(drafter.inner.cache) == 0 for drafter in batch.drafters)
        return
    assert server.engine.target.cache_len == 0
    assert len(server.engine.drafter.cache) == 0


def test_client_disconnect_cancels_generation(slow):
    before = slow.metrics()
    with httpx.Client(timeout=60) as http:
        with _stream(slow, http, max_tokens=240) as response:
            assert response.status_code == 200
            _first_text(response)
        # the response is closed here: the client is gone mid-stream
    slow.wait_idle()
    after = slow.metrics()
    assert delta(after, before, "eaglespec:request_cancelled_total") == 1
    assert delta(after, before, "eaglespec:request_success_total") == 0
    assert 1 <= delta(after, before, "eaglespec:generation_tokens_total") < 240
    _assert_freed(slow)
    # A non-streaming client that gives up is noticed too.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(slow.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=0.5,
                   json={"model": MODEL, "prompt": "Once upon a time", "max_tokens": 240})
    slow.wait_idle()
    assert delta(slow.metrics(), before, "eaglespec:request_cancelled_total") == 2
    _assert_freed(slow)
    r = slow.client().completions.create(model=MODEL, prompt="Hello", max_tokens=3)
    assert r.usage.completion_tokens == 3


def test_full_queue_answers_503(slow):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    batch = slow.config.max_batch
    with httpx.Client(timeout=60) as http, contextlib.ExitStack() as streams:
        lines = []  # these are being generated, one per slot: each is running before the next is sent (else the
        for _ in range(batch):  # next could find the first still in the queue of one, and get a 503 itself)
            lines.append(_first_text(streams.enter_context(_stream(slow, http, max_tokens=240))))
        with _stream(slow, http, max_tokens=240) as waiting:  # this one fills the queue (size 1)
            assert waiting.status_code == 200
            health = slow.get("/health", key=None).json()
            assert (health["running"], health["waiting"]) == (batch, 1)
            r = slow.post("/v1/completions", body)
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "queue_full"
            for line in lines:  # the running ones still stream
                assert next(line).startswith("data: ") or next(line).startswith("data: ")
    slow.wait_idle()
    _assert_freed(slow)
    assert slow.post("/v1/completions", body).status_code == 200


def test_request_timeout(tokenizer):
    server = LiveServer(tiny_engine(tokenizer, seed=2, agreeable=False), timeout=1.0)
    try:
        r = server.post("/v1/completions", {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 240})
        assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
        with pytest.raises(openai.APIError, match="longer than the server's limit"):
            for _ in server.client().completions.create(model=MODEL, prompt="Once upon a time", max_tokens=240,
                                                        stream=True):
                pass
        server.wait_idle()
        _assert_freed(server)
        after = server.metrics()
        assert metric(after, "eaglespec:request_errors_total", code="504") == 2
        assert server.post("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2}).status_code == 200
    finally:
        server.close()


def test_concurrent_streams_with_early_disconnects(live):
    prompts = [f"Story number {i}:" for i in range(8)]
    live.wait_idle()
    expected = {p: live.engine.generate(p, max_new_tokens=40, chat=False).text for p in prompts}
    results: dict[str, str] = {}
    errors: list[BaseException] = []

    def run(i: int, prompt: str) -> None:
        try:
            with httpx.Client(timeout=120) as http:
                with http.stream("POST", live.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                                 json={"model": MODEL, "prompt": prompt, "max_tokens": 40, "stream": True}) as resp:
                    assert resp.status_code == 200
                    text, done = "", False
                    for line in resp.iter_lines():
                        if i % 3 == 0 and text:
                            return  # leave early
                        if line == "data: [DONE]":
                            done = True
                        elif line.startswith("data: "):
                            text += json.loads(line[6:])["choices"][0]["text"]
                    assert done
                    results[prompt] = text
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i, p)) for i, p in enumerate(prompts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert set(results) == {p for i, p in enumerate(prompts) if i % 3}
    for prompt, text in results.items():
        assert text == expected[prompt]
    live.wait_idle()
    _assert_freed(live)
    assert live.get("/health", key=None).json()["status"] == "ok"


# ---- command line ----------------------------------------------------------------------------------------------
def test_serve_defaults_bind_loopback():
    args = build_parser().parse_args(["serve"])
    assert (args.host, args.port, args.api_key, args.model, args.method) == ("127.0.0.1", 8000, None,
                                                                              "smollm2-135m", "eagle2")
    assert (args.max_batch, args.speculate) == (None, "auto")  # None: the machine's default (default_max_batch)
    args = build_parser().parse_args(["serve", "--max-batch", "3", "--speculate", "never"])
    assert (args.max_batch, args.speculate) == (3, "never")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--max-batch", "0"])


def test_batched_requests_share_steps(tokenizer):
    """Concurrent requests on the batch decoder (load-aware drafting): each answer is the library's, the steps are
    shared (fewer batched steps than the requests' verify forwards), and the batch metrics add up."""
    server = LiveServer(tiny_engine(tokenizer), max_batch=4, speculate="auto")
    try:
        prompts = [f"Tale {i}:" for i in range(6)]
        expected = {p: server.engine.generate(p, max_new_tokens=96, chat=False) for p in prompts}
        before = server.metrics()
        answers: dict[str, str] = {}

        def run(prompt: str) -> None:
            r = server.client().completions.create(model=MODEL, prompt=prompt, max_tokens=96)
            answers[prompt] = r.choices[0].text

        threads = [threading.Thread(target=run, args=(p,)) for p in prompts]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert answers == {p: ref.text for p, ref in expected.items()}
        server.wait_idle()
        _assert_freed(server)
        after = server.metrics()
        steps = delta(after, before, "eaglespec:batch_steps_total")
        forwards = delta(after, before, "eaglespec:spec_decode_num_target_forwards_total")
        sequences = (delta(after, before, "eaglespec:batch_sequences_drafted_total")
                     + delta(after, before, "eaglespec:batch_sequences_plain_total"))
        assert 0 < steps < forwards  # sequences verified together
        assert sequences == forwards  # every verify forward of a request is one sequence of a batched step
        assert delta(after, before, "eaglespec:batch_rows_total") >= forwards
        assert server.get("/health", key=None).json()["max_batch"] == 4
    finally:
        server.close()


# ---- the real SmolLM2-135M -----------------------------------------------------------------------------------
@pytest.mark.real_model
def test_real_model_greedy_output_equals_library(smollm):
    model, tokenizer = smollm
    torch.manual_seed(0)
    head = build_head(HeadConfig.for_target(TargetModel(model), "eagle1")).eval().requires_grad_(False)
    engine = Engine.from_model(model, tokenizer, head=head, method="eagle2")
    server = LiveServer(engine)
    try:
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        r = server.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=16)
        ref = engine.generate(messages, max_new_tokens=16)
        vanilla = Engine.from_model(model, tokenizer, method="vanilla").generate(messages, max_new_tokens=16)
        assert r.choices[0].message.content == ref.text == vanilla.text
        assert "Paris" in ref.text
        assert r.usage.completion_tokens == len(ref.tokens)
        assert r.usage.model_extra["eaglespec"]["target_forwards"] == ref.stats.target_forwards
    finally:
        server.close()


@pytest.mark.real_model
def test_cli_serve_default_model_with_env_api_key():
    """`eaglespec serve` with only a port: the embedded default model (and its shipped head, if any)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, EAGLESPEC_API_KEY="env-secret")
    # A fixed tree: no one-time tree calibration inside the start-up deadline (tests/test_autotree.py covers it).
    proc = subprocess.Popen([sys.executable, "-m", "eaglespec.cli", "serve", "--port", str(port), "--threads", "1",
                             "--tree", "16,5,4", "--log-level", "warning"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                health = httpx.get(url + "/health", timeout=2)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "eaglespec serve did not come up"
                time.sleep(0.5)
        expected_method = "eagle2" if shipped_head_dir("smollm2-135m") else "vanilla"
        assert health.json()["method"] == expected_method and health.json()["model"] == "smollm2-135m"
        assert health.json()["max_batch"] == 8  # the CPU default: continuous batching
        assert httpx.get(url + "/v1/models", timeout=10).status_code == 401
        c = openai.OpenAI(base_url=url + "/v1", api_key="env-secret", max_retries=0, timeout=60)
        assert [m.id for m in c.models.list().data] == ["smollm2-135m"]
        r = c.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
        assert r.usage.completion_tokens >= 1 and r.choices[0].message.content
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
    # uvicorn shuts down gracefully on SIGTERM, then re-raises the signal as the process's exit status.
    assert proc.returncode in (0, -signal.SIGTERM), out
    assert "Traceback" not in out, out
