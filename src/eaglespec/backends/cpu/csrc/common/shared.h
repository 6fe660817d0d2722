// What the host code and the micro-kernels share: torch's headers, scalar helpers and the packed layouts.
//
// Layout: csrc/common/ holds each operator's host code once (argument checks, dispatch over rows and threads, scalar
// steps, registration); csrc/avx512/ and csrc/avx2/ hold only the vector micro-kernels, each operator's in a
// namespace named after the instruction set, which its header makes the operator's `isa` namespace (`namespace isa
// = avx2;`): the host code calls isa::softmax, isa::store_rows and so on. A build is one translation unit
// (avx512/kernels.cpp, avx2/kernels.cpp) that includes its micro-kernels, then the host code (common/ops.h), so
// torch's headers, the slow part of compiling a file, are parsed once per build. Hence also the light headers below
// in place of <ATen/ATen.h>.
//
// Everything lives in anonymous namespaces, as in a file of its own: each header is included once, into one
// translation unit, and internal linkage lets the compiler inline across it (calls to a -fPIC library's external
// functions could be interposed, so they are not inlined) and keeps the two builds' symbols apart.

#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

namespace eaglespec {
namespace {

// A bfloat16 value as the float32 it is exact in (its high half).
inline float bf16_to_float(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &wide, sizeof(value));
  return value;
}

// float32 -> bfloat16 bits, rounded to nearest even; NaN stays a quiet NaN (avx2/bf16_gemm.h's rounding).
inline uint16_t to_bf16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  return static_cast<uint16_t>((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

// `count` bfloat16 values -> float32 (exact).
inline void widen_bf16(const uint16_t* from, int64_t count, float* to) {
  for (int64_t i = 0; i < count; ++i) to[i] = bf16_to_float(from[i]);
}

// An operator's optional bias [n] as a contiguous float32 tensor (undefined where there is none).
inline at::Tensor float_bias(const std::optional<at::Tensor>& bias_in, int64_t n, const char* op) {
  at::Tensor bias;
  if (bias_in.has_value()) {
    bias = bias_in->to(at::kFloat).contiguous();
    TORCH_CHECK(bias.dim() == 1 && bias.size(0) == n, op, ": bias must be [", n, "]");
  }
  return bias;
}

inline const float* float_data(const at::Tensor& t) { return t.defined() ? t.data_ptr<float>() : nullptr; }

// What a packed product's operator starts with: x [M, K] bfloat16 (checked, made contiguous), its bias [n] (or none)
// as float32, and the output y [M, n] bfloat16 to fill.
struct ProductCall {
  at::Tensor x, bias, y;
  int64_t m, k;
  ProductCall(const at::Tensor& x_in, int64_t n, const std::optional<at::Tensor>& bias_in, const char* op) {
    TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kBFloat16, op, ": x must be [M, K] bfloat16");
    x = x_in.contiguous();
    m = x.size(0);
    k = x.size(1);
    bias = float_bias(bias_in, n, op);
    y = at::empty({m, n}, x.options());
  }
  const uint16_t* xp() const { return reinterpret_cast<const uint16_t*>(x.data_ptr()); }
  uint16_t* yp() const { return reinterpret_cast<uint16_t*>(y.data_ptr()); }
  const float* bp() const { return float_data(bias); }
};

// f(std::integral_constant<int, R>{}) with R = count, for 1 <= count <= kMax: a row count known at run time as the
// compile-time one a micro-kernel lays its registers out for.
template <int kMax, typename F>
inline void with_rows(int64_t count, const F& f) {
  if constexpr (kMax > 1)
    if (count < kMax) return with_rows<kMax - 1>(count, f);
  f(std::integral_constant<int, kMax>{});
}

// Rows [0, rows) in near-equal tiles of at most kMax rows (8 rows in tiles of at most 6: 4 + 4, not 6 + 2):
// f(first row, std::integral_constant<int, R>{}) for each tile of R rows, in order.
template <int kMax, typename F>
inline void for_tiles(int64_t rows, const F& f) {
  const int64_t tiles = (rows + kMax - 1) / kMax;
  for (int64_t t = 0, row = 0; t < tiles; ++t) {
    const int64_t count = (rows - row) / (tiles - t);
    with_rows<kMax>(count, [&](auto r) { f(row, r); });
    row += count;
  }
}

// Software prefetch of a micro-kernel's packed weights, record by record (kBytes each, consecutive in memory, as in
// every packing here; the groups a thread takes in for_groups are consecutive too): the record two ahead into L1,
// and, for tiles of kFarRows rows or more, the one kFarRecords ahead into L2 as well. One row streams the weights at
// the memory's speed with the hardware's prefetchers alone; a tile of several rows computes long enough on each
// record that the next ones arrive late without the far prefetch. On a 2-core Zen 5 VM (AVX-512 build, int8 inputs)
// it took a quarter off the 4-bit products of 4-12 rows and left 1-2 rows as they were (docs/cpu.md, "Prefetching
// for wide passes").
constexpr int kFarRows = 3;
constexpr int kFarRecords = 16;

template <int kBytes, int R>
inline void prefetch_records(const uint8_t* record) {
  for (int line = 0; line < kBytes; line += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(record + 2 * kBytes + line), _MM_HINT_T0);
    if constexpr (R >= kFarRows)
      _mm_prefetch(reinterpret_cast<const char*>(record + kFarRecords * kBytes + line), _MM_HINT_T1);
  }
}

// What a thread sets up for its chunk of groups in for_groups where the micro-kernels need nothing.
struct NoScope {
  explicit NoScope(int64_t) {}
};

// y [m, n] (bfloat16, rounded once) = the kCols columns of each group g that `group(g, acc)` computes into acc
// [m][kCols] (float32), plus bias (or none), over the groups on torch's threads; a Scope (the AMX build's tile
// configuration, or NoScope) is made once per thread's chunk of groups. m <= kMaxRows.
template <int64_t kCols, int64_t kMaxRows, typename Scope, typename F>
void for_groups(int64_t m, int64_t groups, int64_t n, const float* bias, uint16_t* y, const F& group) {
  at::parallel_for(0, groups, 2, [&](int64_t begin, int64_t end) {
    alignas(64) float acc[kMaxRows * kCols];
    const Scope scope(m);
    for (int64_t g = begin; g < end; ++g) {
      group(g, acc);
      const int64_t col = g * kCols, columns = std::min(kCols, n - col);
      for (int64_t r = 0; r < m; ++r)
        for (int64_t c = 0; c < columns; ++c)
          y[r * n + col + c] = to_bf16(acc[r * kCols + c] + (bias ? bias[col + c] : 0.0f));
    }
  });
}

// A call's rows with their inputs as 8-bit integers, for the products with int8 activations (q4_q8_linear,
// q6_q8_linear): per block of 32 inputs of a row, sx = max |x| / 127 and xq = x / sx rounded to the nearest integer
// (ties to even), in [-127, 127], so that x ~ sx xq (llama.cpp's Q8_0 scheme, and the greedy LM head's screen's). A
// block with a non-finite input gets sx = NaN, which the products carry into their outputs. Each row is quantized
// on its own, so a row's integers do not depend on the other rows of the call.
struct Q8Rows {
  static constexpr int64_t kBlock = 32;
  int64_t k, blocks;
  std::unique_ptr<int8_t[]> xq;      // [rows][k]: in k order, or (nibble_order) each 8 inputs' even k, then odd k
  std::unique_ptr<float[]> sx;       // [rows][blocks]
  std::unique_ptr<int32_t[]> sum16;  // [rows][2 blocks]: the sum of xq over each 16 inputs

