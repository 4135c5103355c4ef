// hf_zero::scale_add CPU kernel: out = x + alpha * y (same shape, same floating dtype).

#include <ATen/Parallel.h>
#include <torch/library.h>

#include "utils.h"

namespace hf_zero {
namespace {

template <typename T>
void scale_add_kernel(const T* x, const T* y, T* out, float alpha, int64_t numel) {
  at::parallel_for(0, numel, 1 << 15, [&](int64_t begin, int64_t end) {
#pragma omp simd
    for (int64_t i = begin; i < end; ++i) {
      out[i] = from_float<T>(to_float(x[i]) + alpha * to_float(y[i]));
    }
  });
}

at::Tensor scale_add_cpu(const at::Tensor& x, const at::Tensor& y, double alpha) {
  TORCH_CHECK(x.sizes() == y.sizes(), "scale_add: x and y must have the same shape, got ", x.sizes(), " and ",
              y.sizes());
  TORCH_CHECK(x.scalar_type() == y.scalar_type(), "scale_add: x and y must have the same dtype");
  check_float(x, "scale_add: x");
  const at::Tensor xc = x.contiguous();
  const at::Tensor yc = y.contiguous();
  at::Tensor out = at::empty_like(xc);
  HF_ZERO_DISPATCH_FLOAT(xc.scalar_type(), "scale_add_cpu", [&] {
    scale_add_kernel<scalar_t>(xc.const_data_ptr<scalar_t>(), yc.const_data_ptr<scalar_t>(),
                               out.mutable_data_ptr<scalar_t>(), to_float(alpha), xc.numel());
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(hf_zero, CPU, m) {
  m.impl("scale_add", &scale_add_cpu);
}

}  // namespace hf_zero
