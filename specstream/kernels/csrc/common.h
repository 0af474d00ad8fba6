// Helpers shared by specstream's CPU kernels (kernels/cpu.py builds every .cpp here into one library).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <type_traits>
#include <vector>

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

namespace specstream_kernels {

#if defined(CPU_CAPABILITY_AVX512)
// A row's 16 float32 sums (a tile of outputs) stored in T, each rounded once.
template <typename T>
inline void store_tile(T* y, __m512 v) {
  if constexpr (std::is_same_v<T, float>) {
    _mm512_storeu_ps(y, v);
  } else {
    alignas(64) float tmp[16];
    _mm512_store_ps(tmp, v);
    for (int64_t i = 0; i < 16; ++i) y[i] = static_cast<T>(tmp[i]);
  }
}
#endif

using Vec = at::vec::Vectorized<float>;

// The sum of a vector's lanes.
inline float sum_lanes(const Vec& x) {
#if defined(CPU_CAPABILITY_AVX512)
  return x.reduce_add();
#else
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, x);
#endif
}

// x [M, K] as float32, row by row (a vector rather than a tensor: no dispatch for so small a copy).
inline std::vector<float> as_float(const at::Tensor& x) {
  const int64_t m = x.size(0), k = x.size(1);
  std::vector<float> out(m * k);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "as_float", [&] {
    for (int64_t r = 0; r < m; ++r) {
      const scalar_t* row = x.data_ptr<scalar_t>() + r * x.stride(0);
      for (int64_t j = 0; j < k; ++j) out[r * k + j] = static_cast<float>(row[j * x.stride(1)]);
    }
  });
  return out;
}

}  // namespace specstream_kernels
