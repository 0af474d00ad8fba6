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
// each key and value is read once per pass, and each query's scores come 16 keys at a time. bfloat16 keys,
// queries, probabilities and values multiply as bfloat16 pairs (VDPBF16PS) where the CPU has it, the keys laid out
// once for all the queries of theirs a thread takes (attend_pairs).
//
// Where the CPU has AMX-BF16, bfloat16 with a head dimension of 64 takes tiles instead (attend_tiles): up to 16
// queries of a key/value head share each tile multiply, for the scores and for the sum over the values. It
// serves every call there, decode included, so a row's numbers stay the same in any step (README: row
// invariance). Its figures: docs/MEASUREMENTS.md, "Attention on AMX tiles".

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
#include <cstring>
#include <type_traits>
#include <limits>
#include <memory>
#include <tuple>
#include <vector>

namespace {

using specstream_kernels::sum_lanes;
using specstream_kernels::Vec;

constexpr int64_t kMaxDim = 256;
constexpr int64_t kVectorPath = 0, kTiles = 1;  // short_attention's paths (short_attention_paths)
// The path argument that picks as -1 does and asks the vector path's bfloat16 pairs to attend a tree row over the
// keys it sees laid side by side (attend_scattered): invariant mode's and a8's, which must give a tree row its
// path's bits. Elsewhere a tree row's result differs from its chain's only in rounding, and costs less in place.
constexpr int64_t kTreesAlone = -2;
constexpr int64_t kTileChunk = 16;  // queries that share one item on the AMX tiles
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

// Keys s0 .. s_end - 1 (of the s_max a query row may see) asked into the cache ahead of their reads: keys into L1,
// their values into L2 (read after every key is scored). A sequence's keys lie in blocks scattered over the pool,
// and between two steps the weights have pushed them out of every cache, so without this each block's first reads
// wait on memory one after another. A prefetch is only a hint: it never faults and never changes a result.
template <typename T>
inline void prefetch_keys(const T* k_base, const T* v_base, int64_t k_stride, int64_t v_stride, const int64_t* slots,
                          int64_t s0, int64_t s_end, int64_t d) {
  const int64_t bytes = d * static_cast<int64_t>(sizeof(T));
  for (int64_t s = s0; s < s_end; ++s) {
    const char* k = reinterpret_cast<const char*>(k_base + slots[s] * k_stride);
    const char* v = reinterpret_cast<const char*>(v_base + slots[s] * v_stride);
    for (int64_t b = 0; b < bytes; b += 64) {
      __builtin_prefetch(k + b, 0, 3);
      __builtin_prefetch(v + b, 0, 2);
    }
  }
}
constexpr int64_t kAhead = 32;  // keys asked for ahead of the ones being scored

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

// A query's 64 output dimensions from sums over value pairs (two keys' values interleaved by unpacklo/unpackhi_epi16
// on each 32-dimension half): part[2 h] holds dims 32 h + 8 L + i and part[2 h + 1] dims 32 h + 8 L + 4 + i, at lane
// 4 L + i. Each rounded once to T.
template <typename T>
inline void store_pair_sums(const float* const (&part)[4], T* o_row) {
  for (int64_t h = 0; h < 2; ++h)
    for (int64_t l = 0; l < 4; ++l)
      for (int64_t i = 0; i < 4; ++i) {
        o_row[32 * h + 8 * l + i] = static_cast<T>(part[2 * h][4 * l + i]);
        o_row[32 * h + 8 * l + 4 + i] = static_cast<T>(part[2 * h + 1][4 * l + i]);
      }
}

// A query's scores of the keys its mask hides (m_row: null hides none) set to -inf.
inline void hide_masked(float* sc, const bool* m_row, int64_t m_stride, int64_t s_max) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  if (m_row && m_stride == 1) {
    const __m512 hidden = _mm512_set1_ps(neg_inf);
    int64_t s = 0;
    for (; s + 16 <= s_max; s += 16) {
      const __m128i m = _mm_loadu_si128(reinterpret_cast<const __m128i*>(m_row + s));
      _mm512_mask_storeu_ps(sc + s, _mm_cmpeq_epi8_mask(m, _mm_setzero_si128()), hidden);
    }
    for (; s < s_max; ++s)
      if (!m_row[s]) sc[s] = neg_inf;
  } else if (m_row) {
    for (int64_t s = 0; s < s_max; ++s)
      if (!m_row[s * m_stride]) sc[s] = neg_inf;
  }
}

// The largest of sc[0, s_max).
inline float row_max(const float* sc, int64_t s_max) {
  int64_t s = 0;
  Vec vmax(-std::numeric_limits<float>::infinity());
  for (; s + Vec::size() <= s_max; s += Vec::size()) vmax = at::vec::maximum(vmax, Vec::loadu(sc + s));
  float top = _mm512_reduce_max_ps(vmax);
  for (; s < s_max; ++s) top = sc[s] > top ? sc[s] : top;
  return top;
}
// out[c] = column c of the 16 x 16 float32 rows in[0..15] (in is overwritten).
inline void transpose16(__m512* r, __m512* out) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  auto pd = [](__m512 x) { return _mm512_castps_pd(x); };
  for (int i = 0; i < 4; ++i) {  // r[4i + j], 128-bit lane L: column 4L + j of rows 4i .. 4i + 3
    r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(pd(t[4 * i]), pd(t[4 * i + 2])));
    r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(pd(t[4 * i]), pd(t[4 * i + 2])));
    r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(pd(t[4 * i + 1]), pd(t[4 * i + 3])));
    r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(pd(t[4 * i + 1]), pd(t[4 * i + 3])));
  }
  for (int j = 0; j < 4; ++j) {
    const __m512 a = _mm512_shuffle_f32x4(r[j], r[4 + j], 0x88), b = _mm512_shuffle_f32x4(r[j], r[4 + j], 0xDD);
    const __m512 c = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0x88), d = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0xDD);
    out[j] = _mm512_shuffle_f32x4(a, c, 0x88);
    out[4 + j] = _mm512_shuffle_f32x4(b, d, 0x88);
    out[8 + j] = _mm512_shuffle_f32x4(a, c, 0xDD);
    out[12 + j] = _mm512_shuffle_f32x4(b, d, 0xDD);
  }
}

