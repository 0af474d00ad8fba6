// y = x @ W^T with GGUF block weights (Q4_0/Q4_1: 4-bit codes, Q8_0: 8-bit) and x quantized to 8-bit blocks, the
// products summed as integers: the "a8" quantization mode (quant.py PackedA8), llama.cpp's approach on CPU.
//
// Why. q4_linear widens each weight to a float and multiplies it into every row of x; its cost grows almost in
// step with the rows, so checking 8 drafts (9 rows) cost 3.5 decode steps. Here x is quantized once per call,
// per row and block of 32 inputs, to int8 codes q and a float32 scale dx, and a block's 32 weights meet a row's 32
// codes in integer multiply-adds: VPDPBUSD (AVX512-VNNI: 64 byte products an instruction, twice the bfloat16 pair
// instruction's 32), AMX-INT8 tiles (TDPBSUD: up to 16 rows x 16 outputs x 32 inputs an instruction, so a step's
// rows share one read and one multiply of each weight), AVX-VNNI or AVX2 on CPUs without AVX-512.
//
// Numerics (every path, bit for bit). A row's block of x: amax = max |x_j|, dx = amax / 127, inv = 127 / amax
// (0 where amax is 0), q_j = round-half-even(x_j * inv), qsum = sum q_j, sx = dx * qsum, all float32. A block of
// weights is w = d c + m (float16 d and m from the file: Q4_1 as stored, Q4_0 with m = -8 d; Q8_0 signed codes
// with m = 0; float32 d and m for Q4_K, a super-block's d and dmin times its sub-block's 6-bit scale and minimum,
// which float16 cannot hold). Per output, over blocks g in order:
//     isum = sum_j c_j q_j                        (exact, int32)
//     acc  = fma(float(isum) * dx, d, acc)        (float(isum) is exact: |isum| < 2^24)
//     acc  = fma(m, sx, acc)                      (4-bit only)
// (8-bit codes with a scale per 16 inputs, GGUF Q6_K's: the first two steps per half block, each half's sum with
// its own d, the first half first.)
// and y = acc rounded once to x's dtype. The integer sums are exact and the float steps run in the same order
// on every path, so a row's output never depends on the other rows of the call, on the row count, or on which
// path served it (tests/test_a8.py checks each path and 1, 9 and 16 rows for identical bits).
//
// Layouts (quant.PackedA8), tiles of 16 outputs, blocks of 32 inputs, VNNI order (each output's 4 consecutive
// inputs side by side, so one 32-bit lane holds one output's 4 bytes):
//   4-bit codes [N / 16, K / 32, 256] uint8: vector v (0..3) of 64 bytes, byte 4 i + b = c[i, 4 v + b] (low nibble)
//                                          | c[i, 16 + 4 v + b] << 4; unpacked, the 8 vectors are AMX's B tile.
//   8-bit codes [N / 16, K / 32, 512] uint8: c + 128, vector u (0..7) byte 4 i + b = c[i, 4 u + b] + 128
//                                          (VPDPBUSD multiplies unsigned by signed bytes: isum = dot - 128 qsum).
//   scales, mins [N / 16, K / 32, 16] (8-bit codes: or [N / 16, K / 16, 16], a scale per 16 inputs) float16, or float32 where float16 cannot hold them (Q4_K); mins empty for 8-bit.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "common.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kTile = 16;
constexpr int64_t kBlock = 32;

enum Path : int64_t { kScalar = 0, kAvx2 = 1, kAvx512Vnni = 2, kAmx = 3 };

// x quantized per row and block of 32 (see the numerics above).
struct Acts {
  int64_t m = 0, k = 0, blocks = 0;
  std::vector<int8_t> q;      // [m, k]
  std::vector<float> dx;      // [m, blocks]
  std::vector<float> sx;      // [m, blocks], dx * qsum
  std::vector<int32_t> qsum;  // [m, blocks]
  std::vector<int32_t> offset;  // [m, blocks], 128 qsum: what VPDPBUSD's unsigned 8-bit codes (c + 128) add
  std::vector<int32_t> offset16;  // [m, 2 blocks], the same for each half block (weights with a scale per 16)
};

template <typename T>
inline float widen(T v) {
  return static_cast<float>(v);
}

// One block of 32 inputs: x (already float32) into q, dx, qsum.
inline void quantize_block(const float* x, int8_t* q, float* dx, int32_t* qsum) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  const __m512 sign = _mm512_set1_ps(-0.0f);
  const __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, a), _mm512_andnot_ps(sign, b)));
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(inv)));
  const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, _mm512_set1_ps(inv)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(qa));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtsepi32_epi8(qb));
  *qsum = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
  *dx = amax / 127.f;
