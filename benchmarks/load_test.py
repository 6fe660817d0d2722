"""Bounded load test of `eaglespec serve`: many concurrent streaming clients, some of which leave early.

    python benchmarks/load_test.py                       # starts `eaglespec serve` (default model) on a free port
    python benchmarks/load_test.py --url http://127.0.0.1:8000 --api-key KEY   # or test a running server

It checks that
  * every client that stayed got a complete, valid answer: 200, well-formed SSE chunks ending with
    `data: [DONE]`, a finish reason, a usage chunk whose completion_tokens match, and (greedy decoding) the same
    text as every other client that sent the same prompt;
  * every client that left early had its generation cancelled: the server's request_cancelled counter grows by
    the number of leavers, their generated tokens stay below max_tokens, nothing is left running or waiting;
  * the server is still healthy afterwards (and, when this script started it, its memory did not run away);
and prints requests, failures, p50/p95 latency and tokens/s as a markdown table (--json writes them too).
Only loopback addresses are accepted; clients, tokens and the total time are capped.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import httpx
from prometheus_client.parser import text_string_to_metric_families

PROMPTS = [
    "Give me three tips for learning to cook.",
    "What is the difference between weather and climate?",
    "Write a haiku about a lighthouse.",
    "Explain what a hash table is in two sentences.",
    "Name four planets and one fact about each.",
    "How do bees make honey?",
    "Suggest a name for a small coffee shop.",
    "Why is the sky blue?",
]
MAX_CLIENTS, MAX_TOKENS, MAX_TOTAL_S = 128, 512, 1800


@dataclass
class Outcome:
    client: int
    prompt: str
    leave_after: int | None  # chunks after which this client disconnects on purpose (None: stays)
    status: int = 0
    text: str = ""
    chunks: int = 0
    finish_reason: str | None = None
    usage: dict | None = None
    done: bool = False
    error: str | None = None
    latency: float = 0.0  # request sent -> [DONE] (or -> leaving)
    ttft: float | None = None
    problems: list[str] = field(default_factory=list)

    @property
    def left(self) -> bool:
        return self.leave_after is not None and self.error is None and not self.done


def _check_loopback(url: str) -> None:
    host = urlparse(url).hostname or ""
    try:
        ok = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        ok = False
    if not ok:
        raise SystemExit(f"refusing to load-test {url}: only loopback addresses (127.0.0.1, ::1, localhost)")


async def one_client(http: httpx.AsyncClient, url: str, model: str, o: Outcome, max_tokens: int) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": o.prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    try:
        async with http.stream("POST", url + "/v1/chat/completions", json=body) as response:
            o.status = response.status_code
            if response.status_code != 200:
                o.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return
            async for line in response.aiter_lines():
                if not line:
                    continue
                if not line.startswith("data: "):
                    o.problems.append(f"not an SSE data line: {line[:60]!r}")
                    continue
                data = line[6:]
                if data == "[DONE]":
                    o.done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    o.error = f"stream error: {chunk['error'].get('message')}"
                    return
                if chunk.get("usage"):
                    o.usage = chunk["usage"]
                for choice in chunk.get("choices", []):
                    piece = choice.get("delta", {}).get("content") or ""
                    if piece and o.ttft is None:
                        o.ttft = time.perf_counter() - start
                    o.text += piece
                    o.finish_reason = choice.get("finish_reason") or o.finish_reason
                o.chunks += 1
                if o.leave_after is not None and o.chunks >= o.leave_after:
                    break  # leaving the `async with` closes the connection mid-stream
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        o.error = f"{type(exc).__name__}: {exc}"
    finally:
        o.latency = time.perf_counter() - start


def validate(outcomes: list[Outcome], max_tokens: int) -> None:
    for o in outcomes:
        if o.error or o.left:
            continue
        if not o.done:
            o.problems.append("stream ended without data: [DONE]")
        if o.finish_reason not in ("stop", "length"):
            o.problems.append(f"finish_reason {o.finish_reason!r}")
        if not o.usage:
            o.problems.append("no usage chunk")
        else:
            n = o.usage.get("completion_tokens", 0)
            if not 1 <= n <= max_tokens or (o.finish_reason == "length" and n != max_tokens):
                o.problems.append(f"completion_tokens {n} does not fit finish_reason {o.finish_reason}")
            if o.usage.get("total_tokens") != o.usage.get("prompt_tokens", 0) + n:
                o.problems.append("total_tokens != prompt_tokens + completion_tokens")
        if not o.text:
            o.problems.append("empty text")
    by_prompt: dict[str, set[str]] = {}
    for o in outcomes:
        if o.done and not o.error:
            by_prompt.setdefault(o.prompt, set()).add(o.text)
    for prompt, texts in by_prompt.items():
        if len(texts) > 1:
            for o in outcomes:
                if o.prompt == prompt and o.done:
                    o.problems.append(f"greedy answers to the same prompt differ ({len(texts)} variants)")


def scrape(http: httpx.Client, url: str) -> dict[str, float]:
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(http.get(url + "/metrics").text):
        for s in family.samples:
            values[s.name] = values.get(s.name, 0.0) + s.value
    return values


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def rss_mb(pid: int) -> float | None:
    status = Path(f"/proc/{pid}/status")
    if not status.is_file():
        return None
    for line in status.read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return None


def launch(model: str, serve_args: list[str], threads: int | None, api_key: str,
           startup: float = 300) -> tuple[subprocess.Popen, str]:
    """`eaglespec serve --model MODEL SERVE_ARGS` on a free loopback port, once its /health answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "eaglespec.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--model", model, "--log-level", "warning", *serve_args]
    if threads:
        cmd += ["--threads", str(threads)]
    env = dict(os.environ, EAGLESPEC_API_KEY=api_key)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + startup
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"the server ({' '.join(serve_args)}) exited during start-up:\n{proc.stdout.read()}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            proc.terminate()
            raise SystemExit(f"the server did not come up within {startup:g} s")
        time.sleep(0.5)


