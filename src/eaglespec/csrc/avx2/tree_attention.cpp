// Attention of a decode step's few query rows over the KV cache and their draft-tree ancestors: the AVX2 + FMA build
// of csrc/tree_attention.cpp (float32 arithmetic over a float32 or bfloat16 cache), with the same per-pair arithmetic
// order, so the same bits as the AVX-512 build.
//
// A decode step (plain decoding: 1 row; a verify pass: the tree's 2-64 rows) attends over a few hundred cached keys
// per layer. Each query (head, row) pair sees exactly the keys of its path, in logical order: the cached prefix
// [0, c), then the step rows of its path (its ancestors and itself, ascending), which is the very sequence of keys
// a one-token step at that position sees, at the same logical indices. Every sum is taken in a fixed order over
// those logical indices, so a pair's output does not depend on the other rows of the call, on n, or on where its
// ancestors sit in the step: a verified tree row gets the same bits as the one-token step that would compute it.
//
// Keys come transposed ([Hkv, hd, keys]: element d of 8 consecutive keys is one vector), so 8 keys' scores are 8
// lanes of plain FMAs over d, with no horizontal sums; up to 4 pairs of a key/value head share each key load.
// The arithmetic, per pair (csrc/tree_attention.cpp's, on 8-lane vectors):
//   score_j = (sequential FMAs over d = 0 .. hd-1, from 0) * scale, for every key j;
//   m = max_j score_j;  p_j = e^(score_j - m) (the AVX-512 build's polynomial; 2^n built from its exponent bits);
//   sum = lane l of a 16-lane accumulator (two 8-lane halves) adds p_j for logical j = l mod 16 in order, then the
//         fixed horizontal sum of _mm512_reduce_add_ps (halves, quarters, then pairs);
//   out[d] = (sequential FMAs over logical j of p_j v_j[d], from 0) * (1 / sum).
// How many keys, pairs and head_dim chunks go together differs from the AVX-512 build (16 ymm registers, not 32 zmm),
// which changes no result: every score, sum and output element has its own chain of operations in the order above.
// 30 layers of SmolLM2-135M's shapes, 2 cores: benchmarks/scripts/attention_cost.py.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kLanes = 8;
constexpr int64_t kHeadDimStep = 16;  // head_dim: a multiple of 16 (the AVX-512 build's vector), <= 256
constexpr int64_t kMaxHeadDim = 256;
constexpr int64_t kMaxPairs = 4;  // (head, row) pairs sharing each key and value load

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

// The step's queries [H, n, hd]: any head and row strides (the graph's RoPE output is often a view of [n, H, hd]).
struct Queries {
  const float* data;
  int64_t head_stride, row_stride;
  const float* at(int64_t h, int64_t r) const { return data + h * head_stride + r * row_stride; }
};

// One task: `count` pairs (h, r) of one key/value head.
template <int P, typename T>
void attend_pairs(const int64_t* hs, const int64_t* rs, const Queries& q, int64_t n, int64_t hd, const T* kt,
                  int64_t kt_row, const T* v, int64_t v_row, int64_t c, const std::vector<std::vector<int64_t>>& paths,
                  float scale, std::vector<float>& scratch, float* out) {
  const int64_t total = c + n, stride = total + 2 * kLanes;  // (padding: whole vectors stored past the keys)
  scratch.resize(P * stride * 2);
  float* raw = scratch.data();            // [P][stride]: scores of every column
  float* logical = raw + P * stride;      // [P][stride]: the pair's visible keys in logical order
  const float* qs[P];
  float* outs[P];
  const float* probs[P];
  const int64_t* path[P];
  int64_t lens[P];
  float inv[P];
  for (int p = 0; p < P; ++p) {
    qs[p] = q.at(hs[p], rs[p]);
    outs[p] = out + (hs[p] * n + rs[p]) * hd;
  }
  score_keys<P>(qs, kt, kt_row, hd, total, raw, stride);
  for (int p = 0; p < P; ++p) {
    const std::vector<int64_t>& steps = paths[rs[p]];  // visible step rows, ascending
    float* dst = logical + p * stride;
    std::copy(raw + p * stride, raw + p * stride + c, dst);
    lens[p] = static_cast<int64_t>(steps.size());
    path[p] = steps.data();
    for (int64_t k = 0; k < lens[p]; ++k) dst[c + k] = raw[p * stride + c + steps[k]];
    inv[p] = softmax(dst, c + lens[p], scale);
    probs[p] = dst;
  }
  weigh_values<P>(probs, v, v_row, hd / kLanes, c, path, lens, inv, outs);
}

template <typename T>
void attend_task(int64_t count, const int64_t* hs, const int64_t* rs, const Queries& q, int64_t n, int64_t hd,
                 const T* kt, int64_t kt_row, const T* v, int64_t v_row, int64_t c,
                 const std::vector<std::vector<int64_t>>& paths, float scale, std::vector<float>& scratch, float* out) {
  switch (count) {
    case 1: return attend_pairs<1>(hs, rs, q, n, hd, kt, kt_row, v, v_row, c, paths, scale, scratch, out);
    case 2: return attend_pairs<2>(hs, rs, q, n, hd, kt, kt_row, v, v_row, c, paths, scale, scratch, out);
    case 3: return attend_pairs<3>(hs, rs, q, n, hd, kt, kt_row, v, v_row, c, paths, scale, scratch, out);
    case 4: return attend_pairs<4>(hs, rs, q, n, hd, kt, kt_row, v, v_row, c, paths, scale, scratch, out);
    default: TORCH_CHECK(false, "tree_attention: task of ", count, " pairs");
  }
}

