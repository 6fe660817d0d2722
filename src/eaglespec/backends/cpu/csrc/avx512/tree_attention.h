// The decode-step attention's micro-kernels for CPUs with AVX-512F (the operator and its arithmetic:
// common/tree_attention.h): 16 keys' scores are the 16 lanes of a vector, and 4 blocks of 16 keys are scored
// together (kMaxPairs x kBlocks accumulators).

#pragma once

#include "../common/shared.h"

namespace eaglespec::attention {
namespace {
namespace avx512 {

constexpr int64_t kLanes = 16;
constexpr int64_t kBlocks = 4;      // blocks of 16 keys scored together (kMaxPairs x kBlocks accumulators)

// e^x for x <= 0 (scores minus their maximum): Cody-Waite range reduction and cephes' expf polynomial, ~1 ulp.
inline __m512 exp_ps(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// Up to 16 cache values as float32 (masked lanes zero): float32 as they are, bfloat16 widened (exact).
inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const at::BFloat16* p, __mmask16 m) {
  const __m256i raw = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __mmask16 lanes_below(int64_t count) {  // count >= 0
  return count >= kLanes ? (__mmask16)0xFFFF : (__mmask16)((1u << count) - 1);
}

// Raw scores (before scale) of P pairs against keys [0, total): raw[p * stride + j]. kt: [hd, ...] transposed keys
// of one key/value head (row stride kt_row); qs[p]: the pair's query [hd].
template <int P, typename T>
void score_keys(const float* const* qs, const T* kt, int64_t kt_row, int64_t hd, int64_t total, float* raw,
                int64_t stride) {
  for (int64_t j0 = 0; j0 < total; j0 += kBlocks * kLanes) {
    __mmask16 masks[kBlocks];  // the keys of each block that exist
#pragma GCC unroll 4
    for (int b = 0; b < kBlocks; ++b) masks[b] = lanes_below(std::max<int64_t>(0, total - j0 - b * kLanes));
    __m512 acc[P][kBlocks];
#pragma GCC unroll 4
    for (int p = 0; p < P; ++p)
#pragma GCC unroll 4
      for (int b = 0; b < kBlocks; ++b) acc[p][b] = _mm512_setzero_ps();
    for (int64_t d = 0; d < hd; ++d) {
      const T* row = kt + d * kt_row + j0;
      __m512 kv[kBlocks];
#pragma GCC unroll 4
      for (int b = 0; b < kBlocks; ++b) kv[b] = load16(row + b * kLanes, masks[b]);
#pragma GCC unroll 4
      for (int p = 0; p < P; ++p) {
        const __m512 qd = _mm512_set1_ps(qs[p][d]);
#pragma GCC unroll 4
        for (int b = 0; b < kBlocks; ++b) acc[p][b] = _mm512_fmadd_ps(qd, kv[b], acc[p][b]);
      }
    }
#pragma GCC unroll 4
    for (int p = 0; p < P; ++p)
#pragma GCC unroll 4
      for (int b = 0; b < kBlocks; ++b)  // (a zero mask stores nothing: blocks past the end)
        _mm512_mask_storeu_ps(raw + p * stride + j0 + b * kLanes, masks[b], acc[p][b]);
  }
}

// Softmax of one pair's scores in logical order, in place: scores[0 .. count) -> p_j; returns 1 / sum.
float softmax(float* scores, int64_t count, float scale) {
  const __m512 scale_v = _mm512_set1_ps(scale);
  __m512 best = _mm512_set1_ps(-INFINITY);
  for (int64_t j = 0; j < count; j += kLanes) {
    const __mmask16 m = lanes_below(count - j);
    const __m512 s = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, scores + j), scale_v);
    _mm512_mask_storeu_ps(scores + j, m, s);
    best = _mm512_mask_max_ps(best, m, best, s);
  }
  const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(best));
  __m512 sum = _mm512_setzero_ps();  // lane l sums the keys j = l mod 16, then one fixed reduction
  for (int64_t j = 0; j < count; j += kLanes) {
    const __mmask16 m = lanes_below(count - j);
    const __m512 p = _mm512_maskz_mov_ps(m, exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, scores + j), top)));
    _mm512_mask_storeu_ps(scores + j, m, p);
    sum = _mm512_add_ps(sum, p);
  }
  return 1.0f / _mm512_reduce_add_ps(sum);
}

// out_p[d] = inv_p * sum over logical keys j in order of p_j v_j[d] for P pairs: the c shared prefix rows (all
// pairs read each value row once), then each pair's own path: step rows path[p][0 .. lens[p]), cache rows c + s.
template <int P, typename T>
void weigh_values(const float* const* probs, const T* v, int64_t v_row, int64_t chunks, int64_t c,
                  const int64_t* const* path, const int64_t* lens, const float* inv, float* const* outs) {
  for (int64_t i0 = 0; i0 < chunks; i0 += 4) {
    __mmask16 use[4];  // the 4 chunks of this pass that exist (head_dim 16 or 32: fewer)
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) use[i] = i0 + i < chunks ? (__mmask16)0xFFFF : (__mmask16)0;
    __m512 acc[P][4];
#pragma GCC unroll 4
    for (int p = 0; p < P; ++p)
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) acc[p][i] = _mm512_setzero_ps();
    for (int64_t j = 0; j < c; ++j) {
      const T* row = v + j * v_row + i0 * kLanes;
      __m512 vv[4];
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) vv[i] = load16(row + i * kLanes, use[i]);
#pragma GCC unroll 4
      for (int p = 0; p < P; ++p) {
        const __m512 pj = _mm512_set1_ps(probs[p][j]);
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i) acc[p][i] = _mm512_fmadd_ps(pj, vv[i], acc[p][i]);
      }
    }
#pragma GCC unroll 4
    for (int p = 0; p < P; ++p) {
      for (int64_t k = 0; k < lens[p]; ++k) {
        const T* row = v + (c + path[p][k]) * v_row + i0 * kLanes;
        const __m512 pj = _mm512_set1_ps(probs[p][c + k]);
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i) acc[p][i] = _mm512_fmadd_ps(pj, load16(row + i * kLanes, use[i]), acc[p][i]);
      }
      const __m512 scale = _mm512_set1_ps(inv[p]);
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i)
        _mm512_mask_storeu_ps(outs[p] + (i0 + i) * kLanes, use[i], _mm512_mul_ps(acc[p][i], scale));
    }
  }
}

}  // namespace avx512

namespace isa = avx512;

}  // namespace
}  // namespace eaglespec::attention
