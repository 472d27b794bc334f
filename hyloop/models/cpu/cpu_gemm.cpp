// hyloop's few-row GEMMs (cpu_ops.py gives each op's contract): a decode step multiplies 1 to a
// few dozen rows by each weight, so the weight streams from memory once and its arithmetic is
// light. These kernels read each weight tile once for every row of the call, convert bfloat16 /
// int4 / int8 weights to float32 in registers (no dense copy), and accumulate in float32.
//
// The AVX2 + FMA paths run where the compiler targets them (-march=native); elsewhere the same
// loops run in portable C++. Work is split over output columns: one chunk per thread.

#include <ATen/Parallel.h>

#include "cpu_pool.h"
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cmath>
#include <optional>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HYLOOP_AVX2 1
#endif

namespace {

// ------------------------------------------------------------------ weight loads (8 lanes)

#ifdef HYLOOP_AVX2
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// The rows of x as float32 (a bfloat16 x is converted once per call, not per weight tile).
at::Tensor rows_as_float(const at::Tensor& x, int64_t K) {
  return x.reshape({-1, K}).to(at::kFloat).contiguous();
}

at::Tensor finish(const at::Tensor& out, const at::Tensor& x, int64_t N,
                  const std::optional<at::Tensor>& bias) {
  at::Tensor y = out;
  if (bias.has_value() && bias->defined()) y = y.add_(bias->to(at::kFloat));
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  return y.to(x.scalar_type()).view(shape);
}

// ------------------------------------------------------------------ dense: fp32 / bf16 weights

// MT rows of x against NT weight rows: MT * NT accumulators, each weight vector loaded once and
// used by every row.
template <int MT, int NT, typename W>
inline void dense_tile(const float* x, int64_t ldx, const W* w, int64_t ldw, int64_t K,
                       float* out, int64_t ldo, bool accumulate) {
  int64_t k = 0;
  float acc_s[MT][NT] = {};
#ifdef HYLOOP_AVX2
  __m256 acc[MT][NT];
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n) acc[m][n] = _mm256_setzero_ps();
  for (; k + 8 <= K; k += 8) {
    __m256 wv[NT];
    for (int n = 0; n < NT; ++n) wv[n] = load8(w + n * ldw + k);
    for (int m = 0; m < MT; ++m) {
      const __m256 xv = _mm256_loadu_ps(x + m * ldx + k);
      for (int n = 0; n < NT; ++n) acc[m][n] = _mm256_fmadd_ps(xv, wv[n], acc[m][n]);
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n) acc_s[m][n] = hsum(acc[m][n]);
#endif
  for (; k < K; ++k)
    for (int m = 0; m < MT; ++m)
      for (int n = 0; n < NT; ++n)
        acc_s[m][n] += x[m * ldx + k] * static_cast<float>(w[n * ldw + k]);
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n) {
      float& o = out[m * ldo + n];
      o = accumulate ? o + acc_s[m][n] : acc_s[m][n];
    }
}

// Every row against NT weight rows, in column blocks of kKBlock: the rows' block of x stays in
// L1 while each of their 4-row groups passes over the weight tile's block.
constexpr int64_t kKBlock = 256;

template <int NT, typename W>
inline void dense_rows(const float* x, int64_t M, int64_t K, const W* w, float* out, int64_t N) {
  for (int64_t k0 = 0; k0 < K; k0 += kKBlock) {
    const int64_t kb = std::min(kKBlock, K - k0);
    const bool acc = k0 > 0;
    const float* xk = x + k0;
    const W* wk = w + k0;
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) dense_tile<4, NT>(xk + m * K, K, wk, K, kb, out + m * N, N, acc);
    switch (M - m) {
      case 3: dense_tile<3, NT>(xk + m * K, K, wk, K, kb, out + m * N, N, acc); break;
      case 2: dense_tile<2, NT>(xk + m * K, K, wk, K, kb, out + m * N, N, acc); break;
      case 1: dense_tile<1, NT>(xk + m * K, K, wk, K, kb, out + m * N, N, acc); break;
      default: break;
    }
  }
}

