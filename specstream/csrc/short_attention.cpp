// Attention for a short step (decode, verification) straight from the paged KV pool, on CPU.
//
// The torch version (attention.py: attend_short's fallback) gathers every sequence's keys and values
// into new tensors, widens them to float32 and runs two batched matmuls and a softmax: for one query row
// over a few hundred keys, most of its ~60 us per layer is the gather and the matmuls' fixed cost. This
// reads each key and value once, where the pool holds it, and keeps the scores in a small buffer.
//
// The arithmetic follows the torch version step by step: scores = (q . k) * scaling in float32, masked
// keys at -inf, softmax in float32 (exp(x - max) / sum), probabilities rounded to the values' dtype, then
// summed against the values in float32 and rounded once to the output dtype. A row's result depends only
// on its own query, keys and mask: never on the other rows of the step (batch invariant).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include "common.h"

#include <cmath>
#include <type_traits>
#include <limits>
#include <vector>

namespace {

using specstream_kernels::sum_lanes;
using specstream_kernels::Vec;

constexpr int64_t kMaxDim = 256;
constexpr int64_t kMaxVecs = kMaxDim / Vec::size();

// Row r of d values as float32 vectors, d a multiple of 2 * Vec::size() (queries, keys and values may be
// float32, bf16 or fp16).
template <typename T>
inline void widen(const T* src, Vec* out, int64_t vecs) {
  if constexpr (std::is_same_v<T, float>) {
    for (int64_t c = 0; c < vecs; ++c) out[c] = Vec::loadu(src + c * Vec::size());
  } else {
    for (int64_t c = 0; c < vecs; c += 2) {
      auto [lo, hi] = at::vec::convert_to_float<T>(at::vec::Vectorized<T>::loadu(src + c * Vec::size()));
      out[c] = lo;
      out[c + 1] = hi;
    }
  }
}

// One query row and one head, with the head dimension fixed at compile time (VECS vectors) so the query,
// a key and the output stay in registers; VECS = 0: any supported d, the same loops with runtime bounds.
template <typename T, int64_t VECS>
inline void attend_row(const T* q_row, const T* k_base, const T* v_base, int64_t k_stride, int64_t v_stride,
                       const int64_t* slots, const bool* m_row, int64_t m_stride, int64_t s_max, int64_t d, float scale,
                       float* scores, T* o_row) {
  const int64_t vecs = VECS ? VECS : d / Vec::size();
  const float neg_inf = -std::numeric_limits<float>::infinity();
  Vec q[VECS ? VECS : kMaxVecs], row[VECS ? VECS : kMaxVecs];
  widen(q_row, q, vecs);
  float top = neg_inf;
  for (int64_t s = 0; s < s_max; ++s) {
    if (m_row && !m_row[s * m_stride]) {
      scores[s] = neg_inf;
      continue;
    }
    widen(k_base + slots[s] * k_stride, row, vecs);
    Vec part = q[0] * row[0];
    for (int64_t c = 1; c < vecs; ++c) part = at::vec::fmadd(q[c], row[c], part);
    const float x = sum_lanes(part) * scale;
    scores[s] = x;
    top = x > top ? x : top;
  }
  // softmax (exp(-inf) = 0 for masked keys), then each probability rounded to the values' dtype
  const Vec vtop(top);
  Vec vsum(0.f);
  int64_t s = 0;
  for (; s + Vec::size() <= s_max; s += Vec::size()) {
    const Vec e = (Vec::loadu(scores + s) - vtop).exp();
    e.store(scores + s);
    vsum = vsum + e;
  }
  float total = sum_lanes(vsum);
  for (; s < s_max; ++s) {
    scores[s] = std::exp(scores[s] - top);
    total += scores[s];
  }
  for (s = 0; s < s_max; ++s) scores[s] = static_cast<float>(static_cast<T>(scores[s] / total));
  Vec acc[VECS ? VECS : kMaxVecs];
  for (int64_t c = 0; c < vecs; ++c) acc[c] = Vec(0.f);
  for (s = 0; s < s_max; ++s) {
    if (scores[s] == 0.f) continue;  // masked, or too small to count
    widen(v_base + slots[s] * v_stride, row, vecs);
    const Vec p(scores[s]);
    for (int64_t c = 0; c < vecs; ++c) acc[c] = at::vec::fmadd(p, row[c], acc[c]);
  }
  float out[kMaxDim];
  for (int64_t c = 0; c < vecs; ++c) acc[c].store(out + c * Vec::size());
  for (int64_t j = 0; j < d; ++j) o_row[j] = static_cast<T>(out[j]);
}

// Each work item is one query row and one head.
template <typename T>
void run(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& kv_index,
         const std::optional<at::Tensor>& mask, const at::Tensor& q_index, const at::Tensor& out_index, double scaling,
         at::Tensor& out) {
  const int64_t n = out_index.size(0), heads = query.size(1), d = query.size(2);
  const int64_t group = heads / keys.size(1);
  const int64_t t_max = q_index.size(1), s_max = kv_index.size(1);
  const T* q_ptr = query.data_ptr<T>();
  const T* k_ptr = keys.data_ptr<T>();
  const T* v_ptr = values.data_ptr<T>();
  const int64_t* kv_ptr = kv_index.data_ptr<int64_t>();
  const int64_t* qi_ptr = q_index.data_ptr<int64_t>();
  const int64_t* oi_ptr = out_index.data_ptr<int64_t>();
  const bool* m_ptr = mask.has_value() ? mask->data_ptr<bool>() : nullptr;
  T* o_ptr = out.data_ptr<T>();
  const int64_t qs0 = query.stride(0), qs1 = query.stride(1);
  const int64_t ks0 = keys.stride(0), ks1 = keys.stride(1), vs0 = values.stride(0), vs1 = values.stride(1);
  const int64_t ms0 = mask.has_value() ? mask->stride(0) : 0, ms2 = mask.has_value() ? mask->stride(2) : 0;
  const int64_t ms3 = mask.has_value() ? mask->stride(3) : 0;
  const float scale = static_cast<float>(scaling);

  at::parallel_for(0, n * heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(s_max);
    for (int64_t w = begin; w < end; ++w) {
      const int64_t i = w / heads, h = w % heads, g = h / group;
      const int64_t flat = oi_ptr[i], b = flat / t_max, t = flat % t_max;
      const T* q_row = q_ptr + qi_ptr[b * t_max + t] * qs0 + h * qs1;
      const int64_t* slots = kv_ptr + b * s_max;
      const bool* m_row = m_ptr ? m_ptr + b * ms0 + t * ms2 : nullptr;
      T* o_row = o_ptr + (i * heads + h) * d;
      const T *k_base = k_ptr + g * ks1, *v_base = v_ptr + g * vs1;
      if (d == 4 * Vec::size()) {
        attend_row<T, 4>(q_row, k_base, v_base, ks0, vs0, slots, m_row, ms3, s_max, d, scale, scores.data(), o_row);
      } else if (d == 8 * Vec::size()) {
        attend_row<T, 8>(q_row, k_base, v_base, ks0, vs0, slots, m_row, ms3, s_max, d, scale, scores.data(), o_row);
      } else {
        attend_row<T, 0>(q_row, k_base, v_base, ks0, vs0, slots, m_row, ms3, s_max, d, scale, scores.data(), o_row);
      }
    }
  });
}