// Which of keys s0 .. s0 + n - 1 (n <= 16) a query's mask row shows (null: all).
inline __mmask16 visible16(const bool* m_row, int64_t m_stride, int64_t s0, int64_t n) {
  const __mmask16 in = static_cast<__mmask16>((1u << n) - 1);
  if (!m_row) return in;
  if (m_stride == 1) return _mm_test_epi8_mask(_mm_maskz_loadu_epi8(in, m_row + s0), _mm_set1_epi8(1));
  __mmask16 out = 0;
  for (int64_t s = 0; s < n; ++s) out |= static_cast<__mmask16>(m_row[(s0 + s) * m_stride] ? 1u << s : 0u);
  return out;
}

// Where a query's mask row shows keys that are not one run (a draft tree's row: its ancestors, their siblings hidden
// between them), the indices of the keys it shows, in order; else none (a decode or chain row shows its first keys, a
// windowed row one run of them: nothing to lay side by side).
inline std::vector<int32_t> scattered_keys(const bool* m_row, int64_t m_stride, int64_t s_max) {
  std::vector<int32_t> vis;
  if (!m_row) return vis;
  int64_t runs = 0;
  uint32_t before = 0;  // whether the key before the block is shown
  for (int64_t s0 = 0; s0 < s_max; s0 += 16) {  // count the runs' starts, 16 keys at a time
    const uint32_t shown = visible16(m_row, m_stride, s0, std::min<int64_t>(16, s_max - s0));
    runs += __builtin_popcount(shown & ~(shown << 1 | before));
    before = shown >> 15 & 1;
  }
  if (runs < 2) return vis;
  for (int64_t s = 0; s < s_max; ++s)
    if (m_row[s * m_stride]) vis.push_back(static_cast<int32_t>(s));
  return vis;
}

constexpr int64_t kChunk = 4;   // most queries that share one pass over the keys and values

// A thread's buffers for attend_queries.
struct QueryScratch {
  explicit QueryScratch(int64_t s_pad) : scores(kChunk * s_pad), seen(new bool[s_pad]) {}
  std::vector<float> scores;
  std::unique_ptr<bool[]> seen;  // by key: whether a query of the pass sees it
  alignas(64) float kbuf[kBlock * 64];
};

