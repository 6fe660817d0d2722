// Few-row bfloat16 products: y[M, N] = x[M, K] W[N, K]^T (+ b), float32 accumulation, rounded once to bfloat16.
//
// Decode steps and draft-tree verification multiply 1-16 rows by every weight matrix of the model, so they are
// bound by reading the weights (and, from ~8 rows on 2 cores, by arithmetic). The weight is packed once
// (`bf16_pack`) into groups of 64 output columns, k-pairs innermost: [N/64][K/2][64][2]. Each build's micro-kernels
// (avx512/bf16_gemm.h, avx2/bf16_gemm.h) multiply the rows of a call by one group from register tiles, running
// several tiles over each group's weights block by block, so the weights are read from memory once per call.
//
// Two multiply loops (`variant`): 0, vdpbf16ps (AVX-512 BF16 only), and 1, float32 FMAs on weights widened from
// bfloat16, whose every output element is the ordered sum ((acc + x[2p] w[2p]) + x[2p+1] w[2p+1]) over k-pairs p,
// rounded after every FMA: the same bits in both builds. bf16gemm.variant() measures which loop is faster once per
// machine. Either way every output element is the same ordered sum whatever the number of rows in the call and the
// row's place in it: a row gets the same bits in a one-token step as in a verified draft tree (row-invariant).
// Threads: at::parallel_for over column groups (torch's intra-op thread pool, i.e. --threads).
//
// The micro-kernels (isa::, included before this: avx512/bf16_gemm.h, avx2/bf16_gemm.h): kDpbf16 (whether the
// vdpbf16ps loop exists), kTileRows (rows per register tile), Scratch (a thread's buffers: acc, float32 [kMaxM][64],
// and whatever its loops need), multiply_group (rows [0, m) of x times one packed group -> acc) and store_rows (acc +
// bias, rounded once to bfloat16 -> y).

#pragma once

#include "shared.h"

#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/zeros.h>

namespace eaglespec::bf16 {
namespace {

// [N, K] bfloat16 -> [ceil(N/64), ceil(K/2), 64, 2] bfloat16, zero padded: for a k-pair, the 64 columns of a group
// with their two k-values side by side (one 32-bit lane each).
at::Tensor bf16_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, "bf16_pack: weight must be [N, K] bfloat16");
  const int64_t n = weight.size(0), k = weight.size(1);
  const int64_t n_pad = (n + kGroup - 1) / kGroup * kGroup, k_pad = (k + 1) / 2 * 2;
  at::Tensor padded = at::zeros({n_pad, k_pad}, weight.options());
  padded.narrow(0, 0, n).narrow(1, 0, k).copy_(weight);
  return padded.view({n_pad / kGroup, kGroup, k_pad / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

// Rows [0, m) of x, m <= kMaxM, times every packed group -> y [m, n]. xp: bfloat16 rows (the vdpbf16ps loop), xf:
// the same rows as float32 for the FMA loop (variant 1), else null.
void linear_rows(const uint16_t* xp, const float* xf, int64_t ldx, int64_t m, const uint16_t* wp, int64_t groups,
                 int64_t k_pairs, int64_t n, const float* bp, uint16_t* yp) {
  const Tiles tiles(m, isa::kTileRows);
  at::parallel_for(0, groups, 4, [&](int64_t begin, int64_t end) {
    isa::Scratch scratch;
    for (int64_t g = begin; g < end; ++g) {
      const uint16_t* group = wp + g * k_pairs * kGroup * 2;
      const int64_t col = g * kGroup, columns = std::min(kGroup, n - col);
      isa::multiply_group(tiles, xp, xf, ldx, m, group, k_pairs, scratch);
      isa::store_rows(m, scratch.acc, bp ? bp + col : nullptr, yp + col, n, columns);
    }
  });
}

// x [M, K] bfloat16, packed from bf16_pack of a [n, K] weight, bias [n] or none -> [M, n] bfloat16. variant: 0
// multiplies with vdpbf16ps, 1 with float32 FMAs (bf16gemm.variant() picks the faster on the machine; the AVX2
// build has only the FMA loop).
at::Tensor bf16_linear(const at::Tensor& x_in, const at::Tensor& packed, int64_t n,
                       const std::optional<at::Tensor>& bias_in, int64_t variant) {
  TORCH_CHECK(variant == 0 || variant == 1, "bf16_linear: variant must be 0 (vdpbf16ps) or 1 (float32 FMA)");
  TORCH_CHECK(variant == 1 || isa::kDpbf16, "bf16_linear: the AVX2 build has only the float32 FMA loop (variant 1)");
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kBFloat16, "bf16_linear: x must be [M, K] bfloat16");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kGroup && packed.size(3) == 2 &&
                  packed.scalar_type() == at::kBFloat16 && packed.is_contiguous(),
              "bf16_linear: packed must come from bf16_pack");
  const int64_t m = x_in.size(0), k = x_in.size(1), k_pairs = packed.size(1), groups = packed.size(0);
  TORCH_CHECK((k + 1) / 2 == k_pairs && n > (groups - 1) * kGroup && n <= groups * kGroup,
              "bf16_linear: x [", m, ", ", k, "] does not match the packed weight (", n, " outputs)");
  at::Tensor x = x_in.contiguous();
  if (k % 2) x = at::constant_pad_nd(x, {0, 1});
  const at::Tensor bias = float_bias(bias_in, n, "bf16_linear");
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0 || n == 0) return y;
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  const float* bp = float_data(bias);
  const int64_t ldx = x.size(1);
  // The FMA loop reads x as float32 (exact copies of the bfloat16 inputs): each chunk's rows widened into a plain
  // buffer (an ATen conversion costs ~3 us a call, 0.4 ms over a step's 121 products).
  std::unique_ptr<float[]> x_float(variant == 1 ? new float[std::min(kMaxM, m) * ldx] : nullptr);
  for (int64_t row = 0; row < m; row += kMaxM) {  // each row's sums are independent of the chunk it is in
    const int64_t rows = std::min(kMaxM, m - row);
    if (x_float) widen_bf16(xp + row * ldx, rows * ldx, x_float.get());
    linear_rows(xp + row * ldx, x_float.get(), ldx, rows, wp, groups, k_pairs, n, bp, yp + row * n);
  }
  return y;
}

}  // namespace
}  // namespace eaglespec::bf16