// q [H, n, hd] float32; keys_t [Hkv, hd, c + n] (transposed: keys along the last dim) and values [Hkv, c + n, hd],
// float32 or bfloat16, this step's rows last; step_mask [n, n] bool (row r may see step row s) or none (causal)
// -> [H, n, hd] float32.
at::Tensor tree_attention(const at::Tensor& q_in, const at::Tensor& keys_t, const at::Tensor& values,
                          const std::optional<at::Tensor>& step_mask) {
  TORCH_CHECK(q_in.dim() == 3 && keys_t.dim() == 3 && values.dim() == 3,
              "tree_attention: q, keys_t, values must be 3-d");
  TORCH_CHECK(q_in.scalar_type() == at::kFloat && values.scalar_type() == keys_t.scalar_type() &&
                  (keys_t.scalar_type() == at::kFloat || keys_t.scalar_type() == at::kBFloat16),
              "tree_attention: float32 queries, float32 or bfloat16 keys and values");
  const int64_t heads = q_in.size(0), n = q_in.size(1), hd = q_in.size(2), kv_heads = keys_t.size(0);
  const int64_t total = values.size(1), c = total - n;
  TORCH_CHECK(hd % kHeadDimStep == 0 && hd <= kMaxHeadDim, "tree_attention: head_dim must be a multiple of 16, <= 256");
  TORCH_CHECK(values.size(0) == kv_heads && values.size(2) == hd && keys_t.size(1) == hd && keys_t.size(2) == total &&
                  c >= 0 && heads % kv_heads == 0,
              "tree_attention: keys_t must be [", kv_heads, ", ", hd, ", c + ", n, "] and values [", kv_heads,
              ", c + ", n, ", ", hd, "]");
  TORCH_CHECK(keys_t.stride(2) == 1 && values.stride(2) == 1, "tree_attention: keys/values need a contiguous last dim");
  at::Tensor mask;
  if (step_mask.has_value()) {
    mask = step_mask->to(at::kBool).contiguous();
    TORCH_CHECK(mask.dim() == 2 && mask.size(0) == n && mask.size(1) == n, "tree_attention: step_mask must be [n, n]");
  }
  const at::Tensor q = q_in.stride(2) == 1 ? q_in : q_in.contiguous();  // (a view of [n, H, hd]: read in place)
  at::Tensor out = at::empty({heads, n, hd}, q.options());
  if (heads == 0 || n == 0) return out;
  // Per row: its visible step rows, ascending (its path).
  std::vector<std::vector<int64_t>> paths(n);
  const bool* mp = mask.defined() ? mask.data_ptr<bool>() : nullptr;
  for (int64_t r = 0; r < n; ++r)
    for (int64_t s = 0; s < n; ++s)
      if (mp ? mp[r * n + s] : s <= r) paths[r].push_back(s);
  // Tasks: the (head, row) pairs of each key/value head in near-equal groups of at most 4, and at least two tasks
  // per thread where there are pairs enough (one row: 3 pairs of a key/value head -> 2 tasks).
  const int64_t group = heads / kv_heads, per_head = group * n;
  const int64_t wanted = (2 * at::get_num_threads() + kv_heads - 1) / kv_heads;
  const int64_t tasks = std::min(per_head, std::max((per_head + kMaxPairs - 1) / kMaxPairs, wanted));
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const Queries qp{q.data_ptr<float>(), q.stride(0), q.stride(1)};
  float* op = out.data_ptr<float>();
  auto run = [&](const auto* kp, const auto* vp) {
    at::parallel_for(0, kv_heads * tasks, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scratch;
      for (int64_t u = begin; u < end; ++u) {
        const int64_t g = u / tasks, t = u % tasks;
        const int64_t first = t * per_head / tasks, last = (t + 1) * per_head / tasks;
        int64_t hs[kMaxPairs], rs[kMaxPairs];
        for (int64_t i = first; i < last; ++i) {  // pair i of the head: head-in-group i / n, row i % n
          hs[i - first] = g * group + i / n;
          rs[i - first] = i % n;
        }
        attend_task(last - first, hs, rs, qp, n, hd, kp + g * keys_t.stride(0), keys_t.stride(1),
                    vp + g * values.stride(0), values.stride(1), c, paths, scale, scratch, op);
      }
    });
  };
  if (keys_t.scalar_type() == at::kFloat)
    run(keys_t.data_ptr<float>(), values.data_ptr<float>());
  else
    run(keys_t.data_ptr<at::BFloat16>(), values.data_ptr<at::BFloat16>());
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(eaglespec, CPU, m) {
  m.impl("tree_attention", tree_attention);
}
