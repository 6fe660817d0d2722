// The 6-bit code products' micro-kernels for CPUs with AMX-BF16 (the operator and its packed layout:
// common/q6_gemm.h, common/shared.h; the AVX-512 build's, whose code rebuild this one shares: avx512/q6_gemm.h).
//
// Per group-block (32 columns x 32 k) and half (16 k, one scale): the codes are rebuilt and unpacked to the bfloat16
// values 128 + q as in the AVX-512 kernel, into two weight tiles in L1 (8 k-pair rows x 16 columns x 2 k); the
// rows' 16 inputs of the half are a row tile; a zeroed result tile gets S = sum x (128 + q) (every product exact),
// then acc = fma(s, S - 160 X, acc) as in the AVX-512 build. Row-invariant as amx/q4_gemm.h is: a row's sums come
// from its own tile row, by the same instructions whatever the number of rows.

#pragma once

#include "../avx512/q6_gemm.h"
#include "tiles.h"

namespace eaglespec::q6 {
namespace {
namespace amx {

using eaglespec::amx::TileConfig;
using eaglespec::amx::TileScope;
using avx512::group_rows_q8;  // (int8 inputs: vpdpbusd, as on the AVX-512 build)

constexpr bool kBf16Rows = true;
constexpr bool kNeedsSums = true;
constexpr int kTileRows = 16;

// The tiles for R rows: 0 the rows' 16 inputs of a half; 1, 2 its weights, columns 0-15 / 16-31; 3, 4 their S.
struct Tiles {
  static constexpr int kTileRows = amx::kTileRows;
  static TileConfig tiles_for(int R) {
    TileConfig config;
    config.tile(0, R, 32).tile(1, 8, 64).tile(2, 8, 64).tile(3, R, 64).tile(4, R, 64);
    return config;
  }
};
using ChunkScope = eaglespec::amx::ChunkScope<Tiles>;

// R rows (R <= kTileRows) times the 32 columns of one group, every block -> acc [R][kCols] (float32, overwritten).
// xsum [R][K/16]: each row's sums X of 16 inputs.
inline void tile_rows(int R, const uint16_t* x, int64_t ldx, const float* xsum, int64_t blocks, const uint8_t* group,
                      float* acc) {
  std::optional<TileScope> scope;
  ChunkScope::ensure(scope, R);
  const __m512i exponent = _mm512_set1_epi8(0x43);
  const int64_t halves = 2 * blocks;
  alignas(64) uint16_t weights[2][8 * 32];  // per column half: 8 k-pair rows of 16 columns x 2 k
  alignas(64) float sums[2][kTileRows * 16];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 2; ++v) _mm512_storeu_ps(acc + r * kCols + 16 * v, _mm512_setzero_ps());
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = group + b * kBlockBytes;
    for (int line = 0; line < kBlockBytes; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(blk + 2 * kBlockBytes + line), _MM_HINT_T0);
    const uint8_t* codes = blk + kScaleBytes;
    const auto* scales = reinterpret_cast<const float*>(blk);
    for (int h = 0; h < 2; ++h) {  // k 16 h .. 16 h + 15: one scale
#pragma GCC unroll 8
      for (int p = 8 * h; p < 8 * h + 8; ++p) {
        const __m512i q = avx512::pair_codes(codes + kPairBytes * p);
        _mm512_store_si512(weights[0] + (p - 8 * h) * 32, _mm512_unpacklo_epi8(q, exponent));  // columns 0-15
        _mm512_store_si512(weights[1] + (p - 8 * h) * 32, _mm512_unpackhi_epi8(q, exponent));  // columns 16-31
      }
      _tile_loadd(0, x + b * kBlockK + 16 * h, ldx * sizeof(uint16_t));
      _tile_loadd(1, weights[0], 64);
      _tile_loadd(2, weights[1], 64);
      _tile_zero(3);
      _tile_zero(4);
      _tile_dpbf16ps(3, 0, 1);
      _tile_dpbf16ps(4, 0, 2);
      _tile_stored(3, sums[0], 64);
      _tile_stored(4, sums[1], 64);
#pragma GCC unroll 2
      for (int v = 0; v < 2; ++v) {
        const __m512 scale = _mm512_loadu_ps(scales + 32 * h + 16 * v);
        for (int r = 0; r < R; ++r) {
          float* a = acc + r * kCols + 16 * v;
          const __m512 offset = _mm512_set1_ps(160.0f * xsum[r * halves + 2 * b + h]);
          const __m512 s = _mm512_load_ps(sums[v] + 16 * r);
          _mm512_storeu_ps(a, _mm512_fmadd_ps(scale, _mm512_sub_ps(s, offset), _mm512_loadu_ps(a)));
        }
      }
    }
  }
}

// All 32 columns of a group for any number of rows, kTileRows at a time -> acc [rows][kCols].
inline void group_rows(int64_t rows, const void* x_rows, int64_t ldx, const float* xsum, int64_t blocks,
                       const uint8_t* group, float* acc) {
  const auto* x = static_cast<const uint16_t*>(x_rows);
  for (int64_t row = 0; row < rows; row += kTileRows)
    tile_rows(static_cast<int>(std::min<int64_t>(kTileRows, rows - row)), x + row * ldx, ldx,
              xsum + row * 2 * blocks, blocks, group, acc + row * kCols);
}

}  // namespace amx

namespace isa = amx;

}  // namespace
}  // namespace eaglespec::q6