// Up to kChunk queries of one sequence and one key/value head (its query heads, of one or more rows),
// d = 64, in float32 (float32 and float16; bfloat16 where the CPU has no VDPBF16PS, else attend_pairs below):
// each key and value is read and widened once for all of them, and each query's scores come 16
// keys at a time. Per query, the arithmetic is the same whatever else shares the pass (a query's result
// depends only on its query, keys and mask): a key no query of the pass sees is never read (its slot may
// hold anything), and a key hidden from one query but not another adds exactly 0 to the first.
template <typename T, int64_t NQ>
void attend_queries(const T* const* q_rows, const bool* const* m_rows, T* const* o_rows, const T* k_base,
                    const T* v_base, int64_t k_stride, int64_t v_stride, const int64_t* slots, int64_t m_stride,
                    int64_t s_max, float scale, float* scores, int64_t s_pad, float* kbuf, bool* seen_by) {
  constexpr int64_t V = 4, D = 64, nq = NQ;
  auto seen = [&](int64_t s) {
    for (int64_t j = 0; j < nq; ++j)
      if (!m_rows[j] || m_rows[j][s * m_stride]) return true;
    return false;
  };
  alignas(64) float qf[NQ * D];  // the queries widened to float32, once for the whole pass
  for (int64_t j = 0; j < nq; ++j) {
    Vec q[V];
    widen(q_rows[j], q, V);
    for (int64_t c = 0; c < V; ++c) q[c].store(qf + j * D + c * Vec::size());
  }
  prefetch_keys(k_base, v_base, k_stride, v_stride, slots, 0, std::min(kAhead, s_max), D);
  for (int64_t s0 = 0; s0 < s_max; s0 += kBlock) {
    const int64_t nb = std::min(kBlock, s_max - s0);
    prefetch_keys(k_base, v_base, k_stride, v_stride, slots, std::min(s0 + kAhead, s_max), std::min(s0 + kAhead + kBlock, s_max), D);
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
  // masked keys at -inf, then each query's softmax, each probability rounded to the values' dtype
  for (int64_t j = 0; j < nq; ++j) {
    float* sc = scores + j * s_pad;
    hide_masked(sc, m_rows[j], m_stride, s_max);
    softmax_rounded<T>(sc, s_max, row_max(sc, s_max));
  }
  __m512 acc[NQ][V];
  for (int64_t j = 0; j < nq; ++j)
    for (int64_t c = 0; c < V; ++c) acc[j][c] = _mm512_setzero_ps();
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

#if defined(__AVX512BF16__)
// bfloat16, d = 64, on VDPBF16PS (a product of two bfloat16 pairs, both products exact, added in float32): one
// sequence's keys for one key/value head laid out once for every query of theirs a thread takes (a verification's
// rows times the head's query heads: 27 queries at 9 rows of the bundled model) by pairs of dimensions, 16 keys a
// vector: keys[32 b + p] lane i holds dimensions 2p, 2p + 1 of key 16 b + i. A query's scores of 16 keys are then
// 32 VDPBF16PS of its broadcast pairs, one key a lane, with no sum across lanes (summing each query . key
// product's 16 lanes cost more than the products). Keys no row of the sequence sees (seen: by key, s_pad of them)
// are zero: their slots may hold anything, NaN included.
struct PairCache {
  int64_t b = -1, g = -1;  // whose keys it holds (b = -1: none)
  const __m512i* keys = nullptr;

  void fill(int64_t b_, int64_t g_, const c10::BFloat16* k_base, int64_t k_stride, const int64_t* slots, int64_t s_max,
            int64_t s_pad, const std::vector<bool>& seen) {
    b = b_, g = g_;
    room.resize(2 * s_pad * 16 + 16);  // 2 * s_pad vectors, and room to align them to 64 bytes
    __m512i* out = reinterpret_cast<__m512i*>((reinterpret_cast<uintptr_t>(room.data()) + 63) / 64 * 64);
    keys = out;
    const __m512i none = _mm512_setzero_si512();
    auto key = [&](int64_t s, int64_t h) {
      return seen[s] ? _mm512_loadu_si512(k_base + slots[s] * k_stride + 32 * h) : none;
    };
    for (int64_t s0 = 0; s0 < s_pad; s0 += 16) {
      for (int64_t s = std::min(s0 + kAhead, s_max); s < std::min(s0 + kAhead + 16, s_max); ++s) {
        __builtin_prefetch(k_base + slots[s] * k_stride, 0, 3);
        __builtin_prefetch(k_base + slots[s] * k_stride + 32, 0, 3);
      }
      for (int64_t h = 0; h < 2; ++h) {  // dimensions 32 h .. 32 h + 31: pairs 16 h .. 16 h + 15
        __m512 rows[16], pairs[16];
        for (int64_t i = 0; i < 16; ++i) rows[i] = _mm512_castsi512_ps(key(s0 + i, h));
        transpose16(rows, pairs);
        for (int64_t p = 0; p < 16; ++p) _mm512_store_si512(out + 2 * s0 + 16 * h + p, _mm512_castps_si512(pairs[p]));
      }
    }
  }

 private:
  std::vector<uint32_t> room;
};

// One query whose mask shows keys that are not one run (a draft tree's row: the n keys it sees, scattered_keys'),
// from its scaled scores sc (by key, before masking), over those keys laid side by side (dense: room for s_pad + 16
// floats). Each then has the place it has when the same path is verified as a chain or decoded: it lands in the
// same lane of the softmax's sum and in the same pair of the sum over values, and the row gets the chain's bits
// (README: the same tokens in any batch). In place, the hidden keys between them would shift the later ones. A key the shared pass
// counts as hidden adds an exact zero there, so a chain row would get these bits too.
inline void attend_scattered(const float* sc, const int32_t* keys, int64_t n, float* dense, const c10::BFloat16* v_base,
                             int64_t v_stride, const int64_t* slots, c10::BFloat16* o_row) {
  for (int64_t c = 0; c < n; ++c) dense[c] = sc[keys[c]];
  softmax_rounded<c10::BFloat16>(dense, n, row_max(dense, n));  // past n: zeros
  __m512 part[4];
  for (int64_t q = 0; q < 4; ++q) part[q] = _mm512_setzero_ps();
  const __m512i none = _mm512_setzero_si512();
  for (int64_t c = 0; c < n; c += 2) {
    const c10::BFloat16* a_row = v_base + slots[keys[c]] * v_stride;
    const c10::BFloat16* b_row = c + 1 < n ? v_base + slots[keys[c + 1]] * v_stride : nullptr;
    __m512bh pair[4];
    for (int64_t h = 0; h < 2; ++h) {
      const __m512i a = _mm512_loadu_si512(a_row + 32 * h), b = b_row ? _mm512_loadu_si512(b_row + 32 * h) : none;
      pair[2 * h] = (__m512bh)_mm512_unpacklo_epi16(a, b);
      pair[2 * h + 1] = (__m512bh)_mm512_unpackhi_epi16(a, b);
    }
    // the two probabilities' bfloat16 bits (softmax_rounded rounded them: the upper half of each float's bits)
    uint32_t lo, hi;
    std::memcpy(&lo, dense + c, sizeof(lo));
    std::memcpy(&hi, dense + c + 1, sizeof(hi));
    const __m512bh p = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(lo >> 16 | (hi >> 16) << 16));
    for (int64_t q = 0; q < 4; ++q) part[q] = _mm512_dpbf16_ps(part[q], p, pair[q]);
  }
  alignas(64) float lanes[64];
  for (int64_t q = 0; q < 4; ++q) _mm512_store_ps(lanes + q * 16, part[q]);
  store_pair_sums<c10::BFloat16>({lanes, lanes + 16, lanes + 32, lanes + 48}, o_row);
}

// Up to kChunk queries of one sequence and one key/value head against its PairCache (keys) and the pool (values,
// two keys at a time interleaved into pairs, which a query's two probabilities, already bfloat16, multiply as one
// broadcast pair). A query's scores are four chains of eight products (pairs p = c mod 4) added as (c0 + c1) +
// (c2 + c3), its output the sum over keys in order: the same arithmetic whatever else shares the pass, so a
// query's result depends on its query, keys and mask alone. scores: [NQ][s_pad] floats; probs: [NQ][s_pad]
// bfloat16 bits; seen_by: by key, whether a query of the pass sees it; scattered: by query, where not null
// (kTreesAlone) the keys it sees that are not one run (scattered_keys), attend_scattered's to attend, and the pass
// leaves it out; dense: attend_scattered's buffer.
template <int64_t NQ>
void attend_pairs(const c10::BFloat16* const* q_rows, const bool* const* m_rows, c10::BFloat16* const* o_rows,
                  const PairCache& cache, const c10::BFloat16* v_base, int64_t v_stride, const int64_t* slots,
                  int64_t m_stride, int64_t s_max, int64_t s_pad, float scale, float* scores, uint16_t* probs,
                  bool* seen_by, const std::vector<int32_t>* const* scattered, float* dense) {
  const __m512 vscale = _mm512_set1_ps(scale);
  const uint32_t* q[NQ];
  for (int64_t j = 0; j < NQ; ++j) q[j] = reinterpret_cast<const uint32_t*>(q_rows[j]);
  for (int64_t s0 = 0; s0 < s_pad; s0 += 16) {
    const int64_t n = std::clamp<int64_t>(s_max - s0, 0, 16);
    __mmask16 any = 0;
    for (int64_t j = 0; j < NQ; ++j) any |= visible16(m_rows[j], m_stride, s0, n);
    for (int64_t i = 0; i < 16; ++i) seen_by[s0 + i] = any >> i & 1;
    if (!any) {  // no query of the pass sees these keys: hide_masked sets those below s_max to -inf
      for (int64_t j = 0; j < NQ; ++j) _mm512_storeu_ps(scores + j * s_pad + s0, _mm512_setzero_ps());
      continue;
    }
    const __m512i* k = cache.keys + 2 * s0;
    __m512 acc[NQ][4];
    for (int64_t j = 0; j < NQ; ++j)
      for (int64_t c = 0; c < 4; ++c) acc[j][c] = _mm512_setzero_ps();
    for (int64_t p = 0; p < 32; p += 4) {
#pragma GCC unroll 4
      for (int64_t c = 0; c < 4; ++c) {
        const __m512bh kp = (__m512bh)_mm512_load_si512(k + p + c);
#pragma GCC unroll 4
        for (int64_t j = 0; j < NQ; ++j)
          acc[j][c] = _mm512_dpbf16_ps(acc[j][c], (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(q[j][p + c])), kp);
      }
    }
    for (int64_t j = 0; j < NQ; ++j) {
      const __m512 sum = _mm512_add_ps(_mm512_add_ps(acc[j][0], acc[j][1]), _mm512_add_ps(acc[j][2], acc[j][3]));
      _mm512_storeu_ps(scores + j * s_pad + s0, _mm512_mul_ps(sum, vscale));
    }
  }
  // masked keys at -inf, each query's softmax (probabilities rounded to bfloat16, zeros past s_max), and its
  // probabilities as bfloat16 bits (exact: the upper half of each float's bits)
  for (int64_t j = 0; j < NQ; ++j) {
    float* sc = scores + j * s_pad;
    if (scattered[j]) {  // its own pass, below it takes no part
      attend_scattered(sc, scattered[j]->data(), static_cast<int64_t>(scattered[j]->size()), dense, v_base, v_stride,
                       slots, o_rows[j]);
      continue;
    }
    hide_masked(sc, m_rows[j], m_stride, s_max);
    softmax_rounded<c10::BFloat16>(sc, s_max, row_max(sc, s_max));
    for (int64_t s = 0; s < s_pad; s += 16) {
      const __m512i bits = _mm512_srli_epi32(_mm512_castps_si512(_mm512_loadu_ps(sc + s)), 16);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(probs + j * s_pad + s), _mm512_cvtepi32_epi16(bits));
    }
  }
  // Keys two at a time: each query's two probabilities as one pair, times the keys' value pairs
  const __m512i none = _mm512_setzero_si512();
  auto value = [&](int64_t s, int64_t h) {
    return s < s_max && seen_by[s] ? _mm512_loadu_si512(v_base + slots[s] * v_stride + 32 * h) : none;
  };
  __m512 acc[NQ][4];
  for (int64_t j = 0; j < NQ; ++j)
    for (int64_t c = 0; c < 4; ++c) acc[j][c] = _mm512_setzero_ps();
  for (int64_t s = 0; s < s_max; s += 2) {
    for (int64_t a = s + kAhead; a < std::min(s + kAhead + 2, s_max); ++a) {
      __builtin_prefetch(v_base + slots[a] * v_stride, 0, 3);
      __builtin_prefetch(v_base + slots[a] * v_stride + 32, 0, 3);
    }
    if (!seen_by[s] && !seen_by[s + 1]) continue;  // keys no query of the pass sees (probabilities 0)
    __m512bh pair[4];
    for (int64_t h = 0; h < 2; ++h) {
      const __m512i a = value(s, h), b = value(s + 1, h);
      pair[2 * h] = (__m512bh)_mm512_unpacklo_epi16(a, b);
      pair[2 * h + 1] = (__m512bh)_mm512_unpackhi_epi16(a, b);
    }
#pragma GCC unroll 4
    for (int64_t j = 0; j < NQ; ++j) {
      if (scattered[j]) continue;
      int32_t two;
      std::memcpy(&two, probs + j * s_pad + s, sizeof(two));
      const __m512bh p = (__m512bh)_mm512_set1_epi32(two);
#pragma GCC unroll 4
      for (int64_t c = 0; c < 4; ++c) acc[j][c] = _mm512_dpbf16_ps(acc[j][c], p, pair[c]);
    }
  }
  for (int64_t j = 0; j < NQ; ++j) {
    if (scattered[j]) continue;  // attend_scattered's, above
    alignas(64) float lanes[64];
    for (int64_t c = 0; c < 4; ++c) _mm512_store_ps(lanes + c * 16, acc[j][c]);
    store_pair_sums<c10::BFloat16>({lanes, lanes + 16, lanes + 32, lanes + 48}, o_rows[j]);
  }
}
#endif
#endif

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
// AMX-BF16 (bfloat16, d = 64): up to 16 queries of one sequence and one key/value head share each tile
// multiply. Scores: per 16 keys, the keys (A: 16 x 32 values, twice for 64; read in place where their slots
// run consecutively in the pool, else gathered) times the queries' value pairs (B, built once per item) give
// the 16 keys' scores for every query (C), transposed to one row per query. Each query's softmax follows (torch's
// exp_u20, a lane-wise sum, the probabilities divided straight into bfloat16). Output: per 32 keys, the probabilities (A: queries x 32, bfloat16) times the keys' values
// interleaved into pairs (B, 16 dimensions a tile) add into four tiles of 16 x 16 float32 sums (C). Each sum of a
// tile is its row's and column's alone, so a query's result does not depend on the queries beside it; it differs
// from the vector path's in the order of its float32 additions, so one CPU takes one path for every call (the
// dispatcher picks the tiles wherever the CPU has them).
#define SPECSTREAM_ATTENTION_AMX 1

