"""How far a 4-token verify forward's logits are from four one-token steps' (the same tokens), per target form.

    python benchmarks/microbench/batch_vs_step_logits.py

Speculative verification compares the target's choice in a multi-token forward with what plain decoding computes
one token at a time; any difference can flip a near-tie. Prints the largest absolute logit difference per row,
for the decode path (a causal tree mask, as the decoding loop passes) and for a batched prefill-style call, for:
float32 with unpacked weights (F.linear), float32 packed for oneDNN (the default), the same with row-by-row
attention (row_invariant=True), int8 and int4 (row by row by default).
"""

import torch

from eaglespec.models import load_target
from eaglespec.targets.fast import FastTarget

torch.set_num_threads(2)
model, tokenizer = load_target("smollm2-135m", dtype="float32")
ids = torch.tensor(tokenizer("Explain how a bicycle works in simple terms. A bicycle is a mechanical device that "
                             "uses")["input_ids"])
n = len(ids)
FORMS = {  # name: FastTarget options
    "float32 unpacked": dict(pack=False),
    "float32 packed": dict(),
    "float32 packed, row by row": dict(row_invariant=True),
    "int8": dict(quantize="int8"),
    "int4": dict(quantize="int4"),
}
for form, options in FORMS.items():
    target = FastTarget(model, "final", **options)
    target.forward(ids[: n - 4])
    target.commit()
    c = n - 4
    causal = torch.ones(4, 4, dtype=torch.bool).tril()
    verify = target.forward(ids[c:], torch.arange(c, n), causal).logits  # [4, V], the decode path
    target.commit(torch.zeros(0, dtype=torch.long))
    prefill = target.forward(ids[c:]).logits  # [4, V], one batched attention call
    target.commit(torch.zeros(0, dtype=torch.long))
    steps = []
    for i in range(4):
        steps.append(target.forward(ids[c + i : c + i + 1], torch.tensor([c + i]), causal[:1, :1]).logits[0])
        target.commit()
    for name, batch in (("verify", verify), ("prefill", prefill)):
        diffs = [f"{(batch[i] - steps[i]).abs().max().item():.2e}" for i in range(4)]
        print(f"{form:27s} {name:8s} max |logit difference| per row: {', '.join(diffs)}")
