// The rows' argmax micro-kernel for CPUs with AVX2 (the operator: common/argmax_rows.h). 8 float32 lanes a register
// (no mask registers): four independent lane sets of 8 (32 elements an iteration, so the compare-and-blend chains
// overlap), the last partial iteration read from a copy padded with -inf.

#pragma once

#include "../common/shared.h"

namespace eaglespec::argmax {
namespace {
namespace avx2 {

constexpr int64_t kStep = 32;  // row elements an iteration: 4 registers of 8 lanes

// The 32 elements [i, i + 32) of a row as 4 x 8 float32 lanes, and the row index each lane holds.
// bfloat16 (the high half of a float32): two 256-bit loads of 16, each split by unpacking with zero below every
// element; an unpack works within 128-bit halves, so register lo holds elements {0-3, 8-11} and hi {4-7, 12-15}
// of its 16 (the index vectors follow: the reduction looks at index values, never at lane positions).
inline void load32(const uint16_t* p, __m256 (&x)[4]) {
  const __m256i zero = _mm256_setzero_si256();
  for (int h = 0; h < 2; ++h) {
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16 * h));
    x[2 * h] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, bits));
    x[2 * h + 1] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, bits));
  }
}

inline void load32(const float* p, __m256 (&x)[4]) {
  for (int j = 0; j < 4; ++j) x[j] = _mm256_loadu_ps(p + 8 * j);
}

inline void first_index(const uint16_t*, __m256i (&index)[4]) {
  for (int h = 0; h < 2; ++h) {
    index[2 * h] = _mm256_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11);
    index[2 * h + 1] = _mm256_setr_epi32(4, 5, 6, 7, 12, 13, 14, 15);
    for (int j = 2 * h; j < 2 * h + 2; ++j) index[j] = _mm256_add_epi32(index[j], _mm256_set1_epi32(16 * h));
  }
}

inline void first_index(const float*, __m256i (&index)[4]) {
  for (int j = 0; j < 4; ++j) index[j] = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                                          _mm256_set1_epi32(8 * j));
}

inline uint16_t minus_infinity(const uint16_t*) { return 0xFF80; }  // bfloat16 -inf
inline float minus_infinity(const float*) { return -std::numeric_limits<float>::infinity(); }

template <typename T>
int64_t argmax_row(const T* row, int64_t v) {
  // Each lane keeps its largest value and that value's first index (strictly greater replaces); the lanes are then
  // reduced to the largest value's smallest index.
  __m256 best[4];
  __m256i best_index[4], index[4];
  first_index(row, index);
  for (int j = 0; j < 4; ++j) {
    best[j] = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    best_index[j] = index[j];
  }
  const __m256i step = _mm256_set1_epi32(kStep);
  __m256 nan = _mm256_setzero_ps();
  const auto update = [&](const T* p) {
    __m256 x[4];
    load32(p, x);
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(x[j], x[j], _CMP_UNORD_Q));
      const __m256 greater = _mm256_cmp_ps(x[j], best[j], _CMP_GT_OQ);
      best[j] = _mm256_blendv_ps(best[j], x[j], greater);
      best_index[j] = _mm256_castps_si256(
          _mm256_blendv_ps(_mm256_castsi256_ps(best_index[j]), _mm256_castsi256_ps(index[j]), greater));
      index[j] = _mm256_add_epi32(index[j], step);
    }
  };
  const int64_t full = v / kStep * kStep;
  for (int64_t i = 0; i < full; i += kStep) update(row + i);
  if (full < v) {  // the last elements, padded with -inf (never strictly greater: their indices are never taken)
    T tail[kStep];
    std::fill(tail, tail + kStep, minus_infinity(row));
    std::memcpy(tail, row + full, static_cast<size_t>(v - full) * sizeof(T));
    update(tail);
  }
  if (_mm256_movemask_ps(nan)) return first_nan(row, v);
  // Lane sets merged: the larger value, or the smaller index of equal values (each set keeps first indices, and
  // the sets cover disjoint indices, so the smallest index at the top value is the row's first maximum). If every
  // element is -inf, lane 0 of set 0 still holds index 0.
  for (int j = 1; j < 4; ++j) {
    const __m256 take = _mm256_or_ps(
        _mm256_cmp_ps(best[j], best[0], _CMP_GT_OQ),
        _mm256_and_ps(_mm256_cmp_ps(best[j], best[0], _CMP_EQ_OQ),
                      _mm256_castsi256_ps(_mm256_cmpgt_epi32(best_index[0], best_index[j]))));
    best[0] = _mm256_blendv_ps(best[0], best[j], take);
    best_index[0] = _mm256_castps_si256(
        _mm256_blendv_ps(_mm256_castsi256_ps(best_index[0]), _mm256_castsi256_ps(best_index[j]), take));
  }
  alignas(32) float values[8];
  alignas(32) int32_t indices[8];
  _mm256_store_ps(values, best[0]);
  _mm256_store_si256(reinterpret_cast<__m256i*>(indices), best_index[0]);
  float top = values[0];
  int32_t at = indices[0];
  for (int l = 1; l < 8; ++l)
    if (values[l] > top || (values[l] == top && indices[l] < at)) {
      top = values[l];
      at = indices[l];
    }
  return at;
}

}  // namespace avx2

namespace isa = avx2;

}  // namespace
}  // namespace eaglespec::argmax
