// A Llama-style decoder's layers over one step's rows, in one call: the whole step of a target that runs on the
// kernels (eaglespec.backends.cpu.stack), with no Python and no torch operator between the products.
//
// Per layer, on the step's rows x [N, d] bfloat16 (the rows of one or several sequences, one after another):
//   h = RMSNorm(x) * w_in;  qkv = h W_qkv^T (+ b);  q, k = RoPE(q, k);
//   attention of each sequence's rows over its own cache (attention::tree_attention_batch, which writes k and v);
//   x = x + attn W_o^T;  h = RMSNorm(x) * w_post;  gate, up = h W_gu^T;  x = x + (SiLU(gate) up) W_down^T.
// The products are the kernels' own (bf16::bf16_linear, q4::q4_linear, q6::q6_linear). The steps between them work on
// each row alone, in a fixed order, and round to bfloat16 where the model's bfloat16 arithmetic does (each elementwise
// result, as torch's bfloat16 operators round them); RMSNorm sums x^2 in float32 over 8 interleaved partial sums. So a
// row's bits depend on that row only: a verified tree row gets the bits of the one-token step that would compute it,
// and a batch's row those of its batch-1 step, as with the layers in Python (eaglespec.targets.layers), whose steps
// between the products these replace (~40 torch operator calls a layer, ~0.3 ms a layer of Python on 2 cores).

#pragma once

#include <ATen/ops/cat.h>

#include "bf16_gemm.h"
#include "q4_gemm.h"
#include "q6_gemm.h"
#include "shared.h"
#include "tree_attention.h"

namespace eaglespec::stack {
namespace {

constexpr int64_t kMatrices = 4;  // per layer: qkv, o, gate_up, down
constexpr int64_t kQ4 = 2;        // a matrix's kind: 0 or 1 the bf16_linear variant, 2 the exact 4-bit product,
constexpr int64_t kQ6 = 3;        // 3 the 6-bit code product,
constexpr int64_t kQ4Int8 = 4;    // 4 and 5 the same two with int8 inputs (q4_q8_linear, q6_q8_linear)
constexpr int64_t kQ6Int8 = 5;

inline float bf16_round(float value) { return bf16_to_float(to_bf16(value)); }

// Work over rows [0, rows) of `width` values each, on the threads where there is enough of it.
template <typename F>
void for_rows(int64_t rows, int64_t width, const F& f) {
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, width));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) f(r);
  });
}

// x [N, d] bfloat16 -> RMSNorm(x) * weight [N, d] bfloat16: x * (1 / sqrt(mean(x^2) + eps)) rounded, times weight,
// rounded (transformers' Llama form).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, float eps) {
  const int64_t n = x.size(0), d = x.size(1);
  at::Tensor out = at::empty({n, d}, x.options());
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const auto* wp = reinterpret_cast<const uint16_t*>(weight.data_ptr());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  for_rows(n, d, [&](int64_t r) {
    const uint16_t* row = xp + r * d;
    float partial[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 8 <= d; i += 8)
      for (int j = 0; j < 8; ++j) {
        const float v = bf16_to_float(row[i + j]);
        partial[j] += v * v;
      }
    for (; i < d; ++i) {
      const float v = bf16_to_float(row[i]);
      partial[i % 8] += v * v;
    }
    const float sum = ((partial[0] + partial[1]) + (partial[2] + partial[3])) +
                      ((partial[4] + partial[5]) + (partial[6] + partial[7]));
    const float inv = 1.0f / std::sqrt(sum / static_cast<float>(d) + eps);
    for (int64_t c = 0; c < d; ++c)
      op[r * d + c] = to_bf16(bf16_to_float(wp[c]) * bf16_round(bf16_to_float(row[c]) * inv));
  });
  return out;
}

