// Transformer-block CUDA kernels: fused bias + GeLU, scaled masked softmax, rotary position embedding.
// Same contracts as transformer_cpu.cpp.

#include <torch/library.h>

#include <string_view>

#include "cuda_utils.cuh"
#include "utils.h"

namespace hf_zero {
namespace {

constexpr float kSqrt1_2 = 0.70710678118654752440f;
constexpr float kInvSqrt2Pi = 0.39894228040143267794f;
constexpr float kSqrt2OverPi = 0.79788456080286535588f;
constexpr float kGeluTanhCoeff = 0.044715f;

// ---------------------------------------------------------------- bias + GeLU

template <typename T, bool kTanh, bool kBackward>
__global__ void gelu_kernel(const T* __restrict__ x, const float* __restrict__ bias, const T* __restrict__ grad,
                            T* __restrict__ out, int64_t numel, int64_t D) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < numel;
       i += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    const float z = static_cast<float>(x[i]) + (bias != nullptr ? bias[i % D] : 0.f);
    float value;
    if constexpr (kTanh) {
      const float t = tanhf(kSqrt2OverPi * (z + kGeluTanhCoeff * z * z * z));
      if constexpr (kBackward) {
        const float dinner = kSqrt2OverPi * (1.f + 3.f * kGeluTanhCoeff * z * z);
        value = static_cast<float>(grad[i]) * (0.5f * (1.f + t) + 0.5f * z * (1.f - t * t) * dinner);
      } else {
        value = 0.5f * z * (1.f + t);
      }
    } else {
      const float cdf = 0.5f * (1.f + erff(z * kSqrt1_2));
      if constexpr (kBackward) {
        value = static_cast<float>(grad[i]) * (cdf + z * kInvSqrt2Pi * expf(-0.5f * z * z));
      } else {
        value = z * cdf;
      }
    }
    out[i] = static_cast<T>(value);
  }
}

