// The LM-head screen's micro-kernels for CPUs with AVX2 (the operator and its bound: common/screened_argmax.h), with
// the same packed operands (eaglespec.backends.cpu.kernels.int8_rows) and the same integers, hence the same a_n, e_n
// and E_n.
//
// What differs is only how the integer sums are formed. AVX2 has no vpdpbusd (u8 x s8, 4 products summed into
// int32). vpmaddubsw multiplies u8 by s8 and adds pairs into int16 with saturation, and the stored bytes q + 128
// (0..255) times xq (-127..127) make pair sums up to 2 * 255 * 127 = 64770: they would saturate. So the signed q
// is recovered (byte ^ 0x80) and the sign moved onto x: |q| (0..127 as u8) times sign(q) xq (vpsignb, which also
// zeroes xq where q = 0, where the product is 0), pair sums at most 2 * 127 * 127 = 32258 < 32767; then vpmaddwd by
// ones adds the pairs into the int32 lane of their column. The block sums are sum_k xq_k q_nk directly (no
// "- 128 sum xq" correction, so Quantized::xsum is unused), the same integers as the AVX-512 build's.
//
// Registers: a 64-byte packed unit (16 columns x 4 consecutive channels) is two 256-bit halves of 8 columns each,
// and 4 channels of an input row are one 32-bit value broadcast to every lane, so the int32 lanes line up with the
// columns. A row costs 8 instructions a unit (vpsignb, vpmaddubsw, vpmaddwd, vpaddd per half) and the unit 4
// shared ones (vpxor, vpabsb per half), so a pass over a group's weights takes 4 input rows: their 8 int32 block
// sums, the halves' q and |q|, ones and the broadcast x fill the 16 ymm registers (the float32 accumulators, touched
// once a block, live in memory). More rows of a call take another pass over the same group, whose bytes
// (K32 * 16, 9 KB for K = 576) are then in L1. (On Zen 3, one core, weights in L2: ~1.3 ns a row and unit for 1
// row a pass, ~1.15 for 2, ~1.07 for 4.)
//
// E_n's 16 lanes of ordered FMAs are two registers of 8, reduced in the order GCC's _mm512_reduce_add_ps uses, so
// E is the AVX-512 build's too (with GCC).

#pragma once

#include "../common/shared.h"

namespace eaglespec::screen {
namespace {
namespace avx2 {

constexpr int kPass = 4;        // input rows multiplied per read of a group's weights (registers)

// bfloat16 [8] -> float32 lanes (the high half of a float32).
inline __m256 bf16_to_float(const uint16_t* w) {
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))), 16));
}

// E_n for one input row (float32 [K]) and one bfloat16 weight row: 16 lanes of ordered FMAs (lane l over k = l mod
// 16, two registers of 8; the last partial 16 zero padded), then one fixed horizontal sum (the halves added, then
// the 128-bit halves, then lanes {0, 2} and {1, 3}, then those two).
float exact_dot(const float* x, const uint16_t* w, int64_t k) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  const int64_t full = k / kLanes * kLanes;
  for (int64_t i = 0; i < full; i += kLanes) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), bf16_to_float(w + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 8), bf16_to_float(w + i + 8), acc1);
  }
  if (full < k) {
    alignas(32) float xt[kLanes] = {};
    alignas(32) uint16_t wt[kLanes] = {};
    std::memcpy(xt, x + full, static_cast<size_t>(k - full) * sizeof(float));
    std::memcpy(wt, w + full, static_cast<size_t>(k - full) * sizeof(uint16_t));
    acc0 = _mm256_fmadd_ps(_mm256_load_ps(xt), bf16_to_float(wt), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_load_ps(xt + 8), bf16_to_float(wt + 8), acc1);
  }
  const __m256 eight = _mm256_add_ps(acc1, acc0);
  const __m128 four = _mm_add_ps(_mm256_extractf128_ps(eight, 1), _mm256_castps256_ps128(eight));
  const __m128 two = _mm_add_ps(four, _mm_shuffle_ps(four, four, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(two) + _mm_cvtss_f32(_mm_shuffle_ps(two, two, _MM_SHUFFLE(1, 1, 1, 1)));
}

// acc[r][0:16] = sum_b sx_b sum_{k in b} xq_k q_nk for P rows and the 16 columns n of one packed group w
// ([K32/4, 16, 4] bytes q + 128): per block, int32 sums (exact in any order), then one float32 FMA by the block's
// scale (a fixed order: a_n is the same for a row in any call). PREFETCH (the first pass over the group): fetch the
// weights kAhead bytes ahead.
template <int P, bool PREFETCH>
inline void group_dots(const Quantized* x, int64_t blocks, const uint8_t* w, float (*acc_out)[kLanes]) {
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80)), ones = _mm256_set1_epi16(1);
  __m256 acc[P][2];
#pragma GCC unroll 4
  for (int r = 0; r < P; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m256i sum[P][2];
#pragma GCC unroll 4
    for (int r = 0; r < P; ++r) sum[r][0] = sum[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int64_t s = 0; s < kSteps; ++s) {
      if constexpr (PREFETCH) _mm_prefetch(reinterpret_cast<const char*>(w + kAhead + s * 64), _MM_HINT_T0);
      __m256i q[2], magnitude[2];
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {  // columns 8h .. 8h + 7, 4 channels each
        q[h] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + s * 64 + 32 * h)), flip);
        magnitude[h] = _mm256_abs_epi8(q[h]);
      }
