// Adam/AdamW hyper-parameters of one step, reduced on the host to the constants the element loop needs.
// Shared by the CPU (adam_cpu.cpp) and CUDA (adam_cuda.cu) kernels so both compute the same formula:
//
//   g  = grad / grad_scale (+ weight_decay * p       when !adamw_mode: L2, as torch.optim.Adam)
//   p  = p * (1 - lr * weight_decay)                 when adamw_mode (decoupled, as torch.optim.AdamW)
//   m  = m + (1 - beta1) * (g - m)                   (torch's lerp form)
//   v  = beta2 * v + (1 - beta2) * g * g
//   p  = p - (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps),   bc_i = 1 - beta_i^step (1 without bias correction)
#pragma once

#include <cmath>
#include <cstdint>

#include <c10/util/Exception.h>

namespace hf_zero {

struct AdamConstants {
  float beta1;
  float beta2;
  float one_minus_beta1;
  float one_minus_beta2;
  float eps;
  float l2_decay;          // weight_decay when !adamw_mode, else 0
  float param_decay;       // 1 - lr * weight_decay when adamw_mode, else 1
  float step_size;         // lr / bc1
  float inv_bc2_sqrt;      // 1 / sqrt(bc2)
  float inv_grad_scale;    // 1 / grad_scale
};

inline AdamConstants make_adam_constants(int64_t step, double lr, double beta1, double beta2, double eps,
                                         double weight_decay, bool adamw_mode, bool bias_correction,
                                         double grad_scale) {
  TORCH_CHECK(step >= 1, "adam_step: step must be >= 1 (the first step is 1), got ", step);
  TORCH_CHECK(grad_scale > 0.0, "adam_step: grad_scale must be > 0, got ", grad_scale);
  const double bc1 = bias_correction ? 1.0 - std::pow(beta1, static_cast<double>(step)) : 1.0;
  const double bc2 = bias_correction ? 1.0 - std::pow(beta2, static_cast<double>(step)) : 1.0;
  AdamConstants c;
  c.beta1 = static_cast<float>(beta1);
  c.beta2 = static_cast<float>(beta2);
  c.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  c.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  c.eps = static_cast<float>(eps);
  c.l2_decay = adamw_mode ? 0.0f : static_cast<float>(weight_decay);
  c.param_decay = adamw_mode ? static_cast<float>(1.0 - lr * weight_decay) : 1.0f;
  c.step_size = static_cast<float>(lr / bc1);
  c.inv_bc2_sqrt = static_cast<float>(1.0 / std::sqrt(bc2));
  c.inv_grad_scale = static_cast<float>(1.0 / grad_scale);
  return c;
}

}  // namespace hf_zero
