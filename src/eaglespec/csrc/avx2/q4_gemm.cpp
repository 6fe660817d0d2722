// Few-row products with weights stored as 4-bit blocks, for CPUs with AVX2 + FMA + F16C:
// y[M, N] = x[M, K] W[N, K]^T (+ b), where every block of 32 consecutive k of a row of W is exactly d q + m with
// q in [0, 15] and d, m float16 (llama.cpp's Q4_1 form; eaglespec.q4 finds it in float32 weights and packs it).
//
// Lossless: the kernel rebuilds each float32 weight exactly, fmaf(d, q, m) (d q has at most 15 significant bits, so
// the one rounding is that of the sum, as in gguf's float32 dequantization d q + m), then multiplies with the FMA loop
// of csrc/avx2/bf16_gemm.cpp: the ordered sum over k of x[k] w[k], rounded after every FMA, plus bias, rounded once to
// bfloat16. Where the weights are bfloat16 values too, the result has bf16_linear's bits, and a row gets the same bits
// whatever the number of rows in the call (row-invariant). Why: a decode step of a small model on a few cores is bound
// by reading its weights; 20 bytes per 32 weights here against 64 in bfloat16 (SmolLM2-135M's layers: 66 MB a step
// instead of 212).
//
// Packed layout (q4_pack in eaglespec/q4.py): [N/32 groups][K/32 blocks][640 bytes]; a group-block holds d of its
// 32 columns (float16, 64 bytes), then m (64 bytes), then the q as 4 octets x 4 vectors x 8 columns of uint32 (512
// bytes), where uint32 lane c of vector v of octet j holds q[8 v + c][32 b + 8 j + i] in bits [4 i, 4 i + 4).
//
// One or two rows: each weight vector rebuilt in registers (mask, convert, FMA) and multiplied at once (one row: 4
// accumulators of 8 columns; two: 16-column halves of a block, see two_rows). Three or more rows: each group-block
// is rebuilt once into float32 (4 KB, in L1) and tiles of up to 3 rows x 32 columns multiply from it (cheaper there
// than 2 + 1 or 2 + 2 rows rebuilt in registers, and than 3 x 16-column tiles, on a 2-core Zen 3 VM: all products
// of a SmolLM2-135M step, 1 / 2 / 3 / 4 rows, ~5.4-7.4 / 7.2-8.7 / 11.4-12.9 / 13.9-16.3 ms against 10.9-12.4 /
// 12.4-15.7 / 16.3-18.9 / 17.9-21.5 for the bfloat16 kernel, the VM's timings moving by 20-40% between runs).
// Threads: at::parallel_for over column groups (torch's intra-op pool).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>

namespace {

constexpr int64_t kCols = 32;                   // output columns per group: 4 vectors of 8 float32 lanes
constexpr int64_t kBlockK = 32;                 // k per block (one d and m per column)
constexpr int64_t kBlockBytes = 640;            // 64 d + 64 m + 512 q
constexpr int64_t kScaleBytes = 128;
constexpr int64_t kTileRows = 3;                // rows per tile over a rebuilt block
constexpr int64_t kMaxM = 64;                   // rows per pass over the weights; longer inputs take several
constexpr int64_t kAhead = 4 * kBlockBytes;     // software prefetch distance: four blocks ahead

inline __m256 half8(const uint8_t* p) {  // 8 float16 -> 8 float32 (exact)
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// Row x (float32, K values) times every block of one group -> acc (float32 [32]).
void one_row(const float* x, const uint8_t* group, int64_t blocks, float* acc_out) {
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  const __m256i low4 = _mm256_set1_epi32(0xF);
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = group + b * kBlockBytes;
    for (int line = 0; line < kBlockBytes; line += 64) _mm_prefetch(reinterpret_cast<const char*>(blk + kAhead + line),
                                                                     _MM_HINT_T0);
    __m256 d[4];
    alignas(32) float m[kCols];
    for (int v = 0; v < 4; ++v) {
      d[v] = half8(blk + 16 * v);
      _mm256_store_ps(m + 8 * v, half8(blk + 64 + 16 * v));
    }
    const float* mp = m;
    const float* xb = x + b * kBlockK;
    const uint8_t* qs = blk + kScaleBytes;
    for (int j = 0; j < 4; ++j) {
      __m256i words[4];
#pragma GCC unroll 4
      for (int v = 0; v < 4; ++v) words[v] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + (4 * j + v) * 32));
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) {  // k = 32 b + 8 j + i: the low nibble, then shift the next one down
        // m is read from L1 at each use (an FMA's memory operand): the compiler would otherwise hold d, m, the words
        // and the accumulators in 16 + 2 registers and spill accumulators, whose chain then waits on the stack
        asm volatile("" : "+r"(mp));
        const __m256 xk = _mm256_broadcast_ss(xb + 8 * j + i);
#pragma GCC unroll 4
        for (int v = 0; v < 4; ++v) {
          const __m256i q = _mm256_and_si256(words[v], low4);
          words[v] = _mm256_srli_epi32(words[v], 4);
          const __m256 w = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), d[v], _mm256_load_ps(mp + 8 * v));
          acc[v] = _mm256_fmadd_ps(xk, w, acc[v]);
        }
      }
    }
  }
  for (int v = 0; v < 4; ++v) _mm256_storeu_ps(acc_out + 8 * v, acc[v]);
}

