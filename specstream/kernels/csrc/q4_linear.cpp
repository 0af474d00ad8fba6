// y = x @ W^T for 4-bit block weights (GGUF Q4_0/Q4_1, quant.py Int4Weights): W[n, k] = d * c + m, a 4-bit
// code c and float16 d and m per block of 32 inputs, on CPU.
//
// torch's int4 kernel (_weight_int4pack_mm_for_cpu) serves one row well, but its cost grows almost in step
// with the rows (at 9 rows, a verification of 8 drafts, 5x one row's), so a verification cost several
// decode steps. Here each vector of 16 weights (16 outputs at one input) is widened to float32 once and
// multiplied into up to 12 rows of x, whose sums for those 16 outputs stay in registers. d * c + m is
// computed in float32 from the file's float16 d and m, as GGUF's own dequantization does, so the weights
// multiplied are the file's; sums are float32, rounded once to the output dtype.
//
// Layout (quant.PackedQ4), tiles of 16 outputs:
//   codes  [N / 16, K / 2, 16] uint8: byte [t, j, i] holds c[16 t + i, 2 j] (low nibble) and c[16 t + i, 2 j + 1]
//   scales [N / 16, K / 32, 16] float16: d of output 16 t + i in block g; mins the same for m. float32 where float16
//   cannot hold them (Q4_K's d is a super-block's float16 d times a 6-bit sub-block scale).

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include "common.h"

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace {

using specstream_kernels::as_float;
#if defined(CPU_CAPABILITY_AVX512)
using specstream_kernels::store_tile;
#endif
using specstream_kernels::Vec;

constexpr int64_t kTile = 16;  // outputs per tile
constexpr int64_t kBlock = 32;
constexpr int64_t kRows = 12;  // rows of x per pass over a tile

// The paths: 0 the vector path (float32 FMA, or VDPBF16PS pairs from 2 rows of bfloat16 x; scalar without AVX-512),
// 1 AMX-BF16 tiles (bfloat16 x only). kInvariant (-2) asks for row invariance: a row's outputs are the same bits
// whatever the call's row count, so one path for every row count (the tiles where -1 would take them for many
// rows, else the vector path with bfloat16 pairs even for one row) and one chain a row in every pass.
constexpr int64_t kVector = 0, kAmx = 1, kInvariant = -2;
// AMX pays from this many rows of bfloat16 x, fewer take the vector path. Timed alone on a 2-core Xeon with AMX over
// the bundled model's layer shapes (a weight called again and again, so read from the cache): AMX 0.74-0.75x the
// vector path at 1 row, 0.85-0.97x at 2, 1.6-1.8x at 4, 1.9-2.2x at 9, 2.3-2.7x at 16. In a forward every weight
// comes from memory, and there the tiles win from 2 rows: the bundled model's forward over 512 positions took
// 13.3 / 13.8 / 14.2 ms at 2 / 3 / 4 rows with the tiles from 2 rows (this and q8_linear's LM head), 14.0 / 19.0 / 15.8
// with them from 4 (5 for the LM head); a 1-row decode was no faster on them.
constexpr int64_t kAmxMinRows = 2;

#if defined(CPU_CAPABILITY_AVX512)

// One pass of ROWS rows over a tile's K / 32 blocks: block_sums(g, part) leaves each row's CHAINS partial sums of
// c * x over block g in part, and the block's d and m then apply once: acc += d * sum + m * sum(x) (xsum: each
// row's sums of x per block, [rows, K / 32]).
// A block's 16 d or m: float16 (a GGUF file's Q4_0/Q4_1), or float32 where float16 cannot hold them (Q4_K: a
// super-block's float16 d times a sub-block's 6-bit scale).
inline __m512 load16(const c10::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

template <int64_t ROWS, int64_t CHAINS, typename S, typename BlockSums>
inline void over_blocks(int64_t k, const S* scales, const S* mins, const float* xsum, __m512* out,
                        BlockSums&& block_sums) {
  __m512 acc[ROWS];
  for (int64_t r = 0; r < ROWS; ++r) acc[r] = _mm512_setzero_ps();
  const int64_t blocks = k / kBlock;
  for (int64_t g = 0; g < blocks; ++g) {
    __m512 part[ROWS][CHAINS];
    for (int64_t r = 0; r < ROWS; ++r)
      for (int64_t c = 0; c < CHAINS; ++c) part[r][c] = _mm512_setzero_ps();
    block_sums(g, part);
    const __m512 d = load16(scales + g * kTile);
    const __m512 m = load16(mins + g * kTile);
    for (int64_t r = 0; r < ROWS; ++r) {
      __m512 sum = part[r][0];
      for (int64_t c = 1; c < CHAINS; ++c) sum = _mm512_add_ps(sum, part[r][c]);
      acc[r] = _mm512_fmadd_ps(d, sum, acc[r]);
      acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(xsum[r * blocks + g]), acc[r]);
    }
  }
  for (int64_t r = 0; r < ROWS; ++r) out[r] = acc[r];
}

// ROWS rows of x (float32, row stride k) against one tile. Within a block the codes themselves multiply x
// (CHAINS independent sums per row, 1, 2 or 4, so that few rows do not wait on the adder), and the block's d and m
// apply once: sum_j (d c_j + m) x_j = d sum_j c_j x_j + m sum_j x_j, with xsum [rows, K / 32] the second sums.
template <int64_t ROWS, int64_t CHAINS, typename S>
inline void tile_rows(const float* x, const float* xsum, int64_t k, const uint8_t* codes, const S* scales, const S* mins,
                      __m512* out) {
  const __m512i low_mask = _mm512_set1_epi32(0x0F);
  over_blocks<ROWS, CHAINS>(k, scales, mins, xsum, out, [&](int64_t g, __m512 (&part)[ROWS][CHAINS]) {
    const uint8_t* cg = codes + g * (kBlock / 2) * kTile;
    const float* xg = x + g * kBlock;
    // Two input pairs per step; with 4 chains the second pair feeds chains 2 and 3 (indexes known at
    // compile time, so the sums stay in registers).
    constexpr int64_t a0 = 0, a1 = CHAINS > 1 ? 1 : 0, b0 = CHAINS > 2 ? 2 : a0, b1 = CHAINS > 2 ? 3 : a1;
    for (int64_t j = 0; j < kBlock / 2; j += 2) {
      const __m512i bytes0 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(cg + j * kTile)));
      const __m512i bytes1 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(cg + (j + 1) * kTile)));
      const __m512 c00 = _mm512_cvtepi32_ps(_mm512_and_si512(bytes0, low_mask));
      const __m512 c01 = _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes0, 4));
      const __m512 c10 = _mm512_cvtepi32_ps(_mm512_and_si512(bytes1, low_mask));
      const __m512 c11 = _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes1, 4));
      for (int64_t r = 0; r < ROWS; ++r) {
        const float* xr = xg + r * k + 2 * j;
        part[r][a0] = _mm512_fmadd_ps(_mm512_set1_ps(xr[0]), c00, part[r][a0]);
        part[r][a1] = _mm512_fmadd_ps(_mm512_set1_ps(xr[1]), c01, part[r][a1]);
        part[r][b0] = _mm512_fmadd_ps(_mm512_set1_ps(xr[2]), c10, part[r][b0]);
        part[r][b1] = _mm512_fmadd_ps(_mm512_set1_ps(xr[3]), c11, part[r][b1]);
      }
    }
  });
}