def start_server(args: argparse.Namespace, api_key: str) -> tuple[subprocess.Popen, str]:
    return launch(args.model, ["--method", args.method, "--max-queue", str(max(64, args.clients)),
                               "--timeout", str(args.server_timeout)], args.threads, api_key)


async def run_clients(url: str, api_key: str | None, model: str, outcomes: list[Outcome], max_tokens: int,
                      total_timeout: float) -> float:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=len(outcomes) + 4)
    async with httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(total_timeout), limits=limits) as http:
        start = time.perf_counter()
        await asyncio.wait_for(asyncio.gather(*(one_client(http, url, model, o, max_tokens) for o in outcomes)),
                               timeout=total_timeout)
        return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=None, help="a running server (loopback only); default: start one")
    p.add_argument("--api-key", default=None, help="API key of --url (a started server gets a random one)")
    p.add_argument("--model", default="smollm2-135m", help="model to start, or the name --url serves")
    p.add_argument("--method", default="eagle2", help="drafting method of the started server")
    p.add_argument("--threads", type=int, default=None, help="torch threads of the started server")
    p.add_argument("--clients", type=int, default=32, help=f"concurrent streaming clients (max {MAX_CLIENTS})")
    p.add_argument("--leave-every", type=int, default=4, help="every Nth client disconnects early (0: none)")
    p.add_argument("--leave-after", type=int, default=3, help="chunks a leaving client reads before it goes")
    p.add_argument("--max-tokens", type=int, default=48, help=f"max_tokens per request (max {MAX_TOKENS})")
    p.add_argument("--timeout", type=float, default=900, help=f"seconds for the whole run (max {MAX_TOTAL_S})")
    p.add_argument("--server-timeout", type=float, default=900,
                   help="per-request --timeout of the started server (queue wait included)")
    p.add_argument("--json", type=Path, default=None, help="also write the figures to this JSON file")
    args = p.parse_args(argv)
    if not 1 <= args.clients <= MAX_CLIENTS or not 1 <= args.max_tokens <= MAX_TOKENS:
        raise SystemExit(f"--clients must be 1..{MAX_CLIENTS} and --max-tokens 1..{MAX_TOKENS}")
    total_timeout = min(args.timeout, MAX_TOTAL_S)

    proc = None
    if args.url:
        _check_loopback(args.url)
        url, api_key = args.url.rstrip("/"), args.api_key
    else:
        api_key = args.api_key or os.urandom(12).hex()
        proc, url = start_server(args, api_key)
    try:
        sync = httpx.Client(headers={"Authorization": f"Bearer {api_key}"} if api_key else {}, timeout=60)
        served = sync.get(url + "/v1/models").json()["data"][0]["id"]
        method = sync.get(url + "/health").json()["method"]
        # Warm-up (not timed): the first generation pays one-off costs.
        sync.post(url + "/v1/chat/completions", json={"model": served, "max_tokens": 4,
                                                      "messages": [{"role": "user", "content": "Hi"}]})
        before = scrape(sync, url)
        rss_before = rss_mb(proc.pid) if proc else None
        outcomes = [Outcome(i, PROMPTS[i % len(PROMPTS)],
                            args.leave_after if args.leave_every and i % args.leave_every == args.leave_every - 1
                            else None) for i in range(args.clients)]
        wall = asyncio.run(run_clients(url, api_key, served, outcomes, args.max_tokens, total_timeout))
        validate(outcomes, args.max_tokens)
        # Let the server notice the leavers and drain.
        deadline = time.monotonic() + 60
        while True:
            health = sync.get(url + "/health")
            h = health.json()
            if h["running"] == 0 and h["waiting"] == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        after = scrape(sync, url)
        rss_after = rss_mb(proc.pid) if proc else None
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()

    def d(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    completed = [o for o in outcomes if o.done and not o.error and not o.problems and o.leave_after is None]
    leavers = [o for o in outcomes if o.leave_after is not None]
    left = [o for o in leavers if o.left]
    failures = [o for o in outcomes if o.error or o.problems or (o.leave_after is None and not o.done)]
    stayed_tokens = sum(o.usage["completion_tokens"] for o in completed if o.usage)
    cancelled = d("eaglespec:request_cancelled_total")
    leaver_tokens = d("eaglespec:generation_tokens_total") - stayed_tokens
    checks = {
        "every staying client got a full, valid answer": len(completed) == len(outcomes) - len(leavers),
        "every leaver's generation was cancelled": cancelled == len(left),
        "leavers generated fewer tokens than asked": leaver_tokens < len(left) * args.max_tokens or not left,
        "nothing left running or waiting": (h["running"], h["waiting"]) == (0, 0),
        "server healthy afterwards": health.status_code == 200 and h["status"] == "ok",
    }
    lat = [o.latency for o in completed]
    ttft = [o.ttft for o in completed if o.ttft is not None]
    figures = {
        "model": served, "method": method, "clients": args.clients, "max_tokens": args.max_tokens,
        "requests": len(outcomes), "completed": len(completed), "left_early": len(left), "failures": len(failures),
        "cancelled_by_server": int(cancelled), "wall_s": round(wall, 2),
        "latency_p50_s": round(percentile(lat, 50), 2), "latency_p95_s": round(percentile(lat, 95), 2),
        "ttft_p50_s": round(percentile(ttft, 50), 2), "ttft_p95_s": round(percentile(ttft, 95), 2),
        "completion_tokens": int(stayed_tokens), "generated_tokens_all": int(d("eaglespec:generation_tokens_total")),
        "tokens_per_s": round(d("eaglespec:generation_tokens_total") / wall, 2),
        "tau": round((d("eaglespec:spec_decode_num_accepted_tokens_total")
                      + d("eaglespec:spec_decode_num_target_forwards_total"))
                     / max(d("eaglespec:spec_decode_num_target_forwards_total"), 1), 3),
        "server_rss_mb_before": None if rss_before is None else round(rss_before),
        "server_rss_mb_after": None if rss_after is None else round(rss_after),
        "checks": checks,
    }
    print("| figure | value |\n|---|---|")
    for key, value in figures.items():
        if key != "checks":
            print(f"| {key} | {value} |")
    for name, ok in checks.items():
        print(f"[{'ok' if ok else 'FAILED'}] {name}")
    for o in failures[:10]:
        print(f"client {o.client}: {o.error or '; '.join(o.problems) or 'incomplete'}", file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0 if all(checks.values()) and not failures else 1


if __name__ == "__main__":
    sys.exit(main())
