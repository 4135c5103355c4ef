// hf_zero::sum_of_squares CUDA kernel: sum(x.float() ** 2) over every element, as a 0-dim fp32 tensor.
//
// Two launches of one kernel, no atomics, so the result is deterministic: a grid-stride pass leaves one fp32
// partial sum per block in a (blocks,) buffer, then a single block sums those partials. inf and nan propagate
// through every add (squares are never negative), as the caller's fp16 overflow check needs.

#include <torch/library.h>

#include "cuda_utils.cuh"
#include "utils.h"

namespace hf_zero {
namespace {

// out[blockIdx.x] = sum over this block's grid-stride elements of x (squared first when kSquare).
template <typename T, bool kSquare>
__global__ void sum_kernel(const T* __restrict__ x, int64_t numel, float* __restrict__ out) {
  __shared__ float scratch[kThreads / kWarp];
  float acc = 0.f;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < numel;
       i += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    const float v = static_cast<float>(x[i]);
    acc += kSquare ? v * v : v;
  }
  acc = block_reduce<false>(acc, scratch);
  if (threadIdx.x == 0) {
    out[blockIdx.x] = acc;
  }
}

at::Tensor sum_of_squares_cuda(const at::Tensor& x) {
  check_float(x, "sum_of_squares: x");
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor xc = x.contiguous();
  const int64_t numel = xc.numel();
  at::Tensor out = at::zeros({}, xc.options().dtype(at::kFloat));
  if (numel == 0) {
    return out;
  }
  const int blocks = elementwise_blocks(numel);
  at::Tensor partial = at::empty({blocks}, xc.options().dtype(at::kFloat));  // (blocks,)
  HF_ZERO_DISPATCH_FLOAT(xc.scalar_type(), "sum_of_squares_cuda", [&] {
    sum_kernel<scalar_t, true><<<blocks, kThreads, 0, current_stream()>>>(
        xc.const_data_ptr<scalar_t>(), numel, partial.mutable_data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  sum_kernel<float, false><<<1, kThreads, 0, current_stream()>>>(partial.const_data_ptr<float>(), blocks,
                                                                 out.mutable_data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(hf_zero, CUDA, m) {
  m.impl("sum_of_squares", &sum_of_squares_cuda);
}

}  // namespace hf_zero
