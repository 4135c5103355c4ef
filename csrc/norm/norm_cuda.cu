// LayerNorm / RMSNorm CUDA kernels: forward, fused residual-add forward, backward. Same contracts as norm_cpu.cpp
// and the *_reference functions of hf_zero/ops/norm.py: x viewed as (rows, D) contiguous; statistics in fp32;
// mean / rstd fp32 (rows,); RMSNorm as LlamaRMSNorm (n = x * rstd rounded to T, out = weight * n); dweight and
// dbias in the weight's dtype.
//
// The fast path (D % V == 0 and every row pointer 16-byte aligned, V = 16 / sizeof(T) elements per 128-bit access):
//
//   norm_fwd_vec_kernel. A row is owned by a group of G threads, G a power of two chosen at launch from D: a few
//   lanes of a warp for small D (a block of 128 threads then holds 128 / G rows), a whole block of up to 1024
//   threads for large D. Lane l of the group owns the vectors l, l + G, ..., l + (K-1)G of the row, K <= 4 a
//   template parameter, so the row stays in registers: x (and residual) are read once with 128-bit loads, out
//   (and sum) written once with 128-bit stores. LayerNorm's mean and variance are two passes over the registers
//   (exact: no E[x^2] - E[x]^2 cancellation). Group sums: butterfly shuffles inside a warp, then shared memory
//   across the warps of a block; every thread of a group ends with the same bits. The grid is one wave of
//   resident blocks (the occupancy calculator's count), each striding over row groups.
//
//   norm_bwd_vec_kernel. The same row ownership (fewer vectors per thread: K * V <= 16 elements, since x, grad_out
//   and the weight/bias-gradient accumulators all live in registers). x and grad_out are read once; xhat is
//   recomputed from the saved mean / rstd; dx = rstd * (g*w - mean(g*w) - xhat * mean(g*w*xhat)) needs one group
//   sum of two values. A thread owns the same columns in every row it visits, so it accumulates its columns of
//   dweight (and dbias) in registers across all its rows; at the end the block writes one fp32 partial row
//   (several groups of a block are first combined by shuffles and shared memory). The grid is at most 1024
//   resident threads per SM -- enough loads in flight for full bandwidth -- so the partials are a few hundred
//   rows, and column_sum_kernel adds them up into dweight / dbias in the weight's dtype.
//
// The fallback (any D, any alignment, or D too large for registers: more than 4 x 1024 vectors forward,
// 16 x 512 elements backward): norm_fwd_loop_kernel / norm_bwd_loop_kernel, one block of 256 threads per row,
// scalar accesses, each pass re-reading the row (from L1/L2); the backward keeps each block's partial in global
// memory, every column owned by one thread of the block (no atomics), and ends with the same column_sum_kernel.
//
// Every partial and column sum is added in a fixed order: results are deterministic run to run.

#include <torch/library.h>

#include <map>
#include <mutex>
#include <tuple>
#include <type_traits>
#include <vector>

#include "cuda_utils.cuh"
#include "utils.h"

namespace hf_zero {
namespace {

constexpr int kMaxFwdGroup = 1024;  // threads per row, forward (one block)
constexpr int kMaxBwdGroup = 512;   // threads per row, backward (<= 128 registers per thread)
constexpr int kSmallBlock = 128;    // block size when several rows share a block (G <= 32)
constexpr int kFwdVecsPerThread = 4;
constexpr int kBwdElemsPerThread = 16;
// Backward, G <= 32: a block's warps combine their partial columns in shared memory, D <= 32 * 16 floats each.
constexpr int kRedFloats = (kSmallBlock / kWarp) * kWarp * kBwdElemsPerThread;

template <typename T, int N>
struct alignas(sizeof(T) * N < 16 ? sizeof(T) * N : 16) Pack {
  T v[N];
};

template <int N, typename T>
__device__ __forceinline__ Pack<T, N> load_pack(const T* p) {
  return *reinterpret_cast<const Pack<T, N>*>(p);
}

template <int N, typename T>
__device__ __forceinline__ void store_pack(T* p, const Pack<T, N>& v) {
  *reinterpret_cast<Pack<T, N>*>(p) = v;
}

template <typename T>
__device__ __forceinline__ float f32(T v) {
  return static_cast<float>(v);
}

// Sums each v[i] over the row group of G threads: lanes of one warp when G <= 32 (butterfly shuffles among the
// group's own lanes; all 32 lanes of the warp take part), else the whole block (blockDim.x == G) through
// `scratch`. Every thread of the group gets the same bits (a + b == b + a in the butterfly; the warps' partials
// are added in the same order by every thread). Must be reached by every thread of the block.
template <int N>
__device__ __forceinline__ void group_sum(float (&v)[N], int G, float (*scratch)[N]) {
  if (G <= kWarp) {
    for (int offset = G / 2; offset > 0; offset /= 2) {
#pragma unroll
      for (int i = 0; i < N; ++i) {
        v[i] += __shfl_xor_sync(0xffffffffu, v[i], offset);
      }
    }
    return;
  }
#pragma unroll
  for (int i = 0; i < N; ++i) {
    v[i] = warp_sum(v[i]);
  }
  const int warp = threadIdx.x / kWarp;
  __syncthreads();  // readers of the previous call are done with scratch
  if (threadIdx.x % kWarp == 0) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
      scratch[warp][i] = v[i];
    }
  }
  __syncthreads();
  const int warps = blockDim.x / kWarp;
#pragma unroll
  for (int i = 0; i < N; ++i) {
    float total = 0.f;
    for (int w = 0; w < warps; ++w) {
      total += scratch[w][i];
    }
    v[i] = total;
  }
}

