"""The greedy LM head's screen (`screened_argmax`, csrc/common/screened_argmax.h) of this checkout against the one of
another git revision, in one process: both builds side by side (ab_kernels.py), checked to pick the same tokens, then
timed for each number of rows (a verify pass's rows), the two builds alternating call by call so that a VM whose
speed drifts affects both alike.

    python benchmarks/microbench/screen_ab.py --against HEAD~1 [--rows 1,4,8,9,12,16] [--repeats 20] [--threads 2]
        [--vocab 151936] [--hidden 1536]

The head is random ([vocab, hidden] bfloat16, Qwen2.5-Coder-1.5B's shape by default: 233 MB as int8), and each
input row is a scaled copy of one of its rows plus noise, so that one token stands clear of the rest as on a real
model's final hidden states and only a handful are scored exactly: the timing is the screen's read of the int8
copy. Prints the median milliseconds of a call for each build.
"""

import argparse

import torch
from ab_kernels import operator_pair, time_alternating

from eaglespec.backends.cpu import kernels

p = argparse.ArgumentParser()
p.add_argument("--against", required=True, help="git revision whose screen to compare with")
p.add_argument("--rows", default="1,4,8,9,12,16")
p.add_argument("--repeats", type=int, default=20)
p.add_argument("--threads", type=int, default=2)
p.add_argument("--vocab", type=int, default=151936)
p.add_argument("--hidden", type=int, default=1536)
args = p.parse_args()
torch.set_num_threads(args.threads)
ops = operator_pair(args.against, "screened_argmax", kernels.isa())

generator = torch.Generator().manual_seed(0)
weight = (0.05 * torch.randn(args.vocab, args.hidden, generator=generator)).bfloat16()  # [V, K]
packed, scale, b1, b2 = kernels.int8_rows(weight)
rows = [int(r) for r in args.rows.split(",")]
picks = torch.randint(0, args.vocab, (max(rows),), generator=generator)
x = (6 * weight[picks].float() + 0.05 * torch.randn(max(rows), args.hidden, generator=generator)).bfloat16()  # [M, K]

answers = {name: op(x, packed, scale, b1, b2, weight) for name, op in ops.items()}
first, *others = answers.values()
if not all(torch.equal(first, other) for other in others):
    raise SystemExit(f"the builds disagree: {answers}")
print(f"both builds pick the same {len(first)} tokens ({int((first == picks).sum())} are the rows copied)")
time_alternating(ops, lambda name, op, count: op(x[:count], packed, scale, b1, b2, weight), rows, args.repeats)
