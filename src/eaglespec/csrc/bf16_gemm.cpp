// Few-row bfloat16 products for CPUs with AVX-512 BF16: y[M, N] = x[M, K] W[N, K]^T (+ b), float32 accumulation.
//
// Decode steps and draft-tree verification multiply 1-16 rows by every weight matrix of the model, so they are
// bound by reading the weights (and, from ~8 rows on 2 cores, by bfloat16 arithmetic). The weight is packed once
// (`bf16_pack`) into groups of 64 output columns, k-pairs innermost: [N/64][K/2][64][2]. One 64-byte load then
// holds two k-values of 16 columns, the layout of vdpbf16ps's second operand; the first operand is a pair of x
// values broadcast to all lanes. Each tile keeps up to 6 rows x 4 column vectors of float32 accumulators in
// registers (24 of the 32); no horizontal sums are needed. Calls of more than 6 rows run several tiles over each
// group's weights block by block (linear_rows), so the weights are read from memory once per call.
// A second multiply loop (variant 1, tile_part<ROWS, true>) widens the weights to float32 and uses FMAs: on CPUs where
// vdpbf16ps issues at half the FMA rate (Intel Emerald Rapids here) it does the arithmetic of 6-16 rows ~1.4x
// faster; bf16gemm.variant() measures which loop is faster once per machine.
//
// Every output element is the same ordered sum over k-pairs whatever the number of rows in the call and the row's
// place in it: a row gets the same bits in a one-token step as in a verified draft tree (row-invariant).
// Threads: at::parallel_for over column groups (torch's intra-op thread pool, i.e. --threads).

// The packing (bf16_pack) and the operator schemas are in csrc/ops.cpp, shared with the AVX2 build
// (csrc/avx2/bf16_gemm.cpp).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <memory>

