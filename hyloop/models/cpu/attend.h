// Decode attention of one kv head's query group over a row's visible pool columns, and the
// vector math around it (exp, SiLU, sums of squares), shared by hyloop::decode_attention and
// the decoder stack. Float32 math for every pool dtype; the AVX-512 paths are vectorised over
// head_dim, AVX2 ones over half vectors (two per 16 lanes), and portable loops compute the same
// bits otherwise.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
#include <immintrin.h>
#define HYLOOP_A512 1
#elif defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#define HYLOOP_A256 1
#endif

namespace hyloop::attend {

// The CPU numerics these functions define, each one written in torch ops too
// (``models/cpu/numerics.py``), bit for bit: every multiply and add is rounded on its own (the
// library is built with -ffp-contract=off, and nothing here calls a fused multiply-add), and
// every reduction runs in one stated order, the same in the AVX-512 and the portable code.
//
// - exp: n = round(x * log2(e)) (half to even), r = (x - n * C1) - n * C2, p(r) by Horner from
//   1/720 down to 1, then p * 2^n rounded once; x below LO gives 0, above HI is clamped.
// - a lane sum of v[0, n): 16 lanes, lane l the sequential sum from +0 of v[l], v[l + 16], ...
//   (zeros past n), then the tree (l, l + 8), (l, l + 4), (l, l + 2), (0, 1) (``tree16``).
constexpr float kLog2e = 0x1.715476p+0f, kC1 = 0x1.63p-1f, kC2 = -0x1.bd0106p-13f;
constexpr float kExpLo = -0x1.5d589ep+6f, kExpHi = 0x1.61814ap+6f;
constexpr float kP6 = 0x1.6c16c2p-10f, kP5 = 0x1.111112p-7f, kP4 = 0x1.555556p-5f,
                kP3 = 0x1.555556p-3f;  // 1/720, 1/120, 1/24, 1/6 in float32

// e^x for one value, the same steps as ``exp16``, branch-free so that loops of it vectorise:
// round to nearest even by adding and taking away 1.5 * 2^23 (exact for |v| < 2^22), and
// p * 2^n as two exact products by powers of two, the second of which rounds (n <= 128).
inline float pow2(int32_t e) {  // 2^e, e in [-126, 127]
  const uint32_t bits = static_cast<uint32_t>(e + 127) << 23;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline float exp1(float x) {
  const bool under = x < kExpLo;
  x = std::min(std::max(x, kExpLo), kExpHi);
  constexpr float kRound = 0x1.8p+23f;
  const float n = (x * kLog2e + kRound) - kRound;
  float r = x - n * kC1;
  r = r - n * kC2;
  float p = kP6;
  p = p * r + kP5;
  p = p * r + kP4;
  p = p * r + kP3;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t e = static_cast<int32_t>(n), e1 = std::min(e, 127);
  const float out = (p * pow2(e1)) * pow2(e - e1);
  return under ? 0.0f : out;
}

// The pool dtypes the vector paths load.
template <typename T>
constexpr bool kLoads =
    std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16> || std::is_same_v<T, c10::Half>;

// The fixed tree over 16 lanes.
inline float tree16(const float* a) {
  float t[8];
  for (int i = 0; i < 8; ++i) t[i] = a[i] + a[i + 8];
  for (int i = 0; i < 4; ++i) t[i] = t[i] + t[i + 4];
  for (int i = 0; i < 2; ++i) t[i] = t[i] + t[i + 2];
  return t[0] + t[1];
}

#ifdef HYLOOP_A512
inline __m512 exp16(__m512 x) {
  const __m512 lo = _mm512_set1_ps(kExpLo), hi = _mm512_set1_ps(kExpHi);
  const __mmask16 under = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  x = _mm512_min_ps(_mm512_max_ps(x, lo), hi);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(kC1)));
  r = _mm512_sub_ps(r, _mm512_mul_ps(n, _mm512_set1_ps(kC2)));
  __m512 p = _mm512_set1_ps(kP6);
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(kP5));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(kP4));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(kP3));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(0.5f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.0f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.0f));
  const __m512 out = _mm512_scalef_ps(p, n);
  return _mm512_mask_mov_ps(out, under, _mm512_setzero_ps());
}

