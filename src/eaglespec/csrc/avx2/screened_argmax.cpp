// AVX2 build of csrc/screened_argmax.cpp, with the same semantics and the same packed operands
// (eaglespec.bf16gemm.int8_rows): greedy decoding's next token without reading the whole bfloat16 LM head (an int8
// copy of it screens the vocabulary, and only the few tokens it cannot rule out are scored exactly), and
// int8_linear, the same integer products without the bound. The original's header has the bound and its
// derivation; in short, with a_n = s_n sum_b sx_b sum_{k in b} xq_k q_nk (exact integer block sums, then one
// float32 FMA per block by the block's scale, blocks in order), E_n = sum_k x_k w_nk (float32, one fixed order) and
// |a_n - E_n| <= e_n = |x|_1 B1_n + (sum_b sx_b) B2_n, the token is the first largest E_n among the candidates
// {n : a_n + e_n >= T}, T = max_n (a_n - e_n). A row whose input is not finite returns -1 (int8_linear: NaN).
//
// What differs is only how the integer sums are formed. AVX2 has no vpdpbusd (u8 x s8, 4 products summed into
// int32). vpmaddubsw multiplies u8 by s8 and adds pairs into int16 with saturation, and the stored bytes q + 128
// (0..255) times xq (-127..127) make pair sums up to 2 * 255 * 127 = 64770: they would saturate. So the signed q
// is recovered (byte ^ 0x80) and the sign moved onto x: |q| (0..127 as u8) times sign(q) xq (vpsignb, which also
// zeroes xq where q = 0, where the product is 0), pair sums at most 2 * 127 * 127 = 32258 < 32767; then vpmaddwd by
// ones adds the pairs into the int32 lane of their column. The block sums are sum_k xq_k q_nk directly (no
// "- 128 sum xq" correction), the same integers as the AVX-512 build's, so a_n and e_n are the same bits too.
//
// Registers: a 64-byte packed unit (16 columns x 4 consecutive channels) is two 256-bit halves of 8 columns each,
// and 4 channels of an input row are one 32-bit value broadcast to every lane, so the int32 lanes line up with the
// columns. A row costs 8 instructions a unit (vpsignb, vpmaddubsw, vpmaddwd, vpaddd per half) and the unit 4
// shared ones (vpxor, vpabsb per half), so a pass over a group's weights takes 4 input rows: their 8 int32 block
// sums, the halves' q and |q|, ones and the broadcast x fill the 16 ymm registers (the float32 accumulators, touched
// once a block, live in memory). More rows of a call take another pass over the same group, whose bytes
// (K32 * 16, 9 KB for K = 576) are then in L1. (On Zen 3, one core, weights in L2: ~1.3 ns a row and unit for 1
// row a pass, ~1.15 for 2, ~1.07 for 4.)
//
// E_n's 16 lanes of ordered FMAs are two registers of 8, reduced in the order GCC's _mm512_reduce_add_ps uses, so
// E is the AVX-512 build's too (with GCC).

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
constexpr int64_t kRows = 8;    // input rows per screen call (scratch rows)
constexpr int kPass = 4;        // input rows multiplied per read of a group's weights (registers)
constexpr int64_t kBlock = 32;  // input channels per quantization block of x
constexpr int64_t kSteps = kBlock / 4;  // 64-byte units (4 channels each) per block
constexpr int64_t kSerialCandidates = 256;  // exact scores one thread computes before the work is shared
constexpr int64_t kAhead = 8 * kBlock * kLanes;  // software prefetch distance in weight bytes: 8 blocks

// bfloat16 [8] -> float32 lanes (the high half of a float32).
inline __m256 bf16_to_float(const uint16_t* w) {
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))), 16));
}