at::Tensor gelu_impl(const at::Tensor& x_in, const std::optional<at::Tensor>& bias_in, const at::Tensor* grad_in,
                     std::string_view approximate) {
  check_float(x_in, "bias_gelu: x");
  TORCH_CHECK(approximate == "none" || approximate == "tanh", "bias_gelu: approximate must be 'none' or 'tanh'");
  const bool use_tanh = approximate == "tanh";
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous();
  const int64_t D = x.dim() == 0 ? 1 : x.size(-1);
  at::Tensor bias;
  if (bias_in.has_value()) {
    TORCH_CHECK(bias_in->dim() == 1 && bias_in->size(0) == D, "bias_gelu: bias must have shape (", D, ",)");
    bias = bias_in->to(at::kFloat).contiguous();
  }
  at::Tensor grad;
  if (grad_in != nullptr) {
    TORCH_CHECK(grad_in->sizes() == x_in.sizes() && grad_in->scalar_type() == x_in.scalar_type(),
                "bias_gelu_bwd: grad_out must match x in shape and dtype");
    grad = grad_in->contiguous();
  }
  at::Tensor out = at::empty_like(x);
  const int64_t numel = x.numel();
  if (numel == 0) {
    return out;
  }
  const auto stream = current_stream();
  const int blocks = elementwise_blocks(numel);
  HF_ZERO_DISPATCH_FLOAT(x.scalar_type(), "bias_gelu_cuda", [&] {
    const scalar_t* px = x.const_data_ptr<scalar_t>();
    const float* pb = bias.defined() ? bias.const_data_ptr<float>() : nullptr;
    const scalar_t* pg = grad.defined() ? grad.const_data_ptr<scalar_t>() : nullptr;
    scalar_t* po = out.mutable_data_ptr<scalar_t>();
    if (grad.defined()) {
      if (use_tanh) {
        gelu_kernel<scalar_t, true, true><<<blocks, kThreads, 0, stream>>>(px, pb, pg, po, numel, D);
      } else {
        gelu_kernel<scalar_t, false, true><<<blocks, kThreads, 0, stream>>>(px, pb, pg, po, numel, D);
      }
    } else {
      if (use_tanh) {
        gelu_kernel<scalar_t, true, false><<<blocks, kThreads, 0, stream>>>(px, pb, nullptr, po, numel, D);
      } else {
        gelu_kernel<scalar_t, false, false><<<blocks, kThreads, 0, stream>>>(px, pb, nullptr, po, numel, D);
      }
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

at::Tensor bias_gelu_cuda(const at::Tensor& x, const std::optional<at::Tensor>& bias, c10::string_view approximate) {
  return gelu_impl(x, bias, nullptr, std::string_view(approximate.data(), approximate.size()));
}

at::Tensor bias_gelu_bwd_cuda(const at::Tensor& grad_out, const at::Tensor& x, const std::optional<at::Tensor>& bias,
                              c10::string_view approximate) {
  return gelu_impl(x, bias, &grad_out, std::string_view(approximate.data(), approximate.size()));
}

// ---------------------------------------------------------------- scaled masked softmax (one block per row)

template <typename T>
__global__ void softmax_kernel(const T* __restrict__ x, const bool* __restrict__ mask, const RowOffsets mask_rows,
                               T* __restrict__ out, float scale, int64_t D) {
  __shared__ float scratch[kThreads / kWarp];
  const int64_t row = blockIdx.x;
  const T* xr = x + row * D;
  const bool* mr = mask != nullptr ? mask + mask_rows(row) : nullptr;
  T* orow = out + row * D;
  float local_max = -INFINITY;
  for (int64_t j = threadIdx.x; j < D; j += blockDim.x) {
    const bool masked = mr != nullptr && mr[j];
    local_max = fmaxf(local_max, masked ? -INFINITY : static_cast<float>(xr[j]) * scale);
  }
  const float row_max = block_reduce<true>(local_max, scratch);
  if (row_max == -INFINITY) {  // every position masked
    for (int64_t j = threadIdx.x; j < D; j += blockDim.x) {
      orow[j] = static_cast<T>(0.f);
    }
    return;
  }
  float local_sum = 0.f;
  for (int64_t j = threadIdx.x; j < D; j += blockDim.x) {
    const bool masked = mr != nullptr && mr[j];
    local_sum += masked ? 0.f : expf(static_cast<float>(xr[j]) * scale - row_max);
  }
  const float inv_sum = 1.f / block_reduce<false>(local_sum, scratch);
  for (int64_t j = threadIdx.x; j < D; j += blockDim.x) {
    const bool masked = mr != nullptr && mr[j];
    orow[j] = static_cast<T>(masked ? 0.f : expf(static_cast<float>(xr[j]) * scale - row_max) * inv_sum);
  }
}

at::Tensor scaled_masked_softmax_cuda(const at::Tensor& x_in, const std::optional<at::Tensor>& mask_in,
                                      double scale) {
  check_float(x_in, "scaled_masked_softmax: x");
  TORCH_CHECK(x_in.dim() >= 1, "scaled_masked_softmax: x must have at least one dimension");
  const c10::cuda::CUDAGuard guard(x_in.device());
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
  if (rows == 0) {
    return out;
  }
  HF_ZERO_DISPATCH_FLOAT(x.scalar_type(), "scaled_masked_softmax_cuda", [&] {
    softmax_kernel<scalar_t><<<static_cast<unsigned>(rows), kThreads, 0, current_stream()>>>(
        x.const_data_ptr<scalar_t>(), mask.defined() ? mask.const_data_ptr<bool>() : nullptr, mask_rows,
        out.mutable_data_ptr<scalar_t>(), static_cast<float>(scale), D);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

template <typename T>
__global__ void softmax_bwd_kernel(const T* __restrict__ g, const T* __restrict__ y, T* __restrict__ dx, float scale,
                                   int64_t D) {
  __shared__ float scratch[kThreads / kWarp];
  const int64_t row = blockIdx.x;
  const T* gr = g + row * D;
  const T* yr = y + row * D;
  float local = 0.f;
  for (int64_t j = threadIdx.x; j < D; j += blockDim.x) {
    local += static_cast<float>(gr[j]) * static_cast<float>(yr[j]);
  }
  const float dot = block_reduce<false>(local, scratch);
  T* dr = dx + row * D;
  for (int64_t j = threadIdx.x; j < D; j += blockDim.x) {
    dr[j] = static_cast<T>(scale * static_cast<float>(yr[j]) * (static_cast<float>(gr[j]) - dot));
  }
}

at::Tensor scaled_softmax_bwd_cuda(const at::Tensor& grad_out, const at::Tensor& out_in, double scale) {
  check_float(out_in, "scaled_softmax_bwd: out");
  TORCH_CHECK(grad_out.sizes() == out_in.sizes() && grad_out.scalar_type() == out_in.scalar_type(),
              "scaled_softmax_bwd: grad_out must match out in shape and dtype");
  const c10::cuda::CUDAGuard guard(out_in.device());
  const at::Tensor y = out_in.contiguous();
  const at::Tensor g = grad_out.contiguous();
  const int64_t D = y.size(-1);
  const int64_t rows = D == 0 ? 0 : y.numel() / D;
  at::Tensor dx = at::empty_like(y);
  if (rows == 0) {
    return dx;
  }
  HF_ZERO_DISPATCH_FLOAT(y.scalar_type(), "scaled_softmax_bwd_cuda", [&] {
    softmax_bwd_kernel<scalar_t><<<static_cast<unsigned>(rows), kThreads, 0, current_stream()>>>(
        g.const_data_ptr<scalar_t>(), y.const_data_ptr<scalar_t>(), dx.mutable_data_ptr<scalar_t>(),
        static_cast<float>(scale), D);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return dx;
}

// ---------------------------------------------------------------- rotary embedding (one thread per pair)

template <typename T, typename C, bool kBackward>
__global__ void rotary_kernel(const T* __restrict__ x, const C* __restrict__ cos, const C* __restrict__ sin,
                              const RowOffsets cs_rows, T* __restrict__ out, int64_t rows, int64_t D) {
  const int64_t half = D / 2;
  const int64_t pairs = rows * half;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < pairs;
       i += static_cast<int64_t>(blockDim.x) * gridDim.x) {
    const int64_t row = i / half;
    const int64_t j = i % half;
    const T* xr = x + row * D;
    const int64_t cs = cs_rows(row);
    const float x1 = static_cast<float>(xr[j]);
    const float x2 = static_cast<float>(xr[j + half]);
    const float c1 = static_cast<float>(cos[cs + j]);
    const float c2 = static_cast<float>(cos[cs + j + half]);
    const float s1 = static_cast<float>(sin[cs + j]);
    const float s2 = static_cast<float>(sin[cs + j + half]);
    T* orow = out + row * D;
    if constexpr (kBackward) {
      orow[j] = static_cast<T>(x1 * c1 + x2 * s2);
      orow[j + half] = static_cast<T>(x2 * c2 - x1 * s1);
    } else {
      orow[j] = static_cast<T>(x1 * c1 - x2 * s1);
      orow[j + half] = static_cast<T>(x2 * c2 + x1 * s2);
    }
  }
}

at::Tensor rotary_impl(const at::Tensor& x_in, const at::Tensor& cos_in, const at::Tensor& sin_in, bool backward) {
  check_float(x_in, "apply_rotary: x");
  check_float(cos_in, "apply_rotary: cos");
  TORCH_CHECK(cos_in.scalar_type() == sin_in.scalar_type(), "apply_rotary: cos and sin must have the same dtype");
  TORCH_CHECK(x_in.dim() >= 1 && x_in.size(-1) % 2 == 0, "apply_rotary: the last dimension of x must be even");
  TORCH_CHECK(cos_in.size(-1) == x_in.size(-1) && sin_in.size(-1) == x_in.size(-1),
              "apply_rotary: cos/sin last dimension must equal x's");
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous();
  const at::Tensor cos = expand_rows(cos_in, x.sizes());
  const at::Tensor sin = expand_rows(sin_in, x.sizes());
  TORCH_CHECK(cos.strides() == sin.strides(), "apply_rotary: cos and sin must have the same layout");
  const RowOffsets cs_rows(cos);
  const int64_t D = x.size(-1);
  const int64_t rows = D == 0 ? 0 : x.numel() / D;
  at::Tensor out = at::empty_like(x);
  if (rows == 0) {
    return out;
  }
  const auto stream = current_stream();
  const int blocks = elementwise_blocks(rows * (D / 2));
  HF_ZERO_DISPATCH_FLOAT(x.scalar_type(), "apply_rotary_cuda", [&] {
    using T = scalar_t;
    const T* px = x.const_data_ptr<T>();
    T* po = out.mutable_data_ptr<T>();
    if (cos.scalar_type() == at::kFloat) {
      const float* pc = cos.const_data_ptr<float>();
      const float* ps = sin.const_data_ptr<float>();
      if (backward) {
        rotary_kernel<T, float, true><<<blocks, kThreads, 0, stream>>>(px, pc, ps, cs_rows, po, rows, D);
      } else {
        rotary_kernel<T, float, false><<<blocks, kThreads, 0, stream>>>(px, pc, ps, cs_rows, po, rows, D);
      }
    } else {
      TORCH_CHECK(cos.scalar_type() == x.scalar_type(), "apply_rotary: cos/sin must be float32 or x's dtype");
      const T* pc = cos.const_data_ptr<T>();
      const T* ps = sin.const_data_ptr<T>();
      if (backward) {
        rotary_kernel<T, T, true><<<blocks, kThreads, 0, stream>>>(px, pc, ps, cs_rows, po, rows, D);
      } else {
        rotary_kernel<T, T, false><<<blocks, kThreads, 0, stream>>>(px, pc, ps, cs_rows, po, rows, D);
      }
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

at::Tensor apply_rotary_cuda(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  return rotary_impl(x, cos, sin, false);
}

at::Tensor apply_rotary_bwd_cuda(const at::Tensor& grad_out, const at::Tensor& cos, const at::Tensor& sin) {
  return rotary_impl(grad_out, cos, sin, true);
}

}  // namespace

TORCH_LIBRARY_IMPL(hf_zero, CUDA, m) {
  m.impl("bias_gelu", &bias_gelu_cuda);
  m.impl("bias_gelu_bwd", &bias_gelu_bwd_cuda);
  m.impl("scaled_masked_softmax", &scaled_masked_softmax_cuda);
  m.impl("scaled_softmax_bwd", &scaled_softmax_bwd_cuda);
  m.impl("apply_rotary", &apply_rotary_cuda);
  m.impl("apply_rotary_bwd", &apply_rotary_bwd_cuda);
}

}  // namespace hf_zero
