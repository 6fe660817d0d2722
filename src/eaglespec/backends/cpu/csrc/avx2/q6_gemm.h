// The 6-bit code products' micro-kernels for CPUs with AVX2 + FMA (the operator and its packed layout:
// common/q6_gemm.h, common/shared.h).
//
// A group-block's codes are turned into floats q - 32 once, into L1 ([32 k][32 columns]: per k-pair and 8 columns,
// the 16 code bytes rebuilt from their low nibbles and high 2-bit pieces (common/shared.h's layout), split into even
// and odd k by a mask and a shift, widened and converted), and every row multiplies
// from there: per 16 k and 8 columns, even and odd k in two FMA chains, S = S_even + S_odd, then acc = fma(s, S, acc).
// The rows take these steps one after another, each the same whatever else is in the call (row-invariant).

#pragma once

#include "../common/shared.h"

namespace eaglespec::q6 {
namespace {
namespace avx2 {

// What a thread sets up once for a chunk of groups (the AMX build: its tiles); nothing here.
struct ChunkScope {
  explicit ChunkScope(int64_t) {}
};

constexpr bool kBf16Rows = false;  // the rows come as exact float32 copies of the bfloat16 inputs
constexpr bool kNeedsSums = false;

// 8 uint16 codes (one k: columns 4 j .. 4 j + 3, then 16 + 4 j .. 16 + 4 j + 3) -> floats q - 32 in row qk of qf.
inline void codes_to_floats(__m128i q16, int j, float* qk) {
  const __m256 q = _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_cvtepu16_epi32(q16)), _mm256_set1_ps(32.0f));
  _mm_store_ps(qk + 4 * j, _mm256_castps256_ps128(q));
  _mm_store_ps(qk + 16 + 4 * j, _mm256_extractf128_ps(q, 1));
}

// The 64 codes of the k-pair whose 48 bytes start at `pair` (common/shared.h's layout): q[0] = Q[0 .. 31],
// q[1] = Q[32 .. 63] (the low nibbles in place or shifted down by 4, the high 2-bit pieces broadcast to both lanes and
// shifted by 0 and 2, or 4 and 6, masked, moved up and merged).
inline void pair_codes(const uint8_t* pair, __m256i* q) {
  const __m256i nibble = _mm256_set1_epi8(0x0F), two_bits = _mm256_set1_epi8(0x03);
  const __m256i low = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pair));
  const __m256i high = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(pair + 32)));
  const __m256i high0 = _mm256_srlv_epi64(high, _mm256_set_epi64x(2, 2, 0, 0));
  const __m256i high1 = _mm256_srlv_epi64(high, _mm256_set_epi64x(6, 6, 4, 4));
  q[0] = _mm256_or_si256(_mm256_and_si256(low, nibble), _mm256_slli_epi16(_mm256_and_si256(high0, two_bits), 4));
  q[1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(low, 4), nibble),
                         _mm256_slli_epi16(_mm256_and_si256(high1, two_bits), 4));
}

// One group-block's codes as floats q - 32 [32 k][32 columns] into qf (32-byte aligned): per k-pair and 16-byte
// lane j, the even bytes (k = 2 p) by a mask and the odd ones (k = 2 p + 1) by a shift.
inline void block_floats(const uint8_t* codes, float* qf) {
  const __m256i low8 = _mm256_set1_epi16(0x00FF);
  for (int p = 0; p < 16; ++p) {
    __m256i q[2];
    pair_codes(codes + kPairBytes * p, q);
    float* even_k = qf + (2 * p) * kCols;
    float* odd_k = qf + (2 * p + 1) * kCols;
#pragma GCC unroll 2
    for (int half = 0; half < 2; ++half) {
      const __m256i even = _mm256_and_si256(q[half], low8), odd = _mm256_srli_epi16(q[half], 8);
      codes_to_floats(_mm256_castsi256_si128(even), 2 * half, even_k);
      codes_to_floats(_mm256_castsi256_si128(odd), 2 * half, odd_k);
      codes_to_floats(_mm256_extracti128_si256(even, 1), 2 * half + 1, even_k);
      codes_to_floats(_mm256_extracti128_si256(odd, 1), 2 * half + 1, odd_k);
    }
  }
}

// Any number of rows times all 32 columns of a group -> acc [rows][kCols] (float32, overwritten).
void group_rows(int64_t rows, const void* x_rows, int64_t ldx, const float*, int64_t blocks, const uint8_t* group,
                float* acc) {
  const auto* x = static_cast<const float*>(x_rows);
  alignas(32) float qf[kBlockK * kCols];
  std::fill(acc, acc + rows * kCols, 0.0f);
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = group + b * kBlockBytes;
    for (int line = 0; line < kBlockBytes; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(blk + 2 * kBlockBytes + line), _MM_HINT_T0);
    block_floats(blk + kScaleBytes, qf);
    const auto* scales = reinterpret_cast<const float*>(blk);
    for (int64_t r = 0; r < rows; ++r) {
      const float* xb = x + r * ldx + b * kBlockK;
      float* a = acc + r * kCols;
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        __m256 se[4], so[4];
#pragma GCC unroll 4
        for (int v = 0; v < 4; ++v) se[v] = so[v] = _mm256_setzero_ps();
#pragma GCC unroll 8
        for (int k = 16 * h; k < 16 * h + 16; k += 2) {
          const __m256 xe = _mm256_broadcast_ss(xb + k), xo = _mm256_broadcast_ss(xb + k + 1);
#pragma GCC unroll 4
          for (int v = 0; v < 4; ++v) {
            se[v] = _mm256_fmadd_ps(xe, _mm256_load_ps(qf + k * kCols + 8 * v), se[v]);
            so[v] = _mm256_fmadd_ps(xo, _mm256_load_ps(qf + (k + 1) * kCols + 8 * v), so[v]);
          }
        }
#pragma GCC unroll 4
        for (int v = 0; v < 4; ++v) {
          const __m256 scale = _mm256_loadu_ps(scales + 32 * h + 8 * v);
          _mm256_storeu_ps(a + 8 * v, _mm256_fmadd_ps(scale, _mm256_add_ps(se[v], so[v]), _mm256_loadu_ps(a + 8 * v)));
        }
      }
    }
  }
}