// ``tree16`` on a vector.
inline float tree16(__m512 a) {
  const __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
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

#ifdef HYLOOP_A256
// ``exp16`` on 8 lanes.
inline __m256 exp8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(kExpLo), hi = _mm256_set1_ps(kExpHi);
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(kC1)));
  r = _mm256_sub_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(kC2)));
  __m256 p = _mm256_set1_ps(kP6);
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(kP5));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(kP4));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(kP3));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(0.5f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.0f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_cvtps_epi32(n), e1 = _mm256_min_epi32(e, _mm256_set1_epi32(127));
  const auto pow2 = [](__m256i k) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k, _mm256_set1_epi32(127)), 23));
  };
  const __m256 out = _mm256_mul_ps(_mm256_mul_ps(p, pow2(e1)), pow2(_mm256_sub_epi32(e, e1)));
  return _mm256_blendv_ps(out, _mm256_setzero_ps(), under);
}

// ``tree16`` over lanes 0-7 (a) and 8-15 (b).
inline float tree16(__m256 a, __m256 b) {
  const __m256 s8 = _mm256_add_ps(a, b);
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
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
#elif defined(HYLOOP_A256)
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(v + i, exp8(_mm256_loadu_ps(v + i)));
#endif
  for (; i < n; ++i) v[i] = exp1(v[i]);
}

// out[i] = x[i] / (1 + e^(0 - x[i])) (SiLU), i < n.
inline void silu(const float* x, float* out, int64_t n) {
  int64_t i = 0;
#ifdef HYLOOP_A512
  const __m512 one = _mm512_set1_ps(1.0f);
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), v));
    _mm512_storeu_ps(out + i, _mm512_div_ps(v, _mm512_add_ps(one, e)));
  }
#elif defined(HYLOOP_A256)
  const __m256 one = _mm256_set1_ps(1.0f);
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), v));
    _mm256_storeu_ps(out + i, _mm256_div_ps(v, _mm256_add_ps(one, e)));
  }
#endif
  for (; i < n; ++i) out[i] = x[i] / (1.0f + exp1(0.0f - x[i]));
}

// The lane sum of a[i] * b[i], i < n (a float32, b any of the pool dtypes).
template <typename T>
inline float dot(const float* a, const T* b, int64_t n) {
  int64_t i = 0;
#ifdef HYLOOP_A512
  if constexpr (kLoads<T>) {
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16)
      acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_loadu_ps(a + i), load16(b + i)));
    if (i < n) {  // the tail's lanes: their products, the rest +0
      float ta[16] = {}, tb[16] = {};
      for (int64_t j = i; j < n; ++j) {
        ta[j - i] = a[j];
        tb[j - i] = static_cast<float>(b[j]);
      }
      acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_loadu_ps(ta), _mm512_loadu_ps(tb)));
    }
    return tree16(acc);
  }
#elif defined(HYLOOP_A256)
  if constexpr (kLoads<T>) {
    __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();  // lanes 0-7, 8-15
    for (; i + 16 <= n; i += 16) {
      lo = _mm256_add_ps(lo, _mm256_mul_ps(_mm256_loadu_ps(a + i), load8(b + i)));
      hi = _mm256_add_ps(hi, _mm256_mul_ps(_mm256_loadu_ps(a + i + 8), load8(b + i + 8)));
    }
    if (i < n) {
      float ta[16] = {}, tb[16] = {};
      for (int64_t j = i; j < n; ++j) {
        ta[j - i] = a[j];
        tb[j - i] = static_cast<float>(b[j]);
      }
      lo = _mm256_add_ps(lo, _mm256_mul_ps(_mm256_loadu_ps(ta), _mm256_loadu_ps(tb)));
      hi = _mm256_add_ps(hi, _mm256_mul_ps(_mm256_loadu_ps(ta + 8), _mm256_loadu_ps(tb + 8)));
    }
    return tree16(lo, hi);
  }
