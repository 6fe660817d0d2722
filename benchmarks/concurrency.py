"""Throughput of `eaglespec serve` by concurrency: plain batched decoding against batched speculation, one run.

    python benchmarks/concurrency.py --model smollm2-135m --concurrency 1,2,4,8,16 --max-tokens 128

For each server configuration (default: `plain` = `--method vanilla`, `spec` = the model's default method with its
shipped head; each `--max-batch` as given) this starts `eaglespec serve` (all of them, before any timing) and sends
each one warm-up request (not timed). Then, `--rounds` times, for each concurrency c, each configuration in turn runs
c closed-loop streaming clients over the same prompts (MT-bench first turns, greedy, chat template; a level sends
max(--requests, c x --requests-per-stream) requests, repeating the prompts in order, so that with more than one
request per stream the batch's ramp-up and drain weigh less against its steady state); the turns
alternate their order (plain, spec; spec, plain; ...), so that a drift of the machine's speed during the run weighs
on each configuration alike. It reports aggregate tokens/s (all tokens / wall time, over the rounds; each round's
too), p50 / p95 request latency and time to first token, tau (from the servers' counters), and the share of the
machine's CPU time the load generator (this process, on the same cores) and the server used (from /proc). Every
answer is compared with the answer to the same prompt of one request at a time on the plain server (concurrency 1,
first round), which is plain decoding: they must be equal token for token (with --distinct-prompts, a prompt first
sent at a higher level is compared with the first answer to it instead). Before each level the servers forget the
prompts they read (`POST /reset_prefix_cache`), so the prefix cache reuses only what the level's own prompts share
(the chat template's system prompt); with --distinct-prompts no prompt repeats within a level either (MT-bench's 80
first turns at most), so no answer's prompt is read from the cache whole.
The checks printed at the end are the ones batched serving promises: at 8 concurrent streams at least 4x the
single-stream plain throughput; speculation never below plain batched decoding at any concurrency (within
--tolerance); every greedy answer equal to its single-request answer. --json writes everything.
Time it alone on the machine: anything else running makes the figures worthless.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
from load_test import MAX_TOKENS, Outcome, launch, one_client, percentile, scrape

from eaglespec.bench.datasets import load_questions, select
from eaglespec.bench.machine import describe_machine


def cpu_seconds(pid: int) -> float | None:
    """CPU time (user + system) a process has used so far, from /proc (None where there is none)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime (fields 14, 15)


def request_plan(prompts: list[str], clients: int, per_stream: int) -> list[str]:
    """The prompts one level sends: at least `per_stream` per client and every prompt once, repeated in order."""
    n = max(len(prompts), clients * per_stream)
    return [prompts[i % len(prompts)] for i in range(n)]


