// The kernels for CPUs with AVX-512 F, BW, VL, BF16 and VNNI as one translation unit (why: common/shared.h): this
// folder's micro-kernels, then the host code over them.

#include "argmax_rows.h"
#include "bf16_gemm.h"
#include "q4_gemm.h"
#include "q6_gemm.h"
#include "screened_argmax.h"
#include "topk_rows.h"
#include "tree_attention.h"
#include "activation.h"

#include "../common/ops.h"  // (after the micro-kernels: it calls them)