#pragma GCC unroll 4
      for (int r = 0; r < P; ++r) {
        int32_t four;
        std::memcpy(&four, x[r].xq + b * kBlock + 4 * s, 4);
        const __m256i xv = _mm256_set1_epi32(four);
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
          const __m256i pairs = _mm256_maddubs_epi16(magnitude[h], _mm256_sign_epi8(xv, q[h]));  // |.| <= 32258
          sum[r][h] = _mm256_add_epi32(sum[r][h], _mm256_madd_epi16(pairs, ones));
          __asm__("" : "+x"(sum[r][h]));  // (one chain a register: GCC would otherwise spill a tree of sums)
        }
      }
    }
    w += kSteps * 64;
#pragma GCC unroll 4
    for (int r = 0; r < P; ++r) {
      const __m256 sx = _mm256_set1_ps(x[r].sx[b]);
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[r][h]), sx, acc[r][h]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < P; ++r) {
    _mm256_storeu_ps(acc_out[r], acc[r][0]);
    _mm256_storeu_ps(acc_out[r] + 8, acc[r][1]);
  }
}

// group_dots for R rows, kPass at a time (the later passes read the group from L1).
template <int R, bool FIRST = true>
inline void group_rows(const Quantized* x, int64_t blocks, const uint8_t* w, float (*acc)[kLanes]) {
  if constexpr (R > kPass) {
    group_dots<kPass, FIRST>(x, blocks, w, acc);
    group_rows<R - kPass, false>(x + kPass, blocks, w, acc + kPass);
  } else if constexpr (R > 0) {
    group_dots<R, FIRST>(x, blocks, w, acc);
  }
}

// hi[r][n] = a_n + e_n for rows [0, R) and the groups [g0, g1) of the packed weight ([G, K32/4, 16, 4] bytes
// q + 128); lo[r] = the largest a - e over those columns.
// BOUND = false (int8_linear): hi[r][n] = a_n + bias_n instead (row stride n; b1 is the float32 bias or null; b2, l1,
// sxsum and lo unused).
template <int R, bool BOUND>
void screen_groups(const Quantized* x, int64_t blocks, const uint8_t* packed, const float* scale, const float* b1,
                   const float* b2, const float* l1, const float* sxsum, int64_t g0, int64_t g1, int64_t n,
                   int64_t n_pad, float* hi, float* lo) {
  const int64_t group_bytes = blocks * kBlock * kLanes;
  const __m256i lane0 = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i lane8 = _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15);
  const __m256 minus_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 low[R];
  for (int r = 0; r < R; ++r) low[r] = minus_inf;
  for (int64_t g = g0; g < g1; ++g) {
    alignas(32) float acc[R][kLanes];
    group_rows<R>(x, blocks, packed + g * group_bytes, acc);
    const int64_t left = std::min<int64_t>(n - g * kLanes, kLanes);  // columns of this group that exist
    const __m256i valid[2] = {_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(left)), lane0),
                              _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(left)), lane8)};
    const __m256 s[2] = {_mm256_loadu_ps(scale + g * kLanes), _mm256_loadu_ps(scale + g * kLanes + 8)};
    if constexpr (!BOUND) {
      for (int h = 0; h < 2; ++h) {
        const __m256 bias = b1 ? _mm256_maskload_ps(b1 + g * kLanes + 8 * h, valid[h]) : _mm256_setzero_ps();
        for (int r = 0; r < R; ++r)
          _mm256_maskstore_ps(hi + r * n + g * kLanes + 8 * h, valid[h],
                              _mm256_fmadd_ps(_mm256_load_ps(acc[r] + 8 * h), s[h], bias));
      }
      continue;
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 e1 = _mm256_loadu_ps(b1 + g * kLanes + 8 * h), e2 = _mm256_loadu_ps(b2 + g * kLanes + 8 * h);
      for (int r = 0; r < R; ++r) {
        const __m256 a = _mm256_mul_ps(_mm256_load_ps(acc[r] + 8 * h), s[h]);
        const __m256 e = _mm256_fmadd_ps(_mm256_set1_ps(l1[r]), e1, _mm256_mul_ps(_mm256_set1_ps(sxsum[r]), e2));
        _mm256_storeu_ps(hi + r * n_pad + g * kLanes + 8 * h, _mm256_add_ps(a, e));
        // (the padding columns never set T)
        low[r] = _mm256_max_ps(low[r], _mm256_blendv_ps(minus_inf, _mm256_sub_ps(a, e), _mm256_castsi256_ps(valid[h])));
      }
    }
  }
  if constexpr (BOUND) {
    for (int r = 0; r < R; ++r) {
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, low[r]);
      for (float v : lanes) lo[r] = std::max(lo[r], v);
    }
  }
}

// The columns [0, n) of a row's a + e (h) that reach lo (T), ascending, appended to `out`.
inline void candidates(const float* h, int64_t n, float lo, std::vector<int64_t>& out) {
  const __m256 t = _mm256_set1_ps(lo);
  for (int64_t i = 0; i < n; i += kLanes) {
    const int low = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(h + i), t, _CMP_GE_OQ));
    const int high = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(h + i + 8), t, _CMP_GE_OQ));
    unsigned pass = static_cast<unsigned>(low) | static_cast<unsigned>(high) << 8;
    if (n - i < kLanes) pass &= (1u << (n - i)) - 1;  // (the padding columns are no tokens)
    for (; pass; pass &= pass - 1) out.push_back(i + __builtin_ctz(pass));
  }
}

}  // namespace avx2

namespace isa = avx2;

}  // namespace
}  // namespace eaglespec::screen
