"""How far a 4-token forward's logits are from four one-token steps' (the same tokens), float32 vs int8/int4.

    python benchmarks/scripts/batch_vs_step_logits.py

Speculative verification compares the target's choice in a multi-token forward with what plain decoding computes
one token at a time; any difference can flip a near-tie. Prints the largest absolute logit difference per row.
"""

import torch

from eaglespec.fastpath import FastTarget
from eaglespec.models import load_target

torch.set_num_threads(2)
model, tokenizer = load_target("smollm2-135m", dtype="float32")
ids = torch.tensor(tokenizer("Explain how a bicycle works in simple terms. A bicycle is a mechanical device that "
                             "uses")["input_ids"])
n = len(ids)
for mode in (None, "int8", "int4"):
    target = FastTarget(model, "final", quantize=mode)
    target.forward(ids[: n - 4])
    target.commit()
    batch = target.forward(ids[n - 4 :]).logits  # [4, V]
    target.commit(torch.zeros(0, dtype=torch.long))
    steps = []
    for i in range(4):
        steps.append(target.forward(ids[n - 4 + i : n - 3 + i]).logits[0])
        target.commit()
    diffs = [f"{(batch[i] - steps[i]).abs().max().item():.2e}" for i in range(4)]
    print(f"{mode or 'float32':8s} max |logit difference| per row: {', '.join(diffs)}")
