"""eaglespec's C++ kernels at an older git revision against the working tree's, interleaved in one process.

    python benchmarks/microbench/kernel_ab.py --rev 823231a~1 [--threads 2] [--rows 1,4,6,8,12,16]
        [--contexts 100,250,400] [--repeats 15] [--variant 0|1] [--shapes qwen2.5-coder-1.5b --layers 6]
        [--no-attention]

Both versions are built from the per-ISA layout (csrc/common/, csrc/avx512/, csrc/avx2/, one kernels.cpp per build;
src/eaglespec/backends/cpu/csrc/ since git 823231a, src/eaglespec/csrc/ from e9119e2 until then; older revisions of
the flat layout are refused): the build this CPU loads (eaglespec.backends.cpu.kernels.isa(); EAGLESPEC_KERNEL_ISA=avx2
picks the AVX2 build on an AVX-512 CPU), with the working tree's flags for it, each as its own extension under its own
operator namespace (eaglespec_ab_old, eaglespec_ab_new; ab_kernels.py), so both run side by side on the same inputs:
1. all matrix products of one SmolLM2-135M decode step (random bfloat16 weights of its shapes, 269 MB) for M rows;
2. decode-step attention of its shapes (9 query heads, 3 key/value heads, head_dim 64, bfloat16 cache, 30 layers)
   over c cached keys for n rows with a chain mask (keys transposed, as the schema's `keys_t`).
--variant is the products' multiply loop in both versions: 0 vdpbf16ps (the AVX-512 build's default), 1 float32 FMA
(the AVX2 build's only loop, its default).
Prints median milliseconds and whether the two versions' outputs are equal (products: bit for bit; attention: the
largest difference, as the summation order may differ between versions).
"""

import argparse
import statistics
import time

import torch
from ab_kernels import SHAPES, build

from eaglespec.backends.cpu import kernels

# hidden, intermediate, fused q/k/v outputs, vocabulary, layers of the models whose products a step can time

p = argparse.ArgumentParser()
p.add_argument("--rev", required=True, help="the git revision to compare against (e.g. a commit before a change)")
p.add_argument("--threads", type=int, default=2)
p.add_argument("--rows", default="1,4,6,8,12,16")
p.add_argument("--contexts", default="100,250,400")
p.add_argument("--repeats", type=int, default=15)
p.add_argument("--shapes", choices=sorted(SHAPES), default="smollm2-135m",
               help="whose products a step multiplies (qwen2.5-coder-1.5b: 3.1 GB of weights, packed twice)")
p.add_argument("--layers", type=int, default=None, help="this many layers instead of all the model's (+ LM head)")
p.add_argument("--no-attention", action="store_true", help="time the products only")
p.add_argument("--variant", type=int, choices=sorted(kernels.VARIANTS.values()), default=None,
               help="the products' multiply loop in both versions (0 vdpbf16ps, AVX-512 build only; 1 float32 FMA); "
                    "default: the build's first (AVX-512: 0, AVX2: 1)")
args = p.parse_args()
torch.set_num_threads(args.threads)

ISA = kernels.isa()
if ISA is None:
    raise SystemExit("eaglespec's kernels need a CPU with AVX-512 BF16 + VNNI or AVX2 + FMA + F16C")
loops = {kernels.VARIANTS[name]: name for name in ISA.variants}
variant = kernels.VARIANTS[ISA.variants[0]] if args.variant is None else args.variant
if variant not in loops:
    raise SystemExit(f"--variant {variant}: the {ISA.name} build has only the {' and '.join(ISA.variants)} loop "
                     f"({', '.join(str(code) for code in loops)})")
versions = {}
for name, rev in (("old", args.rev), ("new", None)):
    ops, what = build(rev, f"eaglespec_ab_{name}", ISA)
    versions[name] = ops
    print(f"{name}: {what}")

rows = [int(v) for v in args.rows.split(",")]
# keys go transposed ([kv_heads, head_dim, capacity]) to a kernel whose schema names them keys_t
transposed = {name: ops.tree_attention.default._schema.arguments[1].name == "keys_t" for name, ops in versions.items()}
torch.manual_seed(0)
d, inter, qkv, vocab, layers = SHAPES[args.shapes]
layers = args.layers or layers
shapes = [(qkv, d), (d, d), (2 * inter, d), (d, inter)] * layers + [(vocab, d)]
packs = {name: [] for name in versions}
for n, k in shapes:  # one random weight at a time: only the packed copies stay
    w = torch.randn(n, k).bfloat16() * 0.05
    for name, ops in versions.items():
        packs[name].append(ops.bf16_pack(w))
megabytes = sum(n * k * 2 for n, k in shapes) / 1e6
print(f"\nall products of a step ({args.shapes}, {layers} layers: {len(shapes)}, {megabytes:.0f} MB), {ISA.name} build, "
      f"{loops[variant]} loop, {args.threads} threads, median ms of {args.repeats}, rev {args.rev} against the working "
      "tree")
print("| rows | old | new | same bits |")
print("|---|---|---|---|")
for m in rows:
    xs = {k: torch.randn(m, k).bfloat16() for k in (d, inter)}
    times, outs = {name: [] for name in versions}, {}
    for repeat in range(args.repeats + 2):
        for name, ops in versions.items():
            start = time.perf_counter()
            ys = [ops.bf16_linear(xs[k], packed, n, None, variant) for (n, k), packed in zip(shapes, packs[name])]
            if repeat >= 2:
                times[name].append(1e3 * (time.perf_counter() - start))
            outs[name] = ys
    same = all(torch.equal(a, b) for a, b in zip(outs["old"], outs["new"]))
    print(f"| {m} | {statistics.median(times['old']):.2f} | {statistics.median(times['new']):.2f} | {same} |")

if args.no_attention:
    raise SystemExit(0)
heads, kv_heads, hd, capacity = 9, 3, 64, 1024
keys = [torch.randn(kv_heads, capacity, hd).bfloat16() for _ in range(layers)]
values = [torch.randn(kv_heads, capacity, hd).bfloat16() for _ in range(layers)]
keys_t = [k.transpose(1, 2).contiguous() for k in keys]
print(f"\nattention, 30 layers, bfloat16 cache, {ISA.name} build, {args.threads} threads, median ms of {args.repeats}")
print("| cached keys | rows | old | new | largest difference |")
print("|---|---|---|---|---|")
for c in (int(v) for v in args.contexts.split(",")):
    for n in rows:
        q = torch.randn(heads, n, hd)
        mask = torch.ones(n, n, dtype=torch.bool).tril() if n > 1 else None
        times, outs = {name: [] for name in versions}, {}
        for repeat in range(args.repeats + 2):
            for name, ops in versions.items():
                start = time.perf_counter()
                for k, kt, v in zip(keys, keys_t, values):
                    ks = kt[..., : c + n] if transposed[name] else k[:, : c + n]
                    out = ops.tree_attention(q, ks, v[:, : c + n], mask)
                if repeat >= 2:
                    times[name].append(1e3 * (time.perf_counter() - start))
                outs[name] = out
        diff = (outs["old"] - outs["new"]).abs().max().item()
        print(f"| {c} | {n} | {statistics.median(times['old']):.3f} | {statistics.median(times['new']):.3f} | "
              f"{diff:.1e} |")
