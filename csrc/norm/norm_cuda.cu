// LayerNorm / RMSNorm CUDA kernels (forward, fused residual-add forward, backward). Same contracts as
// norm_cpu.cpp: x viewed as (rows, D) contiguous, fp32 statistics, weight/bias (D,), RMSNorm as LlamaRMSNorm.
//
// Forward: one block per row; the row is read once for its statistics and again (from L1/L2) for the output.
// Backward: a grid of blocks strides over rows; each thread owns fixed columns and accumulates their weight/bias
// gradient in its block's row of a (blocks, D) fp32 buffer, summed afterwards, so no atomics are needed.

#include <torch/library.h>

#include <vector>

#include "cuda_utils.cuh"
#include "utils.h"

namespace hf_zero {
namespace {

template <typename T, bool kAdd, bool kRms>
__global__ void norm_fwd_kernel(const T* __restrict__ x, const T* __restrict__ residual, T* __restrict__ sum,
                                const float* __restrict__ w, const float* __restrict__ b, T* __restrict__ out,
                                float* __restrict__ mean_out, float* __restrict__ rstd_out, int64_t D, float eps) {
  __shared__ float scratch[kThreads / kWarp];
  const int64_t row = blockIdx.x;
  const T* src = x + row * D;
  float acc = 0.f;
  if constexpr (kAdd) {
    const T* rr = residual + row * D;
    T* sr = sum + row * D;
    for (int64_t j = threadIdx.x; j < D; j += blockDim.x) {
      const T s = static_cast<T>(static_cast<float>(src[j]) + static_cast<float>(rr[j]));
      sr[j] = s;
      const float sf = static_cast<float>(s);
      acc += kRms ? sf * sf : sf;
    }
    __syncthreads();  // make this block's writes of `sum` visible before re-reading them
    src = sr;
  } else {
    for (int64_t j = threadIdx.x; j < D; j += blockDim.x) {
      const float xf = static_cast<float>(src[j]);
      acc += kRms ? xf * xf : xf;
    }
  }
  const float total = block_reduce<false>(acc, scratch);
  float mu = 0.f;
  float rs;
  if constexpr (kRms) {
    rs = rsqrtf(total / static_cast<float>(D) + eps);
  } else {
    mu = total / static_cast<float>(D);
    float sq = 0.f;
    for (int64_t j = threadIdx.x; j < D; j += blockDim.x) {
      const float d = static_cast<float>(src[j]) - mu;
      sq += d * d;
    }
    rs = rsqrtf(block_reduce<false>(sq, scratch) / static_cast<float>(D) + eps);
  }
  T* orow = out + row * D;
  for (int64_t j = threadIdx.x; j < D; j += blockDim.x) {
    if constexpr (kRms) {
      const float n = static_cast<float>(static_cast<T>(static_cast<float>(src[j]) * rs));
      orow[j] = static_cast<T>(w[j] * n);
    } else {
      orow[j] = static_cast<T>((static_cast<float>(src[j]) - mu) * rs * w[j] + b[j]);
    }
  }
  if (threadIdx.x == 0) {
    if constexpr (!kRms) {
      mean_out[row] = mu;
    }
    rstd_out[row] = rs;
  }
}

template <typename T, bool kRms>
__global__ void norm_bwd_kernel(const T* __restrict__ g, const T* __restrict__ x, const float* __restrict__ mean,
                                const float* __restrict__ rstd, const float* __restrict__ w, T* __restrict__ dx,
                                float* __restrict__ dw_partial, float* __restrict__ db_partial, int64_t rows,
                                int64_t D) {
  __shared__ float scratch[kThreads / kWarp];
  float* dw = dw_partial + blockIdx.x * D;
  float* db = kRms ? nullptr : db_partial + blockIdx.x * D;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* gr = g + row * D;
    const T* xr = x + row * D;
    const float mu = kRms ? 0.f : mean[row];
    const float rs = rstd[row];
    float sum_gw = 0.f;
    float sum_gw_xhat = 0.f;
    for (int64_t j = threadIdx.x; j < D; j += blockDim.x) {
      const float gj = static_cast<float>(gr[j]);
      const float xhat = (static_cast<float>(xr[j]) - mu) * rs;
      const float gw = gj * w[j];
      sum_gw += gw;
      sum_gw_xhat += gw * xhat;
      if constexpr (kRms) {
        dw[j] += gj * static_cast<float>(static_cast<T>(xhat));
      } else {
        dw[j] += gj * xhat;
        db[j] += gj;
      }
    }
    const float mean_gw = kRms ? 0.f : block_reduce<false>(sum_gw, scratch) / static_cast<float>(D);
    const float mean_gw_xhat = block_reduce<false>(sum_gw_xhat, scratch) / static_cast<float>(D);
    T* dxr = dx + row * D;
    for (int64_t j = threadIdx.x; j < D; j += blockDim.x) {
      const float xhat = (static_cast<float>(xr[j]) - mu) * rs;
      dxr[j] = static_cast<T>(rs * (static_cast<float>(gr[j]) * w[j] - mean_gw - xhat * mean_gw_xhat));
    }
  }
}

struct Rows {
  at::Tensor x;
  int64_t rows;
  int64_t D;
};

Rows rows_of(const at::Tensor& x, const at::Tensor& weight, const char* op) {
  check_float(x, op);
  TORCH_CHECK(x.dim() >= 1, op, ": x must have at least one dimension");
  const int64_t D = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == D, op, ": weight must have shape (", D, ",)");
  TORCH_CHECK(weight.device() == x.device(), op, ": weight must be on ", x.device());
  return {x.contiguous(), D == 0 ? 0 : x.numel() / D, D};
}