#else
  float amax = 0.f;
  for (int64_t j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(x[j]));
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  int32_t sum = 0;
  for (int64_t j = 0; j < kBlock; ++j) {
    const float scaled = x[j] * inv;
    const int32_t v = static_cast<int32_t>(std::nearbyint(scaled));  // round half to even, as cvtps_epi32
    q[j] = static_cast<int8_t>(std::clamp(v, -127, 127));
    sum += q[j];
  }
  *qsum = sum;
  *dx = amax / 127.f;
#endif
}

template <typename T>
Acts quantize(const T* x, int64_t m, int64_t k, int64_t stride) {
  Acts a;
  a.m = m, a.k = k, a.blocks = k / kBlock;
  a.q.resize(m * k + 64);  // +64: vector loads past the last block stay in bounds
  a.dx.resize(m * a.blocks), a.sx.resize(m * a.blocks), a.qsum.resize(m * a.blocks), a.offset.resize(m * a.blocks);
  a.offset16.resize(2 * m * a.blocks);
  alignas(64) float block[kBlock];
  for (int64_t r = 0; r < m; ++r)
    for (int64_t g = 0; g < a.blocks; ++g) {
      const T* src = x + r * stride + g * kBlock;
      for (int64_t j = 0; j < kBlock; ++j) block[j] = widen(src[j]);
      const int64_t i = r * a.blocks + g;
      quantize_block(block, a.q.data() + r * k + g * kBlock, &a.dx[i], &a.qsum[i]);
      a.sx[i] = a.dx[i] * static_cast<float>(a.qsum[i]);
      a.offset[i] = 128 * a.qsum[i];
      const int8_t* qi = a.q.data() + r * k + g * kBlock;
      int32_t first = 0;
      for (int64_t j = 0; j < kBlock / 2; ++j) first += qi[j];
      a.offset16[2 * i] = 128 * first, a.offset16[2 * i + 1] = 128 * (a.qsum[i] - first);
    }
  return a;
}

// The weights of one call, as PackedA8 holds them: d and m in float16 (a GGUF file's Q4_0/Q4_1/Q8_0 blocks), or
// in float32 where float16 cannot hold them (Q4_K: a super-block's float16 d times a 6-bit sub-block scale).
struct Weights {
  const uint8_t* codes;
  const void* scales;
  const void* mins;  // null for 8-bit codes
  int64_t n, k, blocks;
  bool four;    // 4-bit codes (else 8-bit)
  bool f32;     // scales and mins in float32 (else float16)
  bool halves;  // 8-bit codes with a scale per 16 inputs (Q6_K), two a block (else one per block of 32)
  int64_t block_bytes() const { return four ? 256 : 512; }
  const uint8_t* block(int64_t t, int64_t g) const { return codes + (t * blocks + g) * block_bytes(); }
  // Index of the first of tile t's 16 scales in scale block s (s = g, or 2 g + h for the halves of block g).
  int64_t at(int64_t t, int64_t s) const { return (t * (halves ? 2 * blocks : blocks) + s) * kTile; }
  static float one(const void* p, int64_t i, bool f32) {
    return f32 ? static_cast<const float*>(p)[i] : static_cast<float>(static_cast<const c10::Half*>(p)[i]);
  }
  // Output i's d and m in scale block s of tile t.
  float d(int64_t t, int64_t g, int64_t i) const { return one(scales, at(t, g) + i, f32); }
  float m(int64_t t, int64_t g, int64_t i) const { return one(mins, at(t, g) + i, f32); }
};

// ---------------------------------------------------------------------------------------------------------------
// Reference path, any CPU: the numerics above written out, one output at a time.

inline int32_t code_at(const Weights& w, int64_t t, int64_t g, int64_t i, int64_t j) {
  const uint8_t* b = w.block(t, g);
  if (!w.four) return static_cast<int32_t>(b[(j / 4) * 64 + 4 * i + j % 4]) - 128;
  const int64_t v = (j % 16) / 4;
  const uint8_t byte = b[v * 64 + 4 * i + j % 4];
  return j < 16 ? byte & 0x0F : byte >> 4;
}

