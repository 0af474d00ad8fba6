// y = x @ W^T for weights in GGUF Q8_0's form (quant.py Int8Blocks): W[n, k] = d[n, k / 32] * c[n, k], int8 codes
// and a float32 scale per block of 32, on CPU; or per block of 16 (GGUF Q6_K: 6-bit codes, less 32, and a scale per
// 16 inputs, a super-block's float16 d times the sub-block's int8 scale).
//
// torch has no kernel for 8-bit weights with a scale per block (its int8 kernel takes one per row), so these
// were served as two 4-bit planes (1.25 bytes per weight read, two kernel calls). This reads the file's own
// bytes once (1.125 per weight). For the bundled model's LM head (49152 x 576) it is the one projection of a
// step not inside a layer, and the largest: a verification needs its logits at every row, so its cost at
// a few rows (decode 1, a verification 9, 8 streams 8) counts.
//
// Per block of 32 inputs and output n, the codes multiply x first and the block's scale applies once:
//     y[n] = sum_g d[n, g] * (sum_{j in g} c[n, j] x[j])
// The products c x are exact in float32 for bfloat16 x (8 by 8 significant bits) and the sums float32, so the
// weights multiplied are the file's; y is rounded once to x's dtype. Two paths compute the inner sums:
//   - float32 (any x dtype, widened), with fused multiply-adds: each vector of 32 codes (16 outputs at two
//     inputs) is widened once per pass and multiplied into up to 8 rows;
//   - bfloat16 pairs (bfloat16 x, 5 rows or more, where the CPU has AVX512-BF16): the 32 codes become 32
//     bfloat16 values (exact) and one VDPBF16PS multiplies them into a row's two inputs: 32 multiply-adds an
//     instruction where float32 does 16 (and the codes are widened once for all the rows of a pass).
//
// Layout (quant.PackedInt8Blocks), tiles of 16 outputs, each output's two inputs 2j, 2j + 1 side by side (the
// pair a bfloat16 lane multiplies):
//   codes  [N / 16, K / 2, 32] int8: byte [t, j, 2 i + h] = c[16 t + i, 2 j + h]
//   scales [N / 16, K / G, 16] float32: d of output 16 t + i in block g, G = 32 (Q8_0) or 16 (Q6_K)

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "common.h"

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

using specstream_kernels::as_float;
#if defined(CPU_CAPABILITY_AVX512)
using specstream_kernels::store_tile;
#endif

constexpr int64_t kTile = 16;  // outputs per tile
constexpr int64_t kBlock = 32;  // inputs a row of x must come in multiples of; a scale's block: 32 or 16 (GROUP)

// The paths: 0 the vector path (float32 FMA, or VDPBF16PS pairs from 5 rows of bfloat16 x; scalar without AVX-512),
// 1 AMX-BF16 tiles (bfloat16 x, a scale per 32 inputs).
// kInvariant (-2) asks for row invariance: a row's outputs are the same bits whatever the call's row count, so one
// path for every row count (the tiles where -1 would take them for many rows, else the vector path with bfloat16
// pairs even for one row, or float32 with one chain a row).
constexpr int64_t kVector = 0, kAmx = 1, kInvariant = -2;
// AMX pays from this many rows of bfloat16 x, fewer take the vector path. Timed alone on a 2-core Xeon with AMX, the
// bundled model's LM head, 49152 x 576: AMX 0.66x the vector path at 1 row, even at 4, 4.4x at 9, 5.3x at 16; in a
// forward, where the other layers' weights have pushed it out of the cache, the tiles win from 2 rows (q4_linear.cpp's
// kAmxMinRows says by how much).
constexpr int64_t kAmxMinRows = 2;

#if defined(CPU_CAPABILITY_AVX512)

constexpr int64_t kRowsF32 = 8;    // rows of x per pass over a tile, float32 path
constexpr int64_t kRowsBf16 = 12;  // bfloat16 path (one sum per row, and the accumulators)

// The 32 codes of input pair j: outputs 0..7 (lanes 2 i + h) and 8..15, as float32 (exact).
inline void widen_pair(const int8_t* c, __m512& low, __m512& high) {
  low = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c))));
  high = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + 16))));
}

