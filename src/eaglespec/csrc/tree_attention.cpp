// Attention of a decode step's few query rows over the KV cache and their draft-tree ancestors (AVX-512F; float32
// arithmetic over a float32 or bfloat16 cache).
//
// A decode step (plain decoding: 1 row; a verify pass: the tree's 2-16 rows) attends over a few hundred cached keys
// per layer. torch's CPU flash attention pays for its generality there: with a mask, 4 rows cost 2x one row over
// 400 keys (30 layers, 2 cores: 1.16 ms for 1 row, 2.37 ms for 4; this kernel 0.68 and 1.52 ms;
// benchmarks/scripts/attention_cost.py). This kernel gives each (query head, row) pair its own pass over exactly
// the keys it may see:
//   the cached prefix [0, c) in order, then the step rows of its path (its ancestors and itself, ascending),
// which is the very sequence of keys a one-token step at that position attends over, laid out in the same order.
// Every sum (q.k per key, the softmax denominator, the weighted sum of values) is taken in that logical order with
// a fixed vector layout, so a row's output does not depend on the other rows of the call, on n, or on where its
// ancestors sit in the step: a verified tree row gets the same bits as the one-token step that would compute it.
// Heads that share a key/value head (GQA) run one after another on one thread, so its keys stay in L1/L2.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kLanes = 16;
constexpr int64_t kMaxChunks = 16;  // head_dim up to 256

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

// 16 cache values as float32: float32 as they are, bfloat16 widened (exact).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// One (query head, row) pair: out[hd] = softmax(q . K[keys] * scale) V[keys], keys = rows[0..count) of the cache.
// rows: physical cache rows in logical order; scores: scratch of at least count floats. T: the cache's dtype.
template <typename T>
void attend_one(const float* q, const T* k, const T* v, int64_t k_row, int64_t v_row,
                const int64_t* rows, int64_t count, int64_t chunks, float scale, float* scores, float* out) {
  __m512 qv[kMaxChunks];
  for (int64_t i = 0; i < chunks; ++i) qv[i] = _mm512_loadu_ps(q + i * kLanes);
  __m512 best = _mm512_set1_ps(-INFINITY);
  for (int64_t j = 0; j < count; ++j) {  // scores, in key order
    const T* kp = k + rows[j] * k_row;
    __m512 acc = _mm512_mul_ps(qv[0], load16(kp));
    for (int64_t i = 1; i < chunks; ++i) acc = _mm512_fmadd_ps(qv[i], load16(kp + i * kLanes), acc);
    scores[j] = _mm512_reduce_add_ps(acc) * scale;
  }
  int64_t j = 0;
  for (; j + kLanes <= count; j += kLanes) best = _mm512_max_ps(best, _mm512_loadu_ps(scores + j));
  const __mmask16 tail = (__mmask16)((1u << (count - j)) - 1);
  best = _mm512_mask_max_ps(best, tail, best, _mm512_maskz_loadu_ps(tail, scores + j));
  const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(best));
  __m512 sum = _mm512_setzero_ps();  // lane l sums the keys j = l mod 16, then one fixed reduction
  for (j = 0; j + kLanes <= count; j += kLanes) {
    const __m512 p = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(scores + j), top));
    _mm512_storeu_ps(scores + j, p);
    sum = _mm512_add_ps(sum, p);
  }
  if (j < count) {
    const __m512 p = _mm512_maskz_mov_ps(tail, exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, scores + j), top)));
    _mm512_mask_storeu_ps(scores + j, tail, p);
    sum = _mm512_add_ps(sum, p);
  }
  const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum));
  __m512 acc[kMaxChunks];
  for (int64_t i = 0; i < chunks; ++i) acc[i] = _mm512_setzero_ps();
  for (j = 0; j < count; ++j) {  // weighted values, in key order
    const T* vp = v + rows[j] * v_row;
    const __m512 p = _mm512_set1_ps(scores[j]);
    for (int64_t i = 0; i < chunks; ++i) acc[i] = _mm512_fmadd_ps(p, load16(vp + i * kLanes), acc[i]);
  }
  for (int64_t i = 0; i < chunks; ++i) _mm512_storeu_ps(out + i * kLanes, _mm512_mul_ps(acc[i], inv));
}

