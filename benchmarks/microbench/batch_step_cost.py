"""What one step of the batch decoder costs by batch width, without the server: B MT-bench prompts decode together
(plain decoding, end-of-sequence ignored so the batch stays full), and the steps after the prompts are read are
timed one by one.

    python benchmarks/microbench/batch_step_cost.py [--model smollm2-135m] [--batch 1,2,4,8] [--steps 150]
        [--threads 2]

Prints, per batch width, the median step in milliseconds and the tokens per second of the timed steps. Against the
server's figures (benchmarks/concurrency.py) it separates the engine's own scaling from what the server, prefills
and a draining batch add.
"""

import argparse
import statistics
import time

import torch

from eaglespec.api import Engine
from eaglespec.bench.datasets import load_questions

p = argparse.ArgumentParser()
p.add_argument("--model", default="smollm2-135m")
p.add_argument("--batch", default="1,2,4,8")
p.add_argument("--steps", type=int, default=150)
p.add_argument("--threads", type=int, default=2)
args = p.parse_args()
torch.set_num_threads(args.threads)

engine = Engine(model=args.model, method="vanilla")
questions = load_questions("mt-bench")
for width in (int(b) for b in args.batch.split(",")):
    prompts = []
    for question in questions[:width]:
        ids = engine.tokenizer.apply_chat_template([{"role": "user", "content": question.turns[0]}],
                                                   add_generation_prompt=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    batch = engine.batch_decoder(width, "never")
    batch.eos = set()  # (every sequence runs its whole length: the batch keeps its width)
    for key, ids in enumerate(prompts):
        batch.add(key, ids, max_new_tokens=args.steps + 20)
    while batch.prefilling or batch.waiting:
        batch.step()
    for _ in range(5):  # warm-up steps
        batch.step()
    steps = []
    start = time.perf_counter()
    for _ in range(args.steps):
        t0 = time.perf_counter()
        batch.step()
        steps.append(time.perf_counter() - t0)
    total = time.perf_counter() - start
    print(f"batch {width}: step median {1e3 * statistics.median(steps):.2f} ms, "
          f"{width * args.steps / total:.1f} tokens/s")
