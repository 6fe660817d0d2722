// The 4-bit block products' micro-kernels for CPUs with AVX2 + FMA + F16C (the operator and its packed layout:
// common/q4_gemm.h); the AVX-512 build compiles these too (every AVX-512 CPU runs them).
//
// A weight costs only its q as a float: a mask, a convert and one FMA per row for 8 weights (rebuilding d q + m
// first took a shift and a second FMA more, and two rows waited on 4 FMA chains). Nibble i of a packed word is
// masked in place, which leaves q 16^i (exact in float32), against x[k] 16^-i (exact: a power of two; the rows are
// scaled once a call, kNibbleScale); the last nibble is shifted down instead (q 16^7 does not fit an int32). S sums
// even and odd k apart (2 R V independent FMA chains for R rows and V vectors of 8 columns), then per block
// acc = fma(m, X, fma(d, S_even + S_odd, acc)), then bias, rounded once to bfloat16.
//
// One row takes a block's 4 vectors at once, more rows fewer (their partial sums need the registers). All products
// of a SmolLM2-135M step against the previous rebuild-and-multiply version (benchmarks/microbench/q4_ab.py, both
// built into one process and called alternately, 2 threads, a 2-core Zen 3 VM whose speed moves by 20-40%): 1-2
// rows 3-15% cheaper (more when the VM is fast), 4 rows 10-14%, 6-8 rows ~10% dearer (that version rebuilt each
// block once into L1 for 3 or more rows; here a block's scaling is per row and pass).

#pragma once

#include "../common/shared.h"

namespace eaglespec::q4 {
namespace {
namespace avx2 {

// What a thread sets up once for a chunk of groups (the AMX build: its tiles); nothing here.
struct ChunkScope {
  explicit ChunkScope(int64_t) {}
};

constexpr bool kBf16Rows = false;  // the rows come as float32 scaled by kNibbleScale (common/q4_gemm.h)

inline __m256 half8(const uint8_t* p) {  // 8 float16 -> 8 float32 (exact)
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline __m256 bytes8(const uint8_t* p) {  // 8 uint8 -> 8 float32 (exact)
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// Block b's d and m, vector v of 8 columns, as float32, from its record blk: the two layouts of common/shared.h.
struct HalfScales : HalfLayout {  // Q4_1: float16
  static __m256 d(const uint8_t* blk, int64_t, int v) { return half8(blk + 16 * v); }
  static __m256 m(const uint8_t* blk, int64_t, int v) { return half8(blk + 64 + 16 * v); }
};
struct SuperScales : SuperLayout {  // Q4_K: d sc and -(dmin mn), exact products in float32
  static __m256 d(const uint8_t* blk, int64_t b, int v) {
    return _mm256_mul_ps(half8(header(blk, b) + 16 * v), bytes8(blk + 8 * v));
  }
  static __m256 m(const uint8_t* blk, int64_t b, int v) {
    const __m256 dmin_mn = _mm256_mul_ps(half8(header(blk, b) + 64 + 16 * v), bytes8(blk + 32 + 8 * v));
    return _mm256_xor_ps(dmin_mn, _mm256_set1_ps(-0.0f));
  }
};

// R rows times the V vectors of 8 columns from vector c0 of one group, every block -> acc_out[r][8 c0 ..] (float32,
// row stride kCols). xs: the rows scaled by kNibbleScale, row stride ldx; xsum [R][blocks]: each block's input sum X.
template <typename Scales, int R, int V>
void rows_in_registers(const float* xs, int64_t ldx, const float* xsum, int64_t blocks, const uint8_t* group, int c0,
                       float* acc_out) {
  __m256 acc[R][V];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) acc[r][v] = _mm256_setzero_ps();
  constexpr int64_t kAhead = 4 * Scales::kBytes;  // software prefetch distance: four blocks ahead
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = Scales::block(group, b);
    if (c0 == 0)
      for (int line = 0; line < Scales::kBytes; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(blk + kAhead + line), _MM_HINT_T0);
    __m256 s[2][R][V];  // partial sums of even and odd k: 2 R V independent FMA chains
#pragma GCC unroll 2
    for (int e = 0; e < 2; ++e)
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
        for (int v = 0; v < V; ++v) s[e][r][v] = _mm256_setzero_ps();
    const float* xb = xs + b * kBlockK;
    const uint8_t* qs = blk + Scales::kBytes - kQBytes;
    for (int j = 0; j < 4; ++j) {
      __m256i words[V];
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v)
        words[v] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + (4 * j + c0 + v) * 32));
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) {  // k = 32 b + 8 j + i
        __m256 xk[R];
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) xk[r] = _mm256_broadcast_ss(xb + r * ldx + 8 * j + i);
#pragma GCC unroll 4
        for (int v = 0; v < V; ++v) {
          const __m256i q = i < 7 ? _mm256_and_si256(words[v], _mm256_set1_epi32(0xF << (4 * i)))
                                  : _mm256_srli_epi32(words[v], 28);
          const __m256 qf = _mm256_cvtepi32_ps(q);
#pragma GCC unroll 4
          for (int r = 0; r < R; ++r) s[i & 1][r][v] = _mm256_fmadd_ps(xk[r], qf, s[i & 1][r][v]);
        }
      }
    }
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) {
      const __m256 d = Scales::d(blk, b, c0 + v), m = Scales::m(blk, b, c0 + v);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r)
        acc[r][v] = _mm256_fmadd_ps(m, _mm256_broadcast_ss(xsum + r * blocks + b),
                                    _mm256_fmadd_ps(d, _mm256_add_ps(s[0][r][v], s[1][r][v]), acc[r][v]));
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) _mm256_storeu_ps(acc_out + r * kCols + 8 * (c0 + v), acc[r][v]);
}

