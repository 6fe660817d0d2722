"""How many vocabulary entries a rigorous int8 screen of SmolLM2-135M's LM head leaves to score exactly (the
last line is the screen csrc/screened_argmax.cpp implements): with the head's rows quantized to int8 in groups
of G input channels (a scale per row and group) and the input row x kept in float32, every logit a_n of the int8
copy is within e_n = sum_g |x_g|_1 err_ng of the exact one (err_ng: the group's largest |w - s q|), so only the
n with a_n + e_n >= max_m (a_m - e_m) can be the argmax. Prints the bound and the candidate counts over the
target's final hidden states of a few greedy answers (exact logits stand in for a_n, which only moves the
counts by the same bound).

    python benchmarks/microbench/lm_head_screen_bound.py

The first line quantizes x too (one scale per row, as VNNI's integer dot products need): SmolLM2's final hidden
states have outlier channels (|x| up to ~50 against ~1), which widen the bound; hence the float32 x in the others.
The last two lines quantize x per block of 32 channels (an outlier widens only its block), as the kernel does, on
those hidden states and on those of random tokens.
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
# the input quantized too (one scale per row, as integer dot products need): its error sx / 2 per channel adds
# sx * sum_k |s q_nk| / 2 to the bound
row_scale = weight.abs().amax(-1, keepdim=True) / 127  # [N, 1]
row_q = torch.round(weight / row_scale.clamp_min(1e-30)).clamp(-127, 127)
row_err = (weight - row_q * row_scale).abs().amax(-1)  # [N]
sx = x.abs().amax(-1, keepdim=True) / 127  # [M, 1]
bound = x.abs().sum(-1, keepdim=True) * row_err + sx * (row_scale[:, 0] * row_q.abs().sum(-1) / 2)  # [M, N]
candidates = ((exact + bound) >= (exact - bound).max(-1, keepdim=True).values).sum(-1).double()
print(f"input quantized per row, weights per row: median bound {float(bound.median()):.3f} logits; candidates median "
      f"{float(candidates.median()):.0f}, mean {float(candidates.mean()):.1f}, max {float(candidates.max()):.0f}")
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
# What csrc/screened_argmax.cpp does: weights per row as above, the input quantized per block of 32
# channels (an outlier widens only its own block); e_n = |x|_1 err_n + (sum_b sx_b) s_n max_b sum_{k in b} |q_nk| / 2
blocks = x.view(-1, k // 32, 32)
sx_blocks = (blocks.abs().amax(-1) / 127).sum(-1, keepdim=True)  # [M, 1]
block_q = row_q.view(n, k // 32, 32).abs().sum(-1).amax(-1)  # [N]
bound = x.abs().sum(-1, keepdim=True) * row_err + sx_blocks * (row_scale[:, 0] * block_q / 2)  # [M, N]
candidates = ((exact + bound) >= (exact - bound).max(-1, keepdim=True).values).sum(-1).double()
print(f"input quantized per 32 channels, weights per row: median bound {float(bound.median()):.3f} logits; "
      f"candidates median {float(candidates.median()):.0f}, mean {float(candidates.mean()):.1f}, "
      f"max {float(candidates.max()):.0f}")
# The same screen on hidden states of random tokens (what tree auto timed before git 8dec72f): flat logits
ids = torch.randint(0, 40000, (320,))
target.reset()
x_random = target.forward(ids).features.double()[-100::5]  # [20, K]
target.commit()
sx_random = (x_random.view(-1, k // 32, 32).abs().amax(-1) / 127).sum(-1, keepdim=True)
exact = x_random @ weight.T
bound = x_random.abs().sum(-1, keepdim=True) * row_err + sx_random * (row_scale[:, 0] * block_q / 2)
candidates = ((exact + bound) >= (exact - bound).max(-1, keepdim=True).values).sum(-1).double()
print(f"the same on 20 hidden states of random tokens: candidates median {float(candidates.median()):.0f}, "
      f"max {float(candidates.max()):.0f}")