#endif
  float lanes[16] = {};
  for (; i < n; i += 16)
    for (int64_t l = 0; l < 16 && i + l < n; ++l)
      lanes[l] = lanes[l] + a[i + l] * static_cast<float>(b[i + l]);
  return tree16(lanes);
}

// The lane sum of x[i]^2, i < n.
inline float sum_squares(const float* x, int64_t n) { return dot(x, x, n); }

// The query group of kv head `h` (`G` heads of `D` float32 values at q) over the visible
// columns of one row: column j reads pool slot slots[j] (rows of `k_row` / `v_row` elements,
// head h at h * D), is visible unless bias[j] is -inf, and adds bias[j] to its score.
// `scratch` holds G * (L + 1) floats. out[g * D + i] (float32) for each head g.
// With `self_slot` >= 0, the column at that slot reads `k_self` / `v_self` (the head's own new
// K/V, which another thread may be writing to the pool meanwhile: the same values).
// The numerics: a score is the lane sum of q * k, times scale, plus bias; the softmax takes the
// max, exp(score - max), and their sum from +0 column by column; the output is the sum from +0,
// column by column, of p * v per element, times 1 / that sum.
// Softmax of each of G heads' n scores (rows of `stride`) in place, their max taken away, e^
// of each, summed from +0 column by column: inv[g] = 1 / that sum.
inline void softmax_heads(float* scores, int64_t G, int64_t stride, int64_t n, float* inv) {
  for (int64_t g = 0; g < G; ++g) {
    float* sg = scores + g * stride;
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < n; ++j) mx = std::max(mx, sg[j]);
    for (int64_t j = 0; j < n; ++j) sg[j] -= mx;
    exp_inplace(sg, n);
    float total = 0.0f;
    for (int64_t j = 0; j < n; ++j) total += sg[j];
    inv[g] = 1.0f / total;
  }
}

#ifdef HYLOOP_A512
// ``tree16`` of 16 vectors at once: lane c of the result is tree16(a[c]). The same adds in the
// same pairs (lanes l and l + 8, then l and l + 4, l and l + 2, 0 and 1), on 16 scores a step.
inline __m512 tree16x16(const __m512* a) {
  __m512 l1[8], l2[4], l3[2];
  for (int m = 0; m < 8; ++m)  // column 2m's lanes i + (i + 8) in lanes 0-7, 2m + 1's in 8-15
    l1[m] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * m], a[2 * m + 1], 0x44),
                          _mm512_shuffle_f32x4(a[2 * m], a[2 * m + 1], 0xEE));
  for (int r = 0; r < 4; ++r)  // 128-bit lane k: column 4r + k's i + (i + 4)
    l2[r] = _mm512_add_ps(_mm512_shuffle_f32x4(l1[2 * r], l1[2 * r + 1], 0x88),
                          _mm512_shuffle_f32x4(l1[2 * r], l1[2 * r + 1], 0xDD));
  for (int s = 0; s < 2; ++s)  // lane k: columns 8s + k and 8s + 4 + k, i + (i + 2) each
    l3[s] = _mm512_add_ps(_mm512_shuffle_ps(l2[2 * s], l2[2 * s + 1], 0x44),
                          _mm512_shuffle_ps(l2[2 * s], l2[2 * s + 1], 0xEE));
  // element 4k + m: column k + 4m's 0 + 1; then into column order
  const __m512 f = _mm512_add_ps(_mm512_shuffle_ps(l3[0], l3[1], 0x88),
                                 _mm512_shuffle_ps(l3[0], l3[1], 0xDD));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, f);
}

// A pool row of zeros: the columns a last block of fewer than 16 reads past the visible ones
// (their scores are never stored), so that every block is 16 loads with no branch.
template <typename T>
inline const T* zero_row() {
  alignas(64) static const T zeros[128] = {};
  return zeros;
}

