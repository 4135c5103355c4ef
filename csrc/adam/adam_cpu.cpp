// Adam/AdamW CPU kernels: hf_zero::adam_step (one flat partition) and hf_zero::multi_tensor_adam.
//
// One pass over memory per step: each element reads p, g, m, v and writes p, m, v (and the 16-bit copy of p),
// 28 bytes per fp32 element, so the kernel is bound by memory bandwidth; what decides its speed is how close it
// runs to that bound, not the arithmetic. Three implementations of the same element loop, chosen once per process
// from what the CPU reports (__builtin_cpu_supports), so one binary runs everywhere:
//
//   avx512  16 lanes: explicit AVX-512F intrinsics, compiled with a target attribute (not -march)
//   avx2     8 lanes: explicit AVX2/F16C intrinsics, likewise
//   scalar  the portable loop (`#pragma omp simd`, vectorized by the compiler for whatever -march allows); also
//           the reference the SIMD paths are tested against, bit for bit
//
// What the SIMD paths add over the compiler's loop (measured against DeepSpeedCPUAdam, benchmarks/bench_cpu_adam.py):
// * software prefetch on the four input streams, at two distances: into L1 kPrefetchElems ahead and into L2
//   kPrefetchL2Elems ahead. The hardware stream prefetcher stops at every 4 KiB page, so a plain loop stalls on a
//   cache miss at each page of each of its four arrays; prefetching ahead keeps the loads in flight across those
//   boundaries. One core's bandwidth is bounded by how many misses it keeps in flight: the L1 prefetches alone are
//   capped by the L1's fill buffers, the L2 ones add requests beyond them (measured on the Xeon of RESULTS.md,
//   1 thread: the L1 prefetch alone 1.13-1.19x a loop without prefetch, both 1.18-1.29x; the same loop reading
//   the four arrays and writing none is 6-14% faster, so this is near the core's read ceiling, not the arithmetic).
// * at one thread the whole tensor is one chunk, so the prefetch streams run across what would be block boundaries
//   instead of restarting cold at each (1-5% at 1 thread).
// * bf16 <-> fp32 by 16-bit shifts and integer round-to-nearest-even, fp16 by F16C, all in vector registers.
// * threads pull fixed blocks from a shared counter (a thread that is slowed or descheduled hands its share to the
//   others) instead of one static slice each, as DeepSpeed's `omp parallel for` and at::parallel_for do.
// The arithmetic is the scalar loop's, operation for operation (no fused multiply-add: the loop is memory-bound, so
// FMA would buy nothing measurable and would make the paths round differently). Tails shorter than a vector run the
// same vector code on a zero-padded copy, so every element of a tensor is computed by the same instructions.
//
// Parameters are the fp32 master (optionally copied to bf16/fp16 `out16` in the same pass) or 16-bit themselves
// (bf16/fp16, updated in fp32 and rounded once on store: DeepSpeedCPUAdam's layout for 16-bit params).

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <string>
#include <type_traits>

#include "adam.h"
#include "utils.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define HF_ZERO_ADAM_X86 1
#define HF_ZERO_TARGET_AVX2 __attribute__((target("avx2,f16c")))
#define HF_ZERO_TARGET_AVX512 __attribute__((target("avx512f,avx2,f16c")))
#endif

