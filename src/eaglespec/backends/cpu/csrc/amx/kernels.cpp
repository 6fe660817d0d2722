// The kernels for CPUs with AMX-BF16 (and AVX-512 F, BW, VL, BF16 and VNNI) as one translation unit: the AVX-512
// build's micro-kernels, but the 4-bit block and 6-bit code products through AMX tiles (this folder), then the host
// code over them.

#define EAGLESPEC_AMX

#include "../avx512/argmax_rows.h"
#include "../avx512/bf16_gemm.h"
#include "q4_gemm.h"
#include "q6_gemm.h"
#include "../avx512/screened_argmax.h"
#include "../avx512/topk_rows.h"
#include "../avx512/tree_attention.h"
#include "../avx512/activation.h"

#include "../common/ops.h"  // (after the micro-kernels: it calls them)
