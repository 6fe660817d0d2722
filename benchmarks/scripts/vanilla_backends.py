"""Vanilla decoding speed of the transformers path vs the fast path, float32 and bfloat16 (one warm-up run)."""

import time

import torch

from eaglespec import Engine
from eaglespec.models import load_target

torch.set_num_threads(2)
PROMPT = "Write a poem about the sea."
for dtype in ["float32", "bfloat16"]:
    model, tokenizer = load_target("smollm2-135m", dtype=dtype)
    for backend in ["hf", "fast"]:
        engine = Engine.from_model(model, tokenizer, method="vanilla", backend=backend)
        engine.generate(PROMPT, max_new_tokens=8)  # warm-up
        start = time.perf_counter()
        result = engine.generate(PROMPT, max_new_tokens=64)
        print(f"{dtype:9s} {backend:4s} {result.stats.new_tokens / (time.perf_counter() - start):6.1f} tokens/s "
              f"first tokens {result.tokens[:8]}")