// ROWS rows of x (float32, row stride k) against one tile, in float32. Per block, CHAINS independent sums per row
// and half (pairs j alternate between chains, so one row does not wait on the adder), for outputs 0..7 and 8..15
// with each output's two inputs in adjacent lanes; at the block's end the lanes of a pair add up and d applies.
template <int64_t GROUP, int64_t ROWS, int64_t CHAINS>
inline void tile_f32(const float* x, int64_t k, const int8_t* codes, const float* scales, __m512* out) {
  constexpr int64_t kPairs = GROUP / 2;  // input pairs per block
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  __m512 acc[ROWS];
  for (int64_t r = 0; r < ROWS; ++r) acc[r] = _mm512_setzero_ps();
  const int64_t blocks = k / GROUP;
  for (int64_t g = 0; g < blocks; ++g) {
    __m512 low[ROWS][CHAINS], high[ROWS][CHAINS];
    for (int64_t r = 0; r < ROWS; ++r)
      for (int64_t c = 0; c < CHAINS; ++c) low[r][c] = high[r][c] = _mm512_setzero_ps();
    const int8_t* cg = codes + g * kPairs * 2 * kTile;
    const float* xg = x + g * GROUP;
    for (int64_t j0 = 0; j0 < kPairs; j0 += CHAINS) {
#pragma GCC unroll 2
      for (int64_t c = 0; c < CHAINS; ++c) {
        const int64_t j = j0 + c;
        __m512 wl, wh;
        widen_pair(cg + j * 2 * kTile, wl, wh);
        for (int64_t r = 0; r < ROWS; ++r) {
          double pair;  // x[2 j], x[2 j + 1] in every pair of lanes
          std::memcpy(&pair, xg + r * k + 2 * j, sizeof(pair));
          const __m512 xp = _mm512_castpd_ps(_mm512_set1_pd(pair));
          low[r][c] = _mm512_fmadd_ps(wl, xp, low[r][c]);
          high[r][c] = _mm512_fmadd_ps(wh, xp, high[r][c]);
        }
      }
    }
    const __m512 d = _mm512_loadu_ps(scales + g * kTile);
    for (int64_t r = 0; r < ROWS; ++r) {
      __m512 l = low[r][0], h = high[r][0];
      for (int64_t c = 1; c < CHAINS; ++c) l = _mm512_add_ps(l, low[r][c]), h = _mm512_add_ps(h, high[r][c]);
      const __m512 sum =
          _mm512_add_ps(_mm512_permutex2var_ps(l, even, h), _mm512_permutex2var_ps(l, odd, h));  // output i: lane i
      acc[r] = _mm512_fmadd_ps(d, sum, acc[r]);
    }
  }
  for (int64_t r = 0; r < ROWS; ++r) out[r] = acc[r];
}

#if defined(__AVX512BF16__)

// ROWS rows of bfloat16 x (its bits, row stride k) against one tile: per input pair, the 32 codes as bfloat16
// (lane i: output i's two inputs) and one VDPBF16PS per row with the row's two inputs in every lane.
template <int64_t GROUP, int64_t ROWS>
inline void tile_bf16(const uint16_t* x, int64_t k, const int8_t* codes, const float* scales, __m512* out) {
  constexpr int64_t kPairs = GROUP / 2;
  __m512 acc[ROWS];
  for (int64_t r = 0; r < ROWS; ++r) acc[r] = _mm512_setzero_ps();
  const int64_t blocks = k / GROUP;
  for (int64_t g = 0; g < blocks; ++g) {
    __m512 part[ROWS];
    for (int64_t r = 0; r < ROWS; ++r) part[r] = _mm512_setzero_ps();
    const int8_t* cg = codes + g * kPairs * 2 * kTile;
    const uint16_t* xg = x + g * GROUP;
    for (int64_t j = 0; j < kPairs; ++j) {
      __m512 wl, wh;
      widen_pair(cg + j * 2 * kTile, wl, wh);
      const __m512bh w = _mm512_cvtne2ps_pbh(wh, wl);  // words 0..15 from wl, 16..31 from wh: exact
      for (int64_t r = 0; r < ROWS; ++r) {
        int32_t pair;
        std::memcpy(&pair, xg + r * k + 2 * j, sizeof(pair));
        part[r] = _mm512_dpbf16_ps(part[r], w, (__m512bh)_mm512_set1_epi32(pair));
      }
    }
    const __m512 d = _mm512_loadu_ps(scales + g * kTile);
    for (int64_t r = 0; r < ROWS; ++r) acc[r] = _mm512_fmadd_ps(d, part[r], acc[r]);
  }
  for (int64_t r = 0; r < ROWS; ++r) out[r] = acc[r];
}

