// Adam/AdamW CUDA kernels: hf_zero::adam_step (one flat partition) and hf_zero::multi_tensor_adam (many tensors,
// one launch per gradient dtype). Same formula as adam_cpu.cpp (see adam.h).

#include <torch/library.h>

#include <vector>

#include "adam.h"
#include "cuda_utils.cuh"
#include "utils.h"

namespace hf_zero {
namespace {

template <typename G, typename O, bool kWriteOut16>
__device__ __forceinline__ void adam_element(float* __restrict__ param, const G* __restrict__ grad,
                                             float* __restrict__ exp_avg, float* __restrict__ exp_avg_sq,
                                             O* __restrict__ out16, int64_t i, const AdamConstants& c) {
  float p = param[i];
  const float g = static_cast<float>(grad[i]) * c.inv_grad_scale + c.l2_decay * p;
  p *= c.param_decay;
  float m = exp_avg[i];
  m = m + c.one_minus_beta1 * (g - m);
  const float v = c.beta2 * exp_avg_sq[i] + c.one_minus_beta2 * (g * g);
  const float denom = sqrtf(v) * c.inv_bc2_sqrt + c.eps;
  p = p - c.step_size * (m / denom);
  param[i] = p;
  exp_avg[i] = m;
  exp_avg_sq[i] = v;
  if constexpr (kWriteOut16) {
    out16[i] = static_cast<O>(p);
  }
}

template <typename G, typename O, bool kWriteOut16>
__global__ void adam_kernel(float* __restrict__ param, const G* __restrict__ grad, float* __restrict__ exp_avg,
                            float* __restrict__ exp_avg_sq, O* __restrict__ out16, int64_t numel,
                            const AdamConstants c) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < numel;
       i += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    adam_element<G, O, kWriteOut16>(param, grad, exp_avg, exp_avg_sq, out16, i, c);
  }
}

void check_tensors(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                   const at::Tensor& exp_avg_sq) {
  TORCH_CHECK(param.scalar_type() == at::kFloat && param.is_contiguous(),
              "adam_step: param must be a contiguous float32 tensor");
  check_float(grad, "adam_step: grad");
  for (const at::Tensor* t : {&grad, &exp_avg, &exp_avg_sq}) {
    TORCH_CHECK(t->numel() == param.numel(), "adam_step: all tensors must have param's number of elements");
    TORCH_CHECK(t->device() == param.device(), "adam_step: all tensors must be on ", param.device());
  }
  TORCH_CHECK(exp_avg.scalar_type() == at::kFloat && exp_avg.is_contiguous() &&
                  exp_avg_sq.scalar_type() == at::kFloat && exp_avg_sq.is_contiguous(),
              "adam_step: exp_avg and exp_avg_sq must be contiguous float32 tensors");
}

