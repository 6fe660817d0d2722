"""How many vocabulary entries a rigorous int8 screen of SmolLM2-135M's LM head would leave to score exactly
(an idea for greedy decoding measured in session 19, not built): with the head's rows quantized to int8 in groups
of G input channels (a scale per row and group) and the input row x kept in float32, every logit a_n of the int8
copy is within e_n = sum_g |x_g|_1 err_ng of the exact one (err_ng: the group's largest |w - s q|), so only the
n with a_n + e_n >= max_m (a_m - e_m) can be the argmax. Prints the bound and the candidate counts over the
target's final hidden states of a few greedy answers (exact logits stand in for a_n, which only moves the
counts by the same bound).

    python benchmarks/scripts/lm_head_screen_bound.py

Session 19's first kernel also quantized x (one scale per row, for VNNI's integer dot products): SmolLM2's final
hidden states have outlier channels (|x| up to ~50 against ~1), which made e_n ~10 logits wide and left ~23,000 of
49,152 candidates; hence the float32 x here.
"""

import torch

from eaglespec import Engine, TreeSettings

torch.set_num_threads(2)
engine = Engine(method="eagle2", tree=TreeSettings(4, 2, 2))
target = engine.target
weight = target.lm_head.weight.detach().double()  # [N, K]
n, k = weight.shape
prompts = ["Compose an engaging travel blog post about a recent trip to Hawaii.", "Explain quicksort in Python.",
           "What is the capital of France? Answer briefly."]
rows = []
for prompt in prompts:
    ids = engine.encode(prompt)
    answer = engine.generate(prompt, max_new_tokens=40).tokens
    target.reset()
    rows.append(target.forward(torch.tensor(ids + answer[:-1])).features.double())  # final hidden states [L, K]
    target.commit()
x = torch.cat(rows)[::3]  # [M, K]
print(f"{x.shape[0]} rows, largest |x| {float(x.abs().max()):.1f}")
exact = x @ weight.T  # [M, N]
for group in (576, 64, 32, 16):
    w = weight.view(n, k // group, group)
    scale = w.abs().amax(-1, keepdim=True) / 127
    q = torch.where(scale > 0, torch.round(w / scale.clamp_min(1e-30)), torch.zeros_like(w)).clamp(-127, 127)
    err = (w - q * scale).abs().amax(-1)  # [N, K/G]
    bound = x.abs().view(-1, k // group, group).sum(-1) @ err.T  # [M, N]
    threshold = (exact - bound).max(-1, keepdim=True).values
    candidates = ((exact + bound) >= threshold).sum(-1).double()
    print(f"groups of {group}: median bound {float(bound.median()):.3f} logits; candidates median "
          f"{float(candidates.median()):.0f}, mean {float(candidates.mean()):.1f}, max {float(candidates.max()):.0f}; "
          f"per-group errors {n * k // group * 4 / 1e6:.1f} MB")
