"""A target's forward over N rows in a loop, for a profiler to attach to (`perf record -p PID`): one greedy verify
pass of N rows (a causal chain) after a 300-token prompt, repeated for --seconds, the cache left as it was after each.

    python benchmarks/microbench/step_loop.py [--model qwen2.5-coder-1.5b] [--rows 16] [--seconds 40] [--threads 2]
    perf record -F 999 -p $(pgrep -f step_loop.py) -o step.data -- sleep 25   # once it prints "looping"
    perf report -i step.data --no-children --sort symbol

The target is built as the engine builds it (`FastTarget`, the kernels' decoder stack where it applies). It prints
the mean milliseconds a pass at the end; a profile's shares, not that figure, are what it is for (timings belong to
`eaglespec bench`).
"""

import argparse
import time

import torch

from eaglespec.models import load_target
from eaglespec.targets.fast import FastTarget

p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
p.add_argument("--model", default="qwen2.5-coder-1.5b")
p.add_argument("--rows", type=int, default=16)
p.add_argument("--seconds", type=float, default=40.0)
p.add_argument("--threads", type=int, default=2)
args = p.parse_args()
torch.set_num_threads(args.threads)
model, tokenizer = load_target(args.model, dtype="bfloat16")
target = FastTarget(model, None, compile=True)
target.warm_up()
prompt = tokenizer("Write a poem about the sea and the sky and the stars. " * 40)["input_ids"][:300]
with torch.inference_mode():
    target.forward(torch.tensor(prompt))
    target.commit()
    c, n = target.cache_len, args.rows
    positions, mask = torch.arange(c, c + n), torch.ones(n, n, dtype=torch.bool).tril()  # [N], [N, N]

    def step() -> None:
        target.forward(torch.randint(0, 1000, (n,)), positions, mask, greedy=True)
        target.commit(torch.zeros(0, dtype=torch.long))  # keep nothing: the prompt stays as it was

    for _ in range(3):
        step()
    print(f"looping: {n} rows, layers as one kernel call: {target.kernel_stack is not None}", flush=True)
    start, steps = time.perf_counter(), 0
    while time.perf_counter() - start < args.seconds:
        step()
        steps += 1
print(f"{steps} passes, {1e3 * (time.perf_counter() - start) / steps:.1f} ms a pass")
