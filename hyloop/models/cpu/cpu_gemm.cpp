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
  const int64_t grain = std::max<int64_t>(1, (tiles + at::get_num_threads() - 1) /
                                                 at::get_num_threads());
  hyloop::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
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

at::Tensor small_gemm(const at::Tensor& x, const at::Tensor& weight,
                      const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "small_gemm: weight [N, K] contiguous");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(x.size(-1) == K, "small_gemm: x has ", x.size(-1), " columns, weight ", K);
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
// one), then single weight rows. ``tile(MT, NT, m, n)`` runs one tile.
template <typename Tile>
inline void over_tiles(int64_t M, int64_t begin, int64_t end, Tile tile) {
  using I1 = std::integral_constant<int, 1>;
  using I2 = std::integral_constant<int, 2>;
  using I4 = std::integral_constant<int, 4>;
  int64_t n = begin;
  for (; n + 4 <= end && M > 1; n += 4) {
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
  const int64_t grain = std::max<int64_t>(1, (N + at::get_num_threads() - 1) /
                                                 at::get_num_threads());
#ifdef HYLOOP_AVX2
  const Q8Rows q8 = quantize_rows(xf);
  const int8_t* qx = q8.codes.const_data_ptr<int8_t>();
  const float* dx = q8.scale.const_data_ptr<float>();
  const float* sp = q8.sums.const_data_ptr<float>();
  hyloop::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    over_tiles(M, begin, end, [&](auto mt, auto nt, int64_t m, int64_t n) {
      int4_tile_q8<decltype(mt)::value, decltype(nt)::value>(
          qx + m * K, dx + m * G, sp + m * G, K, qp + n * (K / 2), scp + n * G, mp + n * G,
          op + m * N + n, N);
    });
  });
  return finish(out, x, N, bias);
#else
  const at::Tensor xsum = xf.view({M, G, kGroup}).sum(-1).contiguous();
  const float* xp = xf.const_data_ptr<float>();
  const float* sp = xsum.const_data_ptr<float>();
  hyloop::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
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
    const int64_t rows_grain = std::max<int64_t>(1, (N + at::get_num_threads() - 1) /
                                                        at::get_num_threads());
    hyloop::parallel_for(0, N, rows_grain, [&](int64_t begin, int64_t end) {
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
  const int64_t grain = std::max<int64_t>(1, (tiles + at::get_num_threads() - 1) /
                                                 at::get_num_threads());
  hyloop::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
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