  Q8Rows(int64_t rows, int64_t k_)
      : k(k_), blocks(k_ / kBlock), xq(new int8_t[rows * k_]), sx(new float[rows * (k_ / kBlock)]),
        sum16(new int32_t[rows * 2 * (k_ / kBlock)]) {}

  // Rows [0, rows) of x (bfloat16, row stride k); k a multiple of 32.
  void quantize(const uint16_t* x, int64_t rows, bool nibble_order) {
    at::parallel_for(0, rows * blocks, 64, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) quantize_block(x + i * kBlock, i, nibble_order);
    });
  }

 private:
  // Block i of all rows' blocks (row i / blocks): loops of fixed length the compiler vectorizes.
  void quantize_block(const uint16_t* x, int64_t i, bool nibble_order) {
    uint16_t peak_bits = 0;  // max |x| as bfloat16 bits: for non-negative floats the bits order as the values
    for (int64_t j = 0; j < kBlock; ++j) peak_bits = std::max<uint16_t>(peak_bits, x[j] & 0x7FFF);
    int8_t* q = xq.get() + i * kBlock;
    int32_t* sums = sum16.get() + 2 * i;
    if (peak_bits >= 0x7F80) {  // an infinity or NaN
      sx[i] = std::numeric_limits<float>::quiet_NaN();
      std::memset(q, 0, kBlock);
      sums[0] = sums[1] = 0;
      return;
    }
    const float peak = bf16_to_float(peak_bits), scale = peak / 127.0f;
    constexpr float kRound = 12582912.0f;  // 1.5 2^23: v + kRound - kRound is v rounded to nearest even, |v| < 2^22
    alignas(64) int8_t v[kBlock];
    for (int64_t j = 0; j < kBlock; ++j) {
      const float scaled = peak > 0.0f ? bf16_to_float(x[j]) / scale : 0.0f;
      const float rounded = (scaled + kRound) - kRound;
      v[j] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, rounded)));
    }
    sx[i] = scale;
    for (int h = 0; h < 2; ++h) {
      int32_t sum = 0;
      for (int64_t j = 16 * h; j < 16 * h + 16; ++j) sum += v[j];
      sums[h] = sum;
    }
    if (!nibble_order) {
      std::memcpy(q, v, kBlock);
      return;
    }
    for (int64_t o = 0; o < kBlock; o += 8)
      for (int64_t j = 0; j < 4; ++j) {
        q[o + j] = v[o + 2 * j];
        q[o + 4 + j] = v[o + 2 * j + 1];
      }
  }
};

}  // namespace
}  // namespace eaglespec

