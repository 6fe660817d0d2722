"""eaglespec's KV-cache commit of an accepted path (csrc/commit_rows.cpp) for SmolLM2-135M's 30 layers, with the
cache out of the CPU caches (as after a verify pass streams the weights).

    python benchmarks/scripts/commit_rows_cost.py

Prints the median microseconds of 30 calls (a 4-node path 0, 2, 3, 5 at a growing cache length).
"""

import torch, time, statistics
from eaglespec import bf16gemm
bf16gemm.load(); torch.set_num_threads(2)
cap=2048
keys=[torch.randn(3,64,cap).bfloat16() for _ in range(30)]
vals=[torch.randn(3,cap,64).bfloat16() for _ in range(30)]
junk=torch.randn(64*1024*1024//4)  # evict caches between calls, as a verify pass does
ts=[]
for i in range(30):
    junk.add_(1)
    c=300+i*5
    t=time.perf_counter()
    torch.ops.eaglespec.commit_rows(keys, vals, c, [0,2,3,5])
    ts.append((time.perf_counter()-t)*1e6)
print("commit_rows us median", statistics.median(ts))
