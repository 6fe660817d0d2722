"""What `eaglespec train head --feature-dtype` costs: one training-feature pass of a target (the layers with their
hidden states, as TargetModel.features_for_batch runs them) over random token ids, in float32 and with its products
in bfloat16 under autocast.

    python benchmarks/microbench/feature_dtype_cost.py [--model qwen2.5-coder-1.5b] [--batch 4] [--length 400]

Prints the seconds of one pass in each dtype (after one short warm-up pass each).
"""

import argparse
import time

import torch

from eaglespec.models import load_target
from eaglespec.targets.hf import TargetModel

p = argparse.ArgumentParser()
p.add_argument("--model", default="qwen2.5-coder-1.5b")
p.add_argument("--threads", type=int, default=2)
p.add_argument("--batch", type=int, default=4)
p.add_argument("--length", type=int, default=400)
args = p.parse_args()
torch.set_num_threads(args.threads)
model, _ = load_target(args.model, dtype="float32")
target = TargetModel(model, feature_kind="eagle3")
ids = torch.randint(0, target.vocab_size, (args.batch, args.length), generator=torch.Generator().manual_seed(0))
for compute in (None, torch.bfloat16):
    target.features_for_batch(ids[:1, :64], compute_dtype=compute)
    start = time.perf_counter()
    target.features_for_batch(ids, compute_dtype=compute)
    name = "float32" if compute is None else "bfloat16 (autocast)"
    print(f"{name}: {time.perf_counter() - start:.1f} s for {args.batch} x {args.length} tokens")
