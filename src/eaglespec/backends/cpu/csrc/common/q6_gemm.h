// Few-row products with weights stored as 6-bit codes: y[M, N] = x[M, K] W[N, K]^T (+ b), where every 16
// consecutive k of a row of W are exactly s (q - 32) with q in [0, 63] and s one float32: llama.cpp's Q6_K (s = d sc,
// d float16 per 256 k, sc a signed byte per 16: exact in float32, 11 x 7 significant bits) and Q5_0 (s = d per 32, q
// its 5 bits + 16), read from a GGUF file by eaglespec.backends.cpu.kquant, packed by q6.q6_pack as bytes.
//
// Why: such matrices were read as bfloat16 (16 bits a weight); the codes take 8 (6 bits and a float32 scale per 16).
// Qwen2.5-Coder-1.5B's Q4_K_M file keeps half its ffn_down matrices in Q6_K (a fifth of a step's bytes in bfloat16),
// and its 0.5B sibling most of its matrices in Q5_0.
//
// Each 16 k sum to S = sum_k x[k] (q[k] - 32), every product exact (a bfloat16 input times an integer below 256),
// then acc = fma(s, S, acc), block after block; a row goes through the same sums in the same order whatever the
// number of rows in the call (row-invariant), so speculative decoding stays exactly plain decoding. The micro-kernels:
// avx512/q6_gemm.h (the codes unpacked into bfloat16 128 + q, vdpbf16ps over k-pairs, then - 160 X) and
// avx2/q6_gemm.h (the codes turned into floats once per group-block, then float32 FMAs); the two builds' sums
// differ in the last bits (pairs inside vdpbf16ps), each exact against its own plain decoding.
//
// The micro-kernels (isa::, included before this): kBf16Rows (whether they take the bfloat16 rows, else float32
// copies), kNeedsSums (whether they take each 16 inputs' sum X too) and group_rows (any number of rows times all 32
// columns of a group -> acc). Threads: at::parallel_for over column groups.

#pragma once

#include "shared.h"