namespace hf_zero {
namespace {

// Elements per block that a thread takes from the shared counter: 512 KiB per fp32 stream, ~100 us of work, so
// the counter costs nothing and a thread that falls behind delays the step by at most one block. A multiple of
// 64, so no cache line is written by two threads.
constexpr int64_t kBlockElems = 1 << 17;
// Prefetch distance in elements: 2 KiB of fp32 ahead, half a page (measured at 1 and 2 threads: 256..1024 within
// noise of each other, 2048 and beyond slower; with no prefetch the loop stalls at every page).
constexpr int64_t kPrefetchElems = 512;
// L2 prefetch distance: 8 KiB of fp32 ahead, two pages, beyond what the L1 fill buffers can keep in flight
// (1024..4096 measured within noise of each other at 1 and 2 threads, fp32 and bf16; any of them 3-8% faster
// than the L1 prefetch alone at 1 thread).
constexpr int64_t kPrefetchL2Elems = 2048;

// The parameter needs no 16-bit copy.
struct NoCopy {};

template <typename O>
constexpr bool kHasCopy = !std::is_same_v<O, NoCopy>;

// ---------------------------------------------------------------- scalar (reference) path
//
// One contiguous chunk. A separate function (not the parallel_for lambda body) so that the pointers keep their
// __restrict qualification and the constants live in registers: captured by reference in a lambda, GCC must
// assume the stores to param may alias them and reloads them every iteration.
template <typename G, typename P, typename O>
void adam_chunk_scalar(P* __restrict param, const G* __restrict grad, float* __restrict exp_avg,
                       float* __restrict exp_avg_sq, O* __restrict out16, int64_t count, const AdamConstants c) {
  const float inv_grad_scale = c.inv_grad_scale;
  const float l2_decay = c.l2_decay;
  const float param_decay = c.param_decay;
  const float one_minus_beta1 = c.one_minus_beta1;
  const float beta2 = c.beta2;
  const float one_minus_beta2 = c.one_minus_beta2;
  const float inv_bc2_sqrt = c.inv_bc2_sqrt;
  const float eps = c.eps;
  const float step_size = c.step_size;
#pragma omp simd
  for (int64_t i = 0; i < count; ++i) {
    float p = to_float(param[i]);
    const float g = to_float(grad[i]) * inv_grad_scale + l2_decay * p;
    p *= param_decay;
    float m = exp_avg[i];
    m = m + one_minus_beta1 * (g - m);
    const float v = beta2 * exp_avg_sq[i] + one_minus_beta2 * (g * g);
    const float denom = std::sqrt(v) * inv_bc2_sqrt + eps;
    p = p - step_size * (m / denom);
    param[i] = from_float<P>(p);
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    if constexpr (kHasCopy<O>) {
      out16[i] = from_float<O>(p);
    }
  }
}

#ifdef HF_ZERO_ADAM_X86

// Runs `update` (one vector's worth, kWidth elements) on zero-padded copies of the last `count` < kWidth
// elements and copies the results back: tails take the vector path's exact arithmetic.
template <int64_t kWidth, typename G, typename P, typename O, typename Consts>
void vector_tail(P* param, const G* grad, float* exp_avg, float* exp_avg_sq, O* out16, int64_t count,
                 void (*update)(P*, const G*, float*, float*, O*, const Consts&), const Consts& k) {
  P pb[kWidth] = {};
  G gb[kWidth] = {};
  float mb[kWidth] = {};
  float vb[kWidth] = {};
  O ob[kWidth] = {};
  std::copy_n(param, count, pb);
  std::copy_n(grad, count, gb);
  std::copy_n(exp_avg, count, mb);
  std::copy_n(exp_avg_sq, count, vb);
  update(pb, gb, mb, vb, ob, k);
  std::copy_n(pb, count, param);
  std::copy_n(mb, count, exp_avg);
  std::copy_n(vb, count, exp_avg_sq);
  if constexpr (kHasCopy<O>) {
    std::copy_n(ob, count, out16);
  }
}

// always_inline: these have no target attribute, GCC may decline to inline them into the target-attributed chunks,
// and a call to a function that only prefetches has no visible effect, so it is deleted: the prefetches would
// silently vanish (they did, and the kernel fell to 0.91-0.99x DeepSpeed's).
// kHint: _MM_HINT_T0 or _MM_HINT_T1 (an enum in GCC's headers, an int in clang's: hence auto).
template <auto kHint, typename T>
__attribute__((always_inline)) inline void prefetch(const T* p) {
  _mm_prefetch(reinterpret_cast<const char*>(p), kHint);
}

// The four input streams' prefetches `distance` elements past element i, into the cache level kHint names
// (_MM_HINT_T0: L1, _MM_HINT_T1: L2); only called while i + distance is inside the chunk.
template <int64_t kDistance, auto kHint, typename G, typename P>
__attribute__((always_inline)) inline void prefetch_streams(const P* param, const G* grad, const float* exp_avg,
                                                            const float* exp_avg_sq, int64_t i) {
  const int64_t j = i + kDistance;
  prefetch<kHint>(param + j);
  prefetch<kHint>(grad + j);
  prefetch<kHint>(exp_avg + j);
  prefetch<kHint>(exp_avg_sq + j);
}

// Both prefetches for element i.
template <typename G, typename P>
__attribute__((always_inline)) inline void prefetch_l1_l2(const P* param, const G* grad, const float* exp_avg,
                                                          const float* exp_avg_sq, int64_t i) {
  prefetch_streams<kPrefetchL2Elems, _MM_HINT_T1>(param, grad, exp_avg, exp_avg_sq, i);
  prefetch_streams<kPrefetchElems, _MM_HINT_T0>(param, grad, exp_avg, exp_avg_sq, i);
}

// ---------------------------------------------------------------- AVX-512F path (16 lanes)
namespace avx512 {

constexpr int64_t kWidth = 16;

HF_ZERO_TARGET_AVX512 inline __m512 load(const float* x) { return _mm512_loadu_ps(x); }
HF_ZERO_TARGET_AVX512 inline __m512 load(const at::BFloat16* x) {  // bf16 is the top half of an fp32
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
HF_ZERO_TARGET_AVX512 inline __m512 load(const at::Half* x) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
}
HF_ZERO_TARGET_AVX512 inline void store(float* x, __m512 v) { _mm512_storeu_ps(x, v); }
HF_ZERO_TARGET_AVX512 inline void store(at::BFloat16* x, __m512 v) {
  // Round to nearest even as from_float<BFloat16>: add 0x7FFF plus the lowest kept bit, keep the top 16 bits;
  // NaN becomes the canonical quiet NaN 0x7FC0.
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(x), _mm512_cvtepi32_epi16(r));
}
HF_ZERO_TARGET_AVX512 inline void store(at::Half* x, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(x),
                      _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

struct Consts {
  __m512 inv_grad_scale, l2_decay, param_decay, one_minus_beta1, beta2, one_minus_beta2, inv_bc2_sqrt, eps,
      step_size;
};

// kWidth elements at the given pointers; the operations and their order are adam_chunk_scalar's.
template <typename G, typename P, typename O>
HF_ZERO_TARGET_AVX512 inline void update(P* param, const G* grad, float* exp_avg, float* exp_avg_sq, O* out16,
                                         const Consts& k) {
  __m512 p = load(param);
  const __m512 g = _mm512_add_ps(_mm512_mul_ps(load(grad), k.inv_grad_scale), _mm512_mul_ps(k.l2_decay, p));
  p = _mm512_mul_ps(p, k.param_decay);
  __m512 m = _mm512_loadu_ps(exp_avg);
  m = _mm512_add_ps(m, _mm512_mul_ps(k.one_minus_beta1, _mm512_sub_ps(g, m)));
  const __m512 v = _mm512_add_ps(_mm512_mul_ps(k.beta2, _mm512_loadu_ps(exp_avg_sq)),
                                 _mm512_mul_ps(k.one_minus_beta2, _mm512_mul_ps(g, g)));
  const __m512 denom = _mm512_add_ps(_mm512_mul_ps(_mm512_sqrt_ps(v), k.inv_bc2_sqrt), k.eps);
  p = _mm512_sub_ps(p, _mm512_mul_ps(k.step_size, _mm512_div_ps(m, denom)));
  store(param, p);
  _mm512_storeu_ps(exp_avg, m);
  _mm512_storeu_ps(exp_avg_sq, v);
  if constexpr (kHasCopy<O>) {
    store(out16, p);
  }
}

template <typename G, typename P, typename O>
HF_ZERO_TARGET_AVX512 void adam_chunk(P* __restrict param, const G* __restrict grad, float* __restrict exp_avg,
                                      float* __restrict exp_avg_sq, O* __restrict out16, int64_t count,
                                      const AdamConstants c) {
  const Consts k{_mm512_set1_ps(c.inv_grad_scale), _mm512_set1_ps(c.l2_decay), _mm512_set1_ps(c.param_decay),
                 _mm512_set1_ps(c.one_minus_beta1), _mm512_set1_ps(c.beta2), _mm512_set1_ps(c.one_minus_beta2),
                 _mm512_set1_ps(c.inv_bc2_sqrt), _mm512_set1_ps(c.eps), _mm512_set1_ps(c.step_size)};
  int64_t i = 0;
  // Both prefetches, then the L1 one alone for the last kPrefetchL2Elems, then none for the last kPrefetchElems
  // (no address past the arrays).
  for (; i + kWidth + kPrefetchL2Elems <= count; i += kWidth) {
    prefetch_l1_l2(param, grad, exp_avg, exp_avg_sq, i);
    update(param + i, grad + i, exp_avg + i, exp_avg_sq + i, kHasCopy<O> ? out16 + i : out16, k);
  }
  for (; i + kWidth + kPrefetchElems <= count; i += kWidth) {
    prefetch_streams<kPrefetchElems, _MM_HINT_T0>(param, grad, exp_avg, exp_avg_sq, i);
    update(param + i, grad + i, exp_avg + i, exp_avg_sq + i, kHasCopy<O> ? out16 + i : out16, k);
  }
  for (; i + kWidth <= count; i += kWidth) {
    update(param + i, grad + i, exp_avg + i, exp_avg_sq + i, kHasCopy<O> ? out16 + i : out16, k);
  }
  if (i < count) {
    vector_tail<kWidth>(param + i, grad + i, exp_avg + i, exp_avg_sq + i, kHasCopy<O> ? out16 + i : out16,
                        count - i, &update<G, P, O>, k);
  }
}

}  // namespace avx512

// ---------------------------------------------------------------- AVX2 path (8 lanes)
namespace avx2 {

constexpr int64_t kWidth = 8;

HF_ZERO_TARGET_AVX2 inline __m256 load(const float* x) { return _mm256_loadu_ps(x); }
HF_ZERO_TARGET_AVX2 inline __m256 load(const at::BFloat16* x) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
HF_ZERO_TARGET_AVX2 inline __m256 load(const at::Half* x) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
}
HF_ZERO_TARGET_AVX2 inline void store(float* x, __m256 v) { _mm256_storeu_ps(x, v); }
HF_ZERO_TARGET_AVX2 inline void store(at::BFloat16* x, __m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  // Eight 32-bit lanes (each <= 0xFFFF) to eight 16-bit ones: packus works per 128-bit half, the permute
  // gathers the two halves' results into the low 128 bits.
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(x), _mm256_castsi256_si128(packed));
}
HF_ZERO_TARGET_AVX2 inline void store(at::Half* x, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(x), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

struct Consts {
  __m256 inv_grad_scale, l2_decay, param_decay, one_minus_beta1, beta2, one_minus_beta2, inv_bc2_sqrt, eps,
      step_size;
};

template <typename G, typename P, typename O>
HF_ZERO_TARGET_AVX2 inline void update(P* param, const G* grad, float* exp_avg, float* exp_avg_sq, O* out16,
                                       const Consts& k) {
  __m256 p = load(param);
  const __m256 g = _mm256_add_ps(_mm256_mul_ps(load(grad), k.inv_grad_scale), _mm256_mul_ps(k.l2_decay, p));
  p = _mm256_mul_ps(p, k.param_decay);
  __m256 m = _mm256_loadu_ps(exp_avg);
  m = _mm256_add_ps(m, _mm256_mul_ps(k.one_minus_beta1, _mm256_sub_ps(g, m)));
  const __m256 v = _mm256_add_ps(_mm256_mul_ps(k.beta2, _mm256_loadu_ps(exp_avg_sq)),
                                 _mm256_mul_ps(k.one_minus_beta2, _mm256_mul_ps(g, g)));
  const __m256 denom = _mm256_add_ps(_mm256_mul_ps(_mm256_sqrt_ps(v), k.inv_bc2_sqrt), k.eps);
  p = _mm256_sub_ps(p, _mm256_mul_ps(k.step_size, _mm256_div_ps(m, denom)));
  store(param, p);
  _mm256_storeu_ps(exp_avg, m);
  _mm256_storeu_ps(exp_avg_sq, v);
  if constexpr (kHasCopy<O>) {
    store(out16, p);
  }
}

template <typename G, typename P, typename O>
HF_ZERO_TARGET_AVX2 void adam_chunk(P* __restrict param, const G* __restrict grad, float* __restrict exp_avg,
                                    float* __restrict exp_avg_sq, O* __restrict out16, int64_t count,
                                    const AdamConstants c) {
  const Consts k{_mm256_set1_ps(c.inv_grad_scale), _mm256_set1_ps(c.l2_decay), _mm256_set1_ps(c.param_decay),
                 _mm256_set1_ps(c.one_minus_beta1), _mm256_set1_ps(c.beta2), _mm256_set1_ps(c.one_minus_beta2),
                 _mm256_set1_ps(c.inv_bc2_sqrt), _mm256_set1_ps(c.eps), _mm256_set1_ps(c.step_size)};
  int64_t i = 0;
  for (; i + kWidth + kPrefetchL2Elems <= count; i += kWidth) {
    prefetch_l1_l2(param, grad, exp_avg, exp_avg_sq, i);
    update(param + i, grad + i, exp_avg + i, exp_avg_sq + i, kHasCopy<O> ? out16 + i : out16, k);
  }
  for (; i + kWidth + kPrefetchElems <= count; i += kWidth) {
    prefetch_streams<kPrefetchElems, _MM_HINT_T0>(param, grad, exp_avg, exp_avg_sq, i);
    update(param + i, grad + i, exp_avg + i, exp_avg_sq + i, kHasCopy<O> ? out16 + i : out16, k);
  }
  for (; i + kWidth <= count; i += kWidth) {
    update(param + i, grad + i, exp_avg + i, exp_avg_sq + i, kHasCopy<O> ? out16 + i : out16, k);
  }
  if (i < count) {
    vector_tail<kWidth>(param + i, grad + i, exp_avg + i, exp_avg_sq + i, kHasCopy<O> ? out16 + i : out16,
                        count - i, &update<G, P, O>, k);
  }
}

}  // namespace avx2

#endif  // HF_ZERO_ADAM_X86

// ---------------------------------------------------------------- path selection

enum class CpuIsa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

const char* isa_name(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kAvx512:
      return "avx512";
    case CpuIsa::kAvx2:
      return "avx2";
    default:
      return "scalar";
  }
}

