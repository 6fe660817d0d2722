// The 6-bit code products' micro-kernels for CPUs with AVX-512 BF16 (the operator and its packed layout:
// common/q6_gemm.h, common/shared.h).
//
// A k-pair's 64 codes for the 32 columns of a group are rebuilt as 64 bytes from their 48 (pair_codes: the low
// nibbles broadcast to both halves and shifted by 0 or 4, the high 2-bit pieces broadcast to the four lanes and shifted
// by 0, 2, 4, 6, masked, merged), ordered so that one byte unpack against 0x43 (vpunpcklbw,
// vpunpckhbw) makes 16-bit words 0x43qq: the bfloat16 value 128 + q, exactly (bfloat16 holds the integers of
// [128, 256) exactly, and their low 7 bits are the mantissa), in the two halves of each 32-bit lane for the pair's two
// k, 16 columns a vector. vdpbf16ps multiplies them with the row's two bfloat16 inputs of the pair, broadcast: every
// product exact. Per row, column and 16 k: S = the vdpbf16ps chain over the 8 k-pairs in order of k, which is
// sum x (128 + q); then acc = fma(s, S - 160 X, acc), X the 16 inputs' sum (from the host code), since
// q - 32 = (128 + q) - 160. The rebuild and unpack are shared by the tile's up to kTileRows rows.
// Every row goes through exactly these instructions whatever else is in the call (row-invariant).

#pragma once

#include "../common/shared.h"

namespace eaglespec::q6 {
namespace {
namespace avx512 {

// What a thread sets up once for a chunk of groups (the AMX build: its tiles); nothing here.
struct ChunkScope {
  explicit ChunkScope(int64_t) {}
};

constexpr bool kBf16Rows = true;  // the rows come as the operator's bfloat16 inputs
constexpr bool kNeedsSums = true;  // and their 16-k sums X
constexpr int kTileRows = 8;
constexpr int kWideRows = 5;  // tiles of this many rows or more rebuild a block's codes into L1 first (registers)

// The 64 codes Q[t] of the k-pair whose 48 bytes start at `pair`, byte t of the vector (common/shared.h's layout).
inline __m512i pair_codes(const uint8_t* pair) {
  const __m512i low = _mm512_srlv_epi64(  // bytes 0-31: L's low nibbles, 32-63: its high ones (above: garbage)
      _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(pair))),
      _mm512_set_epi64(4, 4, 4, 4, 0, 0, 0, 0));
  const __m512i high = _mm512_srlv_epi64(  // lane s: H >> 2 s, Q[16 s + t] >> 4 in the low 2 bits of byte t
      _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(pair + 32))),
      _mm512_set_epi64(6, 6, 4, 4, 2, 2, 0, 0));
  return _mm512_or_si512(_mm512_and_si512(low, _mm512_set1_epi8(0x0F)),
                         _mm512_slli_epi16(_mm512_and_si512(high, _mm512_set1_epi8(0x03)), 4));
}

// R rows (R <= kTileRows) times the 32 columns of one group, every block -> acc [R][kCols] (float32, overwritten).
// xsum [R][K/16]: each row's sums X of 16 inputs.
template <int R>
void tile_rows(const uint16_t* x, int64_t ldx, const float* xsum, int64_t blocks, const uint8_t* group, float* acc) {
  const __m512i exponent = _mm512_set1_epi8(0x43);
  const int64_t halves = 2 * blocks;
  __m512 a[R][2];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) a[r][0] = a[r][1] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = group + b * kBlockBytes;
    prefetch_records<kBlockBytes, R>(blk);
    const uint8_t* codes = blk + kScaleBytes;
    const auto* scales = reinterpret_cast<const float*>(blk);
    const uint16_t* xb = x + b * kBlockK;
    alignas(64) uint8_t rebuilt[kWideRows <= R ? 16 * 64 : 1];  // wide tiles: the block's 64-byte codes, rebuilt once
    if constexpr (kWideRows <= R)
#pragma GCC unroll 4
      for (int p = 0; p < 16; ++p) _mm512_store_si512(rebuilt + 64 * p, pair_codes(codes + kPairBytes * p));
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {  // k 16 h .. 16 h + 15: one scale
      __m512 s[R][2];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) s[r][0] = s[r][1] = _mm512_setzero_ps();
#pragma GCC unroll 8
      for (int p = 8 * h; p < 8 * h + 8; ++p) {
        const __m512i q = kWideRows <= R ? _mm512_load_si512(rebuilt + 64 * p) : pair_codes(codes + kPairBytes * p);
        const __m512bh w0 = (__m512bh)_mm512_unpacklo_epi8(q, exponent);  // columns 0-15
        const __m512bh w1 = (__m512bh)_mm512_unpackhi_epi8(q, exponent);  // columns 16-31
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          int32_t bits;
          std::memcpy(&bits, xb + r * ldx + 2 * p, sizeof(bits));
          const __m512bh xk = (__m512bh)_mm512_set1_epi32(bits);
          s[r][0] = _mm512_dpbf16_ps(s[r][0], xk, w0);
          s[r][1] = _mm512_dpbf16_ps(s[r][1], xk, w1);
        }
      }
