// Adagrad CPU kernel: hf_zero::adagrad_step over one flat fp32 partition (DeepSpeedCPUAdagrad's update, which is
// torch.optim.Adagrad's with lr_decay 0 and initial_accumulator_value 0):
//
//   g = grad / grad_scale + weight_decay * p          (L2, as torch.optim.Adagrad)
//   v = v + g * g
//   p = p - lr * g / (sqrt(v) + eps)
//
// One pass over memory, split over threads with at::parallel_for, vectorized with `omp simd` inside a chunk
// (the same structure as adam/adam_cpu.cpp).

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>

#include "utils.h"

namespace hf_zero {
namespace {

template <typename G, typename O, bool kWriteOut16>
void adagrad_chunk(float* __restrict param, const G* __restrict grad, float* __restrict exp_avg_sq,
                   O* __restrict out16, int64_t count, const float lr, const float eps, const float weight_decay,
                   const float inv_grad_scale) {
#pragma omp simd
  for (int64_t i = 0; i < count; ++i) {
    float p = param[i];
    const float g = to_float(grad[i]) * inv_grad_scale + weight_decay * p;
    const float v = exp_avg_sq[i] + g * g;
    p = p - lr * g / (std::sqrt(v) + eps);
    param[i] = p;
    exp_avg_sq[i] = v;
    if constexpr (kWriteOut16) {
      out16[i] = from_float<O>(p);
    }
  }
}

template <typename G, typename O, bool kWriteOut16>
void adagrad_kernel(float* param, const G* grad, float* exp_avg_sq, O* out16, int64_t numel, float lr, float eps,
                    float weight_decay, float inv_grad_scale) {
  at::parallel_for(0, numel, kElementwiseGrain, [=](int64_t begin, int64_t end) {
    adagrad_chunk<G, O, kWriteOut16>(param + begin, grad + begin, exp_avg_sq + begin,
                                     kWriteOut16 ? out16 + begin : nullptr, end - begin, lr, eps, weight_decay,
                                     inv_grad_scale);
  });
}

template <typename G>
void dispatch_out16(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg_sq,
                    const std::optional<at::Tensor>& out16, float lr, float eps, float wd, float inv_scale) {
  float* p = param.mutable_data_ptr<float>();
  const G* g = grad.const_data_ptr<G>();
  float* v = exp_avg_sq.mutable_data_ptr<float>();
  const int64_t n = param.numel();
  if (!out16.has_value()) {
    adagrad_kernel<G, float, false>(p, g, v, nullptr, n, lr, eps, wd, inv_scale);
  } else if (out16->scalar_type() == at::kBFloat16) {
    adagrad_kernel<G, at::BFloat16, true>(p, g, v, out16->mutable_data_ptr<at::BFloat16>(), n, lr, eps, wd,
                                          inv_scale);
  } else {
    adagrad_kernel<G, at::Half, true>(p, g, v, out16->mutable_data_ptr<at::Half>(), n, lr, eps, wd, inv_scale);
  }
}

void adagrad_step_cpu(const at::Tensor& param, const at::Tensor& grad_in, const at::Tensor& exp_avg_sq,
                      const std::optional<at::Tensor>& out16, double lr, double eps, double weight_decay,
                      double grad_scale) {
  TORCH_CHECK(param.scalar_type() == at::kFloat && param.is_contiguous(),
              "adagrad_step: param must be a contiguous float32 tensor (the fp32 master copy), got ",
              param.scalar_type());
  check_float(grad_in, "adagrad_step: grad");
  TORCH_CHECK(grad_in.numel() == param.numel(), "adagrad_step: grad has ", grad_in.numel(),
              " elements, param has ", param.numel());
  TORCH_CHECK(exp_avg_sq.scalar_type() == at::kFloat && exp_avg_sq.is_contiguous() &&
                  exp_avg_sq.numel() == param.numel(),
              "adagrad_step: exp_avg_sq must be contiguous float32 with param's number of elements");
  TORCH_CHECK(grad_scale > 0.0, "adagrad_step: grad_scale must be > 0, got ", grad_scale);
  if (out16.has_value()) {
    TORCH_CHECK((out16->scalar_type() == at::kBFloat16 || out16->scalar_type() == at::kHalf) &&
                    out16->numel() == param.numel() && out16->is_contiguous(),
                "adagrad_step: out16 must be contiguous bfloat16/float16 with param's number of elements");
  }
  const at::Tensor grad = grad_in.contiguous();
  const float lr_f = static_cast<float>(lr), eps_f = static_cast<float>(eps);
  const float wd_f = static_cast<float>(weight_decay), inv_scale = static_cast<float>(1.0 / grad_scale);
  switch (grad.scalar_type()) {
    case at::kFloat:
      dispatch_out16<float>(param, grad, exp_avg_sq, out16, lr_f, eps_f, wd_f, inv_scale);
      break;
    case at::kBFloat16:
      dispatch_out16<at::BFloat16>(param, grad, exp_avg_sq, out16, lr_f, eps_f, wd_f, inv_scale);
      break;
    default:
      dispatch_out16<at::Half>(param, grad, exp_avg_sq, out16, lr_f, eps_f, wd_f, inv_scale);
      break;
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(hf_zero, CPU, m) { m.impl("adagrad_step", &adagrad_step_cpu); }

}  // namespace hf_zero