void scalar_tile(const Acts& a, const Weights& w, int64_t t, int64_t r0, int64_t rows, float* out /* [rows, 16] */) {
  for (int64_t r = r0; r < r0 + rows; ++r)
    for (int64_t i = 0; i < kTile; ++i) {
      float acc = 0.f;
      for (int64_t g = 0; g < w.blocks; ++g) {
        const int64_t x = r * a.blocks + g, parts = w.halves ? 2 : 1;
        for (int64_t h = 0; h < parts; ++h) {  // a scale per block, or one per half block
          int32_t isum = 0;
          for (int64_t j = h * kBlock / parts; j < (h + 1) * kBlock / parts; ++j)
            isum += code_at(w, t, g, i, j) * a.q[r * a.k + g * kBlock + j];
          const float scaled = static_cast<float>(isum) * a.dx[x];
          acc = std::fmaf(scaled, w.d(t, parts * g + h, i), acc);
        }
        if (w.four) acc = std::fmaf(w.m(t, g, i), a.sx[x], acc);
      }
      out[(r - r0) * kTile + i] = acc;
    }
}

// ---------------------------------------------------------------------------------------------------------------
// AVX2 (8 outputs a vector, two halves a tile; a block's codes unpacked once for up to 4 rows): VPDPBUSD on
// 256-bit vectors where the CPU has AVX-VNNI, else
// VPMADDUBSW + VPMADDWD, which saturates 16-bit pair sums: 8-bit codes then go in as |c| against q with c's sign
// (at most 2 * 128 * 127, which fits), an exact sum of c q without the + 128 offset.

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)

inline __m256i unpack_half(const Weights& w, const uint8_t* block, int64_t u, int64_t half) {
  if (!w.four) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + u * 64 + half * 32));
  const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + (u % 4) * 64 + half * 32));
  const __m256i low = _mm256_set1_epi8(0x0F);
  return u < 4 ? _mm256_and_si256(packed, low) : _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
}

// The exact int32 sums of c q for 8 outputs: w the (offset) codes of inputs 4u..4u+3, q those 4 codes broadcast.
inline __m256i dot4_avx2(__m256i acc, __m256i w, __m256i q, bool four) {
#if defined(__AVXVNNI__)
  (void)four;
  return _mm256_dpbusd_avx_epi32(acc, w, q);
#else
  __m256i products;
  if (four) {
    products = _mm256_maddubs_epi16(w, q);
  } else {
    const __m256i c = _mm256_xor_si256(w, _mm256_set1_epi8(static_cast<char>(0x80)));  // the signed codes
    products = _mm256_maddubs_epi16(_mm256_abs_epi8(c), _mm256_sign_epi8(q, c));
  }
  return _mm256_add_epi32(acc, _mm256_madd_epi16(products, _mm256_set1_epi16(1)));
#endif
}

constexpr bool kAvx2Offsets =
#if defined(__AVXVNNI__)
    true;  // VPDPBUSD sums (c + 128) q: subtract 128 qsum
#else
    false;
#endif

// 8 of a block's d or m (from index i), float16 or float32.
inline __m256 load8(const void* p, int64_t i, bool f32) {
  if (f32) return _mm256_loadu_ps(static_cast<const float*>(p) + i);
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const c10::Half*>(p) + i)));
}

// ROWS rows (from r0) against tile t, a half tile (8 outputs) at a time: each block's 8 code vectors are unpacked
// once and multiplied into every row (AVX2 has 16 vector registers: the codes, ROWS sums and a few more).
template <int64_t ROWS>
void avx2_rows(const Acts& a, const Weights& w, int64_t t, int64_t r0, float* out) {
  const int64_t parts = w.halves ? 2 : 1;  // a scale per block, or one per half block (vectors 0-3, 4-7)
  for (int64_t half = 0; half < 2; ++half) {
    __m256 acc[ROWS];
    for (int64_t r = 0; r < ROWS; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < w.blocks; ++g) {
      const uint8_t* block = w.block(t, g);
      __m256i v[8];
      for (int64_t u = 0; u < 8; ++u) v[u] = unpack_half(w, block, u, half);
      const __m256 mn = w.four ? load8(w.mins, w.at(t, g) + half * 8, w.f32) : _mm256_setzero_ps();
      for (int64_t r = 0; r < ROWS; ++r) {
        const int8_t* q = a.q.data() + (r0 + r) * a.k + g * kBlock;
        const int64_t x = (r0 + r) * a.blocks + g;
        for (int64_t h = 0; h < parts; ++h) {
          __m256i s = _mm256_setzero_si256();
          for (int64_t u = h * 8 / parts; u < (h + 1) * 8 / parts; ++u) {
            int32_t quad;
            std::memcpy(&quad, q + 4 * u, 4);
            s = dot4_avx2(s, v[u], _mm256_set1_epi32(quad), w.four);
          }
          const int32_t offset = w.halves ? a.offset16[2 * x + h] : a.offset[x];
          if (!w.four && kAvx2Offsets) s = _mm256_sub_epi32(s, _mm256_set1_epi32(offset));
          const __m256 scaled = _mm256_mul_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(a.dx[x]));
          acc[r] = _mm256_fmadd_ps(scaled, load8(w.scales, w.at(t, parts * g + h) + half * 8, w.f32), acc[r]);
        }
        if (w.four) acc[r] = _mm256_fmadd_ps(mn, _mm256_set1_ps(a.sx[x]), acc[r]);
      }
    }
    for (int64_t r = 0; r < ROWS; ++r) _mm256_storeu_ps(out + r * kTile + half * 8, acc[r]);
  }
}

