// The LM-head screen's micro-kernels for CPUs with AVX-512 VNNI (the operator and its bound:
// common/screened_argmax.h): vpdpbusd multiplies the stored bytes q + 128 by xq, 4 channels a lane per instruction,
// and "- 128 sum_k xq_k" makes the block sums sum_k xq_k q_nk.

#pragma once

#include "../common/shared.h"

namespace eaglespec::screen {
namespace {
namespace avx512 {

// E_n for one input row (float32 [K]) and one bfloat16 weight row: 16 lanes of ordered FMAs (lane l over k = l mod
// 16), then one fixed horizontal sum.
float exact_dot(const float* x, const uint16_t* w, int64_t k) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < k; i += kLanes) {
    const __mmask16 m = k - i >= kLanes ? (__mmask16)0xFFFF : (__mmask16)((1u << (k - i)) - 1);
    const __m512 xv = _mm512_maskz_loadu_ps(m, x + i);
    const __m512 wv =
        _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, w + i)), 16));
    acc = _mm512_fmadd_ps(xv, wv, acc);
  }
  return _mm512_reduce_add_ps(acc);
}

// hi[r][n] = a_n + e_n for rows [0, R) and the groups [g0, g1) of the packed weight ([G, K32/4, 16, 4] bytes
// q + 128); lo[r] = the largest a - e over those columns. Per block, C chains of int32 sums (exact in any order),
// then one float32 FMA by the block's scale (a fixed order: a_n is the same for a row in any call).
// BOUND = false (int8_linear): hi[r][n] = a_n + bias_n instead (row stride n; b1 is the float32 bias or null; b2, l1,
// sxsum and lo unused).
template <int R, int C, bool BOUND>
void screen_chains(const Quantized* x, int64_t blocks, const uint8_t* packed, const float* scale, const float* b1,
                   const float* b2, const float* l1, const float* sxsum, int64_t g0, int64_t g1, int64_t n,
                   int64_t n_pad, float* hi, float* lo) {
  const int64_t group_bytes = blocks * kBlock * kLanes;
  for (int64_t g = g0; g < g1; ++g) {
    __m512 acc[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    const uint8_t* w = packed + g * group_bytes;
    for (int64_t b = 0; b < blocks; ++b) {
      __m512i sum[R][C];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
        for (int c = 0; c < C; ++c) sum[r][c] = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int64_t s = 0; s < kSteps; ++s) {
        const __m512i wv = _mm512_loadu_si512(w + s * 64);
        _mm_prefetch(reinterpret_cast<const char*>(w + kAhead + s * 64), _MM_HINT_T0);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          int32_t four;
          std::memcpy(&four, x[r].xq + b * kBlock + 4 * s, 4);
          sum[r][s % C] = _mm512_dpbusd_epi32(sum[r][s % C], wv, _mm512_set1_epi32(four));
        }
      }
      w += kSteps * 64;
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        __m512i total = sum[r][0];
#pragma GCC unroll 2
        for (int c = 1; c < C; ++c) total = _mm512_add_epi32(total, sum[r][c]);
        total = _mm512_sub_epi32(total, _mm512_set1_epi32(128 * x[r].xsum[b]));  // sum_k xq_k q_nk, exact
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), _mm512_set1_ps(x[r].sx[b]), acc[r]);
      }
    }
    const __m512 s = _mm512_loadu_ps(scale + g * kLanes);
    const int64_t left = n - g * kLanes;  // columns of this group that exist (the padding never sets T)
    const __mmask16 valid = left >= kLanes ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
    if constexpr (!BOUND) {
      const __m512 bias = b1 ? _mm512_maskz_loadu_ps(valid, b1 + g * kLanes) : _mm512_setzero_ps();
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r)
        _mm512_mask_storeu_ps(hi + r * n + g * kLanes, valid, _mm512_fmadd_ps(acc[r], s, bias));
      continue;
    }
    const __m512 e1 = _mm512_loadu_ps(b1 + g * kLanes), e2 = _mm512_loadu_ps(b2 + g * kLanes);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 a = _mm512_mul_ps(acc[r], s);
      const __m512 e = _mm512_fmadd_ps(_mm512_set1_ps(l1[r]), e1, _mm512_mul_ps(_mm512_set1_ps(sxsum[r]), e2));
      _mm512_storeu_ps(hi + r * n_pad + g * kLanes, _mm512_add_ps(a, e));
      lo[r] = std::max(lo[r], _mm512_mask_reduce_max_ps(valid, _mm512_sub_ps(a, e)));
    }
  }
}

// Two chains of sums a row for up to 4 rows, one for more (the registers).
template <int R, bool BOUND>
void screen_groups(const Quantized* x, int64_t blocks, const uint8_t* packed, const float* scale, const float* b1,
                   const float* b2, const float* l1, const float* sxsum, int64_t g0, int64_t g1, int64_t n,
                   int64_t n_pad, float* hi, float* lo) {
  screen_chains<R, (R <= 4 ? 2 : 1), BOUND>(x, blocks, packed, scale, b1, b2, l1, sxsum, g0, g1, n, n_pad, hi, lo);
}

// The columns [0, n) of a row's a + e (h) that reach lo (T), ascending, appended to `out`.
inline void candidates(const float* h, int64_t n, float lo, std::vector<int64_t>& out) {
  const __m512 t = _mm512_set1_ps(lo);
  for (int64_t i = 0; i < n; i += kLanes) {
    const __mmask16 valid = n - i >= kLanes ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - i)) - 1);
    for (__mmask16 pass = _mm512_mask_cmp_ps_mask(valid, _mm512_loadu_ps(h + i), t, _CMP_GE_OQ); pass;
         pass &= pass - 1)
      out.push_back(i + __builtin_ctz(pass));
  }
}

}  // namespace avx512

namespace isa = avx512;

}  // namespace
}  // namespace eaglespec::screen
