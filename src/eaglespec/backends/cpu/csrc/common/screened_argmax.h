// Greedy decoding's next token without reading the whole bfloat16 LM head: an int8 copy of it screens the
// vocabulary, and only the few tokens it cannot rule out are scored exactly.
//
// On a small model the LM head is a fifth of a decode step's weights (SmolLM2-135M: 49152 x 576, 57 MB of its
// 269 MB in bfloat16), and greedy decoding needs only its argmax. Each row n of W is stored as q_n (int8, kept as
// the unsigned byte q + 128) with a scale s_n = max_k |w_nk| / 127, so |w_nk - s_n q_nk| <= err_n (measured,
// <= s_n / 2). An input row x is quantized per block b of 32 channels (sx_b = max_{k in b} |x_k| / 127,
// |x_k - sx_b xq_k| <= sx_b / 2: an outlier channel widens only its own block) and the screen is an exact integer
// dot product per block (AVX-512 VNNI, 4 bytes a lane per instruction, or AVX2's vpmaddubsw: 28 MB read instead of
// 57; avx512/screened_argmax.h, avx2/screened_argmax.h: the same integers, hence the same bits):
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
// benchmarks/microbench/lm_head_screen_bound.py). E is not the bfloat16 kernel's logit bit for bit (another summation
// order, and no rounding to bfloat16); greedy decoding, plain or speculative, uses this one wherever it applies, so
// they agree token for token.
//
// A row whose input is not finite returns -1 (the caller computes the logits instead).
//
// int8_linear runs the same integer products without the bound: approximate logits a_n for the draft heads' LM head
// (bf16gemm.Int8Linear), where an error can only cost acceptance.
//
// The micro-kernels (isa::, included before this): exact_dot (E_n for one input row and one bfloat16 weight row: 16
// lanes of ordered FMAs, lane l over k = l mod 16, then one fixed horizontal sum), screen_groups<R, BOUND> (the
// screen's hi and lo over a range of packed groups) and candidates (the columns whose a + e reach T, ascending).

#pragma once

#include "shared.h"