// Rows in even passes of at most 4 (the registers' bound).
void avx2_tile(const Acts& a, const Weights& w, int64_t t, int64_t r0, int64_t rows, float* out) {
  const int64_t passes = (rows + 3) / 4;
  for (int64_t p = 0, done = 0; p < passes; ++p) {
    const int64_t n = (rows - done) / (passes - p);
    float* o = out + done * kTile;
    switch (n) {
      case 1: avx2_rows<1>(a, w, t, r0 + done, o); break;
      case 2: avx2_rows<2>(a, w, t, r0 + done, o); break;
      case 3: avx2_rows<3>(a, w, t, r0 + done, o); break;
      default: avx2_rows<4>(a, w, t, r0 + done, o); break;
    }
    done += n;
  }
}

#endif

// ---------------------------------------------------------------------------------------------------------------
// AVX512-VNNI: a tile's 16 outputs in one vector; each block's 8 code vectors are unpacked once and multiplied
// into up to 12 rows (vnni_rows), whose sums stay in registers.

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)

inline void unpack_block(const Weights& w, const uint8_t* block, __m512i (&v)[8]) {
  if (!w.four) {
    for (int64_t u = 0; u < 8; ++u) v[u] = _mm512_loadu_si512(block + u * 64);
    return;
  }
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t u = 0; u < 4; ++u) {
    const __m512i packed = _mm512_loadu_si512(block + u * 64);
    v[u] = _mm512_and_si512(packed, low);
    v[u + 4] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low);
  }
}

// The float steps of one block for one row: the same on the AMX path.
inline __m512 block_epilogue(__m512i s, const Acts& a, int64_t x, bool four, __m512 d, __m512 mn, __m512 acc) {
  if (!four) s = _mm512_sub_epi32(s, _mm512_set1_epi32(a.offset[x]));
  const __m512 scaled = _mm512_mul_ps(_mm512_cvtepi32_ps(s), _mm512_set1_ps(a.dx[x]));
  acc = _mm512_fmadd_ps(scaled, d, acc);
  if (four) acc = _mm512_fmadd_ps(mn, _mm512_set1_ps(a.sx[x]), acc);
  return acc;
}

// A block's 16 d or m (from index i), float16 or float32.
inline __m512 load16(const void* p, int64_t i, bool f32) {
  if (f32) return _mm512_loadu_ps(static_cast<const float*>(p) + i);
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const c10::Half*>(p) + i)));
}

// A row's 4 codes at p, broadcast to the 16 lanes: written as one 32-bit load, so that the compiler folds it into
// VPDPBUSD as an embedded broadcast ({1to16}, a load, no shuffle). Copying a block's 32 codes to registers
// first made it split 64-bit loads and broadcast from general registers: two more instructions per VPDPBUSD,
// and the compute-bound row counts (8 and more) ran up to 2x slower.
inline __m512i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return _mm512_set1_epi32(v);
}

// ROWS rows (from r0) against tile t: each block's 8 code vectors are unpacked once and multiplied into every
// row, whose sums stay in registers. CHAINS: independent integer sums per row, 2 where few rows give the
// out-of-order core too little to overlap VPDPBUSD's latency, 1 from 4 rows on (one add fewer per block and
// row). Integer sums, so the chains do not change the bits.
template <int64_t ROWS>
void vnni_rows(const Acts& a, const Weights& w, int64_t t, int64_t r0, float* out) {
  constexpr int64_t CHAINS = ROWS < 4 ? 2 : 1;
  const int64_t k = a.k, blocks = a.blocks;
  const int8_t* q0 = a.q.data() + r0 * k;
  const float* dx0 = a.dx.data() + r0 * blocks;
  const float* sx0 = a.sx.data() + r0 * blocks;
  const int32_t* off0 = a.offset.data() + r0 * blocks;
  const bool four = w.four;
  __m512 acc[ROWS];
  for (int64_t r = 0; r < ROWS; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < blocks; ++g) {
    __m512i v[8];
    unpack_block(w, w.block(t, g), v);
    const __m512 d = load16(w.scales, w.at(t, g), w.f32);
    const __m512 mn = four ? load16(w.mins, w.at(t, g), w.f32) : _mm512_setzero_ps();
    for (int64_t r = 0; r < ROWS; ++r) {
      const int8_t* q = q0 + r * k + g * kBlock;
      __m512i s[CHAINS];
      for (int64_t c = 0; c < CHAINS; ++c) s[c] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), v[c], broadcast4(q + 4 * c));
      for (int64_t u = CHAINS; u < 8; u += CHAINS)
        for (int64_t c = 0; c < CHAINS; ++c) s[c] = _mm512_dpbusd_epi32(s[c], v[u + c], broadcast4(q + 4 * (u + c)));
      __m512i sum = s[0];
      if constexpr (CHAINS == 2) sum = _mm512_add_epi32(sum, s[1]);
      const int64_t x = r * blocks + g;
      if (!four) sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(off0[x]));
      const __m512 scaled = _mm512_mul_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(dx0[x]));
      acc[r] = _mm512_fmadd_ps(scaled, d, acc[r]);
      if (four) acc[r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(sx0[x]), acc[r]);
    }
  }
  for (int64_t r = 0; r < ROWS; ++r) _mm512_storeu_ps(out + r * kTile, acc[r]);
}

