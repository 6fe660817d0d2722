// Few-row bfloat16 products for CPUs with AVX2 + FMA: y[M, N] = x[M, K] W[N, K]^T (+ b), float32 accumulation.
// The AVX2 build of csrc/bf16_gemm.cpp: the same operator, the same packed weight (csrc/ops.cpp's bf16_pack,
// [N/64][K/2][64][2]) and the arithmetic of that file's FMA loop (variant 1), the only one here: no bfloat16
// dot-product instruction exists below AVX-512 BF16.
//
// Why bfloat16 weights pay on such a CPU: a decode step of a small model on a few cores is bound by reading its
// weights, and bfloat16 halves the bytes of float32 (SmolLM2-135M: 269 MB instead of 538 a step). The weights are
// widened to float32 in registers (a 16-bit shift for the even k of a pair, a mask for the odd one) and multiplied
// with float32 FMAs, so each output element is the ordered sum ((acc + x[2p] w[2p]) + x[2p+1] w[2p+1]) over k-pairs p,
// rounded after every FMA and once to bfloat16 at the end: the same bits as the AVX-512 build's FMA loop, for a row
// in any call whatever the number of rows (row-invariant).
//
// Register tiles for 16 ymm registers: one row takes a group's 64 columns at once (8 accumulators); two rows run two
// tiles of 2 rows x 32 columns that take turns over blocks of 32 k-pairs of a group (8 KB, in L1 after the first
// tile reads it); three or more widen each block to float32 once and run tiles of up to 3 rows x 32 columns over it
// (widened_part). Either way the weights stream from memory once per call. Threads: at::parallel_for over column
// groups (torch's intra-op pool, i.e. --threads).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>

namespace {

constexpr int64_t kGroup = 64;    // output columns per packed group: 8 vectors of 8 float32 lanes
constexpr int64_t kLanes = 8;
constexpr int64_t kWideRows = 3;  // rows per tile over a widened block (x 4 vectors of 8 columns)
constexpr int kWideV = 4;
constexpr int64_t kMaxM = 64;     // rows per pass over the weights; longer inputs (prefills) take several
constexpr int64_t kBlock = 32;    // k-pairs per block when several tiles share a group's weights (8 KB)
constexpr int64_t kAhead = kBlock * kGroup * 2;  // software prefetch distance in weight elements: one block ahead
constexpr int64_t kFarAhead = 4 * kAhead;        // and into L2 four blocks ahead, as the AVX-512 FMA loop

// Rows [0, ROWS) of xf (float32, row stride ldx) times k-pairs [p0, p1) of columns [col0, col0 + 8 V) of one packed
// group, accumulated into acc_mem (float32 [ROWS][64], in memory between blocks; zeroed first when p0 == 0). A
// float32 store and load change nothing, so blocks give the same sums as one pass.
template <int ROWS, int V>
void tile_part(const float* x, int64_t ldx, const uint16_t* group, int64_t col0, int64_t p0, int64_t p1,
               float* acc_mem) {
  __m256 acc[ROWS][V];
#pragma GCC unroll 2
  for (int r = 0; r < ROWS; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v)
      acc[r][v] = p0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(acc_mem + r * kGroup + col0 + v * kLanes);
  const __m256i high = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  const uint16_t* w = group + p0 * kGroup * 2 + col0 * 2;
  for (int64_t p = p0; p < p1; ++p, w += kGroup * 2) {
    __m256i raw[V];  // 8 columns x 2 k each
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) raw[v] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + v * 2 * kLanes));
    if (V == 8 || col0 == 0) {  // one prefetch per cache line of the k-pair's 256 bytes
#pragma GCC unroll 4
      for (int line = 0; line < 4; ++line) {
        _mm_prefetch(reinterpret_cast<const char*>(w + kFarAhead + line * 32), _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(w + kAhead + line * 32), _MM_HINT_T0);
      }
    }
#pragma GCC unroll 2
    for (int r = 0; r < ROWS; ++r) {
      const __m256 even = _mm256_broadcast_ss(x + r * ldx + 2 * p);
#pragma GCC unroll 8
      for (int v = 0; v < V; ++v)
        acc[r][v] = _mm256_fmadd_ps(even, _mm256_castsi256_ps(_mm256_slli_epi32(raw[v], 16)), acc[r][v]);
    }
#pragma GCC unroll 2
    for (int r = 0; r < ROWS; ++r) {
      const __m256 odd = _mm256_broadcast_ss(x + r * ldx + 2 * p + 1);
#pragma GCC unroll 8
      for (int v = 0; v < V; ++v)
        acc[r][v] = _mm256_fmadd_ps(odd, _mm256_castsi256_ps(_mm256_and_si256(raw[v], high)), acc[r][v]);
    }
  }
#pragma GCC unroll 2
  for (int r = 0; r < ROWS; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) _mm256_storeu_ps(acc_mem + r * kGroup + col0 + v * kLanes, acc[r][v]);
}