// The products with int8 inputs (q6_q8_linear, common/q6_gemm.h). Per block, two k-pairs' codes (pair_codes)
// unpacked against each other as 16-bit words give each column's codes of 4 consecutive k as the bytes of its 32-bit
// lane, 8 columns in order a vector (columns 0-7 and 16-23 from the pairs' Q[0 .. 31], 8-15 and 24-31 from their
// Q[32 .. 63]), built once per block and tile into L1; vpmaddubsw against the row's 4 xq broadcast (at most
// 2 x 63 x 127 in an int16) and vpmaddwd by ones give vpdpbusd's integers. Per row, column and 16 k: S = -32 sum xq
// plus those sums, then acc = fma(s, sx S, acc), as the AVX-512 kernel (the same bits).
constexpr int kTileRowsQ8 = 4;

template <int R>
void tile_rows_q8(const int8_t* xq, int64_t ldq, const float* sx, const int32_t* sum16, int64_t blocks,
                  const uint8_t* group, float* acc) {
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t halves = 2 * blocks;
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v) _mm256_storeu_ps(acc + r * kCols + 8 * v, _mm256_setzero_ps());
  alignas(32) __m256i w[8][4];  // [4 consecutive k][8 columns]: the block's codes in vpmaddubsw's order
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = group + b * kBlockBytes;
    prefetch_records<kBlockBytes, R>(blk);
    const uint8_t* codes = blk + kScaleBytes;
    const auto* scales = reinterpret_cast<const float*>(blk);
    const int8_t* xb = xq + b * kBlockK;
    for (int t = 0; t < 8; ++t) {  // k 4 t .. 4 t + 3: pairs 2 t and 2 t + 1
      __m256i q0[2], q1[2];
      pair_codes(codes + kPairBytes * (2 * t), q0);
      pair_codes(codes + kPairBytes * (2 * t + 1), q1);
      w[t][0] = _mm256_unpacklo_epi16(q0[0], q1[0]);
      w[t][1] = _mm256_unpacklo_epi16(q0[1], q1[1]);
      w[t][2] = _mm256_unpackhi_epi16(q0[0], q1[0]);
      w[t][3] = _mm256_unpackhi_epi16(q0[1], q1[1]);
    }
    for (int h = 0; h < 2; ++h)  // k 16 h .. 16 h + 15: one scale
      for (int v = 0; v < 4; ++v) {
        __m256i s[R];
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) s[r] = _mm256_set1_epi32(-32 * sum16[r * halves + 2 * b + h]);
#pragma GCC unroll 4
        for (int t = 4 * h; t < 4 * h + 4; ++t)
#pragma GCC unroll 4
          for (int r = 0; r < R; ++r) {
            int32_t bits;
            std::memcpy(&bits, xb + r * ldq + 4 * t, sizeof(bits));
            s[r] = _mm256_add_epi32(s[r], _mm256_madd_epi16(_mm256_maddubs_epi16(w[t][v], _mm256_set1_epi32(bits)),
                                                            ones));
          }
        const __m256 scale = _mm256_loadu_ps(scales + 32 * h + 8 * v);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          float* out = acc + r * kCols + 8 * v;
          const __m256 scaled = _mm256_mul_ps(_mm256_cvtepi32_ps(s[r]), _mm256_set1_ps(sx[r * blocks + b]));
          _mm256_storeu_ps(out, _mm256_fmadd_ps(scale, scaled, _mm256_loadu_ps(out)));
        }
      }
  }
}

// All 32 columns of a group for any number of rows with int8 inputs (in k order, row stride ldq), in near-equal
// tiles of at most kTileRowsQ8 rows -> acc [rows][kCols]. sx [rows][blocks]: each 32 inputs' scale; sum16
// [rows][2 blocks]: each 16 inputs' sum.
void group_rows_q8(int64_t rows, const int8_t* xq, int64_t ldq, const float* sx, const int32_t* sum16,
                   int64_t blocks, const uint8_t* group, float* acc) {
  for_tiles<kTileRowsQ8>(rows, [&](int64_t row, auto r) {
    tile_rows_q8<decltype(r)::value>(xq + row * ldq, ldq, sx + row * blocks, sum16 + row * 2 * blocks, blocks, group,
                                     acc + row * kCols);
  });
}

}  // namespace avx2

namespace isa = avx2;

}  // namespace
}  // namespace eaglespec::q6