namespace eaglespec::q6 {
namespace {

constexpr int64_t kMaxM = 64;  // rows per pass over the weights; longer inputs take several

void check_packed(const at::Tensor& packed, int64_t n, int64_t k) {
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kBlockBytes && packed.scalar_type() == at::kByte &&
                  packed.is_contiguous(),
              "q6_linear: packed must come from eaglespec.backends.cpu.q6.q6_pack");
  TORCH_CHECK(k == packed.size(1) * kBlockK && n > (packed.size(0) - 1) * kCols && n <= packed.size(0) * kCols,
              "q6_linear: [", n, ", ", k, "] does not match the packed weight (", packed.size(0), " groups of 32 "
              "columns, ", packed.size(1), " blocks of 32 k)");
}

// x [M, K] bfloat16, packed [ceil(n/32), K/32, 1024] uint8, bias [n] or none -> [M, n] bfloat16.
at::Tensor q6_linear(const at::Tensor& x_in, const at::Tensor& packed, int64_t n,
                     const std::optional<at::Tensor>& bias_in) {
  const ProductCall call(x_in, n, bias_in, "q6_linear");
  const int64_t m = call.m, k = call.k;
  check_packed(packed, n, k);
  if (m == 0 || n == 0) return call.y;
  const uint16_t* xp = call.xp();
  uint16_t* yp = call.yp();
  const float* bp = call.bp();
  const int64_t blocks = k / kBlockK, groups = packed.size(0);
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const int64_t chunk = std::min(kMaxM, m), halves = k / kScaleK;
  std::unique_ptr<float[]> xf(new float[chunk * k]), xsum(new float[isa::kNeedsSums ? chunk * halves : 0]);
  for (int64_t row = 0; row < m; row += kMaxM) {  // each row's sums are independent of the chunk it is in
    const int64_t rows = std::min(kMaxM, m - row);
    widen_bf16(xp + row * k, rows * k, xf.get());  // exact float32 copies
    if (isa::kNeedsSums)
      for (int64_t i = 0; i < rows * halves; ++i) {  // in order of k
        float sum = 0.0f;
        for (int64_t kk = 0; kk < kScaleK; ++kk) sum += xf[i * kScaleK + kk];
        xsum[i] = sum;
      }
    const void* rows_in = isa::kBf16Rows ? static_cast<const void*>(xp + row * k) : xf.get();
    // (isa::ChunkScope: the AMX build's tiles configured once for a thread's groups)
    for_groups<kCols, kMaxM, isa::ChunkScope>(rows, groups, n, bp, yp + row * n, [&](int64_t g, float* acc) {
      isa::group_rows(rows, rows_in, k, xsum.get(), blocks, wp + g * blocks * kBlockBytes, acc);
    });
  }
  return call.y;
}

// The same product with each row's inputs quantized to 8-bit integers per block of 32 (Q8Rows, common/shared.h):
// per row, column and 16 k, S = sum_k xq[k] (q[k] - 32) in int32 (exact), then acc = fma(s, sx S, acc)
// (isa::group_rows_q8). Another arithmetic for the model than q6_linear's (an opt-in format), the same bits on every
// build, each row's its own (row-invariant); see q4_q8_linear.
at::Tensor q6_q8_linear(const at::Tensor& x_in, const at::Tensor& packed, int64_t n,
                        const std::optional<at::Tensor>& bias_in) {
  const ProductCall call(x_in, n, bias_in, "q6_q8_linear");
  const int64_t m = call.m, k = call.k;
  check_packed(packed, n, k);
  if (m == 0 || n == 0) return call.y;
  const uint16_t* xp = call.xp();
  uint16_t* yp = call.yp();
  const float* bp = call.bp();
  const int64_t blocks = k / kBlockK, groups = packed.size(0);
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  Q8Rows xq(m, k);
  xq.quantize(xp, m, /*nibble_order=*/false);
  for (int64_t row = 0; row < m; row += kMaxM) {  // each row's sums are independent of the chunk it is in
    const int64_t rows = std::min(kMaxM, m - row);
    for_groups<kCols, kMaxM, NoScope>(rows, groups, n, bp, yp + row * n, [&](int64_t g, float* acc) {
      isa::group_rows_q8(rows, xq.xq.get() + row * k, k, xq.sx.get() + row * blocks,
                         xq.sum16.get() + row * 2 * blocks, blocks, wp + g * blocks * kBlockBytes, acc);
    });
  }
  return call.y;
}

// One group-block's weights s (q - 32) as float32 [32 k][32 columns] (k-major) into wf (for q6_unpack).
void unpack_block(const uint8_t* blk, float* wf) {
  const auto* scales = reinterpret_cast<const float*>(blk);
  const uint8_t* codes = blk + kScaleBytes;
  for (int64_t k = 0; k < kBlockK; ++k)
    for (int64_t c = 0; c < kCols; ++c) {
      const float q = static_cast<float>(code_at(codes + kPairBytes * (k / 2), code_index(c, k % 2))) - 32.0f;
      wf[k * kCols + c] = scales[kCols * (k / kScaleK) + c] * q;
    }
}

// The float32 weights [n, K] the packing holds, s (q - 32) (gguf's float32 dequantization): to check the packing.
at::Tensor q6_unpack(const at::Tensor& packed, int64_t n, int64_t k) {
  check_packed(packed, n, k);
  const int64_t groups = packed.size(0), blocks = packed.size(1);
  at::Tensor w = at::empty({groups * kCols, k}, at::kFloat);
  float* out = w.data_ptr<float>();
  alignas(64) float wf[kBlockK * kCols];
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t b = 0; b < blocks; ++b) {
      unpack_block(packed.data_ptr<uint8_t>() + (g * blocks + b) * kBlockBytes, wf);
      for (int64_t kk = 0; kk < kBlockK; ++kk)
        for (int64_t c = 0; c < kCols; ++c) out[(g * kCols + c) * k + b * kBlockK + kk] = wf[kk * kCols + c];
    }
  return w.narrow(0, 0, n).contiguous();
}

}  // namespace
}  // namespace eaglespec::q6
