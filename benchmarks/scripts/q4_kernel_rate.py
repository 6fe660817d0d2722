"""Weights per second of the 4-bit block product (eaglespec.q4) against the bfloat16 kernel, on random blocks: a
matrix that stays in L2 (256 x 576, call overhead included) and one far larger than the caches (92,160 x 576: 30
steps' worth of gate/up rows), for 1-3 rows and 1 and 2 threads. Either build (AVX2, AVX-512).

    python benchmarks/scripts/q4_kernel_rate.py
"""

import statistics
import time

import torch

from eaglespec import bf16gemm, q4

if not q4.available():
    raise SystemExit("the 4-bit block product needs a CPU with AVX2 + FMA + F16C (or AVX-512), and EAGLESPEC_Q4 not 0")
bf16gemm.load()
generator = torch.Generator().manual_seed(0)


def random_blocks(n: int, k: int) -> q4.Blocks:
    d = (torch.rand(n, k // 32, generator=generator) * 0.01).half()
    m = (-torch.rand(n, k // 32, generator=generator) * 0.05).half()
    return q4.Blocks(d, m, torch.randint(0, 16, (n, k), generator=generator, dtype=torch.uint8))


for threads in (1, 2):
    torch.set_num_threads(threads)
    for n, k, calls in ((256, 576, 400), (92160, 576, 3)):
        blocks = random_blocks(n, k)
        packed, packed_bf16 = q4.q4_pack(blocks), torch.ops.eaglespec.bf16_pack(blocks.weight().bfloat16())
        x = torch.randn(3, k).bfloat16()
        for rows in (1, 2, 3):
            products = {"q4": lambda: torch.ops.eaglespec.q4_linear(x[:rows], packed, n, None),
                        "bf16": lambda: torch.ops.eaglespec.bf16_linear(x[:rows], packed_bf16, n, None, 1)}
            line = []
            for name, product in products.items():
                product()
                seconds = []
                for _ in range(5):
                    start = time.perf_counter()
                    for _ in range(calls):
                        product()
                    seconds.append((time.perf_counter() - start) / calls)
                line.append(f"{name} {n * k / statistics.median(seconds) / 1e9:.2f} G weights/s")
            print(f"{threads} threads, {n} x {k}, {rows} rows: " + ", ".join(line))