using specstream_kernels::amx_ready;

// Tiles 0-7, each 16 rows x 64 bytes. Scores: 4, 5 B (query pairs, dims 0-31, 32-63); two blocks in flight, 6, 7 A
// (keys) into 0 C and 2, 3 A into 1 C. Output: 0-3 C, 4 A (probabilities), 5, 6, 7 B (value pairs).
inline void configure_attention_tiles() {
  specstream_kernels::TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  __asm__ volatile("ldtilecfg %0" : : "m"(cfg));  // see common.h's configure_bf16_tiles
}

// A thread's buffers for attend_tiles, sized for s_max keys.
struct TileScratch {
  explicit TileScratch(int64_t s_max)
      : s_pad((s_max + 31) / 32 * 32), ld(s_pad + 32), scores(kTileChunk * ld), probs(kTileChunk * ld), seen(new bool[s_pad]) {}
  int64_t s_pad;                  // keys rounded up to whole blocks of 32
  int64_t ld;                     // row stride of scores and probs: s_pad and 128 bytes (rows a power of two
                                  // apart would share the L1 cache's sets)
  std::vector<float> scores;      // [query][key]
  std::vector<uint16_t> probs;    // [query][key], bfloat16 bits (rows past the item's queries: never read back)
  std::unique_ptr<bool[]> seen;   // by key: whether a query of the item sees it
  alignas(64) uint16_t keys[2][16 * 64];       // a block of 16 keys gathered (two: one per C tile in flight)
  alignas(64) uint16_t value_pairs[2][4][16 * 32];  // B tiles of 32 keys' values (two: one being read, one filled)
};