template <typename G>
void launch_one(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& out16, const AdamConstants& c) {
  const int64_t numel = param.numel();
  const auto stream = current_stream();
  const int blocks = elementwise_blocks(numel);
  float* p = param.mutable_data_ptr<float>();
  const G* g = grad.const_data_ptr<G>();
  float* m = exp_avg.mutable_data_ptr<float>();
  float* v = exp_avg_sq.mutable_data_ptr<float>();
  if (!out16.has_value()) {
    adam_kernel<G, float, false><<<blocks, kThreads, 0, stream>>>(p, g, m, v, nullptr, numel, c);
  } else if (out16->scalar_type() == at::kBFloat16) {
    adam_kernel<G, at::BFloat16, true>
        <<<blocks, kThreads, 0, stream>>>(p, g, m, v, out16->mutable_data_ptr<at::BFloat16>(), numel, c);
  } else {
    adam_kernel<G, at::Half, true>
        <<<blocks, kThreads, 0, stream>>>(p, g, m, v, out16->mutable_data_ptr<at::Half>(), numel, c);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void adam_step_cuda(const at::Tensor& param, const at::Tensor& grad_in, const at::Tensor& exp_avg,
                    const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& out16, int64_t step, double lr,
                    double beta1, double beta2, double eps, double weight_decay, bool adamw_mode,
                    bool bias_correction, double grad_scale) {
  check_tensors(param, grad_in, exp_avg, exp_avg_sq);
  if (out16.has_value()) {
    TORCH_CHECK((out16->scalar_type() == at::kBFloat16 || out16->scalar_type() == at::kHalf) &&
                    out16->numel() == param.numel() && out16->is_contiguous(),
                "adam_step: out16 must be a contiguous bf16/fp16 tensor with param's number of elements");
  }
  const AdamConstants c =
      make_adam_constants(step, lr, beta1, beta2, eps, weight_decay, adamw_mode, bias_correction, grad_scale);
  if (param.numel() == 0) {
    return;
  }
  const c10::cuda::CUDAGuard guard(param.device());
  const at::Tensor grad = grad_in.contiguous();
  switch (grad.scalar_type()) {
    case at::kFloat:
      launch_one<float>(param, grad, exp_avg, exp_avg_sq, out16, c);
      break;
    case at::kBFloat16:
      launch_one<at::BFloat16>(param, grad, exp_avg, exp_avg_sq, out16, c);
      break;
    default:
      launch_one<at::Half>(param, grad, exp_avg, exp_avg_sq, out16, c);
      break;
  }
}

// ---------------------------------------------------------------- multi-tensor

// One block per chunk of one tensor; the table of (tensor, chunk) lives in device memory, so a single launch
// covers any number of tensors.
constexpr int64_t kChunk = 1 << 16;

struct TensorSlot {
  float* param;
  const void* grad;
  float* exp_avg;
  float* exp_avg_sq;
  int64_t numel;
};

struct ChunkSlot {
  int32_t tensor;
  int32_t chunk;
};

template <typename G>
__global__ void multi_tensor_adam_kernel(const TensorSlot* __restrict__ tensors, const ChunkSlot* __restrict__ chunks,
                                         const AdamConstants c) {
  const ChunkSlot work = chunks[blockIdx.x];
  const TensorSlot t = tensors[work.tensor];
  const int64_t begin = static_cast<int64_t>(work.chunk) * kChunk;
  const int64_t end = min(begin + kChunk, t.numel);
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    adam_element<G, float, false>(t.param, static_cast<const G*>(t.grad), t.exp_avg, t.exp_avg_sq, nullptr, i, c);
  }
}

template <typename G>
void launch_multi(const std::vector<TensorSlot>& tensors, const at::Device device, const AdamConstants& c) {
  std::vector<ChunkSlot> chunks;
  for (size_t t = 0; t < tensors.size(); ++t) {
    const int64_t n_chunks = (tensors[t].numel + kChunk - 1) / kChunk;
    for (int64_t k = 0; k < n_chunks; ++k) {
      chunks.push_back({static_cast<int32_t>(t), static_cast<int32_t>(k)});
    }
  }
  if (chunks.empty()) {
    return;
  }
  // Both tables in one pinned host buffer, copied asynchronously on the current stream.
  const int64_t tensor_bytes = static_cast<int64_t>(tensors.size() * sizeof(TensorSlot));
  const int64_t chunk_bytes = static_cast<int64_t>(chunks.size() * sizeof(ChunkSlot));
  at::Tensor host = at::empty({tensor_bytes + chunk_bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  std::memcpy(host.mutable_data_ptr<uint8_t>(), tensors.data(), tensor_bytes);
  std::memcpy(host.mutable_data_ptr<uint8_t>() + tensor_bytes, chunks.data(), chunk_bytes);
  const at::Tensor table = host.to(device, /*non_blocking=*/true);
  const auto* d_tensors = reinterpret_cast<const TensorSlot*>(table.const_data_ptr<uint8_t>());
  const auto* d_chunks = reinterpret_cast<const ChunkSlot*>(table.const_data_ptr<uint8_t>() + tensor_bytes);
  multi_tensor_adam_kernel<G>
      <<<static_cast<unsigned>(chunks.size()), kThreads, 0, current_stream()>>>(d_tensors, d_chunks, c);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void multi_tensor_adam_cuda(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                            at::TensorList exp_avg_sqs, int64_t step, double lr, double beta1, double beta2,
                            double eps, double weight_decay, bool adamw_mode, bool bias_correction,
                            double grad_scale) {
  TORCH_CHECK(params.size() == grads.size() && params.size() == exp_avgs.size() &&
                  params.size() == exp_avg_sqs.size(),
              "multi_tensor_adam: params, grads, exp_avgs and exp_avg_sqs must have the same length");
  const AdamConstants c =
      make_adam_constants(step, lr, beta1, beta2, eps, weight_decay, adamw_mode, bias_correction, grad_scale);
  if (params.empty()) {
    return;
  }
  const at::Device device = params[0].device();
  const c10::cuda::CUDAGuard guard(device);
  std::vector<at::Tensor> keep_alive;  // contiguous copies of non-contiguous grads live until the launch
  std::vector<TensorSlot> by_dtype[3];  // fp32, bf16, fp16 grads
  for (size_t i = 0; i < params.size(); ++i) {
    check_tensors(params[i], grads[i], exp_avgs[i], exp_avg_sqs[i]);
    TORCH_CHECK(params[i].device() == device, "multi_tensor_adam: all tensors must be on one device");
    at::Tensor g = grads[i].contiguous();
    const int which = g.scalar_type() == at::kFloat ? 0 : (g.scalar_type() == at::kBFloat16 ? 1 : 2);
    by_dtype[which].push_back({params[i].mutable_data_ptr<float>(), g.const_data_ptr(),
                               exp_avgs[i].mutable_data_ptr<float>(), exp_avg_sqs[i].mutable_data_ptr<float>(),
                               params[i].numel()});
    keep_alive.push_back(std::move(g));
  }
  launch_multi<float>(by_dtype[0], device, c);
  launch_multi<at::BFloat16>(by_dtype[1], device, c);
  launch_multi<at::Half>(by_dtype[2], device, c);
}

}  // namespace

TORCH_LIBRARY_IMPL(hf_zero, CUDA, m) {
  m.impl("adam_step", &adam_step_cuda);
  m.impl("multi_tensor_adam", &multi_tensor_adam_cuda);
}

}  // namespace hf_zero
