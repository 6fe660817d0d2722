"""The fixed cost of a compiled decode step apart from its products: a tiny bfloat16 Llama (hidden 64) with N layers
under `--compile`, 20 one-token steps profiled; prints dynamo's guard-check time (`TorchDynamo Cache Lookup`), the
graph's own time (`## Call CompiledFxGraph`, its loops, attention and calls) and the kernel's, per step.

    python benchmarks/scripts/compiled_call_overhead.py [LAYERS]        (default 30, as SmolLM2-135M)
    TORCH_LOGS=guards python benchmarks/scripts/compiled_call_overhead.py 30   (also lists every guard)
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from conftest import make_model  # noqa: E402  (the tests' tiny models)

from eaglespec.fastpath import FastTarget  # noqa: E402

torch.set_num_threads(2)
layers = int(sys.argv[1]) if len(sys.argv) > 1 else 30
target = FastTarget(make_model("llama", layers=layers).to(torch.bfloat16), None, compile=True)
print(f"compiled in {target.warm_up():.1f} s")
target.forward(torch.arange(20) % 30)
target.commit()
c = target.cache_len


def step() -> None:
    target.forward(torch.randint(0, 30, (1,)), torch.arange(c, c + 1), torch.ones(1, 1, dtype=torch.bool))
    target.commit(torch.tensor([], dtype=torch.long))


for _ in range(5):
    step()
with torch.profiler.profile() as prof:
    for _ in range(20):
        step()
for event in prof.key_averages():
    if any(name in event.key for name in ("Cache Lookup", "CompiledFxGraph", "bf16_linear")):
        print(f"{event.key[:40]:40s} {event.self_cpu_time_total / 20:8.1f} us a step")