// Calls of 3 or more rows: a block of k-pairs of a group is widened to float32 once ([2 kb][64] floats, k-major, 16
// KB, in L1) and every row tile multiplies from it, so the widening (a shift and a mask per weight vector) is paid
// once per block instead of once per tile: tiles of up to 3 rows x 32 columns (12 accumulators, 3 broadcasts, one
// weight vector at a time), which beat 6 x 16 and 4 x 16 tiles on a 2-core Zen 3 VM (more broadcasts per FMA there).
// The sums are the same: k = 2p, then 2p + 1, for every p.
void widen_block(const uint16_t* group, int64_t p0, int64_t p1, float* wf) {
  const __m256i high = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  const uint16_t* w = group + p0 * kGroup * 2;
  for (int64_t p = p0; p < p1; ++p, w += kGroup * 2, wf += 2 * kGroup) {
    _mm_prefetch(reinterpret_cast<const char*>(w + kAhead), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w + kAhead + 32), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w + kAhead + 64), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w + kAhead + 96), _MM_HINT_T0);
#pragma GCC unroll 8
    for (int v = 0; v < kGroup / kLanes; ++v) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + v * 2 * kLanes));
      _mm256_store_ps(wf + v * kLanes, _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16)));
      _mm256_store_ps(wf + kGroup + v * kLanes, _mm256_castsi256_ps(_mm256_and_si256(raw, high)));
    }
  }
}

// Rows [0, ROWS) of x times the widened block wf ([2 (p1 - p0)][64] floats) for columns [col0, col0 + 8 V) and
// k-pairs [p0, p1), accumulated into acc_mem as tile_part does.
template <int ROWS, int V>
void widened_part(const float* x, int64_t ldx, const float* wf, int64_t col0, int64_t p0, int64_t p1,
                  float* acc_mem) {
  __m256 acc[ROWS][V];
#pragma GCC unroll 3
  for (int r = 0; r < ROWS; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v)
      acc[r][v] = p0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(acc_mem + r * kGroup + col0 + v * kLanes);
  const float* w = wf + col0;
  for (int64_t k = 2 * p0; k < 2 * p1; ++k, w += kGroup) {
    __m256 xk[ROWS];
#pragma GCC unroll 3
    for (int r = 0; r < ROWS; ++r) xk[r] = _mm256_broadcast_ss(x + r * ldx + k);
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) {
      const __m256 wv = _mm256_load_ps(w + v * kLanes);
#pragma GCC unroll 3
      for (int r = 0; r < ROWS; ++r) acc[r][v] = _mm256_fmadd_ps(xk[r], wv, acc[r][v]);
    }
  }
#pragma GCC unroll 3
  for (int r = 0; r < ROWS; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) _mm256_storeu_ps(acc_mem + r * kGroup + col0 + v * kLanes, acc[r][v]);
}

void widened_rows(int64_t rows, const float* x, int64_t ldx, const float* wf, int64_t col0, int64_t p0, int64_t p1,
                  float* acc_mem) {
  switch (rows) {
    case 1: return widened_part<1, kWideV>(x, ldx, wf, col0, p0, p1, acc_mem);
    case 2: return widened_part<2, kWideV>(x, ldx, wf, col0, p0, p1, acc_mem);
    case 3: return widened_part<3, kWideV>(x, ldx, wf, col0, p0, p1, acc_mem);
    default: TORCH_CHECK(false, "bf16_linear: tile of ", rows, " rows");
  }
}

// float32 -> bfloat16 bits, rounded to nearest even (as vcvtneps2bf16); NaN stays a quiet NaN.
inline __m128i to_bf16(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x40));
  rounded = _mm256_blendv_epi8(rounded, quiet, nan);
  // 32-bit lanes holding 16-bit values -> 8 packed halves (packus works per 128-bit lane: fix the order after)
  const __m256i packed = _mm256_packus_epi32(rounded, rounded);
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
}

// The finished sums of `rows` rows (acc, [rows][64] float32) + bias, rounded once to bfloat16 -> y columns
// [0, columns).
void store_rows(int64_t rows, const float* acc_mem, const float* bias, uint16_t* y, int64_t ldy, int64_t columns) {
  alignas(32) float b[kGroup] = {};
  if (bias) std::copy(bias, bias + columns, b);
  for (int64_t col = 0; col < columns; col += kLanes) {
    const int64_t count = std::min(kLanes, columns - col);
    const __m256 bv = _mm256_load_ps(b + col);
    for (int64_t r = 0; r < rows; ++r) {
      const __m128i out = to_bf16(_mm256_add_ps(_mm256_loadu_ps(acc_mem + r * kGroup + col), bv));
      if (count == kLanes)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(y + r * ldy + col), out);
      else {
        alignas(16) uint16_t tail[kLanes];
        _mm_store_si128(reinterpret_cast<__m128i*>(tail), out);
        std::memcpy(y + r * ldy + col, tail, count * sizeof(uint16_t));
      }
    }
  }
}

