// The kernels for CPUs with AVX-512 F, BW, VL, BF16 and VNNI: the whole build as one translation unit (why:
// common/host.h), the shared host code over this folder's micro-kernels and the AVX2 4-bit product's.

#include "../avx2/q4_gemm.h"
#include "../common/ops.h"
#include "argmax_rows.h"
#include "bf16_gemm.h"
#include "screened_argmax.h"
#include "topk_rows.h"
#include "tree_attention.h"

TORCH_LIBRARY_IMPL(eaglespec, CPU, m) {
  eaglespec::register_kernels<eaglespec::Avx512>(m);
}
