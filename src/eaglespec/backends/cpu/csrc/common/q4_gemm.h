// Few-row products with weights stored as 4-bit blocks: y[M, N] = x[M, K] W[N, K]^T (+ b), where every block of 32
// consecutive k of a row of W is exactly d q + m with q in [0, 15] and d, m float16 (llama.cpp's Q4_1 form;
// eaglespec.backends.cpu.q4 finds it in float32 weights) or d = d' sc, m = -(dmin mn) (llama.cpp's Q4_K, read from a
// GGUF file by eaglespec.backends.cpu.kquant: d', dmin float16 per 256 k, sc, mn 6-bit), packed by q4.q4_pack.
//
// Why: a decode step of a small model on a few cores is bound by reading its weights; 20 bytes per 32 weights here
// against 64 in bfloat16 (SmolLM2-135M's layers: 66 MB a step instead of 212).
//
// The sum over a block factors: sum_k x[k] (d q[k] + m) = d S + m X with S = sum_k x[k] q[k] and X = sum_k x[k], so a
// weight costs no rebuild, only its q as a number (the micro-kernels: avx2/q4_gemm.h as float32 FMAs,
// avx512/q4_gemm.h as bfloat16 pairs through vdpbf16ps). Every product x[k] q[k] is exact and every row goes through
// the same sums in the same order whatever the number of rows in the call: a row gets the same bits alone or in a
// verify pass (row-invariant), which keeps speculative decoding exactly plain decoding. The result is the float32
// product of the exact 4-bit weights to float32 rounding (not bit for bit the bfloat16 kernel's, nor the other
// build's).
//
// The packed layout (q4_pack in eaglespec/q4.py): common/shared.h, beside its constants. Both builds read it.
//
// AVX2: up to 4 rows multiply the packed nibbles in registers; more take the wide path, which turns each group-block
// into floats once in L1 (same products, same order of sums, same bits: row-invariant across the two). AVX-512: any
// number of rows in tiles of up to 8 (group_rows and group_rows_wide alike), the q turned into bfloat16 once per tile
// and group-block.
// Threads: at::parallel_for over column groups (torch's intra-op pool).
//
// The micro-kernels (isa::, included before this), each for the two packings of d and m (isa::HalfScales,
// isa::SuperScales; the packed tensor's last size tells which): isa::kBf16Rows (whether they take the bfloat16
// rows, or float32 rows scaled by kNibbleScale), group_rows (AVX2: up to kPassRows rows; AVX-512: any number, times
// all 32 columns of a group -> acc), group_rows_wide (any number of rows), unpack_block (a group-block's q as
// float32) and block_scales (its d and m as float32). The Scales give a block's record in its group (block) and its d
// and m (d, m: Q4_K's multiplied out exactly, so either packing of the same weights gives the same bits).

#pragma once

#include "shared.h"

