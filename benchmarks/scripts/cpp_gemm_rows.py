"""Inductor's C++ GEMM kernels (max-autotune, CPP template) against oneDNN for 20 layer pairs 576 -> 3072 -> 576
in bfloat16, compiled for M rows (static) or with M dynamic, timed at several row counts; the autotuning log
prints both kernels' times.

    python benchmarks/scripts/cpp_gemm_rows.py 8 static|dyn     (RESULTS.md, session 14)
"""
import torch, time, sys
import torch._inductor.config as c
torch.set_num_threads(2)
c.freezing = True; c.max_autotune = True; c.max_autotune_gemm_backends = "CPP,ATEN"
m = int(sys.argv[1]); dyn = sys.argv[2] == "dyn"
layers = torch.nn.Sequential(*[torch.nn.Linear(576, 3072, bias=False) if i % 2 == 0 else torch.nn.Linear(3072, 576, bias=False) for i in range(40)]).to(torch.bfloat16).eval()
f = torch.compile(layers, dynamic=dyn)
with torch.inference_mode():
    x = torch.randn(m, 576, dtype=torch.bfloat16)
    f(x)
    for mm in (1, 2, 4, 6, 8, 12):
        if not dyn and mm != m: continue
        if dyn and mm == 1: continue
        x = torch.randn(mm, 576, dtype=torch.bfloat16)
        for _ in range(5): f(x)
        t = time.perf_counter()
        for _ in range(30): f(x)
        dt = (time.perf_counter() - t) / 30
        print(m, dyn, mm, f"{dt*1e3:.2f} ms {40*576*3072*2/dt/1e9:.1f} GB/s")