#if defined(__AVX512BF16__)

// The 16 code pairs of one layout row (inputs 2j and 2j + 1 of a tile's 16 outputs) as bfloat16 pairs: word 2i the
// low code of output i (input 2j), word 2i + 1 its high code (input 2j + 1). Exact: codes are 0..15.
inline __m512bh code_pairs(const uint8_t* row) {
  // bfloat16 bits of 0.0 .. 15.0, twice (vpermw indexes 32 words).
  alignas(64) static const uint16_t kCodes[32] = {
      0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0, 0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170,
      0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0, 0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170};
  const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row)));
  const __m512i index = _mm512_or_si512(_mm512_and_si512(bytes, _mm512_set1_epi32(0x0F)),
                                        _mm512_slli_epi32(_mm512_and_si512(bytes, _mm512_set1_epi32(0xF0)), 12));
  return (__m512bh)_mm512_permutexvar_epi16(index, _mm512_load_si512(kCodes));
}

// bfloat16 x: each pair of codes (inputs 2j and 2j + 1 of one output, one byte of the layout) becomes a pair of
// bfloat16 values (exact: codes are 0..15), and one VDPBF16PS multiplies it into a pair of x's inputs: 32
// multiply-adds an instruction, twice float32's 16, with the products exact and the sums in float32. This is
// what makes several rows (a verification) cheaper; d and m apply per block as above.
template <int64_t ROWS, int64_t CHAINS, typename S>
inline void tile_rows_bf16(const uint16_t* x, const float* xsum, int64_t k, const uint8_t* codes, const S* scales,
                           const S* mins, __m512* out) {
  over_blocks<ROWS, CHAINS>(k, scales, mins, xsum, out, [&](int64_t g, __m512 (&part)[ROWS][CHAINS]) {
    const uint8_t* cg = codes + g * (kBlock / 2) * kTile;
    const uint16_t* xg = x + g * kBlock;
    // One code pair vector per j, multiplied into every row. With several chains, j steps in groups of
    // CHAINS and the chain index is a constant of the unrolled inner loop: indexed by a variable, the sums
    // would live in memory rather than registers (measured: 2 rows ran 1.6x slower).
    auto pairs = [&](int64_t j) { return code_pairs(cg + j * kTile); };
    auto x_pair = [&](int64_t r, int64_t j) {
      int32_t pair;
      std::memcpy(&pair, xg + r * k + 2 * j, sizeof(pair));
      return (__m512bh)_mm512_set1_epi32(pair);
    };
    if constexpr (CHAINS == 1) {
      for (int64_t j = 0; j < kBlock / 2; ++j) {
        const __m512bh w = pairs(j);
        for (int64_t r = 0; r < ROWS; ++r) part[r][0] = _mm512_dpbf16_ps(part[r][0], w, x_pair(r, j));
      }
    } else {
      for (int64_t j0 = 0; j0 < kBlock / 2; j0 += CHAINS) {
#pragma GCC unroll 4
        for (int64_t c = 0; c < CHAINS; ++c) {
          const __m512bh w = pairs(j0 + c);
          for (int64_t r = 0; r < ROWS; ++r) part[r][c] = _mm512_dpbf16_ps(part[r][c], w, x_pair(r, j0 + c));
        }
      }
    }
  });
}