// The widest path this CPU (and OS: libgcc checks the saved register state too) supports.
CpuIsa best_isa() {
#ifdef HF_ZERO_ADAM_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) {
    return CpuIsa::kAvx512;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c")) {
    return CpuIsa::kAvx2;
  }
#endif
  return CpuIsa::kScalar;
}

std::atomic<int>& active_isa() {
  static std::atomic<int> isa{static_cast<int>(best_isa())};
  return isa;
}

// hf_zero::adam_cpu_isa: which path the CPU Adam kernels use; a non-empty `isa` ("auto", "avx512", "avx2",
// "scalar") selects it first (tests use it to run every path the machine has). Returns the path now in use.
std::string adam_cpu_isa(const std::string& isa) {
  if (!isa.empty()) {
    CpuIsa want = CpuIsa::kScalar;
    if (isa == "auto") {
      want = best_isa();
    } else if (isa == "avx512") {
      want = CpuIsa::kAvx512;
    } else if (isa == "avx2") {
      want = CpuIsa::kAvx2;
    } else {
      TORCH_CHECK(isa == "scalar", "adam_cpu_isa: unknown path '", isa,
                  "'; use one of auto, avx512, avx2, scalar");
    }
    TORCH_CHECK(static_cast<int>(want) <= static_cast<int>(best_isa()), "adam_cpu_isa: this CPU has no ", isa,
                " (the widest it supports is ", isa_name(best_isa()), ")");
    active_isa().store(static_cast<int>(want));
  }
  return isa_name(static_cast<CpuIsa>(active_isa().load()));
}