// Scores of a block of 16 keys (A: `keys`, rows `stride` bytes apart) against the queries (B: tiles 4, 5) into C
// tile 0 (keys on tiles 6, 7) or 1 (2, 3): two blocks in flight. GCC's tile macros take literal tile numbers.
inline void score_block_0(const void* keys, int64_t stride) {
  _tile_loadd(6, keys, stride);
  _tile_loadd(7, static_cast<const uint8_t*>(keys) + 64, stride);
  _tile_zero(0);
  _tile_dpbf16ps(0, 6, 4);
  _tile_dpbf16ps(0, 7, 5);
}
inline void score_block_1(const void* keys, int64_t stride) {
  _tile_loadd(2, keys, stride);
  _tile_loadd(3, static_cast<const uint8_t*>(keys) + 64, stride);
  _tile_zero(1);
  _tile_dpbf16ps(1, 2, 4);
  _tile_dpbf16ps(1, 3, 5);
}

// nq <= 16 queries of one sequence and one key/value head (q_rows, masks m_rows: null sees every key, results
// o_rows), their keys' pool slots, on the tiles configure_attention_tiles set up.
void attend_tiles(const c10::BFloat16* const* q_rows, const bool* const* m_rows, c10::BFloat16* const* o_rows,
                  int64_t nq, const c10::BFloat16* k_base, const c10::BFloat16* v_base, int64_t k_stride,
                  int64_t v_stride, int64_t pool_slots, const int64_t* slots, int64_t m_stride, int64_t s_max,
                  float scale, TileScratch& w) {
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const int64_t s_pad = w.s_pad;
  bool* seen = w.seen.get();
  bool all_see = false;
  for (int64_t j = 0; j < nq; ++j) all_see |= m_rows[j] == nullptr;
  for (int64_t s = 0; s < s_pad; s += 16) {  // bools are 0 or 1: the masks' bytes or'ed, 16 keys at a time
    const int64_t n = std::clamp<int64_t>(s_max - s, 0, 16);
    __mmask16 any = all_see ? static_cast<__mmask16>((1u << n) - 1) : 0;
    for (int64_t j = 0; j < nq && !all_see; ++j) any |= visible16(m_rows[j], m_stride, s, n);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(seen + s), _mm_maskz_set1_epi8(any, 1));
  }
  // the queries' value pairs, B of the scores: qb[h][p][q] = query q's values 32 h + 2 p, 32 h + 2 p + 1
  alignas(64) uint32_t qb[2][16][16] = {};
  for (int64_t j = 0; j < nq; ++j) {
    const uint32_t* q = reinterpret_cast<const uint32_t*>(q_rows[j]);
    for (int64_t p = 0; p < 32; ++p) qb[p / 16][p % 16][j] = q[p];
  }
  _tile_loadd(4, qb[0], 64);
  _tile_loadd(5, qb[1], 64);

  // Scores, a block of 16 keys at a time, the next block's multiply in flight while this one's sums are read:
  // scaled, masked to -inf (and blocks no query sees skipped: -inf), each query's running maximum kept.
  __m512 top[16];
  for (int64_t j = 0; j < nq; ++j) top[j] = neg_inf;
  auto next_block = [&](int64_t s0) {
    for (; s0 < s_max; s0 += 16) {
      bool any = false;
      for (int64_t s = s0; s < std::min(s0 + 16, s_max); ++s) any |= seen[s];
      if (any) return s0;
      for (int64_t j = 0; j < nq; ++j) _mm512_storeu_ps(w.scores.data() + j * w.ld + s0, neg_inf);
    }
    return s_max;
  };
  auto issue = [&](int64_t s0, int which) {  // the block's keys in place where 16 slots run consecutively, else
    const int64_t nb = std::min<int64_t>(16, s_max - s0);  // gathered (keys no query sees as zeros: any slot)
    bool in_place = nb == 16 && slots[s0] >= 0 && slots[s0] + 16 <= pool_slots;
    for (int64_t s = 1; s < nb && in_place; ++s) in_place = slots[s0 + s] == slots[s0] + s;
    const void* a = k_base + slots[s0] * k_stride;
    int64_t stride = k_stride * 2;
    if (!in_place) {
      uint16_t* buf = w.keys[which];
      for (int64_t s = 0; s < 16; ++s) {
        const bool read = s < nb && seen[s0 + s];
        const c10::BFloat16* key = read ? k_base + slots[s0 + s] * k_stride : nullptr;
        _mm512_store_si512(buf + s * 64, read ? _mm512_loadu_si512(key) : _mm512_setzero_si512());
        _mm512_store_si512(buf + s * 64 + 32, read ? _mm512_loadu_si512(key + 32) : _mm512_setzero_si512());
      }
      a = buf;
      stride = 128;
    }
    if (which == 0)
      score_block_0(a, stride);
    else
      score_block_1(a, stride);
  };
  alignas(64) float c[16 * 16];
  const __m512 vscale = _mm512_set1_ps(scale);
  int which = 0;
  int64_t s0 = next_block(0);
  if (s0 < s_max) issue(s0, which);
  while (s0 < s_max) {
    const int64_t s1 = next_block(s0 + 16);
    if (s1 < s_max) issue(s1, which ^ 1);
    if (which == 0)
      _tile_stored(0, c, 64);
    else
      _tile_stored(1, c, 64);
    __m512 in[16], rows[16];
    for (int i = 0; i < 16; ++i) in[i] = _mm512_load_ps(c + 16 * i);
    transpose16(in, rows);
    const int64_t nb = std::min<int64_t>(16, s_max - s0);
    for (int64_t j = 0; j < nq; ++j) {
      const __m512 x = _mm512_mask_mov_ps(neg_inf, visible16(m_rows[j], m_stride, s0, nb), _mm512_mul_ps(rows[j], vscale));
      _mm512_storeu_ps(w.scores.data() + j * w.ld + s0, x);
      top[j] = _mm512_max_ps(top[j], x);
    }
    s0 = s1;
    which ^= 1;
  }
  // Each query's softmax: exp(x - top) (exp_u20: torch's flash attention's, 20 ulp; the probabilities are
  // rounded to bfloat16 next, 2^-8), summed lane by lane as softmax_rounded sums them, and divided by the sum
  // straight into bfloat16 (zeros past the keys, to a whole block of 32).
  for (int64_t j = 0; j < nq; ++j) {
    float* sc = w.scores.data() + j * w.ld;
    const __m512 vtop = _mm512_set1_ps(_mm512_reduce_max_ps(top[j]));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t s = 0; s < s_max; s += 16) {
      const __mmask16 in = static_cast<__mmask16>((1u << std::min<int64_t>(16, s_max - s)) - 1);
      const __m512 e = _mm512_maskz_mov_ps(in, Vec(_mm512_sub_ps(_mm512_loadu_ps(sc + s), vtop)).exp_u20());
      _mm512_storeu_ps(sc + s, e);
      sum = _mm512_add_ps(sum, e);
    }
    const __m512 total = _mm512_set1_ps(_mm512_reduce_add_ps(sum));
    uint16_t* pr = w.probs.data() + j * w.ld;
    for (int64_t s = 0; s < s_pad; s += 16) {
      const __m512 p = s < s_max ? _mm512_div_ps(_mm512_loadu_ps(sc + s), total) : _mm512_setzero_ps();
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + s), (__m256i)_mm512_cvtneps_pbh(p));
    }
  }
  // Output, 32 keys at a time into C tiles 0-3, column 4 L + i of tile c as store_pair_sums reads part[c]; values
  // of keys no query sees as zeros (their slots may hold anything; p = 0 times NaN).
  const __m512i none = _mm512_setzero_si512();
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  auto multiply = [&](int64_t s0, const uint16_t (*vb)[16 * 32]) {
    _tile_loadd(4, w.probs.data() + s0, w.ld * 2);
    _tile_loadd(5, vb[0], 64);
    _tile_loadd(6, vb[1], 64);
    _tile_loadd(7, vb[2], 64);
    _tile_dpbf16ps(0, 4, 5);
    _tile_dpbf16ps(1, 4, 6);
    _tile_dpbf16ps(2, 4, 7);
    _tile_loadd(5, vb[3], 64);
    _tile_dpbf16ps(3, 4, 5);
  };
  // a block's value pairs are filled one block ahead of their tile loads (a tile load right after the vector
  // stores that wrote its bytes waits for them to drain)
  int fill = 0;
  int64_t pending = -1;
  for (int64_t s0 = 0; s0 < s_max; s0 += 32) {
    bool any = false;
    for (int64_t s = s0; s < s0 + 32; ++s) any |= seen[s];
    if (!any) continue;
    auto load = [&](int64_t s, int64_t h) {
      return s < s_max && seen[s] ? _mm512_loadu_si512(v_base + slots[s] * v_stride + 32 * h) : none;
    };
    uint16_t(*vb)[16 * 32] = w.value_pairs[fill];
    for (int64_t p = 0; p < 16; ++p) {
      const int64_t s = s0 + 2 * p;
      for (int64_t h = 0; h < 2; ++h) {
        const __m512i a = load(s, h), b = load(s + 1, h);
        _mm512_store_si512(vb[2 * h] + p * 32, _mm512_unpacklo_epi16(a, b));
        _mm512_store_si512(vb[2 * h + 1] + p * 32, _mm512_unpackhi_epi16(a, b));
      }
    }
    if (pending >= 0) multiply(pending, w.value_pairs[fill ^ 1]);
    pending = s0;
    fill ^= 1;
  }
  if (pending >= 0) multiply(pending, w.value_pairs[fill ^ 1]);
  alignas(64) float out[4][16 * 16];
  _tile_stored(0, out[0], 64);
  _tile_stored(1, out[1], 64);
  _tile_stored(2, out[2], 64);
  _tile_stored(3, out[3], 64);
  for (int64_t j = 0; j < nq; ++j)
    store_pair_sums<c10::BFloat16>({out[0] + j * 16, out[1] + j * 16, out[2] + j * 16, out[3] + j * 16}, o_rows[j]);
}
#endif