// Weighted values of HN heads (HN a compile-time count, so that their D sums and their
// weights' sums stay in registers: a run-time count left them in memory, each add waiting on the
// store before it): head r's weights are w[r][0, n) over value rows vs[0, n); each of its D
// sums, and beside them its weights' sum, runs from +0 column by column; then out[r] takes
// the sums times 1 / the weights' sum. ``Masked``: a column from ``every`` on adds to head r's
// sums only where bit shift[r] of sees[j] is set (a verify row that does not see it: its weight
// is +0, which its weights' sum takes, and its outputs' sums skip the column); the columns
// before ``every`` are seen by every head.
template <typename T, int NC, int HN, bool Masked>
inline void weigh16(const float* const* w, const T* const* vs, int64_t n, int64_t every,
                    const uint32_t* sees, const int64_t* shift, float* const* out) {
  __m512 acc[HN][NC];
  float total[HN];
#pragma GCC unroll 8
  for (int r = 0; r < HN; ++r) {
    total[r] = 0.0f;
    for (int i = 0; i < NC; ++i) acc[r][i] = _mm512_setzero_ps();
  }
  const int64_t all = Masked ? std::min(every, n) : n;
  for (int64_t j = 0; j < n; ++j) {
    __m512 v[NC];
#pragma GCC unroll 8
    for (int i = 0; i < NC; ++i) v[i] = load16(vs[j] + 16 * i);
#pragma GCC unroll 8
    for (int r = 0; r < HN; ++r) {
      const float p = w[r][j];
      total[r] = total[r] + p;
      const __m512 pv = _mm512_set1_ps(p);
      // every head sees the columns before ``all`` (a full mask adds as an unmasked add)
      const __mmask16 on =
          j < all ? static_cast<__mmask16>(0xFFFF)
                  : static_cast<__mmask16>(0u - ((sees[j] >> shift[r]) & 1u));
#pragma GCC unroll 8
      for (int i = 0; i < NC; ++i)
        acc[r][i] = _mm512_mask_add_ps(acc[r][i], on, acc[r][i], _mm512_mul_ps(pv, v[i]));
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < HN; ++r) {
    const __m512 iv = _mm512_set1_ps(1.0f / total[r]);
    for (int i = 0; i < NC; ++i) _mm512_storeu_ps(out[r] + 16 * i, _mm512_mul_ps(acc[r][i], iv));
  }
}

// ``weigh16`` for hn <= 16 / NC heads, hn known at run time.
template <typename T, int NC, bool Masked>
inline void weigh16_n(int64_t hn, const float* const* w, const T* const* vs, int64_t n,
                      int64_t every, const uint32_t* sees, const int64_t* shift,
                      float* const* out) {
  static_assert(NC == 4 || NC == 8);
  switch (hn) {
    case 1: weigh16<T, NC, 1, Masked>(w, vs, n, every, sees, shift, out); break;
    case 2: weigh16<T, NC, 2, Masked>(w, vs, n, every, sees, shift, out); break;
    case 3:
      if constexpr (NC == 4) weigh16<T, NC, 3, Masked>(w, vs, n, every, sees, shift, out);
      break;
    case 4:
      if constexpr (NC == 4) weigh16<T, NC, 4, Masked>(w, vs, n, every, sees, shift, out);
      break;
    default: break;
  }
}

// ``group`` for head_dim = 16 * NC on AVX-512: the same arithmetic in the same order, 16
// columns' scores reduced together (``tree16x16``) and each head's output summed in registers.
// A lane's sum starts at its first product, not at +0 + that product: the two differ only in
// the sign of a zero, and a score's zero sign changes nothing after it (a score's -0 or +0
// plus a bias of +0 is +0, and e^(s - max) is the same for either), so outputs keep their bits.
template <typename T, int NC>
void group16(const float* q, int64_t G, const T* kb, int64_t k_row, const T* vb, int64_t v_row,
             int64_t h, const int64_t* slots, const float* bias, int64_t L, float scale,
             float* scratch, float* out, int64_t self_slot, const T* k_self, const T* v_self) {
  constexpr int64_t D = 16 * NC;
  const float ninf = -std::numeric_limits<float>::infinity();
  thread_local std::vector<const T*> ks, vs;
  thread_local std::vector<float> bs;
  ks.resize(L + 16);
  vs.resize(L + 16);
  bs.resize(L + 16);
  int64_t n = 0;  // the visible columns, packed to the front
  for (int64_t j = 0; j < L; ++j) {
    if (bias[j] == ninf) continue;
    ks[n] = slots[j] == self_slot ? k_self : kb + slots[j] * k_row + h * D;
    vs[n] = slots[j] == self_slot ? v_self : vb + slots[j] * v_row + h * D;
    bs[n] = bias[j];
    ++n;
  }
  for (int64_t j = n; j < n + 16; ++j) ks[j] = zero_row<T>();
  constexpr int64_t lines = (D * static_cast<int64_t>(sizeof(T)) + 63) / 64;
  float* scores = scratch;  // [G][n]
  const __m512 sc = _mm512_set1_ps(scale), ninf16 = _mm512_set1_ps(ninf);
  // Each head's running max over its scores' lanes: a max is the same in any order (a NaN
  // score is passed over, as std::max(mx, s) does; +0 / -0 give the same e^(s - max)).
  thread_local std::vector<float> maxima;
  maxima.assign(16 * G, ninf);
  for (int64_t c0 = 0; c0 < n; c0 += 16) {
    const int64_t cn = std::min<int64_t>(16, n - c0);
    for (int64_t c = 0; c < cn; ++c) {  // the next block's K rows, this block's V rows
      if (c0 + 16 + c < n) {
        const char* ka = reinterpret_cast<const char*>(ks[c0 + 16 + c]);
        for (int64_t i = 0; i < lines; ++i) _mm_prefetch(ka + 64 * i, _MM_HINT_T0);
      }
      const char* va = reinterpret_cast<const char*>(vs[c0 + c]);
      for (int64_t i = 0; i < lines; ++i) _mm_prefetch(va + 64 * i, _MM_HINT_T1);
    }
    const __mmask16 live = static_cast<__mmask16>(cn == 16 ? 0xFFFF : (1u << cn) - 1);
    const __m512 bias16 = _mm512_maskz_loadu_ps(live, bs.data() + c0);
    const T* const* kc = ks.data() + c0;
    for (int64_t g = 0; g < G; ++g) {
      __m512 qv[NC];
      for (int i = 0; i < NC; ++i) qv[i] = _mm512_loadu_ps(q + g * D + 16 * i);
      __m512 acc[16];
#pragma GCC unroll 16
      for (int c = 0; c < 16; ++c) {
        const T* k = kc[c];
        acc[c] = _mm512_mul_ps(qv[0], load16(k));
#pragma GCC unroll 8
        for (int i = 1; i < NC; ++i)
          acc[c] = _mm512_add_ps(acc[c], _mm512_mul_ps(qv[i], load16(k + 16 * i)));
      }
      const __m512 s = _mm512_add_ps(_mm512_mul_ps(tree16x16(acc), sc), bias16);
      _mm512_mask_storeu_ps(scores + g * L + c0, live, s);
      float* m = maxima.data() + 16 * g;
      _mm512_storeu_ps(m, _mm512_max_ps(_mm512_mask_blend_ps(live, ninf16, s), _mm512_loadu_ps(m)));
    }
  }
  // e^(score - max) per head, as ``softmax_heads``; the sums from +0 are taken below.
  for (int64_t g = 0; g < G; ++g) {
    const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(_mm512_loadu_ps(maxima.data() + 16 * g)));
    float* sg = scores + g * L;
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) _mm512_storeu_ps(sg + j, exp16(_mm512_sub_ps(_mm512_loadu_ps(sg + j), mx)));
    if (j < n) {
      const __mmask16 m = static_cast<__mmask16>((1u << (n - j)) - 1);
      _mm512_mask_storeu_ps(sg + j, m, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, sg + j), mx)));
    }
  }
  // Weighted values: each head's D sums from +0 in registers, column by column, and beside
  // them its weights' sum from +0 (the softmax's denominator), column by column.
  constexpr int64_t HB = 16 / NC;  // heads a pass holds
  for (int64_t g0 = 0; g0 < G; g0 += HB) {
    const int64_t hb = std::min<int64_t>(HB, G - g0);
    const float* w[HB];
    float* o[HB];
    for (int64_t g = 0; g < hb; ++g) {
      w[g] = scores + (g0 + g) * L;
      o[g] = out + (g0 + g) * D;
    }
    weigh16_n<T, NC, false>(hb, w, vs.data(), n, n, nullptr, nullptr, o);
  }
}
#endif