#endif

#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)

// AMX-BF16: per pair of blocks, TDPBF16PS multiplies up to 16 rows of bfloat16 x (A: rows x 32 values, read in place)
// by the block's code pairs (B: the 16 code_pairs vectors, 1 KiB, the layout VDPBF16PS takes one row of) into 16 x 16
// float32 sums (C), and d and m then apply as over_blocks applies them. One instruction does what 16 VDPBF16PS a row
// do, so the rows of a verification cost little more than one; unpacking the codes is paid once per block, not per
// row. Tiles: 0, 1 C; 2, 3 A; 4, 5 B (two blocks in flight; common.h's configure_bf16_tiles).
#define SPECSTREAM_Q4_AMX 1

using specstream_kernels::amx_ready;

inline void b_tile(const uint8_t* cg, uint16_t* buf) {
  for (int64_t j = 0; j < kBlock / 2; ++j) _mm512_store_si512(buf + j * 32, (__m512i)code_pairs(cg + j * kTile));
}

// rows <= 16 rows of x (bfloat16 bits, row stride k) against one tile; the caller configured the tiles for `rows`.
// kept, fill: the tile's unpacked codes kept across passes (common.h's bf16_tile_blocks).
template <typename S>
void amx_tile(const uint16_t* x, const float* xsum, int64_t k, int64_t rows, const uint8_t* codes, const S* scales,
              const S* mins, __m512* out, uint16_t* kept, bool fill) {
  const int64_t blocks = k / kBlock;
  for (int64_t r = 0; r < rows; ++r) out[r] = _mm512_setzero_ps();
  specstream_kernels::bf16_tile_blocks(
      x, k, [&](int64_t g, uint16_t* buf) { b_tile(codes + g * (kBlock / 2) * kTile, buf); },
      [&](const float* c, int64_t g) {
        const __m512 d = load16(scales + g * kTile);
        const __m512 m = load16(mins + g * kTile);
        for (int64_t r = 0; r < rows; ++r) {
          out[r] = _mm512_fmadd_ps(d, _mm512_load_ps(c + r * 16), out[r]);
          out[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(xsum[r * blocks + g]), out[r]);
        }
      },
      kept, fill);
}

