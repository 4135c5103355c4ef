// Helpers shared by the hf_zero CUDA kernels: launch geometry and block-wide reductions.
//
// Only c10/cuda headers and the CUDA runtime are used -- not ATen/cuda/CUDAContext.h, which pulls in the cuBLAS,
// cuSPARSE and cuSOLVER headers: the kernels need none of them, they slow the build, and a bare CUDA toolkit
// (nvcc + cudart only) lacks them.
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>

namespace hf_zero {

constexpr int kThreads = 256;  // threads per block for element-wise and row kernels
constexpr int kWarp = 32;

// Streaming multiprocessors of the current device (queried once per device).
inline int sm_count() {
  static int cached[64] = {};
  const int device = c10::cuda::current_device();
  TORCH_CHECK(device < 64, "hf_zero: device index ", device, " out of range");
  if (cached[device] == 0) {
    int count = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
    cached[device] = count;
  }
  return cached[device];
}

inline cudaStream_t current_stream() {
  return c10::cuda::getCurrentCUDAStream().stream();
}

inline int elementwise_blocks(int64_t numel) {
  // Grid-stride loops: enough blocks to fill the GPU a few times over, never more than needed.
  const int64_t needed = (numel + kThreads - 1) / kThreads;
  const int64_t cap = static_cast<int64_t>(sm_count()) * 8;
  return static_cast<int>(std::max<int64_t>(1, std::min(needed, cap)));
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset /= 2) {
    v += __shfl_xor_sync(0xffffffffu, v, offset);
  }
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset /= 2) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  }
  return v;
}

// Sum (or max) over the block; every thread gets the result. `scratch` holds kThreads / kWarp floats.
template <bool kMax>
__device__ __forceinline__ float block_reduce(float v, float* scratch) {
  const int lane = threadIdx.x % kWarp;
  const int warp = threadIdx.x / kWarp;
  v = kMax ? warp_max(v) : warp_sum(v);
  __syncthreads();  // scratch may still be read by a previous reduction
  if (lane == 0) {
    scratch[warp] = v;
  }
  __syncthreads();
  const int warps = (blockDim.x + kWarp - 1) / kWarp;
  v = lane < warps ? scratch[lane] : (kMax ? -INFINITY : 0.f);
  return kMax ? warp_max(v) : warp_sum(v);
}

}  // namespace hf_zero