// All 32 columns of a group for R <= kPassRows rows: one row reads a block's 4 vectors at once; more rows take
// narrower passes (their partial sums need the registers; the compiler spills the accumulators, read once a block).
template <typename Scales, int R>
void group_rows(const float* xs, int64_t ldx, const float* xsum, int64_t blocks, const uint8_t* group, float* acc) {
  constexpr int V = R == 1 ? 4 : R == 2 ? 2 : 1;
  for (int c0 = 0; c0 < 4; c0 += V) rows_in_registers<Scales, R, V>(xs, ldx, xsum, blocks, group, c0, acc);
}

template <typename Scales>
void group_rows(int64_t rows, const void* x_rows, int64_t ldx, const float* xsum, int64_t blocks,
                const uint8_t* group, float* acc) {
  const auto* xs = static_cast<const float*>(x_rows);
  TORCH_CHECK(rows >= 1 && rows <= 4, "q4_linear: ", rows, " rows in registers");
  with_rows<4>(rows, [&](auto r) { group_rows<Scales, decltype(r)::value>(xs, ldx, xsum, blocks, group, acc); });
}

// The wide path (many rows): a group-block's q is turned into floats once, into L1, and tiles of up to 3 rows x 2
// vectors multiply from there: per k, 3 broadcasts and 2 loads feed 6 FMAs (the register path above spends a mask
// and a convert per vector and row pass, and spills its accumulators from 3 rows on). Every product and sum is the
// register path's, in its order: the same masked-in-place q (q 16^i) against the same scaled x, even and odd k in
// separate sums, then acc = fma(m, X, fma(d, S_even + S_odd, acc)); so a row gets the same bits on either path.

// One group-block's q, masked in place as the register path has them, as float32 [32 k][32 columns] into qm.
template <typename Scales>
void masked_block(const uint8_t* blk, float* qm) {
  const uint8_t* qs = blk + Scales::kBytes - kQBytes;
  for (int j = 0; j < 4; ++j)
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v) {
      const __m256i word = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + (4 * j + v) * 32));
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) {
        const __m256i q = i < 7 ? _mm256_and_si256(word, _mm256_set1_epi32(0xF << (4 * i)))
                                : _mm256_srli_epi32(word, 28);
        _mm256_store_ps(qm + (8 * j + i) * kCols + 8 * v, _mm256_cvtepi32_ps(q));
      }
    }
}

