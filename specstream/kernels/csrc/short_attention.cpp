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
//
// With AVX-512 and a head dimension of 64 (the bundled model's), the queries that read the same keys (a
// key/value head's query heads, for each of a sequence's rows) share one pass over them, a few at a time:
// each key and value is read once per pass, each query's scores come 16 keys at a time, and bfloat16
// keys, queries, probabilities and values multiply as bfloat16 pairs (VDPBF16PS) where the CPU has it.
// Measured with 2 threads over 1024 keys: a decode step's attention 71 -> 54 us a layer, a verification
// of 9 rows 448 -> 210 us (benchmarks/cpu_kernels.py).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include "common.h"

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <limits>
#include <memory>
#include <tuple>
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

// scores[0, n) in place: exp(x - top) / their sum, each rounded to T (exp(-inf) = 0 for masked keys). The buffer
// holds n rounded up to whole vectors, and the keys past n count as masked: every score goes through the same
// vector exp and lands in the same lane of the sum whatever n is, so a row's probabilities do not depend on how
// many keys its step spans (a verification row sees its later rows' keys masked, a decode row does not see them).
template <typename T>
inline void softmax_rounded(float* scores, int64_t n, float top) {
  const int64_t padded = (n + Vec::size() - 1) / Vec::size() * Vec::size();
  for (int64_t s = n; s < padded; ++s) scores[s] = -std::numeric_limits<float>::infinity();
  const Vec vtop(top);
  Vec vsum(0.f);
  for (int64_t s = 0; s < padded; s += Vec::size()) {
    const Vec e = (Vec::loadu(scores + s) - vtop).exp();
    e.store(scores + s);
    vsum = vsum + e;
  }
  const float total = sum_lanes(vsum);
  const Vec vtotal(total);
  int64_t s = 0;
  for (; s + 2 * Vec::size() <= padded; s += 2 * Vec::size()) {
    Vec lo = Vec::loadu(scores + s) / vtotal, hi = Vec::loadu(scores + s + Vec::size()) / vtotal;
    if constexpr (!std::is_same_v<T, float>) std::tie(lo, hi) = at::vec::convert_to_float<T>(at::vec::convert_from_float<T>(lo, hi));
    lo.store(scores + s);
    hi.store(scores + s + Vec::size());
  }
  for (; s < n; ++s) scores[s] = static_cast<float>(static_cast<T>(scores[s] / total));
}

// Room for a row's scores: s_max rounded up to whole vectors (softmax_rounded).
inline int64_t score_room(int64_t s_max) { return (s_max + Vec::size() - 1) / Vec::size() * Vec::size(); }

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
  softmax_rounded<T>(scores, s_max, top);
  Vec acc[VECS ? VECS : kMaxVecs];
  for (int64_t c = 0; c < vecs; ++c) acc[c] = Vec(0.f);
  for (int64_t s = 0; s < s_max; ++s) {
    if (scores[s] == 0.f) continue;  // masked, or too small to count
    widen(v_base + slots[s] * v_stride, row, vecs);
    const Vec p(scores[s]);
    for (int64_t c = 0; c < vecs; ++c) acc[c] = at::vec::fmadd(p, row[c], acc[c]);
  }
  float out[kMaxDim];
  for (int64_t c = 0; c < vecs; ++c) acc[c].store(out + c * Vec::size());
  for (int64_t j = 0; j < d; ++j) o_row[j] = static_cast<T>(out[j]);
}


#if defined(CPU_CAPABILITY_AVX512)
// Lane s of the result: the sum of v[s]'s 16 lanes (a transpose-and-add tree: 45 instructions for 16 sums,
// where reducing each vector alone takes 8 and a chain of dependent steps).
inline __m512 sum_each(const __m512* v) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i)
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
}

constexpr int64_t kBlock = 16;  // keys scored together
constexpr int64_t kChunk = 4;   // most queries that share one pass over the keys and values

