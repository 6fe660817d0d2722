// The rows' top-k micro-kernel for CPUs with AVX2 (the operator: common/topk_rows.h): 16 lanes are two registers of
// 8, so two vector compares against the k-th best per 16 elements; the last < 16 elements one by one.

#pragma once

#include "../common/shared.h"

namespace eaglespec::topk {
namespace {
namespace avx2 {

// Returns false if the row has a NaN.
bool topk_row(const float* row, int64_t v, int64_t k, float* values, int64_t* indices) {
  int64_t count = 0;
  __m256 nan = _mm256_setzero_ps();
  const int64_t full = v / 16 * 16;
  for (int64_t i = 0; i < full; i += 16) {
    const __m256 x0 = _mm256_loadu_ps(row + i), x1 = _mm256_loadu_ps(row + i + 8);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(x0, x1, _CMP_UNORD_Q));  // (unordered: either is NaN)
    unsigned pass = 0xFFFF;
    if (count == k) {
      const __m256 t = _mm256_set1_ps(values[k - 1]);
      pass = static_cast<unsigned>(_mm256_movemask_ps(_mm256_cmp_ps(x0, t, _CMP_GT_OQ))) |
             static_cast<unsigned>(_mm256_movemask_ps(_mm256_cmp_ps(x1, t, _CMP_GT_OQ))) << 8;
    }
    while (pass) {
      const int lane = __builtin_ctz(pass);
      pass &= pass - 1;
      insert(row[i + lane], i + lane, values, indices, count, k);
    }
  }
  bool finite = _mm256_movemask_ps(nan) == 0;
  for (int64_t i = full; i < v; ++i) {  // the last < 16 elements one by one (insert compares with the k-th best)
    finite = finite && !std::isnan(row[i]);
    insert(row[i], i, values, indices, count, k);
  }
  return finite;
}

}  // namespace avx2

namespace isa = avx2;

}  // namespace
}  // namespace eaglespec::topk
