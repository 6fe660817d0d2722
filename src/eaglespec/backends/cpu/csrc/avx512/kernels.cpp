// The kernels for CPUs with AVX-512 F, BW, VL, BF16 and VNNI as one translation unit (why: common/shared.h): this
// folder's micro-kernels and the AVX2 4-bit product's (every AVX-512 CPU runs them), then the host code over them.

#include "../avx2/q4_gemm.h"
#include "argmax_rows.h"
#include "bf16_gemm.h"
#include "screened_argmax.h"
#include "topk_rows.h"
#include "tree_attention.h"

#include "../common/ops.h"  // (after the micro-kernels: it calls them)
