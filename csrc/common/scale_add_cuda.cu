// hf_zero::scale_add CUDA kernel: out = x + alpha * y.

#include <torch/library.h>

#include "cuda_utils.cuh"
#include "utils.h"

namespace hf_zero {
namespace {

template <typename T>
__global__ void scale_add_kernel(const T* __restrict__ x, const T* __restrict__ y, T* __restrict__ out, float alpha,
                                 int64_t numel) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < numel;
       i += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    out[i] = static_cast<T>(static_cast<float>(x[i]) + alpha * static_cast<float>(y[i]));
  }
}

at::Tensor scale_add_cuda(const at::Tensor& x, const at::Tensor& y, double alpha) {
  TORCH_CHECK(x.sizes() == y.sizes() && x.scalar_type() == y.scalar_type(),
              "scale_add: x and y must have the same shape and dtype");
  check_float(x, "scale_add: x");
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor xc = x.contiguous();
  const at::Tensor yc = y.contiguous();
  at::Tensor out = at::empty_like(xc);
  const int64_t numel = xc.numel();
  if (numel == 0) {
    return out;
  }
  HF_ZERO_DISPATCH_FLOAT(xc.scalar_type(), "scale_add_cuda", [&] {
    scale_add_kernel<scalar_t><<<elementwise_blocks(numel), kThreads, 0, current_stream()>>>(
        xc.const_data_ptr<scalar_t>(), yc.const_data_ptr<scalar_t>(), out.mutable_data_ptr<scalar_t>(),
        static_cast<float>(alpha), numel);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(hf_zero, CUDA, m) {
  m.impl("scale_add", &scale_add_cuda);
}

}  // namespace hf_zero
