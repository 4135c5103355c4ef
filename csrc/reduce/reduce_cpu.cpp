// hf_zero::sum_of_squares CPU kernel: sum(x.float() ** 2) over every element, as a 0-dim fp32 tensor.
//
// The engine's global gradient norm runs this over each flat gradient shard every step. torch's
// vector_norm(dtype=float32) on a bf16 tensor converts element by element without vectorizing on CPUs lacking
// AVX512-BF16 (~110 ms for 16.8M elements on AVX2); this kernel is bound by memory bandwidth instead.
//
// Accumulation: kLanes independent fp32 partial sums (the inner lane loop vectorizes into a few SIMD registers and
// hides the add latency), flushed into a double every kTileNumel elements, so no fp32 partial sums more than
// kTileNumel / kLanes terms. The range is cut into fixed blocks of kBlockNumel whose double sums are added in
// block order: the result does not depend on the number of threads. inf and nan propagate through every add
// (squares are never negative, so inf - inf cannot occur): callers detect fp16 overflow from the result.

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "utils.h"

namespace hf_zero {
namespace {

constexpr int64_t kLanes = 32;           // four AVX2 registers of fp32
constexpr int64_t kTileNumel = 2048;     // 64 terms per fp32 lane before the flush into double
constexpr int64_t kBlockNumel = 1 << 16;  // unit of work of one thread, and of the deterministic final sum

// Sum of squares of x[0, count), count <= kTileNumel. A separate function with __restrict pointers so that the
// lane loop vectorizes (the bf16 / fp16 conversions of utils.h are branch-free for that reason).
template <typename T>
double tile_sum_of_squares(const T* __restrict x, int64_t count) {
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= count; i += kLanes) {
    for (int64_t lane = 0; lane < kLanes; ++lane) {
      const float v = to_float(x[i + lane]);
      acc[lane] += v * v;
    }
  }
  for (int64_t lane = 0; i < count; ++i, ++lane) {
    const float v = to_float(x[i]);
    acc[lane] += v * v;
  }
  double total = 0.0;
  for (int64_t lane = 0; lane < kLanes; ++lane) {
    total += acc[lane];
  }
  return total;
}

template <typename T>
double block_sum_of_squares(const T* x, int64_t count) {
  double total = 0.0;
  for (int64_t i = 0; i < count; i += kTileNumel) {
    total += tile_sum_of_squares<T>(x + i, std::min(kTileNumel, count - i));
  }
  return total;
}

template <typename T>
double sum_of_squares_kernel(const T* x, int64_t numel) {
  const int64_t blocks = (numel + kBlockNumel - 1) / kBlockNumel;
  std::vector<double> partial(blocks, 0.0);  // (blocks,)
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t lo = b * kBlockNumel;
      partial[b] = block_sum_of_squares<T>(x + lo, std::min(kBlockNumel, numel - lo));
    }
  });
  double total = 0.0;
  for (const double p : partial) {
    total += p;
  }
  return total;
}

at::Tensor sum_of_squares_cpu(const at::Tensor& x) {
  check_float(x, "sum_of_squares: x");
  const at::Tensor xc = x.contiguous();
  double total = 0.0;
  HF_ZERO_DISPATCH_FLOAT(xc.scalar_type(), "sum_of_squares_cpu", [&] {
    total = sum_of_squares_kernel<scalar_t>(xc.const_data_ptr<scalar_t>(), xc.numel());
  });
  // A finite double beyond the fp32 range becomes inf (IEEE rounding of the narrowing conversion), as the fp32
  // sum of the reference would.
  return at::full({}, static_cast<float>(total), xc.options().dtype(at::kFloat));
}

}  // namespace

TORCH_LIBRARY_IMPL(hf_zero, CPU, m) {
  m.impl("sum_of_squares", &sum_of_squares_cpu);
}

}  // namespace hf_zero
