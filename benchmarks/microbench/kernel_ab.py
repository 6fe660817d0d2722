"""eaglespec's C++ kernels at an older git revision against the working tree's, interleaved in one process.

    python benchmarks/microbench/kernel_ab.py --rev 290bbfc [--threads 2] [--rows 1,4,6,8,12,16]
        [--contexts 100,250,400] [--variant 1]

Each version of csrc/bf16_gemm.cpp and csrc/tree_attention.cpp is built as its own extension under its own operator
namespace (eaglespec_ab_old, eaglespec_ab_new), so both run side by side on the same inputs:
1. all matrix products of one SmolLM2-135M decode step (random bfloat16 weights of its shapes, 269 MB) for M rows;
2. decode-step attention of its shapes (9 query heads, 3 key/value heads, head_dim 64, bfloat16 cache, 30 layers)
   over c cached keys for n rows with a chain mask (keys transposed for a kernel whose schema takes `keys_t`).
Prints median milliseconds and whether the two versions' outputs are equal (products: bit for bit; attention: the
largest difference, as the summation order may differ between versions).
"""

import argparse
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import load

from eaglespec.backends.cpu.kernels import ISAS

ROOT = Path(__file__).resolve().parents[2]
FLAGS = list(ISAS["avx512"].flags)  # these are the AVX-512 build's sources: an AVX-512 BF16 CPU is needed
SOURCES = ("src/eaglespec/csrc/bf16_gemm.cpp", "src/eaglespec/csrc/tree_attention.cpp")
# Since git fc47eda (2026-11-25) the operator schemas and the weight packing live in csrc/ops.cpp; revisions before
# it define them in bf16_gemm.cpp itself. Each version is built with ops.cpp where its revision has one.
SCHEMAS = "src/eaglespec/csrc/ops.cpp"

p = argparse.ArgumentParser()
p.add_argument("--rev", required=True, help="the git revision to compare against (e.g. a commit before a change)")
p.add_argument("--threads", type=int, default=2)
p.add_argument("--rows", default="1,4,6,8,12,16")
p.add_argument("--contexts", default="100,250,400")
p.add_argument("--repeats", type=int, default=15)
p.add_argument("--variant", type=int, default=0,
               help="the products' multiply loop in both versions (0 vdpbf16ps, 1 float32 FMA; "
                    "1 needs both to have it)")
args = p.parse_args()
torch.set_num_threads(args.threads)


def build(name: str, texts: list[str], workdir: Path):
    """Build the sources under operator namespace `name`; returns torch.ops.<name> and whether keys go transposed."""
    paths = []
    for i, text in enumerate(texts):
        text = text.replace("TORCH_LIBRARY(eaglespec,", f"TORCH_LIBRARY({name},")
        text = text.replace("TORCH_LIBRARY_FRAGMENT(eaglespec,", f"TORCH_LIBRARY_FRAGMENT({name},")
        text = text.replace("TORCH_LIBRARY_IMPL(eaglespec,", f"TORCH_LIBRARY_IMPL({name},")
        path = workdir / f"{name}_{i}.cpp"
        path.write_text(text)
        paths.append(str(path))
    load(name, paths, extra_cflags=FLAGS, extra_ldflags=["-fopenmp"], is_python_module=False,
         build_directory=str(workdir))
    return getattr(torch.ops, name), "keys_t" in texts[1]  # texts: bf16_gemm, tree_attention[, ops]


with tempfile.TemporaryDirectory() as tmp:
    def at_rev(path: str) -> str | None:
        shown = subprocess.run(["git", "show", f"{args.rev}:{path}"], cwd=ROOT, capture_output=True, text=True)
        return shown.stdout if shown.returncode == 0 else None

    old_texts = [at_rev(s) for s in SOURCES + (SCHEMAS,)]
    if None in old_texts[:2]:
        raise SystemExit(f"{args.rev} lacks {SOURCES[0]} or {SOURCES[1]}")
    old_texts = [t for t in old_texts if t is not None]
    new_texts = [(ROOT / s).read_text() for s in SOURCES + (SCHEMAS,)]
    (Path(tmp) / "old").mkdir()
    (Path(tmp) / "new").mkdir()
    versions = {"old": build("eaglespec_ab_old", old_texts, Path(tmp) / "old"),
                "new": build("eaglespec_ab_new", new_texts, Path(tmp) / "new")}

rows = [int(v) for v in args.rows.split(",")]
# revisions before git ebe642e take no variant argument; from git 4b6e0ae on (both 2026-11-25) it is required
takes_variant = {name: any(a.name == "variant" for a in ops.bf16_linear.default._schema.arguments)
                 for name, (ops, _) in versions.items()}
torch.manual_seed(0)
d, inter, qkv, vocab, layers = 576, 1536, 960, 49152, 30
shapes = [(qkv, d), (d, d), (2 * inter, d), (d, inter)] * layers + [(vocab, d)]
weights = [torch.randn(n, k).bfloat16() * 0.05 for n, k in shapes]
packs = {name: [ops.bf16_pack(w) for w in weights] for name, (ops, _) in versions.items()}
print(f"all products of a step (121, 269 MB), {args.threads} threads, median ms of {args.repeats}, rev {args.rev} "
      "against the working tree")
print("| rows | old | new | same bits |")
print("|---|---|---|---|")
for m in rows:
    xs = {k: torch.randn(m, k).bfloat16() for k in (d, inter)}
    times, outs = {name: [] for name in versions}, {}
    for repeat in range(args.repeats + 2):
        for name, (ops, _) in versions.items():
            start = time.perf_counter()
            extra = (args.variant,) if takes_variant[name] else ()
            ys = [ops.bf16_linear(xs[k], packed, n, None, *extra) for (n, k), packed in zip(shapes, packs[name])]
            if repeat >= 2:
                times[name].append(1e3 * (time.perf_counter() - start))
            outs[name] = ys
    same = all(torch.equal(a, b) for a, b in zip(outs["old"], outs["new"]))
    print(f"| {m} | {statistics.median(times['old']):.2f} | {statistics.median(times['new']):.2f} | {same} |")

heads, kv_heads, hd, capacity = 9, 3, 64, 1024
keys = [torch.randn(kv_heads, capacity, hd).bfloat16() for _ in range(layers)]
values = [torch.randn(kv_heads, capacity, hd).bfloat16() for _ in range(layers)]
keys_t = [k.transpose(1, 2).contiguous() for k in keys]
print(f"\nattention, 30 layers, bfloat16 cache, {args.threads} threads, median ms of {args.repeats}")
print("| cached keys | rows | old | new | largest difference |")
print("|---|---|---|---|---|")
for c in (int(v) for v in args.contexts.split(",")):
    for n in rows:
        q = torch.randn(heads, n, hd)
        mask = torch.ones(n, n, dtype=torch.bool).tril() if n > 1 else None
        times, outs = {name: [] for name in versions}, {}
        for repeat in range(args.repeats + 2):
            for name, (ops, transposed) in versions.items():
                start = time.perf_counter()
                for k, kt, v in zip(keys, keys_t, values):
                    ks = kt[..., : c + n] if transposed else k[:, : c + n]
                    out = ops.tree_attention(q, ks, v[:, : c + n], mask)
                if repeat >= 2:
                    times[name].append(1e3 * (time.perf_counter() - start))
                outs[name] = out
        diff = (outs["old"] - outs["new"]).abs().max().item()
        print(f"| {c} | {n} | {statistics.median(times['old']):.3f} | {statistics.median(times['new']):.3f} | "
              f"{diff:.1e} |")
