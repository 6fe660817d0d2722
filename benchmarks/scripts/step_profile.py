"""torch.profiler's per-operator table (self CPU time) of compiled bfloat16 greedy decode steps of 1 and 2 tokens:
20 untimed steps, then 20 profiled, each over the same 300 cached tokens. Divide an operator's self time by 20 for
its cost per step. With TORCHINDUCTOR_CPP_ENABLE_KERNEL_PROFILE=1 inductor's fused loops appear as their own rows
(the graph then compiles anew). RESULTS.md, session 24.

    python benchmarks/scripts/step_profile.py
"""

import torch
from torch.profiler import profile, ProfilerActivity
from eaglespec.fastpath import FastTarget
from eaglespec.models import load_target
torch.set_num_threads(2)
model, tok = load_target("smollm2-135m", dtype="bfloat16")
target = FastTarget(model, None, compile=True)
target.warm_up()
prefix = tok("Write a poem about the sea and the sky and the stars. " * 31)["input_ids"][:300]
target.forward(torch.tensor(prefix)); target.commit()
c = target.cache_len
def step(n):
    target.forward(torch.randint(0, 1000, (n,)), torch.arange(c, c + n), torch.ones(n, n, dtype=torch.bool).tril(), greedy=True)
    target.commit(torch.zeros(0, dtype=torch.long))
with torch.inference_mode():
    for n in (1, 2):
        for _ in range(20): step(n)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(20): step(n)
        print(f"===== n={n}")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