template <typename W>
void dense_gemm(const float* x, int64_t M, int64_t K, const W* w, int64_t N, float* out) {
  // One row: more columns per tile keep more FMA chains in flight; more rows: 4 x 3 tiles.
  constexpr int64_t kTileOne = 6, kTile = 3;
  const int64_t tile = M == 1 ? kTileOne : kTile;
  const int64_t tiles = (N + tile - 1) / tile;
  hyloop::parallel_chunks(tiles, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * tile, nt = std::min(tile, N - n0);
      const W* wt = w + n0 * K;
      float* o = out + n0;
      if (nt == tile && M == 1) {
        dense_tile<1, kTileOne>(x, K, wt, K, K, o, N, false);
      } else if (nt == tile) {
        dense_rows<kTile>(x, M, K, wt, o, N);
      } else {
        for (int64_t n = 0; n < nt; ++n) dense_rows<1>(x, M, K, wt + n * K, o + n, N);
      }
    }
  });
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define HYLOOP_BF16_DP 1
// ------------------------------------------------------------------ bf16 x bf16 (AVX-512 BF16)

// bfloat16 rows against bfloat16 weights with vdpbf16ps: each instruction multiplies 32 pairs
// exactly and adds them into 16 float32 lanes, reading the weights as they lie (no conversion).
// MT rows of x against NT weight rows, a K tail by masked loads.
// ``next`` (if set) is the next tile's weights: each step prefetches NT of its cache lines, so
// the tile after this one is in cache when it starts (a row of a few hundred columns is too
// short a stream for the hardware prefetcher to ramp up on).
template <int MT, int NT>
inline void bf16_tile(const c10::BFloat16* x, int64_t K, const c10::BFloat16* w, float* out,
                      int64_t ldo, const c10::BFloat16* next = nullptr) {
  __m512 acc[MT][NT];
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n) acc[m][n] = _mm512_setzero_ps();
  const char* pf = reinterpret_cast<const char*>(next);
  for (int64_t k = 0; k < K; k += 32) {
    if (pf != nullptr) {
      for (int n = 0; n < NT; ++n) _mm_prefetch(pf + (k / 32 * NT + n) * 64, _MM_HINT_T0);
    }
    const __mmask32 mask = K - k >= 32 ? ~__mmask32{0} : (__mmask32{1} << (K - k)) - 1;
    __m512i wv[NT];
    for (int n = 0; n < NT; ++n) wv[n] = _mm512_maskz_loadu_epi16(mask, w + n * K + k);
    for (int m = 0; m < MT; ++m) {
      const __m512i xv = _mm512_maskz_loadu_epi16(mask, x + m * K + k);
      for (int n = 0; n < NT; ++n)
        acc[m][n] = _mm512_dpbf16_ps(acc[m][n], (__m512bh)xv, (__m512bh)wv[n]);
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n) out[m * ldo + n] = _mm512_reduce_add_ps(acc[m][n]);
}

template <int NT>
inline void bf16_rows(const c10::BFloat16* x, int64_t M, int64_t K, const c10::BFloat16* w,
                      float* out, int64_t N) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) bf16_tile<4, NT>(x + m * K, K, w, out + m * N, N);
  switch (M - m) {
    case 3: bf16_tile<3, NT>(x + m * K, K, w, out + m * N, N); break;
    case 2: bf16_tile<2, NT>(x + m * K, K, w, out + m * N, N); break;
    case 1: bf16_tile<1, NT>(x + m * K, K, w, out + m * N, N); break;
    default: break;
  }
}

