// Greedy decoding's next token without reading the whole bfloat16 LM head: an int8 copy of it screens the
// vocabulary, and only the few tokens it cannot rule out are scored exactly.
//
// On a small model the LM head is a fifth of a decode step's weights (SmolLM2-135M: 49152 x 576, 57 MB of its
// 269 MB in bfloat16), and greedy decoding needs only its argmax. Each row n of W is stored as q_n (int8, kept as
// the unsigned byte q + 128) with a scale s_n = max_k |w_nk| / 127, so |w_nk - s_n q_nk| <= err_n (measured,
// <= s_n / 2). An input row x is quantized per block b of 32 channels (sx_b = max_{k in b} |x_k| / 127,
// |x_k - sx_b xq_k| <= sx_b / 2: an outlier channel widens only its own block) and the screen is an exact integer
// dot product per block (AVX-512 VNNI, 4 bytes a lane per instruction: 28 MB read instead of 57):
//   a_n = s_n sum_b sx_b sum_{k in b} xq_k q_nk
//   E_n = sum_k x_k w_nk           (float32, in one fixed order, from the bfloat16 row itself)
//   E_n - a_n = sum_k x_k (w_nk - s_n q_nk) + s_n sum_k q_nk (x_k - sx_b xq_k) + roundings, so
//   |a_n - E_n| <= e_n = |x|_1 B1_n + (sum_b sx_b) B2_n,
//   B1_n ~ err_n + 3 gamma_K max_k |w_nk|, B2_n ~ s_n max_b sum_{k in b} |q_nk| / 2
// (gamma_K = K u / (1 - K u) covers E's float32 sum; bf16gemm.GreedyHead adds margins for the rest). With
// T = max_n (a_n - e_n), every n with E_n >= E_m for all m has a_n + e_n >= T. So the token is the first index of
// the largest E_n among the candidates {n : a_n + e_n >= T}: the argmax of E over the whole vocabulary, ties to the
// lowest index, a function of the row alone (row-invariant), over a few to a few hundred candidates (SmolLM2-135M's
// final hidden states: median 18, max 378; random tokens' flat logits leave thousands, which the threads share;
// benchmarks/scripts/lm_head_screen_bound.py). E is not the bfloat16 kernel's logit bit for bit (another summation
// order, and no rounding to bfloat16); greedy decoding, plain or speculative, uses this one wherever it applies, so
// they agree token for token.
//
// A row whose input is not finite returns -1 (the caller computes the logits instead).
//
// int8_linear runs the same integer products without the bound: approximate logits a_n for the draft heads' LM head
// (bf16gemm.Int8Linear), where an error can only cost acceptance.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kLanes = 16;  // output columns per packed group
constexpr int64_t kRows = 8;    // input rows per pass
constexpr int64_t kBlock = 32;  // input channels per quantization block of x
constexpr int64_t kSteps = kBlock / 4;  // vpdpbusd steps (4 channels each) per block
constexpr int64_t kSerialCandidates = 256;  // exact scores one thread computes before the work is shared
constexpr int64_t kAhead = 8 * kBlock * kLanes;  // software prefetch distance in weight bytes: 8 blocks

// E_n for one input row (float32 [K]) and one bfloat16 weight row: 16 lanes of ordered FMAs (lane l over k = l mod
// 16), then one fixed horizontal sum.
float exact_dot(const float* x, const uint16_t* w, int64_t k) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < k; i += kLanes) {
    const __mmask16 m = k - i >= kLanes ? (__mmask16)0xFFFF : (__mmask16)((1u << (k - i)) - 1);
    const __m512 xv = _mm512_maskz_loadu_ps(m, x + i);
    const __m512 wv =
        _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, w + i)), 16));
    acc = _mm512_fmadd_ps(xv, wv, acc);
  }
  return _mm512_reduce_add_ps(acc);
}

