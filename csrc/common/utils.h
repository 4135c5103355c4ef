// Shared helpers for the hf_zero CPU and CUDA kernels: dtype dispatch and broadcast row addressing.
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <cstdint>

namespace hf_zero {

// Every kernel computes in fp32 and reads/writes fp32, bf16 or fp16 storage. The conversions are the inline
// c10::BFloat16 / c10::Half operators, so they compile into the vectorized loop bodies.
#define HF_ZERO_DISPATCH_FLOAT(TYPE, NAME, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, TYPE, NAME, __VA_ARGS__)

inline void check_float(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf,
              what, " must be float32, bfloat16 or float16, got ", t.scalar_type());
}

// Maps a row index of a tensor viewed as (rows, last_dim) onto the element offset of the matching row of a
// broadcast operand (a mask, cos/sin tables) that has been expanded to the same shape. The operand keeps its
// own (possibly zero) strides, so broadcasting costs no copy. Its last dimension must be contiguous.
struct RowOffsets {
  static constexpr int kMaxDims = 8;
  int ndim = 0;  // leading (row) dimensions
  std::array<int64_t, kMaxDims> sizes{};
  std::array<int64_t, kMaxDims> strides{};

  RowOffsets() = default;
  explicit RowOffsets(const at::Tensor& expanded) {
    ndim = static_cast<int>(expanded.dim()) - 1;
    TORCH_CHECK(ndim <= kMaxDims, "hf_zero: at most ", kMaxDims + 1, " dimensions are supported");
    TORCH_CHECK(expanded.dim() >= 1 && (expanded.size(-1) == 1 || expanded.stride(-1) == 1),
                "hf_zero: the broadcast operand's last dimension must be contiguous");
    for (int d = 0; d < ndim; ++d) {
      sizes[d] = expanded.size(d);
      strides[d] = expanded.stride(d);
    }
  }

#ifdef __CUDACC__
  __host__ __device__
#endif
  int64_t operator()(int64_t row) const {
    int64_t offset = 0;
    for (int d = ndim - 1; d >= 0; --d) {
      offset += (row % sizes[d]) * strides[d];
      row /= sizes[d];
    }
    return offset;
  }
};

// Expands `operand` to `shape` without copying; a non-contiguous last dimension is made contiguous first
// (operands here are small tables or masks, so that copy is cheap).
inline at::Tensor expand_rows(const at::Tensor& operand, at::IntArrayRef shape) {
  at::Tensor t = operand;
  if (t.dim() >= 1 && t.size(-1) != shape.back()) {
    return t.expand(shape).contiguous();  // broadcast along the last dimension: materialize it
  }
  if (t.dim() >= 1 && t.size(-1) > 1 && t.stride(-1) != 1) {
    t = t.contiguous();
  }
  return t.expand(shape);
}

}  // namespace hf_zero