// query [T, heads, d] (the step's rows; any strides with a unit last one), keys/values [slots, kv_heads, d]
// (one layer of the pool), kv_index [B, S] pool slot of each sequence's keys, mask [B, 1, T_max, S] (True:
// visible) or none, q_index [B, T_max] row of each query, out_index [n] flattened (b, t) of each output
// row. Returns [n, heads, d].
at::Tensor short_attention(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values,
                           const at::Tensor& kv_index, const std::optional<at::Tensor>& mask, const at::Tensor& q_index,
                           const at::Tensor& out_index, double scaling) {
  TORCH_CHECK(query.dim() == 3 && keys.dim() == 3 && values.dim() == 3, "short_attention: 3-d query, keys, values");
  TORCH_CHECK(query.scalar_type() == keys.scalar_type() && keys.scalar_type() == values.scalar_type(),
              "short_attention: query, keys and values share a dtype");
  TORCH_CHECK(query.stride(2) == 1 && keys.stride(2) == 1 && values.stride(2) == 1,
              "short_attention: rows must be contiguous along the head dimension");
  TORCH_CHECK(query.size(1) % keys.size(1) == 0, "short_attention: heads must be a multiple of key/value heads");
  TORCH_CHECK(query.size(2) % (2 * Vec::size()) == 0 && query.size(2) <= kMaxDim && keys.size(2) == query.size(2) &&
                  values.size(2) == query.size(2),
              "short_attention: a head dimension that is a multiple of ", 2 * Vec::size(), " up to ", kMaxDim);
  TORCH_CHECK(kv_index.scalar_type() == at::kLong && q_index.scalar_type() == at::kLong &&
                  out_index.scalar_type() == at::kLong, "short_attention: int64 indexes");
  TORCH_CHECK(!mask.has_value() || mask->scalar_type() == at::kBool, "short_attention: bool mask");
  auto kv = kv_index.contiguous(), qi = q_index.contiguous(), oi = out_index.contiguous();
  at::Tensor out = at::empty({oi.size(0), query.size(1), query.size(2)}, query.options());
  if (oi.size(0) == 0) return out;
  switch (query.scalar_type()) {
    case at::kFloat: run<float>(query, keys, values, kv, mask, qi, oi, scaling, out); break;
    case at::kBFloat16: run<c10::BFloat16>(query, keys, values, kv, mask, qi, oi, scaling, out); break;
    case at::kHalf: run<c10::Half>(query, keys, values, kv, mask, qi, oi, scaling, out); break;
    default: TORCH_CHECK(false, "short_attention: float32, bfloat16 or float16, not ", query.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(specstream, CPU, m) { m.impl("short_attention", &short_attention); }