// ---------------------------------------------------------------- fast path: rows in registers

template <typename T, typename W, bool kAdd, bool kRms, int K>
__global__ void __launch_bounds__(kMaxFwdGroup)
    norm_fwd_vec_kernel(const T* __restrict__ x, const T* __restrict__ residual, T* __restrict__ sum,
                        const W* __restrict__ w, const W* __restrict__ b, T* __restrict__ out,
                        float* __restrict__ mean_out, float* __restrict__ rstd_out, int64_t rows, int D, int g_log2,
                        float eps) {
  constexpr int V = 16 / sizeof(T);
  __shared__ float scratch[kMaxFwdGroup / kWarp][1];
  const int G = 1 << g_log2;
  const int lane = threadIdx.x & (G - 1);
  const int groups = blockDim.x >> g_log2;  // rows in flight per block
  const float fD = static_cast<float>(D);
  // The loop bound is the same for the whole block, so every thread reaches every group_sum; a group whose row is
  // past the end (the last block-stride) joins the sums with zeros and stores nothing.
  for (int64_t first = static_cast<int64_t>(blockIdx.x) * groups; first < rows;
       first += static_cast<int64_t>(gridDim.x) * groups) {
    const int64_t row = first + (threadIdx.x >> g_log2);
    const bool live = row < rows;
    const int64_t base = row * D;
    Pack<T, V> s[K];  // the normalized input (x, or x + residual rounded to T), columns (lane + k*G)*V + i
    float acc[1] = {0.f};
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int c = (lane + k * G) * V;
      if (live && c < D) {
        if constexpr (kAdd) {
          const Pack<T, V> a = load_pack<V>(x + base + c);
          const Pack<T, V> r = load_pack<V>(residual + base + c);
#pragma unroll
          for (int i = 0; i < V; ++i) {
            s[k].v[i] = static_cast<T>(f32(a.v[i]) + f32(r.v[i]));
          }
          store_pack<V>(sum + base + c, s[k]);
        } else {
          s[k] = load_pack<V>(x + base + c);
        }
#pragma unroll
        for (int i = 0; i < V; ++i) {
          const float f = f32(s[k].v[i]);
          acc[0] += kRms ? f * f : f;
        }
      }
    }
    group_sum(acc, G, scratch);
    float mu = 0.f;
    float rs;
    if constexpr (kRms) {
      rs = rsqrtf(acc[0] / fD + eps);
    } else {
      mu = acc[0] / fD;
      float sq[1] = {0.f};
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const int c = (lane + k * G) * V;
        if (live && c < D) {
#pragma unroll
          for (int i = 0; i < V; ++i) {
            const float d = f32(s[k].v[i]) - mu;
            sq[0] += d * d;
          }
        }
      }
      group_sum(sq, G, scratch);
      rs = rsqrtf(sq[0] / fD + eps);
    }
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int c = (lane + k * G) * V;
      if (live && c < D) {
        const Pack<W, V> wk = load_pack<V>(w + c);
        Pack<T, V> o;
        if constexpr (kRms) {
#pragma unroll
          for (int i = 0; i < V; ++i) {
            const float n = f32(static_cast<T>(f32(s[k].v[i]) * rs));  // LlamaRMSNorm rounds before the weight
            o.v[i] = static_cast<T>(f32(wk.v[i]) * n);
          }
        } else {
          const Pack<W, V> bk = load_pack<V>(b + c);
#pragma unroll
          for (int i = 0; i < V; ++i) {
            o.v[i] = static_cast<T>((f32(s[k].v[i]) - mu) * rs * f32(wk.v[i]) + f32(bk.v[i]));
          }
        }
        store_pack<V>(out + base + c, o);
      }
    }
    if (live && lane == 0) {
      if constexpr (!kRms) {
        mean_out[row] = mu;
      }
      rstd_out[row] = rs;
    }
  }
}