// R rows x vectors v0, v0 + 1 of block b from its floats qm: acc [R][kCols] (row stride kCols) += the block's sums.
template <typename Scales, int R>
void wide_tile(const float* xs, int64_t ldx, const float* xsum, int64_t blocks, int64_t b, const float* qm,
               const uint8_t* blk, int v0, float* acc) {
  __m256 s[2][R][2];
#pragma GCC unroll 2
  for (int e = 0; e < 2; ++e)
#pragma GCC unroll 3
    for (int r = 0; r < R; ++r) s[e][r][0] = s[e][r][1] = _mm256_setzero_ps();
  const float* xb = xs + b * kBlockK;
  const float* q = qm + 8 * v0;
#pragma GCC unroll 4
  for (int k = 0; k < kBlockK; k += 2) {
#pragma GCC unroll 2
    for (int e = 0; e < 2; ++e) {  // k + e: even, then odd
      const __m256 q0 = _mm256_load_ps(q + (k + e) * kCols), q1 = _mm256_load_ps(q + (k + e) * kCols + 8);
#pragma GCC unroll 3
      for (int r = 0; r < R; ++r) {
        const __m256 x = _mm256_broadcast_ss(xb + r * ldx + k + e);
        s[e][r][0] = _mm256_fmadd_ps(x, q0, s[e][r][0]);
        s[e][r][1] = _mm256_fmadd_ps(x, q1, s[e][r][1]);
      }
    }
  }
#pragma GCC unroll 2
  for (int v = 0; v < 2; ++v) {
    const __m256 d = Scales::d(blk, b, v0 + v), m = Scales::m(blk, b, v0 + v);
#pragma GCC unroll 3
    for (int r = 0; r < R; ++r) {
      float* a = acc + r * kCols + 8 * (v0 + v);
      _mm256_storeu_ps(a, _mm256_fmadd_ps(m, _mm256_broadcast_ss(xsum + r * blocks + b),
                                          _mm256_fmadd_ps(d, _mm256_add_ps(s[0][r][v], s[1][r][v]),
                                                          _mm256_loadu_ps(a))));
    }
  }
}

// All m rows times all 32 columns of a group, the wide way: acc [m][kCols] (zeroed here).
template <typename Scales>
__attribute__((noinline))  // (inlined into linear_rows, it made the 1-row path 10-15% slower)
void group_rows_wide(int64_t m, const void* x_rows, int64_t ldx, const float* xsum, int64_t blocks,
                     const uint8_t* group, float* acc) {
  const auto* xs = static_cast<const float*>(x_rows);
  alignas(32) float qm[kBlockK * kCols];
  std::fill(acc, acc + m * kCols, 0.0f);
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = Scales::block(group, b);
    for (int line = 0; line < Scales::kBytes; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(blk + 2 * Scales::kBytes + line), _MM_HINT_T0);
    masked_block<Scales>(blk, qm);
    for (int64_t row = 0; row < m; row += 3) {
      const float* x = xs + row * ldx;
      const float* xr = xsum + row * blocks;
      float* a = acc + row * kCols;
      with_rows<3>(std::min<int64_t>(3, m - row), [&](auto r) {
        for (int v0 = 0; v0 < 4; v0 += 2) wide_tile<Scales, decltype(r)::value>(x, ldx, xr, blocks, b, qm, blk, v0, a);
      });
    }
  }
}

// One group-block's q as float32 [32 k][32 columns] (k-major) into qf (for q4_unpack).
template <typename Scales>
void unpack_block(const uint8_t* blk, float* qf) {
  const __m256i low4 = _mm256_set1_epi32(0xF);
  const uint8_t* qs = blk + Scales::kBytes - kQBytes;
  for (int j = 0; j < 4; ++j)
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v) {
      __m256i word = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + (4 * j + v) * 32));
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i, word = _mm256_srli_epi32(word, 4))
        _mm256_store_ps(qf + (8 * j + i) * kCols + 8 * v, _mm256_cvtepi32_ps(_mm256_and_si256(word, low4)));
    }
}

// Group-block b's d and m of its 32 columns as float32 (32-byte aligned outputs; for q4_unpack).
template <typename Scales>
void block_scales(const uint8_t* blk, int64_t b, float* d, float* m) {
  for (int v = 0; v < 4; ++v) {
    _mm256_store_ps(d + 8 * v, Scales::d(blk, b, v));
    _mm256_store_ps(m + 8 * v, Scales::m(blk, b, v));
  }
}