// The bfloat16 products (common/bf16_gemm.h).
namespace eaglespec::bf16 {
namespace {

// The packed weight (bf16_pack): [ceil(N/64), ceil(K/2), 64, 2] bfloat16, for a k-pair the 64 columns of a group with
// their two k-values side by side (one 32-bit lane each).
constexpr int64_t kGroup = 64;  // output columns per packed group
constexpr int64_t kMaxM = 64;   // rows per pass over the weights; longer inputs (prefills) take several
constexpr int64_t kBlock = 32;  // k-pairs per block when several tiles share a group's weights (8 KB)
constexpr int64_t kAhead = kBlock * kGroup * 2;  // software prefetch distance in weight elements: one block ahead
// The FMA loops also prefetch into L2 four blocks (32 KB) ahead: on the Intel VM where the AVX-512 build chooses its
// FMA loop, all products of a step took 10-14% less for 1-16 rows than with the near prefetch alone (kernel_ab.py
// --variant 1).
constexpr int64_t kFarAhead = 4 * kAhead;

// The rows of a call split into near-equal tiles of at most `most` rows (8 rows in tiles of 6: 4 + 4, not 6 + 2).
struct Tiles {
  int64_t count;
  int64_t rows[kMaxM];
  Tiles(int64_t m, int64_t most) : count((m + most - 1) / most) {
    for (int64_t t = 0, row = 0; t < count; ++t) {
      rows[t] = (m - row) / (count - t);
      row += rows[t];
    }
  }
};

}  // namespace
}  // namespace eaglespec::bf16