namespace {

constexpr int64_t kGroup = 64;    // output columns per packed group: 4 vectors of 16 float32 lanes
constexpr int64_t kVectors = 4;   // accumulator vectors per row in a tile
constexpr int64_t kMaxRows = 6;   // rows per tile: 6 x 4 accumulators + 4 weight vectors + 1 broadcast <= 32 zmm
constexpr int64_t kMaxM = 64;     // rows per pass over the weights; longer inputs (prefills) take several
constexpr int64_t kBlock = 32;    // k-pairs per block when several tiles share a group's weights (8 KB)
constexpr int64_t kAhead = kBlock * kGroup * 2;  // software prefetch distance in weight elements: one block ahead
// The FMA loop also prefetches into L2 four blocks (32 KB) ahead: on the Intel VM where it is chosen, all products of
// a step took 10-14% less for 1-16 rows than with the near prefetch alone (kernel_ab.py --variant 1, session 18).
constexpr int64_t kFarAhead = 4 * kAhead;

// Rows [0, ROWS) of x (row stride ldx) times k-pairs [p0, p1) of one packed group, accumulated into acc (float32
// [ROWS][64], in memory between calls; zeroed first when p0 == 0). Exact: a float32 store and load change nothing,
// so splitting the k range into blocks gives the same sums as one pass.
// FMA = false (variant 0): x is bfloat16 and each k-pair is one vdpbf16ps. FMA = true (variant 1): x is float32
// (exact copies of the bfloat16 inputs), the even-k weights of a packed vector become float32 by a 16-bit shift, the
// odd-k ones by masking off the low half, and each output element is the ordered sum
// ((acc + x[2p] w[2p]) + x[2p+1] w[2p+1]) over p, rounded after every FMA. Either way the same for every row in any
// call.
template <int ROWS, bool FMA>
void tile_part(const void* x_rows, int64_t ldx, const uint16_t* group, int64_t p0, int64_t p1, float* acc_mem) {
  __m512 acc[ROWS][kVectors];
#pragma GCC unroll 8
  for (int r = 0; r < ROWS; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < kVectors; ++v)
      acc[r][v] = p0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(acc_mem + (r * kVectors + v) * 16);
  const uint16_t* w = group + p0 * kGroup * 2;
  for (int64_t p = p0; p < p1; ++p, w += kGroup * 2) {
    if constexpr (FMA) {
      const auto* x = static_cast<const float*>(x_rows);
      const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
      __m512 wv[kVectors];
#pragma GCC unroll 4
      for (int v = 0; v < kVectors; ++v) {
        wv[v] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_loadu_si512(w + v * 32), 16));
        _mm_prefetch(reinterpret_cast<const char*>(w + kFarAhead + v * 32), _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(w + kAhead + v * 32), _MM_HINT_T0);
      }
#pragma GCC unroll 8
      for (int r = 0; r < ROWS; ++r) {
        const __m512 even = _mm512_set1_ps(x[r * ldx + 2 * p]);
#pragma GCC unroll 4
        for (int v = 0; v < kVectors; ++v) acc[r][v] = _mm512_fmadd_ps(even, wv[v], acc[r][v]);
      }
#pragma GCC unroll 4
      for (int v = 0; v < kVectors; ++v)
        wv[v] = _mm512_castsi512_ps(_mm512_and_si512(_mm512_loadu_si512(w + v * 32), high));
#pragma GCC unroll 8
      for (int r = 0; r < ROWS; ++r) {
        const __m512 odd = _mm512_set1_ps(x[r * ldx + 2 * p + 1]);
#pragma GCC unroll 4
        for (int v = 0; v < kVectors; ++v) acc[r][v] = _mm512_fmadd_ps(odd, wv[v], acc[r][v]);
      }
    } else {
      const auto* x = static_cast<const uint16_t*>(x_rows);
      __m512i wv[kVectors];
#pragma GCC unroll 4
      for (int v = 0; v < kVectors; ++v) {
        wv[v] = _mm512_loadu_si512(w + v * 32);
        _mm_prefetch(reinterpret_cast<const char*>(w + kAhead + v * 32), _MM_HINT_T0);
      }
#pragma GCC unroll 8
      for (int r = 0; r < ROWS; ++r) {
        int32_t pair;
        std::memcpy(&pair, x + r * ldx + 2 * p, sizeof(pair));
        const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 4
        for (int v = 0; v < kVectors; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], xb, (__m512bh)wv[v]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < ROWS; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < kVectors; ++v) _mm512_storeu_ps(acc_mem + (r * kVectors + v) * 16, acc[r][v]);
}

template <bool FMA>
void rows_part(int64_t rows, const void* x, int64_t ldx, const uint16_t* group, int64_t p0, int64_t p1,
               float* acc_mem) {
  switch (rows) {
    case 1: return tile_part<1, FMA>(x, ldx, group, p0, p1, acc_mem);
    case 2: return tile_part<2, FMA>(x, ldx, group, p0, p1, acc_mem);
    case 3: return tile_part<3, FMA>(x, ldx, group, p0, p1, acc_mem);
    case 4: return tile_part<4, FMA>(x, ldx, group, p0, p1, acc_mem);
    case 5: return tile_part<5, FMA>(x, ldx, group, p0, p1, acc_mem);
    case 6: return tile_part<6, FMA>(x, ldx, group, p0, p1, acc_mem);
    default: TORCH_CHECK(false, "bf16_linear: tile of ", rows, " rows");
  }
}

// The finished sums of `rows` rows (acc, [rows][64] float32) + bias, rounded once to bfloat16 -> y columns
// [0, columns).
void store_rows(int64_t rows, const float* acc_mem, const float* bias, uint16_t* y, int64_t ldy, int64_t columns) {
  for (int64_t v = 0; v < kVectors; ++v) {
    const int64_t col = v * 16;
    if (col >= columns) break;
    const int64_t left = columns - col;
    const __mmask16 mask = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + col) : _mm512_setzero_ps();
    for (int64_t r = 0; r < rows; ++r) {
      const __m512 sum = _mm512_loadu_ps(acc_mem + (r * kVectors + v) * 16);
      const __m256i out = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(sum, b));
      _mm256_mask_storeu_epi16(y + r * ldy + col, mask, out);
    }
  }
}

