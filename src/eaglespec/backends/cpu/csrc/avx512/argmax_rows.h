// The rows' argmax micro-kernel for CPUs with AVX-512F (the operator: common/argmax_rows.h): 16 lanes a vector,
// masked loads for the last partial vector.

#pragma once

#include "../common/shared.h"

namespace eaglespec::argmax {
namespace {
namespace avx512 {

// 16 float32 lanes of row elements [i, i + 16) (masked: -inf past the end).
inline __m512 load16(const uint16_t* row, int64_t i, __mmask16 mask) {  // bfloat16: the high half of a float32
  const __m256i bits = _mm256_maskz_loadu_epi16(mask, row + i);
  const __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
  return _mm512_mask_blend_ps(mask, _mm512_set1_ps(-std::numeric_limits<float>::infinity()), v);
}

inline __m512 load16(const float* row, int64_t i, __mmask16 mask) {
  return _mm512_mask_loadu_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()), mask, row + i);
}

template <typename T>
int64_t argmax_row(const T* row, int64_t v) {
  // Each lane keeps its largest value and that value's first index (strictly greater replaces); the lanes are then
  // reduced to the largest value's smallest index.
  __m512 best = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512i best_index = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512i index = best_index;
  const __m512i step = _mm512_set1_epi32(16);
  __mmask16 nan = 0;
  for (int64_t i = 0; i < v; i += 16, index = _mm512_add_epi32(index, step)) {
    const __mmask16 mask = v - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (v - i)) - 1);
    const __m512 x = load16(row, i, mask);
    nan |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    const __mmask16 greater = _mm512_cmp_ps_mask(x, best, _CMP_GT_OQ);
    best = _mm512_mask_blend_ps(greater, best, x);
    best_index = _mm512_mask_blend_epi32(greater, best_index, index);
  }
  if (nan) return first_nan(row, v);
  const float top = _mm512_reduce_max_ps(best);
  const __mmask16 at_top = _mm512_cmp_ps_mask(best, _mm512_set1_ps(top), _CMP_EQ_OQ);
  return _mm512_mask_reduce_min_epi32(at_top, best_index);
}

}  // namespace avx512

namespace isa = avx512;

}  // namespace
}  // namespace eaglespec::argmax
