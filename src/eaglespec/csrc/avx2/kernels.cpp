// The kernels for CPUs with AVX2 + FMA + F16C: the whole build as one translation unit (why: common/host.h), the
// shared host code over this folder's micro-kernels.

#include "../common/ops.h"
#include "argmax_rows.h"
#include "bf16_gemm.h"
#include "q4_gemm.h"
#include "screened_argmax.h"
#include "topk_rows.h"
#include "tree_attention.h"

TORCH_LIBRARY_IMPL(eaglespec, CPU, m) {
  eaglespec::register_kernels<eaglespec::Avx2>(m);
}