template <typename G, typename P, typename O>
void adam_kernel(P* param, const G* grad, float* exp_avg, float* exp_avg_sq, O* out16, int64_t numel,
                 const AdamConstants c) {
  using Chunk = void (*)(P*, const G*, float*, float*, O*, int64_t, AdamConstants);
  Chunk chunk = adam_chunk_scalar<G, P, O>;
#ifdef HF_ZERO_ADAM_X86
  switch (static_cast<CpuIsa>(active_isa().load(std::memory_order_relaxed))) {
    case CpuIsa::kAvx512:
      chunk = avx512::adam_chunk<G, P, O>;
      break;
    case CpuIsa::kAvx2:
      chunk = avx2::adam_chunk<G, P, O>;
      break;
    default:
      break;
  }
#endif
  // Dynamic split: each thread pulls the next block from a shared counter until none is left, rather than
  // taking one fixed slice. Where every core is free the two are the same; where one thread is descheduled or
  // slowed (other processes, the training loop's own threads, an interrupt-heavy core), the others take over its
  // blocks instead of waiting for it: a static split waits for its slowest slice.
  const int64_t blocks = (numel + kBlockElems - 1) / kBlockElems;
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), blocks);
  if (workers <= 1) {
    // One thread walks the blocks in order anyway: one chunk keeps its prefetch streams running to the end of
    // the tensor instead of draining and restarting at every block boundary. Same per-element arithmetic.
    chunk(param, grad, exp_avg, exp_avg_sq, out16, numel, c);
    return;
  }
  std::atomic<int64_t> next_block{0};
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    for (int64_t b = next_block.fetch_add(1, std::memory_order_relaxed); b < blocks;
         b = next_block.fetch_add(1, std::memory_order_relaxed)) {
      const int64_t begin = b * kBlockElems;
      const int64_t count = std::min(kBlockElems, numel - begin);
      chunk(param + begin, grad + begin, exp_avg + begin, exp_avg_sq + begin,
            kHasCopy<O> ? out16 + begin : out16, count, c);
    }
  });
}

