// The decoder stack's SwiGLU activation for CPUs with AVX-512F (the operator: common/decoder_stack.h): 16 values a
// vector, e^-g by the decode-step attention's polynomial (avx512/tree_attention.h), every step rounded as the scalar
// form rounds it, so a value's bits depend on its gate and up only (not on its lane or row).

#pragma once

#include "../common/shared.h"
#include "tree_attention.h"

namespace eaglespec::stack {
namespace {
namespace avx512 {

// float32 -> bfloat16 bits in the low halves of 32-bit lanes, rounded to nearest even; NaN a quiet NaN (to_bf16).
inline __m512i round_bf16(__m512 value) {
  const __m512i bits = _mm512_castps_si512(value);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))),
                                            16);
  const __mmask16 nan = _mm512_cmp_ps_mask(value, value, _CMP_UNORD_Q);
  return _mm512_mask_or_epi32(rounded, nan, _mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
}

// 16 bfloat16 values (masked lanes zero) as float32 (exact).
inline __m512 widen16(const uint16_t* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

// out[i] = bf16(bf16(g / (1 + e^-g)) * up[i]), g = gate[i], for i < count (bfloat16 bits).
inline void silu_mul_row(const uint16_t* gate, const uint16_t* up, uint16_t* out, int64_t count) {
  for (int64_t i = 0; i < count; i += 16) {
    const __mmask16 m = count - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (count - i)) - 1);
    const __m512 g = widen16(gate + i, m);
    // e^-g, -g clamped to 88 (e^88 < FLT_MAX): below g = -88 silu(g) is a few times -1e-37, not -0; a gate of
    // -inf gives -inf, not the formula's NaN (-inf / inf)
    const __m512 e = attention::avx512::exp_ps(_mm512_min_ps(_mm512_sub_ps(_mm512_setzero_ps(), g),
                                                             _mm512_set1_ps(88.0f)));
    const __m512 act = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
    const __m512 act16 = _mm512_castsi512_ps(_mm512_slli_epi32(round_bf16(act), 16));
    const __m512i y = round_bf16(_mm512_mul_ps(act16, widen16(up + i, m)));
    _mm256_mask_storeu_epi16(out + i, m, _mm512_cvtepi32_epi16(y));
  }
}

}  // namespace avx512

namespace isa = avx512;

}  // namespace
}  // namespace eaglespec::stack
