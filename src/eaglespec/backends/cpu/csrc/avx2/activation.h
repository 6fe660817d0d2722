// The decoder stack's SwiGLU activation for CPUs with AVX2 + FMA (the operator: common/decoder_stack.h): 8 values a
// vector, e^-g by the decode-step attention's polynomial (avx2/tree_attention.h), every step rounded as the scalar
// form rounds it, so a value's bits depend on its gate and up only (not on its lane or row): the AVX-512 build's
// arithmetic (avx512/activation.h).

#pragma once

#include "../common/shared.h"
#include "bf16_gemm.h"
#include "tree_attention.h"

namespace eaglespec::stack {
namespace {
namespace avx2 {

using bf16::avx2::round_bf16;  // (bf16_gemm.h)

// 8 bfloat16 values as float32 (exact).
inline __m256 widen8(const uint16_t* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

// out[i] = bf16(bf16(g / (1 + e^-g)) * up[i]), g = gate[i], for i < count (bfloat16 bits).
inline void silu_mul_row(const uint16_t* gate, const uint16_t* up, uint16_t* out, int64_t count) {
  alignas(32) uint16_t g_tail[8] = {}, u_tail[8] = {}, y_tail[8];
  for (int64_t i = 0; i < count; i += 8) {
    const int64_t left = std::min<int64_t>(count - i, 8);
    const uint16_t *g_at = gate + i, *u_at = up + i;
    if (left < 8) {  // the last values, padded (nothing read past them)
      std::memcpy(g_tail, g_at, left * sizeof(uint16_t));
      std::memcpy(u_tail, u_at, left * sizeof(uint16_t));
      g_at = g_tail;
      u_at = u_tail;
    }
    const __m256 g = widen8(g_at);
    // e^-g, -g clamped to 88 (e^88 < FLT_MAX): below g = -88 silu(g) is a few times -1e-37, not -0; a gate of
    // -inf gives -inf, not the formula's NaN (-inf / inf)
    const __m256 e = attention::avx2::exp_ps(_mm256_min_ps(_mm256_sub_ps(_mm256_setzero_ps(), g),
                                                           _mm256_set1_ps(88.0f)));
    const __m256 act = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
    const __m256 act16 = _mm256_castsi256_ps(_mm256_slli_epi32(round_bf16(act), 16));
    const __m256i y = round_bf16(_mm256_mul_ps(act16, widen8(u_at)));
    // the low halves of the 32-bit lanes, packed (packus works within 128-bit lanes: reorder its quads)
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(y, y), 0xD8);
    if (left == 8) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm256_castsi256_si128(packed));
    } else {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(y_tail), _mm256_castsi256_si128(packed));
      std::memcpy(out + i, y_tail, left * sizeof(uint16_t));
    }
  }
}

}  // namespace avx2

namespace isa = avx2;

}  // namespace
}  // namespace eaglespec::stack
