// Greedy choice of every verified row: the index of the largest logit of each row of [N, V] bfloat16 or float32.
//
// torch.argmax over a [6, 49152] bfloat16 block costs ~0.6 ms on 2 cores (~0.2 ms for one row), more than the
// decode-step attention of a 30-layer model; here it is a few microseconds a row. Same answer as torch.argmax: the
// first index of the maximum, and the first NaN if a row has one (torch counts NaN as the maximum).
//
// The micro-kernel (isa::, included before this): argmax_row(row, v) for bfloat16 (uint16_t bits) and float32 rows.

#pragma once

#include "shared.h"

namespace eaglespec::argmax {
namespace {

at::Tensor argmax_rows(const at::Tensor& logits_in) {
  TORCH_CHECK(logits_in.dim() == 2 && logits_in.device().is_cpu() &&
                  (logits_in.scalar_type() == at::kBFloat16 || logits_in.scalar_type() == at::kFloat),
              "argmax_rows: logits must be [N, V] bfloat16 or float32 on the CPU");
  const int64_t n = logits_in.size(0), v = logits_in.size(1);
  TORCH_CHECK(v > 0 && v < (int64_t{1} << 31) - 16, "argmax_rows: V must be in [1, 2^31 - 16)");
  const at::Tensor logits = logits_in.contiguous();
  at::Tensor out = at::empty({n}, logits.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < n; ++r) {
    if (logits.scalar_type() == at::kBFloat16)
      op[r] = isa::argmax_row(reinterpret_cast<const uint16_t*>(logits.data_ptr()) + r * v, v);
    else
      op[r] = isa::argmax_row(logits.data_ptr<float>() + r * v, v);
  }
  return out;
}

}  // namespace
}  // namespace eaglespec::argmax