// The rows' argmax (common/argmax_rows.h).
namespace eaglespec::argmax {
namespace {

inline float value_at(const uint16_t* row, int64_t i) { return bf16_to_float(row[i]); }
inline float value_at(const float* row, int64_t i) { return row[i]; }

// The first NaN of a row the vector pass found one in.
template <typename T>
int64_t first_nan(const T* row, int64_t v) {
  for (int64_t i = 0; i < v; ++i)
    if (std::isnan(value_at(row, i))) return i;
  return -1;
}

}  // namespace
}  // namespace eaglespec::argmax

// The rows' top-k (common/topk_rows.h).
namespace eaglespec::topk {
namespace {

// Insert (value, index) into the sorted best list of `count` entries (capacity k); index grows along the row, so
// an equal value goes after the entries already there.
inline void insert(float value, int64_t index, float* values, int64_t* indices, int64_t& count, int64_t k) {
  if (count == k && !(value > values[k - 1])) return;
  int64_t at = count < k ? count : k - 1;  // the slot freed (the end, or the current k-th best)
  while (at > 0 && values[at - 1] < value) {
    values[at] = values[at - 1];
    indices[at] = indices[at - 1];
    --at;
  }
  values[at] = value;
  indices[at] = index;
  if (count < k) ++count;
}

}  // namespace
}  // namespace eaglespec::topk

// The LM-head screen and the int8 products (common/screened_argmax.h).
namespace eaglespec::screen {
namespace {

// The packed int8 weight (bf16gemm.int8_rows): [ceil(N/16), K32/4, 16, 4] bytes q + 128, 16 columns x 4 consecutive
// channels per 64 bytes.
constexpr int64_t kLanes = 16;  // output columns per packed group
constexpr int64_t kBlock = 32;  // input channels per quantization block of x
constexpr int64_t kSteps = kBlock / 4;  // 64-byte units (16 columns x 4 channels) per block
constexpr int64_t kAhead = 8 * kBlock * kLanes;  // software prefetch distance in weight bytes: 8 blocks

// One input row, quantized: xq [K32] signed bytes, the scale of each block and the sum of its xq.
struct Quantized {
  const int8_t* xq;
  const float* sx;      // [blocks]
  const int32_t* xsum;  // [blocks]: sum_{k in b} xq_k (AVX-512: the weights are stored as q + 128)
};

}  // namespace
}  // namespace eaglespec::screen

// The 4-bit block products (common/q4_gemm.h).
namespace eaglespec::q4 {
namespace {

// The packed weight (q4_pack in eaglespec/q4.py), [N/32 groups][...] uint8, in one of two layouts:
// - Q4_1 (d and m per 32 k float16): [K/32 blocks][640 bytes]; a group-block holds d of its 32 columns (64 bytes),
//   then m, then the q (512 bytes).
// - Q4_K (d sc and -(dmin mn) per 32 k: d and dmin float16 per 256 k, sc and mn 6-bit integers): [K/256
//   super-blocks][4736 bytes]; a super-block holds d of its 32 columns, then dmin (64 bytes each), then its 8 blocks,
//   each sc of the 32 columns, then mn (32 bytes each, one byte a value), then the q (512 bytes). The kernels
//   multiply d sc and dmin mn out in float32, exactly (11 x 6 significant bits): 18.5 bytes per 32 weights.
// The q: 4 octets x 4 vectors x 8 columns of uint32, where uint32 lane c of vector v of octet j holds
// q[8 v + c][32 b + 8 j + i] in bits [4 i, 4 i + 4).
constexpr int64_t kCols = 32;                   // output columns per group: 4 vectors of 8 float32 lanes
constexpr int64_t kBlockK = 32;                 // k per block (one d and m per column)
constexpr int64_t kQBytes = 512;                // the q of a group-block
constexpr int64_t kHalfBlockBytes = 128 + kQBytes;   // Q4_1: float16 d and m, q
constexpr int64_t kSuperBlocks = 8;                  // Q4_K: blocks per super-block (256 k)
constexpr int64_t kSuperHeader = 128;                // its float16 d and dmin of 32 columns
constexpr int64_t kSuperRecord = 64 + kQBytes;       // a block in it: sc, mn (uint8), q
constexpr int64_t kSuperBytes = kSuperHeader + kSuperBlocks * kSuperRecord;

// Where a group's blocks lie (the micro-kernels' Scales derive from these and add how to read d and m).
struct HalfLayout {  // Q4_1: blocks of kBytes one after another
  static constexpr int64_t kBytes = kHalfBlockBytes;  // a block's record (its q are its last kQBytes)
  static const uint8_t* block(const uint8_t* group, int64_t b) { return group + b * kBytes; }
  static int64_t group_bytes(int64_t blocks) { return blocks * kBytes; }
};
struct SuperLayout {  // Q4_K: super-blocks of kSuperBlocks blocks under a header
  static constexpr int64_t kBytes = kSuperRecord;
  static const uint8_t* block(const uint8_t* group, int64_t b) {
    return group + b / kSuperBlocks * kSuperBytes + kSuperHeader + b % kSuperBlocks * kSuperRecord;
  }
  static const uint8_t* header(const uint8_t* blk, int64_t b) {  // block b's super-block header, from its record
    return blk - kSuperHeader - b % kSuperBlocks * kSuperRecord;
  }
  static int64_t group_bytes(int64_t blocks) { return blocks / kSuperBlocks * kSuperBytes; }
};

}  // namespace
}  // namespace eaglespec::q4