void check_state(const at::Tensor& t, const at::Tensor& param, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat, "adam_step: ", what, " must be float32, got ", t.scalar_type());
  TORCH_CHECK(t.numel() == param.numel(), "adam_step: ", what, " has ", t.numel(), " elements, param has ",
              param.numel());
  TORCH_CHECK(t.is_contiguous(), "adam_step: ", what, " must be contiguous");
  TORCH_CHECK(t.device() == param.device(), "adam_step: ", what, " is on ", t.device(), ", param on ",
              param.device());
}

template <typename G>
void dispatch_param(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                    const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& out16, const AdamConstants& c) {
  const G* g = grad.const_data_ptr<G>();
  float* m = exp_avg.mutable_data_ptr<float>();
  float* v = exp_avg_sq.mutable_data_ptr<float>();
  const int64_t numel = param.numel();
  NoCopy* none = nullptr;
  if (param.scalar_type() == at::kBFloat16) {
    adam_kernel<G>(param.mutable_data_ptr<at::BFloat16>(), g, m, v, none, numel, c);
  } else if (param.scalar_type() == at::kHalf) {
    adam_kernel<G>(param.mutable_data_ptr<at::Half>(), g, m, v, none, numel, c);
  } else if (!out16.has_value()) {
    adam_kernel<G>(param.mutable_data_ptr<float>(), g, m, v, none, numel, c);
  } else if (out16->scalar_type() == at::kBFloat16) {
    adam_kernel<G>(param.mutable_data_ptr<float>(), g, m, v, out16->mutable_data_ptr<at::BFloat16>(), numel, c);
  } else {
    adam_kernel<G>(param.mutable_data_ptr<float>(), g, m, v, out16->mutable_data_ptr<at::Half>(), numel, c);
  }
}