// Without AVX-512, or for a head dimension other than 64: each work item is one query row and one head.
template <typename T>
void run(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& kv_index,
         const std::optional<at::Tensor>& mask, const at::Tensor& q_index, const at::Tensor& out_index, double scaling,
         at::Tensor& out, int64_t path, bool trees_alone) {
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
    // heads of the sequence's rows; 16 on the tiles), in chunks small enough to give every thread two items or
    // more (on the tiles: one or more, a smaller item costing nearly as much as a full one).
    std::vector<std::vector<int64_t>> rows_of(kv_index.size(0));
    for (int64_t i = 0; i < n; ++i) rows_of[oi_ptr[i] / t_max].push_back(i);
    const int64_t kv_heads = keys.size(1);
    auto count = [&](int64_t chunk) {
      int64_t items = 0;
      for (const auto& rows : rows_of) items += kv_heads * ((static_cast<int64_t>(rows.size()) * group + chunk - 1) / chunk);
      return items;
    };
    const bool tiles = path == kTiles;
    int64_t chunk = tiles ? kTileChunk : kChunk;
    while (chunk > 1 && count(chunk) < (tiles ? 1 : 2) * at::get_num_threads()) --chunk;
    struct Item {
      int64_t b, g, first, last;  // queries first .. last - 1 of (b, g), query q = row q / group, head q % group
    };
    std::vector<Item> items;
    for (int64_t b = 0; b < static_cast<int64_t>(rows_of.size()); ++b) {
      const int64_t total = static_cast<int64_t>(rows_of[b].size()) * group;
      for (int64_t g = 0; g < kv_heads; ++g)
        for (int64_t q = 0; q < total; q += chunk) items.push_back({b, g, q, std::min(q + chunk, total)});
    }
    // an item's queries, their masks (null: none) and their output rows
    auto item_rows = [&](const Item& it, const T** q_rows, const bool** m_rows, T** o_rows) {
      for (int64_t q = it.first; q < it.last; ++q) {
        const int64_t i = rows_of[it.b][q / group], h = it.g * group + q % group;
        const int64_t t = oi_ptr[i] % t_max;
        q_rows[q - it.first] = q_ptr + qi_ptr[it.b * t_max + t] * qs0 + h * qs1;
        m_rows[q - it.first] = m_ptr ? m_ptr + it.b * ms0 + t * ms2 : nullptr;
        o_rows[q - it.first] = o_ptr + (i * heads + h) * d;
      }
    };
    const int64_t s_pad = (s_max + kBlock - 1) / kBlock * kBlock;
#if defined(SPECSTREAM_ATTENTION_AMX)
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      if (tiles) {
        at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
          TileScratch scratch(s_max);
          configure_attention_tiles();
          for (int64_t w = begin; w < end; ++w) {
            const Item& it = items[w];
            const T* q_rows[kTileChunk];
            const bool* m_rows[kTileChunk];
            T* o_rows[kTileChunk];
            item_rows(it, q_rows, m_rows, o_rows);
            attend_tiles(q_rows, m_rows, o_rows, it.last - it.first, k_ptr + it.g * ks1, v_ptr + it.g * vs1, ks0, vs0,
                         keys.size(0), kv_ptr + it.b * s_max, ms3, s_max, scale, scratch);
          }
          _tile_release();
        });
        return;
      }
    }
