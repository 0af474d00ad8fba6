// RMSNorm, row by row, with one summation order: weight * (x * rsqrt(mean(x^2) + eps)) rounded as torch
// rounds it (x's dtype after the scaling, then the weight's product rounded once).
//
// Why not torch's: the eager op and inductor's generated loop sum a row's squares in different orders, so a
// row's mean differs in its last bit now and then between the eager forward and the compiled steps. Under
// 8-bit activations (a8) such a bit can move a code by one step, and a greedy answer would then depend on
// which kind of step computed a token. This kernel is what both call: a row's result depends on the row
// alone (float32 lanes of 16 summed in order, the lanes then in a fixed tree; the tail added last), never on
// the other rows of the call, nor on threads.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <cmath>
#include <tuple>
#include <type_traits>

#include "common.h"

namespace {

using specstream_kernels::sum_lanes;
using specstream_kernels::Vec;

template <typename T>
inline Vec load_float(const T* src) {
  if constexpr (std::is_same_v<T, float>) {
    return Vec::loadu(src);
  } else {
    // Vec::size() values of T, widened (the low half of a Vectorized<T>'s worth).
    return std::get<0>(at::vec::convert_to_float<T>(at::vec::Vectorized<T>::loadu(src, Vec::size())));
  }
}

template <typename T>
void run(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor& out) {
  const int64_t rows = x.size(0), d = x.size(1);
  const int64_t body = d / Vec::size() * Vec::size();
  const T* x_ptr = x.data_ptr<T>();
  const T* w_ptr = weight.data_ptr<T>();
  T* o_ptr = out.data_ptr<T>();
  const int64_t xs = x.stride(0);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = x_ptr + r * xs;
      Vec acc(0.f);
      for (int64_t j = 0; j < body; j += Vec::size()) {
        const Vec v = load_float(row + j);
        acc = acc + v * v;
      }
      float total = sum_lanes(acc);
      for (int64_t j = body; j < d; ++j) {
        const float v = static_cast<float>(row[j]);
        total += v * v;
      }
      const float scale = 1.0f / std::sqrt(total / static_cast<float>(d) + static_cast<float>(eps));
      T* o = o_ptr + r * d;
      for (int64_t j = 0; j < d; ++j) {
        const T h = static_cast<T>(static_cast<float>(row[j]) * scale);
        o[j] = static_cast<T>(static_cast<float>(w_ptr[j]) * static_cast<float>(h));
      }
    }
  });
}

// x [rows, d] (unit last stride), weight [d] of x's dtype. Returns [rows, d], contiguous.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "rms_norm: x is [rows, d] with a unit last stride");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "rms_norm: weight is [d] of x's dtype");
  at::Tensor w = weight.contiguous();
  at::Tensor out = at::empty({x.size(0), x.size(1)}, x.options());
  if (x.size(0) == 0) return out;
  switch (x.scalar_type()) {
    case at::kFloat: run<float>(x, w, eps, out); break;
    case at::kBFloat16: run<c10::BFloat16>(x, w, eps, out); break;
    case at::kHalf: run<c10::Half>(x, w, eps, out); break;
    default: TORCH_CHECK(false, "rms_norm: float32, bfloat16 or float16, not ", x.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(specstream, CPU, m) { m.impl("rms_norm", &rms_norm); }
