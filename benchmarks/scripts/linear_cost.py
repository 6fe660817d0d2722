"""Time only the float32 matrix products of one SmolLM2-135M-sized forward (30 layers' q/k/v/o/gate/up/down shapes and
the 49152-row LM head, random weights, 540 MB) for 1-16 rows: F.linear (MKL), MKL's packed GEMM, and oneDNN with
weights reordered once (what eaglespec.packed uses).

    python benchmarks/scripts/linear_cost.py [--threads 2]
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--threads", type=int, default=2)
args = p.parse_args()
torch.set_num_threads(args.threads)
shapes = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)] * 30 + [(49152, 576)]
weights = [torch.randn(n, k) for n, k in shapes]
onednn = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights]


def timed(products, rows: int) -> float:
    """Median ms of 7 runs (after 2 warm-ups) of one pass over every weight."""
    inputs = {k: torch.randn(rows, k) for k in (576, 1536)}
    times = []
    for i in range(9):
        start = time.perf_counter()
        products(inputs)
        if i >= 2:
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def plain(x):
    for w in weights:
        F.linear(x[w.shape[1]], w)


def packed(x):
    for w, p in zip(weights, onednn):
        torch.ops.mkldnn._linear_pointwise(x[w.shape[1]], p, None, "none", [], "")


print(f"{args.threads} threads; ms per pass over all weights")
with torch.inference_mode():
    for rows in (1, 2, 4, 8, 16):
        mkl = [torch.ops.mkl._mkl_reorder_linear_weight(w, rows) for w in weights]

        def mkl_packed(x, mkl=mkl):
            for w, p in zip(weights, mkl):
                torch.ops.mkl._mkl_linear(x[w.shape[1]], p, w, None, rows)

        print(f"{rows:2d} rows: F.linear {timed(plain, rows):6.1f}  MKL packed {timed(mkl_packed, rows):6.1f}  "
              f"oneDNN packed {timed(packed, rows):6.1f}")
        del mkl
