// The schemas of eaglespec's CPU operators, and the weight packing every build shares.
//
// The kernels come in one build per instruction set (eaglespec.bf16gemm.ISAS): AVX-512 (csrc/*.cpp) and AVX2 + FMA
// (csrc/avx2/*.cpp). Both register their implementations under these schemas, so Python code and compiled graphs
// call the same operators whichever build the CPU loaded, and both read the same packed layouts.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>

namespace {

constexpr int64_t kGroup = 64;  // output columns per packed group of bf16_linear

// [N, K] bfloat16 -> [ceil(N/64), ceil(K/2), 64, 2] bfloat16, zero padded: for a k-pair, the 64 columns of a group
// with their two k-values side by side (one 32-bit lane each).
at::Tensor bf16_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, "bf16_pack: weight must be [N, K] bfloat16");
  const int64_t n = weight.size(0), k = weight.size(1);
  const int64_t n_pad = (n + kGroup - 1) / kGroup * kGroup, k_pad = (k + 1) / 2 * 2;
  at::Tensor padded = at::zeros({n_pad, k_pad}, weight.options());
  padded.narrow(0, 0, n).narrow(1, 0, k).copy_(weight);
  return padded.view({n_pad / kGroup, kGroup, k_pad / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

}  // namespace

TORCH_LIBRARY(eaglespec, m) {
  m.def("bf16_pack(Tensor weight) -> Tensor");
  // (variant has no default: inductor's C++ wrapper leaves out arguments equal to their default, and its call through
  // the dispatcher then fails; every caller passes it)
  m.def("bf16_linear(Tensor x, Tensor packed, int n, Tensor? bias, int variant) -> Tensor");
  m.def("tree_attention(Tensor q, Tensor keys_t, Tensor values, Tensor? step_mask) -> Tensor");
  m.def("commit_rows(Tensor(a!)[] keys_t, Tensor(b!)[] values, int c, int[] rows) -> ()");
  m.def("argmax_rows(Tensor logits) -> Tensor");
  m.def("topk_rows(Tensor scores, int k) -> (Tensor, Tensor)");
  m.def("screened_argmax(Tensor x, Tensor packed, Tensor scale, Tensor b1, Tensor b2, Tensor weight) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor packed, Tensor scale, int n, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(eaglespec, CPU, m) {
  m.impl("bf16_pack", bf16_pack);
}