#endif
    // The items split among threads: start() runs once a thread, before its items, and returns what the thread
    // keeps for them (its buffers); attend(kept, nq, item, q_rows, m_rows, o_rows) runs for each item, nq its
    // query count as a template argument (1 .. kChunk).
    auto over_items = [&](auto&& start, auto&& attend) {
      at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
        auto kept = start();
        for (int64_t w = begin; w < end; ++w) {
          const Item& it = items[w];
          const T* q_rows[kChunk];
          const bool* m_rows[kChunk];
          T* o_rows[kChunk];
          item_rows(it, q_rows, m_rows, o_rows);
          auto call = [&](auto nq) { attend(kept, nq, it, q_rows, m_rows, o_rows); };
          switch (it.last - it.first) {
            case 1: call(std::integral_constant<int64_t, 1>{}); break;
            case 2: call(std::integral_constant<int64_t, 2>{}); break;
            case 3: call(std::integral_constant<int64_t, 3>{}); break;
            default: call(std::integral_constant<int64_t, kChunk>{}); break;
          }
        }
      });
    };
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      // by sequence and key: whether a row of the sequence sees the key (the keys its PairCache holds)
      std::vector<std::vector<bool>> seen_of(rows_of.size(), std::vector<bool>(s_pad));
      for (int64_t b = 0; b < static_cast<int64_t>(rows_of.size()); ++b)
        for (int64_t s0 = 0; s0 < s_pad; s0 += 16) {
          const int64_t n = std::clamp<int64_t>(s_max - s0, 0, 16);
          __mmask16 any = 0;
          for (int64_t i : rows_of[b])
            any |= visible16(m_ptr ? m_ptr + b * ms0 + (oi_ptr[i] % t_max) * ms2 : nullptr, ms3, s0, n);
          for (int64_t j = 0; j < 16; ++j) seen_of[b][s0 + j] = any >> j & 1;
        }
      // by output row, where trees_alone: the keys it sees where they are not one run (empty: none such)
      std::vector<std::vector<int32_t>> scattered_of(trees_alone ? n : 0);
      for (int64_t i = 0; i < static_cast<int64_t>(scattered_of.size()) && m_ptr; ++i)
        scattered_of[i] = scattered_keys(m_ptr + (oi_ptr[i] / t_max) * ms0 + (oi_ptr[i] % t_max) * ms2, ms3, s_max);
      over_items(
          [&] {
            thread_local PairCache cache;  // kept for its memory; what it holds is this call's only from fill
            thread_local std::vector<float> scores;
            thread_local std::vector<uint16_t> probs;
            thread_local std::vector<float> dense;
            cache.b = -1;
            scores.resize(kChunk * s_pad);
            probs.resize(kChunk * s_pad);
            dense.resize(s_pad + 16);
            return std::make_tuple(&cache, scores.data(), probs.data(), std::unique_ptr<bool[]>(new bool[s_pad]), dense.data());
          },
          [&](auto& kept, auto nq, const Item& it, const T** q_rows, const bool** m_rows, T** o_rows) {
            auto& [cache, scores, probs, seen, dense] = kept;
            const std::vector<int32_t>* scattered[kChunk] = {};  // the item's queries' keys, where not one run
            for (int64_t q = it.first; q < it.last && trees_alone; ++q) {
              const std::vector<int32_t>& keys = scattered_of[rows_of[it.b][q / group]];
              scattered[q - it.first] = keys.empty() ? nullptr : &keys;
            }
            if (cache->b != it.b || cache->g != it.g)
              cache->fill(it.b, it.g, k_ptr + it.g * ks1, ks0, kv_ptr + it.b * s_max, s_max, s_pad, seen_of[it.b]);
            attend_pairs<decltype(nq)::value>(q_rows, m_rows, o_rows, *cache, v_ptr + it.g * vs1, vs0,
                                              kv_ptr + it.b * s_max, ms3, s_max, s_pad, scale, scores, probs, seen.get(),
                                              scattered, dense);
          });
      return;
    }