// The same for 8-bit codes with a scale per 16 inputs (Q6_K): a block's vectors 0-3 and 4-7 sum its two halves
// (two chains, whatever the rows), each half with its own offset and scale.
template <int64_t ROWS>
void vnni_rows_halves(const Acts& a, const Weights& w, int64_t t, int64_t r0, float* out) {
  const int64_t k = a.k, blocks = a.blocks;
  const int8_t* q0 = a.q.data() + r0 * k;
  const float* dx0 = a.dx.data() + r0 * blocks;
  const int32_t* off0 = a.offset16.data() + 2 * r0 * blocks;
  __m512 acc[ROWS];
  for (int64_t r = 0; r < ROWS; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < blocks; ++g) {
    __m512i v[8];
    unpack_block(w, w.block(t, g), v);
    const __m512 d0 = load16(w.scales, w.at(t, 2 * g), w.f32), d1 = load16(w.scales, w.at(t, 2 * g + 1), w.f32);
    for (int64_t r = 0; r < ROWS; ++r) {
      const int8_t* q = q0 + r * k + g * kBlock;
      __m512i s0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), v[0], broadcast4(q));
      __m512i s1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), v[4], broadcast4(q + 16));
      for (int64_t u = 1; u < 4; ++u) {
        s0 = _mm512_dpbusd_epi32(s0, v[u], broadcast4(q + 4 * u));
        s1 = _mm512_dpbusd_epi32(s1, v[u + 4], broadcast4(q + 16 + 4 * u));
      }
      const int64_t x = r * blocks + g;
      s0 = _mm512_sub_epi32(s0, _mm512_set1_epi32(off0[2 * x]));
      s1 = _mm512_sub_epi32(s1, _mm512_set1_epi32(off0[2 * x + 1]));
      const __m512 dx = _mm512_set1_ps(dx0[x]);
      acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(s0), dx), d0, acc[r]);
      acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(s1), dx), d1, acc[r]);
    }
  }
  for (int64_t r = 0; r < ROWS; ++r) _mm512_storeu_ps(out + r * kTile, acc[r]);
}

template <int64_t ROWS>
void vnni_pass(const Acts& a, const Weights& w, int64_t t, int64_t r0, float* out) {
  if (w.halves)
    vnni_rows_halves<ROWS>(a, w, t, r0, out);
  else
    vnni_rows<ROWS>(a, w, t, r0, out);
}

// Rows in passes of at most kVnniRows, the passes as even as can be (9 rows: one pass, not 8 and 1; 16: 8 and 8):
// a pass's cost is mostly its rows', but each pass unpacks the tile's codes again.
constexpr int64_t kVnniRows = 12;

void vnni_tile(const Acts& a, const Weights& w, int64_t t, int64_t r0, int64_t rows, float* out) {
  const int64_t passes = (rows + kVnniRows - 1) / kVnniRows;
  for (int64_t p = 0, done = 0; p < passes; ++p) {
    const int64_t n = (rows - done) / (passes - p);  // the remaining rows spread over the remaining passes
    float* o = out + done * kTile;
    switch (n) {
      case 1: vnni_pass<1>(a, w, t, r0 + done, o); break;
      case 2: vnni_pass<2>(a, w, t, r0 + done, o); break;
      case 3: vnni_pass<3>(a, w, t, r0 + done, o); break;
      case 4: vnni_pass<4>(a, w, t, r0 + done, o); break;
      case 5: vnni_pass<5>(a, w, t, r0 + done, o); break;
      case 6: vnni_pass<6>(a, w, t, r0 + done, o); break;
      case 7: vnni_pass<7>(a, w, t, r0 + done, o); break;
      case 8: vnni_pass<8>(a, w, t, r0 + done, o); break;
      case 9: vnni_pass<9>(a, w, t, r0 + done, o); break;
      case 10: vnni_pass<10>(a, w, t, r0 + done, o); break;
      case 11: vnni_pass<11>(a, w, t, r0 + done, o); break;
      default: vnni_pass<12>(a, w, t, r0 + done, o); break;
    }
    done += n;
  }
}