void adam_step_one(const at::Tensor& param, const at::Tensor& grad_in, const at::Tensor& exp_avg,
                   const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& out16, const AdamConstants& c) {
  check_float(param, "adam_step: param (the fp32 master, or a bf16/fp16 parameter updated in place)");
  TORCH_CHECK(param.is_contiguous(), "adam_step: param must be contiguous");
  check_float(grad_in, "adam_step: grad");
  TORCH_CHECK(grad_in.numel() == param.numel(), "adam_step: grad has ", grad_in.numel(), " elements, param has ",
              param.numel());
  check_state(exp_avg, param, "exp_avg");
  check_state(exp_avg_sq, param, "exp_avg_sq");
  if (out16.has_value()) {
    TORCH_CHECK(param.scalar_type() == at::kFloat, "adam_step: out16 is the 16-bit copy of an fp32 master param; "
                "param is ", param.scalar_type(), " (a 16-bit param is updated in place: pass out16=None)");
    TORCH_CHECK(out16->scalar_type() == at::kBFloat16 || out16->scalar_type() == at::kHalf,
                "adam_step: out16 must be bfloat16 or float16, got ", out16->scalar_type());
    TORCH_CHECK(out16->numel() == param.numel() && out16->is_contiguous(),
                "adam_step: out16 must be contiguous with param's number of elements");
  }
  const at::Tensor grad = grad_in.contiguous();
  switch (grad.scalar_type()) {
    case at::kFloat:
      dispatch_param<float>(param, grad, exp_avg, exp_avg_sq, out16, c);
      break;
    case at::kBFloat16:
      dispatch_param<at::BFloat16>(param, grad, exp_avg, exp_avg_sq, out16, c);
      break;
    default:
      dispatch_param<at::Half>(param, grad, exp_avg, exp_avg_sq, out16, c);
      break;
  }
}

