// Transformer-block CPU kernels: fused bias + GeLU, scaled masked softmax, rotary position embedding.
//
// All operate row-wise on the last dimension of a contiguous input viewed as (rows, D); broadcast operands
// (mask, cos/sin tables) are addressed through RowOffsets without being materialized.

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <string_view>

#include "utils.h"

namespace hf_zero {
namespace {

constexpr float kSqrt1_2 = 0.70710678118654752440f;       // 1/sqrt(2)
constexpr float kInvSqrt2Pi = 0.39894228040143267794f;    // 1/sqrt(2*pi)
constexpr float kSqrt2OverPi = 0.79788456080286535588f;   // sqrt(2/pi)
constexpr float kGeluTanhCoeff = 0.044715f;
constexpr int64_t kRowTaskElements = int64_t{1} << 14;  // per OpenMP task (rows_per_task)

bool parse_approximate(std::string_view approximate) {
  TORCH_CHECK(approximate == "none" || approximate == "tanh",
              "bias_gelu: approximate must be 'none' or 'tanh', got '", approximate, "'");
  return approximate == "tanh";
}

// ---------------------------------------------------------------- bias + GeLU

template <typename T, bool kTanh, bool kBackward>
void gelu_kernel(const T* __restrict x, const float* __restrict bias, const T* __restrict grad, T* __restrict out,
                 int64_t rows, int64_t D) {
  at::parallel_for(0, rows, rows_per_task(D, kRowTaskElements), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * D;
      T* orow = out + r * D;
#pragma omp simd
      for (int64_t j = 0; j < D; ++j) {
        const float z = to_float(xr[j]) + (bias != nullptr ? bias[j] : 0.f);
        float value;
        if constexpr (kTanh) {
          const float t = std::tanh(kSqrt2OverPi * (z + kGeluTanhCoeff * z * z * z));
          if constexpr (kBackward) {
            const float dinner = kSqrt2OverPi * (1.f + 3.f * kGeluTanhCoeff * z * z);
            value = to_float(grad[r * D + j]) * (0.5f * (1.f + t) + 0.5f * z * (1.f - t * t) * dinner);
          } else {
            value = 0.5f * z * (1.f + t);
          }
        } else {
          const float cdf = 0.5f * (1.f + std::erf(z * kSqrt1_2));
          if constexpr (kBackward) {
            value = to_float(grad[r * D + j]) * (cdf + z * kInvSqrt2Pi * std::exp(-0.5f * z * z));
          } else {
            value = z * cdf;
          }
        }
        orow[j] = from_float<T>(value);
      }
    }
  });
}

at::Tensor gelu_impl(const at::Tensor& x_in, const std::optional<at::Tensor>& bias_in, const at::Tensor* grad_in,
                     std::string_view approximate) {
  check_float(x_in, "bias_gelu: x");
  const bool use_tanh = parse_approximate(approximate);
  const at::Tensor x = x_in.contiguous();
  const int64_t D = x.dim() == 0 ? 1 : x.size(-1);
  const int64_t rows = D == 0 ? 0 : x.numel() / D;
  at::Tensor bias;
  if (bias_in.has_value()) {
    TORCH_CHECK(bias_in->dim() == 1 && bias_in->size(0) == D, "bias_gelu: bias must have shape (", D, ",), got ",
                bias_in->sizes());
    bias = bias_in->to(at::kFloat).contiguous();
  }
  at::Tensor grad;
  if (grad_in != nullptr) {
    TORCH_CHECK(grad_in->sizes() == x_in.sizes() && grad_in->scalar_type() == x_in.scalar_type(),
                "bias_gelu_bwd: grad_out must match x in shape and dtype");
    grad = grad_in->contiguous();
  }
  at::Tensor out = at::empty_like(x);
  HF_ZERO_DISPATCH_FLOAT(x.scalar_type(), "bias_gelu", [&] {
    const scalar_t* px = x.const_data_ptr<scalar_t>();
    const float* pb = bias.defined() ? bias.const_data_ptr<float>() : nullptr;
    scalar_t* po = out.mutable_data_ptr<scalar_t>();
    if (grad.defined()) {
      const scalar_t* pg = grad.const_data_ptr<scalar_t>();
      use_tanh ? gelu_kernel<scalar_t, true, true>(px, pb, pg, po, rows, D)
               : gelu_kernel<scalar_t, false, true>(px, pb, pg, po, rows, D);
    } else {
      use_tanh ? gelu_kernel<scalar_t, true, false>(px, pb, nullptr, po, rows, D)
               : gelu_kernel<scalar_t, false, false>(px, pb, nullptr, po, rows, D);
    }
  });
  return out;
}

at::Tensor bias_gelu_cpu(const at::Tensor& x, const std::optional<at::Tensor>& bias, c10::string_view approximate) {
  return gelu_impl(x, bias, nullptr, std::string_view(approximate.data(), approximate.size()));
}

