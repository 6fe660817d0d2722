// The bfloat16 products' micro-kernels for CPUs with AVX2 + FMA (the operator: common/bf16_gemm.h): the FMA loop
// (variant 1) only, with its arithmetic, hence its bits; no bfloat16 dot-product instruction exists below AVX-512 BF16.
//
// Why bfloat16 weights pay on such a CPU: a decode step of a small model on a few cores is bound by reading its
// weights, and bfloat16 halves the bytes of float32 (SmolLM2-135M: 269 MB instead of 538 a step). The weights are
// widened to float32 in registers (a 16-bit shift for the even k of a pair, a mask for the odd one) and multiplied
// with float32 FMAs, so each output element is the ordered sum ((acc + x[2p] w[2p]) + x[2p+1] w[2p+1]) over k-pairs p,
// rounded after every FMA and once to bfloat16 at the end.
//
// Register tiles for 16 ymm registers: one row takes a group's 64 columns at once (8 accumulators); two rows run two
// tiles of 2 rows x 32 columns that take turns over blocks of 32 k-pairs of a group (8 KB, in L1 after the first
// tile reads it); 4-8 rows tiles of up to 6 rows x 16 columns (4 + 3 and 4 + 4 for 7 and 8) the same way, widening
// in registers (12 accumulators at most); 3 rows and 9 or more widen each block to float32 once and run tiles of up
// to 3 rows x 32 columns over it (widened_part). Either way the weights stream from memory once per call, prefetched
// into L2 four blocks ahead at an even pace: in the widened path the first tile of a block prefetches one line per k,
// so the loads to L2 overlap the arithmetic instead of coming in bursts while a block is widened. All products of 6
// layers + LM head of Qwen2.5-Coder-1.5B on a 2-core Zen 3 VM, median ms, this layout against the earlier one
// (widened tiles from 3 rows on, no far prefetch there; kernel_ab.py --rev 541cf23 --shapes qwen2.5-coder-1.5b
// --layers 6 --no-attention, the table in docs/cpu.md): 3 rows 71 -> 44, 4: 84 -> 58, 5: 85 -> 52, 8: 126 -> 84,
// 12: 144 -> 111; one and two rows run the same code in both (37-40).

#pragma once

#include "../common/shared.h"

namespace eaglespec::bf16 {
namespace {
namespace avx2 {

constexpr int64_t kLanes = 8;
constexpr int64_t kWideRows = 3;  // rows per tile over a widened block (x 4 vectors of 8 columns)
constexpr int kWideV = 4;

// Rows [0, ROWS) of xf (float32, row stride ldx) times k-pairs [p0, p1) of columns [col0, col0 + 8 V) of one packed
// group, accumulated into acc_mem (float32 [ROWS][64], in memory between blocks; zeroed first when p0 == 0). A
// float32 store and load change nothing, so blocks give the same sums as one pass.
template <int ROWS, int V>
void tile_part(const float* x, int64_t ldx, const uint16_t* group, int64_t col0, int64_t p0, int64_t p1,
               float* acc_mem) {
  __m256 acc[ROWS][V];
#pragma GCC unroll 6
  for (int r = 0; r < ROWS; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v)
      acc[r][v] = p0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(acc_mem + r * kGroup + col0 + v * kLanes);
  const __m256i high = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  const uint16_t* w = group + p0 * kGroup * 2 + col0 * 2;
  for (int64_t p = p0; p < p1; ++p, w += kGroup * 2) {
    __m256i raw[V];  // 8 columns x 2 k each
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) raw[v] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + v * 2 * kLanes));
    if (V == 8 || col0 == 0) {  // one prefetch per cache line of the k-pair's 256 bytes
#pragma GCC unroll 4
      for (int line = 0; line < 4; ++line) {
        _mm_prefetch(reinterpret_cast<const char*>(w + kFarAhead + line * 32), _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(w + kAhead + line * 32), _MM_HINT_T0);
      }
    }
#pragma GCC unroll 6
    for (int r = 0; r < ROWS; ++r) {
      const __m256 even = _mm256_broadcast_ss(x + r * ldx + 2 * p);
#pragma GCC unroll 8
      for (int v = 0; v < V; ++v)
        acc[r][v] = _mm256_fmadd_ps(even, _mm256_castsi256_ps(_mm256_slli_epi32(raw[v], 16)), acc[r][v]);
    }
#pragma GCC unroll 6
    for (int r = 0; r < ROWS; ++r) {
      const __m256 odd = _mm256_broadcast_ss(x + r * ldx + 2 * p + 1);
#pragma GCC unroll 8
      for (int v = 0; v < V; ++v)
        acc[r][v] = _mm256_fmadd_ps(odd, _mm256_castsi256_ps(_mm256_and_si256(raw[v], high)), acc[r][v]);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < ROWS; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) _mm256_storeu_ps(acc_mem + r * kGroup + col0 + v * kLanes, acc[r][v]);
}

// Rows [0, rows) of x, 3 <= rows <= 6, as one tile of 16 columns (tile_part).
void narrow_rows(int64_t rows, const float* x, int64_t ldx, const uint16_t* group, int64_t col0, int64_t p0,
                 int64_t p1, float* acc_mem) {
  TORCH_CHECK(rows >= 3 && rows <= 6, "bf16_linear: narrow tile of ", rows, " rows");
  with_rows<6>(rows, [&](auto r) {
    if constexpr (decltype(r)::value >= 3) tile_part<decltype(r)::value, 2>(x, ldx, group, col0, p0, p1, acc_mem);
  });
}

// Calls of 3 or more rows: a block of k-pairs of a group is widened to float32 once ([2 kb][64] floats, k-major, 16
// KB, in L1) and every row tile multiplies from it, so the widening (a shift and a mask per weight vector) is paid
// once per block instead of once per tile: tiles of up to 3 rows x 32 columns (12 accumulators, 3 broadcasts, one
// weight vector at a time), which beat 6 x 16 and 4 x 16 tiles on a 2-core Zen 3 VM (more broadcasts per FMA there).
// The sums are the same: k = 2p, then 2p + 1, for every p.
void widen_block(const uint16_t* group, int64_t p0, int64_t p1, float* wf) {
  const __m256i high = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  const uint16_t* w = group + p0 * kGroup * 2;
  for (int64_t p = p0; p < p1; ++p, w += kGroup * 2, wf += 2 * kGroup) {
#pragma GCC unroll 4
    for (int line = 0; line < 4; ++line)
      _mm_prefetch(reinterpret_cast<const char*>(w + kAhead + line * 32), _MM_HINT_T0);
#pragma GCC unroll 8
    for (int v = 0; v < kGroup / kLanes; ++v) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + v * 2 * kLanes));
      _mm256_store_ps(wf + v * kLanes, _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16)));
      _mm256_store_ps(wf + kGroup + v * kLanes, _mm256_castsi256_ps(_mm256_and_si256(raw, high)));
    }
  }
}