// One input row, quantized: xq [K32] signed bytes, the scale of each block and the sum of its xq.
struct Quantized {
  const int8_t* xq;
  const float* sx;      // [blocks]
  const int32_t* xsum;  // [blocks]: sum_{k in b} xq_k (the weights are stored as q + 128)
};

// hi[r][n] = a_n + e_n for rows [0, R) and the groups [g0, g1) of the packed weight ([G, K32/4, 16, 4] bytes
// q + 128); lo[r] = the largest a - e over those columns. Per block, C chains of int32 sums (exact in any order),
// then one float32 FMA by the block's scale (a fixed order: a_n is the same for a row in any call).
// BOUND = false (int8_linear): hi[r][n] = a_n + bias_n instead (row stride n; b1 is the float32 bias or null; b2, l1,
// sxsum and lo unused).
template <int R, int C, bool BOUND>
void screen_groups(const Quantized* x, int64_t blocks, const uint8_t* packed, const float* scale, const float* b1,
                   const float* b2, const float* l1, const float* sxsum, int64_t g0, int64_t g1, int64_t n,
                   int64_t n_pad, float* hi, float* lo) {
  const int64_t group_bytes = blocks * kBlock * kLanes;
  for (int64_t g = g0; g < g1; ++g) {
    __m512 acc[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    const uint8_t* w = packed + g * group_bytes;
    for (int64_t b = 0; b < blocks; ++b) {
      __m512i sum[R][C];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
        for (int c = 0; c < C; ++c) sum[r][c] = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int64_t s = 0; s < kSteps; ++s) {
        const __m512i wv = _mm512_loadu_si512(w + s * 64);
        _mm_prefetch(reinterpret_cast<const char*>(w + kAhead + s * 64), _MM_HINT_T0);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          int32_t four;
          std::memcpy(&four, x[r].xq + b * kBlock + 4 * s, 4);
          sum[r][s % C] = _mm512_dpbusd_epi32(sum[r][s % C], wv, _mm512_set1_epi32(four));
        }
      }
      w += kSteps * 64;
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        __m512i total = sum[r][0];
#pragma GCC unroll 2
        for (int c = 1; c < C; ++c) total = _mm512_add_epi32(total, sum[r][c]);
        total = _mm512_sub_epi32(total, _mm512_set1_epi32(128 * x[r].xsum[b]));  // sum_k xq_k q_nk, exact
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), _mm512_set1_ps(x[r].sx[b]), acc[r]);
      }
    }
    const __m512 s = _mm512_loadu_ps(scale + g * kLanes);
    const int64_t left = n - g * kLanes;  // columns of this group that exist (the padding never sets T)
    const __mmask16 valid = left >= kLanes ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
    if constexpr (!BOUND) {
      const __m512 bias = b1 ? _mm512_maskz_loadu_ps(valid, b1 + g * kLanes) : _mm512_setzero_ps();
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r)
        _mm512_mask_storeu_ps(hi + r * n + g * kLanes, valid, _mm512_fmadd_ps(acc[r], s, bias));
      continue;
    }
    const __m512 e1 = _mm512_loadu_ps(b1 + g * kLanes), e2 = _mm512_loadu_ps(b2 + g * kLanes);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 a = _mm512_mul_ps(acc[r], s);
      const __m512 e = _mm512_fmadd_ps(_mm512_set1_ps(l1[r]), e1, _mm512_mul_ps(_mm512_set1_ps(sxsum[r]), e2));
      _mm512_storeu_ps(hi + r * n_pad + g * kLanes, _mm512_add_ps(a, e));
      lo[r] = std::max(lo[r], _mm512_mask_reduce_max_ps(valid, _mm512_sub_ps(a, e)));
    }
  }
}