// The products with int8 inputs (q4_q8_linear, common/q4_gemm.h). Per 8 k of 8 columns, the 32-byte load of their
// words masked (even k) and shifted then masked (odd k) gives each column's four even and four odd q as bytes in its
// 32-bit lane; vpmaddubsw against the row's four even and four odd xq broadcast (the host code stores each 8 inputs'
// even k, then odd k) sums products in pairs (at most 2 x 15 x 127 = 3810 in an int16, no saturation), and
// vpmaddwd by ones sums each lane's int16 into its int32 S: the integers of AVX-512 VNNI's vpdpbusd. Tiles of 3 or
// more rows first add a block's 4 groups of 8 k in int16 (at most 8 x 3810 = 30480 < 2^15: exact) and widen once a
// block, not once per 8 k: vpmaddubsw and vpmaddwd share a port on Zen 2, and that made 4- and 6-row products 2-6%
// cheaper there, but 1- and 2-row ones 5-7% dearer, so those widen per 8 k (q4_ab.py --int8, Qwen2.5-Coder-1.5B's
// shapes, a 2-core Zen 2 VM). Exact integers either way: the same S. Per row, column and block
// acc = fma(m, X, fma(d, sx S, acc)), in the AVX-512 kernel's order (the same bits on either build). The running sums
// stay in acc (L1) between blocks: 8 lanes a register leave too few for a row's 4 vectors.
constexpr int kTileRowsQ8 = 4;

template <typename Scales, int R>
void tile_rows_q8(const int8_t* xq, int64_t ldq, const float* sx, const float* xsum, int64_t blocks,
                  const uint8_t* group, float* acc) {
  const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v) _mm256_storeu_ps(acc + r * kCols + 8 * v, _mm256_setzero_ps());
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = Scales::block(group, b);
    prefetch_records<Scales::kBytes, R>(blk);
    const uint8_t* qs = blk + Scales::kBytes - kQBytes;
    const int8_t* xb = xq + b * kBlockK;
    for (int v = 0; v < 4; ++v) {  // columns 8 v .. 8 v + 7
      constexpr bool kWidenOnce = R >= 3;
      __m256i s[R];  // int32 S, or (kWidenOnce) the block's products summed in pairs per int16 lane
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) s[r] = _mm256_setzero_si256();
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {  // k = 32 b + 8 j .. 32 b + 8 j + 7
        const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + (4 * j + v) * 32));
        const __m256i even = _mm256_and_si256(words, low4);
        const __m256i odd = _mm256_and_si256(_mm256_srli_epi16(words, 4), low4);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          int32_t e, o;
          std::memcpy(&e, xb + r * ldq + 8 * j, sizeof(e));
          std::memcpy(&o, xb + r * ldq + 8 * j + 4, sizeof(o));
          const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(even, _mm256_set1_epi32(e)),
                                                 _mm256_maddubs_epi16(odd, _mm256_set1_epi32(o)));
          s[r] = kWidenOnce ? _mm256_add_epi16(s[r], pairs) : _mm256_add_epi32(s[r], _mm256_madd_epi16(pairs, ones));
        }
      }
      const __m256 d = Scales::d(blk, b, v), m = Scales::m(blk, b, v);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        float* out = acc + r * kCols + 8 * v;
        const __m256i sum = kWidenOnce ? _mm256_madd_epi16(s[r], ones) : s[r];  // S
        const __m256 scaled = _mm256_mul_ps(_mm256_cvtepi32_ps(sum), _mm256_set1_ps(sx[r * blocks + b]));
        _mm256_storeu_ps(out, _mm256_fmadd_ps(m, _mm256_set1_ps(xsum[r * blocks + b]),
                                              _mm256_fmadd_ps(d, scaled, _mm256_loadu_ps(out))));
      }
    }
  }
}

// All 32 columns of a group for any number of rows with int8 inputs, in near-equal tiles of at most kTileRowsQ8
// rows -> acc [rows][kCols]. xq: the rows' int8 inputs (row stride ldq, in nibble order); sx, xsum [rows][blocks]:
// each block's scale and X.
template <typename Scales>
void group_rows_q8(int64_t rows, const int8_t* xq, int64_t ldq, const float* sx, const float* xsum, int64_t blocks,
                   const uint8_t* group, float* acc) {
  for_tiles<kTileRowsQ8>(rows, [&](int64_t row, auto r) {
    tile_rows_q8<Scales, decltype(r)::value>(xq + row * ldq, ldq, sx + row * blocks, xsum + row * blocks, blocks,
                                             group, acc + row * kCols);
  });
}

}  // namespace avx2

namespace isa = avx2;

}  // namespace
}  // namespace eaglespec::q4