// Writes this thread's column sums acc[k][i] (columns (lane + k*G)*V + i) into `part`, the block's row of a
// (blocks, D) partial buffer. G == blockDim.x: the columns are the thread's alone. G < blockDim.x (then G <= 32,
// D <= kRedFloats / warps): the groups of a warp own the same columns and are added by shuffles across lanes
// lane + m*G, then the warps through `red` (warps x D floats) in a fixed order. Reached by every thread.
template <int K, int V>
__device__ __forceinline__ void write_partial(float (&acc)[K][V], float* __restrict__ part, int D, int G, int lane,
                                              float* red) {
  if (G == static_cast<int>(blockDim.x)) {
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int c = (lane + k * G) * V;
      if (c < D) {
#pragma unroll
        for (int i = 0; i < V; ++i) {
          part[c + i] = acc[k][i];
        }
      }
    }
    return;
  }
  for (int offset = G; offset < kWarp; offset *= 2) {
#pragma unroll
    for (int k = 0; k < K; ++k) {
#pragma unroll
      for (int i = 0; i < V; ++i) {
        acc[k][i] += __shfl_xor_sync(0xffffffffu, acc[k][i], offset);
      }
    }
  }
  const int warp = threadIdx.x / kWarp;
  if (threadIdx.x % kWarp < G) {  // the warp's first group now holds the warp's sums
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int c = (lane + k * G) * V;
      if (c < D) {
#pragma unroll
        for (int i = 0; i < V; ++i) {
          red[warp * D + c + i] = acc[k][i];
        }
      }
    }
  }
  __syncthreads();
  const int warps = blockDim.x / kWarp;
  for (int j = threadIdx.x; j < D; j += blockDim.x) {
    float total = 0.f;
    for (int w = 0; w < warps; ++w) {
      total += red[w * D + j];
    }
    part[j] = total;
  }
  __syncthreads();  // red is reused by the next call
}

template <typename T, typename W, bool kRms, int K>
__global__ void __launch_bounds__(kMaxBwdGroup)
    norm_bwd_vec_kernel(const T* __restrict__ g, const T* __restrict__ x, const float* __restrict__ mean,
                        const float* __restrict__ rstd, const W* __restrict__ w, T* __restrict__ dx,
                        float* __restrict__ dw_part, float* __restrict__ db_part, int64_t rows, int D, int g_log2) {
  constexpr int V = 16 / sizeof(T);
  constexpr int kSums = kRms ? 1 : 2;  // sum(g*w*xhat), and for LayerNorm sum(g*w)
  __shared__ float scratch[kMaxBwdGroup / kWarp][kSums];
  __shared__ float red[kRedFloats];
  const int G = 1 << g_log2;
  const int lane = threadIdx.x & (G - 1);
  const int groups = blockDim.x >> g_log2;
  const float fD = static_cast<float>(D);
  float dw_acc[K][V];
  float db_acc[K][V];
#pragma unroll
  for (int k = 0; k < K; ++k) {
#pragma unroll
    for (int i = 0; i < V; ++i) {
      dw_acc[k][i] = 0.f;
      db_acc[k][i] = 0.f;
    }
  }
  for (int64_t first = static_cast<int64_t>(blockIdx.x) * groups; first < rows;
       first += static_cast<int64_t>(gridDim.x) * groups) {
    const int64_t row = first + (threadIdx.x >> g_log2);
    const bool live = row < rows;
    const int64_t base = row * D;
    const float mu = (kRms || !live) ? 0.f : mean[row];
    const float rs = live ? rstd[row] : 0.f;
    Pack<T, V> xk[K];
    Pack<T, V> gk[K];
    float sums[kSums];
#pragma unroll
    for (int s = 0; s < kSums; ++s) {
      sums[s] = 0.f;
    }
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int c = (lane + k * G) * V;
      if (live && c < D) {
        xk[k] = load_pack<V>(x + base + c);
        gk[k] = load_pack<V>(g + base + c);
        const Pack<W, V> wk = load_pack<V>(w + c);
#pragma unroll
        for (int i = 0; i < V; ++i) {
          const float gf = f32(gk[k].v[i]);
          const float xhat = (f32(xk[k].v[i]) - mu) * rs;
          const float gw = gf * f32(wk.v[i]);
          sums[0] += gw * xhat;
          if constexpr (kRms) {
            dw_acc[k][i] += gf * f32(static_cast<T>(xhat));  // the rounded n the forward multiplied by w
          } else {
            sums[1] += gw;
            dw_acc[k][i] += gf * xhat;
            db_acc[k][i] += gf;
          }
        }
      }
    }
    group_sum(sums, G, scratch);
    const float mean_gw_xhat = sums[0] / fD;
    const float mean_gw = kRms ? 0.f : sums[kSums - 1] / fD;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int c = (lane + k * G) * V;
      if (live && c < D) {
        const Pack<W, V> wk = load_pack<V>(w + c);  // again (L1), rather than holding K*V more registers
        Pack<T, V> o;
#pragma unroll
        for (int i = 0; i < V; ++i) {
          const float xhat = (f32(xk[k].v[i]) - mu) * rs;
          o.v[i] = static_cast<T>(rs * (f32(gk[k].v[i]) * f32(wk.v[i]) - mean_gw - xhat * mean_gw_xhat));
        }
        store_pack<V>(dx + base + c, o);
      }
    }
  }
  write_partial<K, V>(dw_acc, dw_part + static_cast<int64_t>(blockIdx.x) * D, D, G, lane, red);
  if constexpr (!kRms) {
    write_partial<K, V>(db_acc, db_part + static_cast<int64_t>(blockIdx.x) * D, D, G, lane, red);
  }
}