// Up to kChunk queries of one sequence and one key/value head (its query heads, of one or more rows),
// d = 64: each key and value is read and widened once for all of them, and each query's scores come 16
// keys at a time. Per query, the arithmetic is the same whatever else shares the pass (a query's result
// depends only on its query, keys and mask): a key no query of the pass sees is never read (its slot may
// hold anything), and a key hidden from one query but not another adds exactly 0 to the first.
template <typename T, int64_t NQ>
void attend_queries(const T* const* q_rows, const bool* const* m_rows, T* const* o_rows, const T* k_base,
                    const T* v_base, int64_t k_stride, int64_t v_stride, const int64_t* slots, int64_t m_stride,
                    int64_t s_max, float scale, float* scores, int64_t s_pad, float* kbuf, bool* seen_by) {
  constexpr int64_t V = 4, D = 64, nq = NQ;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  auto seen = [&](int64_t s) {
    for (int64_t j = 0; j < nq; ++j)
      if (!m_rows[j] || m_rows[j][s * m_stride]) return true;
    return false;
  };
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    // bfloat16 keys and queries as they are: each key is two vectors of bfloat16 pairs, and one pair
    // product (VDPBF16PS: both products exact, added in float32) does the work of two widenings and two FMAs.
    for (int64_t s0 = 0; s0 < s_max; s0 += kBlock) {
      const int64_t nb = std::min(kBlock, s_max - s0);
      const T* key[kBlock];
      for (int64_t s = 0; s < kBlock; ++s)
        key[s] = s < nb && (seen_by[s0 + s] = seen(s0 + s)) ? k_base + slots[s0 + s] * k_stride : nullptr;
#pragma GCC unroll 4
      for (int64_t j = 0; j < nq; ++j) {
        const __m512bh q0 = (__m512bh)_mm512_loadu_si512(q_rows[j]), q1 = (__m512bh)_mm512_loadu_si512(q_rows[j] + 32);
        __m512 part[kBlock];
        for (int64_t s = 0; s < kBlock; ++s) {
          if (!key[s]) {
            part[s] = _mm512_setzero_ps();
            continue;
          }
          const __m512 x = _mm512_dpbf16_ps(_mm512_setzero_ps(), q0, (__m512bh)_mm512_loadu_si512(key[s]));
          part[s] = _mm512_dpbf16_ps(x, q1, (__m512bh)_mm512_loadu_si512(key[s] + 32));
        }
        _mm512_storeu_ps(scores + j * s_pad + s0, _mm512_mul_ps(sum_each(part), _mm512_set1_ps(scale)));
      }
    }
  } else
