"""One EAGLE-3 head step (decoder layer + draft-vocabulary logits + log-softmax) over T rows after 200 cached head
positions, with the weights in cache (hot) and after a 128 MB sweep (cold, as after a verify pass): eager, then
either packed for oneDNN (`pack`) or through torch.compile with max-autotune (`compile`).

    python benchmarks/scripts/head_step_cost.py pack|compile     (RESULTS.md, session 14)
"""
import torch, time, sys
import torch._inductor.config as c
from eaglespec.heads import load_head
from eaglespec.heads.layer import KVCache
from eaglespec import packed
torch.set_num_threads(2)
head = load_head("src/eaglespec/shipped_heads/smollm2-135m-eagle3", dtype=torch.bfloat16)
d = 576
def step(hidden, emb, positions, past_k, past_v, mask):
    cache = KVCache(1); cache.keys[0], cache.values[0] = past_k, past_v
    out = head.step(hidden, emb, positions, cache, mask)
    return head.logits(out, None).float().log_softmax(-1), cache.keys[0], cache.values[0]
S, T = 200, 2
args = lambda T: (torch.randn(T, d, dtype=torch.bfloat16), torch.randn(T, d, dtype=torch.bfloat16), torch.arange(S, S + T),
        torch.randn(1, 3, S, 64, dtype=torch.bfloat16), torch.randn(1, 3, S, 64, dtype=torch.bfloat16), torch.ones(T, S + T, dtype=torch.bool))
big = torch.randn(64 * 1024 * 1024 // 2)  # 128 MB to evict caches
def bench(f, T, evict):
    a = args(T); ts = []
    for i in range(40):
        if evict: big.mul_(1.0)
        t = time.perf_counter(); f(*a); ts.append(time.perf_counter() - t)
    ts.sort(); return ts[len(ts)//2] * 1e3
with torch.inference_mode():
    eager = step
    for T in (1, 2, 4): print("eager", T, "%.3f hot %.3f cold" % (bench(eager, T, False), bench(eager, T, True)))
    if sys.argv[1] == "pack":
        head = packed.pack_linears(head)
        for T in (1, 2, 4): print("packed", T, "%.3f hot %.3f cold" % (bench(step, T, False), bench(step, T, True)))
    else:
        c.freezing = True; c.max_autotune = True; c.max_autotune_gemm_backends = "CPP,ATEN"
        f = torch.compile(step, dynamic=True)
        t = time.perf_counter(); f(*args(1)); f(*args(2)); print("compile s", time.perf_counter() - t)
        for T in (1, 2, 4): print("compiled", T, "%.3f hot %.3f cold" % (bench(f, T, False), bench(f, T, True)))