#endif

#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)

// AMX-BF16 (Q8_0's scale per 32 inputs): per pair of blocks, TDPBF16PS multiplies up to 16 rows of bfloat16 x (A, read
// in place) by the block's codes as bfloat16 pairs (B: 16 x 64 bytes, the vectors tile_bf16 multiplies, exact) into
// 16 x 16 float32 sums, and d then applies per block. The codes are widened once per block for all the rows.
#define SPECSTREAM_Q8_AMX 1

using specstream_kernels::amx_ready;

inline void b_tile(const int8_t* cg, uint16_t* buf) {
  for (int64_t j = 0; j < kBlock / 2; ++j) {
    __m512 wl, wh;
    widen_pair(cg + j * 2 * kTile, wl, wh);
    _mm512_store_si512(buf + j * 32, (__m512i)_mm512_cvtne2ps_pbh(wh, wl));
  }
}

// rows <= 16 rows of x (bfloat16 bits, row stride k) against one tile; the caller configured the tiles for `rows`.
// kept, fill: the tile's widened codes kept across passes (common.h's bf16_tile_blocks).
void amx_tile(const uint16_t* x, int64_t k, int64_t rows, const int8_t* codes, const float* scales, __m512* out,
              uint16_t* kept, bool fill) {
  for (int64_t r = 0; r < rows; ++r) out[r] = _mm512_setzero_ps();
  specstream_kernels::bf16_tile_blocks(
      x, k, [&](int64_t g, uint16_t* buf) { b_tile(codes + g * kBlock * kTile, buf); },
      [&](const float* c, int64_t g) {
        const __m512 d = _mm512_loadu_ps(scales + g * kTile);
        for (int64_t r = 0; r < rows; ++r) out[r] = _mm512_fmadd_ps(d, _mm512_load_ps(c + r * 16), out[r]);
      },
      kept, fill);
}

#endif

// Rows m0 .. m0 + rows of x against tile t (codes c, scales d) into out, by the float32 path.
template <int64_t G>
inline void pass_f32(const float* x, int64_t rows, int64_t k, const int8_t* c, const float* d, __m512* out,
                     bool invariant) {
  if (invariant && rows < 4) {  // one chain a row, as from 4 rows
    switch (rows) {
      case 1: tile_f32<G, 1, 1>(x, k, c, d, out); break;
      case 2: tile_f32<G, 2, 1>(x, k, c, d, out); break;
      default: tile_f32<G, 3, 1>(x, k, c, d, out); break;
    }
    return;
  }
  switch (rows) {
    case 1: tile_f32<G, 1, 2>(x, k, c, d, out); break;
    case 2: tile_f32<G, 2, 2>(x, k, c, d, out); break;
    case 3: tile_f32<G, 3, 2>(x, k, c, d, out); break;
    case 4: tile_f32<G, 4, 1>(x, k, c, d, out); break;
    case 5: tile_f32<G, 5, 1>(x, k, c, d, out); break;
    case 6: tile_f32<G, 6, 1>(x, k, c, d, out); break;
    case 7: tile_f32<G, 7, 1>(x, k, c, d, out); break;
    default: tile_f32<G, 8, 1>(x, k, c, d, out); break;
  }
}

