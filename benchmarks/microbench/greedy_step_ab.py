"""A compiled bfloat16 SmolLM2-135M decode step with greedy decoding's screened LM head against the same step with
the bfloat16 logits and their argmax (the target's `greedy_head` set to None), interleaved in one process.

    python benchmarks/microbench/greedy_step_ab.py [--threads 2] [--rows 1,4] [--repeats 60]

The context is a real prompt and plain decoding's greedy answer to it (the screen leaves a handful of candidates on
such hidden states; random tokens leave thousands); each timed step is `forward(..., greedy=True)` plus reading its
tokens, the cache left as it was. Median ms, the first 5 repeats dropped.
"""

import argparse
import statistics
import time

import torch

from eaglespec import Engine

p = argparse.ArgumentParser()
p.add_argument("--threads", type=int, default=2)
p.add_argument("--rows", default="1,4")
p.add_argument("--repeats", type=int, default=60)
args = p.parse_args()
torch.set_num_threads(args.threads)
engine = Engine(method="vanilla", compile=True)
target = engine.target
screened = target.greedy_head
assert screened is not None, "needs the bfloat16 kernels (AVX-512 BF16 and VNNI, a C++ compiler)"
prompt = engine.encode("Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural "
                       "experiences and must-see attractions.")
answer = engine.generate(prompt, max_new_tokens=240).tokens
text = prompt + list(answer)
rows = [int(r) for r in args.rows.split(",")]
context = len(text) - max(rows)
target.reset()
target.forward(torch.tensor(text[:context]))
target.commit()
print(f"{args.threads} threads, {context} cached tokens, median ms per step")
for n in rows:
    tokens = torch.tensor(text[context : context + n])
    mask = torch.ones(n, n, dtype=torch.bool).tril_()
    times = {"screened": [], "logits": []}
    for _ in range(args.repeats):
        for name in times:
            target.greedy_head = screened if name == "screened" else None
            start = time.perf_counter()
            target.forward(tokens, torch.arange(context, context + n), mask, greedy=True).greedy()
            target.commit(torch.zeros(0, dtype=torch.long))
            times[name].append(1000 * (time.perf_counter() - start))
    m = {name: statistics.median(v[5:]) for name, v in times.items()}
    print(f"{n} tokens: screened LM head {m['screened']:.2f} ms, logits + argmax {m['logits']:.2f} ms "
          f"({m['logits'] - m['screened']:+.2f})")
target.greedy_head = screened
