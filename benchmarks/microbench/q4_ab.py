"""The 4-bit block product of this checkout against the one of another git revision, in one process: both sources are
built side by side (their operators renamed into two namespaces), checked against a float64 product and for
row-invariance, then all layer products of a SmolLM2-135M step (120 matrices, the real weights) are timed for each
number of rows, the two builds alternating call by call so that a VM whose speed drifts affects both alike.

    python benchmarks/microbench/q4_ab.py --against d1b9b2b~1 [--rows 1,2,3,4,6,8] [--repeats 30] [--threads 2]

Prints the median milliseconds of a step's layer products (the LM head is not included) for each build (built with the
AVX2 flags, which AVX-512 CPUs run too).
"""

import argparse
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from step_matrices import step_matrices
from torch.utils.cpp_extension import load

from eaglespec.backends.cpu import kernels as bf16gemm
from eaglespec.backends.cpu import q4

SOURCE = "src/eaglespec/csrc/avx2/q4_gemm.cpp"
ROOT = Path(__file__).resolve().parents[2]

p = argparse.ArgumentParser()
p.add_argument("--against", required=True, help="git revision whose q4_gemm.cpp to compare with")
p.add_argument("--rows", default="1,2,3,4,6,8")
p.add_argument("--repeats", type=int, default=30)
p.add_argument("--threads", type=int, default=2)
args = p.parse_args()
torch.set_num_threads(args.threads)
if not q4.available():
    raise SystemExit("the 4-bit block product needs a CPU with AVX2 + FMA + F16C (or AVX-512), and EAGLESPEC_Q4 not 0")

builds = {"this": (ROOT / SOURCE).read_text(),
          args.against: subprocess.run(["git", "show", f"{args.against}:{SOURCE}"], cwd=ROOT, check=True,
                                       capture_output=True, text=True).stdout}
work = Path(tempfile.mkdtemp(prefix="q4_ab_"))
namespaces = {}
for i, (name, text) in enumerate(builds.items()):
    namespaces[name] = f"q4ab{i}"
    text = text.replace("TORCH_LIBRARY_FRAGMENT(eaglespec, m)", f"TORCH_LIBRARY_FRAGMENT(q4ab{i}, m)")
    (work / f"q4ab{i}.cpp").write_text(text.replace("TORCH_LIBRARY_IMPL(eaglespec, CPU, m)",
                                                    f"TORCH_LIBRARY_IMPL(q4ab{i}, CPU, m)"))
load("q4_ab", [str(work / f"q4ab{i}.cpp") for i in range(len(builds))], build_directory=str(work),
     extra_cflags=list(bf16gemm.ISAS["avx2"].flags), extra_ldflags=["-fopenmp"], is_python_module=False)
ops = {name: getattr(torch.ops, ns).q4_linear for name, ns in namespaces.items()}

matrices = step_matrices()
layers = [q4.Q4Linear(q4.find_blocks(w)) for w in matrices]
torch.manual_seed(0)
inputs = {k: torch.randn(16, k).bfloat16() for k in (576, 1536)}

for index in (0, 2, 3):  # fused QKV, gate/up, down of layer 0
    layer, exact_weight = layers[index], matrices[index].double()
    x = inputs[layer.in_features][:9]
    exact = x.double() @ exact_weight.T
    for name, op in ops.items():
        y = op(x, layer.packed, layer.out_features, None)
        error = ((y.double() - exact).abs() / (exact.abs() + 1e-3)).max().item()
        invariant = all(torch.equal(op(x[:m], layer.packed, layer.out_features, None), y[:m]) for m in range(1, 10))
        print(f"matrix {index} {name}: max relative error {error:.2e}, row-invariant {invariant}")

names = list(ops)
print(f"{len(layers)} products, {args.threads} threads, medians of {args.repeats} interleaved rounds (ms)")
for rows in (int(r) for r in args.rows.split(",")):
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(args.repeats + 2):  # the first two rounds warm up
        for name in names if round_ % 2 else names[::-1]:
            start = time.perf_counter()
            for layer in layers:
                ops[name](inputs[layer.in_features][:rows], layer.packed, layer.out_features, None)
            if round_ >= 2:
                times[name].append((time.perf_counter() - start) * 1e3)
    print(f"rows {rows}: " + ", ".join(f"{name} {statistics.median(t):.2f}" for name, t in times.items()))
