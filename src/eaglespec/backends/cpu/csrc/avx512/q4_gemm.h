// The 4-bit block products' micro-kernels for CPUs with AVX-512 BF16 (the operator and its packed layout:
// common/q4_gemm.h; the AVX2 build's: avx2/q4_gemm.h).
//
// The packed q of a group-block (32 columns x 32 k) hold, per column and 8 consecutive k, one 32-bit word of 8
// nibbles, k in nibble order. Byte p of such a word is the k-pair (2p, 2p + 1) of its column. One 64-byte load takes
// the words of 16 columns; per pair, a byte shuffle puts byte p in both 16-bit halves of each 32-bit lane, a
// per-half shift and a mask leave the even k's q in the low half and the odd k's in the high half, and a 16-bit
// table lookup (vpermw) turns each q in [0, 15] into its bfloat16 value (exact). That is vdpbf16ps's second
// operand; the first is the row's two bfloat16 inputs at that pair, broadcast. So the rows multiply the weights as
// they are (no scaled copies of x), 32 products an instruction, and the q are turned into bfloat16 once per call
// and group-block, whatever the number of rows (the AVX2 kernel spends a mask, a convert and an FMA per 8 weights
// and row pass).
//
// Per row, column and block: S = the vdpbf16ps chain over the block's 16 k-pairs in order of k, then
// acc = fma(m, X, fma(d, S, acc)) as in the AVX2 kernel (X: the block's input sum, computed by the host code).
// Every row goes through exactly these instructions whatever else is in the call, in tiles of up to kTileRows rows:
// a row gets the same bits alone or in a verify pass (row-invariant). The sums differ from the AVX2 kernel's (pairs
// of products are added inside vdpbf16ps), so the two builds' results differ in the last bits, as their bfloat16
// products do.

#pragma once

#include "../common/shared.h"