// Two rows of x (row stride ldx) times every block of one group -> acc (float32 [2][32]), each block in two halves
// of 16 columns: the half's d, m and nibble words stay in registers next to its 4 accumulators (reloaded from L1 once
// a block and half), so rebuilding a weight vector loads nothing (a 2 x 32 tile's 8 accumulators left no registers
// for them: ~10% slower on a 2-core Zen 3 VM, all 2-row products of a SmolLM2-135M step). The order of the sums is
// one_row's.
void two_rows(const float* x, int64_t ldx, const uint8_t* group, int64_t blocks, float* acc_out) {
  alignas(32) float acc[2 * kCols] = {};
  const __m256i low4 = _mm256_set1_epi32(0xF);
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = group + b * kBlockBytes;
    for (int line = 0; line < kBlockBytes; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(blk + kAhead + line), _MM_HINT_T0);
    const float* xb = x + b * kBlockK;
    for (int h = 0; h < 2; ++h) {
      float* a0p = acc + 16 * h;
      float* a1p = acc + kCols + 16 * h;
      __m256 a00 = _mm256_load_ps(a0p), a01 = _mm256_load_ps(a0p + 8);
      __m256 a10 = _mm256_load_ps(a1p), a11 = _mm256_load_ps(a1p + 8);
      const __m256 d0 = half8(blk + 32 * h), d1 = half8(blk + 32 * h + 16);
      const __m256 m0 = half8(blk + 64 + 32 * h), m1 = half8(blk + 64 + 32 * h + 16);
      const uint8_t* qs = blk + kScaleBytes + 64 * h;
      for (int j = 0; j < 4; ++j) {
        __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 128 * j));
        __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 128 * j + 32));
#pragma GCC unroll 8
        for (int i = 0; i < 8; ++i) {
          const __m256 x0 = _mm256_broadcast_ss(xb + 8 * j + i), x1 = _mm256_broadcast_ss(xb + ldx + 8 * j + i);
          const __m256 v0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(w0, low4)), d0, m0);
          const __m256 v1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(w1, low4)), d1, m1);
          w0 = _mm256_srli_epi32(w0, 4);
          w1 = _mm256_srli_epi32(w1, 4);
          a00 = _mm256_fmadd_ps(x0, v0, a00);
          a10 = _mm256_fmadd_ps(x1, v0, a10);
          a01 = _mm256_fmadd_ps(x0, v1, a01);
          a11 = _mm256_fmadd_ps(x1, v1, a11);
        }
      }
      _mm256_store_ps(a0p, a00);
      _mm256_store_ps(a0p + 8, a01);
      _mm256_store_ps(a1p, a10);
      _mm256_store_ps(a1p + 8, a11);
    }
  }
  std::memcpy(acc_out, acc, sizeof(acc));
}

// One group-block rebuilt as float32 [32 k][32 columns] (k-major) into wf.
void rebuild_block(const uint8_t* blk, float* wf) {
  const __m256i low4 = _mm256_set1_epi32(0xF);
  __m256 d[4], m[4];
  for (int v = 0; v < 4; ++v) {
    d[v] = half8(blk + 16 * v);
    m[v] = half8(blk + 64 + 16 * v);
  }
  const uint8_t* qs = blk + kScaleBytes;
  for (int j = 0; j < 4; ++j)
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v) {
      __m256i word = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + (4 * j + v) * 32));
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i, word = _mm256_srli_epi32(word, 4)) {
        const __m256i q = _mm256_and_si256(word, low4);
        _mm256_store_ps(wf + (8 * j + i) * kCols + 8 * v, _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), d[v], m[v]));
      }
    }
}