// ---------------------------------------------------------------- fallback: any D, any alignment

template <typename T, bool kAdd, bool kRms>
__global__ void __launch_bounds__(kThreads)
    norm_fwd_loop_kernel(const T* __restrict__ x, const T* __restrict__ residual, T* __restrict__ sum,
                         const float* __restrict__ w, const float* __restrict__ b, T* __restrict__ out,
                         float* __restrict__ mean_out, float* __restrict__ rstd_out, int64_t rows, int64_t D,
                         float eps) {
  __shared__ float scratch[kThreads / kWarp][1];
  const float fD = static_cast<float>(D);
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* src = x + row * D;
    float acc[1] = {0.f};
    if constexpr (kAdd) {
      const T* rr = residual + row * D;
      T* sr = sum + row * D;
      for (int64_t j = threadIdx.x; j < D; j += blockDim.x) {
        const T s = static_cast<T>(f32(src[j]) + f32(rr[j]));
        sr[j] = s;
        const float sf = f32(s);
        acc[0] += kRms ? sf * sf : sf;
      }
      src = sr;  // each thread re-reads only the columns it wrote
    } else {
      for (int64_t j = threadIdx.x; j < D; j += blockDim.x) {
        const float xf = f32(src[j]);
        acc[0] += kRms ? xf * xf : xf;
      }
    }
    group_sum(acc, blockDim.x, scratch);
    float mu = 0.f;
    float rs;
    if constexpr (kRms) {
      rs = rsqrtf(acc[0] / fD + eps);
    } else {
      mu = acc[0] / fD;
      float sq[1] = {0.f};
      for (int64_t j = threadIdx.x; j < D; j += blockDim.x) {
        const float d = f32(src[j]) - mu;
        sq[0] += d * d;
      }
      group_sum(sq, blockDim.x, scratch);
      rs = rsqrtf(sq[0] / fD + eps);
    }
    T* orow = out + row * D;
    for (int64_t j = threadIdx.x; j < D; j += blockDim.x) {
      if constexpr (kRms) {
        const float n = f32(static_cast<T>(f32(src[j]) * rs));
        orow[j] = static_cast<T>(w[j] * n);
      } else {
        orow[j] = static_cast<T>((f32(src[j]) - mu) * rs * w[j] + b[j]);
      }
    }
    if (threadIdx.x == 0) {
      if constexpr (!kRms) {
        mean_out[row] = mu;
      }
      rstd_out[row] = rs;
    }
  }
}

// Needs gridDim.x <= rows: a block's first row (blockIdx.x) initializes its partial rows, so they need no zeroing.
template <typename T, bool kRms>
__global__ void __launch_bounds__(kThreads)
    norm_bwd_loop_kernel(const T* __restrict__ g, const T* __restrict__ x, const float* __restrict__ mean,
                         const float* __restrict__ rstd, const float* __restrict__ w, T* __restrict__ dx,
                         float* __restrict__ dw_part, float* __restrict__ db_part, int64_t rows, int64_t D) {
  constexpr int kSums = kRms ? 1 : 2;
  __shared__ float scratch[kThreads / kWarp][kSums];
  float* dw = dw_part + static_cast<int64_t>(blockIdx.x) * D;
  float* db = kRms ? nullptr : db_part + static_cast<int64_t>(blockIdx.x) * D;
  const float fD = static_cast<float>(D);
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const bool first = row == blockIdx.x;
    const T* gr = g + row * D;
    const T* xr = x + row * D;
    const float mu = kRms ? 0.f : mean[row];
    const float rs = rstd[row];
    float sums[kSums];
#pragma unroll
    for (int s = 0; s < kSums; ++s) {
      sums[s] = 0.f;
    }
    // Column j belongs to thread j % blockDim.x in every row: the partial rows need no synchronization.
    for (int64_t j = threadIdx.x; j < D; j += blockDim.x) {
      const float gj = f32(gr[j]);
      const float xhat = (f32(xr[j]) - mu) * rs;
      const float gw = gj * w[j];
      sums[0] += gw * xhat;
      if constexpr (kRms) {
        dw[j] = (first ? 0.f : dw[j]) + gj * f32(static_cast<T>(xhat));
      } else {
        sums[1] += gw;
        dw[j] = (first ? 0.f : dw[j]) + gj * xhat;
        db[j] = (first ? 0.f : db[j]) + gj;
      }
    }
    group_sum(sums, blockDim.x, scratch);
    const float mean_gw_xhat = sums[0] / fD;
    const float mean_gw = kRms ? 0.f : sums[kSums - 1] / fD;
    T* dxr = dx + row * D;
    for (int64_t j = threadIdx.x; j < D; j += blockDim.x) {
      const float xhat = (f32(xr[j]) - mu) * rs;
      dxr[j] = static_cast<T>(rs * (f32(gr[j]) * w[j] - mean_gw - xhat * mean_gw_xhat));
    }
  }
}

