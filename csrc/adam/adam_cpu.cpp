// Adam/AdamW CPU kernels: hf_zero::adam_step (one flat partition) and hf_zero::multi_tensor_adam.
//
// One pass over memory per step: each element reads p, g, m, v and writes p, m, v (and the 16-bit copy of p),
// so the kernel is bound by memory bandwidth. OpenMP (through at::parallel_for, which honours
// torch.set_num_threads) splits the flat range into contiguous chunks; inside a chunk the loop body is
// branch-free and `#pragma omp simd` lets the compiler vectorize it, bf16/fp16 conversions included.

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>

#include "adam.h"
#include "utils.h"

namespace hf_zero {
namespace {

// Elements per OpenMP task: large enough to amortize scheduling, small enough to balance 2..64 threads.
constexpr int64_t kGrainSize = 1 << 16;

// One contiguous chunk. A separate function (not the parallel_for lambda body) so that the pointers keep their
// __restrict qualification and the constants live in registers: captured by reference in a lambda, GCC must
// assume the stores to param may alias them and reloads them every iteration.
template <typename G, typename O, bool kWriteOut16>
void adam_chunk(float* __restrict param, const G* __restrict grad, float* __restrict exp_avg,
                float* __restrict exp_avg_sq, O* __restrict out16, int64_t count, const AdamConstants c) {
  const float inv_grad_scale = c.inv_grad_scale;
  const float l2_decay = c.l2_decay;
  const float param_decay = c.param_decay;
  const float one_minus_beta1 = c.one_minus_beta1;
  const float beta2 = c.beta2;
  const float one_minus_beta2 = c.one_minus_beta2;
  const float inv_bc2_sqrt = c.inv_bc2_sqrt;
  const float eps = c.eps;
  const float step_size = c.step_size;
#pragma omp simd
  for (int64_t i = 0; i < count; ++i) {
    float p = param[i];
    const float g = to_float(grad[i]) * inv_grad_scale + l2_decay * p;
    p *= param_decay;
    float m = exp_avg[i];
    m = m + one_minus_beta1 * (g - m);
    const float v = beta2 * exp_avg_sq[i] + one_minus_beta2 * (g * g);
    const float denom = std::sqrt(v) * inv_bc2_sqrt + eps;
    p = p - step_size * (m / denom);
    param[i] = p;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    if constexpr (kWriteOut16) {
      out16[i] = from_float<O>(p);
    }
  }
}

template <typename G, typename O, bool kWriteOut16>
void adam_kernel(float* param, const G* grad, float* exp_avg, float* exp_avg_sq, O* out16, int64_t numel,
                 const AdamConstants c) {
  at::parallel_for(0, numel, kGrainSize, [=](int64_t begin, int64_t end) {
    adam_chunk<G, O, kWriteOut16>(param + begin, grad + begin, exp_avg + begin, exp_avg_sq + begin,
                                  kWriteOut16 ? out16 + begin : nullptr, end - begin, c);
  });
}

void check_state(const at::Tensor& t, const at::Tensor& param, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat, "adam_step: ", what, " must be float32, got ", t.scalar_type());
  TORCH_CHECK(t.numel() == param.numel(), "adam_step: ", what, " has ", t.numel(), " elements, param has ",
              param.numel());
  TORCH_CHECK(t.is_contiguous(), "adam_step: ", what, " must be contiguous");
  TORCH_CHECK(t.device() == param.device(), "adam_step: ", what, " is on ", t.device(), ", param on ",
              param.device());
}

template <typename G>
void dispatch_out16(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                    const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& out16, const AdamConstants& c) {
  float* p = param.mutable_data_ptr<float>();
  const G* g = grad.const_data_ptr<G>();
  float* m = exp_avg.mutable_data_ptr<float>();
  float* v = exp_avg_sq.mutable_data_ptr<float>();
  const int64_t numel = param.numel();
  if (!out16.has_value()) {
    adam_kernel<G, float, false>(p, g, m, v, nullptr, numel, c);
  } else if (out16->scalar_type() == at::kBFloat16) {
    adam_kernel<G, at::BFloat16, true>(p, g, m, v, out16->mutable_data_ptr<at::BFloat16>(), numel, c);
  } else {
    adam_kernel<G, at::Half, true>(p, g, m, v, out16->mutable_data_ptr<at::Half>(), numel, c);
  }
}

void adam_step_one(const at::Tensor& param, const at::Tensor& grad_in, const at::Tensor& exp_avg,
                   const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& out16, const AdamConstants& c) {
  TORCH_CHECK(param.scalar_type() == at::kFloat, "adam_step: param must be float32 (the fp32 master copy), got ",
              param.scalar_type());
  TORCH_CHECK(param.is_contiguous(), "adam_step: param must be contiguous");
  check_float(grad_in, "adam_step: grad");
  TORCH_CHECK(grad_in.numel() == param.numel(), "adam_step: grad has ", grad_in.numel(), " elements, param has ",
              param.numel());
  check_state(exp_avg, param, "exp_avg");
  check_state(exp_avg_sq, param, "exp_avg_sq");
  if (out16.has_value()) {
    TORCH_CHECK(out16->scalar_type() == at::kBFloat16 || out16->scalar_type() == at::kHalf,
                "adam_step: out16 must be bfloat16 or float16, got ", out16->scalar_type());
    TORCH_CHECK(out16->numel() == param.numel() && out16->is_contiguous(),
                "adam_step: out16 must be contiguous with param's number of elements");
  }
  const at::Tensor grad = grad_in.contiguous();
  switch (grad.scalar_type()) {
    case at::kFloat:
      dispatch_out16<float>(param, grad, exp_avg, exp_avg_sq, out16, c);
      break;
    case at::kBFloat16:
      dispatch_out16<at::BFloat16>(param, grad, exp_avg, exp_avg_sq, out16, c);
      break;
    default:
      dispatch_out16<at::Half>(param, grad, exp_avg, exp_avg_sq, out16, c);
      break;
  }
}

void adam_step_cpu(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                   const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& out16, int64_t step, double lr,
                   double beta1, double beta2, double eps, double weight_decay, bool adamw_mode,
                   bool bias_correction, double grad_scale) {
  const AdamConstants c =
      make_adam_constants(step, lr, beta1, beta2, eps, weight_decay, adamw_mode, bias_correction, grad_scale);
  adam_step_one(param, grad, exp_avg, exp_avg_sq, out16, c);
}

void multi_tensor_adam_cpu(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                           at::TensorList exp_avg_sqs, int64_t step, double lr, double beta1, double beta2,
                           double eps, double weight_decay, bool adamw_mode, bool bias_correction,
                           double grad_scale) {
  TORCH_CHECK(params.size() == grads.size() && params.size() == exp_avgs.size() &&
                  params.size() == exp_avg_sqs.size(),
              "multi_tensor_adam: params, grads, exp_avgs and exp_avg_sqs must have the same length");
  const AdamConstants c =
      make_adam_constants(step, lr, beta1, beta2, eps, weight_decay, adamw_mode, bias_correction, grad_scale);
  for (size_t i = 0; i < params.size(); ++i) {
    adam_step_one(params[i], grads[i], exp_avgs[i], exp_avg_sqs[i], std::nullopt, c);
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(hf_zero, CPU, m) {
  m.impl("adam_step", &adam_step_cpu);
  m.impl("multi_tensor_adam", &multi_tensor_adam_cpu);
}

}  // namespace hf_zero