// Rows [0, ROWS) of x times the widened block wf ([2 (p1 - p0)][64] floats) for columns [col0, col0 + 8 V) and
// k-pairs [p0, p1), accumulated into acc_mem as tile_part does; far (or null): lines to prefetch into L2, one per k.
template <int ROWS, int V>
void widened_part(const float* x, int64_t ldx, const float* wf, int64_t col0, int64_t p0, int64_t p1,
                  float* acc_mem, const char* far) {
  __m256 acc[ROWS][V];
#pragma GCC unroll 3
  for (int r = 0; r < ROWS; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v)
      acc[r][v] = p0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(acc_mem + r * kGroup + col0 + v * kLanes);
  const float* w = wf + col0;
  for (int64_t k = 2 * p0; k < 2 * p1; ++k, w += kGroup) {
    if (far) _mm_prefetch(far + (k - 2 * p0) * 64, _MM_HINT_T1);
    __m256 xk[ROWS];
#pragma GCC unroll 3
    for (int r = 0; r < ROWS; ++r) xk[r] = _mm256_broadcast_ss(x + r * ldx + k);
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) {
      const __m256 wv = _mm256_load_ps(w + v * kLanes);
#pragma GCC unroll 3
      for (int r = 0; r < ROWS; ++r) acc[r][v] = _mm256_fmadd_ps(xk[r], wv, acc[r][v]);
    }
  }
#pragma GCC unroll 3
  for (int r = 0; r < ROWS; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) _mm256_storeu_ps(acc_mem + r * kGroup + col0 + v * kLanes, acc[r][v]);
}

void widened_rows(int64_t rows, const float* x, int64_t ldx, const float* wf, int64_t col0, int64_t p0, int64_t p1,
                  float* acc_mem, const char* far) {
  TORCH_CHECK(rows >= 1 && rows <= 3, "bf16_linear: tile of ", rows, " rows");
  with_rows<3>(rows, [&](auto r) {
    widened_part<decltype(r)::value, kWideV>(x, ldx, wf, col0, p0, p1, acc_mem, far);
  });
}

// float32 -> bfloat16 bits in the low halves of 32-bit lanes, rounded to nearest even (as vcvtneps2bf16); NaN a
// quiet NaN.
inline __m256i round_bf16(__m256 value) {
  const __m256i bits = _mm256_castps_si256(value);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))),
                                            16);
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x40));
  return _mm256_blendv_epi8(rounded, quiet, _mm256_castps_si256(_mm256_cmp_ps(value, value, _CMP_UNORD_Q)));
}