#if defined(__AVX512BF16__)
template <int64_t G>
inline void pass_bf16(const uint16_t* x, int64_t rows, int64_t k, const int8_t* c, const float* d, __m512* out) {
  switch (rows) {
    case 1: tile_bf16<G, 1>(x, k, c, d, out); break;
    case 2: tile_bf16<G, 2>(x, k, c, d, out); break;
    case 3: tile_bf16<G, 3>(x, k, c, d, out); break;
    case 4: tile_bf16<G, 4>(x, k, c, d, out); break;
    case 5: tile_bf16<G, 5>(x, k, c, d, out); break;
    case 6: tile_bf16<G, 6>(x, k, c, d, out); break;
    case 7: tile_bf16<G, 7>(x, k, c, d, out); break;
    case 8: tile_bf16<G, 8>(x, k, c, d, out); break;
    case 9: tile_bf16<G, 9>(x, k, c, d, out); break;
    case 10: tile_bf16<G, 10>(x, k, c, d, out); break;
    case 11: tile_bf16<G, 11>(x, k, c, d, out); break;
    default: tile_bf16<G, 12>(x, k, c, d, out); break;
  }
}
#endif

template <typename T, int64_t G>
void run(const float* x, const uint16_t* xb, const int8_t* codes, const float* scales, T* y, int64_t m_rows,
         int64_t n_rows, int64_t k, int64_t path, bool invariant) {
  const int64_t tiles = n_rows / kTile, blocks = k / G;
#if defined(SPECSTREAM_Q8_AMX)
  if (path == kAmx) {
    specstream_kernels::bf16_tile_passes(
        tiles, m_rows, n_rows, k, y, [&](int64_t t, int64_t m0, int64_t rows, __m512* out, uint16_t* kept, bool fill) {
          amx_tile(xb + m0 * k, k, rows, codes + t * (k / 2) * 2 * kTile, scales + t * blocks * kTile, out, kept, fill);
        });
    return;
  }
#endif
  // bfloat16 pairs from 5 rows: below, widening the codes to bfloat16 costs more than the pairs save (measured on
  // an AMD EPYC: float32 faster at 1-3 rows, even at 4, pairs 1.2-1.4x faster at 5-16). Row invariance: pairs at every
  // row count.
#if defined(__AVX512BF16__)
  const bool pairs = xb != nullptr && (m_rows >= 5 || invariant);
#else
  const bool pairs = false;
  (void)xb;
#endif
  const int64_t group = pairs ? kRowsBf16 : kRowsF32;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    __m512 out[kRowsBf16];
    for (int64_t t = begin; t < end; ++t) {
      const int8_t* c = codes + t * (k / 2) * 2 * kTile;
      const float* d = scales + t * blocks * kTile;
      for (int64_t m0 = 0; m0 < m_rows; m0 += group) {
        const int64_t rows = std::min(group, m_rows - m0);
#if defined(__AVX512BF16__)
        if (pairs)
          pass_bf16<G>(xb + m0 * k, rows, k, c, d, out);
        else
#endif
          pass_f32<G>(x + m0 * k, rows, k, c, d, out, invariant);
        for (int64_t r = 0; r < rows; ++r) store_tile(y + (m0 + r) * n_rows + t * kTile, out[r]);
      }
    }
  });
}

#else

// Without AVX-512: the same sums (per block, then d), one output at a time.
template <typename T, int64_t G>
void run(const float* x, const uint16_t* /*xb*/, const int8_t* codes, const float* scales, T* y, int64_t m_rows,
         int64_t n_rows, int64_t k, int64_t /*path*/, bool /*invariant*/) {
  const int64_t tiles = n_rows / kTile, blocks = k / G;
  constexpr int64_t kPairs = G / 2;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int8_t* c = codes + t * (k / 2) * 2 * kTile;
      const float* d = scales + t * blocks * kTile;
      for (int64_t r = 0; r < m_rows; ++r) {
        float acc[kTile] = {};
        for (int64_t g = 0; g < blocks; ++g) {
          float part[kTile] = {};
          for (int64_t j = g * kPairs; j < (g + 1) * kPairs; ++j) {
            const float x0 = x[r * k + 2 * j], x1 = x[r * k + 2 * j + 1];
            const int8_t* cj = c + j * 2 * kTile;
            for (int64_t i = 0; i < kTile; ++i) part[i] += cj[2 * i] * x0 + cj[2 * i + 1] * x1;
          }
          for (int64_t i = 0; i < kTile; ++i) acc[i] += d[g * kTile + i] * part[i];
        }
        for (int64_t i = 0; i < kTile; ++i) y[r * n_rows + t * kTile + i] = static_cast<T>(acc[i]);
      }
    }
  });
}

#endif