// One layer product: kinds 0 / 1 the bfloat16 kernel's variants, 2 the exact 4-bit one, 3 the 6-bit codes, 4 and 5
// those two with int8 inputs.
at::Tensor product(const at::Tensor& x, const at::Tensor& packed, int64_t n, const std::optional<at::Tensor>& bias,
                   int64_t kind) {
  if (kind == kQ4) return q4::q4_linear(x, packed, n, bias);
  if (kind == kQ6) return q6::q6_linear(x, packed, n, bias);
  if (kind == kQ4Int8) return q4::q4_q8_linear(x, packed, n, bias);
  if (kind == kQ6Int8) return q6::q6_q8_linear(x, packed, n, bias);
  return bf16::bf16_linear(x, packed, n, bias, kind);
}

// qkv [N, (H + 2 Hkv) hd] bfloat16 -> q [H, N, hd], k, v [Hkv, N, hd] float32: RoPE (rotate-half form) on q and k
// with cos, sin [N, hd] bfloat16, as torch computes x * cos + cat(-x2, x1) * sin in bfloat16 (each product and the
// sum rounded), then widened; v widened.
void rope_split(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t heads,
                int64_t kv_heads, int64_t hd, at::Tensor& q, at::Tensor& k, at::Tensor& v) {
  const int64_t n = qkv.size(0), width = qkv.size(1), half = hd / 2;
  q = at::empty({heads, n, hd}, qkv.options().dtype(at::kFloat));
  k = at::empty({kv_heads, n, hd}, q.options());
  v = at::empty({kv_heads, n, hd}, q.options());
  const auto* xp = reinterpret_cast<const uint16_t*>(qkv.data_ptr());
  const auto* cp = reinterpret_cast<const uint16_t*>(cos.data_ptr());
  const auto* sp = reinterpret_cast<const uint16_t*>(sin.data_ptr());
  float* qp = q.data_ptr<float>();
  float* kp = k.data_ptr<float>();
  float* vp = v.data_ptr<float>();
  for_rows(n, width, [&](int64_t r) {
    const uint16_t* cr = cp + r * hd;
    const uint16_t* sr = sp + r * hd;
    for (int64_t h = 0; h < heads + 2 * kv_heads; ++h) {
      const uint16_t* x = xp + r * width + h * hd;
      if (h >= heads + kv_heads) {  // v
        float* out = vp + ((h - heads - kv_heads) * n + r) * hd;
        for (int64_t j = 0; j < hd; ++j) out[j] = bf16_to_float(x[j]);
        continue;
      }
      float* out = h < heads ? qp + (h * n + r) * hd : kp + ((h - heads) * n + r) * hd;
      for (int64_t j = 0; j < hd; ++j) {
        const float rotated = j < half ? -bf16_to_float(x[j + half]) : bf16_to_float(x[j - half]);
        const float a = bf16_round(bf16_to_float(x[j]) * bf16_to_float(cr[j]));
        const float b = bf16_round(rotated * bf16_to_float(sr[j]));
        out[j] = bf16_round(a + b);
      }
    }
  });
}

// attention output [H, N, hd] float32 -> [N, H hd] bfloat16 (rounded).
at::Tensor merge_heads(const at::Tensor& attn) {
  const int64_t heads = attn.size(0), n = attn.size(1), hd = attn.size(2);
  at::Tensor out = at::empty({n, heads * hd}, attn.options().dtype(at::kBFloat16));
  const float* ap = attn.data_ptr<float>();
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  for_rows(n, heads * hd, [&](int64_t r) {
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t j = 0; j < hd; ++j) op[(r * heads + h) * hd + j] = to_bf16(ap[(h * n + r) * hd + j]);
  });
  return out;
}

// x += y, both [N, d] bfloat16 (each sum rounded).
void add_into(at::Tensor& x, const at::Tensor& y) {
  const int64_t n = x.size(0), d = x.size(1);
  auto* xp = reinterpret_cast<uint16_t*>(x.data_ptr());
  const auto* yp = reinterpret_cast<const uint16_t*>(y.data_ptr());
  for_rows(n, d, [&](int64_t r) {
    for (int64_t c = r * d; c < (r + 1) * d; ++c) xp[c] = to_bf16(bf16_to_float(xp[c]) + bf16_to_float(yp[c]));
  });
}

