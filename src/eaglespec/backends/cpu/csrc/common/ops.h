// The schemas of eaglespec's CPU operators and the list of their implementations.
//
// The kernels come in one build per instruction set (eaglespec.backends.cpu.kernels.ISAS): AVX-512 (avx512/kernels.cpp)
// and AVX2 + FMA (avx2/kernels.cpp). Both define these schemas and register the same host code over their own
// micro-kernels, so Python code and compiled graphs call the same operators whichever build the CPU loaded, and both
// read the same packed layouts. Included after the build's micro-kernels (the host code calls them as isa::).

#pragma once

#include "argmax_rows.h"
#include "bf16_gemm.h"
#include "commit_rows.h"
#include "decoder_stack.h"
#include "q4_gemm.h"
#include "q6_gemm.h"
#include "screened_argmax.h"
#include "shared.h"
#include "topk_rows.h"
#include "tree_attention.h"

TORCH_LIBRARY(eaglespec, m) {
  m.def("bf16_pack(Tensor weight) -> Tensor");
  // (variant has no default: inductor's C++ wrapper leaves out arguments equal to their default, and its call through
  // the dispatcher then fails; every caller passes it)
  m.def("bf16_linear(Tensor x, Tensor packed, int n, Tensor? bias, int variant) -> Tensor");
  m.def("tree_attention(Tensor q, Tensor keys_t, Tensor values, Tensor? step_mask) -> Tensor");
  m.def("tree_attention_batch(Tensor q, Tensor k, Tensor v, Tensor(a!)[] keys_t, Tensor(b!)[] values, int[] cached, "
        "int[] sizes, Tensor?[] step_masks) -> Tensor");
  m.def("commit_rows(Tensor(a!)[] keys_t, Tensor(b!)[] values, int c, int[] rows) -> ()");
  m.def("argmax_rows(Tensor logits) -> Tensor");
  m.def("topk_rows(Tensor scores, int k) -> (Tensor, Tensor)");
  m.def("screened_argmax(Tensor x, Tensor packed, Tensor scale, Tensor b1, Tensor b2, Tensor weight) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor packed, Tensor scale, int n, Tensor? bias) -> Tensor");
  m.def("q4_linear(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor");
  m.def("q4_q8_linear(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor");
  m.def("q4_unpack(Tensor packed, int n, int k) -> Tensor");
  m.def("q6_linear(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor");
  m.def("q6_q8_linear(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor");
  m.def("q6_unpack(Tensor packed, int n, int k) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("decoder_stack(Tensor x, Tensor cos, Tensor sin, Tensor[] norms, Tensor[] packed, int[] outs, int[] kinds, "
        "Tensor?[] biases, int[] parts, Tensor(a!)[] keys_t, Tensor(b!)[] values, int[] cached, int[] sizes, "
        "Tensor?[] step_masks, "
        "int heads, int kv_heads, float eps, int[] saved) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(eaglespec, CPU, m) {
  m.impl("bf16_pack", eaglespec::bf16::bf16_pack);
  m.impl("bf16_linear", eaglespec::bf16::bf16_linear);
  m.impl("tree_attention", eaglespec::attention::tree_attention);
  m.impl("tree_attention_batch", eaglespec::attention::tree_attention_batch);
  m.impl("commit_rows", eaglespec::commit::commit_rows);
  m.impl("argmax_rows", eaglespec::argmax::argmax_rows);
  m.impl("topk_rows", eaglespec::topk::topk_rows);
  m.impl("screened_argmax", eaglespec::screen::screened_argmax);
  m.impl("int8_linear", eaglespec::screen::int8_linear);
  m.impl("q4_linear", eaglespec::q4::q4_linear);
  m.impl("q4_q8_linear", eaglespec::q4::q4_q8_linear);
  m.impl("q4_unpack", eaglespec::q4::q4_unpack);
  m.impl("q6_linear", eaglespec::q6::q6_linear);
  m.impl("q6_q8_linear", eaglespec::q6::q6_q8_linear);
  m.impl("q6_unpack", eaglespec::q6::q6_unpack);
  m.impl("silu_mul", eaglespec::stack::silu_mul);
  m.impl("decoder_stack", eaglespec::stack::decoder_stack);
}
