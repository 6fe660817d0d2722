// AVX2 build of csrc/topk_rows.cpp, with the same semantics: the k best entries of every row of [N, V] float32 (a
// draft step's log-probabilities over its vocabulary), for the few k a draft tree expands (k <= 64).
//
// torch.topk on one row of 8192 float32 takes ~24 us (one thread, every element through a selection), and a draft
// round makes it 2-3 times. Here one pass keeps the best k seen so far in a small sorted list and compares 16 lanes
// at a time (two registers of 8) against the k-th best: after the first few hundred elements almost no lane passes,
// so a row costs about two vector compares per 16 elements.
//
// Order: values descending; equal values by ascending index. A row with a NaN falls back to at::topk for the
// whole call (torch counts NaN as the largest value).

#include <ATen/ATen.h>
#include <torch/library.h>

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>

namespace {

constexpr int64_t kMaxK = 64;

// Insert (value, index) into the sorted best list of `count` entries (capacity k); index grows along the row, so
// an equal value goes after the entries already there.
inline void insert(float value, int64_t index, float* values, int64_t* indices, int64_t& count, int64_t k) {
  if (count == k && !(value > values[k - 1])) return;
  int64_t at = count < k ? count : k - 1;  // the slot freed (the end, or the current k-th best)
  while (at > 0 && values[at - 1] < value) {
    values[at] = values[at - 1];
    indices[at] = indices[at - 1];
    --at;
  }
  values[at] = value;
  indices[at] = index;
  if (count < k) ++count;
}

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

std::tuple<at::Tensor, at::Tensor> topk_rows(const at::Tensor& scores_in, int64_t k) {
  TORCH_CHECK(scores_in.dim() == 2 && scores_in.device().is_cpu() && scores_in.scalar_type() == at::kFloat,
              "topk_rows: scores must be [N, V] float32 on the CPU");
  const int64_t n = scores_in.size(0), v = scores_in.size(1);
  TORCH_CHECK(k >= 1 && k <= kMaxK && k <= v, "topk_rows: k must be in [1, min(64, V)]");
  const at::Tensor scores = scores_in.contiguous();
  at::Tensor values = at::empty({n, k}, scores.options());
  at::Tensor indices = at::empty({n, k}, scores.options().dtype(at::kLong));
  const float* sp = scores.data_ptr<float>();
  float* vp = values.data_ptr<float>();
  int64_t* ip = indices.data_ptr<int64_t>();
  for (int64_t r = 0; r < n; ++r) {
    if (!topk_row(sp + r * v, v, k, vp + r * k, ip + r * k)) {
      return at::topk(scores, k, -1);
    }
  }
  return {values, indices};
}

}  // namespace

TORCH_LIBRARY_IMPL(eaglespec, CPU, m) {
  m.impl("topk_rows", topk_rows);
}