// gate_up [N, 2I] bfloat16 -> SiLU(gate) * up [N, I] bfloat16: silu(g) = g / (1 + e^-g) rounded, times up, rounded
// (the build's vector micro-kernel, isa::silu_mul_row: e^-g by the attention's polynomial, ~1 ulp, where torch's
// bfloat16 SiLU uses its own exp; per value, so a row's bits are its own).
at::Tensor silu_mul(const at::Tensor& gate_up_in) {
  TORCH_CHECK(gate_up_in.dim() == 2 && gate_up_in.size(1) % 2 == 0 && gate_up_in.scalar_type() == at::kBFloat16,
              "silu_mul: gate_up must be [N, 2 I] bfloat16");
  const at::Tensor gate_up = gate_up_in.contiguous();
  const int64_t n = gate_up.size(0), inter = gate_up.size(1) / 2;
  at::Tensor out = at::empty({n, inter}, gate_up.options());
  const auto* gp = reinterpret_cast<const uint16_t*>(gate_up.data_ptr());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  for_rows(n, 2 * inter, [&](int64_t r) {
    isa::silu_mul_row(gp + r * 2 * inter, gp + r * 2 * inter + inter, op + r * inter, inter);
  });
  return out;
}

// x [N, d] bfloat16, the step's rows of `sizes.size()` sequences; cos, sin [N, hd] bfloat16 at their positions;
// norms [2 L] (each layer's input and post-attention RMSNorm weights, [d] bfloat16); per layer kMatrices products
// (qkv, o, gate_up, down), each made of parts[i] >= 1 products whose outputs lie side by side (a fused q/k/v whose
// matrices the file stores in two block types: its q and k in one, its v in the other), the parts' packed weights,
// outputs, kinds and biases one after another; keys_t, values [L S] (layer l, sequence s at
// l S + s: its cache, as tree_attention_batch takes it), cached[s], sizes[s], step_masks[s] as there; `saved`: the
// layers whose input to return too (EAGLE-3's features), ascending -> [x after the last layer, the saved inputs...].
std::vector<at::Tensor> decoder_stack(const at::Tensor& x_in, const at::Tensor& cos_in, const at::Tensor& sin_in,
                                      at::TensorList norms, at::TensorList packed, at::IntArrayRef outs,
                                      at::IntArrayRef kinds, const c10::List<std::optional<at::Tensor>>& biases,
                                      at::IntArrayRef parts, at::TensorList keys_t, at::TensorList values,
                                      at::IntArrayRef cached, at::IntArrayRef sizes,
                                      const c10::List<std::optional<at::Tensor>>& step_masks,
                                      int64_t heads, int64_t kv_heads, double eps, at::IntArrayRef saved) {
  const int64_t layers = static_cast<int64_t>(norms.size()) / 2, seqs = static_cast<int64_t>(sizes.size());
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kBFloat16, "decoder_stack: x must be [N, d] bfloat16");
  const int64_t n = x_in.size(0), d = x_in.size(1);
  TORCH_CHECK(layers > 0 && static_cast<int64_t>(norms.size()) == 2 * layers &&
                  static_cast<int64_t>(parts.size()) == kMatrices * layers,
              "decoder_stack: two norms and four products per layer");
  std::vector<int64_t> first(kMatrices * layers + 1, 0);  // product i's parts: first[i] .. first[i + 1] - 1
  for (int64_t i = 0; i < kMatrices * layers; ++i) {
    TORCH_CHECK(parts[i] >= 1, "decoder_stack: a product has at least one part");
    first[i + 1] = first[i] + parts[i];
  }
  const int64_t total = first.back();
  TORCH_CHECK(static_cast<int64_t>(packed.size()) == total && static_cast<int64_t>(outs.size()) == total &&
                  static_cast<int64_t>(kinds.size()) == total && static_cast<int64_t>(biases.size()) == total,
              "decoder_stack: one packed weight, output size, kind and bias per part");
  TORCH_CHECK(seqs > 0 && static_cast<int64_t>(keys_t.size()) == layers * seqs &&
                  static_cast<int64_t>(values.size()) == layers * seqs,
              "decoder_stack: one cache per layer and sequence");
  TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0,
              "decoder_stack: heads must be a multiple of kv_heads");
  const int64_t hd = cos_in.size(-1);
  TORCH_CHECK(cos_in.dim() == 2 && sin_in.dim() == 2 && cos_in.size(0) == n && sin_in.sizes() == cos_in.sizes() &&
                  cos_in.scalar_type() == at::kBFloat16 && sin_in.scalar_type() == at::kBFloat16 && hd % 2 == 0,
              "decoder_stack: cos and sin must be [N, head_dim] bfloat16");
  for (int64_t l = 0; l < layers; ++l) {
    int64_t width = 0;
    for (int64_t j = first[kMatrices * l]; j < first[kMatrices * l + 1]; ++j) width += outs[j];
    TORCH_CHECK(width == (heads + 2 * kv_heads) * hd, "decoder_stack: layer ", l, "'s qkv product has ", width,
                " outputs, not (heads + 2 kv_heads) head_dim");
  }
  for (int64_t i = 0; i < 2 * layers; ++i)
    TORCH_CHECK(norms[i].dim() == 1 && norms[i].size(0) == d && norms[i].scalar_type() == at::kBFloat16 &&
                    norms[i].is_contiguous(),
                "decoder_stack: norm weights must be [", d, "] bfloat16");
  for (int64_t i = 0; i < total; ++i)
    TORCH_CHECK(kinds[i] >= 0 && kinds[i] <= kQ6Int8,
                "decoder_stack: a product's kind is 0-1 (bfloat16), 2 (4-bit), 3 (6-bit codes), 4-5 (int8 inputs)");
  const at::Tensor cos = cos_in.contiguous(), sin = sin_in.contiguous();
  const float epsilon = static_cast<float>(eps);
  at::Tensor x = x_in.clone(at::MemoryFormat::Contiguous);
  std::vector<at::Tensor> result(1);
  size_t next_saved = 0;
  std::vector<at::Tensor> layer_keys(seqs), layer_values(seqs);
  for (int64_t l = 0; l < layers; ++l) {
    if (next_saved < saved.size() && saved[next_saved] == l) {
      result.push_back(x.clone());
      ++next_saved;
    }
    // the layer's product i, its parts' outputs side by side (one copy of a split product's [N, outs] output: at one
    // row a few KB a layer, against megabytes of weights read)
    auto run = [&](const at::Tensor& input, int64_t i) {
      const int64_t begin = first[kMatrices * l + i], end = first[kMatrices * l + i + 1];
      if (end - begin == 1) return product(input, packed[begin], outs[begin], biases.get(begin), kinds[begin]);
      std::vector<at::Tensor> pieces;
      for (int64_t j = begin; j < end; ++j)
        pieces.push_back(product(input, packed[j], outs[j], biases.get(j), kinds[j]));
      return at::cat(pieces, 1);
    };
    const at::Tensor qkv = run(rms_norm(x, norms[2 * l], epsilon), 0);
    at::Tensor q, k, v;
    rope_split(qkv, cos, sin, heads, kv_heads, hd, q, k, v);
    for (int64_t s = 0; s < seqs; ++s) {
      layer_keys[s] = keys_t[l * seqs + s];
      layer_values[s] = values[l * seqs + s];
    }
    const at::Tensor attn = attention::tree_attention_batch(q, k, v, layer_keys, layer_values, cached, sizes,
                                                            step_masks);
    add_into(x, run(merge_heads(attn), 1));
    add_into(x, run(silu_mul(run(rms_norm(x, norms[2 * l + 1], epsilon), 2)), 3));
  }
  TORCH_CHECK(next_saved == saved.size(), "decoder_stack: saved layers must be ascending layer indices");
  result[0] = x;
  return result;
}

}  // namespace
}  // namespace eaglespec::stack