#endif
  {
    alignas(64) float qf[NQ * D];  // the queries widened to float32, once for the whole pass
    for (int64_t j = 0; j < nq; ++j) {
      Vec q[V];
      widen(q_rows[j], q, V);
      for (int64_t c = 0; c < V; ++c) q[c].store(qf + j * D + c * Vec::size());
    }
    for (int64_t s0 = 0; s0 < s_max; s0 += kBlock) {
      const int64_t nb = std::min(kBlock, s_max - s0);
      for (int64_t s = 0; s < kBlock; ++s) {
        Vec row[V];
        if (s < nb && (seen_by[s0 + s] = seen(s0 + s))) {
          widen(k_base + slots[s0 + s] * k_stride, row, V);
        } else {
          for (int64_t c = 0; c < V; ++c) row[c] = Vec(0.f);
        }
        for (int64_t c = 0; c < V; ++c) row[c].store(kbuf + s * D + c * Vec::size());
      }
      for (int64_t j = 0; j < nq; ++j) {
        const __m512 q0 = _mm512_load_ps(qf + j * D), q1 = _mm512_load_ps(qf + j * D + 16);
        const __m512 q2 = _mm512_load_ps(qf + j * D + 32), q3 = _mm512_load_ps(qf + j * D + 48);
        __m512 part[kBlock];
        for (int64_t s = 0; s < kBlock; ++s) {
          const float* k = kbuf + s * D;
          __m512 x = _mm512_mul_ps(q0, _mm512_load_ps(k));
          x = _mm512_fmadd_ps(q1, _mm512_load_ps(k + 16), x);
          x = _mm512_fmadd_ps(q2, _mm512_load_ps(k + 32), x);
          part[s] = _mm512_fmadd_ps(q3, _mm512_load_ps(k + 48), x);
        }
        _mm512_storeu_ps(scores + j * s_pad + s0, _mm512_mul_ps(sum_each(part), _mm512_set1_ps(scale)));
      }
    }
  }
  // masked keys at -inf, then each query's softmax, each probability rounded to the values' dtype
  for (int64_t j = 0; j < nq; ++j) {
    float* sc = scores + j * s_pad;
    if (m_rows[j] && m_stride == 1) {
      const __m512 hidden = _mm512_set1_ps(neg_inf);
      int64_t s = 0;
      for (; s + 16 <= s_max; s += 16) {
        const __m128i m = _mm_loadu_si128(reinterpret_cast<const __m128i*>(m_rows[j] + s));
        _mm512_mask_storeu_ps(sc + s, _mm_cmpeq_epi8_mask(m, _mm_setzero_si128()), hidden);
      }
      for (; s < s_max; ++s)
        if (!m_rows[j][s]) sc[s] = neg_inf;
    } else if (m_rows[j]) {
      for (int64_t s = 0; s < s_max; ++s)
        if (!m_rows[j][s * m_stride]) sc[s] = neg_inf;
    }
    int64_t s = 0;
    Vec vmax(neg_inf);
    for (; s + Vec::size() <= s_max; s += Vec::size()) vmax = at::vec::maximum(vmax, Vec::loadu(sc + s));
    float top = _mm512_reduce_max_ps(vmax);
    for (; s < s_max; ++s) top = sc[s] > top ? sc[s] : top;
    softmax_rounded<T>(sc, s_max, top);
  }
  __m512 acc[NQ][V];
  for (int64_t j = 0; j < nq; ++j)
    for (int64_t c = 0; c < V; ++c) acc[j][c] = _mm512_setzero_ps();
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    // Keys two at a time: their values interleaved into bfloat16 pairs, times each query's two
    // probabilities (already rounded to bfloat16, so exactly representable), one VDPBF16PS per 16 lanes.
    // acc[j][2h] holds dims 32h + 8L + i and acc[j][2h + 1] dims 32h + 8L + 4 + i, at lane 4L + i.
    const __m512i none = _mm512_setzero_si512();
    auto load = [&](int64_t s, int64_t h) {
      return s < s_max && seen_by[s] ? _mm512_loadu_si512(v_base + slots[s] * v_stride + 32 * h) : none;
    };
    for (int64_t s = 0; s < s_max; s += 2) {
      if (!seen_by[s] && (s + 1 >= s_max || !seen_by[s + 1])) continue;  // keys no query of the pass sees
      __m512bh pair[V];
      for (int64_t h = 0; h < 2; ++h) {
        const __m512i a = load(s, h), b = load(s + 1, h);
        pair[2 * h] = (__m512bh)_mm512_unpacklo_epi16(a, b);
        pair[2 * h + 1] = (__m512bh)_mm512_unpackhi_epi16(a, b);
      }
#pragma GCC unroll 4
      for (int64_t j = 0; j < nq; ++j) {
        const float* sc = scores + j * s_pad;
        const c10::BFloat16 p0(sc[s]), p1(s + 1 < s_max ? sc[s + 1] : 0.f);
        const __m512bh p = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(p0.x) | (static_cast<int32_t>(p1.x) << 16));
#pragma GCC unroll 4
        for (int64_t c = 0; c < V; ++c) acc[j][c] = _mm512_dpbf16_ps(acc[j][c], p, pair[c]);
      }
    }
    for (int64_t j = 0; j < nq; ++j) {
      alignas(64) float lanes[D];
      for (int64_t c = 0; c < V; ++c) _mm512_store_ps(lanes + c * 16, acc[j][c]);
      for (int64_t h = 0; h < 2; ++h)
        for (int64_t l = 0; l < 4; ++l)
          for (int64_t i = 0; i < 4; ++i) {
            o_rows[j][32 * h + 8 * l + i] = static_cast<T>(lanes[(2 * h) * 16 + 4 * l + i]);
            o_rows[j][32 * h + 8 * l + 4 + i] = static_cast<T>(lanes[(2 * h + 1) * 16 + 4 * l + i]);
          }
    }
    return;
  }
#endif
  for (int64_t s = 0; s < s_max; ++s) {
    if (!seen_by[s]) continue;  // a key no query of the pass sees: its slot may hold anything
    Vec row[V];
    widen(v_base + slots[s] * v_stride, row, V);
#pragma GCC unroll 4
    for (int64_t j = 0; j < nq; ++j) {
      // p = 0 (hidden from this query, or too small to count) adds exactly 0: the value is finite
      const __m512 p = _mm512_set1_ps(scores[j * s_pad + s]);
#pragma GCC unroll 4
      for (int64_t c = 0; c < V; ++c) acc[j][c] = _mm512_fmadd_ps(p, row[c], acc[j][c]);
    }
  }
  for (int64_t j = 0; j < nq; ++j) {
    alignas(64) float out[D];
    for (int64_t c = 0; c < V; ++c) _mm512_store_ps(out + c * 16, acc[j][c]);
    for (int64_t e = 0; e < D; ++e) o_rows[j][e] = static_cast<T>(out[e]);
  }
}
#endif

