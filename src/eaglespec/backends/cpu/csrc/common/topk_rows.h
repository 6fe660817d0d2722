// The k best entries of every row of [N, V] float32 (a draft step's log-probabilities over its vocabulary), for
// the few k a draft tree expands (k <= 64).
//
// torch.topk on one row of 8192 float32 takes ~24 us on this project's CPUs (one thread, every element through a
// selection), and a draft round makes it 2-3 times. Here one pass keeps the best k seen so far in a small sorted
// list and compares 16 lanes at a time against the k-th best (avx512/topk_rows.h, avx2/topk_rows.h): after the
// first few hundred elements almost no lane passes, so a row costs about one or two vector compares per 16 elements.
//
// Order: values descending; equal values by ascending index. A row with a NaN falls back to at::topk for the
// whole call (torch counts NaN as the largest value).
//
// The micro-kernel (isa::, included before this): topk_row(row, v, k, values, indices), false if the row has a NaN.

#pragma once

#include "shared.h"

#include <ATen/ops/topk.h>

namespace eaglespec::topk {
namespace {

constexpr int64_t kMaxK = 64;

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
    if (!isa::topk_row(sp + r * v, v, k, vp + r * k, ip + r * k)) {
      return at::topk(scores, k, -1);
    }
  }
  return {values, indices};
}

}  // namespace
}  // namespace eaglespec::topk
