"""Fast-path target forward time vs number of tokens on top of a short cached prefix, and an op profile."""

import time

import torch

from eaglespec.fastpath import FastTarget
from eaglespec.models import load_target

torch.set_num_threads(2)
model, tokenizer = load_target("smollm2-135m", dtype="float32")
target = FastTarget(model, None)
target.forward(torch.tensor(tokenizer("Write a poem about the sea and the sky and the stars.")["input_ids"]))
target.commit()
for n in [1, 4, 16, 32]:
    tokens = torch.randint(0, 1000, (n,))
    times = []
    for _ in range(10):
        start = time.perf_counter()
        target.forward(tokens)
        target.commit(torch.tensor([], dtype=torch.long))  # keep nothing: the prefix stays as it was
        times.append(time.perf_counter() - start)
    print(f"forward {n:2d} tokens: median {sorted(times)[5] * 1000:.1f} ms")
with torch.profiler.profile() as prof:
    for _ in range(5):
        target.forward(torch.tensor([5]))
        target.commit(torch.tensor([], dtype=torch.long))
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8))