at::Tensor bias_gelu_bwd_cpu(const at::Tensor& grad_out, const at::Tensor& x, const std::optional<at::Tensor>& bias,
                             c10::string_view approximate) {
  return gelu_impl(x, bias, &grad_out, std::string_view(approximate.data(), approximate.size()));
}

// ---------------------------------------------------------------- scaled masked softmax

template <typename T>
void softmax_kernel(const T* __restrict x, const bool* __restrict mask, const RowOffsets mask_rows, T* __restrict out,
                    float scale, int64_t rows, int64_t D) {
  at::parallel_for(0, rows, rows_per_task(D, kRowTaskElements), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * D;
      const bool* mr = mask != nullptr ? mask + mask_rows(r) : nullptr;
      T* orow = out + r * D;
      float row_max = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < D; ++j) {
        const bool masked = mr != nullptr && mr[j];
        const float v = masked ? -std::numeric_limits<float>::infinity() : to_float(xr[j]) * scale;
        row_max = std::max(row_max, v);
      }
      if (row_max == -std::numeric_limits<float>::infinity()) {  // every position masked
        for (int64_t j = 0; j < D; ++j) {
          orow[j] = from_float<T>(0.f);
        }
        continue;
      }
      float sum = 0.f;
      // exp is recomputed in the write pass rather than staged: the row is in L1 and 16-bit rows could not hold it.
      for (int64_t j = 0; j < D; ++j) {
        const bool masked = mr != nullptr && mr[j];
        sum += masked ? 0.f : std::exp(to_float(xr[j]) * scale - row_max);
      }
      const float inv_sum = 1.f / sum;
      for (int64_t j = 0; j < D; ++j) {
        const bool masked = mr != nullptr && mr[j];
        orow[j] = from_float<T>(masked ? 0.f : std::exp(to_float(xr[j]) * scale - row_max) * inv_sum);
      }
    }
  });
}

at::Tensor scaled_masked_softmax_cpu(const at::Tensor& x_in, const std::optional<at::Tensor>& mask_in, double scale) {
  check_float(x_in, "scaled_masked_softmax: x");
  TORCH_CHECK(x_in.dim() >= 1, "scaled_masked_softmax: x must have at least one dimension");
  const at::Tensor x = x_in.contiguous();
  const int64_t D = x.size(-1);
  const int64_t rows = D == 0 ? 0 : x.numel() / D;
  at::Tensor mask;
  RowOffsets mask_rows;
  if (mask_in.has_value()) {
    TORCH_CHECK(mask_in->scalar_type() == at::kBool, "scaled_masked_softmax: mask must be bool (True = masked out)");
    mask = expand_rows(*mask_in, x.sizes());
    mask_rows = RowOffsets(mask);
  }
  at::Tensor out = at::empty_like(x);
  HF_ZERO_DISPATCH_FLOAT(x.scalar_type(), "scaled_masked_softmax", [&] {
    softmax_kernel<scalar_t>(x.const_data_ptr<scalar_t>(), mask.defined() ? mask.const_data_ptr<bool>() : nullptr,
                             mask_rows, out.mutable_data_ptr<scalar_t>(), to_float(scale), rows, D);
  });
  return out;
}

// dx = scale * y * (g - sum(g * y))
template <typename T>
void softmax_bwd_kernel(const T* __restrict g, const T* __restrict y, T* __restrict dx, float scale, int64_t rows,
                        int64_t D) {
  at::parallel_for(0, rows, rows_per_task(D, kRowTaskElements), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gr = g + r * D;
      const T* yr = y + r * D;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t j = 0; j < D; ++j) {
        dot += to_float(gr[j]) * to_float(yr[j]);
      }
      T* dr = dx + r * D;
#pragma omp simd
      for (int64_t j = 0; j < D; ++j) {
        dr[j] = from_float<T>(scale * to_float(yr[j]) * (to_float(gr[j]) - dot));
      }
    }
  });
}

at::Tensor scaled_softmax_bwd_cpu(const at::Tensor& grad_out, const at::Tensor& out_in, double scale) {
  check_float(out_in, "scaled_softmax_bwd: out");
  TORCH_CHECK(grad_out.sizes() == out_in.sizes() && grad_out.scalar_type() == out_in.scalar_type(),
              "scaled_softmax_bwd: grad_out must match out in shape and dtype");
  const at::Tensor y = out_in.contiguous();
  const at::Tensor g = grad_out.contiguous();
  const int64_t D = y.size(-1);
  const int64_t rows = D == 0 ? 0 : y.numel() / D;
  at::Tensor dx = at::empty_like(y);
  HF_ZERO_DISPATCH_FLOAT(y.scalar_type(), "scaled_softmax_bwd", [&] {
    softmax_bwd_kernel<scalar_t>(g.const_data_ptr<scalar_t>(), y.const_data_ptr<scalar_t>(),
                                 dx.mutable_data_ptr<scalar_t>(), to_float(scale), rows, D);
  });
  return dx;
}

// ---------------------------------------------------------------- rotary embedding