// E_n for one input row (float32 [K]) and one bfloat16 weight row: 16 lanes of ordered FMAs (lane l over k = l mod
// 16, two registers of 8; the last partial 16 zero padded), then one fixed horizontal sum (the halves added, then
// the 128-bit halves, then lanes {0, 2} and {1, 3}, then those two).
float exact_dot(const float* x, const uint16_t* w, int64_t k) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  const int64_t full = k / kLanes * kLanes;
  for (int64_t i = 0; i < full; i += kLanes) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), bf16_to_float(w + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 8), bf16_to_float(w + i + 8), acc1);
  }
  if (full < k) {
    alignas(32) float xt[kLanes] = {};
    alignas(32) uint16_t wt[kLanes] = {};
    std::memcpy(xt, x + full, static_cast<size_t>(k - full) * sizeof(float));
    std::memcpy(wt, w + full, static_cast<size_t>(k - full) * sizeof(uint16_t));
    acc0 = _mm256_fmadd_ps(_mm256_load_ps(xt), bf16_to_float(wt), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_load_ps(xt + 8), bf16_to_float(wt + 8), acc1);
  }
  const __m256 eight = _mm256_add_ps(acc1, acc0);
  const __m128 four = _mm_add_ps(_mm256_extractf128_ps(eight, 1), _mm256_castps256_ps128(eight));
  const __m128 two = _mm_add_ps(four, _mm_shuffle_ps(four, four, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(two) + _mm_cvtss_f32(_mm_shuffle_ps(two, two, _MM_SHUFFLE(1, 1, 1, 1)));
}

// One input row, quantized: xq [K32] signed bytes and the scale of each block.
struct Quantized {
  const int8_t* xq;
  const float* sx;  // [blocks]
};

// acc[r][0:16] = sum_b sx_b sum_{k in b} xq_k q_nk for P rows and the 16 columns n of one packed group w
// ([K32/4, 16, 4] bytes q + 128): per block, int32 sums (exact in any order), then one float32 FMA by the block's
// scale (a fixed order: a_n is the same for a row in any call). PREFETCH (the first pass over the group): fetch the
// weights kAhead bytes ahead.
template <int P, bool PREFETCH>
inline void group_dots(const Quantized* x, int64_t blocks, const uint8_t* w, float (*acc_out)[kLanes]) {
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80)), ones = _mm256_set1_epi16(1);
  __m256 acc[P][2];
#pragma GCC unroll 4
  for (int r = 0; r < P; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m256i sum[P][2];
#pragma GCC unroll 4
    for (int r = 0; r < P; ++r) sum[r][0] = sum[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int64_t s = 0; s < kSteps; ++s) {
      if constexpr (PREFETCH) _mm_prefetch(reinterpret_cast<const char*>(w + kAhead + s * 64), _MM_HINT_T0);
      __m256i q[2], magnitude[2];
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {  // columns 8h .. 8h + 7, 4 channels each
        q[h] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + s * 64 + 32 * h)), flip);
        magnitude[h] = _mm256_abs_epi8(q[h]);
      }
#pragma GCC unroll 4
      for (int r = 0; r < P; ++r) {
        int32_t four;
        std::memcpy(&four, x[r].xq + b * kBlock + 4 * s, 4);
        const __m256i xv = _mm256_set1_epi32(four);
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
          const __m256i pairs = _mm256_maddubs_epi16(magnitude[h], _mm256_sign_epi8(xv, q[h]));  // |.| <= 32258
          sum[r][h] = _mm256_add_epi32(sum[r][h], _mm256_madd_epi16(pairs, ones));
          __asm__("" : "+x"(sum[r][h]));  // (one chain a register: GCC would otherwise spill a tree of sums)
        }
      }
    }
    w += kSteps * 64;
#pragma GCC unroll 4
    for (int r = 0; r < P; ++r) {
      const __m256 sx = _mm256_set1_ps(x[r].sx[b]);
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[r][h]), sx, acc[r][h]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < P; ++r) {
    _mm256_storeu_ps(acc_out[r], acc[r][0]);
    _mm256_storeu_ps(acc_out[r] + 8, acc[r][1]);
  }
}

// group_dots for R rows, kPass at a time (the later passes read the group from L1).
template <int R, bool FIRST = true>
inline void group_rows(const Quantized* x, int64_t blocks, const uint8_t* w, float (*acc)[kLanes]) {
  if constexpr (R > kPass) {
    group_dots<kPass, FIRST>(x, blocks, w, acc);
    group_rows<R - kPass, false>(x + kPass, blocks, w, acc + kPass);
  } else if constexpr (R > 0) {
    group_dots<R, FIRST>(x, blocks, w, acc);
  }
}