// Tiles of 8 weight rows for one row of x (eight streams in flight), 4 x 4 for more rows (the
// weight tile stays in L1 while every 4-row group of x passes over it).
void bf16_gemm(const c10::BFloat16* x, int64_t M, int64_t K, const c10::BFloat16* w, int64_t N,
               float* out) {
  const int64_t tile = M == 1 ? 8 : 4;
  const int64_t tiles = (N + tile - 1) / tile;
  hyloop::parallel_chunks(tiles, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * tile, nt = std::min(tile, N - n0);
      const c10::BFloat16* wt = w + n0 * K;
      if (nt == 8) {
        bf16_tile<1, 8>(x, K, wt, out + n0, N, t + 1 < end ? wt + 8 * K : nullptr);
      } else if (nt == 4) {
        bf16_rows<4>(x, M, K, wt, out + n0, N);
      } else {
        for (int64_t n = 0; n < nt; ++n) bf16_rows<1>(x, M, K, wt + n * K, out + n0 + n, N);
      }
    }
  });
}
#endif

at::Tensor small_gemm(const at::Tensor& x, const at::Tensor& weight,
                      const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "small_gemm: weight [N, K] contiguous");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(x.size(-1) == K, "small_gemm: x has ", x.size(-1), " columns, weight ", K);
#ifdef HYLOOP_BF16_DP
  if (weight.scalar_type() == at::kBFloat16 && x.scalar_type() == at::kBFloat16) {
    const at::Tensor xb = x.reshape({-1, K}).contiguous();
    at::Tensor out = at::empty({xb.size(0), N}, xb.options().dtype(at::kFloat));
    bf16_gemm(xb.const_data_ptr<c10::BFloat16>(), xb.size(0), K,
              weight.const_data_ptr<c10::BFloat16>(), N, out.mutable_data_ptr<float>());
    return finish(out, x, N, bias);
  }
#endif
  const at::Tensor xf = rows_as_float(x, K);
  const int64_t M = xf.size(0);
  at::Tensor out = at::empty({M, N}, xf.options());
  const float* xp = xf.const_data_ptr<float>();
  float* op = out.mutable_data_ptr<float>();
  if (weight.scalar_type() == at::kFloat) {
    dense_gemm(xp, M, K, weight.const_data_ptr<float>(), N, op);
  } else {
    TORCH_CHECK(weight.scalar_type() == at::kBFloat16, "small_gemm: float32 or bfloat16 weight");
    dense_gemm(xp, M, K, weight.const_data_ptr<c10::BFloat16>(), N, op);
  }
  return finish(out, x, N, bias);
}

// ------------------------------------------------------------------ int4 groups of 32

// codes [N, K / 2] uint8: byte j of a group holds code j (low nibble) and code j + 16 (high);
// a weight is code * scale + min, scale and min float32 [N, K / 32]. With per-group sums of x,
// a row's dot is sum_g scale_g * dot(x_g, codes_g) + min_g * sum(x_g).
constexpr int64_t kGroup = 32;

inline int code_at(const uint8_t* q, int64_t j) {
  return j < 16 ? (q[j] & 0x0F) : (q[j - 16] >> 4);
}

// MT rows against one weight row n (the portable path).
template <int MT>
inline void int4_row(const float* x, int64_t ldx, const float* xsum, int64_t ldxs,
                     const uint8_t* q, const float* scale, const float* mins, int64_t K,
                     float* out, int64_t ldo) {
  const int64_t G = K / kGroup;
  for (int m = 0; m < MT; ++m) {
    float total = 0.0f;
    for (int64_t g = 0; g < G; ++g) {
      float d = 0.0f;
      for (int64_t j = 0; j < kGroup; ++j)
        d += code_at(q + g * (kGroup / 2), j) * x[m * ldx + g * kGroup + j];
      total += d * scale[g] + mins[g] * xsum[m * ldxs + g];
    }
    out[m * ldo] = total;
  }
}

#ifdef HYLOOP_AVX2
// ------------------------------------------------------------------ 8-bit activations (AVX2)

// With AVX2 the rows of x are first quantized to int8 per group of 32 (a scale per group, the
// group's float32 sum kept for the int4 minimum term), and each group's dot product is integer:
// maddubs multiplies 32 unsigned weight codes (or |int8 weights|) by 32 signed activations and
// adds pairs, madd adds those to 8 int32 lanes. That is a handful of instructions per 32 weights
// where converting the codes to float32 takes about three times as many.
struct Q8Rows {
  at::Tensor codes;  // int8 [M, K]
  at::Tensor scale;  // float32 [M, K / 32]
  at::Tensor sums;   // float32 [M, K / 32]: each group's sum of x (the int4 minimum term)
};