// The 6-bit code products (common/q6_gemm.h).
namespace eaglespec::q6 {
namespace {

// The packed weight (q6_pack in eaglespec/backends/cpu/q6.py): [N/32 groups][K/32 blocks][1024 bytes]; a group-block
// holds the scales s of its 32 columns for k 0-15 of the block, then for k 16-31 (float32, 128 bytes each), then the
// codes q (6 bits in [0, 63]; the weight is s (q - 32)), 48 bytes per k-pair p (768 bytes).
// A pair's 64 codes in kernel order, Q[t] for t = 16 j + 8 u + 2 i + e = q[16 u + 4 j + i][32 b + 2 p + e] (j, i in
// [0, 4), u, e in {0, 1}: each 16-byte lane j has columns 4 j .. 4 j + 3, then 16 + 4 j .. 16 + 4 j + 3, each
// column's two k together), are stored as their low 4 bits, 32 bytes L (Q[t] in the low nibble of L[t], Q[32 + t]
// in its high nibble), then their high 2 bits, 16 bytes H (Q[16 s + t] >> 4 in bits 2 s, 2 s + 1 of H[t]): a
// vector of 32 or 64 Q is two broadcast loads, shifts and masks away (code_at says it one code at a time).
constexpr int64_t kCols = 32;        // output columns per group
constexpr int64_t kBlockK = 32;      // k per block
constexpr int64_t kScaleK = 16;      // k per scale
constexpr int64_t kScaleBytes = 256;
constexpr int64_t kPairBytes = 48;   // a k-pair's codes: L (32 bytes), then H (16)
constexpr int64_t kCodeBytes = 16 * kPairBytes;
constexpr int64_t kBlockBytes = kScaleBytes + kCodeBytes;

// Where column c's code of k-pair p, k 2 p + e, lies among the pair's 64 codes in kernel order.
inline int64_t code_index(int64_t c, int64_t e) { return 16 * (c % 16 / 4) + 8 * (c / 16) + 2 * (c % 4) + e; }

// Code Q[t] of the pair whose 48 bytes start at `pair`.
inline int code_at(const uint8_t* pair, int64_t t) {
  const int low = t < 32 ? pair[t] & 15 : pair[t - 32] >> 4;
  const int high = (pair[32 + t % 16] >> (2 * (t / 16))) & 3;
  return low | high << 4;
}

}  // namespace
}  // namespace eaglespec::q6