namespace eaglespec::screen {
namespace {

constexpr int64_t kRows = 16;  // input rows per screen call (scratch rows): one read of the weights for all
constexpr int kTileRows = 8;   // rows the micro-kernels take at a time (their registers)
constexpr int64_t kSerialCandidates = 256;  // exact scores one thread computes before the work is shared

// hi and lo (BOUND) or the products (not BOUND) of R rows (R <= kRows) over every packed group, on torch's threads.
// Up to kTileRows rows run as one tile over a thread's groups. More run as two tiles of near-equal rows, group by
// group: the second tile finds the group's weights (16 columns x K bytes) in L1, so the weights are read from memory
// once per call rather than once per tile (a verify pass of 9-16 rows then costs about what 8 do). A row's integer
// sums and its float steps are the same in either form, and in every tile: its bits are its own (row-invariant).
template <int R, bool BOUND = true>
void screen(const Quantized* x, int64_t blocks, const uint8_t* packed, const float* scale, const float* b1,
            const float* b2, const float* l1, const float* sxsum, int64_t groups, int64_t n, int64_t n_pad, float* hi,
            float* lo_out) {
  const int threads = at::get_num_threads();
  std::vector<float> lo(static_cast<size_t>(threads) * R, -std::numeric_limits<float>::infinity());
  at::parallel_for(0, groups, 4, [&](int64_t g0, int64_t g1) {  // (a few groups a task: small heads too)
    float* mine = lo.data() + static_cast<size_t>(at::get_thread_num()) * R;
    if constexpr (R <= kTileRows) {
      isa::screen_groups<R, BOUND>(x, blocks, packed, scale, b1, b2, l1, sxsum, g0, g1, n, n_pad, hi, mine);
    } else {
      constexpr int R1 = (R + 1) / 2, R2 = R - R1;
      const int64_t stride = BOUND ? n_pad : n;  // hi's row stride
      for (int64_t g = g0; g < g1; ++g) {
        isa::screen_groups<R1, BOUND>(x, blocks, packed, scale, b1, b2, l1, sxsum, g, g + 1, n, n_pad, hi, mine);
        isa::screen_groups<R2, BOUND>(x + R1, blocks, packed, scale, b1, b2, BOUND ? l1 + R1 : l1,
                                      BOUND ? sxsum + R1 : sxsum, g, g + 1, n, n_pad, hi + R1 * stride, mine + R1);
      }
    }
  });
  if constexpr (!BOUND) return;
  for (int r = 0; r < R; ++r) {
    float best = -std::numeric_limits<float>::infinity();
    for (int t = 0; t < threads; ++t) best = std::max(best, lo[static_cast<size_t>(t) * R + r]);
    lo_out[r] = best;
  }
}

// `screen` for 1-16 rows (a compile-time count).
template <bool BOUND>
void screen_rows(int rows, const Quantized* x, int64_t blocks, const uint8_t* packed, const float* scale,
                 const float* b1, const float* b2, const float* l1, const float* sxsum, int64_t groups, int64_t n,
                 int64_t n_pad, float* hi, float* lo) {
  with_rows<kRows>(rows, [&](auto r) {
    screen<decltype(r)::value, BOUND>(x, blocks, packed, scale, b1, b2, l1, sxsum, groups, n, n_pad, hi, lo);
  });
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

// The quantized copies of up to kRows input rows of `blocks` blocks.
struct QuantizedRows {
  int64_t blocks;
  std::vector<int8_t> xq;
  std::vector<float> sx;
  std::vector<int32_t> xsum;
  explicit QuantizedRows(int64_t row_blocks)
      : blocks(row_blocks),
        xq(static_cast<size_t>(kRows * row_blocks * kBlock)),
        sx(static_cast<size_t>(kRows * row_blocks)),
        xsum(static_cast<size_t>(kRows * row_blocks)) {}
  // Row r of a pass from x [k] -> q[r], *l1, *sxsum; false if x is not finite.
  bool quantize(int r, const float* x, int64_t k, Quantized* q, float* l1, float* sxsum) {
    q[r] = {xq.data() + r * blocks * kBlock, sx.data() + r * blocks, xsum.data() + r * blocks};
    return quantize_row(x, k, blocks, xq.data() + r * blocks * kBlock, sx.data() + r * blocks,
                        xsum.data() + r * blocks, l1, sxsum);
  }
};

// The packed int8 weight [ceil(N/16), ceil(K/32) * 8, 16, 4] uint8 for K channels: true if its shape matches.
bool packed_fits(const at::Tensor& packed, int64_t blocks, int64_t n) {
  return packed.dim() == 4 && packed.scalar_type() == at::kByte && packed.size(1) * 4 == blocks * kBlock &&
         packed.size(2) == kLanes && packed.size(3) == 4 && packed.size(0) * kLanes >= n && packed.is_contiguous();
}

at::Tensor screened_argmax(const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& scale,
                           const at::Tensor& b1, const at::Tensor& b2, const at::Tensor& weight) {
  TORCH_CHECK(x_in.dim() == 2, "screened_argmax: x must be [M, K]");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.is_contiguous(),
              "screened_argmax: weight must be a contiguous [N, K] bfloat16 tensor");
  const int64_t m = x_in.size(0), k = x_in.size(1), n = weight.size(0);
  const int64_t blocks = (k + kBlock - 1) / kBlock;
  TORCH_CHECK(weight.size(1) == k, "screened_argmax: x and weight disagree on K");
  TORCH_CHECK(packed_fits(packed, blocks, n),
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
  QuantizedRows quantized(blocks);
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
    for (int r = 0; r < rows; ++r)
      finite = quantized.quantize(r, xp + (r0 + r) * k, k, q, &l1[r], &sxsum[r]) && finite;
    if (!finite) {
      for (int r = 0; r < rows; ++r) op[r0 + r] = -1;
      continue;
    }
    screen_rows<true>(rows, q, blocks, pp, sp, b1p, b2p, l1, sxsum, groups, n, n_pad, hi, lo);
    for (int r = 0; r < rows; ++r) {
      // candidates: a + e >= T, in ascending n; then the first largest E wins
      candidates.clear();
      isa::candidates(hi + r * n_pad, n, lo[r], candidates);
      const float* row = xp + (r0 + r) * k;
      const int64_t count = static_cast<int64_t>(candidates.size());
      exact.resize(candidates.size());
      // A handful on real hidden states; many where the logits are flat (e.g. random tokens): then the threads
      // share them (each E is the same whichever thread computes it)
      at::parallel_for(0, count, kSerialCandidates, [&](int64_t c0, int64_t c1) {
        for (int64_t c = c0; c < c1; ++c) exact[c] = isa::exact_dot(row, w + candidates[c] * k, k);
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
  TORCH_CHECK(packed_fits(packed, blocks, n) && (packed.size(0) - 1) * kLanes < n,
              "int8_linear: packed does not match x [", m, ", ", k, "] and ", n, " outputs");
  const int64_t groups = packed.size(0), n_pad = groups * kLanes;
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == n_pad && scale.is_contiguous(),
              "int8_linear: scale must be float32 [ceil(N/16) * 16]");
  const at::Tensor bias = float_bias(bias_in, n, "int8_linear");
  at::Tensor y = at::empty({m, n}, x_in.options().dtype(at::kFloat));
  if (m == 0 || n == 0) return y;
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  const float* bp = float_data(bias);
  QuantizedRows quantized(blocks);
  float* sx = quantized.sx.data();
  for (int64_t r0 = 0; r0 < m; r0 += kRows) {
    const int rows = static_cast<int>(std::min<int64_t>(kRows, m - r0));
    Quantized q[kRows];
    float l1, sxsum;
    bool finite[kRows];
    for (int r = 0; r < rows; ++r) {
      finite[r] = quantized.quantize(r, xp + (r0 + r) * k, k, q, &l1, &sxsum);
      if (!finite[r]) std::fill(sx + r * blocks, sx + (r + 1) * blocks, 0.0f);  // NaN after the call
    }
    float* out = yp + r0 * n;
    screen_rows<false>(rows, q, blocks, pp, sp, bp, nullptr, nullptr, nullptr, groups, n, n_pad, out, nullptr);
    for (int r = 0; r < rows; ++r)
      if (!finite[r]) std::fill(out + r * n, out + (r + 1) * n, std::numeric_limits<float>::quiet_NaN());
  }
  return y;
}

}  // namespace
}  // namespace eaglespec::screen
