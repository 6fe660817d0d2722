// Few-row products with weights stored as 4-bit blocks, for CPUs with AVX2 + FMA + F16C:
// y[M, N] = x[M, K] W[N, K]^T (+ b), where every block of 32 consecutive k of a row of W is exactly d q + m with
// q in [0, 15] and d, m float16 (llama.cpp's Q4_1 form; eaglespec.q4 finds it in float32 weights and packs it).
//
// Why: a decode step of a small model on a few cores is bound by reading its weights; 20 bytes per 32 weights here
// against 64 in bfloat16 (SmolLM2-135M's layers: 66 MB a step instead of 212).
//
// The sum over a block factors: sum_k x[k] (d q[k] + m) = d S + m X with S = sum_k x[k] q[k] and X = sum_k x[k], so a
// weight costs no rebuild, only its q as a float: a mask, a convert and one FMA per row for 8 weights (rebuilding
// d q + m first took a shift and a second FMA more, and two rows waited on 4 FMA chains). Nibble i of a packed word
// is masked in place, which leaves q 16^i (exact in float32), against x[k] 16^-i (exact: a power of two; the rows
// are scaled once a call); the last nibble is shifted down instead (q 16^7 does not fit an int32). S sums even and
// odd k apart (2 R V independent FMA chains for R rows and V vectors of 8 columns), then per block
// acc = fma(m, X, fma(d, S_even + S_odd, acc)), then bias, rounded once to bfloat16. Every product x[k] q[k] is exact
// and every row goes through the same sums in the same order whatever the number of rows in the call: a row gets the
// same bits alone or in a verify pass (row-invariant), which keeps speculative decoding exactly plain decoding. The
// result is the float32 product of the exact 4-bit weights to float32 rounding (not bit for bit the bfloat16 kernel's).
//
// Packed layout (q4_pack in eaglespec/q4.py): [N/32 groups][K/32 blocks][640 bytes]; a group-block holds d of its
// 32 columns (float16, 64 bytes), then m (64 bytes), then the q as 4 octets x 4 vectors x 8 columns of uint32 (512
// bytes), where uint32 lane c of vector v of octet j holds q[8 v + c][32 b + 8 j + i] in bits [4 i, 4 i + 4).
//
// Rows go through in passes of up to 4 (6 rows = 4 + 2), the later passes reading the group from L1/L2. One row
// takes a block's 4 vectors at once, more rows fewer (their partial sums need the registers). All products of a
// SmolLM2-135M step against the previous rebuild-and-multiply version (benchmarks/scripts/q4_ab.py, both built into
// one process and called alternately, 2 threads, a 2-core Zen 3 VM whose speed moves by 20-40%): 1-2 rows 3-15%
// cheaper (more when the VM is fast), 4 rows 10-14%, 6-8 rows ~10% dearer (that version rebuilt each block once into
// L1 for 3 or more rows; here a block's scaling is per row and pass).
// Threads: at::parallel_for over column groups (torch's intra-op pool).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>