#endif

// One pass of ROWS rows over a tile: with bfloat16 x where the CPU multiplies bfloat16 pairs (xb, its bits)
// and there are 2 rows or more, else in float32 (x). Timed alone on one weight (read from the cache), the float32
// path was as fast at 1-3 rows; in a forward, where every weight comes from memory, the pairs made a step of 2 or 3
// rows cheaper (the README's kernels section), and one row is as fast either way. From 4 rows the pairs win alone
// too, 1.2-1.7x at 9-16 rows.
// Under kInvariant (invariant) one row takes the pairs too, so that a row is summed alike at every row count.
template <int64_t ROWS, int64_t CHAINS, typename S>
inline void tile(const float* x, const uint16_t* xb, const float* xsum, int64_t k, const uint8_t* codes, const S* scales,
                 const S* mins, __m512* out, bool invariant) {
#if defined(__AVX512BF16__)
  if ((ROWS >= 2 || invariant) && xb != nullptr) {
    tile_rows_bf16<ROWS, CHAINS>(xb, xsum, k, codes, scales, mins, out);
    return;
  }
#endif
  (void)invariant;
  tile_rows<ROWS, CHAINS>(x, xsum, k, codes, scales, mins, out);
}

template <typename T, typename S>
void run(const float* x, const uint16_t* xb, const uint8_t* codes, const S* scales, const S* mins, T* y,
         int64_t m_rows, int64_t n_rows, int64_t k, int64_t path, bool invariant) {
  const int64_t tiles = n_rows / kTile, blocks = k / kBlock;
  std::vector<float> xsums(m_rows * blocks);  // each block's sum, a vector's lanes at a time (a chain of 32
  for (int64_t r = 0; r < m_rows; ++r)        // dependent adds a block cost more than the tiles at 9 rows)
    for (int64_t g = 0; g < blocks; ++g) {
      const float* xg = x + r * k + g * kBlock;
      xsums[r * blocks + g] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_loadu_ps(xg), _mm512_loadu_ps(xg + 16)));
    }
  const float* xsum = xsums.data();
#if defined(SPECSTREAM_Q4_AMX)
  if (path == kAmx) {
    specstream_kernels::bf16_tile_passes(
        tiles, m_rows, n_rows, k, y, [&](int64_t t, int64_t m0, int64_t rows, __m512* out, uint16_t* kept, bool fill) {
          amx_tile(xb + m0 * k, xsum + m0 * blocks, k, rows, codes + t * (k / 2) * kTile, scales + t * blocks * kTile,
                   mins + t * blocks * kTile, out, kept, fill);
        });
    return;
  }