template <int R, bool BOUND = true>
void screen(const Quantized* x, int64_t blocks, const uint8_t* packed, const float* scale, const float* b1,
            const float* b2, const float* l1, const float* sxsum, int64_t groups, int64_t n, int64_t n_pad, float* hi,
            float* lo_out) {
  const int threads = at::get_num_threads();
  std::vector<float> lo(static_cast<size_t>(threads) * R, -std::numeric_limits<float>::infinity());
  at::parallel_for(0, groups, 4, [&](int64_t g0, int64_t g1) {  // (a few groups a task: small heads too)
    float* mine = lo.data() + static_cast<size_t>(at::get_thread_num()) * R;
    screen_groups<R, (R <= 4 ? 2 : 1), BOUND>(x, blocks, packed, scale, b1, b2, l1, sxsum, g0, g1, n, n_pad, hi, mine);
  });
  if constexpr (!BOUND) return;
  for (int r = 0; r < R; ++r) {
    float best = -std::numeric_limits<float>::infinity();
    for (int t = 0; t < threads; ++t) best = std::max(best, lo[static_cast<size_t>(t) * R + r]);
    lo_out[r] = best;
  }
}

// `screen` for 1-8 rows (a compile-time count).
template <bool BOUND>
void screen_rows(int rows, const Quantized* x, int64_t blocks, const uint8_t* packed, const float* scale,
                 const float* b1, const float* b2, const float* l1, const float* sxsum, int64_t groups, int64_t n,
                 int64_t n_pad, float* hi, float* lo) {
  switch (rows) {
    case 1: return screen<1, BOUND>(x, blocks, packed, scale, b1, b2, l1, sxsum, groups, n, n_pad, hi, lo);
    case 2: return screen<2, BOUND>(x, blocks, packed, scale, b1, b2, l1, sxsum, groups, n, n_pad, hi, lo);
    case 3: return screen<3, BOUND>(x, blocks, packed, scale, b1, b2, l1, sxsum, groups, n, n_pad, hi, lo);
    case 4: return screen<4, BOUND>(x, blocks, packed, scale, b1, b2, l1, sxsum, groups, n, n_pad, hi, lo);
    case 5: return screen<5, BOUND>(x, blocks, packed, scale, b1, b2, l1, sxsum, groups, n, n_pad, hi, lo);
    case 6: return screen<6, BOUND>(x, blocks, packed, scale, b1, b2, l1, sxsum, groups, n, n_pad, hi, lo);
    case 7: return screen<7, BOUND>(x, blocks, packed, scale, b1, b2, l1, sxsum, groups, n, n_pad, hi, lo);
    default: return screen<8, BOUND>(x, blocks, packed, scale, b1, b2, l1, sxsum, groups, n, n_pad, hi, lo);
  }
}

// Quantizes row x [k] into xq [blocks * 32] (zero padded), sx, xsum; returns false if x is not finite. l1 = |x|_1
// and sxsum = sum_b sx_b, both rounded up.
bool quantize_row(const float* x, int64_t k, int64_t blocks, int8_t* xq, float* sx, int32_t* xsum, float* l1,
                  float* sxsum) {
  double total = 0.0, scales = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t k0 = b * kBlock, k1 = std::min(k, k0 + kBlock);
    float peak = 0.0f;
    for (int64_t i = k0; i < k1; ++i) {
      total += std::fabs(x[i]);
      peak = std::max(peak, std::fabs(x[i]));
    }
    if (!std::isfinite(peak)) return false;
    sx[b] = peak / 127.0f;
    scales += sx[b];
    int32_t sum = 0;
    for (int64_t i = k0; i < k0 + kBlock; ++i) {
      const float q = i < k1 && sx[b] > 0.0f ? std::nearbyint(x[i] / sx[b]) : 0.0f;
      xq[i] = static_cast<int8_t>(std::clamp(q, -127.0f, 127.0f));
      sum += xq[i];
    }
    xsum[b] = sum;
  }
  *l1 = static_cast<float>(total * (1.0 + 1e-6));
  *sxsum = static_cast<float>(scales * (1.0 + 1e-6));
  return std::isfinite(*l1) && std::isfinite(*sxsum);
}