namespace {

constexpr int64_t kCols = 32;                   // output columns per group: 4 vectors of 8 float32 lanes
constexpr int64_t kBlockK = 32;                 // k per block (one d and m per column)
constexpr int64_t kBlockBytes = 640;            // 64 d + 64 m + 512 q
constexpr int64_t kScaleBytes = 128;
constexpr int64_t kPassRows = 4;                // rows per pass over a group
constexpr int64_t kMaxM = 64;                   // rows per pass over the weights; longer inputs take several
constexpr int64_t kAhead = 4 * kBlockBytes;     // software prefetch distance: four blocks ahead
// x[k] 16^-i for nibble i = k mod 8 (the masked nibble is q 16^i); the last nibble is shifted down, so 1
constexpr float kNibbleScale[8] = {1.0f, 0x1p-4f, 0x1p-8f, 0x1p-12f, 0x1p-16f, 0x1p-20f, 0x1p-24f, 1.0f};

inline __m256 half8(const uint8_t* p) {  // 8 float16 -> 8 float32 (exact)
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// R rows times the V vectors of 8 columns from vector c0 of one group, every block -> acc_out[r][8 c0 ..] (float32,
// row stride kCols). xs: the rows scaled by kNibbleScale, row stride ldx; xsum [R][blocks]: each block's input sum X.
template <int R, int V>
void rows_in_registers(const float* xs, int64_t ldx, const float* xsum, int64_t blocks, const uint8_t* group, int c0,
                       float* acc_out) {
  __m256 acc[R][V];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) acc[r][v] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = group + b * kBlockBytes;
    if (c0 == 0)
      for (int line = 0; line < kBlockBytes; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(blk + kAhead + line), _MM_HINT_T0);
    __m256 s[2][R][V];  // partial sums of even and odd k: 2 R V independent FMA chains
#pragma GCC unroll 2
    for (int e = 0; e < 2; ++e)
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
        for (int v = 0; v < V; ++v) s[e][r][v] = _mm256_setzero_ps();
    const float* xb = xs + b * kBlockK;
    const uint8_t* qs = blk + kScaleBytes;
    for (int j = 0; j < 4; ++j) {
      __m256i words[V];
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v)
        words[v] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + (4 * j + c0 + v) * 32));
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) {  // k = 32 b + 8 j + i
        __m256 xk[R];
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) xk[r] = _mm256_broadcast_ss(xb + r * ldx + 8 * j + i);
#pragma GCC unroll 4
        for (int v = 0; v < V; ++v) {
          const __m256i q = i < 7 ? _mm256_and_si256(words[v], _mm256_set1_epi32(0xF << (4 * i)))
                                  : _mm256_srli_epi32(words[v], 28);
          const __m256 qf = _mm256_cvtepi32_ps(q);
#pragma GCC unroll 4
          for (int r = 0; r < R; ++r) s[i & 1][r][v] = _mm256_fmadd_ps(xk[r], qf, s[i & 1][r][v]);
        }
      }
    }
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) {
      const __m256 d = half8(blk + 16 * (c0 + v)), m = half8(blk + 64 + 16 * (c0 + v));
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r)
        acc[r][v] = _mm256_fmadd_ps(m, _mm256_broadcast_ss(xsum + r * blocks + b),
                                    _mm256_fmadd_ps(d, _mm256_add_ps(s[0][r][v], s[1][r][v]), acc[r][v]));
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) _mm256_storeu_ps(acc_out + r * kCols + 8 * (c0 + v), acc[r][v]);
}

// All 32 columns of a group for R <= kPassRows rows: one row reads a block's 4 vectors at once; more rows take
// narrower passes (their partial sums need the registers; the compiler spills the accumulators, read once a block).
template <int R>
void group_rows(const float* xs, int64_t ldx, const float* xsum, int64_t blocks, const uint8_t* group, float* acc) {
  constexpr int V = R == 1 ? 4 : R == 2 ? 2 : 1;
  for (int c0 = 0; c0 < 4; c0 += V) rows_in_registers<R, V>(xs, ldx, xsum, blocks, group, c0, acc);
}

void group_rows(int64_t rows, const float* xs, int64_t ldx, const float* xsum, int64_t blocks, const uint8_t* group,
                float* acc) {
  switch (rows) {
    case 1: return group_rows<1>(xs, ldx, xsum, blocks, group, acc);
    case 2: return group_rows<2>(xs, ldx, xsum, blocks, group, acc);
    case 3: return group_rows<3>(xs, ldx, xsum, blocks, group, acc);
    case 4: return group_rows<4>(xs, ldx, xsum, blocks, group, acc);
    default: TORCH_CHECK(false, "q4_linear: ", rows, " rows in registers");
  }
}

// One group-block's q as float32 [32 k][32 columns] (k-major) into qf (for q4_unpack).
void unpack_block(const uint8_t* blk, float* qf) {
  const __m256i low4 = _mm256_set1_epi32(0xF);
  const uint8_t* qs = blk + kScaleBytes;
  for (int j = 0; j < 4; ++j)
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v) {
      __m256i word = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + (4 * j + v) * 32));
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i, word = _mm256_srli_epi32(word, 4))
        _mm256_store_ps(qf + (8 * j + i) * kCols + 8 * v, _mm256_cvtepi32_ps(_mm256_and_si256(word, low4)));
    }
}