#pragma GCC unroll 2
      for (int v = 0; v < 2; ++v) {
        const __m512 scale = _mm512_loadu_ps(scales + 32 * h + 16 * v);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const __m512 offset = _mm512_set1_ps(160.0f * xsum[r * halves + 2 * b + h]);
          a[r][v] = _mm512_fmadd_ps(scale, _mm512_sub_ps(s[r][v], offset), a[r][v]);
        }
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int v = 0; v < 2; ++v) _mm512_storeu_ps(acc + r * kCols + 16 * v, a[r][v]);
}

// All 32 columns of a group for any number of rows, kTileRows at a time -> acc [rows][kCols].
void group_rows(int64_t rows, const void* x_rows, int64_t ldx, const float* xsum, int64_t blocks, const uint8_t* group,
                float* acc) {
  const auto* x = static_cast<const uint16_t*>(x_rows);
  for (int64_t row = 0; row < rows; row += kTileRows) {
    const uint16_t* xr = x + row * ldx;
    const float* sr = xsum + row * 2 * blocks;
    float* ar = acc + row * kCols;
    with_rows<kTileRows>(std::min<int64_t>(kTileRows, rows - row), [&](auto r) {
      tile_rows<decltype(r)::value>(xr, ldx, sr, blocks, group, ar);
    });
  }
}

// The products with int8 inputs (q6_q8_linear, common/q6_gemm.h). Two k-pairs' codes, unpacked against each other
// as 16-bit words (vpunpcklwd, vpunpckhwd), give each column's codes of 4 consecutive k as the bytes of its 32-bit
// lane, 16 columns in order a vector: vpdpbusd's unsigned operand, against the row's 4 xq of those k broadcast. Per
// row, column and 16 k: S = -32 sum xq (the host code's sums) plus the vpdpbusd chain, which is sum xq (q - 32) in
// int32 (exact), then acc = fma(s, sx S, acc), sx the scale of the 32 inputs the 16 are in (the same steps, and
// bits, as the AVX2 kernel's).
constexpr int kTileRowsQ8 = 6;

template <int R>
void tile_rows_q8(const int8_t* xq, int64_t ldq, const float* sx, const int32_t* sum16, int64_t blocks,
                  const uint8_t* group, float* acc) {
  const int64_t halves = 2 * blocks;
  __m512 a[R][2];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) a[r][0] = a[r][1] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = group + b * kBlockBytes;
    prefetch_records<kBlockBytes, R>(blk);
    const uint8_t* codes = blk + kScaleBytes;
    const auto* scales = reinterpret_cast<const float*>(blk);
    const int8_t* xb = xq + b * kBlockK;
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {  // k 16 h .. 16 h + 15: one scale
      __m512i s[R][2];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) s[r][0] = s[r][1] = _mm512_set1_epi32(-32 * sum16[r * halves + 2 * b + h]);
#pragma GCC unroll 4
      for (int t = 0; t < 4; ++t) {  // k 16 h + 4 t .. 16 h + 4 t + 3: pairs 8 h + 2 t and 8 h + 2 t + 1
        const __m512i q0 = pair_codes(codes + kPairBytes * (8 * h + 2 * t));
        const __m512i q1 = pair_codes(codes + kPairBytes * (8 * h + 2 * t + 1));
        const __m512i w0 = _mm512_unpacklo_epi16(q0, q1);  // columns 0-15
        const __m512i w1 = _mm512_unpackhi_epi16(q0, q1);  // columns 16-31
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          int32_t bits;
          std::memcpy(&bits, xb + r * ldq + 16 * h + 4 * t, sizeof(bits));
          const __m512i xk = _mm512_set1_epi32(bits);
          s[r][0] = _mm512_dpbusd_epi32(s[r][0], w0, xk);
          s[r][1] = _mm512_dpbusd_epi32(s[r][1], w1, xk);
        }
      }
#pragma GCC unroll 2
      for (int v = 0; v < 2; ++v) {
        const __m512 scale = _mm512_loadu_ps(scales + 32 * h + 16 * v);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const __m512 scaled = _mm512_mul_ps(_mm512_cvtepi32_ps(s[r][v]), _mm512_set1_ps(sx[r * blocks + b]));
          a[r][v] = _mm512_fmadd_ps(scale, scaled, a[r][v]);
        }
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int v = 0; v < 2; ++v) _mm512_storeu_ps(acc + r * kCols + 16 * v, a[r][v]);
}

// All 32 columns of a group for any number of rows with int8 inputs (in k order, row stride ldq), in near-equal
// tiles of at most kTileRowsQ8 rows -> acc [rows][kCols]. sx [rows][blocks]: each 32 inputs' scale; sum16
// [rows][2 blocks]: each 16 inputs' sum of xq.
void group_rows_q8(int64_t rows, const int8_t* xq, int64_t ldq, const float* sx, const int32_t* sum16,
                   int64_t blocks, const uint8_t* group, float* acc) {
  for_tiles<kTileRowsQ8>(rows, [&](int64_t row, auto r) {
    tile_rows_q8<decltype(r)::value>(xq + row * ldq, ldq, sx + row * blocks, sum16 + row * 2 * blocks, blocks, group,
                                     acc + row * kCols);
  });
}

}  // namespace avx512

#ifndef EAGLESPEC_AMX  // (the AMX build's micro-kernels, amx/, build on these)
namespace isa = avx512;
#endif

}  // namespace
}  // namespace eaglespec::q6
