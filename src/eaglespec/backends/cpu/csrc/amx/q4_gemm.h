// The 4-bit block products' micro-kernels for CPUs with AMX-BF16 (the operator and its packed layout:
// common/q4_gemm.h; the AVX-512 build's, whose weight unpacking and scales this one shares: avx512/q4_gemm.h).
//
// Why: on a CPU whose vector units are slow for their memory (2 vCPUs of an Intel Xeon with AMX: a 4-row product
// cost twice a 1-row one through vdpbf16ps), a verify pass of a few rows should cost what one row costs. AMX's
// tdpbf16ps multiplies a tile of up to 16 rows by a 16-column tile in one instruction, so the rows ride along while
// the weights are unpacked once.
//
// Per group-block (32 columns x 32 k): the q are unpacked exactly as in the AVX-512 kernel into two 1 KB weight
// tiles in L1 (16 k-pair rows x 16 columns x 2 k: tdpbf16ps's pair layout is the one vdpbf16ps takes); the rows'
// 32 bfloat16 inputs of the block are a row tile (loaded from the rows in place); a zeroed result tile gets S = sum
// x q over the block (every product exact, summed by the instruction in its fixed order), then acc = fma(m, X,
// fma(d, S, acc)) as in the other builds. A row's S is computed from its own tile row only and by the same
// instructions whatever the tile's number of rows, so a row gets the same bits alone or in a verify pass
// (row-invariant); its bits differ from the AVX-512 build's (another order of the sums), as the AVX2 build's do.

#pragma once

#include "../avx512/q4_gemm.h"
#include "tiles.h"

namespace eaglespec::q4 {
namespace {
namespace amx {

using eaglespec::amx::TileConfig;
using eaglespec::amx::TileScope;

constexpr bool kBf16Rows = true;
constexpr int kTileRows = 16;  // a tile's rows
using avx512::HalfScales;
using avx512::SuperScales;
using avx512::unpack_block;
using avx512::block_scales;
using avx512::group_rows_q8;  // (int8 inputs: vpdpbusd, as on the AVX-512 build)

// The tiles for R rows: 0 the rows' inputs of a block; 1, 2 its weights, columns 0-15 / 16-31; 3, 4 their S.
struct Tiles {
  static constexpr int kTileRows = amx::kTileRows;
  static TileConfig tiles_for(int R) {
    TileConfig config;
    config.tile(0, R, 64).tile(1, 16, 64).tile(2, 16, 64).tile(3, R, 64).tile(4, R, 64);
    return config;
  }
};
using ChunkScope = eaglespec::amx::ChunkScope<Tiles>;  // (the host code makes one per thread's chunk of groups)

// R rows (R <= kTileRows) times the 32 columns of one group, every block -> acc [R][kCols] (float32, overwritten).
template <typename Scales>
void tile_rows(int R, const uint16_t* x, int64_t ldx, const float* xsum, int64_t blocks, const uint8_t* group,
               float* acc) {
  std::optional<TileScope> scope;
  ChunkScope::ensure(scope, R);
  const __m512i table = _mm512_load_si512(avx512::kNibbleBf16);
  const __m512i shifts = _mm512_set1_epi32(4 << 16);
  const __m512i low4 = _mm512_set1_epi32(0x000F000F);
  __m512i control[4];  // as in avx512::tile_rows
  for (int p = 0; p < 4; ++p) {
    alignas(64) uint32_t lanes[16];
    for (int e = 0; e < 16; ++e) {
      const uint32_t byte = 4 * (e % 4) + p;
      lanes[e] = byte | 0x80u << 8 | byte << 16 | 0x80u << 24;
    }
    control[p] = _mm512_load_si512(lanes);
  }
  alignas(64) uint16_t weights[2][16 * 32];  // per column half: 16 k-pair rows of 16 columns x 2 k
  alignas(64) float sums[2][kTileRows * 16];  // per column half: R rows of 16 S
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 2; ++v) _mm512_storeu_ps(acc + r * kCols + 16 * v, _mm512_setzero_ps());
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = Scales::block(group, b);
    for (int line = 0; line < Scales::kBytes; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(blk + 2 * Scales::kBytes + line), _MM_HINT_T0);
    const uint8_t* qs = blk + Scales::kBytes - kQBytes;
    for (int j = 0; j < 4; ++j) {  // k = 32 b + 8 j + 2 p (+ 1): k-pair row 4 j + p
      __m512i words[2];
#pragma GCC unroll 2
      for (int v = 0; v < 2; ++v) words[v] = _mm512_loadu_si512(qs + (4 * j + 2 * v) * 32);
#pragma GCC unroll 4
      for (int p = 0; p < 4; ++p)
#pragma GCC unroll 2
        for (int v = 0; v < 2; ++v) {
          const __m512i pair = _mm512_srlv_epi16(_mm512_shuffle_epi8(words[v], control[p]), shifts);
          _mm512_store_si512(weights[v] + (4 * j + p) * 32,
                             _mm512_permutexvar_epi16(_mm512_and_si512(pair, low4), table));
        }
    }
    _tile_loadd(0, x + b * kBlockK, ldx * sizeof(uint16_t));
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
      const __m512 d = Scales::d(blk, b, v), m = Scales::m(blk, b, v);
      for (int r = 0; r < R; ++r) {
        float* a = acc + r * kCols + 16 * v;
        const __m512 s = _mm512_load_ps(sums[v] + 16 * r);
        _mm512_storeu_ps(a, _mm512_fmadd_ps(m, _mm512_set1_ps(xsum[r * blocks + b]),
                                            _mm512_fmadd_ps(d, s, _mm512_loadu_ps(a))));
      }
    }
  }
}

// All 32 columns of a group for any number of rows, kTileRows at a time -> acc [rows][kCols].
template <typename Scales>
void group_rows(int64_t rows, const void* x_rows, int64_t ldx, const float* xsum, int64_t blocks,
                const uint8_t* group, float* acc) {
  const auto* x = static_cast<const uint16_t*>(x_rows);
  for (int64_t row = 0; row < rows; row += kTileRows)
    tile_rows<Scales>(static_cast<int>(std::min<int64_t>(kTileRows, rows - row)), x + row * ldx, ldx,
                      xsum + row * blocks, blocks, group, acc + row * kCols);
}

template <typename Scales>
void group_rows_wide(int64_t rows, const void* x_rows, int64_t ldx, const float* xsum, int64_t blocks,
                     const uint8_t* group, float* acc) {
  group_rows<Scales>(rows, x_rows, ldx, xsum, blocks, group, acc);
}

}  // namespace amx

namespace isa = amx;

}  // namespace
}  // namespace eaglespec::q4