void adam_step_cpu(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                   const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& out16, int64_t step, double lr,
                   double beta1, double beta2, double eps, double weight_decay, bool adamw_mode,
                   bool bias_correction, double grad_scale) {
  const AdamConstants c =
      make_adam_constants(step, lr, beta1, beta2, eps, weight_decay, adamw_mode, bias_correction, grad_scale);
  adam_step_one(param, grad, exp_avg, exp_avg_sq, out16, c);
}

void multi_tensor_adam_cpu(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                           at::TensorList exp_avg_sqs, int64_t step, double lr, double beta1, double beta2,
                           double eps, double weight_decay, bool adamw_mode, bool bias_correction,
                           double grad_scale) {
  TORCH_CHECK(params.size() == grads.size() && params.size() == exp_avgs.size() &&
                  params.size() == exp_avg_sqs.size(),
              "multi_tensor_adam: params, grads, exp_avgs and exp_avg_sqs must have the same length");
  const AdamConstants c =
      make_adam_constants(step, lr, beta1, beta2, eps, weight_decay, adamw_mode, bias_correction, grad_scale);
  for (size_t i = 0; i < params.size(); ++i) {
    adam_step_one(params[i], grads[i], exp_avgs[i], exp_avg_sqs[i], std::nullopt, c);
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hf_zero, m) {
  // Which SIMD path the CPU Adam kernels use ("avx512", "avx2", "scalar"); a non-empty argument selects one
  // first ("auto": the widest this CPU has). For tests and diagnostics; the default needs no call.
  m.def("adam_cpu_isa(str isa=\"\") -> str", &adam_cpu_isa);
}

TORCH_LIBRARY_IMPL(hf_zero, CPU, m) {
  m.impl("adam_step", &adam_step_cpu);
  m.impl("multi_tensor_adam", &multi_tensor_adam_cpu);
}

}  // namespace hf_zero
