// The decode-step attention's micro-kernels for CPUs with AVX2 + FMA (the operator and its arithmetic:
// common/tree_attention.h), with the AVX-512 build's per-pair arithmetic order on 8-lane vectors, so the same bits:
//   p_j = e^(score_j - m): the AVX-512 build's polynomial; 2^n built from its exponent bits;
//   sum: a 16-lane accumulator (two 8-lane halves) adds p_j for logical j = l mod 16 in order, then the fixed
//        horizontal sum of _mm512_reduce_add_ps (halves, quarters, then pairs).
// How many keys, pairs and head_dim chunks go together differs from the AVX-512 build (16 ymm registers, not 32 zmm),
// which changes no result: every score, sum and output element has its own chain of operations in the same order.

#pragma once

#include "../common/shared.h"

namespace eaglespec::attention {
namespace {
namespace avx2 {

constexpr int64_t kLanes = 8;

// Blocks of 8 keys scored together, and chunks of 8 head_dim elements weighed together, for P pairs: P x blocks
// (P x chunks) accumulators, P broadcasts and one loaded vector fit the 16 ymm registers (at most 13, no spills),
// with 8 or more independent FMA chains (2 FMA pipes of 4 cycles' latency).
constexpr int score_blocks(int pairs) { return pairs == 1 ? 8 : pairs == 2 ? 4 : pairs == 3 ? 3 : 2; }
constexpr int weigh_chunks(int pairs) { return pairs == 1 ? 8 : pairs == 2 ? 4 : pairs == 3 ? 3 : 2; }

// e^x for x <= 0 (scores minus their maximum): Cody-Waite range reduction and cephes' expf polynomial, ~1 ulp. x is
// clamped to >= -87, so n >= -126 and 2^n is a normal float: p * 2^n rounds as the AVX-512 build's scalef(p, n).
inline __m256 exp_ps(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// Lanes [0, count) set (count clamped to [0, 8]): the mask of a masked load or a blend.
inline __m256i lanes_below(int64_t count) {
  const int32_t k = static_cast<int32_t>(std::min<int64_t>(std::max<int64_t>(count, 0), kLanes));
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(k), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// 8 cache values as float32: float32 as they are, bfloat16 widened (exact).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
// The first `count` (0 < count < 8) of them, the other lanes zero, reading nothing past them (the last key of a
// cache view may end its allocation). AVX2 has no 16-bit masked load: bfloat16 loads its whole 32-bit pairs masked,
// then puts an odd last value in its lane.
struct Part {
  __m256i lanes;  // lanes [0, count)
  __m128i pairs;  // bfloat16: 32-bit pairs [0, count / 2)
  __m256i last;   // bfloat16: lane count - 1 where count is odd, else none
  int64_t count;
  explicit Part(int64_t n)
      : lanes(lanes_below(n)),
        pairs(_mm_cmpgt_epi32(_mm_set1_epi32(static_cast<int32_t>(n / 2)), _mm_setr_epi32(0, 1, 2, 3))),
        last(_mm256_cmpeq_epi32(_mm256_set1_epi32(n % 2 ? static_cast<int32_t>(n - 1) : -1),
                                _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7))),
        count(n) {}
};
inline __m256 load8(const float* p, const Part& part) { return _mm256_maskload_ps(p, part.lanes); }
inline __m256 load8(const at::BFloat16* p, const Part& part) {
  const __m128i raw = _mm_maskload_epi32(reinterpret_cast<const int*>(p), part.pairs);
  const __m256i wide = _mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16);
  const uint16_t odd = part.count % 2 ? reinterpret_cast<const uint16_t*>(p)[part.count - 1] : 0;
  const __m256i last = _mm256_set1_epi32(static_cast<int32_t>(static_cast<uint32_t>(odd) << 16));
  return _mm256_castsi256_ps(_mm256_blendv_epi8(wide, last, part.last));
}

// Raw scores (before scale) of P pairs against the keys [j0, j0 + B * 8), or against [j0, j0 + count) (count < 8,
// B = 1) if Tail: raw[p * stride + j], whole vectors stored (the scratch rows are padded; lanes past the keys are
// never read). kt: [hd, ...] transposed keys of one key/value head (row stride kt_row); qs[p]: the pair's query [hd].
template <int P, int B, bool Tail, typename T>
inline void score_block(const float* const* qs, const T* kt, int64_t kt_row, int64_t hd, int64_t j0, int64_t count,
                        float* raw, int64_t stride) {
  const Part part(count);  // (Tail only)
  __m256 acc[P][B];
#pragma GCC unroll 8
  for (int p = 0; p < P; ++p)
#pragma GCC unroll 8
    for (int b = 0; b < B; ++b) acc[p][b] = _mm256_setzero_ps();
  for (int64_t d = 0; d < hd; ++d) {
    const T* row = kt + d * kt_row + j0;
    __m256 qd[P];  // (P broadcasts, then one key vector at a time: P x B + P + 1 registers)
#pragma GCC unroll 8
    for (int p = 0; p < P; ++p) qd[p] = _mm256_set1_ps(qs[p][d]);
#pragma GCC unroll 8
    for (int b = 0; b < B; ++b) {
      const __m256 kv = Tail ? load8(row, part) : load8(row + b * kLanes);
#pragma GCC unroll 8
      for (int p = 0; p < P; ++p) acc[p][b] = _mm256_fmadd_ps(qd[p], kv, acc[p][b]);
    }
  }
#pragma GCC unroll 8
  for (int p = 0; p < P; ++p)
#pragma GCC unroll 8
    for (int b = 0; b < B; ++b) _mm256_storeu_ps(raw + p * stride + j0 + b * kLanes, acc[p][b]);
}

// Raw scores of P pairs against keys [0, total): blocks of score_blocks(P) x 8 keys, then single blocks of 8, then
// the last few keys.
template <int P, typename T>
void score_keys(const float* const* qs, const T* kt, int64_t kt_row, int64_t hd, int64_t total, float* raw,
                int64_t stride) {
  constexpr int B = score_blocks(P);
  int64_t j0 = 0;
  for (; j0 + B * kLanes <= total; j0 += B * kLanes) score_block<P, B, false>(qs, kt, kt_row, hd, j0, 0, raw, stride);
  for (; j0 + kLanes <= total; j0 += kLanes) score_block<P, 1, false>(qs, kt, kt_row, hd, j0, 0, raw, stride);
  if (j0 < total) score_block<P, 1, true>(qs, kt, kt_row, hd, j0, total - j0, raw, stride);
}

// Softmax of one pair's scores in logical order, in place: scores[0 .. count) -> p_j; returns 1 / sum. The sum is
// the AVX-512 build's: a 16-lane accumulator (here lo: lanes 0-7, hi: lanes 8-15) over keys j = l mod 16, then
// _mm512_reduce_add_ps's order (GCC's: hi + lo, upper + lower 4, lanes {0,1} + {2,3}, lane 0 + lane 1).
// scores has room for 16 floats past count: whole vectors are loaded and stored (masked stores are slow on AMD's
// cores), and the lanes past count are left out of the max and the sum.
float softmax(float* scores, int64_t count, float scale) {
  const __m256 scale_v = _mm256_set1_ps(scale), lowest = _mm256_set1_ps(-INFINITY);
  __m256 best = lowest;
  for (int64_t j = 0; j < count; j += kLanes) {
    const __m256 s = _mm256_mul_ps(_mm256_loadu_ps(scores + j), scale_v);
    _mm256_storeu_ps(scores + j, s);
    best = _mm256_max_ps(best, _mm256_blendv_ps(lowest, s, _mm256_castsi256_ps(lanes_below(count - j))));
  }
  __m128 b4 = _mm_max_ps(_mm256_extractf128_ps(best, 1), _mm256_castps256_ps128(best));
  b4 = _mm_max_ps(b4, _mm_movehl_ps(b4, b4));
  b4 = _mm_max_ss(b4, _mm_movehdup_ps(b4));
  const __m256 top = _mm256_set1_ps(_mm_cvtss_f32(b4));
  __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();  // lanes 0-7 and 8-15 of the 16-lane accumulator
  for (int64_t j = 0; j < count; j += 2 * kLanes) {  // (lanes past count: p = 0 added, no change)
    const __m256 m_lo = _mm256_castsi256_ps(lanes_below(count - j));
    const __m256 m_hi = _mm256_castsi256_ps(lanes_below(count - j - kLanes));
    const __m256 p_lo = _mm256_and_ps(exp_ps(_mm256_sub_ps(_mm256_loadu_ps(scores + j), top)), m_lo);
    const __m256 p_hi = _mm256_and_ps(exp_ps(_mm256_sub_ps(_mm256_loadu_ps(scores + j + kLanes), top)), m_hi);
    _mm256_storeu_ps(scores + j, p_lo);
    _mm256_storeu_ps(scores + j + kLanes, p_hi);
    lo = _mm256_add_ps(lo, p_lo);
    hi = _mm256_add_ps(hi, p_hi);
  }
  const __m256 t3 = _mm256_add_ps(hi, lo);
  const __m128 t6 = _mm_add_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
  const __m128 t8 = _mm_add_ps(t6, _mm_movehl_ps(t6, t6));  // lanes 0, 1: t6[0] + t6[2], t6[1] + t6[3]
  return 1.0f / _mm_cvtss_f32(_mm_add_ss(t8, _mm_movehdup_ps(t8)));
}

// One pass of weigh_values over the head_dim chunks [i0, i0 + C) (8 elements each).
template <int P, int C, typename T>
void weigh_pass(const float* const* probs, const T* v, int64_t v_row, int64_t i0, int64_t c,
                const int64_t* const* path, const int64_t* lens, const float* inv, float* const* outs) {
  __m256 acc[P][C];
#pragma GCC unroll 8
  for (int p = 0; p < P; ++p)
#pragma GCC unroll 8
    for (int i = 0; i < C; ++i) acc[p][i] = _mm256_setzero_ps();
  for (int64_t j = 0; j < c; ++j) {
    const T* row = v + j * v_row + i0 * kLanes;
    __m256 pj[P];  // (P broadcasts, then one value vector at a time: P x C + P + 1 registers)
#pragma GCC unroll 8
    for (int p = 0; p < P; ++p) pj[p] = _mm256_set1_ps(probs[p][j]);
#pragma GCC unroll 8
    for (int i = 0; i < C; ++i) {
      const __m256 vv = load8(row + i * kLanes);
#pragma GCC unroll 8
      for (int p = 0; p < P; ++p) acc[p][i] = _mm256_fmadd_ps(pj[p], vv, acc[p][i]);
    }
  }
#pragma GCC unroll 4
  for (int p = 0; p < P; ++p) {
    for (int64_t k = 0; k < lens[p]; ++k) {
      const T* row = v + (c + path[p][k]) * v_row + i0 * kLanes;
      const __m256 pj = _mm256_set1_ps(probs[p][c + k]);
#pragma GCC unroll 8
      for (int i = 0; i < C; ++i) acc[p][i] = _mm256_fmadd_ps(pj, load8(row + i * kLanes), acc[p][i]);
    }
    const __m256 scale = _mm256_set1_ps(inv[p]);
#pragma GCC unroll 8
    for (int i = 0; i < C; ++i) _mm256_storeu_ps(outs[p] + (i0 + i) * kLanes, _mm256_mul_ps(acc[p][i], scale));
  }
}

// The last pass, of rest < C chunks.
template <int P, int C, typename T>
void weigh_rest(int64_t rest, const float* const* probs, const T* v, int64_t v_row, int64_t i0, int64_t c,
                const int64_t* const* path, const int64_t* lens, const float* inv, float* const* outs) {
  if constexpr (C > 1) {
    if (rest == C - 1) return weigh_pass<P, C - 1>(probs, v, v_row, i0, c, path, lens, inv, outs);
    weigh_rest<P, C - 1>(rest, probs, v, v_row, i0, c, path, lens, inv, outs);
  }
}

// out_p[d] = inv_p * sum over logical keys j in order of p_j v_j[d] for P pairs: the c shared prefix rows (all
// pairs read each value row once per pass), then each pair's own path: step rows path[p][0 .. lens[p]), cache rows
// c + s.
template <int P, typename T>
void weigh_values(const float* const* probs, const T* v, int64_t v_row, int64_t chunks, int64_t c,
                  const int64_t* const* path, const int64_t* lens, const float* inv, float* const* outs) {
  constexpr int C = weigh_chunks(P);
  int64_t i0 = 0;
  for (; i0 + C <= chunks; i0 += C) weigh_pass<P, C>(probs, v, v_row, i0, c, path, lens, inv, outs);
  if (i0 < chunks) weigh_rest<P, C>(chunks - i0, probs, v, v_row, i0, c, path, lens, inv, outs);
}

}  // namespace avx2

namespace isa = avx2;

}  // namespace
}  // namespace eaglespec::attention