#endif
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    __m512 out[kRows];
    for (int64_t t = begin; t < end; ++t) {
      const uint8_t* c = codes + t * (k / 2) * kTile;
      const S* d = scales + t * blocks * kTile;
      const S* m = mins + t * blocks * kTile;
      for (int64_t m0 = 0; m0 < m_rows; m0 += kRows) {
        const int64_t rows = std::min(kRows, m_rows - m0);
        const float* xm = x + m0 * k;
        const uint16_t* xbm = xb != nullptr ? xb + m0 * k : nullptr;
        // A pass's chain count follows its rows, and so does the order in which a row's products are summed. Where
        // a call has more rows than one pass holds, its last pass takes one chain a row, as every full pass does:
        // otherwise the rows of a 16-row call that fell in its last 4 were summed in 4 chains, a decode step's row
        // (padded to 16 rows in --deterministic) in 1, and now and then the two rounded apart. A call of a few
        // rows (a verification, a decode step) keeps its chains, unless the call asks for row invariance.
        const bool few = m_rows <= kRows && !invariant;
        switch (rows) {
          case 1: few ? tile<1, 4>(xm, xbm, xsum + m0 * blocks, k, c, d, m, out, invariant) : tile<1, 1>(xm, xbm, xsum + m0 * blocks, k, c, d, m, out, invariant); break;
          case 2: few ? tile<2, 4>(xm, xbm, xsum + m0 * blocks, k, c, d, m, out, invariant) : tile<2, 1>(xm, xbm, xsum + m0 * blocks, k, c, d, m, out, invariant); break;
          case 3: few ? tile<3, 4>(xm, xbm, xsum + m0 * blocks, k, c, d, m, out, invariant) : tile<3, 1>(xm, xbm, xsum + m0 * blocks, k, c, d, m, out, invariant); break;
          case 4: few ? tile<4, 4>(xm, xbm, xsum + m0 * blocks, k, c, d, m, out, invariant) : tile<4, 1>(xm, xbm, xsum + m0 * blocks, k, c, d, m, out, invariant); break;
          case 5: few ? tile<5, 2>(xm, xbm, xsum + m0 * blocks, k, c, d, m, out, invariant) : tile<5, 1>(xm, xbm, xsum + m0 * blocks, k, c, d, m, out, invariant); break;
          case 6: few ? tile<6, 2>(xm, xbm, xsum + m0 * blocks, k, c, d, m, out, invariant) : tile<6, 1>(xm, xbm, xsum + m0 * blocks, k, c, d, m, out, invariant); break;
          case 7: tile<7, 1>(xm, xbm, xsum + m0 * blocks, k, c, d, m, out, invariant); break;
          case 8: tile<8, 1>(xm, xbm, xsum + m0 * blocks, k, c, d, m, out, invariant); break;
          case 9: tile<9, 1>(xm, xbm, xsum + m0 * blocks, k, c, d, m, out, invariant); break;
          case 10: tile<10, 1>(xm, xbm, xsum + m0 * blocks, k, c, d, m, out, invariant); break;
          case 11: tile<11, 1>(xm, xbm, xsum + m0 * blocks, k, c, d, m, out, invariant); break;
          default: tile<12, 1>(xm, xbm, xsum + m0 * blocks, k, c, d, m, out, invariant); break;
        }
        for (int64_t r = 0; r < rows; ++r) store_tile(y + (m0 + r) * n_rows + t * kTile, out[r]);
      }
    }
  });
}

#else

// Without AVX-512: the same arithmetic, one weight at a time.
template <typename T, typename S>
void run(const float* x, const uint16_t* /*xb*/, const uint8_t* codes, const S* scales, const S* mins, T* y,
         int64_t m_rows, int64_t n_rows, int64_t k, int64_t /*path*/, bool /*invariant*/) {
  const int64_t blocks = k / kBlock;
  at::parallel_for(0, n_rows, kTile, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const int64_t t = n / kTile, i = n % kTile;
      for (int64_t r = 0; r < m_rows; ++r) {
        float sum = 0.f;
        for (int64_t kk = 0; kk < k; ++kk) {
          const int64_t g = kk / kBlock;
          const uint8_t byte = codes[(t * (k / 2) + kk / 2) * kTile + i];
          const float code = static_cast<float>(kk % 2 ? byte >> 4 : byte & 0x0F);
          const float w = std::fma(code, static_cast<float>(scales[(t * blocks + g) * kTile + i]),
                                   static_cast<float>(mins[(t * blocks + g) * kTile + i]));
          sum += x[r * k + kk] * w;
        }
        y[r * n_rows + n] = static_cast<T>(sum);
      }
    }
  });
}

#endif

std::vector<int64_t> q4_paths() {
  std::vector<int64_t> out{kVector};
#if defined(SPECSTREAM_Q4_AMX)
  if (amx_ready()) out.push_back(kAmx);
#endif
  return out;
}