namespace eaglespec::q4 {
namespace {
namespace avx512 {

// What a thread sets up once for a chunk of groups (the AMX build: its tiles); nothing here.
struct ChunkScope {
  explicit ChunkScope(int64_t) {}
};

constexpr bool kBf16Rows = true;  // the rows come as the operator's bfloat16 inputs (not nibble-scaled floats)
constexpr int kTileRows = 8;      // rows per pass over a group: 2 x 8 sums + 8 weight and constant vectors

inline __m512 half16(const uint8_t* p) {  // 16 float16 -> 16 float32 (exact)
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 bytes16(const uint8_t* p) {  // 16 uint8 -> 16 float32 (exact)
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// Block b's d and m for columns 16 v .. 16 v + 15, as float32, from its record blk: the two layouts of
// common/shared.h.
struct HalfScales : HalfLayout {  // Q4_1: float16
  static __m512 d(const uint8_t* blk, int64_t, int v) { return half16(blk + 32 * v); }
  static __m512 m(const uint8_t* blk, int64_t, int v) { return half16(blk + 64 + 32 * v); }
};
struct SuperScales : SuperLayout {  // Q4_K: d sc and -(dmin mn), exact products in float32
  static __m512 d(const uint8_t* blk, int64_t b, int v) {
    return _mm512_mul_ps(half16(header(blk, b) + 32 * v), bytes16(blk + 16 * v));
  }
  static __m512 m(const uint8_t* blk, int64_t b, int v) {
    const __m512 dmin_mn = _mm512_mul_ps(half16(header(blk, b) + 64 + 32 * v), bytes16(blk + 32 + 16 * v));
    return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(dmin_mn), _mm512_set1_epi32(INT32_MIN)));
  }
};

// The bfloat16 bits of 0 .. 15 (vpermw's table; its upper 16 entries are never indexed).
alignas(64) constexpr uint16_t kNibbleBf16[32] = {0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
                                                  0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170};

// R rows (R <= kTileRows) times the 32 columns of one group, every block -> acc [R][kCols] (float32, overwritten).
// x: the rows' bfloat16 inputs (row stride ldx); xsum [R][blocks]: each block's input sum X.
template <typename Scales, int R>
void tile_rows(const uint16_t* x, int64_t ldx, const float* xsum, int64_t blocks, const uint8_t* group, float* acc) {
  const __m512i table = _mm512_load_si512(kNibbleBf16);
  const __m512i shifts = _mm512_set1_epi32(4 << 16);       // the high half of a lane (odd k) down by 4
  const __m512i low4 = _mm512_set1_epi32(0x000F000F);
  __m512i control[4];  // vpshufb: byte p of each 32-bit lane into bytes 0 and 2 of the lane, zeros into 1 and 3
#pragma GCC unroll 4
  for (int p = 0; p < 4; ++p) {
    alignas(64) uint32_t lanes[16];
    for (int e = 0; e < 16; ++e) {  // (vpshufb indexes bytes within each 16-byte lane: lane e is its e % 4)
      const uint32_t byte = 4 * (e % 4) + p;
      lanes[e] = byte | 0x80u << 8 | byte << 16 | 0x80u << 24;
    }
    control[p] = _mm512_load_si512(lanes);
  }
  __m512 a[R][2];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) a[r][0] = a[r][1] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = Scales::block(group, b);
    prefetch_records<Scales::kBytes, R>(blk);
    const uint8_t* qs = blk + Scales::kBytes - kQBytes;
    const uint16_t* xb = x + b * kBlockK;
    __m512 s[R][2];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) s[r][0] = s[r][1] = _mm512_setzero_ps();
    for (int j = 0; j < 4; ++j) {  // k = 32 b + 8 j + 2 p (+ 1)
      __m512i words[2];
#pragma GCC unroll 2
      for (int v = 0; v < 2; ++v)  // columns 16 v .. 16 v + 15: the 32-byte rows 4 j + 2 v and 4 j + 2 v + 1
        words[v] = _mm512_loadu_si512(qs + (4 * j + 2 * v) * 32);
#pragma GCC unroll 4
      for (int p = 0; p < 4; ++p) {
        __m512bh w[2];
#pragma GCC unroll 2
        for (int v = 0; v < 2; ++v) {
          const __m512i pair = _mm512_srlv_epi16(_mm512_shuffle_epi8(words[v], control[p]), shifts);
          w[v] = (__m512bh)_mm512_permutexvar_epi16(_mm512_and_si512(pair, low4), table);
        }
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          int32_t bits;
          std::memcpy(&bits, xb + r * ldx + 8 * j + 2 * p, sizeof(bits));
          const __m512bh xk = (__m512bh)_mm512_set1_epi32(bits);
          s[r][0] = _mm512_dpbf16_ps(s[r][0], xk, w[0]);
          s[r][1] = _mm512_dpbf16_ps(s[r][1], xk, w[1]);
        }
      }
    }
#pragma GCC unroll 2
    for (int v = 0; v < 2; ++v) {
      const __m512 d = Scales::d(blk, b, v), m = Scales::m(blk, b, v);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r)
        a[r][v] = _mm512_fmadd_ps(m, _mm512_set1_ps(xsum[r * blocks + b]), _mm512_fmadd_ps(d, s[r][v], a[r][v]));
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int v = 0; v < 2; ++v) _mm512_storeu_ps(acc + r * kCols + 16 * v, a[r][v]);
}

// All 32 columns of a group for any number of rows, kTileRows at a time -> acc [rows][kCols].
template <typename Scales>
void group_rows(int64_t rows, const void* x_rows, int64_t ldx, const float* xsum, int64_t blocks,
                const uint8_t* group, float* acc) {
  const auto* x = static_cast<const uint16_t*>(x_rows);
  for (int64_t row = 0; row < rows; row += kTileRows) {
    const uint16_t* xr = x + row * ldx;
    const float* sr = xsum + row * blocks;
    float* ar = acc + row * kCols;
    with_rows<kTileRows>(std::min<int64_t>(kTileRows, rows - row), [&](auto r) {
      tile_rows<Scales, decltype(r)::value>(xr, ldx, sr, blocks, group, ar);
    });
  }
}

// The host code's entry for more than kPassRows rows (common/q4_gemm.h): the same tiles.
template <typename Scales>
void group_rows_wide(int64_t rows, const void* x_rows, int64_t ldx, const float* xsum, int64_t blocks,
                     const uint8_t* group, float* acc) {
  group_rows<Scales>(rows, x_rows, ldx, xsum, blocks, group, acc);
}

// The products with int8 inputs (q4_q8_linear, common/q4_gemm.h). Per 8 k of 16 columns, the 64-byte load of their
// words masked (even k) and shifted then masked (odd k) gives each column's four even and four odd q as bytes in its
// 32-bit lane: vpdpbusd's unsigned operand, against the row's four even and four odd xq broadcast (the host code
// stores each 8 inputs' even k, then odd k). Per row, column and block: S in int32 over the block's 32 k, then
// acc = fma(m, X, fma(d, sx S, acc)), the float steps in the AVX2 kernel's order (the same bits on either build).
constexpr int kTileRowsQ8 = 6;  // 2 x 6 int32 sums + 2 x 6 float32 ones + 4 weight vectors in the 32 registers