// Rows [0, m) of x, m <= kMaxM, times every packed group -> y [m, n].
// xf: the same rows as float32 for the FMA loop (variant 1), else null (vdpbf16ps).
void linear_rows(const uint16_t* xp, const float* xf, int64_t ldx, int64_t m, const uint16_t* wp, int64_t groups,
                 int64_t k_pairs, int64_t n, const float* bp, uint16_t* yp) {
  const int64_t tiles = (m + kMaxRows - 1) / kMaxRows;
  // Near-equal tiles (8 rows = 4 + 4, not 6 + 2). With one tile the k range is one block; with more, the tiles take
  // turns over blocks of kBlock k-pairs (8 KB of weights): the first tile pulls a block from memory, the others find
  // it in L1, and every tile prefetches the next block so the stream goes on while they multiply. 16 rows of all a
  // SmolLM2-135M step's products: 7.31 -> 5.56 ms against 3.81 for one row (kernel_ab.py, 2 cores).
  int64_t tile_rows[(kMaxM + kMaxRows - 1) / kMaxRows];
  for (int64_t t = 0, row = 0; t < tiles; ++t) {
    tile_rows[t] = (m - row) / (tiles - t);
    row += tile_rows[t];
  }
  const int64_t block = tiles == 1 ? k_pairs : kBlock;
  at::parallel_for(0, groups, 4, [&](int64_t begin, int64_t end) {
    alignas(64) float acc[kMaxM * kGroup];
    for (int64_t g = begin; g < end; ++g) {
      const uint16_t* group = wp + g * k_pairs * kGroup * 2;
      const int64_t col = g * kGroup, columns = std::min(kGroup, n - col);
      for (int64_t p0 = 0; p0 < k_pairs; p0 += block) {
        const int64_t p1 = std::min(k_pairs, p0 + block);
        for (int64_t t = 0, row = 0; t < tiles; row += tile_rows[t], ++t)
          if (xf)
            rows_part<true>(tile_rows[t], xf + row * ldx, ldx, group, p0, p1, acc + row * kGroup);
          else
            rows_part<false>(tile_rows[t], xp + row * ldx, ldx, group, p0, p1, acc + row * kGroup);
      }
      store_rows(m, acc, bp ? bp + col : nullptr, yp + col, n, columns);
    }
  });
}

// x [M, K] bfloat16, packed from bf16_pack of a [n, K] weight, bias [n] or none -> [M, n] bfloat16. variant: 0
// multiplies with vdpbf16ps, 1 with float32 FMAs (bf16gemm.variant() picks the faster on the machine).
at::Tensor bf16_linear(const at::Tensor& x_in, const at::Tensor& packed, int64_t n,
                       const std::optional<at::Tensor>& bias_in, int64_t variant) {
  TORCH_CHECK(variant == 0 || variant == 1, "bf16_linear: variant must be 0 (vdpbf16ps) or 1 (float32 FMA)");
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
  // The FMA loop reads x as float32: each chunk's rows widened into a plain buffer (an ATen conversion costs ~3 us a
  // call, 0.4 ms over a step's 121 products).
  std::unique_ptr<float[]> x_float(variant == 1 ? new float[std::min(kMaxM, m) * ldx] : nullptr);
  for (int64_t row = 0; row < m; row += kMaxM) {  // each row's sums are independent of the chunk it is in
    const int64_t rows = std::min(kMaxM, m - row);
    if (x_float) {
      const uint16_t* from = xp + row * ldx;
      for (int64_t i = 0; i < rows * ldx; ++i) {
        const uint32_t bits = static_cast<uint32_t>(from[i]) << 16;
        std::memcpy(&x_float[i], &bits, sizeof(bits));
      }
    }
    linear_rows(xp + row * ldx, x_float.get(), ldx, rows, wp, groups, k_pairs, n, bp, yp + row * n);
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_IMPL(eaglespec, CPU, m) {
  m.impl("bf16_linear", bf16_linear);
}