#ifdef HYLOOP_A512
// ``group16`` for the query groups of P rows of one request at once (a verify step's positions,
// P <= 32), whose columns read the same pool slots (`slots`) and whose visibility and biases are
// each row's own (`biases[i]`, L each): the columns any row sees are read once for all of them,
// their K/V streamed from memory while the P * G heads' arithmetic runs, where one row's
// group leaves the core waiting on memory. Row i's heads are q + i * G * D, its outputs out[i].
// Each row's arithmetic is ``group16``'s for it alone, in the same order: the columns it sees
// are the union's, in the union's order; each column it does not see has score -inf (e^ of it is
// +0, so its softmax sum takes +0 and keeps its bits) and is masked out of its outputs' sums.
template <typename T, int NC>
void rows16(const float* q, int64_t P, int64_t G, const T* kb, int64_t k_row, const T* vb,
            int64_t v_row, int64_t h, const int64_t* slots, const float* const* biases,
            int64_t L, float scale, float* scratch, float* const* out) {
  constexpr int64_t D = 16 * NC;
  const float ninf = -std::numeric_limits<float>::infinity();
  thread_local std::vector<const T*> ks, vs;
  thread_local std::vector<float> bs;      // [P][n]: each row's bias of each union column
  thread_local std::vector<uint32_t> sees;  // [n]: bit i, row i sees the column
  ks.resize(L + 16);
  vs.resize(L + 16);
  sees.resize(L + 16);
  bs.resize(P * (L + 16));
  int64_t n = 0;
  int64_t every = -1;  // the leading union columns that every row sees
  const uint32_t all = P == 32 ? ~0u : (1u << P) - 1;
  for (int64_t j = 0; j < L; ++j) {
    uint32_t bits = 0;
    for (int64_t i = 0; i < P; ++i) bits |= static_cast<uint32_t>(biases[i][j] != ninf) << i;
    if (bits == 0) continue;
    if (bits != all && every < 0) every = n;
    ks[n] = kb + slots[j] * k_row + h * D;
    vs[n] = vb + slots[j] * v_row + h * D;
    sees[n] = bits;
    for (int64_t i = 0; i < P; ++i) bs[i * (L + 16) + n] = biases[i][j];
    ++n;
  }
  if (every < 0) every = n;
  for (int64_t j = n; j < n + 16; ++j) {
    ks[j] = zero_row<T>();
    sees[j] = 0;
  }
  constexpr int64_t lines = (D * static_cast<int64_t>(sizeof(T)) + 63) / 64;
  const int64_t H = P * G;  // the heads, row-major: head r = i * G + g
  float* scores = scratch;  // [H][n]
  const __m512 sc = _mm512_set1_ps(scale), ninf16 = _mm512_set1_ps(ninf);
  thread_local std::vector<float> maxima;
  maxima.assign(16 * H, ninf);
  for (int64_t c0 = 0; c0 < n; c0 += 16) {
    const int64_t cn = std::min<int64_t>(16, n - c0);
    for (int64_t c = 0; c < cn; ++c) {
      if (c0 + 16 + c < n) {
        const char* ka = reinterpret_cast<const char*>(ks[c0 + 16 + c]);
        for (int64_t i = 0; i < lines; ++i) _mm_prefetch(ka + 64 * i, _MM_HINT_T0);
      }
      const char* va = reinterpret_cast<const char*>(vs[c0 + c]);
      for (int64_t i = 0; i < lines; ++i) _mm_prefetch(va + 64 * i, _MM_HINT_T1);
    }
    const __mmask16 live = static_cast<__mmask16>(cn == 16 ? 0xFFFF : (1u << cn) - 1);
    const T* const* kc = ks.data() + c0;
    for (int64_t i = 0; i < P; ++i) {
      __mmask16 seen = 0;
      for (int64_t c = 0; c < cn; ++c) seen |= static_cast<__mmask16>(((sees[c0 + c] >> i) & 1u) << c);
      const __m512 bias16 = _mm512_maskz_loadu_ps(live, bs.data() + i * (L + 16) + c0);
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = q + (i * G + g) * D;
        __m512 qv[NC];
        for (int k = 0; k < NC; ++k) qv[k] = _mm512_loadu_ps(qg + 16 * k);
        __m512 acc[16];
#pragma GCC unroll 16
        for (int c = 0; c < 16; ++c) {
          const T* k = kc[c];
          acc[c] = _mm512_mul_ps(qv[0], load16(k));
#pragma GCC unroll 8
          for (int m = 1; m < NC; ++m)
            acc[c] = _mm512_add_ps(acc[c], _mm512_mul_ps(qv[m], load16(k + 16 * m)));
        }
        __m512 s = _mm512_add_ps(_mm512_mul_ps(tree16x16(acc), sc), bias16);
        s = _mm512_mask_blend_ps(seen, ninf16, s);
        const int64_t r = i * G + g;
        _mm512_mask_storeu_ps(scores + r * L + c0, live, s);
        float* m = maxima.data() + 16 * r;
        _mm512_storeu_ps(m, _mm512_max_ps(_mm512_mask_blend_ps(live, ninf16, s), _mm512_loadu_ps(m)));
      }
    }
  }
  for (int64_t r = 0; r < H; ++r) {
    const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(_mm512_loadu_ps(maxima.data() + 16 * r)));
    float* sg = scores + r * L;
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) _mm512_storeu_ps(sg + j, exp16(_mm512_sub_ps(_mm512_loadu_ps(sg + j), mx)));
    if (j < n) {
      const __mmask16 m = static_cast<__mmask16>((1u << (n - j)) - 1);
      _mm512_mask_storeu_ps(sg + j, m, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, sg + j), mx)));
    }
  }
  constexpr int64_t HB = 16 / NC;
  for (int64_t r0 = 0; r0 < H; r0 += HB) {
    const int64_t hb = std::min<int64_t>(HB, H - r0);
    const float* w[HB];
    float* o[HB];
    int64_t row[HB];
    for (int64_t r = 0; r < hb; ++r) {
      row[r] = (r0 + r) / G;
      w[r] = scores + (r0 + r) * L;  // +0 where its row does not see column j
      o[r] = out[row[r]] + ((r0 + r) % G) * D;
    }
    weigh16_n<T, NC, true>(hb, w, vs.data(), n, every, sees.data(), row, o);
  }
}
#endif

