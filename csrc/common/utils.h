// Shared helpers for the hf_zero CPU and CUDA kernels: dtype dispatch and broadcast row addressing.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace hf_zero {

// ---------------------------------------------------------------- 16-bit conversions
//
// Branch-free, bit-exact IEEE conversions (round to nearest even) written with integer masks, so that GCC and
// Clang vectorize the loops that use them. c10's own fp16 conversion goes through scalar F16C intrinsics and its
// bf16 rounding through a branch, which keep those loops scalar: measured 5x slower on the bf16/fp16 Adam path.
// The fp16 formulas are those of the FP16 library (Maratea Dukhan), which c10::Half also uses.

// std::bit_cast is C++20, and the standard an extension compiles with is torch's choice (C++17 in torch 2.11's
// extension builder, C++20 in 2.13's): the memcpy form is the C++17 way to reinterpret bits, and GCC, Clang and nvcc's
// host compiler turn it into the same single move, so the loops still vectorize.
template <typename To, typename From>
inline To bit_cast(const From& from) {
  static_assert(sizeof(To) == sizeof(From), "bit_cast between types of different sizes");
  To to;
  std::memcpy(&to, &from, sizeof(To));
  return to;
}

namespace detail {
inline uint32_t select(bool cond, uint32_t a, uint32_t b) {
  const uint32_t mask = 0u - static_cast<uint32_t>(cond);
  return (a & mask) | (b & ~mask);
}
}  // namespace detail

inline float to_float(float v) { return v; }
inline float to_float(at::BFloat16 v) { return bit_cast<float>(static_cast<uint32_t>(v.x) << 16); }
inline float to_float(at::Half v) {
  const uint32_t w = static_cast<uint32_t>(v.x) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const float normalized = bit_cast<float>((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  const float denormalized = bit_cast<float>((two_w >> 17) | (126u << 23)) - 0.5f;
  return bit_cast<float>(sign | detail::select(two_w < (1u << 27), bit_cast<uint32_t>(denormalized),
                                                    bit_cast<uint32_t>(normalized)));
}
template <typename U>
inline float to_float(U v) {  // integers, doubles
  return static_cast<float>(v);
}

template <typename T>
inline T from_float(float f) {
  return static_cast<T>(f);
}
template <>
inline float from_float<float>(float f) {
  return f;
}
template <>
inline at::BFloat16 from_float<at::BFloat16>(float f) {
  const uint32_t u = bit_cast<uint32_t>(f);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return at::BFloat16(static_cast<uint16_t>(detail::select(f != f, 0x7FC0u, rounded)), at::BFloat16::from_bits());
}
template <>
inline at::Half from_float<at::Half>(float f) {
  float base = (std::fabs(f) * 0x1.0p+112f) * 0x1.0p-110f;
  const uint32_t w = bit_cast<uint32_t>(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t bias = std::max(shl1_w & 0xFF000000u, 0x71000000u);
  base = bit_cast<float>((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = bit_cast<uint32_t>(base);
  const uint32_t nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
  return at::Half(static_cast<uint16_t>((sign >> 16) | detail::select(shl1_w > 0xFF000000u, 0x7E00u, nonsign)),
                  at::Half::from_bits());
}

// Every kernel computes in fp32 and reads/writes fp32, bf16 or fp16 storage through to_float / from_float.
// Exactly the three storage types (no double: fewer instantiations, faster builds).
#define HF_ZERO_DISPATCH_FLOAT(TYPE, NAME, ...)                \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__) \
                         AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__) AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))

inline void check_float(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf,
              what, " must be float32, bfloat16 or float16, got ", t.scalar_type());
}

// f rounded to T's precision and back: the value a T would hold.
template <typename T>
inline float round_to(float f) {
  return to_float(from_float<T>(f));
}

// ---------------------------------------------------------------- OpenMP task sizes (at::parallel_for grains)

// Elements per task of an element-wise optimizer loop (Lion, Adagrad): large enough that a task's start-up cost is
// noise, small enough to split a parameter across every core.
constexpr int64_t kElementwiseGrain = int64_t{1} << 16;

// Rows per task of a row-wise kernel over rows of D elements: at least `elements` elements of work each (norms use
// ~32K, the transformer kernels ~16K: their per-element work is larger).
inline int64_t rows_per_task(int64_t D, int64_t elements) {
  return std::max<int64_t>(1, elements / std::max<int64_t>(D, 1));
}

// ---------------------------------------------------------------- broadcast rows

// Maps a row index of a tensor viewed as (rows, last_dim) onto the element offset of the matching row of a
// broadcast operand (a mask, cos/sin tables) that has been expanded to the same shape. The operand keeps its
// own (possibly zero) strides, so broadcasting costs no copy. Its last dimension must be contiguous.
struct RowOffsets {
  static constexpr int kMaxDims = 8;
  int ndim = 0;  // leading (row) dimensions
  int64_t sizes[kMaxDims] = {};  // plain arrays: the struct is passed by value to CUDA kernels
  int64_t strides[kMaxDims] = {};

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