// Rows [0, ROWS) of x (row stride ldx, offset to the block's first k) times a rebuilt block wf, accumulated into acc
// (float32 [ROWS][32]).
template <int ROWS>
void tile(const float* x, int64_t ldx, const float* wf, float* acc_mem) {
  __m256 acc[ROWS][4];
#pragma GCC unroll 3
  for (int r = 0; r < ROWS; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v) acc[r][v] = _mm256_loadu_ps(acc_mem + r * kCols + 8 * v);
  for (int64_t k = 0; k < kBlockK; ++k) {
    __m256 xk[ROWS];
#pragma GCC unroll 3
    for (int r = 0; r < ROWS; ++r) xk[r] = _mm256_broadcast_ss(x + r * ldx + k);
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v) {
      const __m256 w = _mm256_load_ps(wf + k * kCols + 8 * v);
#pragma GCC unroll 3
      for (int r = 0; r < ROWS; ++r) acc[r][v] = _mm256_fmadd_ps(xk[r], w, acc[r][v]);
    }
  }
#pragma GCC unroll 3
  for (int r = 0; r < ROWS; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v) _mm256_storeu_ps(acc_mem + r * kCols + 8 * v, acc[r][v]);
}

void tile_rows(int64_t rows, const float* x, int64_t ldx, const float* wf, float* acc_mem) {
  switch (rows) {
    case 1: return tile<1>(x, ldx, wf, acc_mem);
    case 2: return tile<2>(x, ldx, wf, acc_mem);
    case 3: return tile<3>(x, ldx, wf, acc_mem);
    default: TORCH_CHECK(false, "q4_linear: tile of ", rows, " rows");
  }
}

// float32 -> bfloat16 bits, rounded to nearest even; NaN stays a quiet NaN (csrc/avx2/bf16_gemm.cpp's rounding).
inline uint16_t to_bf16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  return static_cast<uint16_t>((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

// Rows [0, m) of xf (m <= kMaxM) times every group -> y [m, n] bfloat16.
void linear_rows(const float* xf, int64_t ldx, int64_t m, const uint8_t* wp, int64_t groups, int64_t blocks,
                 int64_t n, const float* bp, uint16_t* yp) {
  const int64_t tiles = (m + kTileRows - 1) / kTileRows;  // near-equal: 4 rows = 2 + 2
  int64_t tile_size[(kMaxM + kTileRows - 1) / kTileRows];
  for (int64_t t = 0, row = 0; t < tiles; ++t) {
    tile_size[t] = (m - row) / (tiles - t);
    row += tile_size[t];
  }
  at::parallel_for(0, groups, 2, [&](int64_t begin, int64_t end) {
    alignas(32) float acc[kMaxM * kCols];
    alignas(32) float wf[kBlockK * kCols];
    for (int64_t g = begin; g < end; ++g) {
      const uint8_t* group = wp + g * blocks * kBlockBytes;
      if (m == 1) {
        one_row(xf, group, blocks, acc);
      } else if (m == 2) {
        two_rows(xf, ldx, group, blocks, acc);
      } else {
        std::fill(acc, acc + m * kCols, 0.0f);
        for (int64_t b = 0; b < blocks; ++b) {
          const uint8_t* blk = group + b * kBlockBytes;
          _mm_prefetch(reinterpret_cast<const char*>(blk + kAhead), _MM_HINT_T0);
          rebuild_block(blk, wf);
          for (int64_t t = 0, row = 0; t < tiles; row += tile_size[t], ++t)
            tile_rows(tile_size[t], xf + row * ldx + b * kBlockK, ldx, wf, acc + row * kCols);
        }
      }
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
  std::unique_ptr<float[]> x_float(new float[std::min(kMaxM, m) * k]);  // exact copies of the bfloat16 inputs
  for (int64_t row = 0; row < m; row += kMaxM) {  // each row's sums are independent of the chunk it is in
    const int64_t rows = std::min(kMaxM, m - row);
    for (int64_t i = 0; i < rows * k; ++i) {
      const uint32_t bits = static_cast<uint32_t>(xp[row * k + i]) << 16;
      std::memcpy(&x_float[i], &bits, sizeof(bits));
    }
    linear_rows(x_float.get(), k, rows, packed.data_ptr<uint8_t>(), packed.size(0), packed.size(1), n, bp,
                yp + row * n);
  }
  return y;
}

// The float32 weights [n, K] the kernel multiplies by (its own rebuild_block): to check the packing against a
// reference dequantization.
at::Tensor q4_unpack(const at::Tensor& packed, int64_t n, int64_t k) {
  check_packed(packed, n, k);
  const int64_t groups = packed.size(0), blocks = packed.size(1);
  at::Tensor w = at::empty({groups * kCols, k}, at::kFloat);
  alignas(32) float wf[kBlockK * kCols];
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  float* out = w.data_ptr<float>();
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t b = 0; b < blocks; ++b) {
      rebuild_block(wp + (g * blocks + b) * kBlockBytes, wf);
      for (int64_t kk = 0; kk < kBlockK; ++kk)
        for (int64_t c = 0; c < kCols; ++c) out[(g * kCols + c) * k + b * kBlockK + kk] = wf[kk * kCols + c];
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
