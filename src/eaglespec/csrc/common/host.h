// What the operators' host code shares: torch's headers, the instruction-set tags and small helpers.
//
// Layout: csrc/common/ holds each operator's host code once (argument checks, dispatch over rows and threads,
// scalar steps, registration), as templates over an instruction-set tag (Avx512, Avx2); csrc/avx512/ and csrc/avx2/
// hold only the vector micro-kernels, as specialisations of each operator's Kernels<Isa>. A build is one
// translation unit (avx512/kernels.cpp, avx2/kernels.cpp) that includes them all, so torch's headers, the slow part
// of compiling a file, are parsed once per build. Hence also the light headers below in place of <ATen/ATen.h>.
//
// Everything lives in anonymous namespaces, as in a file of its own: each header is included once, into one
// translation unit, and internal linkage lets the compiler inline across it (calls to a -fPIC library's external
// functions could be interposed, so they are not inlined) and keeps the two builds' symbols apart.

#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <tuple>
#include <vector>

namespace eaglespec {
namespace {

// The instruction sets: tags that pick each operator's micro-kernels (operator::Kernels<Isa>).
struct Avx512 {
  static constexpr const char* kName = "AVX-512";
};
struct Avx2 {
  static constexpr const char* kName = "AVX2";
};

// A bfloat16 value as the float32 it is exact in (its high half).
inline float bf16_to_float(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &wide, sizeof(value));
  return value;
}

// `count` bfloat16 values -> float32 (exact).
inline void widen_bf16(const uint16_t* from, int64_t count, float* to) {
  for (int64_t i = 0; i < count; ++i) to[i] = bf16_to_float(from[i]);
}

// An operator's optional bias [n] as a contiguous float32 tensor (undefined where there is none).
inline at::Tensor float_bias(const std::optional<at::Tensor>& bias_in, int64_t n, const char* op) {
  at::Tensor bias;
  if (bias_in.has_value()) {
    bias = bias_in->to(at::kFloat).contiguous();
    TORCH_CHECK(bias.dim() == 1 && bias.size(0) == n, op, ": bias must be [", n, "]");
  }
  return bias;
}

inline const float* float_data(const at::Tensor& t) { return t.defined() ? t.data_ptr<float>() : nullptr; }

}  // namespace
}  // namespace eaglespec