// ---------------------------------------------------------------- weight / bias gradient: partial rows -> (D,)

constexpr int kColTile = 32;  // columns per block (one warp-wide, coalesced row segment)
constexpr int kColSlices = 8;  // partial rows read in parallel per column

// out_y[j] = sum_p part_y[p * D + j] for y = blockIdx.y (0: dweight, 1: dbias). A block covers 32 columns with 8
// slices; slice s adds rows s, s + 8, ... in four independent chains (loads in flight), then the slices are added
// in shared memory, always in the same order.
template <typename O>
__global__ void __launch_bounds__(kColTile* kColSlices)
    column_sum_kernel(const float* __restrict__ part0, const float* __restrict__ part1, int64_t parts, int64_t D,
                      O* __restrict__ out0, O* __restrict__ out1) {
  __shared__ float tile[kColSlices][kColTile + 1];
  const float* part = blockIdx.y == 0 ? part0 : part1;
  O* out = blockIdx.y == 0 ? out0 : out1;
  const int64_t j = static_cast<int64_t>(blockIdx.x) * kColTile + threadIdx.x;
  float total = 0.f;
  if (j < D) {
    float chain[4] = {0.f, 0.f, 0.f, 0.f};
    int64_t p = threadIdx.y;
    for (; p + 3 * kColSlices < parts; p += 4 * kColSlices) {
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        chain[u] += part[(p + u * kColSlices) * D + j];
      }
    }
    for (; p < parts; p += kColSlices) {
      chain[0] += part[p * D + j];
    }
    total = (chain[0] + chain[1]) + (chain[2] + chain[3]);
  }
  tile[threadIdx.y][threadIdx.x] = total;
  __syncthreads();
  if (threadIdx.y == 0 && j < D) {
    float s = 0.f;
#pragma unroll
    for (int y = 0; y < kColSlices; ++y) {
      s += tile[y][threadIdx.x];
    }
    out[j] = static_cast<O>(s);
  }
}

// ---------------------------------------------------------------- host side

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

// Typed pointer of an optional operand (nullptr when undefined); inputs through const_data_ptr, which leaves a
// copy-on-write tensor's storage shared.
template <typename P>
P* ptr(const at::Tensor& t) {
  if (!t.defined()) {
    return nullptr;
  }
  if constexpr (std::is_const_v<P>) {
    return static_cast<P*>(t.const_data_ptr());
  } else {
    return static_cast<P*>(t.mutable_data_ptr());
  }
}

bool aligned16(std::initializer_list<const at::Tensor*> tensors) {
  for (const at::Tensor* t : tensors) {
    if (t->defined() && reinterpret_cast<uintptr_t>(t->const_data_ptr()) % 16 != 0) {
      return false;
    }
  }
  return true;
}

// A (D,) parameter as the kernels want it: contiguous and 16-byte aligned (a parameter can be a view into a flat
// buffer at any element offset; copying D elements is cheaper than the fallback kernels).
at::Tensor aligned_param(const at::Tensor& t) {
  at::Tensor c = t.contiguous();
  return reinterpret_cast<uintptr_t>(c.const_data_ptr()) % 16 == 0 ? c : c.clone();
}

int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

// Resident blocks per SM of `kernel` at `threads` per block, cached: the query costs host time on every launch.
int blocks_per_sm(const void* kernel, int threads) {
  static std::mutex mutex;
  static std::map<std::tuple<const void*, int, int>, int> cache;
  const auto key = std::make_tuple(kernel, static_cast<int>(c10::cuda::current_device()), threads);
  const std::lock_guard<std::mutex> lock(mutex);
  const auto it = cache.find(key);
  if (it != cache.end()) {
    return it->second;
  }
  int blocks = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, threads, 0));
  blocks = std::max(blocks, 1);
  cache.emplace(key, blocks);
  return blocks;
}