std::vector<int64_t> stat_shape(const at::Tensor& x) {
  auto sizes = x.sizes().vec();
  sizes.pop_back();
  return sizes;
}

// Returns (out, sum or undefined, mean or undefined, rstd).
template <bool kRms>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> norm_fwd(const at::Tensor& x_in,
                                                                    const std::optional<at::Tensor>& residual_in,
                                                                    const at::Tensor& weight,
                                                                    const std::optional<at::Tensor>& bias,
                                                                    double eps, const char* op) {
  const Rows v = rows_of(x_in, weight, op);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor w = weight.to(at::kFloat).contiguous();
  at::Tensor b;
  if (!kRms) {
    TORCH_CHECK(bias.has_value() && bias->dim() == 1 && bias->size(0) == v.D, op, ": bias must have shape (", v.D,
                ",)");
    b = bias->to(at::kFloat).contiguous();
  }
  at::Tensor residual, sum;
  if (residual_in.has_value()) {
    TORCH_CHECK(residual_in->sizes() == x_in.sizes() && residual_in->scalar_type() == x_in.scalar_type(), op,
                ": residual must match x in shape and dtype");
    residual = residual_in->contiguous();
    sum = at::empty_like(v.x);
  }
  at::Tensor out = at::empty_like(v.x);
  at::Tensor rstd = at::empty(stat_shape(x_in), x_in.options().dtype(at::kFloat));
  at::Tensor mean = kRms ? at::Tensor() : at::empty_like(rstd);
  if (v.rows == 0) {
    return {out, sum, mean, rstd};
  }
  const auto stream = current_stream();
  const float feps = static_cast<float>(eps);
  HF_ZERO_DISPATCH_FLOAT(v.x.scalar_type(), "norm_fwd_cuda", [&] {
    const scalar_t* px = v.x.const_data_ptr<scalar_t>();
    const float* pw = w.const_data_ptr<float>();
    const float* pb = kRms ? nullptr : b.const_data_ptr<float>();
    scalar_t* po = out.mutable_data_ptr<scalar_t>();
    float* pmean = kRms ? nullptr : mean.mutable_data_ptr<float>();
    float* prstd = rstd.mutable_data_ptr<float>();
    const auto grid = static_cast<unsigned>(v.rows);
    if (residual.defined()) {
      norm_fwd_kernel<scalar_t, true, kRms><<<grid, kThreads, 0, stream>>>(
          px, residual.const_data_ptr<scalar_t>(), sum.mutable_data_ptr<scalar_t>(), pw, pb, po, pmean, prstd, v.D,
          feps);
    } else {
      norm_fwd_kernel<scalar_t, false, kRms>
          <<<grid, kThreads, 0, stream>>>(px, nullptr, nullptr, pw, pb, po, pmean, prstd, v.D, feps);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {out, sum, mean, rstd};
}

template <bool kRms>
std::tuple<at::Tensor, at::Tensor, at::Tensor> norm_bwd(const at::Tensor& grad_out, const at::Tensor& x,
                                                        const std::optional<at::Tensor>& mean, const at::Tensor& rstd,
                                                        const at::Tensor& weight, const char* op) {
  const Rows v = rows_of(x, weight, op);
  TORCH_CHECK(grad_out.sizes() == x.sizes() && grad_out.scalar_type() == x.scalar_type(), op,
              ": grad_out must match x in shape and dtype");
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor g = grad_out.contiguous();
  const at::Tensor w = weight.to(at::kFloat).contiguous();
  const at::Tensor rstd_c = rstd.contiguous();
  const at::Tensor mean_c = kRms ? at::Tensor() : mean->contiguous();
  at::Tensor dx = at::empty_like(v.x);
  const int64_t blocks =
      std::max<int64_t>(1, std::min<int64_t>(v.rows, sm_count() * 4));
  at::Tensor dw_partial = at::zeros({blocks, v.D}, x.options().dtype(at::kFloat));
  at::Tensor db_partial = kRms ? at::Tensor() : at::zeros({blocks, v.D}, x.options().dtype(at::kFloat));
  if (v.rows > 0) {
    HF_ZERO_DISPATCH_FLOAT(v.x.scalar_type(), "norm_bwd_cuda", [&] {
      norm_bwd_kernel<scalar_t, kRms><<<static_cast<unsigned>(blocks), kThreads, 0, current_stream()>>>(
          g.const_data_ptr<scalar_t>(), v.x.const_data_ptr<scalar_t>(),
          kRms ? nullptr : mean_c.const_data_ptr<float>(), rstd_c.const_data_ptr<float>(), w.const_data_ptr<float>(),
          dx.mutable_data_ptr<scalar_t>(), dw_partial.mutable_data_ptr<float>(),
          kRms ? nullptr : db_partial.mutable_data_ptr<float>(), v.rows, v.D);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }
  at::Tensor dw = dw_partial.sum(0).to(weight.scalar_type());
  at::Tensor db = kRms ? at::Tensor() : db_partial.sum(0).to(weight.scalar_type());
  return {dx, dw, db};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_fwd_cuda(const at::Tensor& x, const at::Tensor& weight,
                                                                   const at::Tensor& bias, double eps) {
  auto [out, sum, mean, rstd] = norm_fwd<false>(x, std::nullopt, weight, bias, eps, "layer_norm_fwd");
  return {out, mean, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> add_layer_norm_fwd_cuda(const at::Tensor& x,
                                                                                   const at::Tensor& residual,
                                                                                   const at::Tensor& weight,
                                                                                   const at::Tensor& bias,
                                                                                   double eps) {
  return norm_fwd<false>(x, residual, weight, bias, eps, "add_layer_norm_fwd");
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_bwd_cuda(const at::Tensor& grad_out, const at::Tensor& x,
                                                                   const at::Tensor& mean, const at::Tensor& rstd,
                                                                   const at::Tensor& weight) {
  return norm_bwd<false>(grad_out, x, mean, rstd, weight, "layer_norm_bwd");
}

std::tuple<at::Tensor, at::Tensor> rms_norm_fwd_cuda(const at::Tensor& x, const at::Tensor& weight, double eps) {
  auto [out, sum, mean, rstd] = norm_fwd<true>(x, std::nullopt, weight, std::nullopt, eps, "rms_norm_fwd");
  return {out, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> add_rms_norm_fwd_cuda(const at::Tensor& x, const at::Tensor& residual,
                                                                     const at::Tensor& weight, double eps) {
  auto [out, sum, mean, rstd] = norm_fwd<true>(x, residual, weight, std::nullopt, eps, "add_rms_norm_fwd");
  return {out, sum, rstd};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_bwd_cuda(const at::Tensor& grad_out, const at::Tensor& x,
                                                     const at::Tensor& rstd, const at::Tensor& weight) {
  auto [dx, dw, db] = norm_bwd<true>(grad_out, x, std::nullopt, rstd, weight, "rms_norm_bwd");
  return {dx, dw};
}

}  // namespace

TORCH_LIBRARY_IMPL(hf_zero, CUDA, m) {
  m.impl("layer_norm_fwd", &layer_norm_fwd_cuda);
  m.impl("layer_norm_bwd", &layer_norm_bwd_cuda);
  m.impl("add_layer_norm_fwd", &add_layer_norm_fwd_cuda);
  m.impl("rms_norm_fwd", &rms_norm_fwd_cuda);
  m.impl("rms_norm_bwd", &rms_norm_bwd_cuda);
  m.impl("add_rms_norm_fwd", &add_rms_norm_fwd_cuda);
}

}  // namespace hf_zero
