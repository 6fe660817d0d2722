// Attention of a decode step's few query rows over the KV cache and their draft-tree ancestors (float32 arithmetic
// over a float32 or bfloat16 cache).
//
// A decode step (plain decoding: 1 row; a verify pass: the tree's 2-64 rows) attends over a few hundred cached keys
// per layer. Each query (head, row) pair sees exactly the keys of its path, in logical order: the cached prefix
// [0, c), then the step rows of its path (its ancestors and itself, ascending), which is the very sequence of keys
// a one-token step at that position sees, at the same logical indices. Every sum is taken in a fixed order over
// those logical indices, so a pair's output does not depend on the other rows of the call, on n, or on where its
// ancestors sit in the step: a verified tree row gets the same bits as the one-token step that would compute it.
//
// Keys come transposed ([Hkv, hd, keys]: element d of consecutive keys is one vector), so a vector of keys' scores
// is plain FMAs over d, with no horizontal sums; up to 4 pairs of a key/value head share each key load.
// The arithmetic, per pair, the same in both builds (avx512/tree_attention.h, avx2/tree_attention.h):
//   score_j = (sequential FMAs over d = 0 .. hd-1, from 0) * scale, for every key j;
//   m = max_j score_j;  p_j = e^(score_j - m);
//   sum = lane l of a 16-lane vector adds p_j for logical j = l mod 16 in order, then one fixed horizontal sum;
//   out[d] = (sequential FMAs over logical j of p_j v_j[d], from 0) * (1 / sum).
// 30 layers of SmolLM2-135M's shapes, 2 cores: benchmarks/microbench/attention_cost.py.
//
// The micro-kernels (isa::, included before this): kLanes (float32 lanes of a vector), score_keys<P> (raw scores of P
// pairs against every key), softmax (one pair's scores in logical order -> p_j, returns 1 / sum) and weigh_values<P>
// (the outputs of P pairs from their p_j).

#pragma once

#include "shared.h"