// Row-group shape of a fast-path launch: G = 1 << g_log2 threads per row, k vectors per thread, `threads` per block.
struct VecShape {
  int g_log2 = 0;
  int k = 1;
  int threads = kSmallBlock;
};

// nvec 16-byte vectors per row, about k_target per thread with at most g_max threads per row; false when that
// would take more than k_max vectors per thread (the row does not fit in registers: use the fallback).
bool vec_shape(int64_t nvec, int k_target, int k_max, int g_max, VecShape& shape) {
  int64_t g = 1;
  int g_log2 = 0;
  while (g * k_target < nvec && g < g_max) {
    g *= 2;
    ++g_log2;
  }
  int64_t k = 1;
  while (g * k < nvec) {
    k *= 2;
  }
  if (k > k_max) {
    return false;
  }
  shape.g_log2 = g_log2;
  shape.k = static_cast<int>(k);
  shape.threads = g > kWarp ? static_cast<int>(g) : kSmallBlock;  // several rows per block of 128 when G <= 32
  return true;
}

template <typename T, typename W>
struct FwdArgs {
  const T* x;
  const T* residual;  // null: no residual add
  T* sum;
  const W* w;
  const W* b;  // null for RMSNorm
  T* out;
  float* mean;  // null for RMSNorm
  float* rstd;
  int64_t rows;
  int64_t D;
  float eps;
};