Q8Rows quantize_rows(const at::Tensor& xf) {
  const int64_t M = xf.size(0), K = xf.size(1), G = K / kGroup;
  Q8Rows q{at::empty({M, K}, xf.options().dtype(at::kChar)), at::empty({M, G}, xf.options()),
           at::empty({M, G}, xf.options())};
  const float* xp = xf.const_data_ptr<float>();
  int8_t* qp = q.codes.mutable_data_ptr<int8_t>();
  float* sp = q.scale.mutable_data_ptr<float>();
  float* sums = q.sums.mutable_data_ptr<float>();
  for (int64_t i = 0; i < M * G; ++i) {
    const float* v = xp + i * kGroup;
    float amax = 0.0f, total = 0.0f;
    for (int64_t j = 0; j < kGroup; ++j) {
      amax = std::max(amax, std::abs(v[j]));
      total += v[j];
    }
    sums[i] = total;
    const float d = amax / 127.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
    sp[i] = d;
    for (int64_t j = 0; j < kGroup; ++j)
      qp[i * kGroup + j] = static_cast<int8_t>(std::nearbyint(v[j] * inv));
  }
  return q;
}

inline __m256 idot(__m256i u8, __m256i s8) {
  const __m256i pairs = _mm256_maddubs_epi16(u8, s8);
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

// MT rows of x against NT weight rows (ldq bytes, ldg groups apart): MT * NT accumulator
// chains in flight, each row's codes unpacked once for every row of x.
template <int MT, int NT>
inline void int4_tile_q8(const int8_t* qx, const float* dx, const float* xsum, int64_t K,
                         const uint8_t* q, const float* scale, const float* mins, float* out,
                         int64_t ldo) {
  const int64_t G = K / kGroup, ldq = K / 2;
  __m256 acc[MT][NT];
  float tail[MT][NT] = {};
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n) acc[m][n] = _mm256_setzero_ps();
  const __m128i mask = _mm_set1_epi8(0x0F);
  for (int64_t g = 0; g < G; ++g) {
    __m256i codes[NT];
    for (int n = 0; n < NT; ++n) {
      const __m128i b =
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + n * ldq + g * (kGroup / 2)));
      codes[n] = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), mask),
                                  _mm_and_si128(b, mask));
    }
    for (int m = 0; m < MT; ++m) {
      const __m256i xv =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx + m * K + g * kGroup));
      const float d = dx[m * G + g], xs = xsum[m * G + g];
      for (int n = 0; n < NT; ++n) {
        acc[m][n] = _mm256_fmadd_ps(idot(codes[n], xv), _mm256_set1_ps(scale[n * G + g] * d),
                                    acc[m][n]);
        tail[m][n] = std::fma(mins[n * G + g], xs, tail[m][n]);  // one rounding, every tile shape
      }
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n) out[m * ldo + n] = hsum(acc[m][n]) + tail[m][n];
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define HYLOOP_VNNI512 1
#else
constexpr bool kInt4WideOneRow = false;
#endif
#ifdef HYLOOP_VNNI512
// The same tile with AVX-512 VNNI: vpdpbusd multiplies 64 unsigned codes by 64 signed
// activations and adds each four into 16 int32 lanes, so one instruction covers two groups
// (lanes 0-7 group g, 8-15 group g + 1), scaled by a vector holding each group's scale in its
// half. An odd last group takes the 256-bit form. Every tile shape does the same arithmetic per
// (row, weight row), so a row's result never depends on the tile it fell in.
// sum_g mins_g * xsum_g, 16 groups a step (a dependent chain of scalar fmas per output would
// cost more than the tile's integer work).
inline __m512 min_term(const float* mins, const float* xsum, int64_t G) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t h = 0; h < G; h += 16) {
    const __mmask16 k = G - h >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (G - h)) - 1);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, mins + h), _mm512_maskz_loadu_ps(k, xsum + h),
                          acc);
  }
  return acc;  // reduced with the tile's accumulator
}

