"""Fixed costs around a draft round's small calls, hot (microseconds a call, 2 threads):
entering inductor's compile settings (`compiled.compile_settings`, what every compiled call did before git c8de7e2)
against the "fail_on_recompile" stance (`compiled.call_compiled`), a compiled draft-head step of the shipped
EAGLE-1 head (`--compile`, bfloat16) for 1 and 2 rows after a short generation, and torch.topk against
`bf16gemm.topk_rows` over 1-3 rows of 8192 log-probabilities.

    python benchmarks/microbench/call_overheads.py
"""

import statistics
import time

import torch

from eaglespec import Engine, TreeSettings
from eaglespec.backends.cpu import kernels as bf16gemm
from eaglespec.backends.cpu.compiled import compile_settings

torch.set_num_threads(2)


def per_call(fn, calls: int = 2000) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return 1e6 * (time.perf_counter() - start) / calls


def enter_settings():
    with compile_settings(True):
        pass


def enter_stance():
    with torch.compiler.set_stance("fail_on_recompile"):
        pass


print(f"compile_settings: {per_call(enter_settings):.1f} us; fail_on_recompile stance: {per_call(enter_stance):.1f} us")
engine = Engine(method="eagle2", compile=True, tree=TreeSettings(4, 2, 2))
engine.generate("Tell me about Hawaii.", max_new_tokens=32)
drafter = engine.drafter
cache = drafter.cache
cache.rollback()
c = len(cache)
with torch.inference_mode():
    for rows in (1, 2):
        hidden, embeds = torch.randn(rows, 576).bfloat16(), torch.randn(rows, 576).bfloat16()
        positions, mask = torch.arange(c, c + rows), torch.ones(rows, c + rows, dtype=torch.bool)

        def head_step():
            drafter.step(hidden, embeds, positions, cache, mask)
            cache.rollback()

        samples = [per_call(head_step, 20) for _ in range(10)]
        print(f"compiled head step, {rows} row(s): {statistics.median(samples):.0f} us")
    for rows in (1, 2, 3) if hasattr(bf16gemm, "topk_rows") else ():  # (a copy of this script runs at older revisions)
        logp = torch.randn(rows, 8192).log_softmax(-1)
        print(f"top-4 of {rows} x 8192: torch.topk {per_call(lambda: torch.topk(logp, 4, dim=-1)):.1f} us, "
              f"topk_rows {per_call(lambda: bf16gemm.topk_rows(logp, 4)):.1f} us")
