// Decode attention of one kv head's query group over a row's visible pool columns, and the
// vector math around it (exp, SiLU, sums of squares), shared by hyloop::decode_attention and
// the decoder stack. Float32 math for every pool dtype; the AVX-512 paths are vectorised over
// head_dim (any multiple of 16), and portable loops compute the same otherwise.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
#include <immintrin.h>
#define HYLOOP_A512 1
#endif

namespace hyloop::attend {

#ifdef HYLOOP_A512
// e^x for 16 lanes: 2^n * p(r), n = round(x / ln 2), r = x - n ln 2 in two parts, p a degree-6
// polynomial (relative error ~2e-7); lanes below -87.3 give 0.
inline __m512 exp16(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.33654f), hi = _mm512_set1_ps(88.37626f);
  const __mmask16 under = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  x = _mm512_min_ps(_mm512_max_ps(x, lo), hi);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  const __m512 out = _mm512_scalef_ps(p, n);
  return _mm512_mask_mov_ps(out, under, _mm512_setzero_ps());
}

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#endif

// v[i] = e^v[i], i < n.
inline void exp_inplace(float* v, int64_t n) {
  int64_t i = 0;
#ifdef HYLOOP_A512
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(v + i, exp16(_mm512_loadu_ps(v + i)));
  if (i < n) {
    const __mmask16 m = static_cast<__mmask16>((1u << (n - i)) - 1);
    _mm512_mask_storeu_ps(v + i, m, exp16(_mm512_maskz_loadu_ps(m, v + i)));
    return;
  }
#endif
  for (; i < n; ++i) v[i] = std::exp(v[i]);
}

// out[i] = x[i] / (1 + e^-x[i]) (SiLU), i < n.
inline void silu(const float* x, float* out, int64_t n) {
  int64_t i = 0;
#ifdef HYLOOP_A512
  const __m512 one = _mm512_set1_ps(1.0f);
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), v));
    _mm512_storeu_ps(out + i, _mm512_div_ps(v, _mm512_add_ps(one, e)));
  }
#endif
  for (; i < n; ++i) out[i] = x[i] / (1.0f + std::exp(-x[i]));
}

// sum of x[i]^2, i < n.
inline float sum_squares(const float* x, int64_t n) {
  int64_t i = 0;
  float s = 0.0f;
#ifdef HYLOOP_A512
  __m512 a = _mm512_setzero_ps(), b = _mm512_setzero_ps();
  for (; i + 32 <= n; i += 32) {
    const __m512 u = _mm512_loadu_ps(x + i), v = _mm512_loadu_ps(x + i + 16);
    a = _mm512_fmadd_ps(u, u, a);
    b = _mm512_fmadd_ps(v, v, b);
  }
  for (; i + 16 <= n; i += 16) {
    const __m512 u = _mm512_loadu_ps(x + i);
    a = _mm512_fmadd_ps(u, u, a);
  }
  s = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
#endif
  for (; i < n; ++i) s += x[i] * x[i];
  return s;
}

// The query group of kv head `h` (`G` heads of `D` float32 values at q) over the visible
// columns of one row: column j reads pool slot slots[j] (rows of `k_row` / `v_row` elements,
// head h at h * D), is visible unless bias[j] is -inf, and adds bias[j] to its score.
// `scratch` holds G * (L + 1) floats. out[g * D + i] (float32) for each head g.
// With `self_slot` >= 0, the column at that slot reads `k_self` / `v_self` (the head's own new
// K/V, which another thread may be writing to the pool meanwhile: the same values).
template <typename T>
void group(const float* q, int64_t G, int64_t D, const T* kb, int64_t k_row, const T* vb,
           int64_t v_row, int64_t h, const int64_t* slots, const float* bias, int64_t L,
           float scale, float* scratch, float* out, int64_t self_slot = -1,
           const T* k_self = nullptr, const T* v_self = nullptr) {
  const float ninf = -std::numeric_limits<float>::infinity();
  float* scores = scratch;  // [G][n]
  int64_t n = 0;
#ifdef HYLOOP_A512
  constexpr bool kLoads = std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16> ||
                          std::is_same_v<T, c10::Half>;
  const bool vec = kLoads && D % 16 == 0;
#else
  const bool vec = false;
#endif
  // Scores, visible columns only (packed to the front). The pool rows are scattered: K rows
  // are fetched kAhead columns early, and each column's V row while its K row is read.
  constexpr int64_t kAhead = 8;
  const int64_t lines = (D * static_cast<int64_t>(sizeof(T)) + 63) / 64;
  for (int64_t j = 0; j < L; ++j) {
    if (bias[j] == ninf) continue;
    const T* k = slots[j] == self_slot ? k_self : kb + slots[j] * k_row + h * D;
#ifdef HYLOOP_A512
    if (j + kAhead < L) {
      const char* ka = reinterpret_cast<const char*>(kb + slots[j + kAhead] * k_row + h * D);
      for (int64_t c = 0; c < lines; ++c) _mm_prefetch(ka + 64 * c, _MM_HINT_T0);
    }
    const char* va = reinterpret_cast<const char*>(vb + slots[j] * v_row + h * D);
    for (int64_t c = 0; c < lines; ++c) _mm_prefetch(va + 64 * c, _MM_HINT_T1);
#endif
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = q + g * D;
      float s = 0.0f;
#ifdef HYLOOP_A512
      if constexpr (kLoads) {
        if (vec) {
          __m512 acc = _mm512_setzero_ps();
          for (int64_t i = 0; i < D; i += 16)
            acc = _mm512_fmadd_ps(_mm512_loadu_ps(qg + i), load16(k + i), acc);
          s = _mm512_reduce_add_ps(acc);
        }
      }
#endif
      if (!vec) {
        for (int64_t i = 0; i < D; ++i) s += qg[i] * static_cast<float>(k[i]);
      }
      scores[g * L + n] = s * scale + bias[j];
    }
    ++n;
  }
  // Softmax per head.
  float* inv = scratch + G * L;
  for (int64_t g = 0; g < G; ++g) {
    float* sg = scores + g * L;
    float mx = ninf;
    for (int64_t j = 0; j < n; ++j) mx = std::max(mx, sg[j]);
    for (int64_t j = 0; j < n; ++j) sg[j] -= mx;
    exp_inplace(sg, n);
    float total = 0.0f;
    for (int64_t j = 0; j < n; ++j) total += sg[j];
    inv[g] = 1.0f / total;
  }
  // Weighted values.
  std::fill(out, out + G * D, 0.0f);
  int64_t col = 0;
  for (int64_t j = 0; j < L; ++j) {
    if (bias[j] == ninf) continue;
    const T* v = slots[j] == self_slot ? v_self : vb + slots[j] * v_row + h * D;
    for (int64_t g = 0; g < G; ++g) {
      const float p = scores[g * L + col];
      float* o = out + g * D;
#ifdef HYLOOP_A512
      if constexpr (kLoads) {
        if (vec) {
          const __m512 pv = _mm512_set1_ps(p);
          for (int64_t i = 0; i < D; i += 16)
            _mm512_storeu_ps(o + i, _mm512_fmadd_ps(pv, load16(v + i), _mm512_loadu_ps(o + i)));
          continue;
        }
      }
#endif
      for (int64_t i = 0; i < D; ++i) o[i] += p * static_cast<float>(v[i]);
    }
    ++col;
  }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t i = 0; i < D; ++i) out[g * D + i] *= inv[g];
}

}  // namespace hyloop::attend
