"""Cost of single bfloat16 products on a CPU: one matrix of several row counts (cache-resident or not), then
SmolLM2-135M layer shapes over 40 copies of each weight (streamed from memory), oneDNN packed vs F.linear vs mm.

    python benchmarks/scripts/product_cost.py     (2 threads; RESULTS.md, session 14)
"""
import time
import torch
import torch.nn.functional as F
from eaglespec import packed
torch.set_num_threads(2)
for rows in (8192, 4096, 2048, 49152):
    w = torch.randn(rows, 576, dtype=torch.bfloat16)
    p = packed.pack(w, None)
    x = torch.randn(3, 576, dtype=torch.bfloat16)
    with torch.inference_mode():
        for _ in range(20): p(x)
        t = time.perf_counter(); n = 200
        for _ in range(n): p(x)
        dt = (time.perf_counter() - t) / n
    print(rows, f"{dt*1e3:.3f} ms  {w.numel()*2/dt/1e9:.1f} GB/s")

shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536), (64, 64)]
def bench(f, x, n=300):
    for _ in range(20): f(x)
    t = time.perf_counter()
    for _ in range(n): f(x)
    return (time.perf_counter() - t) / n
with torch.inference_mode():
  for o, i in shapes:
    ws = [torch.randn(o, i, dtype=torch.bfloat16) * 0.02 for _ in range(40)]  # 40 copies -> not cache resident
    ps = [packed.pack(w, None) for w in ws]
    for m in (1, 8):
        x = torch.randn(m, i, dtype=torch.bfloat16)
        cyc = {"packed": lambda x: [p(x) for p in ps], "F.linear": lambda x: [F.linear(x, w) for w in ws],
               "mm_t": lambda x: [torch.mm(x, w.t()) for w in ws]}
        res = {k: bench(f, x, 30) / 40 * 1e6 for k, f in cyc.items()}
        mb = o * i * 2 / 1e6
        print(f"{o}x{i} m={m} {mb:.2f}MB " + " ".join(f"{k} {v:.1f}us ({mb*1e3/v:.0f}GB/s)" for k, v in res.items()))
