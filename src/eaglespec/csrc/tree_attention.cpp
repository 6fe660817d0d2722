// Attention of a decode step's few query rows over the KV cache and their draft-tree ancestors (AVX-512F; float32
// arithmetic over a float32 or bfloat16 cache).
//
// A decode step (plain decoding: 1 row; a verify pass: the tree's 2-64 rows) attends over a few hundred cached keys
// per layer. Each query (head, row) pair sees exactly the keys of its path, in logical order: the cached prefix
// [0, c), then the step rows of its path (its ancestors and itself, ascending), which is the very sequence of keys
// a one-token step at that position sees, at the same logical indices. Every sum is taken in a fixed order over
// those logical indices, so a pair's output does not depend on the other rows of the call, on n, or on where its
// ancestors sit in the step: a verified tree row gets the same bits as the one-token step that would compute it.
//
// Keys come transposed ([Hkv, hd, keys]: element d of 16 consecutive keys is one vector), so 16 keys' scores are
// 16 lanes of plain FMAs over d, with no horizontal sums; up to 4 pairs of a key/value head share each key load.
// The arithmetic, per pair:
//   score_j = (sequential FMAs over d = 0 .. hd-1, from 0) * scale, for every key j;
//   m = max_j score_j;  p_j = e^(score_j - m);
//   sum = lane l of a 16-lane vector adds p_j for logical j = l mod 16 in order, then one fixed horizontal sum;
//   out[d] = (sequential FMAs over logical j of p_j v_j[d], from 0) * (1 / sum).
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

constexpr int64_t kLanes = 16;
constexpr int64_t kMaxChunks = 16;  // head_dim up to 256
constexpr int64_t kMaxPairs = 4;    // (head, row) pairs sharing each key and value load
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
  const int64_t total = c + n, stride = total + kLanes;
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
  TORCH_CHECK(hd % kLanes == 0 && hd <= kLanes * kMaxChunks,
              "tree_attention: head_dim must be a multiple of 16, <= 256");
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