async def closed_loop(url: str, api_key: str, model: str, prompts: list[str], clients: int,
                      max_tokens: int) -> tuple[list[Outcome], float]:
    """`clients` clients, each sending the next waiting prompt as soon as its last answer is complete."""
    todo = list(enumerate(prompts))
    outcomes: list[Outcome] = []

    async def client(http: httpx.AsyncClient) -> None:
        while todo:
            i, prompt = todo.pop(0)
            o = Outcome(i, prompt, None)
            outcomes.append(o)
            await one_client(http, url, model, o, max_tokens)

    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {api_key}"}, timeout=1800,
                                 limits=limits) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(clients)))
        return outcomes, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--concurrency", default="1,2,4,8,16", help="comma-separated concurrent client counts")
    p.add_argument("--config", action="append", default=None, metavar="NAME=ARGS",
                   help="a server configuration: name=extra serve arguments (repeatable; default: "
                        "plain='--method vanilla' and spec='')")
    p.add_argument("--max-batch", type=int, default=16, help="--max-batch of every server (default: 16)")
    p.add_argument("--requests", type=int, default=16, help="prompts, each sent once a level at least (default: 16)")
    p.add_argument("--requests-per-stream", type=int, default=1,
                   help="each level sends at least this many requests per stream (default: 1)")
    p.add_argument("--rounds", type=int, default=1,
                   help="times each configuration runs each level, taking turns with the others (default: 1)")
    p.add_argument("--distinct-prompts", action="store_true",
                   help="each level sends max(--requests, streams x --requests-per-stream) different prompts, "
                        "repeating none")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--tolerance", type=float, default=0.05,
                   help="speculation may be this fraction below plain batched decoding before the check fails")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    if not levels or min(levels) < 1 or not 1 <= args.max_tokens <= MAX_TOKENS or args.rounds < 1 \
            or args.requests < 1 or args.requests_per_stream < 1:
        raise SystemExit("--concurrency needs positive counts; --rounds, --requests and --requests-per-stream at "
                         f"least 1; --max-tokens 1..{MAX_TOKENS}")
    configs = dict(c.split("=", 1) for c in (args.config or ["plain=--method vanilla", "spec="]))
    needed = max([args.requests] + [c * args.requests_per_stream for c in levels]) if args.distinct_prompts \
        else args.requests
    questions = select(load_questions("mt-bench"), limit=needed)
    if len(questions) < needed:
        raise SystemExit(f"--distinct-prompts needs {needed} prompts; MT-bench has {len(questions)}")
    prompts = [q.turns[0] for q in questions]
    api_key = os.urandom(12).hex()
    names = list(configs)
    servers: dict[str, tuple[subprocess.Popen, str]] = {}
    runs: dict[tuple[str, int], list[dict]] = {(name, c): [] for name in names for c in levels}
    reference: dict[str, str] | None = None  # the single-request answers (the first level of the first round)
    first_answer: dict[str, str] = {}  # each prompt's first answer (its single-request one where there is one)
    try:
        for name in names:  # every server up before any is timed; an idle one polls its queue ten times a second
            serve_args = configs[name].split() + ["--max-batch", str(args.max_batch), "--max-queue", "256",
                                                  "--timeout", "1800"]
            servers[name] = launch(args.model, serve_args, args.threads, api_key, startup=600)
        sync = httpx.Client(headers={"Authorization": f"Bearer {api_key}"}, timeout=600)
        served, method = {}, {}
        for name, (_, url) in servers.items():
            served[name] = sync.get(url + "/v1/models").json()["data"][0]["id"]
            method[name] = sync.get(url + "/health").json()["method"]
            sync.post(url + "/v1/chat/completions", json={"model": served[name], "max_tokens": 8,
                                                          "messages": [{"role": "user", "content": "Hi"}]})
        for r in range(args.rounds):
            for i, clients in enumerate(levels):
                # the configurations take turns, in alternating order (ABBA), so that a drift of the machine's
                # speed during the run weighs on each alike
                for name in (names if (r + i) % 2 == 0 else names[::-1]):
                    url = servers[name][1]
                    sync.post(url + "/reset_prefix_cache").raise_for_status()
                    before = scrape(sync, url)
                    server_cpu, client_cpu = cpu_seconds(servers[name][0].pid), time.process_time()
                    plan = (prompts[: max(args.requests, clients * args.requests_per_stream)] if args.distinct_prompts
                            else request_plan(prompts, clients, args.requests_per_stream))
                    outcomes, wall = asyncio.run(closed_loop(url, api_key, served[name], plan, clients,
                                                             args.max_tokens))
                    cpu = {"client": time.process_time() - client_cpu, "server": None}
                    server_after = cpu_seconds(servers[name][0].pid)
                    if server_cpu is not None and server_after is not None:
                        cpu["server"] = server_after - server_cpu
                    after = scrape(sync, url)
                    failed = [o for o in outcomes if o.error or not o.done]
                    if failed:
                        raise SystemExit(f"{name} at {clients} clients: {failed[0].error or 'incomplete stream'}")
                    if reference is None:  # the first configuration's first level: one request at a time
                        reference = {o.prompt: o.text for o in outcomes}
                        first_answer.update(reference)
                    counters = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
                    equal = all(o.text == first_answer.setdefault(o.prompt, o.text) for o in outcomes)
                    runs[(name, clients)].append({"outcomes": outcomes, "wall": wall, "counters": counters,
                                                  "equal": equal, "cpu": cpu})
                    tokens = counters.get("eaglespec:generation_tokens_total", 0.0)
                    print(json.dumps({"round": r + 1, "config": name, "concurrency": clients,
                                      "tokens_per_s": round(tokens / wall, 1)}), file=sys.stderr)
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()

    rows, cores = [], os.cpu_count() or 1
    for (name, clients), done in runs.items():
        d: dict[str, float] = {}
        for run in done:
            for k, v in run["counters"].items():
                d[k] = d.get(k, 0.0) + v
        outcomes = [o for run in done for o in run["outcomes"]]
        wall = sum(run["wall"] for run in done)
        forwards = max(d.get("eaglespec:spec_decode_num_target_forwards_total", 0.0), 1.0)
        tokens = d.get("eaglespec:generation_tokens_total", 0.0)
        lat = [o.latency for o in outcomes]
        drafted = d.get("eaglespec:batch_sequences_drafted_total", 0.0)
        sequences = drafted + d.get("eaglespec:batch_sequences_plain_total", 0.0)  # per batched step
        ttft = [o.ttft for o in outcomes if o.ttft is not None]
        rows.append({
            "config": name, "method": method[name], "serve_args": configs[name], "max_batch": args.max_batch,
            "concurrency": clients, "rounds": len(done), "requests": len(outcomes), "tokens": int(tokens),
            "wall_s": round(wall, 2), "tokens_per_s": round(tokens / wall, 1),
            "tokens_per_s_by_round": [round(run["counters"].get("eaglespec:generation_tokens_total", 0.0)
                                            / run["wall"], 1) for run in done],
            "latency_p50_s": round(percentile(lat, 50), 2), "latency_p95_s": round(percentile(lat, 95), 2),
            "ttft_p50_s": round(percentile(ttft, 50), 2), "ttft_p95_s": round(percentile(ttft, 95), 2),
            "tau": round((d.get("eaglespec:spec_decode_num_accepted_tokens_total", 0.0) + forwards) / forwards, 2),
            "mean_batch": round(sequences / max(d.get("eaglespec:batch_steps_total", 0.0), 1.0), 2),
            "prompt_rows_read": int(d.get("eaglespec:batch_prefill_rows_total", 0.0)),
            "prompt_rows_from_cache": int(d.get("eaglespec:prefix_cache_rows_total", 0.0)),
            "drafted_share": round(drafted / max(sequences, 1.0), 2),
            "equal_to_single": all(run["equal"] for run in done),
            # the machine's CPU time the load generator (this process) and the server used over the level's wall time
            "load_generator_cpu_share": round(sum(run["cpu"]["client"] for run in done) / (wall * cores), 3),
            "server_cpu_share": (None if any(run["cpu"]["server"] is None for run in done)
                                 else round(sum(run["cpu"]["server"] for run in done) / (wall * cores), 3)),
        })

    base = next(r["tokens_per_s"] for r in rows if r["concurrency"] == min(levels))
    for r in rows:
        r["x_single_plain"] = round(r["tokens_per_s"] / base, 2)
    check = "every greedy answer equals its single-request answer"
    if args.distinct_prompts:
        check += f" ({len(reference or {})} prompts sent alone; the others: equal to their first answer)"
    checks = {check: all(r["equal_to_single"] for r in rows)}
    at8 = [r for r in rows if r["concurrency"] == 8]
    if at8:
        checks["8 concurrent streams: at least 4x single-stream plain"] = all(r["x_single_plain"] >= 4 for r in at8)
    if len(names) >= 2:
        plain = {r["concurrency"]: r["tokens_per_s"] for r in rows if r["config"] == names[0]}
        spec = [r for r in rows if r["config"] == names[1]]
        checks[f"{names[1]} never below {names[0]} (tolerance {args.tolerance:.0%})"] = all(
            r["tokens_per_s"] >= (1 - args.tolerance) * plain[r["concurrency"]] for r in spec)
    print("| config | concurrency | tokens/s | x single plain | p50 latency s | p95 latency s | p50 TTFT s | tau | "
          "mean batch | drafted share | equal |\n|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['config']} | {r['concurrency']} | {r['tokens_per_s']} | {r['x_single_plain']} | "
              f"{r['latency_p50_s']} | {r['latency_p95_s']} | {r['ttft_p50_s']} | {r['tau']} | {r['mean_batch']} | "
              f"{r['drafted_share']} | {'yes' if r['equal_to_single'] else 'NO'} |")
    print("share of the machine's CPU time used by the load generator / the server, by level: " + "; ".join(
        f"{r['config']} {r['concurrency']}: {r['load_generator_cpu_share']:.0%} / "
        + ("?" if r["server_cpu_share"] is None else f"{r['server_cpu_share']:.0%}") for r in rows))
    for name, ok in checks.items():
        print(f"[{'ok' if ok else 'FAILED'}] {name}")
    if args.json:
        command = "python benchmarks/concurrency.py " + " ".join(argv or sys.argv[1:])
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"machine": describe_machine(), "model": args.model, "command": command,
                                         "max_tokens": args.max_tokens, "requests_per_stream": args.requests_per_stream,
                                         "rows": rows, "checks": checks},
                                        indent=2) + "\n")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
