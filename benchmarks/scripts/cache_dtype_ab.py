"""The KV cache of a compiled bfloat16 SmolLM2-135M in bfloat16 (the default where every decode step attends
through eaglespec's kernel) against float32 (sessions up to 15), in the real decoding loop: two compiled engines in
one process, the first 8 MT-bench questions (one per category), plain decoding and eagle2 (6 / 2 / 4), interleaved.

    python benchmarks/scripts/cache_dtype_ab.py [--threads 2] [--tokens 256] [--rounds 2]

Prints tokens/s per variant and method (all tokens over all wall time) and whether the answers are identical.
"""

import argparse
import time

import torch

from eaglespec import Engine, TreeSettings
from eaglespec.bench.datasets import load_questions, select
from eaglespec.decode import SpecDecoder
from eaglespec.drafters import VanillaDrafter

p = argparse.ArgumentParser()
p.add_argument("--threads", type=int, default=2)
p.add_argument("--tokens", type=int, default=256)
p.add_argument("--rounds", type=int, default=2)
args = p.parse_args()
torch.set_num_threads(args.threads)

engines = {}
for name in ("bfloat16 cache", "float32 cache"):
    engine = Engine(method="eagle2", compile=True, tree=TreeSettings(total_tokens=6, depth=2, top_k=4))
    if name == "float32 cache":  # reallocate the cache as sessions up to 15 had it
        engine.target.cache_dtype = torch.float32
        engine.target.capacity = 0
        engine.target._grow(1024)
    engines[name] = engine
assert engines["bfloat16 cache"].target.cache_dtype == torch.bfloat16

questions = select(load_questions("mt-bench"), per_category=1)
ids = [engines["bfloat16 cache"].encode(q.turns[0]) for q in questions]


def generate(decoder: SpecDecoder, prompt: list[int]) -> tuple[list[int], float]:
    start = time.perf_counter()
    *_, last = decoder.stream(prompt, max_new_tokens=args.tokens)
    return last.tokens, time.perf_counter() - start


decoders = {(name, method): (e.decoder if method == "eagle2" else SpecDecoder(e.target, e.tokenizer, VanillaDrafter()))
            for name, e in engines.items() for method in ("vanilla", "eagle2")}
for decoder in decoders.values():  # warm-up
    generate(decoder, ids[0][:64])
tokens = {key: 0 for key in decoders}
seconds = {key: 0.0 for key in decoders}
answers: dict = {}
for _ in range(args.rounds):
    for i, prompt in enumerate(ids):
        for key, decoder in decoders.items():
            out, took = generate(decoder, prompt)
            tokens[key] += len(out)
            seconds[key] += took
            answers.setdefault(i, set()).add(tuple(out))
print(f"{len(ids)} prompts x {args.rounds} rounds, {args.tokens} new tokens, {args.threads} threads")
print("| variant | vanilla tokens/s | eagle2 tokens/s |")
print("|---|---|---|")
for name in engines:
    print(f"| {name} | {tokens[name, 'vanilla'] / seconds[name, 'vanilla']:.1f} | "
          f"{tokens[name, 'eagle2'] / seconds[name, 'eagle2']:.1f} |")
print(f"answers identical across all four: {sum(len(a) == 1 for a in answers.values())}/{len(answers)}")
