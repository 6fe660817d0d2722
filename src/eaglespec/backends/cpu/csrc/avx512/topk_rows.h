// The rows' top-k micro-kernel for CPUs with AVX-512F (the operator: common/topk_rows.h): one masked compare of 16
// lanes against the k-th best per 16 elements.

#pragma once

#include "../common/shared.h"

namespace eaglespec::topk {
namespace {
namespace avx512 {

// Returns false if the row has a NaN.
bool topk_row(const float* row, int64_t v, int64_t k, float* values, int64_t* indices) {
  int64_t count = 0;
  __mmask16 nan = 0;
  for (int64_t i = 0; i < v; i += 16) {
    const __mmask16 lanes = v - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (v - i)) - 1);
    const __m512 x = _mm512_maskz_loadu_ps(lanes, row + i);
    nan |= _mm512_mask_cmp_ps_mask(lanes, x, x, _CMP_UNORD_Q);
    __mmask16 pass = count < k ? lanes
                               : _mm512_mask_cmp_ps_mask(lanes, x, _mm512_set1_ps(values[k - 1]), _CMP_GT_OQ);
    while (pass) {
      const int lane = __builtin_ctz(pass);
      pass &= pass - 1;
      insert(row[i + lane], i + lane, values, indices, count, k);
    }
  }
  return nan == 0;
}

}  // namespace avx512

namespace isa = avx512;

}  // namespace
}  // namespace eaglespec::topk