inline __m512 two_scales(float a, float b) {
  return _mm512_insertf32x8(_mm512_set1_ps(a), _mm256_set1_ps(b), 1);
}

#ifdef HYLOOP_VNNI512
constexpr bool kInt4WideOneRow = true;  // measured faster with VNNI; the AVX2 tile is not
#endif

template <int MT, int NT>
inline void int4_tile_vnni(const int8_t* qx, const float* dx, const float* xsum, int64_t K,
                           const uint8_t* q, const float* scale, const float* mins, float* out,
                           int64_t ldo) {
  const int64_t G = K / kGroup, ldq = K / 2;
  __m512 acc[MT][NT];
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n) acc[m][n] = _mm512_setzero_ps();
  const __m256i mask = _mm256_set1_epi8(0x0F);
  int64_t g = 0;
  for (; g + 2 <= G; g += 2) {
    __m512i codes[NT];
    __m512 ws[NT];
    for (int n = 0; n < NT; ++n) {
      const __m256i b =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + n * ldq + g * (kGroup / 2)));
      const __m256i lo = _mm256_and_si256(b, mask);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), mask);
      // [g lo, g+1 lo, g hi, g+1 hi] -> [g lo, g hi, g+1 lo, g+1 hi] (128-bit lanes)
      const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
      codes[n] = _mm512_shuffle_i64x2(v, v, _MM_SHUFFLE(3, 1, 2, 0));
      ws[n] = two_scales(scale[n * G + g], scale[n * G + g + 1]);
    }
    for (int m = 0; m < MT; ++m) {
      const __m512i xv =
          _mm512_loadu_si512(reinterpret_cast<const void*>(qx + m * K + g * kGroup));
      const __m512 xs = two_scales(dx[m * G + g], dx[m * G + g + 1]);
      for (int n = 0; n < NT; ++n) {
        const __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), codes[n], xv);
        acc[m][n] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(ws[n], xs), acc[m][n]);
      }
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n) {
      float r = _mm512_reduce_add_ps(_mm512_add_ps(acc[m][n], min_term(mins + n * G, xsum + m * G, G)));
      if (g < G) {  // the odd last group
        const __m128i b =
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + n * ldq + g * (kGroup / 2)));
        const __m256i c = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(0x0F)),
                                           _mm_and_si128(b, _mm_set1_epi8(0x0F)));
        const __m256i xv =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx + m * K + g * kGroup));
        const __m256i d = _mm256_dpbusd_epi32(_mm256_setzero_si256(), c, xv);
        r += hsum(_mm256_cvtepi32_ps(d)) * (scale[n * G + g] * dx[m * G + g]);
      }
      out[m * ldo + n] = r;
    }
}
#endif

template <int MT, int NT>
inline void int8_tile_q8(const int8_t* qx, const float* dx, int64_t K, const int8_t* w,
                         const float* scale, float* out, int64_t ldo) {
  const int64_t G = K / kGroup;
  __m256 acc[MT][NT];
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n) acc[m][n] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m256i wv[NT], aw[NT];
    for (int n = 0; n < NT; ++n) {
      wv[n] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + n * K + g * kGroup));
      aw[n] = _mm256_sign_epi8(wv[n], wv[n]);  // |w|: codes lie in [-127, 127]
    }
    for (int m = 0; m < MT; ++m) {
      const __m256i xv =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx + m * K + g * kGroup));
      const __m256 d = _mm256_set1_ps(dx[m * G + g]);
      for (int n = 0; n < NT; ++n)
        acc[m][n] = _mm256_fmadd_ps(idot(aw[n], _mm256_sign_epi8(xv, wv[n])), d, acc[m][n]);
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n) out[m * ldo + n] = hsum(acc[m][n]) * scale[n];
}