// q [H, n, hd] float32; keys, values [Hkv, c + n, hd] float32 or bfloat16 (this step's rows last); step_mask [n, n]
// bool (row r may see step row s) or none (causal) -> [H, n, hd] float32.
at::Tensor tree_attention(const at::Tensor& q_in, const at::Tensor& keys, const at::Tensor& values,
                          const std::optional<at::Tensor>& step_mask) {
  TORCH_CHECK(q_in.dim() == 3 && keys.dim() == 3 && values.dim() == 3, "tree_attention: q, keys, values must be 3-d");
  TORCH_CHECK(q_in.scalar_type() == at::kFloat && values.scalar_type() == keys.scalar_type() &&
                  (keys.scalar_type() == at::kFloat || keys.scalar_type() == at::kBFloat16),
              "tree_attention: float32 queries, float32 or bfloat16 keys and values");
  const int64_t heads = q_in.size(0), n = q_in.size(1), hd = q_in.size(2), kv_heads = keys.size(0);
  const int64_t total = keys.size(1), c = total - n;
  TORCH_CHECK(hd % kLanes == 0 && hd <= kLanes * kMaxChunks,
              "tree_attention: head_dim must be a multiple of 16, <= 256");
  TORCH_CHECK(keys.size(2) == hd && values.sizes() == keys.sizes() && c >= 0 && heads % kv_heads == 0,
              "tree_attention: keys/values must be [", kv_heads, ", c + ", n, ", ", hd, "]");
  TORCH_CHECK(keys.stride(2) == 1 && values.stride(2) == 1, "tree_attention: keys/values need a contiguous last dim");
  at::Tensor mask;
  if (step_mask.has_value()) {
    mask = step_mask->to(at::kBool).contiguous();
    TORCH_CHECK(mask.dim() == 2 && mask.size(0) == n && mask.size(1) == n, "tree_attention: step_mask must be [n, n]");
  }
  const at::Tensor q = q_in.contiguous();
  at::Tensor out = at::empty({heads, n, hd}, q.options());
  // Per row: the physical cache rows it sees, in logical order (prefix, then its path of step rows).
  std::vector<std::vector<int64_t>> rows(n);
  const bool* mp = mask.defined() ? mask.data_ptr<bool>() : nullptr;
  for (int64_t r = 0; r < n; ++r) {
    rows[r].reserve(c + n);
    for (int64_t j = 0; j < c; ++j) rows[r].push_back(j);
    for (int64_t s = 0; s < n; ++s)
      if (mp ? mp[r * n + s] : s <= r) rows[r].push_back(c + s);
  }
  const int64_t group = heads / kv_heads, chunks = hd / kLanes;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  auto run = [&](const auto* kp, const auto* vp) {
    // units ordered (kv head, head in its group, row): a thread's contiguous range shares key/value heads
    at::parallel_for(0, heads * n, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores(c + n);
      for (int64_t u = begin; u < end; ++u) {
        const int64_t h = u / n, r = u % n, g = h / group;
        attend_one(qp + (h * n + r) * hd, kp + g * keys.stride(0), vp + g * values.stride(0), keys.stride(1),
                   values.stride(1), rows[r].data(), static_cast<int64_t>(rows[r].size()), chunks, scale,
                   scores.data(), op + (h * n + r) * hd);
      }
    });
  };
  if (keys.scalar_type() == at::kFloat)
    run(keys.data_ptr<float>(), values.data_ptr<float>());
  else
    run(keys.data_ptr<at::BFloat16>(), values.data_ptr<at::BFloat16>());
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(eaglespec, m) {
  m.def("tree_attention(Tensor q, Tensor keys, Tensor values, Tensor? step_mask) -> Tensor");
}

TORCH_LIBRARY_IMPL(eaglespec, CPU, m) {
  m.impl("tree_attention", tree_attention);
}
