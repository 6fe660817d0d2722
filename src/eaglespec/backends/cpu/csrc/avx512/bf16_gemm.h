// The bfloat16 products' micro-kernels for CPUs with AVX-512 BF16 (the operator: common/bf16_gemm.h).
//
// One 64-byte load of the packed weight holds two k-values of 16 columns, the layout of vdpbf16ps's second operand;
// the first operand is a pair of x values broadcast to all lanes. Each tile keeps up to 6 rows x 4 column vectors of
// float32 accumulators in registers (24 of the 32); no horizontal sums are needed. Calls of more than 6 rows run
// several tiles over each group's weights block by block, so the weights are read from memory once per call.
// The second multiply loop (variant 1, tile_part<ROWS, true>) widens the weights to float32 and uses FMAs: on CPUs
// where vdpbf16ps issues at half the FMA rate (Intel Emerald Rapids here) it does the arithmetic of 6-16 rows ~1.4x
// faster.

#pragma once

#include "../common/shared.h"

namespace eaglespec::bf16 {
namespace {
namespace avx512 {

constexpr int64_t kVectors = 4;   // accumulator vectors per row in a tile
constexpr int64_t kMaxRows = 6;   // rows per tile: 6 x 4 accumulators + 4 weight vectors + 1 broadcast <= 32 zmm

// Rows [0, ROWS) of x (row stride ldx) times k-pairs [p0, p1) of one packed group, accumulated into acc (float32
// [ROWS][64], in memory between calls; zeroed first when p0 == 0). Exact: a float32 store and load change nothing,
// so splitting the k range into blocks gives the same sums as one pass.
// FMA = false (variant 0): x is bfloat16 and each k-pair is one vdpbf16ps. FMA = true (variant 1): x is float32
// (exact copies of the bfloat16 inputs), the even-k weights of a packed vector become float32 by a 16-bit shift, the
// odd-k ones by masking off the low half, and each output element is the ordered sum
// ((acc + x[2p] w[2p]) + x[2p+1] w[2p+1]) over p, rounded after every FMA. Either way the same for every row in any
// call.
template <int ROWS, bool FMA>
void tile_part(const void* x_rows, int64_t ldx, const uint16_t* group, int64_t p0, int64_t p1, float* acc_mem) {
  __m512 acc[ROWS][kVectors];
#pragma GCC unroll 8
  for (int r = 0; r < ROWS; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < kVectors; ++v)
      acc[r][v] = p0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(acc_mem + (r * kVectors + v) * 16);
  const uint16_t* w = group + p0 * kGroup * 2;
  for (int64_t p = p0; p < p1; ++p, w += kGroup * 2) {
    if constexpr (FMA) {
      const auto* x = static_cast<const float*>(x_rows);
      const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
      __m512 wv[kVectors];
#pragma GCC unroll 4
      for (int v = 0; v < kVectors; ++v) {
        wv[v] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_loadu_si512(w + v * 32), 16));
        _mm_prefetch(reinterpret_cast<const char*>(w + kFarAhead + v * 32), _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(w + kAhead + v * 32), _MM_HINT_T0);
      }
#pragma GCC unroll 8
      for (int r = 0; r < ROWS; ++r) {
        const __m512 even = _mm512_set1_ps(x[r * ldx + 2 * p]);
#pragma GCC unroll 4
        for (int v = 0; v < kVectors; ++v) acc[r][v] = _mm512_fmadd_ps(even, wv[v], acc[r][v]);
      }
#pragma GCC unroll 4
      for (int v = 0; v < kVectors; ++v)
        wv[v] = _mm512_castsi512_ps(_mm512_and_si512(_mm512_loadu_si512(w + v * 32), high));
#pragma GCC unroll 8
      for (int r = 0; r < ROWS; ++r) {
        const __m512 odd = _mm512_set1_ps(x[r * ldx + 2 * p + 1]);
#pragma GCC unroll 4
        for (int v = 0; v < kVectors; ++v) acc[r][v] = _mm512_fmadd_ps(odd, wv[v], acc[r][v]);
      }
    } else {
      const auto* x = static_cast<const uint16_t*>(x_rows);
      __m512i wv[kVectors];
#pragma GCC unroll 4
      for (int v = 0; v < kVectors; ++v) {
        wv[v] = _mm512_loadu_si512(w + v * 32);
        _mm_prefetch(reinterpret_cast<const char*>(w + kAhead + v * 32), _MM_HINT_T0);
      }
#pragma GCC unroll 8
      for (int r = 0; r < ROWS; ++r) {
        int32_t pair;
        std::memcpy(&pair, x + r * ldx + 2 * p, sizeof(pair));
        const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 4
        for (int v = 0; v < kVectors; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], xb, (__m512bh)wv[v]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < ROWS; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < kVectors; ++v) _mm512_storeu_ps(acc_mem + (r * kVectors + v) * 16, acc[r][v]);
}

template <bool FMA>
void rows_part(int64_t rows, const void* x, int64_t ldx, const uint16_t* group, int64_t p0, int64_t p1,
               float* acc_mem) {
  TORCH_CHECK(rows >= 1 && rows <= 6, "bf16_linear: tile of ", rows, " rows");
  with_rows<6>(rows, [&](auto r) { tile_part<decltype(r)::value, FMA>(x, ldx, group, p0, p1, acc_mem); });
}

// The finished sums of `rows` rows (acc, [rows][64] float32) + bias, rounded once to bfloat16 -> y columns
// [0, columns).
void store_rows(int64_t rows, const float* acc_mem, const float* bias, uint16_t* y, int64_t ldy, int64_t columns) {
  for (int64_t v = 0; v < kVectors; ++v) {
    const int64_t col = v * 16;
    if (col >= columns) break;
    const int64_t left = columns - col;
    const __mmask16 mask = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + col) : _mm512_setzero_ps();
    for (int64_t r = 0; r < rows; ++r) {
      const __m512 sum = _mm512_loadu_ps(acc_mem + (r * kVectors + v) * 16);
      const __m256i out = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(sum, b));
      _mm256_mask_storeu_epi16(y + r * ldy + col, mask, out);
    }
  }
}

// What common/bf16_gemm.h calls besides store_rows.
constexpr bool kDpbf16 = true;
constexpr int64_t kTileRows = kMaxRows;
struct Scratch {
  alignas(64) float acc[kMaxM * kGroup];
};

// All m rows of the call (xf: as float32 for the FMA loop, else null) times one packed group -> acc. With one tile
// the k range is one block; with more, the tiles take turns over blocks of kBlock k-pairs (8 KB of weights): the
// first tile pulls a block from memory, the others find it in L1, and every tile prefetches the next block so the
// stream goes on while they multiply. 16 rows of all a SmolLM2-135M step's products: 7.31 -> 5.56 ms against 3.81
// for one row (kernel_ab.py, 2 cores).
inline void multiply_group(const Tiles& tiling, const uint16_t* xp, const float* xf, int64_t ldx, int64_t,
                           const uint16_t* group, int64_t k_pairs, Scratch& scratch) {
  const int64_t tiles = tiling.count, *tile_rows = tiling.rows;
  float* acc = scratch.acc;
  const int64_t block = tiles == 1 ? k_pairs : kBlock;
  for (int64_t p0 = 0; p0 < k_pairs; p0 += block) {
    const int64_t p1 = std::min(k_pairs, p0 + block);
    for (int64_t t = 0, row = 0; t < tiles; row += tile_rows[t], ++t)
      if (xf)
        rows_part<true>(tile_rows[t], xf + row * ldx, ldx, group, p0, p1, acc + row * kGroup);
      else
        rows_part<false>(tile_rows[t], xp + row * ldx, ldx, group, p0, p1, acc + row * kGroup);
  }
}

}  // namespace avx512

namespace isa = avx512;

}  // namespace
}  // namespace eaglespec::bf16