// Rows [0, m) of xf, m <= kMaxM, times every packed group -> y [m, n].
void linear_rows(const float* xf, int64_t ldx, int64_t m, const uint16_t* wp, int64_t groups, int64_t k_pairs,
                 int64_t n, const float* bp, uint16_t* yp) {
  const int64_t tiles = (m + kWideRows - 1) / kWideRows;  // near-equal: 8 rows = 4 + 4, not 6 + 2
  int64_t tile_rows[(kMaxM + kWideRows - 1) / kWideRows];
  for (int64_t t = 0, row = 0; t < tiles; ++t) {
    tile_rows[t] = (m - row) / (tiles - t);
    row += tile_rows[t];
  }
  at::parallel_for(0, groups, 4, [&](int64_t begin, int64_t end) {
    alignas(32) float acc[kMaxM * kGroup];
    alignas(32) float wf[2 * kBlock * kGroup];  // a widened block (calls of 3 or more rows)
    for (int64_t g = begin; g < end; ++g) {
      const uint16_t* group = wp + g * k_pairs * kGroup * 2;
      const int64_t col = g * kGroup, columns = std::min(kGroup, n - col);
      if (m == 1) {  // a decode step: every column of the group at once, one pass over k
        tile_part<1, 8>(xf, ldx, group, 0, 0, k_pairs, acc);
      } else if (m == 2) {  // two tiles of 2 rows x 32 columns take turns over blocks of k-pairs
        for (int64_t p0 = 0; p0 < k_pairs; p0 += kBlock) {
          const int64_t p1 = std::min(k_pairs, p0 + kBlock);
          for (int64_t col0 = 0; col0 < kGroup; col0 += kGroup / 2)
            tile_part<2, 4>(xf, ldx, group, col0, p0, p1, acc);
        }
      } else {  // blocks widened once, then near-equal tiles of up to 3 rows x 32 columns
        for (int64_t p0 = 0; p0 < k_pairs; p0 += kBlock) {
          const int64_t p1 = std::min(k_pairs, p0 + kBlock);
          widen_block(group, p0, p1, wf);
          for (int64_t t = 0, row = 0; t < tiles; row += tile_rows[t], ++t)
            for (int64_t col0 = 0; col0 < kGroup; col0 += kWideV * kLanes)
              widened_rows(tile_rows[t], xf + row * ldx, ldx, wf, col0, p0, p1, acc + row * kGroup);
        }
      }
      store_rows(m, acc, bp ? bp + col : nullptr, yp + col, n, columns);
    }
  });
}

// x [M, K] bfloat16, packed from bf16_pack of a [n, K] weight, bias [n] or none -> [M, n] bfloat16. variant must be
// 1 (float32 FMAs): the one multiply loop of this build (bf16gemm.variant() gives it on an AVX2 CPU).
at::Tensor bf16_linear(const at::Tensor& x_in, const at::Tensor& packed, int64_t n,
                       const std::optional<at::Tensor>& bias_in, int64_t variant) {
  TORCH_CHECK(variant == 0 || variant == 1, "bf16_linear: variant must be 0 (vdpbf16ps) or 1 (float32 FMA)");
  TORCH_CHECK(variant == 1, "bf16_linear: the AVX2 build has only the float32 FMA loop (variant 1)");
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kBFloat16, "bf16_linear: x must be [M, K] bfloat16");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kGroup && packed.size(3) == 2 &&
                  packed.scalar_type() == at::kBFloat16 && packed.is_contiguous(),
              "bf16_linear: packed must come from bf16_pack");
  const int64_t m = x_in.size(0), k = x_in.size(1), k_pairs = packed.size(1), groups = packed.size(0);
  TORCH_CHECK((k + 1) / 2 == k_pairs && n > (groups - 1) * kGroup && n <= groups * kGroup,
              "bf16_linear: x [", m, ", ", k, "] does not match the packed weight (", n, " outputs)");
  at::Tensor x = x_in.contiguous();
  if (k % 2) x = at::constant_pad_nd(x, {0, 1});
  at::Tensor bias;
  if (bias_in.has_value()) {
    bias = bias_in->to(at::kFloat).contiguous();
    TORCH_CHECK(bias.dim() == 1 && bias.size(0) == n, "bf16_linear: bias must be [", n, "]");
  }
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0 || n == 0) return y;
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
  const int64_t ldx = x.size(1);
  // x as float32 (exact copies of the bfloat16 inputs), each chunk's rows widened into a plain buffer
  std::unique_ptr<float[]> x_float(new float[std::min(kMaxM, m) * ldx]);
  for (int64_t row = 0; row < m; row += kMaxM) {  // each row's sums are independent of the chunk it is in
    const int64_t rows = std::min(kMaxM, m - row);
    const uint16_t* from = xp + row * ldx;
    for (int64_t i = 0; i < rows * ldx; ++i) {
      const uint32_t bits = static_cast<uint32_t>(from[i]) << 16;
      std::memcpy(&x_float[i], &bits, sizeof(bits));
    }
    linear_rows(x_float.get(), ldx, rows, wp, groups, k_pairs, n, bp, yp + row * n);
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_IMPL(eaglespec, CPU, m) {
  m.impl("bf16_linear", bf16_linear);
}