// Without AVX-512, or for a head dimension other than 64: each work item is one query row and one head.
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

#if defined(CPU_CAPABILITY_AVX512)
  if (d == 4 * Vec::size()) {
    // Work items: a sequence, a key/value head and up to kChunk of the queries that read it (the group's
    // heads of the sequence's rows), in chunks small enough to give every thread two items or more.
    std::vector<std::vector<int64_t>> rows_of(kv_index.size(0));
    for (int64_t i = 0; i < n; ++i) rows_of[oi_ptr[i] / t_max].push_back(i);
    const int64_t kv_heads = keys.size(1);
    auto count = [&](int64_t chunk) {
      int64_t items = 0;
      for (const auto& rows : rows_of) items += kv_heads * ((static_cast<int64_t>(rows.size()) * group + chunk - 1) / chunk);
      return items;
    };
    int64_t chunk = kChunk;
    while (chunk > 1 && count(chunk) < 2 * at::get_num_threads()) --chunk;
    struct Item {
      int64_t b, g, first, last;  // queries first .. last - 1 of (b, g), query q = row q / group, head q % group
    };
    std::vector<Item> items;
    for (int64_t b = 0; b < static_cast<int64_t>(rows_of.size()); ++b) {
      const int64_t total = static_cast<int64_t>(rows_of[b].size()) * group;
      for (int64_t g = 0; g < kv_heads; ++g)
        for (int64_t q = 0; q < total; q += chunk) items.push_back({b, g, q, std::min(q + chunk, total)});
    }
    const int64_t s_pad = (s_max + kBlock - 1) / kBlock * kBlock;
    at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores(kChunk * s_pad);
      std::unique_ptr<bool[]> seen(new bool[s_pad]);  // by key: whether a query of the pass sees it
      alignas(64) float kbuf[kBlock * 64];
      for (int64_t w = begin; w < end; ++w) {
        const Item& it = items[w];
        const T* q_rows[kChunk];
        const bool* m_rows[kChunk];
        T* o_rows[kChunk];
        for (int64_t q = it.first; q < it.last; ++q) {
          const int64_t i = rows_of[it.b][q / group], h = it.g * group + q % group;
          const int64_t t = oi_ptr[i] % t_max;
          q_rows[q - it.first] = q_ptr + qi_ptr[it.b * t_max + t] * qs0 + h * qs1;
          m_rows[q - it.first] = m_ptr ? m_ptr + it.b * ms0 + t * ms2 : nullptr;
          o_rows[q - it.first] = o_ptr + (i * heads + h) * d;
        }
        const T *k_base = k_ptr + it.g * ks1, *v_base = v_ptr + it.g * vs1;
        const int64_t* slots = kv_ptr + it.b * s_max;
        switch (it.last - it.first) {
#define SPECSTREAM_ATTEND(NQ)                                                                                       \
  case NQ:                                                                                                          \
    attend_queries<T, NQ>(q_rows, m_rows, o_rows, k_base, v_base, ks0, vs0, slots, ms3, s_max, scale, scores.data(), \
                          s_pad, kbuf, seen.get());                                                                \
    break;
          SPECSTREAM_ATTEND(1)
          SPECSTREAM_ATTEND(2)
          SPECSTREAM_ATTEND(3)
          SPECSTREAM_ATTEND(4)
#undef SPECSTREAM_ATTEND
        }
      }
    });
    return;
  }
#endif
  at::parallel_for(0, n * heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(score_room(s_max));
    for (int64_t w = begin; w < end; ++w) {
      const int64_t i = w / heads, h = w % heads, g = h / group;
      const int64_t flat = oi_ptr[i], b = flat / t_max, t = flat % t_max;
      const T* q_row = q_ptr + qi_ptr[b * t_max + t] * qs0 + h * qs1;
      const int64_t* slots = kv_ptr + b * s_max;
      const bool* m_row = m_ptr ? m_ptr + b * ms0 + t * ms2 : nullptr;
      T* o_row = o_ptr + (i * heads + h) * d;
      const T *k_base = k_ptr + g * ks1, *v_base = v_ptr + g * vs1;
      if (d == 8 * Vec::size()) {
        attend_row<T, 8>(q_row, k_base, v_base, ks0, vs0, slots, m_row, ms3, s_max, d, scale, scores.data(), o_row);
      } else if (d == 4 * Vec::size()) {
        attend_row<T, 4>(q_row, k_base, v_base, ks0, vs0, slots, m_row, ms3, s_max, d, scale, scores.data(), o_row);
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