#define SPECSTREAM_HAS_VNNI512 1
#endif

// ---------------------------------------------------------------------------------------------------------------
// AMX-INT8: per pair of blocks, TDPBSUD (signed A, unsigned B) multiplies up to 16 rows' codes (A: rows x 32 bytes, read in place from
// the quantized x) by the tile's unpacked codes (B: 8 x 64 bytes) into 16 x 16 int32 sums (C), which the same
// float steps as VNNI's then apply. Tiles: 0, 1 C; 2, 3 A; 4, 5 B (two blocks in flight).

#if defined(SPECSTREAM_HAS_VNNI512) && defined(__AMX_TILE__) && defined(__AMX_INT8__)

using specstream_kernels::amx_ready;
using specstream_kernels::TileConfig;

void configure_tiles(int64_t rows) {
  TileConfig cfg;
  for (int t : {0, 1}) cfg.rows[t] = rows, cfg.colsb[t] = 64;
  for (int t : {2, 3}) cfg.rows[t] = rows, cfg.colsb[t] = 32;
  for (int t : {4, 5}) cfg.rows[t] = 8, cfg.colsb[t] = 64;
  // Not _tile_loadconfig: GCC 12's declares only the first 8 bytes as read, so the stores of the rest may be
  // dropped or moved past it (the tiles then stay unconfigured: SIGILL at the first tile load).
  __asm__ volatile("ldtilecfg %0" : : "m"(cfg));
}

// B for one block: 8-bit codes are in place; 4-bit ones unpacked into buf (512 bytes).
inline const uint8_t* b_tile(const Weights& w, int64_t t, int64_t g, uint8_t* buf) {
  const uint8_t* block = w.block(t, g);
  if (!w.four) return block;
  __m512i v[8];
  unpack_block(w, block, v);
  for (int64_t u = 0; u < 8; ++u) _mm512_store_si512(buf + u * 64, v[u]);
  return buf;
}

struct DotInt8 {  // common.h's tile_blocks
  static void first() { _tile_dpbsud(0, 2, 4); }
  static void second() { _tile_dpbsud(1, 3, 5); }
};

// rows <= 16; the caller configured the tiles for `rows`. kept: where not null, tile t's unpacked 4-bit codes (512
// bytes a block, 64-byte aligned), unpacked into it where `fill` (the first pass of rows) and read back by the others.
void amx_tile(const Acts& a, const Weights& w, int64_t t, int64_t r0, int64_t rows, float* out, uint8_t* kept = nullptr,
              bool fill = true) {
  __m512 acc[16];
  for (int64_t r = 0; r < rows; ++r) acc[r] = _mm512_setzero_ps();
  const int8_t* q = a.q.data() + r0 * a.k;
  specstream_kernels::tile_blocks<DotInt8, int32_t>(
      w.blocks, a.k, [&](int64_t g) { return q + g * kBlock; },
      [&](int64_t g, uint8_t* scratch) -> const void* {
        if (kept == nullptr) return b_tile(w, t, g, scratch);
        return fill ? b_tile(w, t, g, kept + g * 512) : kept + g * 512;
      },
      [&](const int32_t* c, int64_t g) {
        const __m512 d = load16(w.scales, w.at(t, g), w.f32);
        const __m512 mn = w.four ? load16(w.mins, w.at(t, g), w.f32) : _mm512_setzero_ps();
        for (int64_t r = 0; r < rows; ++r)
          acc[r] = block_epilogue(_mm512_load_si512(c + r * 16), a, (r0 + r) * a.blocks + g, w.four, d, mn, acc[r]);
      });
  for (int64_t r = 0; r < rows; ++r) _mm512_storeu_ps(out + r * kTile, acc[r]);
}