std::vector<int64_t> q8_paths() {
  std::vector<int64_t> out{kVector};
#if defined(SPECSTREAM_Q8_AMX)
  if (amx_ready()) out.push_back(kAmx);
#endif
  return out;
}

// x [M, K] (float32, bf16 or fp16), codes [N / 16, K / 2, 32] int8, scales [N / 16, K / G, 16] float32 (G = 32 or
// 16); path -1 picks (AMX for kAmxMinRows rows or more of bfloat16 x, G = 32, where the CPU has it), 0 or 1 asks for
// one (1: bfloat16 x, G = 32, on a CPU and build with AMX-BF16), -2 (kInvariant) picks one for every row count and
// sums a row alike at every row count. Returns [M, N] in x's dtype.
at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, int64_t path) {
  TORCH_CHECK(x.dim() == 2 && codes.dim() == 3 && scales.dim() == 3, "q8_linear: 2-d x, 3-d codes and scales");
  TORCH_CHECK(codes.scalar_type() == at::kChar && scales.scalar_type() == at::kFloat, "q8_linear: int8 codes, float32 scales");
  const int64_t m = x.size(0), k = x.size(1), n = codes.size(0) * kTile;
  const bool sixteen = k % kBlock == 0 && scales.size(1) == k / 16;
  TORCH_CHECK(k % kBlock == 0 && codes.size(1) == k / 2 && codes.size(2) == 2 * kTile && scales.size(0) == codes.size(0) &&
                  (scales.size(1) == k / kBlock || sixteen) && scales.size(2) == kTile,
              "q8_linear: x [M, K], codes [N / 16, K / 2, 32], scales [N / 16, K / 32 or K / 16, 16] with K a multiple of "
              "32; got ", x.sizes(), ", ", codes.sizes(), ", ", scales.sizes());
  auto c = codes.contiguous();
  auto s = scales.contiguous();
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0) return y;
  const std::vector<float> widened = as_float(x);
  // bfloat16 x is multiplied as it is (its bits, rows packed) on the pair path.
  at::Tensor packed = x.scalar_type() == at::kBFloat16 ? x.contiguous() : at::Tensor();
  const auto* xb = packed.defined() ? reinterpret_cast<const uint16_t*>(packed.data_ptr<c10::BFloat16>()) : nullptr;
  const auto* cp = c.data_ptr<int8_t>();
  const auto* sp = s.data_ptr<float>();
  static const std::vector<int64_t> paths = q8_paths();
  const bool amx = std::find(paths.begin(), paths.end(), kAmx) != paths.end() && xb != nullptr && !sixteen;
  TORCH_CHECK(path >= kInvariant && path <= kAmx, "q8_linear: path -2, -1, 0 or 1, not ", path);
  TORCH_CHECK(path != kAmx || amx, "q8_linear: the AMX path needs bfloat16 x, a scale per 32 inputs and a CPU and build "
              "with AMX-BF16");
  const bool invariant = path == kInvariant;
  if (path < 0) path = amx && (invariant || m >= kAmxMinRows) ? kAmx : kVector;
  auto with_group = [&](auto group) {
    constexpr int64_t G = decltype(group)::value;
    switch (x.scalar_type()) {
      case at::kFloat: run<float, G>(widened.data(), nullptr, cp, sp, y.data_ptr<float>(), m, n, k, path, invariant); break;
      case at::kBFloat16: run<c10::BFloat16, G>(widened.data(), xb, cp, sp, y.data_ptr<c10::BFloat16>(), m, n, k, path, invariant); break;
      case at::kHalf: run<c10::Half, G>(widened.data(), nullptr, cp, sp, y.data_ptr<c10::Half>(), m, n, k, path, invariant); break;
      default: TORCH_CHECK(false, "q8_linear: float32, bfloat16 or float16 x, not ", x.scalar_type());
    }
  };
  if (sixteen)
    with_group(std::integral_constant<int64_t, 16>{});
  else
    with_group(std::integral_constant<int64_t, 32>{});
  return y;
}

}  // namespace

TORCH_LIBRARY_IMPL(specstream, CPU, m) { m.impl("q8_linear", &q8_linear); }

TORCH_LIBRARY_FRAGMENT(specstream, m) { m.def("q8_paths() -> int[]", &q8_paths); }