// ``rows16`` where this build and the head size have it (AVX-512, head_dim 64 or 128, a pool
// dtype it loads, at most 32 rows); false otherwise (the caller runs each row's ``group``).
template <typename T>
bool group_rows(const float* q, int64_t P, int64_t G, int64_t D, const T* kb, int64_t k_row,
                const T* vb, int64_t v_row, int64_t h, const int64_t* slots,
                const float* const* biases, int64_t L, float scale, float* scratch,
                float* const* out) {
#ifdef HYLOOP_A512
  if constexpr (kLoads<T>) {
    if (P > 32) return false;
    if (D == 64) {
      rows16<T, 4>(q, P, G, kb, k_row, vb, v_row, h, slots, biases, L, scale, scratch, out);
      return true;
    }
    if (D == 128) {
      rows16<T, 8>(q, P, G, kb, k_row, vb, v_row, h, slots, biases, L, scale, scratch, out);
      return true;
    }
  }
#endif
  return false;
}

template <typename T>
void group(const float* q, int64_t G, int64_t D, const T* kb, int64_t k_row, const T* vb,
           int64_t v_row, int64_t h, const int64_t* slots, const float* bias, int64_t L,
           float scale, float* scratch, float* out, int64_t self_slot = -1,
           const T* k_self = nullptr, const T* v_self = nullptr) {
#ifdef HYLOOP_A512
  if constexpr (kLoads<T>) {
    if (D == 64) {
      group16<T, 4>(q, G, kb, k_row, vb, v_row, h, slots, bias, L, scale, scratch, out,
                    self_slot, k_self, v_self);
      return;
    }
    if (D == 128) {
      group16<T, 8>(q, G, kb, k_row, vb, v_row, h, slots, bias, L, scale, scratch, out,
                    self_slot, k_self, v_self);
      return;
    }
  }
#endif
  const float ninf = -std::numeric_limits<float>::infinity();
  float* scores = scratch;  // [G][n]
  int64_t n = 0;
  // Scores, visible columns only (packed to the front). The pool rows are scattered: K rows
  // are fetched kAhead columns early, and each column's V row while its K row is read.
  constexpr int64_t kAhead = 8;
  const int64_t lines = (D * static_cast<int64_t>(sizeof(T)) + 63) / 64;
  for (int64_t j = 0; j < L; ++j) {
    if (bias[j] == ninf) continue;
    const T* k = slots[j] == self_slot ? k_self : kb + slots[j] * k_row + h * D;
#if defined(HYLOOP_A512) || defined(HYLOOP_A256)
    if (j + kAhead < L) {
      const char* ka = reinterpret_cast<const char*>(kb + slots[j + kAhead] * k_row + h * D);
      for (int64_t c = 0; c < lines; ++c) _mm_prefetch(ka + 64 * c, _MM_HINT_T0);
    }
    const char* va = reinterpret_cast<const char*>(vb + slots[j] * v_row + h * D);
    for (int64_t c = 0; c < lines; ++c) _mm_prefetch(va + 64 * c, _MM_HINT_T1);
#endif
    for (int64_t g = 0; g < G; ++g) {
      const float s = dot(q + g * D, k, D);
      scores[g * L + n] = s * scale + bias[j];
    }
    ++n;
  }
  // Softmax per head.
  float* inv = scratch + G * L;
  softmax_heads(scores, G, L, n, inv);
  // Weighted values.
  std::fill(out, out + G * D, 0.0f);
  int64_t col = 0;
  for (int64_t j = 0; j < L; ++j) {
    if (bias[j] == ninf) continue;
    const T* v = slots[j] == self_slot ? v_self : vb + slots[j] * v_row + h * D;
    for (int64_t g = 0; g < G; ++g) {
      const float p = scores[g * L + col];
      float* o = out + g * D;
      int64_t i = 0;
#ifdef HYLOOP_A512
      if constexpr (kLoads<T>) {
        const __m512 pv = _mm512_set1_ps(p);
        for (; i + 16 <= D; i += 16)
          _mm512_storeu_ps(o + i, _mm512_add_ps(_mm512_loadu_ps(o + i),
                                                _mm512_mul_ps(pv, load16(v + i))));
      }
#elif defined(HYLOOP_A256)
      if constexpr (kLoads<T>) {
        const __m256 pv = _mm256_set1_ps(p);
        for (; i + 8 <= D; i += 8)
          _mm256_storeu_ps(o + i, _mm256_add_ps(_mm256_loadu_ps(o + i),
                                                _mm256_mul_ps(pv, load8(v + i))));
      }
#endif
      for (; i < D; ++i) o[i] = o[i] + p * static_cast<float>(v[i]);
    }
    ++col;
  }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t i = 0; i < D; ++i) out[g * D + i] *= inv[g];
}

}  // namespace hyloop::attend
