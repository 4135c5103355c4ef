// Lion CPU kernel: hf_zero::lion_step over one flat fp32 partition (DeepSpeedCPULion's update; Chen et al. 2023):
//
//   g = grad / grad_scale
//   c = beta1 * m + (1 - beta1) * g
//   p = p * (1 - lr * weight_decay) - lr * sign(c)      (sign(0) = 0)
//   m = beta2 * m + (1 - beta2) * g
//
// One pass over memory, split over threads with at::parallel_for, vectorized with `omp simd` inside a chunk.

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>

#include "utils.h"

namespace hf_zero {
namespace {

struct LionConstants {
  float lr;
  float beta1;
  float one_minus_beta1;
  float beta2;
  float one_minus_beta2;
  float param_decay;  // 1 - lr * weight_decay
  float inv_grad_scale;
};

template <typename G, typename O, bool kWriteOut16>
void lion_chunk(float* __restrict param, const G* __restrict grad, float* __restrict exp_avg, O* __restrict out16,
                int64_t count, const LionConstants c) {
  const float lr = c.lr, beta1 = c.beta1, one_minus_beta1 = c.one_minus_beta1, beta2 = c.beta2;
  const float one_minus_beta2 = c.one_minus_beta2, param_decay = c.param_decay, inv_scale = c.inv_grad_scale;
#pragma omp simd
  for (int64_t i = 0; i < count; ++i) {
    const float g = to_float(grad[i]) * inv_scale;
    const float m = exp_avg[i];
    const float u = beta1 * m + one_minus_beta1 * g;
    const float sign = static_cast<float>(u > 0.0f) - static_cast<float>(u < 0.0f);
    const float p = param[i] * param_decay - lr * sign;
    param[i] = p;
    exp_avg[i] = beta2 * m + one_minus_beta2 * g;
    if constexpr (kWriteOut16) {
      out16[i] = from_float<O>(p);
    }
  }
}

template <typename G, typename O, bool kWriteOut16>
void lion_kernel(float* param, const G* grad, float* exp_avg, O* out16, int64_t numel, const LionConstants c) {
  at::parallel_for(0, numel, kElementwiseGrain, [=](int64_t begin, int64_t end) {
    lion_chunk<G, O, kWriteOut16>(param + begin, grad + begin, exp_avg + begin,
                                  kWriteOut16 ? out16 + begin : nullptr, end - begin, c);
  });
}

template <typename G>
void dispatch_out16(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                    const std::optional<at::Tensor>& out16, const LionConstants& c) {
  float* p = param.mutable_data_ptr<float>();
  const G* g = grad.const_data_ptr<G>();
  float* m = exp_avg.mutable_data_ptr<float>();
  const int64_t n = param.numel();
  if (!out16.has_value()) {
    lion_kernel<G, float, false>(p, g, m, nullptr, n, c);
  } else if (out16->scalar_type() == at::kBFloat16) {
    lion_kernel<G, at::BFloat16, true>(p, g, m, out16->mutable_data_ptr<at::BFloat16>(), n, c);
  } else {
    lion_kernel<G, at::Half, true>(p, g, m, out16->mutable_data_ptr<at::Half>(), n, c);
  }
}

void lion_step_cpu(const at::Tensor& param, const at::Tensor& grad_in, const at::Tensor& exp_avg,
                   const std::optional<at::Tensor>& out16, double lr, double beta1, double beta2, double weight_decay,
                   double grad_scale) {
  TORCH_CHECK(param.scalar_type() == at::kFloat && param.is_contiguous(),
              "lion_step: param must be a contiguous float32 tensor (the fp32 master copy), got ",
              param.scalar_type());
  check_float(grad_in, "lion_step: grad");
  TORCH_CHECK(grad_in.numel() == param.numel(), "lion_step: grad has ", grad_in.numel(), " elements, param has ",
              param.numel());
  TORCH_CHECK(exp_avg.scalar_type() == at::kFloat && exp_avg.is_contiguous() && exp_avg.numel() == param.numel(),
              "lion_step: exp_avg must be contiguous float32 with param's number of elements");
  TORCH_CHECK(grad_scale > 0.0, "lion_step: grad_scale must be > 0, got ", grad_scale);
  if (out16.has_value()) {
    TORCH_CHECK((out16->scalar_type() == at::kBFloat16 || out16->scalar_type() == at::kHalf) &&
                    out16->numel() == param.numel() && out16->is_contiguous(),
                "lion_step: out16 must be contiguous bfloat16/float16 with param's number of elements");
  }
  LionConstants c;
  c.lr = static_cast<float>(lr);
  c.beta1 = static_cast<float>(beta1);
  c.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  c.beta2 = static_cast<float>(beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  c.param_decay = static_cast<float>(1.0 - lr * weight_decay);
  c.inv_grad_scale = static_cast<float>(1.0 / grad_scale);
  const at::Tensor grad = grad_in.contiguous();
  switch (grad.scalar_type()) {
    case at::kFloat:
      dispatch_out16<float>(param, grad, exp_avg, out16, c);
      break;
    case at::kBFloat16:
      dispatch_out16<at::BFloat16>(param, grad, exp_avg, out16, c);
      break;
    default:
      dispatch_out16<at::Half>(param, grad, exp_avg, out16, c);
      break;
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(hf_zero, CPU, m) { m.impl("lion_step", &lion_step_cpu); }

}  // namespace hf_zero
