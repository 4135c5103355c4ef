// LayerNorm / RMSNorm over the last dimension, forward and backward, plus the fused residual-add forwards.
//
// Layout: x is viewed as (rows, D), contiguous; weight/bias are (D,); mean/rstd are fp32 (rows,).
// Storage may be fp32, bf16 or fp16; every sum is accumulated in fp32. A row is read once for its statistics and
// once more (from cache) for the output, so the forward costs one read and one write of x -- against three or
// four passes for the unfused torch sequence (add, norm, weight multiply, casts).
//
// RMSNorm follows transformers' LlamaRMSNorm exactly: n = (x * rstd) rounded to x's dtype, out = weight * n.

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

#include "utils.h"

namespace hf_zero {
namespace {

constexpr int64_t kNormTaskElements = int64_t{1} << 15;  // per OpenMP task (rows_per_task)

struct RowView {
  at::Tensor x;  // contiguous
  int64_t rows;
  int64_t D;
};

RowView rows_of(const at::Tensor& x, const at::Tensor& weight, const char* op) {
  check_float(x, op);
  TORCH_CHECK(x.dim() >= 1, op, ": x must have at least one dimension");
  const int64_t D = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == D, op, ": weight must have shape (", D, ",), got ",
              weight.sizes());
  return {x.contiguous(), D == 0 ? 0 : x.numel() / D, D};
}

std::vector<int64_t> stat_shape(const at::Tensor& x) {
  auto sizes = x.sizes().vec();
  sizes.pop_back();
  return sizes;
}

// ---------------------------------------------------------------- LayerNorm

// With kAdd, the normalized input is s = x + residual rounded to T, which is also written to sum.
template <typename T, bool kAdd>
void layer_norm_fwd_kernel(const T* __restrict x, const T* __restrict residual, T* __restrict sum,
                           const float* __restrict w, const float* __restrict b, T* __restrict out,
                           float* __restrict mean_out, float* __restrict rstd_out, int64_t rows, int64_t D,
                           float eps) {
  at::parallel_for(0, rows, rows_per_task(D, kNormTaskElements), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * D;
      const T* src = xr;
      // One pass for both moments, on values shifted by the row's first element: E[(x-k)^2] - E[x-k]^2 does not
      // suffer the cancellation of the unshifted formula when |mean| >> std.
      float s1 = 0.f;
      float s2 = 0.f;
      float shift;
      if constexpr (kAdd) {
        const T* rr = residual + r * D;
        T* sr = sum + r * D;
        shift = to_float(from_float<T>(to_float(xr[0]) + to_float(rr[0])));
#pragma omp simd reduction(+ : s1, s2)
        for (int64_t j = 0; j < D; ++j) {
          // Rounded once to T, as `x + residual` in T would be. Kept in a float register rather than a T local:
          // a T temporary whose bytes are both stored and re-read stops GCC from vectorizing the loop.
          const float s = round_to<T>(to_float(xr[j]) + to_float(rr[j]));
          sr[j] = from_float<T>(s);
          const float d = s - shift;
          s1 += d;
          s2 += d * d;
        }
        src = sr;
      } else {
        shift = to_float(xr[0]);
#pragma omp simd reduction(+ : s1, s2)
        for (int64_t j = 0; j < D; ++j) {
          const float d = to_float(xr[j]) - shift;
          s1 += d;
          s2 += d * d;
        }
      }
      const float inv_D = 1.f / to_float(D);
      const float mean_shifted = s1 * inv_D;
      const float mu = shift + mean_shifted;
      const float var = std::max(s2 * inv_D - mean_shifted * mean_shifted, 0.f);
      const float rs = 1.f / std::sqrt(var + eps);
      T* orow = out + r * D;
#pragma omp simd
      for (int64_t j = 0; j < D; ++j) {
        orow[j] = from_float<T>((to_float(src[j]) - mu) * rs * w[j] + b[j]);
      }
      mean_out[r] = mu;
      rstd_out[r] = rs;
    }
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> layer_norm_fwd_impl(
    const at::Tensor& x_in, const std::optional<at::Tensor>& residual_in, const at::Tensor& weight,
    const at::Tensor& bias, double eps, const char* op) {
  const RowView v = rows_of(x_in, weight, op);
  TORCH_CHECK(bias.dim() == 1 && bias.size(0) == v.D, op, ": bias must have shape (", v.D, ",)");
  const at::Tensor w = weight.to(at::kFloat).contiguous();
  const at::Tensor b = bias.to(at::kFloat).contiguous();
  at::Tensor residual, sum;
  if (residual_in.has_value()) {
    TORCH_CHECK(residual_in->sizes() == x_in.sizes() && residual_in->scalar_type() == x_in.scalar_type(), op,
                ": residual must match x in shape and dtype");
    residual = residual_in->contiguous();
    sum = at::empty_like(v.x);
  }
  at::Tensor out = at::empty_like(v.x);
  at::Tensor mean = at::empty(stat_shape(x_in), x_in.options().dtype(at::kFloat));
  at::Tensor rstd = at::empty_like(mean);
  HF_ZERO_DISPATCH_FLOAT(v.x.scalar_type(), "norm_fwd", [&] {
    if (residual.defined()) {
      layer_norm_fwd_kernel<scalar_t, true>(v.x.const_data_ptr<scalar_t>(), residual.const_data_ptr<scalar_t>(),
                                            sum.mutable_data_ptr<scalar_t>(), w.const_data_ptr<float>(),
                                            b.const_data_ptr<float>(), out.mutable_data_ptr<scalar_t>(),
                                            mean.mutable_data_ptr<float>(), rstd.mutable_data_ptr<float>(), v.rows,
                                            v.D, to_float(eps));
    } else {
      layer_norm_fwd_kernel<scalar_t, false>(v.x.const_data_ptr<scalar_t>(), nullptr, nullptr,
                                             w.const_data_ptr<float>(), b.const_data_ptr<float>(),
                                             out.mutable_data_ptr<scalar_t>(), mean.mutable_data_ptr<float>(),
                                             rstd.mutable_data_ptr<float>(), v.rows, v.D, to_float(eps));
    }
  });
  return {out, sum, mean, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_fwd_cpu(const at::Tensor& x, const at::Tensor& weight,
                                                                  const at::Tensor& bias, double eps) {
  auto [out, sum, mean, rstd] = layer_norm_fwd_impl(x, std::nullopt, weight, bias, eps, "layer_norm_fwd");
  return {out, mean, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> add_layer_norm_fwd_cpu(const at::Tensor& x,
                                                                                  const at::Tensor& residual,
                                                                                  const at::Tensor& weight,
                                                                                  const at::Tensor& bias, double eps) {
  return layer_norm_fwd_impl(x, residual, weight, bias, eps, "add_layer_norm_fwd");
}

// Per-thread (D,) fp32 accumulators for the weight/bias gradients, summed after the parallel loop.
struct ThreadAccumulators {
  int64_t D;
  std::vector<float> data;
  ThreadAccumulators(int64_t count, int64_t D_) : D(D_), data(static_cast<size_t>(at::get_num_threads() * count * D_), 0.f) {}
  float* slot(int64_t which, int64_t count) {
    return data.data() + (static_cast<int64_t>(at::get_thread_num()) * count + which) * D;
  }
  void reduce(int64_t which, int64_t count, float* out) const {
    const int64_t threads = static_cast<int64_t>(data.size()) / (count * D);
    for (int64_t j = 0; j < D; ++j) {
      out[j] = 0.f;
    }
    for (int64_t t = 0; t < threads; ++t) {
      const float* src = data.data() + (t * count + which) * D;
      for (int64_t j = 0; j < D; ++j) {
        out[j] += src[j];
      }
    }
  }
};

// dx = rstd * (g*w - mean(g*w) - xhat * mean(g*w*xhat)); dw = sum_rows g*xhat; db = sum_rows g.
template <typename T>
void layer_norm_bwd_kernel(const T* __restrict g, const T* __restrict x, const float* __restrict mean,
                           const float* __restrict rstd, const float* __restrict w, T* __restrict dx,
                           ThreadAccumulators& acc, int64_t rows, int64_t D) {
  at::parallel_for(0, rows, rows_per_task(D, kNormTaskElements), [&](int64_t begin, int64_t end) {
    float* dw = acc.slot(0, 2);
    float* db = acc.slot(1, 2);
    for (int64_t r = begin; r < end; ++r) {
      const T* gr = g + r * D;
      const T* xr = x + r * D;
      const float mu = mean[r];
      const float rs = rstd[r];
      float sum_gw = 0.f;
      float sum_gw_xhat = 0.f;
#pragma omp simd reduction(+ : sum_gw, sum_gw_xhat)
      for (int64_t j = 0; j < D; ++j) {
        const float gj = to_float(gr[j]);
        const float xhat = (to_float(xr[j]) - mu) * rs;
        const float gw = gj * w[j];
        sum_gw += gw;
        sum_gw_xhat += gw * xhat;
        dw[j] += gj * xhat;
        db[j] += gj;
      }
      const float mean_gw = sum_gw / to_float(D);
      const float mean_gw_xhat = sum_gw_xhat / to_float(D);
      T* dxr = dx + r * D;
#pragma omp simd
      for (int64_t j = 0; j < D; ++j) {
        const float xhat = (to_float(xr[j]) - mu) * rs;
        dxr[j] = from_float<T>(rs * (to_float(gr[j]) * w[j] - mean_gw - xhat * mean_gw_xhat));
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_bwd_cpu(const at::Tensor& grad_out, const at::Tensor& x,
                                                                  const at::Tensor& mean, const at::Tensor& rstd,
                                                                  const at::Tensor& weight) {
  const RowView v = rows_of(x, weight, "layer_norm_bwd");
  TORCH_CHECK(grad_out.sizes() == x.sizes() && grad_out.scalar_type() == x.scalar_type(),
              "layer_norm_bwd: grad_out must match x in shape and dtype");
  const at::Tensor g = grad_out.contiguous();
  const at::Tensor w = weight.to(at::kFloat).contiguous();
  const at::Tensor mean_c = mean.contiguous();
  const at::Tensor rstd_c = rstd.contiguous();
  at::Tensor dx = at::empty_like(v.x);
  ThreadAccumulators acc(2, v.D);
  HF_ZERO_DISPATCH_FLOAT(v.x.scalar_type(), "layer_norm_bwd", [&] {
    layer_norm_bwd_kernel<scalar_t>(g.const_data_ptr<scalar_t>(), v.x.const_data_ptr<scalar_t>(),
                                    mean_c.const_data_ptr<float>(), rstd_c.const_data_ptr<float>(),
                                    w.const_data_ptr<float>(), dx.mutable_data_ptr<scalar_t>(), acc, v.rows, v.D);
  });
  at::Tensor dw = at::empty({v.D}, x.options().dtype(at::kFloat));
  at::Tensor db = at::empty({v.D}, x.options().dtype(at::kFloat));
  acc.reduce(0, 2, dw.mutable_data_ptr<float>());
  acc.reduce(1, 2, db.mutable_data_ptr<float>());
  return {dx, dw.to(weight.scalar_type()), db.to(weight.scalar_type())};
}

// ---------------------------------------------------------------- RMSNorm

template <typename T, bool kAdd>
void rms_norm_fwd_kernel(const T* __restrict x, const T* __restrict residual, T* __restrict sum,
                         const float* __restrict w, T* __restrict out, float* __restrict rstd_out, int64_t rows,
                         int64_t D, float eps) {
  at::parallel_for(0, rows, rows_per_task(D, kNormTaskElements), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* src = x + r * D;
      float sq = 0.f;
      if constexpr (kAdd) {
        const T* rr = residual + r * D;
        T* sr = sum + r * D;
#pragma omp simd reduction(+ : sq)
        for (int64_t j = 0; j < D; ++j) {
          const float sf = round_to<T>(to_float(src[j]) + to_float(rr[j]));  // see layer_norm_fwd_kernel
          sr[j] = from_float<T>(sf);
          sq += sf * sf;
        }
        src = sr;
      } else {
#pragma omp simd reduction(+ : sq)
        for (int64_t j = 0; j < D; ++j) {
          const float xf = to_float(src[j]);
          sq += xf * xf;
        }
      }
      const float rs = 1.f / std::sqrt(sq / to_float(D) + eps);
      T* orow = out + r * D;
#pragma omp simd
      for (int64_t j = 0; j < D; ++j) {
        const float n = to_float(from_float<T>(to_float(src[j]) * rs));
        orow[j] = from_float<T>(w[j] * n);
      }
      rstd_out[r] = rs;
    }
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> rms_norm_fwd_impl(const at::Tensor& x_in,
                                                                 const std::optional<at::Tensor>& residual_in,
                                                                 const at::Tensor& weight, double eps,
                                                                 const char* op) {
  const RowView v = rows_of(x_in, weight, op);
  const at::Tensor w = weight.to(at::kFloat).contiguous();
  at::Tensor residual, sum;
  if (residual_in.has_value()) {
    TORCH_CHECK(residual_in->sizes() == x_in.sizes() && residual_in->scalar_type() == x_in.scalar_type(), op,
                ": residual must match x in shape and dtype");
    residual = residual_in->contiguous();
    sum = at::empty_like(v.x);
  }
  at::Tensor out = at::empty_like(v.x);
  at::Tensor rstd = at::empty(stat_shape(x_in), x_in.options().dtype(at::kFloat));
  HF_ZERO_DISPATCH_FLOAT(v.x.scalar_type(), "norm_fwd", [&] {
    if (residual.defined()) {
      rms_norm_fwd_kernel<scalar_t, true>(v.x.const_data_ptr<scalar_t>(), residual.const_data_ptr<scalar_t>(),
                                          sum.mutable_data_ptr<scalar_t>(), w.const_data_ptr<float>(),
                                          out.mutable_data_ptr<scalar_t>(), rstd.mutable_data_ptr<float>(), v.rows,
                                          v.D, to_float(eps));
    } else {
      rms_norm_fwd_kernel<scalar_t, false>(v.x.const_data_ptr<scalar_t>(), nullptr, nullptr,
                                           w.const_data_ptr<float>(), out.mutable_data_ptr<scalar_t>(),
                                           rstd.mutable_data_ptr<float>(), v.rows, v.D, to_float(eps));
    }
  });
  return {out, sum, rstd};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_fwd_cpu(const at::Tensor& x, const at::Tensor& weight, double eps) {
  auto [out, sum, rstd] = rms_norm_fwd_impl(x, std::nullopt, weight, eps, "rms_norm_fwd");
  return {out, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> add_rms_norm_fwd_cpu(const at::Tensor& x, const at::Tensor& residual,
                                                                    const at::Tensor& weight, double eps) {
  return rms_norm_fwd_impl(x, residual, weight, eps, "add_rms_norm_fwd");
}

// n = x * rstd; dx = rstd * (g*w - n * mean(g*w*n)); dw = sum_rows g * n (n rounded as in the forward).
template <typename T>
void rms_norm_bwd_kernel(const T* __restrict g, const T* __restrict x, const float* __restrict rstd,
                         const float* __restrict w, T* __restrict dx, ThreadAccumulators& acc, int64_t rows,
                         int64_t D) {
  at::parallel_for(0, rows, rows_per_task(D, kNormTaskElements), [&](int64_t begin, int64_t end) {
    float* dw = acc.slot(0, 1);
    for (int64_t r = begin; r < end; ++r) {
      const T* gr = g + r * D;
      const T* xr = x + r * D;
      const float rs = rstd[r];
      float sum_gw_n = 0.f;
#pragma omp simd reduction(+ : sum_gw_n)
      for (int64_t j = 0; j < D; ++j) {
        const float gj = to_float(gr[j]);
        const float n = to_float(xr[j]) * rs;
        sum_gw_n += gj * w[j] * n;
        dw[j] += gj * to_float(from_float<T>(n));
      }
      const float mean_gw_n = sum_gw_n / to_float(D);
      T* dxr = dx + r * D;
#pragma omp simd
      for (int64_t j = 0; j < D; ++j) {
        const float n = to_float(xr[j]) * rs;
        dxr[j] = from_float<T>(rs * (to_float(gr[j]) * w[j] - n * mean_gw_n));
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor> rms_norm_bwd_cpu(const at::Tensor& grad_out, const at::Tensor& x,
                                                    const at::Tensor& rstd, const at::Tensor& weight) {
  const RowView v = rows_of(x, weight, "rms_norm_bwd");
  TORCH_CHECK(grad_out.sizes() == x.sizes() && grad_out.scalar_type() == x.scalar_type(),
              "rms_norm_bwd: grad_out must match x in shape and dtype");
  const at::Tensor g = grad_out.contiguous();
  const at::Tensor w = weight.to(at::kFloat).contiguous();
  const at::Tensor rstd_c = rstd.contiguous();
  at::Tensor dx = at::empty_like(v.x);
  ThreadAccumulators acc(1, v.D);
  HF_ZERO_DISPATCH_FLOAT(v.x.scalar_type(), "rms_norm_bwd", [&] {
    rms_norm_bwd_kernel<scalar_t>(g.const_data_ptr<scalar_t>(), v.x.const_data_ptr<scalar_t>(),
                                  rstd_c.const_data_ptr<float>(), w.const_data_ptr<float>(),
                                  dx.mutable_data_ptr<scalar_t>(), acc, v.rows, v.D);
  });
  at::Tensor dw = at::empty({v.D}, x.options().dtype(at::kFloat));
  acc.reduce(0, 1, dw.mutable_data_ptr<float>());
  return {dx, dw.to(weight.scalar_type())};
}

}  // namespace

TORCH_LIBRARY_IMPL(hf_zero, CPU, m) {
  m.impl("layer_norm_fwd", &layer_norm_fwd_cpu);
  m.impl("layer_norm_bwd", &layer_norm_bwd_cpu);
  m.impl("add_layer_norm_fwd", &add_layer_norm_fwd_cpu);
  m.impl("rms_norm_fwd", &rms_norm_fwd_cpu);
  m.impl("rms_norm_bwd", &rms_norm_bwd_cpu);
  m.impl("add_rms_norm_fwd", &add_rms_norm_fwd_cpu);
}

}  // namespace hf_zero