template <typename T, typename W, bool kAdd, bool kRms, int K>
void launch_fwd_vec(const FwdArgs<T, W>& a, const VecShape& s) {
  const auto kernel = norm_fwd_vec_kernel<T, W, kAdd, kRms, K>;
  const int64_t groups = s.threads >> s.g_log2;
  const int64_t wave = static_cast<int64_t>(blocks_per_sm(reinterpret_cast<const void*>(kernel), s.threads)) *
                       sm_count();
  const int64_t grid = std::min(ceil_div(a.rows, groups), wave);
  kernel<<<static_cast<unsigned>(grid), s.threads, 0, current_stream()>>>(
      a.x, a.residual, a.sum, a.w, a.b, a.out, a.mean, a.rstd, a.rows, static_cast<int>(a.D), s.g_log2, a.eps);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T, typename W, bool kAdd, bool kRms>
void fwd_vec_k(const FwdArgs<T, W>& a, const VecShape& s) {
  switch (s.k) {
    case 1:
      return launch_fwd_vec<T, W, kAdd, kRms, 1>(a, s);
    case 2:
      return launch_fwd_vec<T, W, kAdd, kRms, 2>(a, s);
    default:
      TORCH_INTERNAL_ASSERT(s.k == 4);
      return launch_fwd_vec<T, W, kAdd, kRms, 4>(a, s);
  }
}

// w / b: contiguous, of dtype T or float (W). The fast path when the shapes and pointers allow it, else the loop.
template <typename T, typename W, bool kRms>
void norm_fwd_launch(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& sum, const at::Tensor& w,
                     const at::Tensor& b, const at::Tensor& out, const at::Tensor& mean, const at::Tensor& rstd,
                     int64_t rows, int64_t D, float eps) {
  constexpr int V = 16 / sizeof(T);
  const bool add = residual.defined();
  VecShape s;
  if (D % V == 0 && aligned16({&x, &residual, &sum, &w, &b, &out}) &&
      vec_shape(D / V, kFwdVecsPerThread, kFwdVecsPerThread, kMaxFwdGroup, s)) {
    const FwdArgs<T, W> a{ptr<const T>(x), ptr<const T>(residual), ptr<T>(sum),  ptr<const W>(w), ptr<const W>(b),
                          ptr<T>(out),     ptr<float>(mean),       ptr<float>(rstd), rows,          D,
                          eps};
    if (add) {
      fwd_vec_k<T, W, true, kRms>(a, s);
    } else {
      fwd_vec_k<T, W, false, kRms>(a, s);
    }
    return;
  }
  const at::Tensor wf = w.to(at::kFloat);
  const at::Tensor bf = b.defined() ? b.to(at::kFloat) : at::Tensor();
  const auto grid = static_cast<unsigned>(std::min<int64_t>(rows, static_cast<int64_t>(sm_count()) * 8));
  const auto kernel = add ? norm_fwd_loop_kernel<T, true, kRms> : norm_fwd_loop_kernel<T, false, kRms>;
  kernel<<<grid, kThreads, 0, current_stream()>>>(ptr<const T>(x), ptr<const T>(residual), ptr<T>(sum),
                                                  ptr<const float>(wf), ptr<const float>(bf), ptr<T>(out),
                                                  ptr<float>(mean), ptr<float>(rstd), rows, D, eps);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
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
  if (!kRms) {
    TORCH_CHECK(bias.has_value() && bias->dim() == 1 && bias->size(0) == v.D, op, ": bias must have shape (", v.D,
                ",)");
    TORCH_CHECK(bias->device() == x_in.device(), op, ": bias must be on ", x_in.device());
  }
  at::Tensor residual, sum;
  if (residual_in.has_value()) {
    TORCH_CHECK(residual_in->sizes() == x_in.sizes() && residual_in->scalar_type() == x_in.scalar_type(), op,
                ": residual must match x in shape and dtype");
    TORCH_CHECK(residual_in->device() == x_in.device(), op, ": residual must be on ", x_in.device());
    residual = residual_in->contiguous();
    sum = at::empty_like(v.x);
  }
  at::Tensor out = at::empty_like(v.x);
  at::Tensor rstd = at::empty(stat_shape(x_in), x_in.options().dtype(at::kFloat));
  at::Tensor mean = kRms ? at::Tensor() : at::empty_like(rstd);
  if (v.rows == 0) {
    return {out, sum, mean, rstd};
  }
  // The kernels read weight and bias as x's dtype or as fp32; any other mix is made fp32 here (exact).
  const at::ScalarType xt = v.x.scalar_type();
  const bool params_as_x = weight.scalar_type() == xt && (kRms || bias->scalar_type() == xt);
  const auto param = [&](const at::Tensor& t) { return aligned_param(params_as_x ? t : t.to(at::kFloat)); };
  const at::Tensor w = param(weight);
  const at::Tensor b = kRms ? at::Tensor() : param(*bias);
  const float feps = static_cast<float>(eps);
  HF_ZERO_DISPATCH_FLOAT(xt, "norm_fwd_cuda", [&] {
    if (params_as_x) {
      norm_fwd_launch<scalar_t, scalar_t, kRms>(v.x, residual, sum, w, b, out, mean, rstd, v.rows, v.D, feps);
    } else {
      norm_fwd_launch<scalar_t, float, kRms>(v.x, residual, sum, w, b, out, mean, rstd, v.rows, v.D, feps);
    }
  });
  return {out, sum, mean, rstd};
}

template <typename T, typename W, bool kRms, int K>
int64_t launch_bwd_vec(const at::Tensor& g, const at::Tensor& x, const at::Tensor& mean, const at::Tensor& rstd,
                       const at::Tensor& w, const at::Tensor& dx, int64_t rows, int64_t D, const VecShape& s,
                       at::Tensor& part) {
  const auto kernel = norm_bwd_vec_kernel<T, W, kRms, K>;
  const int64_t groups = s.threads >> s.g_log2;
  // At most 1024 resident threads per SM: K*V elements of x and g each in flight per thread is plenty for full
  // bandwidth, and fewer blocks mean fewer partial rows to write and add up.
  const int per_sm =
      std::min(blocks_per_sm(reinterpret_cast<const void*>(kernel), s.threads), std::max(1, 1024 / s.threads));
  const int64_t grid = std::min(ceil_div(rows, groups), static_cast<int64_t>(per_sm) * sm_count());
  part = at::empty({kRms ? 1 : 2, grid, D}, x.options().dtype(at::kFloat));
  float* dw_part = part.mutable_data_ptr<float>();
  float* db_part = kRms ? nullptr : dw_part + grid * D;
  kernel<<<static_cast<unsigned>(grid), s.threads, 0, current_stream()>>>(
      ptr<const T>(g), ptr<const T>(x), ptr<const float>(mean), ptr<const float>(rstd), ptr<const W>(w),
      ptr<T>(dx), dw_part, db_part, rows, static_cast<int>(D), s.g_log2);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return grid;
}

// dx into `dx`; returns the (1 or 2, parts, D) fp32 partial sums of dweight (and dbias) in `part`, and parts.
template <typename T, typename W, bool kRms>
int64_t norm_bwd_launch(const at::Tensor& g, const at::Tensor& x, const at::Tensor& mean, const at::Tensor& rstd,
                        const at::Tensor& w, const at::Tensor& dx, int64_t rows, int64_t D, at::Tensor& part) {
  constexpr int V = 16 / sizeof(T);
  constexpr int kMaxK = kBwdElemsPerThread / V;
  VecShape s;
  if (D % V == 0 && aligned16({&g, &x, &w, &dx}) && vec_shape(D / V, 2, kMaxK, kMaxBwdGroup, s)) {
    // G <= 32 shares a block between rows, whose partial columns meet in shared memory (kRedFloats).
    TORCH_INTERNAL_ASSERT((1 << s.g_log2) > kWarp || (s.threads / kWarp) * D <= kRedFloats);
    switch (s.k) {
      case 1:
        return launch_bwd_vec<T, W, kRms, 1>(g, x, mean, rstd, w, dx, rows, D, s, part);
      case 2:
        return launch_bwd_vec<T, W, kRms, 2>(g, x, mean, rstd, w, dx, rows, D, s, part);
      default:
        if constexpr (kMaxK >= 4) {
          TORCH_INTERNAL_ASSERT(s.k == 4);
          return launch_bwd_vec<T, W, kRms, 4>(g, x, mean, rstd, w, dx, rows, D, s, part);
        }
        TORCH_INTERNAL_ASSERT(false, "norm backward: ", s.k, " vectors per thread");
    }
  }
  const at::Tensor wf = w.to(at::kFloat);
  const int64_t grid = std::min<int64_t>(rows, static_cast<int64_t>(sm_count()) * 4);
  part = at::empty({kRms ? 1 : 2, grid, D}, x.options().dtype(at::kFloat));
  float* dw_part = part.mutable_data_ptr<float>();
  norm_bwd_loop_kernel<T, kRms><<<static_cast<unsigned>(grid), kThreads, 0, current_stream()>>>(
      ptr<const T>(g), ptr<const T>(x), ptr<const float>(mean), ptr<const float>(rstd), ptr<const float>(wf),
      ptr<T>(dx), dw_part, kRms ? nullptr : dw_part + grid * D, rows, D);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return grid;
}

template <bool kRms>
std::tuple<at::Tensor, at::Tensor, at::Tensor> norm_bwd(const at::Tensor& grad_out, const at::Tensor& x,
                                                        const std::optional<at::Tensor>& mean, const at::Tensor& rstd,
                                                        const at::Tensor& weight, const char* op) {
  const Rows v = rows_of(x, weight, op);
  TORCH_CHECK(grad_out.sizes() == x.sizes() && grad_out.scalar_type() == x.scalar_type(), op,
              ": grad_out must match x in shape and dtype");
  TORCH_CHECK(rstd.numel() == v.rows && rstd.scalar_type() == at::kFloat &&
                  (kRms || (mean->numel() == v.rows && mean->scalar_type() == at::kFloat)),
              op, ": mean / rstd must be float32 with one value per row of x (the forward's outputs)");
  TORCH_CHECK(rstd.device() == x.device() && (kRms || mean->device() == x.device()), op,
              ": mean / rstd must be on ", x.device());
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor g = grad_out.contiguous();
  const at::Tensor rstd_c = rstd.contiguous();
  const at::Tensor mean_c = kRms ? at::Tensor() : mean->contiguous();
  at::Tensor dx = at::empty_like(v.x);
  // dweight / dbias in the weight's dtype (both: the bias gradient too, as the CPU kernel and the fake do).
  const at::ScalarType wt = weight.scalar_type();
  const bool wt_direct = wt == at::kFloat || wt == at::kBFloat16 || wt == at::kHalf;
  const auto grad_options = weight.options().dtype(wt_direct ? wt : at::kFloat);
  at::Tensor dw = at::empty({v.D}, grad_options);
  at::Tensor db = kRms ? at::Tensor() : at::empty({v.D}, grad_options);
  if (v.rows == 0) {
    dw.zero_();
    if (!kRms) {
      db.zero_();
    }
  } else {
    const at::ScalarType xt = v.x.scalar_type();
    const bool weight_as_x = wt == xt;
    const at::Tensor w = aligned_param(weight_as_x ? weight : weight.to(at::kFloat));
    at::Tensor part;
    int64_t parts = 0;
    HF_ZERO_DISPATCH_FLOAT(xt, "norm_bwd_cuda", [&] {
      if (weight_as_x) {
        parts = norm_bwd_launch<scalar_t, scalar_t, kRms>(g, v.x, mean_c, rstd_c, w, dx, v.rows, v.D, part);
      } else {
        parts = norm_bwd_launch<scalar_t, float, kRms>(g, v.x, mean_c, rstd_c, w, dx, v.rows, v.D, part);
      }
    });
    const float* dw_part = part.const_data_ptr<float>();
    const dim3 grid(static_cast<unsigned>(ceil_div(v.D, kColTile)), kRms ? 1 : 2);
    const dim3 block(kColTile, kColSlices);
    HF_ZERO_DISPATCH_FLOAT(dw.scalar_type(), "norm_bwd_cuda_columns", [&] {
      column_sum_kernel<scalar_t><<<grid, block, 0, current_stream()>>>(
          dw_part, kRms ? nullptr : dw_part + parts * v.D, parts, v.D, dw.mutable_data_ptr<scalar_t>(),
          kRms ? nullptr : db.mutable_data_ptr<scalar_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }
  if (!wt_direct) {
    dw = dw.to(wt);
    db = kRms ? db : db.to(wt);
  }
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
