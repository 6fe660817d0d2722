"""The 6-bit code product of this checkout (48 bytes of codes per k-pair: low nibbles and high 2-bit pieces) against
the one of a revision that stored each code in a byte (64 per k-pair, a 1,280-byte group-block: git f50e8a8 until the
change that packed them), in one process: both builds side by side (ab_kernels.py), their outputs compared bit for bit
on the same weights, then the 6-bit products of a Qwen2.5-Coder-1.5B step (its Q4_K_M file keeps 14 ffn_down matrices,
1536 x 8960, in Q6_K; random Q6_K codes of that shape) timed for each number of rows, the two builds alternating call
by call so that a VM whose speed drifts affects both alike.

    python benchmarks/microbench/q6_ab.py --against HEAD [--rows 1,2,4,8] [--repeats 20] [--threads 2]

The older layout is made from this checkout's packing (the same codes and scales, each code back in its own byte), so
both builds multiply the same weights. Prints the median milliseconds of the step's 6-bit products for each build.
"""

import argparse

import torch
from ab_kernels import operator_pair, time_alternating

from eaglespec.backends.cpu import kernels, q6

p = argparse.ArgumentParser()
p.add_argument("--against", required=True, help="a git revision with the 1,280-byte layout (e.g. HEAD before it)")
p.add_argument("--rows", default="1,2,4,8")
p.add_argument("--repeats", type=int, default=20)
p.add_argument("--threads", type=int, default=2)
p.add_argument("--matrices", type=int, default=14, help="1536 x 8960 code matrices a step (the 1.5B: 14)")
args = p.parse_args()
torch.set_num_threads(args.threads)
if not q6.available():
    raise SystemExit("the 6-bit code product needs a CPU with AVX2 + FMA + F16C (or AVX-512), and EAGLESPEC_Q4 not 0")
ISA = kernels.isa()

ops = operator_pair(args.against, "q6_linear", ISA)


def random_codes(n: int, k: int, generator: torch.Generator) -> q6.Codes:
    """Q6_K-like codes: s = d sc with d ~ 1e-4 (float16) per 256 k and sc a signed byte per 16, q uniform."""
    d = (1e-4 * (0.5 + torch.rand(n, k // 256, 1, generator=generator))).half().float()
    sc = torch.randint(-127, 128, (n, k // 256, 16), generator=generator).float()
    return q6.Codes((d * sc).view(n, k // 16), torch.randint(0, 64, (n, k), generator=generator, dtype=torch.uint8))


def byte_layout(packed: torch.Tensor) -> torch.Tensor:
    """This checkout's packing [G, B, 1024] -> the older one [G, B, 1280]: each k-pair's 64 codes in their own bytes."""
    groups, blocks = packed.shape[:2]
    pairs = packed[..., 256:].view(groups, blocks, 16, q6.PAIR_BYTES).long()
    low, high = pairs[..., :32], pairs[..., 32:]
    low = torch.cat([low & 15, low >> 4], dim=-1)  # [G, B, p, 64]
    high = torch.cat([(high >> (2 * s)) & 3 for s in range(4)], dim=-1)  # [G, B, p, 64]
    codes = (low | high << 4).to(torch.uint8).view(groups, blocks, -1)
    return torch.cat([packed[..., :256], codes], dim=-1).contiguous()


generator = torch.Generator().manual_seed(0)
n, k = 1536, 8960
all_codes = [random_codes(n, k, generator) for _ in range(args.matrices)]
packed = {"this": [q6.q6_pack(codes) for codes in all_codes]}
packed[args.against] = [byte_layout(p) for p in packed["this"]]
torch.manual_seed(0)
inputs = torch.randn(16, k).bfloat16()

x = inputs[:9]
outs = {name: op(x, packed[name][0], n, None) for name, op in ops.items()}
exact = x.double() @ all_codes[0].weight().double().T
for name, y in outs.items():
    error = ((y.double() - exact).abs() / (exact.abs() + 1e-3)).max().item()
    print(f"{name}: max relative error {error:.2e}")
print(f"the two builds' outputs are equal bit for bit: {torch.equal(*outs.values())}")

print(f"{args.matrices} products of {n} x {k} (random Q6_K codes), {ISA.name} build, {args.threads} threads, medians "
      f"of {args.repeats} interleaved rounds (ms)")


def step(name, op, rows: int) -> None:
    for weight in packed[name]:
        op(inputs[:rows], weight, n, None)


time_alternating(ops, step, [int(r) for r in args.rows.split(",")], args.repeats)