// float32 -> bfloat16 bits, rounded to nearest even; NaN stays a quiet NaN (csrc/avx2/bf16_gemm.cpp's rounding).
inline uint16_t to_bf16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  return static_cast<uint16_t>((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

// Rows [0, m) (m <= kMaxM) times every group -> y [m, n] bfloat16. xs: the rows scaled by kNibbleScale (row stride
// ldx); xsum [m][blocks]: their block sums.
void linear_rows(const float* xs, const float* xsum, int64_t ldx, int64_t m, const uint8_t* wp,
                 int64_t groups, int64_t blocks, int64_t n, const float* bp, uint16_t* yp) {
  at::parallel_for(0, groups, 2, [&](int64_t begin, int64_t end) {
    alignas(32) float acc[kMaxM * kCols];
    for (int64_t g = begin; g < end; ++g) {
      const uint8_t* group = wp + g * blocks * kBlockBytes;
      for (int64_t row = 0; row < m; row += kPassRows)  // 4-row passes are the cheapest per row: 6 rows = 4 + 2
        group_rows(std::min(kPassRows, m - row), xs + row * ldx, ldx, xsum + row * blocks, blocks, group,
                   acc + row * kCols);
      const int64_t col = g * kCols, columns = std::min(kCols, n - col);
      for (int64_t r = 0; r < m; ++r)
        for (int64_t c = 0; c < columns; ++c)
          yp[r * n + col + c] = to_bf16(acc[r * kCols + c] + (bp ? bp[col + c] : 0.0f));
    }
  });
}

void check_packed(const at::Tensor& packed, int64_t n, int64_t k) {
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kBlockBytes && packed.scalar_type() == at::kByte &&
                  packed.is_contiguous(), "q4_linear: packed must come from eaglespec.q4.q4_pack");
  TORCH_CHECK(k == packed.size(1) * kBlockK && n > (packed.size(0) - 1) * kCols && n <= packed.size(0) * kCols,
              "q4_linear: [", n, ", ", k, "] does not match the packed weight (", packed.size(0), " groups of 32 "
              "columns, ", packed.size(1), " blocks of 32 k)");
}

// x [M, K] bfloat16, packed [ceil(n/32), K/32, 640] uint8, bias [n] or none -> [M, n] bfloat16.
at::Tensor q4_linear(const at::Tensor& x_in, const at::Tensor& packed, int64_t n,
                     const std::optional<at::Tensor>& bias_in) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kBFloat16, "q4_linear: x must be [M, K] bfloat16");
  const int64_t m = x_in.size(0), k = x_in.size(1);
  check_packed(packed, n, k);
  const at::Tensor x = x_in.contiguous();
  at::Tensor bias;
  if (bias_in.has_value()) {
    bias = bias_in->to(at::kFloat).contiguous();
    TORCH_CHECK(bias.dim() == 1 && bias.size(0) == n, "q4_linear: bias must be [", n, "]");
  }
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0 || n == 0) return y;
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
  const int64_t blocks = k / kBlockK, chunk = std::min(kMaxM, m);
  std::unique_ptr<float[]> xf(new float[chunk * k]), xs(new float[chunk * k]), xsum(new float[chunk * blocks]);
  for (int64_t row = 0; row < m; row += kMaxM) {  // each row's sums are independent of the chunk it is in
    const int64_t rows = std::min(kMaxM, m - row);
    for (int64_t i = 0; i < rows * k; ++i) {  // exact float32 copies of the bfloat16 inputs
      const uint32_t bits = static_cast<uint32_t>(xp[row * k + i]) << 16;
      std::memcpy(&xf[i], &bits, sizeof(bits));
      xs[i] = xf[i] * kNibbleScale[i % 8];
    }
    for (int64_t i = 0; i < rows * blocks; ++i) {  // in order of k
      float sum = 0.0f;
      for (int64_t kk = 0; kk < kBlockK; ++kk) sum += xf[i * kBlockK + kk];
      xsum[i] = sum;
    }
    linear_rows(xs.get(), xsum.get(), k, rows, packed.data_ptr<uint8_t>(), packed.size(0), blocks, n, bp,
                yp + row * n);
  }
  return y;
}

// The float32 weights [n, K] the packing holds, fmaf(d, q, m) (gguf's float32 dequantization): to check the
// packing against it.
at::Tensor q4_unpack(const at::Tensor& packed, int64_t n, int64_t k) {
  check_packed(packed, n, k);
  const int64_t groups = packed.size(0), blocks = packed.size(1);
  at::Tensor w = at::empty({groups * kCols, k}, at::kFloat);
  alignas(32) float qf[kBlockK * kCols];
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  float* out = w.data_ptr<float>();
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* blk = wp + (g * blocks + b) * kBlockBytes;
      unpack_block(blk, qf);
      alignas(32) float d[kCols], m[kCols];
      for (int v = 0; v < 4; ++v) {
        _mm256_store_ps(d + 8 * v, half8(blk + 16 * v));
        _mm256_store_ps(m + 8 * v, half8(blk + 64 + 16 * v));
      }
      for (int64_t kk = 0; kk < kBlockK; ++kk)
        for (int64_t c = 0; c < kCols; ++c)
          out[(g * kCols + c) * k + b * kBlockK + kk] = std::fmaf(d[c], qf[kk * kCols + c], m[c]);
    }
  return w.narrow(0, 0, n).contiguous();
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(eaglespec, m) {
  m.def("q4_linear(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor");
  m.def("q4_unpack(Tensor packed, int n, int k) -> Tensor");
}

TORCH_LIBRARY_IMPL(eaglespec, CPU, m) {
  m.impl("q4_linear", q4_linear);
  m.impl("q4_unpack", q4_unpack);
}