at::Tensor screened_argmax(const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& scale,
                           const at::Tensor& b1, const at::Tensor& b2, const at::Tensor& weight) {
  TORCH_CHECK(x_in.dim() == 2, "screened_argmax: x must be [M, K]");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.is_contiguous(),
              "screened_argmax: weight must be a contiguous [N, K] bfloat16 tensor");
  const int64_t m = x_in.size(0), k = x_in.size(1), n = weight.size(0);
  const int64_t blocks = (k + kBlock - 1) / kBlock;
  TORCH_CHECK(weight.size(1) == k, "screened_argmax: x and weight disagree on K");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kByte && packed.size(1) * 4 == blocks * kBlock &&
                  packed.size(2) == kLanes && packed.size(3) == 4 && packed.size(0) * kLanes >= n &&
                  packed.is_contiguous(),
              "screened_argmax: packed must be [ceil(N/16), ceil(K/32) * 8, 16, 4] uint8");
  const int64_t groups = packed.size(0), n_pad = groups * kLanes;
  for (const at::Tensor* t : {&scale, &b1, &b2})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->numel() == n_pad && t->is_contiguous(),
                "screened_argmax: scale and bounds must be float32 [ceil(N/16) * 16]");
  at::Tensor out = at::empty({m}, x_in.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  const at::Tensor x = x_in.to(at::kFloat).contiguous();  // [M, K], exact for bfloat16 inputs
  const float* xp = x.data_ptr<float>();
  thread_local std::vector<float> scratch;  // a [kRows, n_pad] buffer kept between calls (allocated once)
  if (scratch.size() < static_cast<size_t>(kRows * n_pad)) scratch.resize(static_cast<size_t>(kRows * n_pad));
  float* hi = scratch.data();
  std::vector<int8_t> xq(static_cast<size_t>(kRows * blocks * kBlock));
  std::vector<float> sx(static_cast<size_t>(kRows * blocks));
  std::vector<int32_t> xsum(static_cast<size_t>(kRows * blocks));
  const auto* w = reinterpret_cast<const uint16_t*>(weight.data_ptr());
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  const float *sp = scale.data_ptr<float>(), *b1p = b1.data_ptr<float>(), *b2p = b2.data_ptr<float>();
  std::vector<int64_t> candidates;
  std::vector<float> exact;
  for (int64_t r0 = 0; r0 < m; r0 += kRows) {
    const int rows = static_cast<int>(std::min<int64_t>(kRows, m - r0));
    Quantized q[kRows];
    float l1[kRows], sxsum[kRows], lo[kRows];
    bool finite = true;
    for (int r = 0; r < rows; ++r) {
      q[r] = {xq.data() + r * blocks * kBlock, sx.data() + r * blocks, xsum.data() + r * blocks};
      finite = quantize_row(xp + (r0 + r) * k, k, blocks, xq.data() + r * blocks * kBlock, sx.data() + r * blocks,
                            xsum.data() + r * blocks, &l1[r], &sxsum[r]) && finite;
    }
    if (!finite) {
      for (int r = 0; r < rows; ++r) op[r0 + r] = -1;
      continue;
    }
    screen_rows<true>(rows, q, blocks, pp, sp, b1p, b2p, l1, sxsum, groups, n, n_pad, hi, lo);
    for (int r = 0; r < rows; ++r) {
      // candidates: a + e >= T, in ascending n; then the first largest E wins
      const float* h = hi + r * n_pad;
      const __m512 t = _mm512_set1_ps(lo[r]);
      candidates.clear();
      for (int64_t i = 0; i < n; i += kLanes) {
        const __mmask16 valid = n - i >= kLanes ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - i)) - 1);
        for (__mmask16 pass = _mm512_mask_cmp_ps_mask(valid, _mm512_loadu_ps(h + i), t, _CMP_GE_OQ); pass;
             pass &= pass - 1)
          candidates.push_back(i + __builtin_ctz(pass));
      }
      const float* row = xp + (r0 + r) * k;
      const int64_t count = static_cast<int64_t>(candidates.size());
      exact.resize(candidates.size());
      // A handful on real hidden states; many where the logits are flat (e.g. random tokens): then the threads
      // share them (each E is the same whichever thread computes it)
      at::parallel_for(0, count, kSerialCandidates, [&](int64_t c0, int64_t c1) {
        for (int64_t c = c0; c < c1; ++c) exact[c] = exact_dot(row, w + candidates[c] * k, k);
      });
      float best = -std::numeric_limits<float>::infinity();
      int64_t best_n = -1;
      for (int64_t c = 0; c < count; ++c)
        if (best_n < 0 || exact[c] > best) {
          best = exact[c];
          best_n = candidates[c];
        }
      op[r0 + r] = best_n;
    }
  }
  return out;
}

