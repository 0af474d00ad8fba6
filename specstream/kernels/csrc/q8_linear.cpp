// y = x @ W^T for weights in GGUF Q8_0's form (quant.py Int8Blocks): W[n, k] = scales[n, k / 32] * codes[n, k],
// int8 codes and a float32 scale per block of 32, on CPU.
//
// torch has no kernel for 8-bit weights with a scale per block (its int8 kernel takes one per row), so these
// were served as two 4-bit planes (1.25 bytes per weight read, two kernel calls). This reads the file's own
// bytes once (1.125 per weight) and widens them to float32 in registers: c * s is exact in float32 (8 by 11
// significant bits), so the weights multiplied are the file's, and the sums are float32, rounded once to the
// output dtype. For the bundled model's LM head (49152 x 576) it is the one projection of a step not inside a
// layer, so its speed at a few rows (decode, verification) counts.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include "common.h"

#include <immintrin.h>

#include <vector>

namespace {

using specstream_kernels::as_float;
using specstream_kernels::sum_lanes;
using specstream_kernels::Vec;

constexpr int64_t kBlock = 32;
constexpr int64_t kRows = 4;  // rows of x per pass over a weight row: their sums stay in registers

inline Vec load_int8(const int8_t* p) {
#if defined(CPU_CAPABILITY_AVX512)
  return Vec(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
#elif defined(CPU_CAPABILITY_AVX2)
  return Vec(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))));
#else
  float tmp[Vec::size()];
  for (int64_t i = 0; i < Vec::size(); ++i) tmp[i] = p[i];
  return Vec::loadu(tmp);
#endif
}

// ROWS rows of x against one weight row, each sum split over four chains of fused multiply-adds so that no
// add waits on the one before it (one chain runs at the adder's latency, a quarter of its throughput).
template <int64_t ROWS>
inline void dot_rows(const float* x, const int8_t* c, const float* s, int64_t k, float* out) {
  constexpr int64_t vs = Vec::size();
  Vec acc[ROWS][4];
  for (int64_t r = 0; r < ROWS; ++r)
    for (int64_t i = 0; i < 4; ++i) acc[r][i] = Vec(0.f);
  int64_t j = 0;
  for (; j + 4 * vs <= k; j += 4 * vs) {
    Vec w[4];
    for (int64_t i = 0; i < 4; ++i) w[i] = load_int8(c + j + i * vs) * Vec(s[(j + i * vs) / kBlock]);  // exact: the file's weight
    for (int64_t r = 0; r < ROWS; ++r)
      for (int64_t i = 0; i < 4; ++i) acc[r][i] = at::vec::fmadd(Vec::loadu(x + r * k + j + i * vs), w[i], acc[r][i]);
  }
  for (; j < k; j += vs) {
    const Vec w = load_int8(c + j) * Vec(s[j / kBlock]);
    for (int64_t r = 0; r < ROWS; ++r) acc[r][0] = at::vec::fmadd(Vec::loadu(x + r * k + j), w, acc[r][0]);
  }
  for (int64_t r = 0; r < ROWS; ++r) out[r] = sum_lanes((acc[r][0] + acc[r][1]) + (acc[r][2] + acc[r][3]));
}

template <typename T>
void run(const float* x, const int8_t* codes, const float* scales, T* y, int64_t m_rows, int64_t n_rows, int64_t k) {
  const int64_t blocks = k / kBlock;
  at::parallel_for(0, n_rows, 64, [&](int64_t begin, int64_t end) {
    float out[kRows];
    for (int64_t n = begin; n < end; ++n) {
      const int8_t* c = codes + n * k;
      const float* s = scales + n * blocks;
      for (int64_t m0 = 0; m0 < m_rows; m0 += kRows) {
        const int64_t rows = std::min(kRows, m_rows - m0);
        const float* xm = x + m0 * k;
        switch (rows) {
          case 1: dot_rows<1>(xm, c, s, k, out); break;
          case 2: dot_rows<2>(xm, c, s, k, out); break;
          case 3: dot_rows<3>(xm, c, s, k, out); break;
          default: dot_rows<4>(xm, c, s, k, out); break;
        }
        for (int64_t r = 0; r < rows; ++r) y[(m0 + r) * n_rows + n] = static_cast<T>(out[r]);
      }
    }
  });
}

// x [M, K] (float32, bf16 or fp16), codes [N, K] int8, scales [N, K / 32] float32; returns [M, N] in x's dtype.
at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && codes.dim() == 2 && scales.dim() == 2, "q8_linear: 2-d x, codes and scales");
  TORCH_CHECK(codes.scalar_type() == at::kChar && scales.scalar_type() == at::kFloat, "q8_linear: int8 codes, float32 scales");
  const int64_t m = x.size(0), k = x.size(1), n = codes.size(0);
  TORCH_CHECK(codes.size(1) == k && k % kBlock == 0 && scales.size(0) == n && scales.size(1) == k / kBlock,
              "q8_linear: x [M, K], codes [N, K], scales [N, K / 32] with K a multiple of 32; got ", x.sizes(), ", ",
              codes.sizes(), ", ", scales.sizes());
  auto c = codes.contiguous();
  auto s = scales.contiguous();
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0) return y;
  const std::vector<float> widened = as_float(x);
  switch (x.scalar_type()) {
    case at::kFloat: run<float>(widened.data(), c.data_ptr<int8_t>(), s.data_ptr<float>(), y.data_ptr<float>(), m, n, k); break;
    case at::kBFloat16:
      run<c10::BFloat16>(widened.data(), c.data_ptr<int8_t>(), s.data_ptr<float>(), y.data_ptr<c10::BFloat16>(), m, n, k);
      break;
    case at::kHalf:
      run<c10::Half>(widened.data(), c.data_ptr<int8_t>(), s.data_ptr<float>(), y.data_ptr<c10::Half>(), m, n, k);
      break;
    default: TORCH_CHECK(false, "q8_linear: float32, bfloat16 or float16 x, not ", x.scalar_type());
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_IMPL(specstream, CPU, m) { m.impl("q8_linear", &q8_linear); }