// Weight rows [begin, end) against every row of x: tiles of 4 weight rows x (2 rows of x, or
// one), then single weight rows; one row of x takes 4-row tiles only if ``wide_one_row``.
// ``tile(MT, NT, m, n)`` runs one tile.
template <typename Tile>
inline void over_tiles(int64_t M, int64_t begin, int64_t end, Tile tile, bool wide_one_row = false) {
  using I1 = std::integral_constant<int, 1>;
  using I2 = std::integral_constant<int, 2>;
  using I4 = std::integral_constant<int, 4>;
  int64_t n = begin;
  for (; n + 4 <= end && (M > 1 || wide_one_row); n += 4) {
    int64_t m = 0;
    for (; m + 2 <= M; m += 2) tile(I2{}, I4{}, m, n);
    if (m < M) tile(I1{}, I4{}, m, n);
  }
  for (; n < end; ++n)
    for (int64_t m = 0; m < M; ++m) tile(I1{}, I1{}, m, n);
}
#endif

at::Tensor int4_gemm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                     const at::Tensor& mins, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous(), "int4_gemm: codes uint8");
  const int64_t N = codes.size(0), K = codes.size(1) * 2, G = K / kGroup;
  TORCH_CHECK(K % kGroup == 0 && x.size(-1) == K, "int4_gemm: x columns ", x.size(-1),
              " against ", K, " (whole groups of 32)");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() &&
                  mins.scalar_type() == at::kFloat && mins.is_contiguous() &&
                  scale.numel() == N * G && mins.numel() == N * G,
              "int4_gemm: scale and mins float32 [N, K / 32]");
  const at::Tensor xf = rows_as_float(x, K);
  const int64_t M = xf.size(0);
  at::Tensor out = at::empty({M, N}, xf.options());
  const uint8_t* qp = codes.const_data_ptr<uint8_t>();
  const float* scp = scale.const_data_ptr<float>();
  const float* mp = mins.const_data_ptr<float>();
  float* op = out.mutable_data_ptr<float>();
#ifdef HYLOOP_AVX2
  const Q8Rows q8 = quantize_rows(xf);
  const int8_t* qx = q8.codes.const_data_ptr<int8_t>();
  const float* dx = q8.scale.const_data_ptr<float>();
  const float* sp = q8.sums.const_data_ptr<float>();
  hyloop::parallel_chunks(N, [&](int64_t begin, int64_t end) {
    over_tiles(M, begin, end, [&](auto mt, auto nt, int64_t m, int64_t n) {
#ifdef HYLOOP_VNNI512
      int4_tile_vnni<decltype(mt)::value, decltype(nt)::value>(
#else
      int4_tile_q8<decltype(mt)::value, decltype(nt)::value>(
#endif
          qx + m * K, dx + m * G, sp + m * G, K, qp + n * (K / 2), scp + n * G, mp + n * G,
          op + m * N + n, N);
    }, kInt4WideOneRow);
  });
  return finish(out, x, N, bias);
#else
  const at::Tensor xsum = xf.view({M, G, kGroup}).sum(-1).contiguous();
  const float* xp = xf.const_data_ptr<float>();
  const float* sp = xsum.const_data_ptr<float>();
  hyloop::parallel_chunks(N, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const uint8_t* q = qp + n * (K / 2);
      const float *s = scp + n * G, *mn = mp + n * G;
      int64_t m = 0;
      for (; m + 4 <= M; m += 4) int4_row<4>(xp + m * K, K, sp + m * G, G, q, s, mn, K, op + m * N + n, N);
      for (; m < M; ++m) int4_row<1>(xp + m * K, K, sp + m * G, G, q, s, mn, K, op + m * N + n, N);
    }
  });
  return finish(out, x, N, bias);
#endif
}

// ------------------------------------------------------------------ int8 rows

