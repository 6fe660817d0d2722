"""Batched decoding on a GPU: greedy equality with batch-1 decoding, and throughput by batch size.

    python benchmarks/tools/gpu_batch.py --out DIR

1. Equality: a tiny random Qwen2 target (biased q/k/v, GQA) with a random EAGLE head, in float32 and bfloat16;
   `Engine.generate` (one sequence) against `Engine.generate_batch` (8 together, drafting at every step) for 8
   prompts, vanilla and eagle2: how many sequences come out token for token equal. On a GPU nothing guarantees it
   (cuBLAS chooses kernels by the shape of the whole product): this measures how often it holds.
2. Throughput: a random model of Qwen2.5-Coder-1.5B's shape (28 layers, d 1536, 12 / 2 heads, vocab 151936) in
   bfloat16, plain batched decoding of 64 new tokens after 32 prompt tokens at batch 1, 4, 16, 64 (a warm-up run
   first): aggregate tokens/s. Random weights read and compute like trained ones; only the text is noise.
Writes results.json to --out and prints it.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from eaglespec.api import Engine
from eaglespec.drafters import TreeSettings
from eaglespec.heads import HeadConfig, build_head
from eaglespec.targets.hf import TargetModel


def word_tokenizer(vocab: int) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over `vocab` ids, without an end-of-sequence token (generation runs to the budget)."""
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0")


def qwen2(dtype: torch.dtype, device: str, **shape) -> transformers.Qwen2ForCausalLM:
    config = transformers.Qwen2Config(**shape)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.Qwen2ForCausalLM(config)
    model = model.to(dtype).eval().requires_grad_(False)
    model.generation_config.eos_token_id = None
    return model


def equality(device: str) -> list[dict]:
    rows = []
    vocab = 512
    tok = word_tokenizer(vocab)
    for dtype in (torch.float32, torch.bfloat16):
        model = qwen2(dtype, device, vocab_size=vocab, hidden_size=192, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=512)
        with torch.no_grad():
            model.lm_head.weight.mul_(20.0)  # sharp next-token distributions, as trained models have
        head = build_head(HeadConfig.for_target(TargetModel(model), "eagle1")).to(device, dtype).eval()
        gen = torch.Generator().manual_seed(1)
        prompts = [torch.randint(0, vocab, (int(n),), generator=gen).tolist() for n in range(8, 24, 2)]
        for method in ("vanilla", "eagle2"):
            engine = Engine.from_model(model, tok, head=head if method == "eagle2" else None, method=method,
                                       tree=TreeSettings(total_tokens=8, depth=3, top_k=2))
            single = [engine.generate(p, max_new_tokens=48).tokens for p in prompts]
            batch = [r.tokens for r in engine.generate_batch(prompts, max_new_tokens=48, max_batch=8,
                                                             speculate="always")]
            rows.append({"dtype": str(dtype).removeprefix("torch."), "method": method, "sequences": len(prompts),
                         "equal": sum(a == b for a, b in zip(single, batch)),
                         "together": engine.batch_decoder(2).pool.together})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def throughput(device: str, sizes: tuple[int, ...] = (1, 4, 16, 64)) -> list[dict]:
    vocab = 151936
    model = qwen2(torch.bfloat16, device, vocab_size=vocab, hidden_size=1536, intermediate_size=8960,
                  num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=4096,
                  tie_word_embeddings=False)
    engine = Engine.from_model(model, word_tokenizer(vocab), method="vanilla")
    gen = torch.Generator().manual_seed(2)
    rows = []
    for batch in sizes:
        prompts = [torch.randint(0, vocab, (32,), generator=gen).tolist() for _ in range(batch)]
        engine.generate_batch(prompts, max_new_tokens=8, max_batch=batch)  # warm-up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        results = engine.generate_batch(prompts, max_new_tokens=64, max_batch=batch)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        tokens = sum(len(r.tokens) for r in results)
        rows.append({"batch": batch, "tokens": tokens, "seconds": round(seconds, 3),
                     "tokens_per_s": round(tokens / seconds, 1)})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("gpu-batch"))
    args = p.parse_args()
    device = "cuda"
    info = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "transformers": transformers.__version__,
            "equality": equality(device), "throughput": throughput(device)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(info, indent=2) + "\n")
    print(json.dumps(info, indent=2))


if __name__ == "__main__":
    main()
