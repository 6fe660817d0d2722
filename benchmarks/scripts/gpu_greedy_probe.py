"""Greedy output on a GPU: plain and speculative (a random EAGLE-1 head, EAGLE-2 tree) decoding of the tests' tiny
Llama, in float32 and bfloat16, eager and with --compile, each compared with eager plain decoding in that dtype.
Run from the repository root on a machine with CUDA: python benchmarks/scripts/gpu_greedy_probe.py
(tokens/s of a 6-million-parameter model say nothing about speed on real models; they are printed to show that
each configuration ran)."""

import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from conftest import TinyTokenizer, make_model  # noqa: E402
from test_engine import PROMPTS, random_head  # noqa: E402

from eaglespec import Engine, TreeSettings  # noqa: E402

TREE = TreeSettings(total_tokens=12, depth=4, top_k=3)

for dtype in (torch.float32, torch.bfloat16):
    model = make_model("llama", device="cuda").to(dtype)
    plain = Engine.from_model(model, TinyTokenizer(), method="vanilla")
    ref = [plain.generate(p, max_new_tokens=40).tokens for p in PROMPTS]
    for compile in (False, True):
        for method in ("vanilla", "eagle2"):
            try:
                head = random_head(model, "eagle1").to(dtype) if method != "vanilla" else None
                e = Engine.from_model(model, TinyTokenizer(), head=head, method=method, tree=TREE, compile=compile)
                same = sum(e.generate(p, max_new_tokens=40).tokens == r for p, r in zip(PROMPTS, ref))
                t0 = time.perf_counter()
                e.generate(PROMPTS[0], max_new_tokens=40)
                rate = 40 / (time.perf_counter() - t0)
                print(f"{dtype} compile={compile} {method}: {same}/{len(PROMPTS)} identical ({rate:.0f} tokens/s)",
                      flush=True)
            except Exception as exc:  # report every configuration, whichever fails
                print(f"{dtype} compile={compile} {method}: FAILED {type(exc).__name__}: {exc}", flush=True)
                traceback.print_exc(limit=4)