#endif
    over_items([&] { return QueryScratch(s_pad); },
               [&](QueryScratch& kept, auto nq, const Item& it, const T** q_rows, const bool** m_rows, T** o_rows) {
                 attend_queries<T, decltype(nq)::value>(q_rows, m_rows, o_rows, k_ptr + it.g * ks1, v_ptr + it.g * vs1,
                                                        ks0, vs0, kv_ptr + it.b * s_max, ms3, s_max, scale,
                                                        kept.scores.data(), s_pad, kept.kbuf, kept.seen.get());
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

// The paths this CPU and build have: 0 (vector), 1 (AMX-BF16 tiles: bfloat16, head dimension 64).
std::vector<int64_t> short_attention_paths() {
  std::vector<int64_t> out{kVectorPath};
#if defined(SPECSTREAM_ATTENTION_AMX)
  if (amx_ready()) out.push_back(kTiles);
#endif
  return out;
}

// Whether bfloat16 with a head dimension of 64 takes the vector path's bfloat16 pairs by default here (attend_pairs:
// built with AVX512-BF16, and no AMX tiles on this CPU).
bool short_attention_pairs() {
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
  const std::vector<int64_t> paths = short_attention_paths();
  return std::find(paths.begin(), paths.end(), kTiles) == paths.end();
#else
  return false;
#endif
}

// query [T, heads, d] (the step's rows; any strides with a unit last one), keys/values [slots, kv_heads, d]
// (one layer of the pool), kv_index [B, S] pool slot of each sequence's keys, mask [B, 1, T_max, S] (True:
// visible) or none, q_index [B, T_max] row of each query, out_index [n] flattened (b, t) of each output
// row; path -1 picks (the AMX tiles for bfloat16 and a head dimension of 64 wherever the CPU has them, at every
// row count: a row's numbers are then the same in any step), -2 picks so and lays a tree row's keys side by side
// (kTreesAlone), 0 or 1 asks for one. Returns [n, heads, d].
at::Tensor short_attention(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values,
                           const at::Tensor& kv_index, const std::optional<at::Tensor>& mask, const at::Tensor& q_index,
                           const at::Tensor& out_index, double scaling, int64_t path) {
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
  static const std::vector<int64_t> paths = short_attention_paths();
  const bool fits_tiles = query.scalar_type() == at::kBFloat16 && query.size(2) == 64 &&
                          std::find(paths.begin(), paths.end(), kTiles) != paths.end();
  TORCH_CHECK(path >= kTreesAlone && path <= kTiles, "short_attention: path -2, -1, 0 or 1, not ", path);
  const bool trees_alone = path == kTreesAlone;
  TORCH_CHECK(path != kTiles || fits_tiles,
              "short_attention: the AMX path needs bfloat16, a head dimension of 64, and a CPU and build with AMX-BF16");
  if (path < 0) path = fits_tiles ? kTiles : kVectorPath;
  auto kv = kv_index.contiguous(), qi = q_index.contiguous(), oi = out_index.contiguous();
  at::Tensor out = at::empty({oi.size(0), query.size(1), query.size(2)}, query.options());
  if (oi.size(0) == 0) return out;
  switch (query.scalar_type()) {
    case at::kFloat: run<float>(query, keys, values, kv, mask, qi, oi, scaling, out, path, trees_alone); break;
    case at::kBFloat16: run<c10::BFloat16>(query, keys, values, kv, mask, qi, oi, scaling, out, path, trees_alone); break;
    case at::kHalf: run<c10::Half>(query, keys, values, kv, mask, qi, oi, scaling, out, path, trees_alone); break;
    default: TORCH_CHECK(false, "short_attention: float32, bfloat16 or float16, not ", query.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(specstream, CPU, m) { m.impl("short_attention", &short_attention); }

TORCH_LIBRARY_FRAGMENT(specstream, m) {
  m.def("short_attention_paths() -> int[]", &short_attention_paths);
  m.def("short_attention_pairs() -> bool", &short_attention_pairs);
}