// x [M, K] (float32, bf16 or fp16), codes [N / 16, K / 2, 16] uint8, scales and mins [N / 16, K / 32, 16] fp16 (or
// fp32, both); path -1 picks (AMX for kAmxMinRows rows or more of bfloat16 x where the CPU has it), 0 or 1 asks for
// one (1: bfloat16 x on a CPU and build with AMX-BF16), -2 (kInvariant) picks one for every row count and sums a row
// alike at every row count. Returns [M, N] in x's dtype.
at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& mins,
                     int64_t path) {
  TORCH_CHECK(x.dim() == 2 && codes.dim() == 3 && scales.dim() == 3 && mins.dim() == 3, "q4_linear: 2-d x, 3-d weights");
  const bool f32 = scales.scalar_type() == at::kFloat;
  TORCH_CHECK(codes.scalar_type() == at::kByte && (f32 || scales.scalar_type() == at::kHalf) &&
                  mins.scalar_type() == scales.scalar_type(),
              "q4_linear: uint8 codes, float16 (or float32) scales and mins of one dtype");
  const int64_t m = x.size(0), k = x.size(1), n = codes.size(0) * kTile;
  TORCH_CHECK(k % kBlock == 0 && codes.size(1) == k / 2 && codes.size(2) == kTile && scales.size(0) == codes.size(0) &&
                  scales.size(1) == k / kBlock && scales.size(2) == kTile && mins.sizes() == scales.sizes(),
              "q4_linear: x [M, K], codes [N / 16, K / 2, 16], scales and mins [N / 16, K / 32, 16] with K a multiple "
              "of 32; got ", x.sizes(), ", ", codes.sizes(), ", ", scales.sizes(), ", ", mins.sizes());
  auto c = codes.contiguous();
  auto s = scales.contiguous();
  auto mn = mins.contiguous();
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0) return y;
  const std::vector<float> widened = as_float(x);
  const auto* cp = c.data_ptr<uint8_t>();
  // bfloat16 x is multiplied as it is (its bits, rows packed), float32 and float16 x as float32.
  at::Tensor packed = x.scalar_type() == at::kBFloat16 ? x.contiguous() : at::Tensor();
  const auto* xb = packed.defined() ? reinterpret_cast<const uint16_t*>(packed.data_ptr<c10::BFloat16>()) : nullptr;
  static const std::vector<int64_t> paths = q4_paths();
  const bool amx = std::find(paths.begin(), paths.end(), kAmx) != paths.end();
  TORCH_CHECK(path >= kInvariant && path <= kAmx, "q4_linear: path -2, -1, 0 or 1, not ", path);
  TORCH_CHECK(path != kAmx || (amx && xb != nullptr), "q4_linear: the AMX path needs bfloat16 x and a CPU and build with AMX-BF16");
  const bool invariant = path == kInvariant;
  if (path < 0) path = amx && xb != nullptr && (invariant || m >= kAmxMinRows) ? kAmx : kVector;
  auto with_scales = [&](const auto* sp, const auto* mp) {
    switch (x.scalar_type()) {
      case at::kFloat: run<float>(widened.data(), nullptr, cp, sp, mp, y.data_ptr<float>(), m, n, k, path, invariant); break;
      case at::kBFloat16: run<c10::BFloat16>(widened.data(), xb, cp, sp, mp, y.data_ptr<c10::BFloat16>(), m, n, k, path, invariant); break;
      case at::kHalf: run<c10::Half>(widened.data(), nullptr, cp, sp, mp, y.data_ptr<c10::Half>(), m, n, k, path, invariant); break;
      default: TORCH_CHECK(false, "q4_linear: float32, bfloat16 or float16 x, not ", x.scalar_type());
    }
  };
  if (f32)
    with_scales(s.data_ptr<float>(), mn.data_ptr<float>());
  else
    with_scales(s.data_ptr<c10::Half>(), mn.data_ptr<c10::Half>());
  return y;
}

}  // namespace

TORCH_LIBRARY_IMPL(specstream, CPU, m) { m.impl("q4_linear", &q4_linear); }

TORCH_LIBRARY_FRAGMENT(specstream, m) { m.def("q4_paths() -> int[]", &q4_paths); }