// codes [N, K] int8, one float32 scale per output row.
template <int MT, int NT>
inline void int8_tile(const float* x, int64_t ldx, const int8_t* q, int64_t K, const float* scale,
                      float* out, int64_t ldo) {
  float acc_s[MT][NT] = {};
  int64_t k = 0;
#ifdef HYLOOP_AVX2
  __m256 acc[MT][NT];
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n) acc[m][n] = _mm256_setzero_ps();
  for (; k + 8 <= K; k += 8) {
    __m256 wv[NT];
    for (int n = 0; n < NT; ++n) {
      const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + n * K + k));
      wv[n] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
    }
    for (int m = 0; m < MT; ++m) {
      const __m256 xv = _mm256_loadu_ps(x + m * ldx + k);
      for (int n = 0; n < NT; ++n) acc[m][n] = _mm256_fmadd_ps(xv, wv[n], acc[m][n]);
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n) acc_s[m][n] = hsum(acc[m][n]);
#endif
  for (; k < K; ++k)
    for (int m = 0; m < MT; ++m)
      for (int n = 0; n < NT; ++n) acc_s[m][n] += x[m * ldx + k] * q[n * K + k];
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n) out[m * ldo + n] = acc_s[m][n] * scale[n];
}

at::Tensor int8_gemm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                     const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(codes.scalar_type() == at::kChar && codes.is_contiguous(), "int8_gemm: codes int8");
  const int64_t N = codes.size(0), K = codes.size(1);
  TORCH_CHECK(x.size(-1) == K, "int8_gemm: x has ", x.size(-1), " columns, codes ", K);
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == N, "int8_gemm: scale [N]");
  const at::Tensor xf = rows_as_float(x, K);
  const at::Tensor sc = scale.contiguous();
  const int64_t M = xf.size(0);
  at::Tensor out = at::empty({M, N}, xf.options());
  const float* xp = xf.const_data_ptr<float>();
  const int8_t* qp = codes.const_data_ptr<int8_t>();
  const float* scp = sc.const_data_ptr<float>();
  float* op = out.mutable_data_ptr<float>();
#ifdef HYLOOP_AVX2
  if (K % kGroup == 0) {
    const Q8Rows q8 = quantize_rows(xf);
    const int8_t* qx = q8.codes.const_data_ptr<int8_t>();
    const float* dx = q8.scale.const_data_ptr<float>();
    hyloop::parallel_chunks(N, [&](int64_t begin, int64_t end) {
      over_tiles(M, begin, end, [&](auto mt, auto nt, int64_t m, int64_t n) {
        int8_tile_q8<decltype(mt)::value, decltype(nt)::value>(
            qx + m * K, dx + m * (K / kGroup), K, qp + n * K, scp + n, op + m * N + n, N);
      });
    });
    return finish(out, x, N, bias);
  }
#endif
  constexpr int64_t kTile = 3;
  const int64_t tiles = (N + kTile - 1) / kTile;
  hyloop::parallel_chunks(tiles, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * kTile, nt = std::min(kTile, N - n0);
      for (int64_t m = 0; m < M; m += 4) {
        const int64_t mt = std::min<int64_t>(4, M - m);
        const float* xm = xp + m * K;
        float* o = op + m * N + n0;
        if (nt == kTile) {
          switch (mt) {
            case 4: int8_tile<4, kTile>(xm, K, qp + n0 * K, K, scp + n0, o, N); break;
            case 3: int8_tile<3, kTile>(xm, K, qp + n0 * K, K, scp + n0, o, N); break;
            case 2: int8_tile<2, kTile>(xm, K, qp + n0 * K, K, scp + n0, o, N); break;
            default: int8_tile<1, kTile>(xm, K, qp + n0 * K, K, scp + n0, o, N); break;
          }
        } else {
          for (int64_t n = 0; n < nt; ++n)
            for (int64_t r = 0; r < mt; ++r)
              int8_tile<1, 1>(xm + r * K, K, qp + (n0 + n) * K, K, scp + n0 + n, o + r * N + n, N);
        }
      }
    }
  });
  return finish(out, x, N, bias);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hyloop, m) {
  m.def("small_gemm(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("int4_gemm(Tensor x, Tensor codes, Tensor scale, Tensor mins, Tensor? bias) -> Tensor");
  m.def("int8_gemm(Tensor x, Tensor codes, Tensor scale, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(hyloop, CPU, m) {
  m.impl("small_gemm", &small_gemm);
  m.impl("int4_gemm", &int4_gemm);
  m.impl("int8_gemm", &int8_gemm);
}