// float32 -> 8 packed bfloat16 values (round_bf16).
inline __m128i to_bf16(__m256 v) {
  // 32-bit lanes holding 16-bit values -> 8 packed halves (packus works per 128-bit lane: fix the order after)
  const __m256i rounded = round_bf16(v);
  const __m256i packed = _mm256_packus_epi32(rounded, rounded);
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
}

// The finished sums of `rows` rows (acc, [rows][64] float32) + bias, rounded once to bfloat16 -> y columns
// [0, columns).
void store_rows(int64_t rows, const float* acc_mem, const float* bias, uint16_t* y, int64_t ldy, int64_t columns) {
  alignas(32) float b[kGroup] = {};
  if (bias) std::copy(bias, bias + columns, b);
  for (int64_t col = 0; col < columns; col += kLanes) {
    const int64_t count = std::min(kLanes, columns - col);
    const __m256 bv = _mm256_load_ps(b + col);
    for (int64_t r = 0; r < rows; ++r) {
      const __m128i out = to_bf16(_mm256_add_ps(_mm256_loadu_ps(acc_mem + r * kGroup + col), bv));
      if (count == kLanes)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(y + r * ldy + col), out);
      else {
        alignas(16) uint16_t tail[kLanes];
        _mm_store_si128(reinterpret_cast<__m128i*>(tail), out);
        std::memcpy(y + r * ldy + col, tail, count * sizeof(uint16_t));
      }
    }
  }
}

// What common/bf16_gemm.h calls besides store_rows.
constexpr bool kDpbf16 = false;
constexpr int64_t kTileRows = kWideRows;
struct Scratch {
  alignas(32) float acc[kMaxM * kGroup];
  alignas(32) float wf[2 * kBlock * kGroup];  // a widened block (calls of 3 or more rows)
};

// All m rows of the call (xf: as float32) times one packed group -> acc.
inline void multiply_group(const Tiles& tiling, const uint16_t*, const float* xf, int64_t ldx, int64_t m,
                           const uint16_t* group, int64_t k_pairs, Scratch& scratch) {
  const int64_t tiles = tiling.count, *tile_rows = tiling.rows;
  float* acc = scratch.acc;
  float* wf = scratch.wf;
  if (m == 1) {  // a decode step: every column of the group at once, one pass over k
    tile_part<1, 8>(xf, ldx, group, 0, 0, k_pairs, acc);
  } else if (m == 2) {  // two tiles of 2 rows x 32 columns take turns over blocks of k-pairs
    for (int64_t p0 = 0; p0 < k_pairs; p0 += kBlock) {
      const int64_t p1 = std::min(k_pairs, p0 + kBlock);
      for (int64_t col0 = 0; col0 < kGroup; col0 += kGroup / 2)
        tile_part<2, 4>(xf, ldx, group, col0, p0, p1, acc);
    }
  } else if (m >= 4 && m <= 8) {  // tiles of m (or 4 + m - 4) rows x 16 columns take turns over blocks of k-pairs
    const int64_t first = m <= 6 ? m : 4;
    for (int64_t p0 = 0; p0 < k_pairs; p0 += kBlock) {
      const int64_t p1 = std::min(k_pairs, p0 + kBlock);
      for (int64_t col0 = 0; col0 < kGroup; col0 += kGroup / 4) {
        narrow_rows(first, xf, ldx, group, col0, p0, p1, acc);
        if (m > first) narrow_rows(m - first, xf + first * ldx, ldx, group, col0, p0, p1, acc + first * kGroup);
      }
    }
  } else {  // blocks widened once, then near-equal tiles of up to 3 rows x 32 columns
    for (int64_t p0 = 0; p0 < k_pairs; p0 += kBlock) {
      const int64_t p1 = std::min(k_pairs, p0 + kBlock);
      widen_block(group, p0, p1, wf);
      // the block four ahead (its 4 (p1 - p0) cache lines), one line per k of the first tile's two column halves
      const char* far = reinterpret_cast<const char*>(group + p0 * kGroup * 2 + kFarAhead);
      for (int64_t t = 0, row = 0; t < tiles; row += tile_rows[t], ++t)
        for (int64_t col0 = 0; col0 < kGroup; col0 += kWideV * kLanes)
          widened_rows(tile_rows[t], xf + row * ldx, ldx, wf, col0, p0, p1, acc + row * kGroup,
                       t == 0 ? far + col0 * 2 * (2 * (p1 - p0)) : nullptr);
    }
  }
}

}  // namespace avx2

namespace isa = avx2;

}  // namespace
}  // namespace eaglespec::bf16