// forward (rotate_half(x) = cat(-x2, x1)):  o1 = x1*c1 - x2*s1,  o2 = x2*c2 + x1*s2
// backward (its transpose):                 d1 = g1*c1 + g2*s2,  d2 = g2*c2 - g1*s1
template <typename T, typename C, bool kBackward>
void rotary_kernel(const T* __restrict x, const C* __restrict cos, const C* __restrict sin, const RowOffsets cs_rows,
                   T* __restrict out, int64_t rows, int64_t D) {
  const int64_t half = D / 2;
  at::parallel_for(0, rows, rows_per_task(D, kRowTaskElements), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * D;
      const int64_t cs = cs_rows(r);
      const C* c = cos + cs;
      const C* s = sin + cs;
      T* orow = out + r * D;
#pragma omp simd
      for (int64_t j = 0; j < half; ++j) {
        const float x1 = to_float(xr[j]);
        const float x2 = to_float(xr[j + half]);
        const float c1 = to_float(c[j]);
        const float c2 = to_float(c[j + half]);
        const float s1 = to_float(s[j]);
        const float s2 = to_float(s[j + half]);
        if constexpr (kBackward) {
          orow[j] = from_float<T>(x1 * c1 + x2 * s2);
          orow[j + half] = from_float<T>(x2 * c2 - x1 * s1);
        } else {
          orow[j] = from_float<T>(x1 * c1 - x2 * s1);
          orow[j + half] = from_float<T>(x2 * c2 + x1 * s2);
        }
      }
    }
  });
}

at::Tensor rotary_impl(const at::Tensor& x_in, const at::Tensor& cos_in, const at::Tensor& sin_in, bool backward) {
  check_float(x_in, "apply_rotary: x");
  check_float(cos_in, "apply_rotary: cos");
  TORCH_CHECK(cos_in.scalar_type() == sin_in.scalar_type(), "apply_rotary: cos and sin must have the same dtype");
  TORCH_CHECK(x_in.dim() >= 1 && x_in.size(-1) % 2 == 0, "apply_rotary: the last dimension of x must be even, got ",
              x_in.sizes());
  TORCH_CHECK(cos_in.size(-1) == x_in.size(-1) && sin_in.size(-1) == x_in.size(-1),
              "apply_rotary: cos/sin last dimension must equal x's (", x_in.size(-1), ")");
  const at::Tensor x = x_in.contiguous();
  const at::Tensor cos = expand_rows(cos_in, x.sizes());
  const at::Tensor sin = expand_rows(sin_in, x.sizes());
  TORCH_CHECK(cos.strides() == sin.strides(), "apply_rotary: cos and sin must have the same layout");
  const RowOffsets cs_rows(cos);
  const int64_t D = x.size(-1);
  const int64_t rows = D == 0 ? 0 : x.numel() / D;
  at::Tensor out = at::empty_like(x);
  HF_ZERO_DISPATCH_FLOAT(x.scalar_type(), "apply_rotary", [&] {
    using T = scalar_t;
    T* po = out.mutable_data_ptr<T>();
    const T* px = x.const_data_ptr<T>();
    if (cos.scalar_type() == at::kFloat) {
      backward ? rotary_kernel<T, float, true>(px, cos.const_data_ptr<float>(), sin.const_data_ptr<float>(), cs_rows,
                                               po, rows, D)
               : rotary_kernel<T, float, false>(px, cos.const_data_ptr<float>(), sin.const_data_ptr<float>(),
                                                cs_rows, po, rows, D);
    } else {
      TORCH_CHECK(cos.scalar_type() == x.scalar_type(), "apply_rotary: cos/sin must be float32 or x's dtype");
      backward ? rotary_kernel<T, T, true>(px, cos.const_data_ptr<T>(), sin.const_data_ptr<T>(), cs_rows, po, rows, D)
               : rotary_kernel<T, T, false>(px, cos.const_data_ptr<T>(), sin.const_data_ptr<T>(), cs_rows, po, rows,
                                            D);
    }
  });
  return out;
}

at::Tensor apply_rotary_cpu(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  return rotary_impl(x, cos, sin, false);
}

at::Tensor apply_rotary_bwd_cpu(const at::Tensor& grad_out, const at::Tensor& cos, const at::Tensor& sin) {
  return rotary_impl(grad_out, cos, sin, true);
}

}  // namespace

TORCH_LIBRARY_IMPL(hf_zero, CPU, m) {
  m.impl("bias_gelu", &bias_gelu_cpu);
  m.impl("bias_gelu_bwd", &bias_gelu_bwd_cpu);
  m.impl("scaled_masked_softmax", &scaled_masked_softmax_cpu);
  m.impl("scaled_softmax_bwd", &scaled_softmax_bwd_cpu);
  m.impl("apply_rotary", &apply_rotary_cpu);
  m.impl("apply_rotary_bwd", &apply_rotary_bwd_cpu);
}

}  // namespace hf_zero
