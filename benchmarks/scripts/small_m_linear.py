"""Why verifying 2 tokens costs ~1.7x verifying 1 here: time one SmolLM2 projection (the fused gate/up weight,
3072 x 576, float32) for M = 1..32 rows with torch's default path and with MKL's pre-packed sgemm
(`torch.ops.mkl._mkl_linear`, the weight packed once for a given M), when this torch build has it.

    python benchmarks/scripts/small_m_linear.py
"""

import time

import torch
import torch.nn.functional as F

torch.set_num_threads(2)


def median_ms(fn, reps: int = 200) -> float:
    for _ in range(10):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * sorted(times)[reps // 2]


weight = torch.randn(3072, 576)
mb = weight.numel() * 4 / 1e6
packed_ok = torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight")
print(f"weight {mb:.1f} MB float32, torch {torch.__version__}, MKL packed sgemm available: {packed_ok}")
print("| M | F.linear ms | GB/s | MKL packed ms | GB/s |")
print("|---|---|---|---|---|")
for m in (1, 2, 3, 4, 8, 16, 32):
    x = torch.randn(m, 576)
    plain = median_ms(lambda: F.linear(x, weight))
    row = f"| {m} | {plain:.3f} | {mb / plain:.1f} |"
    if packed_ok:
        packed_w = torch.ops.mkl._mkl_reorder_linear_weight(weight, m)
        assert torch.allclose(torch.ops.mkl._mkl_linear(x, packed_w, weight, None, m), F.linear(x, weight), atol=1e-4)
        packed = median_ms(lambda: torch.ops.mkl._mkl_linear(x, packed_w, weight, None, m))
        row += f" {packed:.3f} | {mb / packed:.1f} |"
    else:
        row += " - | - |"
    print(row)