// x [M, K], packed / scale as for screened_argmax, bias [n] float32 or none -> [M, n] float32: the int8 copy's
// products a_n (+ bias), each input row quantized per block of 32 channels. Approximate (within the bound above):
// the draft's logits (bf16gemm.Int8Linear), never the target's. A row that is not finite gives NaN.
at::Tensor int8_linear(const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& scale, int64_t n,
                       const std::optional<at::Tensor>& bias_in) {
  TORCH_CHECK(x_in.dim() == 2, "int8_linear: x must be [M, K]");
  const int64_t m = x_in.size(0), k = x_in.size(1), blocks = (k + kBlock - 1) / kBlock;
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kByte && packed.size(1) * 4 == blocks * kBlock &&
                  packed.size(2) == kLanes && packed.size(3) == 4 && packed.size(0) * kLanes >= n &&
                  (packed.size(0) - 1) * kLanes < n && packed.is_contiguous(),
              "int8_linear: packed does not match x [", m, ", ", k, "] and ", n, " outputs");
  const int64_t groups = packed.size(0), n_pad = groups * kLanes;
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == n_pad && scale.is_contiguous(),
              "int8_linear: scale must be float32 [ceil(N/16) * 16]");
  at::Tensor bias;
  if (bias_in.has_value()) {
    bias = bias_in->to(at::kFloat).contiguous();
    TORCH_CHECK(bias.dim() == 1 && bias.size(0) == n, "int8_linear: bias must be [", n, "]");
  }
  at::Tensor y = at::empty({m, n}, x_in.options().dtype(at::kFloat));
  if (m == 0 || n == 0) return y;
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
  std::vector<int8_t> xq(static_cast<size_t>(kRows * blocks * kBlock));
  std::vector<float> sx(static_cast<size_t>(kRows * blocks));
  std::vector<int32_t> xsum(static_cast<size_t>(kRows * blocks));
  for (int64_t r0 = 0; r0 < m; r0 += kRows) {
    const int rows = static_cast<int>(std::min<int64_t>(kRows, m - r0));
    Quantized q[kRows];
    float l1, sxsum;
    bool finite[kRows];
    for (int r = 0; r < rows; ++r) {
      q[r] = {xq.data() + r * blocks * kBlock, sx.data() + r * blocks, xsum.data() + r * blocks};
      finite[r] = quantize_row(xp + (r0 + r) * k, k, blocks, xq.data() + r * blocks * kBlock, sx.data() + r * blocks,
                               xsum.data() + r * blocks, &l1, &sxsum);
      if (!finite[r]) std::fill(sx.data() + r * blocks, sx.data() + (r + 1) * blocks, 0.0f);  // NaN after the call
    }
    float* out = yp + r0 * n;
    screen_rows<false>(rows, q, blocks, pp, sp, bp, nullptr, nullptr, nullptr, groups, n, n_pad, out, nullptr);
    for (int r = 0; r < rows; ++r)
      if (!finite[r]) std::fill(out + r * n, out + (r + 1) * n, std::numeric_limits<float>::quiet_NaN());
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_IMPL(eaglespec, CPU, m) {
  m.impl("screened_argmax", screened_argmax);
  m.impl("int8_linear", int8_linear);
}
