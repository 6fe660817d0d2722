"""The 4-bit block product of this checkout against the one of another git revision, in one process: both versions of
the kernels are built side by side (their operators renamed into two namespaces, ab_kernels.py), checked against a
float64 product and for row-invariance, then all layer products of a SmolLM2-135M step (120 matrices, the real
weights) are timed for each number of rows, the two builds alternating call by call so that a VM whose speed drifts
affects both alike.

    python benchmarks/microbench/q4_ab.py --against 823231a~1 [--rows 1,2,3,4,6,8] [--repeats 30] [--threads 2]
        [--random [--shapes qwen2.5-coder-1.5b]] [--against-isa avx512] [--int8]

--against takes a revision of the per-ISA layout (src/eaglespec/backends/cpu/csrc/ since git 823231a,
src/eaglespec/csrc/ from e9119e2 until then; the 4-bit product is common/q4_gemm.h over <isa>/q4_gemm.h); revisions of
the older flat layout (csrc/avx2/q4_gemm.cpp, e.g. d1b9b2b~1) are refused. Both versions are the build this CPU loads
(eaglespec.backends.cpu.kernels.isa(): AVX-512 micro-kernels since they exist, AVX2 ones before, compiled with the
AVX-512 flags; EAGLESPEC_KERNEL_ISA=avx2 picks the AVX2 build), with the working tree's flags for it. --random times
random exact 4-bit blocks of the step's shapes instead of the real weights (no model download); with --shapes, those
of another model's layer matrices (qwen2.5-coder-1.5b: 28 layers, 1.3 billion weights, 0.8 GB packed;
qwen2.5-coder-0.5b, the draft model of `sps` and `staged`: 24 layers, 358 million weights, 224 MB). --against-isa
builds the revision for another instruction set than this CPU's default (on an AMX CPU, `--against HEAD --against-isa
avx512` times the AMX build's product against the AVX-512 build's). --int8 times the product with int8 inputs
(q4_q8_linear, `--activations int8`) instead, and checks the two builds give the same bits. Prints the median milliseconds of a step's layer
products (the LM head is not included) for each build.
"""

import argparse

import torch
from ab_kernels import SHAPES, operator_pair, time_alternating

from eaglespec import platform
from eaglespec.backends.cpu import kernels, q4

p = argparse.ArgumentParser()
p.add_argument("--against", required=True, help="git revision whose 4-bit product to compare with")
p.add_argument("--rows", default="1,2,3,4,6,8")
p.add_argument("--repeats", type=int, default=30)
p.add_argument("--threads", type=int, default=2)
p.add_argument("--random", action="store_true",
               help="random exact 4-bit blocks of the step's shapes instead of SmolLM2-135M's weights")
p.add_argument("--shapes", choices=sorted(SHAPES), default="smollm2-135m", help="with --random: whose layer shapes")
p.add_argument("--against-isa", choices=sorted(kernels.ISAS), help="build the revision for this instruction set")
p.add_argument("--int8", action="store_true", help="the product with int8 inputs (q4_q8_linear)")
args = p.parse_args()
torch.set_num_threads(args.threads)
if not q4.available():
    raise SystemExit("the 4-bit block product needs a CPU with AVX2 + FMA + F16C (or AVX-512), and EAGLESPEC_Q4 not 0")
ISA = kernels.isa()

against_isa = kernels.ISAS[args.against_isa] if args.against_isa else None
if against_isa is not None and not against_isa.cpu_flags <= platform.cpu_flags():
    raise SystemExit(f"this CPU cannot run the {against_isa.name} build")
ops = operator_pair(args.against, "q4_q8_linear" if args.int8 else "q4_linear", ISA, against_isa)


def random_blocks(n: int, k: int, generator: torch.Generator) -> q4.Blocks:
    """Q4_1-like blocks of a [n, k] weight: d ~ 0.004-0.012, m = -8 d (give or take), q uniform in [0, 15]."""
    d = (0.004 + 0.008 * torch.rand(n, k // q4.BLOCK, generator=generator)).half()
    m = (-d.float() * (7 + 2 * torch.rand(d.shape, generator=generator))).half()
    return q4.Blocks(d, m, torch.randint(0, 16, (n, k), generator=generator, dtype=torch.uint8))


if args.random:
    generator = torch.Generator().manual_seed(0)
    d, inter, qkv, _, n_layers = SHAPES[args.shapes]
    all_blocks = [random_blocks(n, k, generator) for n, k in [(qkv, d), (d, d), (2 * inter, d), (d, inter)] * n_layers]
else:
    from step_matrices import step_matrices

    all_blocks = [q4.find_blocks(w) for w in step_matrices()]  # each rebuilds its matrix bit for bit (Blocks.weight)
    if any(blocks is None for blocks in all_blocks):
        raise SystemExit("a layer matrix is not in exact 4-bit block form (not the Q4_1 GGUF's weights?)")
# (packed, out_features, in_features), packed by eaglespec.backends.cpu.q4 (the layout both versions read); the
# working tree's Q4Linear is not used, as it would load the real torch.ops.eaglespec build as well
layers = [(q4.q4_pack(blocks), *blocks.q.shape) for blocks in all_blocks]
torch.manual_seed(0)
inputs = {k: torch.randn(16, k).bfloat16() for k in {k for _, _, k in layers}}

for index in (0, 2, 3):  # fused QKV, gate/up, down of layer 0
    (packed, n, k), exact_weight = layers[index], all_blocks[index].weight().double()
    x = inputs[k][:9]
    exact = x.double() @ exact_weight.T
    for name, op in ops.items():
        y = op(x, packed, n, None)
        error = ((y.double() - exact).abs() / (exact.abs() + 1e-3)).max().item()
        invariant = all(torch.equal(op(x[:m], packed, n, None), y[:m]) for m in range(1, 10))
        print(f"matrix {index} {name}: max relative error {error:.2e}, row-invariant {invariant}")
    if args.int8:  # the integer sums are exact in any order: every build gives the same bits
        outs = [op(x, packed, n, None) for op in ops.values()]
        print(f"matrix {index}: the builds' outputs equal bit for bit: {torch.equal(*outs)}")

source = f"random 4-bit blocks, {args.shapes}" if args.random else "SmolLM2-135M"
print(f"{len(layers)} products ({source}), {ISA.name} build, "
      f"{args.threads} threads, medians of {args.repeats} interleaved rounds (ms)")


def step(name, op, rows: int) -> None:
    for packed, n, k in layers:
        op(inputs[k][:rows], packed, n, None)


time_alternating(ops, step, [int(r) for r in args.rows.split(",")], args.repeats)