// hi[r][n] = a_n + e_n for rows [0, R) and the groups [g0, g1) of the packed weight ([G, K32/4, 16, 4] bytes
// q + 128); lo[r] = the largest a - e over those columns.
// BOUND = false (int8_linear): hi[r][n] = a_n + bias_n instead (row stride n; b1 is the float32 bias or null; b2, l1,
// sxsum and lo unused).
template <int R, bool BOUND>
void screen_groups(const Quantized* x, int64_t blocks, const uint8_t* packed, const float* scale, const float* b1,
                   const float* b2, const float* l1, const float* sxsum, int64_t g0, int64_t g1, int64_t n,
                   int64_t n_pad, float* hi, float* lo) {
  const int64_t group_bytes = blocks * kBlock * kLanes;
  const __m256i lane0 = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i lane8 = _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15);
  const __m256 minus_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 low[R];
  for (int r = 0; r < R; ++r) low[r] = minus_inf;
  for (int64_t g = g0; g < g1; ++g) {
    alignas(32) float acc[R][kLanes];
    group_rows<R>(x, blocks, packed + g * group_bytes, acc);
    const int64_t left = std::min<int64_t>(n - g * kLanes, kLanes);  // columns of this group that exist
    const __m256i valid[2] = {_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(left)), lane0),
                              _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(left)), lane8)};
    const __m256 s[2] = {_mm256_loadu_ps(scale + g * kLanes), _mm256_loadu_ps(scale + g * kLanes + 8)};
    if constexpr (!BOUND) {
      for (int h = 0; h < 2; ++h) {
        const __m256 bias = b1 ? _mm256_maskload_ps(b1 + g * kLanes + 8 * h, valid[h]) : _mm256_setzero_ps();
        for (int r = 0; r < R; ++r)
          _mm256_maskstore_ps(hi + r * n + g * kLanes + 8 * h, valid[h],
                              _mm256_fmadd_ps(_mm256_load_ps(acc[r] + 8 * h), s[h], bias));
      }
      continue;
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 e1 = _mm256_loadu_ps(b1 + g * kLanes + 8 * h), e2 = _mm256_loadu_ps(b2 + g * kLanes + 8 * h);
      for (int r = 0; r < R; ++r) {
        const __m256 a = _mm256_mul_ps(_mm256_load_ps(acc[r] + 8 * h), s[h]);
        const __m256 e = _mm256_fmadd_ps(_mm256_set1_ps(l1[r]), e1, _mm256_mul_ps(_mm256_set1_ps(sxsum[r]), e2));
        _mm256_storeu_ps(hi + r * n_pad + g * kLanes + 8 * h, _mm256_add_ps(a, e));
        // (the padding columns never set T)
        low[r] = _mm256_max_ps(low[r], _mm256_blendv_ps(minus_inf, _mm256_sub_ps(a, e), _mm256_castsi256_ps(valid[h])));
      }
    }
  }
  if constexpr (BOUND) {
    for (int r = 0; r < R; ++r) {
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, low[r]);
      for (float v : lanes) lo[r] = std::max(lo[r], v);
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
    screen_groups<R, BOUND>(x, blocks, packed, scale, b1, b2, l1, sxsum, g0, g1, n, n_pad, hi, mine);
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

// Quantizes row x [k] into xq [blocks * 32] (zero padded) and sx; returns false if x is not finite. l1 = |x|_1 and
// sxsum = sum_b sx_b, both rounded up. (The original's per-block sums of xq are not needed here: the products use
// the signed q.)
bool quantize_row(const float* x, int64_t k, int64_t blocks, int8_t* xq, float* sx, float* l1, float* sxsum) {
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
    for (int64_t i = k0; i < k0 + kBlock; ++i) {
      const float q = i < k1 && sx[b] > 0.0f ? std::nearbyint(x[i] / sx[b]) : 0.0f;
      xq[i] = static_cast<int8_t>(std::clamp(q, -127.0f, 127.0f));
    }
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
      q[r] = {xq.data() + r * blocks * kBlock, sx.data() + r * blocks};
      finite = quantize_row(xp + (r0 + r) * k, k, blocks, xq.data() + r * blocks * kBlock, sx.data() + r * blocks,
                            &l1[r], &sxsum[r]) && finite;
    }
    if (!finite) {
      for (int r = 0; r < rows; ++r) op[r0 + r] = -1;
      continue;
    }
    screen_rows<true>(rows, q, blocks, pp, sp, b1p, b2p, l1, sxsum, groups, n, n_pad, hi, lo);
    for (int r = 0; r < rows; ++r) {
      // candidates: a + e >= T, in ascending n; then the first largest E wins
      const float* h = hi + r * n_pad;
      const __m256 t = _mm256_set1_ps(lo[r]);
      candidates.clear();
      for (int64_t i = 0; i < n; i += kLanes) {
        const int low = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(h + i), t, _CMP_GE_OQ));
        const int high = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(h + i + 8), t, _CMP_GE_OQ));
        unsigned pass = static_cast<unsigned>(low) | static_cast<unsigned>(high) << 8;
        if (n - i < kLanes) pass &= (1u << (n - i)) - 1;  // (the padding columns are no tokens)
        for (; pass; pass &= pass - 1) candidates.push_back(i + __builtin_ctz(pass));
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
  for (int64_t r0 = 0; r0 < m; r0 += kRows) {
    const int rows = static_cast<int>(std::min<int64_t>(kRows, m - r0));
    Quantized q[kRows];
    float l1, sxsum;
    bool finite[kRows];
    for (int r = 0; r < rows; ++r) {
      q[r] = {xq.data() + r * blocks * kBlock, sx.data() + r * blocks};
      finite[r] = quantize_row(xp + (r0 + r) * k, k, blocks, xq.data() + r * blocks * kBlock, sx.data() + r * blocks,
                               &l1, &sxsum);
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
