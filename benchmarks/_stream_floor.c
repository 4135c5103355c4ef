/* The byte floor of an fp32 Adam step at one thread, for benchmarks/bench_cpu_adam.py (not part of hf_zero).
 *
 * One pass over four fp32 streams that reads param, grad, exp_avg and exp_avg_sq and writes param, exp_avg and
 * exp_avg_sq back, as an Adam step does (28 bytes per parameter), with the least arithmetic that still depends on
 * every loaded value (two multiply-adds and a square; no square root, no division) and the same two-distance
 * software prefetch as hf_zero's kernel (csrc/adam/adam_cpu.cpp), which was the fastest of the distances swept
 * for this pass. No Adam kernel can move these bytes faster than this loop on the same memory, so the bench prints
 * both optimizers' times against it: how far each is from what the memory allows.
 *
 * Built by the bench with the system C compiler (`cc -O3 -shared -fPIC`); AVX-512 when the CPU has it, else the
 * compiler's vectorization of the plain loop.
 */
#include <stddef.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

__attribute__((target("avx512f"))) static void pass_avx512(float* p, const float* g, float* m, float* v, size_t n) {
  const __m512 a = _mm512_set1_ps(0.9f), b = _mm512_set1_ps(0.999f), c = _mm512_set1_ps(1e-3f);
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    if (i + 2048 < n) {
      _mm_prefetch((const char*)(p + i + 2048), _MM_HINT_T1);
      _mm_prefetch((const char*)(g + i + 2048), _MM_HINT_T1);
      _mm_prefetch((const char*)(m + i + 2048), _MM_HINT_T1);
      _mm_prefetch((const char*)(v + i + 2048), _MM_HINT_T1);
    }
    if (i + 512 < n) {
      _mm_prefetch((const char*)(p + i + 512), _MM_HINT_T0);
      _mm_prefetch((const char*)(g + i + 512), _MM_HINT_T0);
      _mm_prefetch((const char*)(m + i + 512), _MM_HINT_T0);
      _mm_prefetch((const char*)(v + i + 512), _MM_HINT_T0);
    }
    const __m512 G = _mm512_loadu_ps(g + i);
    const __m512 M = _mm512_fmadd_ps(_mm512_loadu_ps(m + i), a, G);
    const __m512 V = _mm512_fmadd_ps(_mm512_loadu_ps(v + i), b, _mm512_mul_ps(G, G));
    _mm512_storeu_ps(p + i, _mm512_fmadd_ps(M, c, _mm512_loadu_ps(p + i)));
    _mm512_storeu_ps(m + i, M);
    _mm512_storeu_ps(v + i, V);
  }
  for (; i < n; ++i) {
    m[i] = m[i] * 0.9f + g[i];
    v[i] = v[i] * 0.999f + g[i] * g[i];
    p[i] += m[i] * 1e-3f;
  }
}
#endif

static void pass_plain(float* p, const float* g, float* m, float* v, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    m[i] = m[i] * 0.9f + g[i];
    v[i] = v[i] * 0.999f + g[i] * g[i];
    p[i] += m[i] * 1e-3f;
  }
}

/* Returns 512 when the AVX-512 pass ran, 0 for the plain loop. */
int stream_floor(float* p, const float* g, float* m, float* v, size_t n) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  if (__builtin_cpu_supports("avx512f")) {
    pass_avx512(p, g, m, v, n);
    return 512;
  }
#endif
  pass_plain(p, g, m, v, n);
  return 0;
}