template <typename Scales, int R>
void tile_rows_q8(const int8_t* xq, int64_t ldq, const float* sx, const float* xsum, int64_t blocks,
                  const uint8_t* group, float* acc) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512 a[R][2];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) a[r][0] = a[r][1] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = Scales::block(group, b);
    prefetch_records<Scales::kBytes, R>(blk);
    const uint8_t* qs = blk + Scales::kBytes - kQBytes;
    const int8_t* xb = xq + b * kBlockK;
    __m512i s[R][2];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) s[r][0] = s[r][1] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {  // k = 32 b + 8 j .. 32 b + 8 j + 7
      __m512i even[2], odd[2];
#pragma GCC unroll 2
      for (int v = 0; v < 2; ++v) {  // columns 16 v .. 16 v + 15
        const __m512i words = _mm512_loadu_si512(qs + (4 * j + 2 * v) * 32);
        even[v] = _mm512_and_si512(words, low4);
        odd[v] = _mm512_and_si512(_mm512_srli_epi16(words, 4), low4);
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        int32_t e, o;
        std::memcpy(&e, xb + r * ldq + 8 * j, sizeof(e));
        std::memcpy(&o, xb + r * ldq + 8 * j + 4, sizeof(o));
        const __m512i xe = _mm512_set1_epi32(e), xo = _mm512_set1_epi32(o);
#pragma GCC unroll 2
        for (int v = 0; v < 2; ++v)
          s[r][v] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(s[r][v], even[v], xe), odd[v], xo);
      }
    }
#pragma GCC unroll 2
    for (int v = 0; v < 2; ++v) {
      const __m512 d = Scales::d(blk, b, v), m = Scales::m(blk, b, v);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512 scaled = _mm512_mul_ps(_mm512_cvtepi32_ps(s[r][v]), _mm512_set1_ps(sx[r * blocks + b]));
        a[r][v] = _mm512_fmadd_ps(m, _mm512_set1_ps(xsum[r * blocks + b]), _mm512_fmadd_ps(d, scaled, a[r][v]));
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int v = 0; v < 2; ++v) _mm512_storeu_ps(acc + r * kCols + 16 * v, a[r][v]);
}

// All 32 columns of a group for any number of rows with int8 inputs, in near-equal tiles of at most kTileRowsQ8
// rows (8 rows as 4 + 4) -> acc [rows][kCols]. xq: the rows' int8 inputs (row stride ldq, in nibble order); sx, xsum
// [rows][blocks]: each block's scale and X.
template <typename Scales>
void group_rows_q8(int64_t rows, const int8_t* xq, int64_t ldq, const float* sx, const float* xsum, int64_t blocks,
                   const uint8_t* group, float* acc) {
  for_tiles<kTileRowsQ8>(rows, [&](int64_t row, auto r) {
    tile_rows_q8<Scales, decltype(r)::value>(xq + row * ldq, ldq, sx + row * blocks, xsum + row * blocks, blocks,
                                             group, acc + row * kCols);
  });
}

// One group-block's q as float32 [32 k][32 columns] (k-major) into qf (for q4_unpack; not on a hot path).
template <typename Scales>
void unpack_block(const uint8_t* blk, float* qf) {
  const uint8_t* qs = blk + Scales::kBytes - kQBytes;
  for (int j = 0; j < 4; ++j)
    for (int c = 0; c < kCols; ++c) {
      uint32_t word;
      std::memcpy(&word, qs + (4 * j + c / 8) * 32 + 4 * (c % 8), sizeof(word));
      for (int i = 0; i < 8; ++i) qf[(8 * j + i) * kCols + c] = static_cast<float>((word >> (4 * i)) & 0xF);
    }
}

// Group-block b's d and m of its 32 columns as float32 (64-byte aligned outputs; for q4_unpack).
template <typename Scales>
void block_scales(const uint8_t* blk, int64_t b, float* d, float* m) {
  for (int v = 0; v < 2; ++v) {
    _mm512_storeu_ps(d + 16 * v, Scales::d(blk, b, v));
    _mm512_storeu_ps(m + 16 * v, Scales::m(blk, b, v));
  }
}

}  // namespace avx512

#ifndef EAGLESPEC_AMX  // (the AMX build's micro-kernels, amx/, build on these)
namespace isa = avx512;
#endif

}  // namespace
}  // namespace eaglespec::q4