// Past 16 rows with 4-bit codes (a prefill chunk, a step of many streams' verifications): common.h's
// kept_tile_passes, each block's codes unpacked once for every pass of 16 rows rather than again in each. A row's sums
// are the same (the same codes, the same order). 8-bit codes are read in place, with nothing to keep.
template <typename T>
void amx_passes(const Acts& a, const Weights& w, T* y) {
  at::parallel_for(0, w.n / kTile, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float out[16 * kTile];
    auto pass = [&](int64_t t, int64_t r0, int64_t rows, uint8_t* kept, bool fill) {
      amx_tile(a, w, t, r0, rows, out, kept, fill);
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t i = 0; i < kTile; ++i) y[(r0 + r) * w.n + t * kTile + i] = static_cast<T>(out[r * kTile + i]);
    };
    specstream_kernels::kept_tile_passes(begin, end, a.m, w.blocks * 512, configure_tiles, pass);
  });
}

#define SPECSTREAM_HAS_AMX 1
#endif

// ---------------------------------------------------------------------------------------------------------------

std::vector<int64_t> available_paths() {
  std::vector<int64_t> paths{kScalar};
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  paths.push_back(kAvx2);
#endif
#if defined(SPECSTREAM_HAS_VNNI512)
  paths.push_back(kAvx512Vnni);
#endif
#if defined(SPECSTREAM_HAS_AMX)
  if (amx_ready()) paths.push_back(kAmx);
#endif
  return paths;
}

// AMX pays from this many rows, fewer go to VNNI (timed over 30 weights of 3072 x 576 and 576 x 1536 on a 2-core Xeon
// with AMX: about even at 6-7 rows; VNNI 1.2-1.4x faster at 4, AMX 1.3-1.6x at 9-16). Either gives the same bits.
constexpr int64_t kAmxMinRows = 7;

int64_t pick_path(int64_t requested, int64_t rows) {
  static const std::vector<int64_t> paths = available_paths();
  auto has = [&](int64_t p) { return std::find(paths.begin(), paths.end(), p) != paths.end(); };
  if (requested >= 0) {
    TORCH_CHECK(has(requested), "a8_linear: path ", requested, " is not available on this CPU or build");
    return requested;
  }
  if (has(kAmx) && rows >= kAmxMinRows) return kAmx;
  if (has(kAvx512Vnni)) return kAvx512Vnni;
  if (has(kAvx2)) return kAvx2;
  return kScalar;
}

template <typename T>
void run(const Acts& a, const Weights& w, int64_t path, T* y) {
  // AMX tiles sum whole blocks of 32; weights with a scale per 16 (Q6_K) take the AVX512-VNNI path there (the
  // same bits: every path sums the halves alike).
  if (path == kAmx && w.halves) path = kAvx512Vnni;
#if defined(SPECSTREAM_HAS_AMX)
  if (path == kAmx && w.four && a.m > 16) {
    amx_passes(a, w, y);
    return;
  }
#endif
  const int64_t tiles = w.n / kTile;
  const int64_t chunk = path == kAmx ? 16 : 64;  // rows per pass over a tile
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float out[64 * kTile];
    for (int64_t r0 = 0; r0 < a.m; r0 += chunk) {
      const int64_t rows = std::min(chunk, a.m - r0);
#if defined(SPECSTREAM_HAS_AMX)
      // Tile state is per thread, and other libraries on these threads (oneDNN) configure it for themselves.
      if (path == kAmx) configure_tiles(rows);
#endif
      for (int64_t t = begin; t < end; ++t) {
        switch (path) {
#if defined(SPECSTREAM_HAS_AMX)
          case kAmx: amx_tile(a, w, t, r0, rows, out); break;
#endif
#if defined(SPECSTREAM_HAS_VNNI512)
          case kAvx512Vnni: vnni_tile(a, w, t, r0, rows, out); break;
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
          case kAvx2: avx2_tile(a, w, t, r0, rows, out); break;
#endif
          default: scalar_tile(a, w, t, r0, rows, out); break;
        }
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t i = 0; i < kTile; ++i) y[(r0 + r) * w.n + t * kTile + i] = static_cast<T>(out[r * kTile + i]);
      }
#if defined(SPECSTREAM_HAS_AMX)
      if (path == kAmx) _tile_release();
#endif
    }
  });
}

Acts quantize_input(const at::Tensor& x) {
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(x.stride(1) == 1 || m == 0 || k == 0, "a8: x must be contiguous along its rows");
  switch (x.scalar_type()) {
    case at::kFloat: return quantize(x.data_ptr<float>(), m, k, x.stride(0));
    case at::kBFloat16: return quantize(x.data_ptr<c10::BFloat16>(), m, k, x.stride(0));
    case at::kHalf: return quantize(x.data_ptr<c10::Half>(), m, k, x.stride(0));
    default: TORCH_CHECK(false, "a8: float32, bfloat16 or float16 x, not ", x.scalar_type());
  }
}