namespace eaglespec::attention {
namespace {

constexpr int64_t kHeadDimStep = 16;  // head_dim: a multiple of 16 (the AVX-512 build's vector), <= 256
constexpr int64_t kMaxHeadDim = 256;
constexpr int64_t kMaxPairs = 4;      // (head, row) pairs sharing each key and value load
constexpr int64_t kScorePad = 16;     // room past a pair's scores: whole vectors (AVX2: two) are stored and loaded

// The step's queries [H, n, hd]: any head and row strides (the graph's RoPE output is often a view of [n, H, hd]).
struct Queries {
  const float* data;
  int64_t head_stride, row_stride;
  const float* at(int64_t h, int64_t r) const { return data + h * head_stride + r * row_stride; }
};

// Where the outputs of the step's (head, row) pairs go: [H, n, hd] of one sequence, or its rows of a batch's
// [H, N, hd].
struct Outputs {
  float* data;
  int64_t head_stride, row_stride;
  float* at(int64_t h, int64_t r) const { return data + h * head_stride + r * row_stride; }
};

// One task: `count` pairs (h, r) of one key/value head.
template <int P, typename T>
void attend_pairs(const int64_t* hs, const int64_t* rs, const Queries& q, int64_t n, int64_t hd, const T* kt,
                  int64_t kt_row, const T* v, int64_t v_row, int64_t c, const std::vector<std::vector<int64_t>>& paths,
                  float scale, std::vector<float>& scratch, const Outputs& out) {
  const int64_t total = c + n, stride = total + kScorePad;
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
    outs[p] = out.at(hs[p], rs[p]);
  }
  isa::score_keys<P>(qs, kt, kt_row, hd, total, raw, stride);
  for (int p = 0; p < P; ++p) {
    const std::vector<int64_t>& steps = paths[rs[p]];  // visible step rows, ascending
    float* dst = logical + p * stride;
    std::copy(raw + p * stride, raw + p * stride + c, dst);
    lens[p] = static_cast<int64_t>(steps.size());
    path[p] = steps.data();
    for (int64_t k = 0; k < lens[p]; ++k) dst[c + k] = raw[p * stride + c + steps[k]];
    inv[p] = isa::softmax(dst, c + lens[p], scale);
    probs[p] = dst;
  }
  isa::weigh_values<P>(probs, v, v_row, hd / isa::kLanes, c, path, lens, inv, outs);
}

template <typename T>
void attend_task(int64_t count, const int64_t* hs, const int64_t* rs, const Queries& q, int64_t n, int64_t hd,
                 const T* kt, int64_t kt_row, const T* v, int64_t v_row, int64_t c,
                 const std::vector<std::vector<int64_t>>& paths, float scale, std::vector<float>& scratch,
                 const Outputs& out) {
  TORCH_CHECK(count >= 1 && count <= 4, "tree_attention: task of ", count, " pairs");
  with_rows<4>(count, [&](auto r) {
    attend_pairs<decltype(r)::value>(hs, rs, q, n, hd, kt, kt_row, v, v_row, c, paths, scale, scratch, out);
  });
}

// Per row of a step of n rows: its visible step rows, ascending (its path); mask [n, n] bool or undefined (causal).
std::vector<std::vector<int64_t>> step_paths(const at::Tensor& mask, int64_t n) {
  std::vector<std::vector<int64_t>> paths(n);
  const bool* mp = mask.defined() ? mask.data_ptr<bool>() : nullptr;
  for (int64_t r = 0; r < n; ++r)
    for (int64_t s = 0; s < n; ++s)
      if (mp ? mp[r * n + s] : s <= r) paths[r].push_back(s);
  return paths;
}

// Tasks per key/value head of a step: its (head, row) pairs in near-equal groups of at most 4, and at least two tasks
// per thread where there are pairs enough (one row: 3 pairs of a key/value head -> 2 tasks). How pairs are grouped
// does not change any pair's bits.
int64_t tasks_per_head(int64_t per_head, int64_t kv_heads) {
  const int64_t wanted = (2 * at::get_num_threads() + kv_heads - 1) / kv_heads;
  return std::min(per_head, std::max((per_head + kMaxPairs - 1) / kMaxPairs, wanted));
}

at::Tensor checked_mask(const std::optional<at::Tensor>& step_mask, int64_t n) {
  at::Tensor mask;
  if (step_mask.has_value()) {
    mask = step_mask->to(at::kBool).contiguous();
    TORCH_CHECK(mask.dim() == 2 && mask.size(0) == n && mask.size(1) == n, "tree_attention: step_mask must be [n, n]");
  }
  return mask;
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
  const at::Tensor mask = checked_mask(step_mask, n);
  const at::Tensor q = q_in.stride(2) == 1 ? q_in : q_in.contiguous();  // (a view of [n, H, hd]: read in place)
  at::Tensor out = at::empty({heads, n, hd}, q.options());
  if (heads == 0 || n == 0) return out;
  const std::vector<std::vector<int64_t>> paths = step_paths(mask, n);
  const int64_t group = heads / kv_heads, per_head = group * n;
  const int64_t tasks = tasks_per_head(per_head, kv_heads);
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const Queries qp{q.data_ptr<float>(), q.stride(0), q.stride(1)};
  const Outputs op{out.data_ptr<float>(), n * hd, hd};
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

// A batch's decode step, every sequence over its own cache, in one call (eaglespec.targets.pool): q [H, N, hd] float32
// (the rows of all sequences, one after another: sizes[i] rows each), k and v [Hkv, N, hd] float32, this step's keys
// and values. Sequence i's rows are first written to its cache, keys_t[i] [Hkv, hd, capacity] and values[i]
// [Hkv, capacity, hd] (float32 or bfloat16), at rows cached[i] .. cached[i] + sizes[i] - 1 (as a tensor copy: the
// same rounding as writing them from Python), then attend exactly as `tree_attention` over that cache slice with
// step_masks[i] ([n, n] bool, or none: causal) -> [H, N, hd]: each row has the bits tree_attention gives it.
at::Tensor tree_attention_batch(const at::Tensor& q_in, const at::Tensor& k, const at::Tensor& v,
                                at::TensorList keys_t, at::TensorList values, at::IntArrayRef cached,
                                at::IntArrayRef sizes, const c10::List<std::optional<at::Tensor>>& step_masks) {
  const int64_t count = static_cast<int64_t>(keys_t.size());
  TORCH_CHECK(count > 0 && static_cast<int64_t>(values.size()) == count &&
                  static_cast<int64_t>(cached.size()) == count && static_cast<int64_t>(sizes.size()) == count &&
                  static_cast<int64_t>(step_masks.size()) == count,
              "tree_attention_batch: one cache, cached length, size and mask per sequence");
  TORCH_CHECK(q_in.dim() == 3 && k.dim() == 3 && v.dim() == 3 && q_in.scalar_type() == at::kFloat &&
                  k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "tree_attention_batch: float32 q [H, N, hd], k and v [Hkv, N, hd]");
  const int64_t heads = q_in.size(0), rows = q_in.size(1), hd = q_in.size(2), kv_heads = k.size(0);
  TORCH_CHECK(hd % kHeadDimStep == 0 && hd <= kMaxHeadDim && heads % kv_heads == 0 && k.size(1) == rows &&
                  v.size(0) == kv_heads && v.size(1) == rows && k.size(2) == hd && v.size(2) == hd,
              "tree_attention_batch: q [H, N, hd], k and v [Hkv, N, hd], head_dim a multiple of 16, <= 256");
  const at::ScalarType dtype = keys_t[0].scalar_type();
  std::vector<int64_t> starts(count + 1, 0);
  std::vector<std::vector<std::vector<int64_t>>> paths(count);
  for (int64_t i = 0; i < count; ++i) {
    const int64_t c = cached[i], n = sizes[i];
    const at::Tensor& kt = keys_t[i];
    const at::Tensor& vs = values[i];
    TORCH_CHECK(kt.dim() == 3 && vs.dim() == 3 && kt.size(0) == kv_heads && kt.size(1) == hd &&
                    vs.size(0) == kv_heads && vs.size(2) == hd && c >= 0 && n > 0 && c + n <= kt.size(2) &&
                    c + n <= vs.size(1) && kt.scalar_type() == dtype && vs.scalar_type() == dtype &&
                    (dtype == at::kFloat || dtype == at::kBFloat16) && kt.stride(2) == 1 && vs.stride(2) == 1,
                "tree_attention_batch: sequence ", i, ": cache keys_t [", kv_heads, ", ", hd,
                ", >= c + n] and values [",
                kv_heads, ", >= c + n, ", hd, "] of one dtype (float32 or bfloat16), c >= 0, n >= 1");
    starts[i + 1] = starts[i] + n;
    TORCH_CHECK(starts[i + 1] <= rows, "tree_attention_batch: the sizes add up to more than q's ", rows, " rows");
    kt.narrow(2, c, n).copy_(k.narrow(1, starts[i], n).transpose(1, 2));
    vs.narrow(1, c, n).copy_(v.narrow(1, starts[i], n));
    paths[i] = step_paths(checked_mask(step_masks.get(i), n), n);
  }
  TORCH_CHECK(starts[count] == rows, "tree_attention_batch: the sizes add up to ", starts[count], ", not ", rows);
  const at::Tensor q = q_in.stride(2) == 1 ? q_in : q_in.contiguous();
  at::Tensor out = at::empty({heads, rows, hd}, q.options());
  // Tasks: (sequence, key/value head, group of pairs), as tree_attention makes them for each sequence.
  const int64_t group = heads / kv_heads;
  struct Task { int64_t seq, g, first, last; };
  std::vector<Task> tasks;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t per_head = group * sizes[i], per = tasks_per_head(per_head, kv_heads);
    for (int64_t g = 0; g < kv_heads; ++g)
      for (int64_t t = 0; t < per; ++t) tasks.push_back({i, g, t * per_head / per, (t + 1) * per_head / per});
  }
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  float* op = out.data_ptr<float>();
  const float* qd = q.data_ptr<float>();
  auto run = [&](auto tag) {
    using T = decltype(tag);
    at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scratch;
      for (int64_t u = begin; u < end; ++u) {
        const Task& task = tasks[u];
        const int64_t i = task.seq, n = sizes[i], start = starts[i];
        const Queries qp{qd + start * q.stride(1), q.stride(0), q.stride(1)};
        const Outputs outs{op + start * hd, rows * hd, hd};
        int64_t hs[kMaxPairs], rs[kMaxPairs];
        for (int64_t p = task.first; p < task.last; ++p) {  // pair p of the head: head-in-group p / n, row p % n
          hs[p - task.first] = task.g * group + p / n;
          rs[p - task.first] = p % n;
        }
        const at::Tensor& kt = keys_t[i];
        const at::Tensor& vs = values[i];
        attend_task(task.last - task.first, hs, rs, qp, n, hd, kt.data_ptr<T>() + task.g * kt.stride(0),
                    kt.stride(1), vs.data_ptr<T>() + task.g * vs.stride(0), vs.stride(1), cached[i], paths[i], scale,
                    scratch, outs);
      }
    });
  };
  if (dtype == at::kFloat)
    run(float{});
  else
    run(at::BFloat16{});
  return out;
}

}  // namespace
}  // namespace eaglespec::attention