namespace eaglespec::q4 {
namespace {

constexpr int64_t kPassRows = 4;                // up to this many rows: the register path; more: the wide path
constexpr int64_t kMaxM = 64;                   // rows per pass over the weights; longer inputs take several
// x[k] 16^-i for nibble i = k mod 8 (the micro-kernels mask nibble i in place, which leaves q 16^i); the last
// nibble is shifted down, so 1
constexpr float kNibbleScale[8] = {1.0f, 0x1p-4f, 0x1p-8f, 0x1p-12f, 0x1p-16f, 0x1p-20f, 0x1p-24f, 1.0f};

// Rows [0, m) (m <= kMaxM) times every group -> y [m, n] bfloat16. xs: the rows as the micro-kernels take them
// (isa::kBf16Rows: the bfloat16 inputs; else float32 scaled by kNibbleScale), row stride ldx; xsum [m][blocks]: their
// block sums.
template <typename Scales>
void linear_rows(const void* xs, const float* xsum, int64_t ldx, int64_t m, const uint8_t* wp,
                 int64_t groups, int64_t blocks, int64_t n, const float* bp, uint16_t* yp) {
  // (isa::ChunkScope: the AMX build's tiles configured once for a thread's groups)
  for_groups<kCols, kMaxM, isa::ChunkScope>(m, groups, n, bp, yp, [&](int64_t g, float* acc) {
    const uint8_t* group = wp + g * Scales::group_bytes(blocks);
    if (m > kPassRows)  // the same bits either way: the cheaper one for m rows (AVX-512: the same code)
      isa::group_rows_wide<Scales>(m, xs, ldx, xsum, blocks, group, acc);
    else
      isa::group_rows<Scales>(m, xs, ldx, xsum, blocks, group, acc);
  });
}

// Whether the packing is Q4_K's super-blocks (else Q4_1's blocks); checks it against [n, k].
bool check_packed(const at::Tensor& packed, int64_t n, int64_t k) {
  TORCH_CHECK(packed.dim() == 3 && (packed.size(2) == kHalfBlockBytes || packed.size(2) == kSuperBytes) &&
                  packed.scalar_type() == at::kByte && packed.is_contiguous(),
              "q4_linear: packed must come from eaglespec.backends.cpu.q4.q4_pack");
  const bool super = packed.size(2) == kSuperBytes;
  const int64_t k_per = super ? kSuperBlocks * kBlockK : kBlockK;
  TORCH_CHECK(k == packed.size(1) * k_per && n > (packed.size(0) - 1) * kCols && n <= packed.size(0) * kCols,
              "q4_linear: [", n, ", ", k, "] does not match the packed weight (", packed.size(0), " groups of 32 "
              "columns, ", packed.size(1), " blocks of ", k_per, " k)");
  return super;
}

// x [M, K] bfloat16, packed [ceil(n/32), K/32, 640] or [ceil(n/32), K/256, 4736] uint8, bias [n] or none -> [M, n]
// bfloat16.
at::Tensor q4_linear(const at::Tensor& x_in, const at::Tensor& packed, int64_t n,
                     const std::optional<at::Tensor>& bias_in) {
  const ProductCall call(x_in, n, bias_in, "q4_linear");
  const int64_t m = call.m, k = call.k;
  const bool super = check_packed(packed, n, k);
  if (m == 0 || n == 0) return call.y;
  const uint16_t* xp = call.xp();
  uint16_t* yp = call.yp();
  const float* bp = call.bp();
  const int64_t blocks = k / kBlockK, chunk = std::min(kMaxM, m);
  std::unique_ptr<float[]> xf(new float[chunk * k]), xs(new float[isa::kBf16Rows ? 0 : chunk * k]),
      xsum(new float[chunk * blocks]);
  for (int64_t row = 0; row < m; row += kMaxM) {  // each row's sums are independent of the chunk it is in
    const int64_t rows = std::min(kMaxM, m - row);
    widen_bf16(xp + row * k, rows * k, xf.get());  // exact float32 copies of the bfloat16 inputs
    if (!isa::kBf16Rows)
      for (int64_t i = 0; i < rows * k; ++i) xs[i] = xf[i] * kNibbleScale[i % 8];
    for (int64_t i = 0; i < rows * blocks; ++i) {  // in order of k
      float sum = 0.0f;
      for (int64_t kk = 0; kk < kBlockK; ++kk) sum += xf[i * kBlockK + kk];
      xsum[i] = sum;
    }
    const void* rows_in = isa::kBf16Rows ? static_cast<const void*>(xp + row * k) : xs.get();
    (super ? linear_rows<isa::SuperScales> : linear_rows<isa::HalfScales>)(
        rows_in, xsum.get(), k, rows, packed.data_ptr<uint8_t>(), packed.size(0), blocks, n, bp, yp + row * n);
  }
  return call.y;
}

// The same product with each row's inputs quantized to 8-bit integers per block of 32 (Q8Rows, common/shared.h),
// as llama.cpp multiplies its 4-bit blocks: per row, column and block, S = sum_k xq[k] q[k] in int32 (exact, in any
// order), then acc = fma(m, X, fma(d, sx S, acc)) with X = sx sum_k xq[k] (isa::group_rows_q8: AVX-512 VNNI's
// vpdpbusd, or AVX2's vpmaddubsw, 64 or 32 products an instruction against 32 or 8 in the bfloat16 forms). The
// result is the product of the exact 4-bit weights with the rounded inputs, not the bfloat16 product's: another
// arithmetic for the model (an opt-in format; `eaglespec.backends.cpu.q4`). The integer sums and the float steps after
// them are the same on every build, so every build gives the same bits, and each row's are its own (row-invariant).
template <typename Scales>
void linear_rows_q8(const Q8Rows& xq, int64_t row, int64_t m, const float* xsum, const uint8_t* wp, int64_t groups,
                    int64_t blocks, int64_t n, const float* bp, uint16_t* yp) {
  for_groups<kCols, kMaxM, NoScope>(m, groups, n, bp, yp, [&](int64_t g, float* acc) {
    isa::group_rows_q8<Scales>(m, xq.xq.get() + row * xq.k, xq.k, xq.sx.get() + row * blocks, xsum, blocks,
                               wp + g * Scales::group_bytes(blocks), acc);
  });
}

// x [M, K] bfloat16, packed as for q4_linear, bias [n] or none -> [M, n] bfloat16, through int8 inputs.
at::Tensor q4_q8_linear(const at::Tensor& x_in, const at::Tensor& packed, int64_t n,
                        const std::optional<at::Tensor>& bias_in) {
  const ProductCall call(x_in, n, bias_in, "q4_q8_linear");
  const int64_t m = call.m, k = call.k;
  const bool super = check_packed(packed, n, k);
  if (m == 0 || n == 0) return call.y;
  uint16_t* yp = call.yp();
  const int64_t blocks = k / kBlockK;
  Q8Rows xq(m, k);
  xq.quantize(call.xp(), m, /*nibble_order=*/true);
  std::unique_ptr<float[]> xsum(new float[m * blocks]);
  for (int64_t i = 0; i < m * blocks; ++i)  // X = sx sum xq: the block's input sum as the product sees the inputs
    xsum[i] = xq.sx[i] * static_cast<float>(xq.sum16[2 * i] + xq.sum16[2 * i + 1]);
  for (int64_t row = 0; row < m; row += kMaxM)  // each row's sums are independent of the chunk it is in
    (super ? linear_rows_q8<isa::SuperScales> : linear_rows_q8<isa::HalfScales>)(
        xq, row, std::min(kMaxM, m - row), xsum.get() + row * blocks, packed.data_ptr<uint8_t>(), packed.size(0),
        blocks, n, call.bp(), yp + row * n);
  return call.y;
}

// The float32 weights [n, K] the packing holds, fmaf(d, q, m) (gguf's float32 dequantization): to check the
// packing against it.
template <typename Scales>
void unpack(const at::Tensor& packed, int64_t k, float* out) {
  const int64_t groups = packed.size(0), blocks = k / kBlockK;
  alignas(64) float qf[kBlockK * kCols];
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* blk = Scales::block(wp + g * Scales::group_bytes(blocks), b);
      isa::unpack_block<Scales>(blk, qf);
      alignas(64) float d[kCols], m[kCols];
      isa::block_scales<Scales>(blk, b, d, m);
      for (int64_t kk = 0; kk < kBlockK; ++kk)
        for (int64_t c = 0; c < kCols; ++c)
          out[(g * kCols + c) * k + b * kBlockK + kk] = std::fmaf(d[c], qf[kk * kCols + c], m[c]);
    }
}

at::Tensor q4_unpack(const at::Tensor& packed, int64_t n, int64_t k) {
  const bool super = check_packed(packed, n, k);
  at::Tensor w = at::empty({packed.size(0) * kCols, k}, at::kFloat);
  (super ? unpack<isa::SuperScales> : unpack<isa::HalfScales>)(packed, k, w.data_ptr<float>());
  return w.narrow(0, 0, n).contiguous();
}

}  // namespace
}  // namespace eaglespec::q4