// x [M, K]; codes [N / 16, K / 32, 256 or 512] uint8; scales [N / 16, K / 32, 16] float16 or float32; mins the same for
// 4-bit codes, empty for 8-bit; path -1 picks the fastest (any gives the same bits). Returns [M, N] in x's dtype.
at::Tensor a8_linear(const at::Tensor& x_in, const at::Tensor& codes_in, const at::Tensor& scales_in,
                     const at::Tensor& mins_in, int64_t path) {
  TORCH_CHECK(x_in.dim() == 2 && codes_in.dim() == 3 && scales_in.dim() == 3, "a8_linear: 2-d x, 3-d codes and scales");
  const auto scale_type = scales_in.scalar_type();
  TORCH_CHECK(codes_in.scalar_type() == at::kByte && (scale_type == at::kHalf || scale_type == at::kFloat),
              "a8_linear: uint8 codes, float16 or float32 scales");
  const bool four = codes_in.size(2) == 256;
  const int64_t m = x_in.size(0), k = x_in.size(1), n = codes_in.size(0) * kTile, blocks = k / kBlock;
  const bool halves = !four && scales_in.size(1) == 2 * blocks;  // 8-bit codes, a scale per 16 inputs (Q6_K)
  TORCH_CHECK((four || codes_in.size(2) == 512) && k % kBlock == 0 && codes_in.size(1) == blocks &&
                  scales_in.size(0) == codes_in.size(0) && (scales_in.size(1) == blocks || halves) &&
                  scales_in.size(2) == kTile,
              "a8_linear: x [M, K], codes [N / 16, K / 32, 256 or 512], scales [N / 16, K / 32, 16] with K a multiple of "
              "32; got ", x_in.sizes(), ", ", codes_in.sizes(), ", ", scales_in.sizes());
  TORCH_CHECK(!four || (mins_in.scalar_type() == scale_type && mins_in.sizes() == scales_in.sizes()),
              "a8_linear: 4-bit codes need mins shaped as the scales, of their dtype");
  at::Tensor y = at::empty({m, n}, x_in.options());
  if (m == 0 || n == 0) return y;
  const at::Tensor x = x_in.contiguous(), codes = codes_in.contiguous(), scales = scales_in.contiguous();
  const at::Tensor mins = four ? mins_in.contiguous() : at::Tensor();
  const Acts a = quantize_input(x);
  const Weights w{codes.data_ptr<uint8_t>(), scales.data_ptr(), four ? mins.data_ptr() : nullptr, n, k, blocks, four,
                  scale_type == at::kFloat, halves};
  const int64_t chosen = pick_path(path, m);
  switch (x.scalar_type()) {
    case at::kFloat: run(a, w, chosen, y.data_ptr<float>()); break;
    case at::kBFloat16: run(a, w, chosen, y.data_ptr<c10::BFloat16>()); break;
    default: run(a, w, chosen, y.data_ptr<c10::Half>()); break;
  }
  return y;
}

// x's 8-bit blocks as the kernel makes them: (q [M, K] int8, dx [M, K / 32] float32). For tests.
std::tuple<at::Tensor, at::Tensor> a8_quantize(const at::Tensor& x_in) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) % kBlock == 0, "a8_quantize: x [M, K] with K a multiple of 32");
  const at::Tensor x = x_in.contiguous();
  const Acts a = quantize_input(x);
  at::Tensor q = at::empty({a.m, a.k}, x.options().dtype(at::kChar));
  at::Tensor dx = at::empty({a.m, a.blocks}, x.options().dtype(at::kFloat));
  if (a.m * a.k) std::memcpy(q.data_ptr<int8_t>(), a.q.data(), a.m * a.k);
  if (a.m * a.blocks) std::memcpy(dx.data_ptr<float>(), a.dx.data(), a.m * a.blocks * sizeof(float));
  return {q, dx};
}

// The paths this build and CPU can run (0 scalar, 1 AVX2/AVX-VNNI, 2 AVX512-VNNI, 3 AMX-INT8), and what the
// AVX2 path uses: [paths..., -1, avx_vnni (0/1)].
std::vector<int64_t> a8_paths() {
  std::vector<int64_t> out = available_paths();
  out.push_back(-1);
#if defined(__AVXVNNI__)
  out.push_back(1);
#else
  out.push_back(0);
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(specstream, CPU, m) {
  m.impl("a8_linear", &a8_linear);
  m.impl("a8_quantize", &a8_quantize);
}

TORCH_LIBRARY_FRAGMENT(specstream, m) {
  m.def("a8_paths() -> int[]", &a8_paths);
}
