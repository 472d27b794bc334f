// Panel GEMMs: hyloop's CPU matrix kernels for a step's few rows (and a prefill's many).
//
// A weight [N, K] is stored as panels of 16 output columns, each panel K-major (the 16 columns
// of one k, or of one k pair, or of one quantization group, are adjacent), so the kernels run
// as outer products: one vector load of weights feeds a multiply-add per row of the tile, and
// no horizontal reduction is ever needed. Layouts (panel p = output columns [16p, 16p + 16),
// zero-padded past N):
//
//   kF32:  [K][16] float
//   kBF16: [K/2][16][2] bfloat16 (K padded to even): one vdpbf16ps per k pair
//   kI4:   per group of 32 k: 4 x 64 bytes of codes, byte 4c + r of column j's dword in chunk c
//          holds code(k = 4c + r) in its low nibble and code(k = 16 + 4c + r) in its high
//          nibble (so each unpacked chunk is vpdpbusd's [column][4 k] operand), then 16 scales
//          and 16 mins (fp16 when every one is exact in fp16, else fp32): w = code * scale + min
//   kI8:   per group of 32 k: 8 x 64 bytes of codes + 128 as uint8 (vpdpbusd's unsigned side,
//          the chunk layout above without nibbles), then 16 fp32 scales: w = code * scale
//
// Activations enter as ``Rows`` in the weight's format: float32 rows, bfloat16 rows, or (the
// integer kinds) 16-bit codes per group of 32 with a scale, the group's sum as its codes hold
// it (the int4 minimum term) and its integer code sum (the int8 offset of 128). A code
// c = 256 h + l is held as two int8 halves (h in [-127, 127], l in [-128, 127]; per group 32 h
// then 32 l), so each half is vpdpbusd's signed operand and the dot is 256 * dot(h) + dot(l).
//
// Every output element is one sequential chain over k (or over groups), whatever the tile
// shape and the row count, so a row's result is bit-identical alone, batched, or in a prefill.
// The integer kinds' chain is the quantized modes' definition (``quant/reference.py`` computes
// it in torch, bit for bit): groups in order, per group one fused multiply-add of the exact
// integer dot (converted to float32 once, to nearest even) and (weight scale * activation
// scale, rounded once), then for int4 one of the weight minimum and the activation group's sum.
// AVX-512 (with VNNI and BF16 where present) runs the tiles; elsewhere portable loops compute
// the same thing (bfloat16 pairs as two fused multiply-adds, the odd k first, as vdpbf16ps adds
// them; a product of two bfloat16 values is exact in float32, so each is one rounded add).

#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#include <immintrin.h>
#define HYLOOP_P512 1
#if defined(__AVX512BF16__)
#define HYLOOP_P512_BF16 1
#endif
#if defined(__AVX512VNNI__)
#define HYLOOP_P512_VNNI 1
#endif
#endif

namespace hyloop::panels {

#ifdef HYLOOP_P512
// 16 float32 values to bfloat16 bits (each in its dword's low half), as c10::BFloat16 rounds
// them: to nearest even, a NaN as 0x7FC0 (integer arithmetic: no MXCSR mode applies).
inline __m512i bf16_bits(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i bias = _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(u, 16),
                                                         _mm512_set1_epi32(1)),
                                        _mm512_set1_epi32(0x7FFF));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
  return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
}

// 16 float32 values rounded to bfloat16 and back (``bf16_bits``).
inline __m512 round_bf16(__m512 v) { return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(v), 16)); }
#endif

constexpr int64_t kCols = 16;   // output columns per panel (one 512-bit vector of float32)
constexpr int64_t kGroup = 32;  // quantization group along K
constexpr int64_t kPrefetch = 64;  // weight rows (k steps) prefetched ahead of the tile
constexpr int64_t kPrefetchGroups = 8;  // the integer kinds: groups ahead
constexpr int64_t kAmxMinRows = 12;  // integer GEMMs of this many rows on AMX tiles, where present

enum Kind : int64_t { kF32 = 0, kBF16 = 1, kI4 = 2, kI8 = 3 };

inline int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

// Bytes of one panel of a [N, K] weight of `kind` (`half`: fp16 scales).
inline int64_t panel_bytes(Kind kind, int64_t k, bool half) {
  const int64_t sb = half ? 2 : 4;
  switch (kind) {
    case kF32: return k * kCols * 4;
    case kBF16: return round_up(k, 2) * kCols * 2;
    case kI4: return k / kGroup * (256 + 2 * kCols * sb);
    case kI8: return k / kGroup * (512 + kCols * 4);
  }
  return 0;
}

// A packed weight as the kernels read it. ``split`` > 0: the panels interleave two halves of
// ``split`` output columns (a fused gate/up projection): panel 2j holds columns [16j, 16j + 16)
// of the first half and panel 2j + 1 the same columns of the second, so one thread's pair of
// panels gives it a gate tile and its up tile.
struct Weight {
  Kind kind = kF32;
  int64_t n = 0, k = 0, panels = 0, bytes = 0, split = 0;
  bool half = false;
  const uint8_t* data = nullptr;

  const uint8_t* panel(int64_t p) const { return data + p * bytes; }
  int64_t col(int64_t p) const {
    return split > 0 ? (p % 2) * split + (p / 2) * kCols : p * kCols;
  }
  int64_t valid(int64_t p) const {
    const int64_t end = split > 0 ? split : n;
    const int64_t first = split > 0 ? (p / 2) * kCols : p * kCols;
    return std::min(kCols, end - first);
  }
};

inline Weight make_weight(Kind kind, int64_t n, int64_t k, bool half, int64_t split,
                          const uint8_t* data) {
  Weight w;
  w.kind = kind;
  w.n = n;
  w.k = k;
  w.half = half;
  w.split = split;
  w.panels = split > 0 ? 2 * ((split + kCols - 1) / kCols) : (n + kCols - 1) / kCols;
  w.bytes = panel_bytes(kind, k, half);
  w.data = data;
  return w;
}

// A GEMM's input rows in its weight's format (``ld``: elements, or bytes for codes, per row).
struct Rows {
  int64_t m = 0, k = 0, ld = 0;
  const float* f32 = nullptr;
  const c10::BFloat16* bf16 = nullptr;
  const int8_t* q = nullptr;      // [m][ld = 2k] per group of 32: the codes' h halves, l halves
  const float* scale = nullptr;   // [m][k / 32]
  const float* fsum = nullptr;    // [m][k / 32] each group's sum as its codes hold it: scale * isum
  const int32_t* isum = nullptr;  // [m][k / 32] sum of each group's codes
};

// The largest activation code: 127 * 256, so a code's high half stays in [-127, 127].
constexpr float kCodeMax = 32512.0f;

// Quantize `k` values (float or bfloat16) per group of 32 (``q`` gets 2k bytes): 16-bit codes
// as their two halves, scales, code sums and the group's sum as the codes hold it (scale * code
// sum, one rounding), so an int4 layer's minimum term sees the same quantized activations as
// its codes term and the two errors stay centred.
template <typename T>
inline void quantize_row(const T* x, int64_t k, int8_t* q, float* scale, float* fsum,
                         int32_t* isum) {
  for (int64_t g = 0; g < k / kGroup; ++g) {
    const T* v = x + g * kGroup;
    float amax = 0.0f;
    for (int64_t j = 0; j < kGroup; ++j) amax = std::max(amax, std::abs(static_cast<float>(v[j])));
    const float d = amax / kCodeMax, inv = d > 0.0f ? 1.0f / d : 0.0f;
    int32_t s = 0;
    for (int64_t j = 0; j < kGroup; ++j) {
      const auto c = static_cast<int32_t>(std::nearbyint(static_cast<float>(v[j]) * inv));
      const int32_t h = (c + 128) >> 8;  // floor: c - 256 h lands in [-128, 127]
      q[2 * g * kGroup + j] = static_cast<int8_t>(h);
      q[2 * g * kGroup + kGroup + j] = static_cast<int8_t>(c - 256 * h);
      s += c;
    }
    scale[g] = d;
    fsum[g] = d * static_cast<float>(s);
    isum[g] = s;
  }
}

// ------------------------------------------------------------------ packing (load time)

// panels -> destination bytes (``dst`` holds ``w.panels * w.bytes``, zero-filled by the caller).
template <typename T>
void pack_dense(const T* src, int64_t n, int64_t k, int64_t split, Kind kind, uint8_t* dst) {
  const Weight w = make_weight(kind, n, k, false, split, dst);
  for (int64_t p = 0; p < w.panels; ++p) {
    const int64_t c0 = w.col(p), cols = w.valid(p);
    for (int64_t j = 0; j < cols; ++j) {
      const T* row = src + (c0 + j) * k;
      if (kind == kF32) {
        auto* out = reinterpret_cast<float*>(dst + p * w.bytes);
        for (int64_t i = 0; i < k; ++i) out[i * kCols + j] = static_cast<float>(row[i]);
      } else {
        auto* out = reinterpret_cast<c10::BFloat16*>(dst + p * w.bytes);
        for (int64_t i = 0; i < k; ++i)
          out[(i / 2) * 2 * kCols + j * 2 + i % 2] = static_cast<c10::BFloat16>(row[i]);
      }
    }
  }
}

inline void put_scale(uint8_t* at, int64_t j, float v, bool half) {
  if (half) {
    const c10::Half h(v);
    std::memcpy(at + 2 * j, &h, 2);
  } else {
    std::memcpy(at + 4 * j, &v, 4);
  }
}

// codes uint8 [n, k] in [0, 15]; scale, mins float [n, k / 32].
inline void pack_i4(const uint8_t* codes, const float* scale, const float* mins, int64_t n,
                    int64_t k, int64_t split, bool half, uint8_t* dst) {
  const Weight w = make_weight(kI4, n, k, half, split, dst);
  const int64_t G = k / kGroup, sb = half ? 2 : 4, block = w.bytes / G;
  for (int64_t p = 0; p < w.panels; ++p) {
    const int64_t c0 = w.col(p), cols = w.valid(p);
    for (int64_t g = 0; g < G; ++g) {
      uint8_t* b = dst + p * w.bytes + g * block;
      for (int64_t j = 0; j < cols; ++j) {
        const uint8_t* c = codes + (c0 + j) * k + g * kGroup;
        for (int64_t ch = 0; ch < 4; ++ch)
          for (int64_t r = 0; r < 4; ++r)
            b[ch * 64 + j * 4 + r] = static_cast<uint8_t>(c[4 * ch + r] | (c[16 + 4 * ch + r] << 4));
        put_scale(b + 256, j, scale[(c0 + j) * G + g], half);
        put_scale(b + 256 + kCols * sb, j, mins[(c0 + j) * G + g], half);
      }
    }
  }
}

// codes int8 [n, k]; scale float [n, k / 32].
inline void pack_i8(const int8_t* codes, const float* scale, int64_t n, int64_t k, int64_t split,
                    uint8_t* dst) {
  const Weight w = make_weight(kI8, n, k, false, split, dst);
  const int64_t G = k / kGroup, block = w.bytes / G;
  for (int64_t p = 0; p < w.panels; ++p) {
    const int64_t c0 = w.col(p), cols = w.valid(p);
    for (int64_t g = 0; g < G; ++g) {
      uint8_t* b = dst + p * w.bytes + g * block;
      for (int64_t j = 0; j < kCols; ++j)  // padded columns: code 0 (stored 128)
        for (int64_t ch = 0; ch < 8; ++ch)
          for (int64_t r = 0; r < 4; ++r) b[ch * 64 + j * 4 + r] = 128;
      for (int64_t j = 0; j < cols; ++j) {
        const int8_t* c = codes + (c0 + j) * k + g * kGroup;
        for (int64_t ch = 0; ch < 8; ++ch)
          for (int64_t r = 0; r < 4; ++r)
            b[ch * 64 + j * 4 + r] = static_cast<uint8_t>(c[4 * ch + r] + 128);
        put_scale(b + 512, j, scale[(c0 + j) * G + g], false);
      }
    }
  }
}

// ------------------------------------------------------------------ tiles

inline float get_scale(const uint8_t* at, int64_t j, bool half) {
  if (half) {
    c10::Half h;
    std::memcpy(&h, at + 2 * j, 2);
    return static_cast<float>(h);
  }
  float v;
  std::memcpy(&v, at + 4 * j, 4);
  return v;
}

#ifdef HYLOOP_P512
inline __m512 load_scales(const uint8_t* at, bool half) {
  return half ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at)))
              : _mm512_loadu_ps(at);
}
#endif

// MR rows x NP panels (starting at panel pointer `w`, `stride` bytes apart), k in [k0, k1)
// -> tile[MR][NP][16]; `resume`: the tile holds the sums over [0, k0) to continue (a sum kept
// in memory between k blocks is the same float, so blocking changes no result).
template <int MR, int NP>
inline void tile_f32(const Rows& x, int64_t m0, const uint8_t* w, int64_t stride, int64_t k0,
                     int64_t k1, bool resume, float (*tile)[NP][kCols]) {
  const float* xr = x.f32 + m0 * x.ld;
#ifdef HYLOOP_P512
  __m512 acc[MR][NP];
  for (int m = 0; m < MR; ++m)
    for (int p = 0; p < NP; ++p) acc[m][p] = resume ? _mm512_loadu_ps(tile[m][p]) : _mm512_setzero_ps();
  for (int64_t k = k0; k < k1; ++k) {
    __m512 wv[NP];
    for (int p = 0; p < NP; ++p) {
      const float* wp = reinterpret_cast<const float*>(w + p * stride);
      _mm_prefetch(reinterpret_cast<const char*>(wp + (k + kPrefetch) * kCols), _MM_HINT_T0);
      wv[p] = _mm512_loadu_ps(wp + k * kCols);
    }
    for (int m = 0; m < MR; ++m) {
      const __m512 xv = _mm512_set1_ps(xr[m * x.ld + k]);
      for (int p = 0; p < NP; ++p) acc[m][p] = _mm512_fmadd_ps(xv, wv[p], acc[m][p]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int p = 0; p < NP; ++p) _mm512_storeu_ps(tile[m][p], acc[m][p]);
#else
  for (int m = 0; m < MR; ++m)
    for (int p = 0; p < NP; ++p) {
      const float* wp = reinterpret_cast<const float*>(w + p * stride);
      for (int64_t j = 0; j < kCols; ++j) {
        float acc = resume ? tile[m][p][j] : 0.0f;
        for (int64_t k = k0; k < k1; ++k) acc = std::fma(xr[m * x.ld + k], wp[k * kCols + j], acc);
        tile[m][p][j] = acc;
      }
    }
#endif
}

// Whether bfloat16 GEMMs run as float32 multiply-adds over the weights widened in registers
// (``true``) or as vdpbf16ps (``false``; only where the CPU has AVX512_BF16): the same chain, the
// same bits (a product of two bfloat16 values is exact in float32, so a fused multiply-add is
// one rounded add, and ``gemm`` runs the float32 one with denormals flushed, as vdpbf16ps
// flushes them). Set once per process by ``set_bf16_dot`` from the rule in ``kernel_choice``;
// ``RowsBuffer`` then also holds its bfloat16 rows widened to float32 (``Rows::f32``).
#ifdef HYLOOP_P512_BF16
inline bool g_bf16_fma = false;
#else
inline bool g_bf16_fma = true;
#endif

template <int MR, int NP>
inline void tile_bf16(const Rows& x, int64_t m0, const uint8_t* w, int64_t stride, int64_t k0,
                      int64_t k1, bool resume, float (*tile)[NP][kCols]) {
  const c10::BFloat16* xr = x.bf16 + m0 * x.ld;
#ifdef HYLOOP_P512
  if (x.f32 != nullptr) {
    // Each 64-byte k pair of a panel as two float32 vectors over its 16 columns: the odd k
    // (each dword's high half) and the even (its low half shifted up), added in that order.
    const float* xf = x.f32 + m0 * x.ld;
    const __m512i hi = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
    __m512 acc[MR][NP];
    for (int m = 0; m < MR; ++m)
      for (int p = 0; p < NP; ++p) acc[m][p] = resume ? _mm512_loadu_ps(tile[m][p]) : _mm512_setzero_ps();
    for (int64_t k = k0; k < k1; k += 2) {
      __m512 odd[NP], even[NP];
      for (int p = 0; p < NP; ++p) {
        const auto* wp = reinterpret_cast<const c10::BFloat16*>(w + p * stride);
        _mm_prefetch(reinterpret_cast<const char*>(wp + (k + 2 * kPrefetch) * kCols), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(wp + (k + 8 * kPrefetch) * kCols), _MM_HINT_T1);
        const __m512i wv = _mm512_loadu_si512(wp + k * kCols);
        odd[p] = _mm512_castsi512_ps(_mm512_and_si512(wv, hi));
        even[p] = _mm512_castsi512_ps(_mm512_slli_epi32(wv, 16));
      }
      for (int m = 0; m < MR; ++m) {
        const __m512 xo = _mm512_set1_ps(xf[m * x.ld + k + 1]);
        const __m512 xe = _mm512_set1_ps(xf[m * x.ld + k]);
        for (int p = 0; p < NP; ++p) {
          acc[m][p] = _mm512_fmadd_ps(xo, odd[p], acc[m][p]);
          acc[m][p] = _mm512_fmadd_ps(xe, even[p], acc[m][p]);
        }
      }
    }
    for (int m = 0; m < MR; ++m)
      for (int p = 0; p < NP; ++p) _mm512_storeu_ps(tile[m][p], acc[m][p]);
    return;
  }
#endif
#ifdef HYLOOP_P512_BF16
  __m512 acc[MR][NP];
  for (int m = 0; m < MR; ++m)
    for (int p = 0; p < NP; ++p) acc[m][p] = resume ? _mm512_loadu_ps(tile[m][p]) : _mm512_setzero_ps();
  for (int64_t k = k0; k < k1; k += 2) {
    __m512i wv[NP];
    for (int p = 0; p < NP; ++p) {
      const auto* wp = reinterpret_cast<const c10::BFloat16*>(w + p * stride);
      _mm_prefetch(reinterpret_cast<const char*>(wp + (k + 2 * kPrefetch) * kCols), _MM_HINT_T0);
      wv[p] = _mm512_loadu_si512(wp + k * kCols);
    }
    for (int m = 0; m < MR; ++m) {
      int32_t pair;
      std::memcpy(&pair, xr + m * x.ld + k, 4);
      const __m512i xv = _mm512_set1_epi32(pair);
      for (int p = 0; p < NP; ++p)
        acc[m][p] = _mm512_dpbf16_ps(acc[m][p], (__m512bh)xv, (__m512bh)wv[p]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int p = 0; p < NP; ++p) _mm512_storeu_ps(tile[m][p], acc[m][p]);
#else
  for (int m = 0; m < MR; ++m)
    for (int p = 0; p < NP; ++p) {
      const auto* wp = reinterpret_cast<const c10::BFloat16*>(w + p * stride);
      for (int64_t j = 0; j < kCols; ++j) {
        float acc = resume ? tile[m][p][j] : 0.0f;
        for (int64_t k = k0; k < k1; k += 2) {  // vdpbf16ps' order: the odd k, then the even
          acc = std::fma(static_cast<float>(xr[m * x.ld + k + 1]),
                         static_cast<float>(wp[k * kCols + 2 * j + 1]), acc);
          acc = std::fma(static_cast<float>(xr[m * x.ld + k]),
                         static_cast<float>(wp[k * kCols + 2 * j]), acc);
        }
        tile[m][p][j] = acc;
      }
    }
#endif
}

// Activation code j of a group held as halves (``grp``: 32 h then 32 l).
inline int32_t code_at(const int8_t* grp, int64_t j) { return 256 * grp[j] + grp[kGroup + j]; }

#ifdef HYLOOP_P512_VNNI
// The dot over a group from its two halves' dots: 256 * dot(h) + dot(l), exact in int32.
inline __m512i join_halves(__m512i h, __m512i l) {
  return _mm512_add_epi32(_mm512_slli_epi32(h, 8), l);
}
#endif

template <int MR, int NP>
inline void tile_i4(const Rows& x, int64_t m0, const uint8_t* w, int64_t stride, bool half,
                    float (*tile)[NP][kCols]) {
  const int64_t G = x.k / kGroup, sb = half ? 2 : 4, block = 256 + 2 * kCols * sb;
  const int8_t* xq = x.q + m0 * x.ld;
  const float* xd = x.scale + m0 * G;
  const float* xs = x.fsum + m0 * G;
#ifdef HYLOOP_P512_VNNI
  __m512 acc[MR][NP];
  for (int m = 0; m < MR; ++m)
    for (int p = 0; p < NP; ++p) acc[m][p] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F);
  if constexpr (MR == 1) {
    // One row: each panel's codes are unpacked and used at once (holding NP panels' unpacked
    // codes for several rows would spill), the row's broadcasts shared by the panels.
    for (int64_t g = 0; g < G; ++g) {
      const auto* xr = reinterpret_cast<const int32_t*>(xq + 2 * g * kGroup);  // h: 0-7, l: 8-15
      const __m512 d = _mm512_set1_ps(xd[g]), s = _mm512_set1_ps(xs[g]);
      for (int p = 0; p < NP; ++p) {
        const uint8_t* b = w + p * stride + g * block;
        for (int64_t line = 0; line < block; line += 64)
          _mm_prefetch(reinterpret_cast<const char*>(b + kPrefetchGroups * block + line), _MM_HINT_T0);
        __m512i h0 = _mm512_setzero_si512(), h1 = h0, l0 = h0, l1 = h0;  // four short chains
        for (int c = 0; c < 4; ++c) {
          const __m512i v = _mm512_loadu_si512(b + 64 * c);
          const __m512i a = _mm512_and_si512(v, low), e = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
          h0 = _mm512_dpbusd_epi32(h0, a, _mm512_set1_epi32(xr[c]));
          h1 = _mm512_dpbusd_epi32(h1, e, _mm512_set1_epi32(xr[4 + c]));
          l0 = _mm512_dpbusd_epi32(l0, a, _mm512_set1_epi32(xr[8 + c]));
          l1 = _mm512_dpbusd_epi32(l1, e, _mm512_set1_epi32(xr[12 + c]));
        }
        const __m512i h = _mm512_add_epi32(h0, h1), l = _mm512_add_epi32(l0, l1);
        const __m512 dot = _mm512_cvtepi32_ps(join_halves(h, l));
        acc[0][p] = _mm512_fmadd_ps(dot, _mm512_mul_ps(load_scales(b + 256, half), d), acc[0][p]);
        acc[0][p] = _mm512_fmadd_ps(load_scales(b + 256 + kCols * sb, half), s, acc[0][p]);
      }
    }
    for (int p = 0; p < NP; ++p) _mm512_storeu_ps(tile[0][p], acc[0][p]);
    return;
  }
  for (int64_t g = 0; g < G; ++g) {
    __m512i codes[NP][8];
    __m512 sc[NP], mn[NP];
    for (int p = 0; p < NP; ++p) {
      const uint8_t* b = w + p * stride + g * block;
      for (int64_t line = 0; line < block; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(b + kPrefetchGroups * block + line), _MM_HINT_T0);
      for (int c = 0; c < 4; ++c) {
        const __m512i v = _mm512_loadu_si512(b + 64 * c);
        codes[p][c] = _mm512_and_si512(v, low);
        codes[p][4 + c] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      }
      sc[p] = load_scales(b + 256, half);
      mn[p] = load_scales(b + 256 + kCols * sb, half);
    }
    for (int m = 0; m < MR; ++m) {
      const auto* xr = reinterpret_cast<const int32_t*>(xq + m * x.ld + 2 * g * kGroup);
      const __m512 d = _mm512_set1_ps(xd[m * G + g]);
      const __m512 s = _mm512_set1_ps(xs[m * G + g]);
      for (int p = 0; p < NP; ++p) {
        __m512i h = _mm512_setzero_si512(), l = _mm512_setzero_si512();
        for (int c = 0; c < 8; ++c) {
          h = _mm512_dpbusd_epi32(h, codes[p][c], _mm512_set1_epi32(xr[c]));
          l = _mm512_dpbusd_epi32(l, codes[p][c], _mm512_set1_epi32(xr[8 + c]));
        }
        const __m512 dot = _mm512_cvtepi32_ps(join_halves(h, l));
        acc[m][p] = _mm512_fmadd_ps(dot, _mm512_mul_ps(sc[p], d), acc[m][p]);
        acc[m][p] = _mm512_fmadd_ps(mn[p], s, acc[m][p]);
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int p = 0; p < NP; ++p) _mm512_storeu_ps(tile[m][p], acc[m][p]);
#else
  for (int m = 0; m < MR; ++m)
    for (int p = 0; p < NP; ++p)
      for (int64_t j = 0; j < kCols; ++j) {
        float acc = 0.0f;
        for (int64_t g = 0; g < G; ++g) {
          const uint8_t* b = w + p * stride + g * block;
          const int8_t* grp = xq + m * x.ld + 2 * g * kGroup;
          int32_t dot = 0;
          for (int64_t c = 0; c < 4; ++c)
            for (int64_t r = 0; r < 4; ++r) {
              const uint8_t byte = b[c * 64 + j * 4 + r];
              dot += (byte & 0x0F) * code_at(grp, 4 * c + r);
              dot += (byte >> 4) * code_at(grp, 16 + 4 * c + r);
            }
          const float sc = get_scale(b + 256, j, half), mn = get_scale(b + 256 + kCols * sb, j, half);
          acc = std::fma(static_cast<float>(dot), sc * xd[m * G + g], acc);
          acc = std::fma(mn, xs[m * G + g], acc);
        }
        tile[m][p][j] = acc;
      }
#endif
}

template <int MR, int NP>
inline void tile_i8(const Rows& x, int64_t m0, const uint8_t* w, int64_t stride,
                    float (*tile)[NP][kCols]) {
  const int64_t G = x.k / kGroup, block = 512 + kCols * 4;
  const int8_t* xq = x.q + m0 * x.ld;
  const float* xd = x.scale + m0 * G;
  const int32_t* xi = x.isum + m0 * G;
#ifdef HYLOOP_P512_VNNI
  __m512 acc[MR][NP];
  for (int m = 0; m < MR; ++m)
    for (int p = 0; p < NP; ++p) acc[m][p] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512 sc[NP];
    for (int p = 0; p < NP; ++p) {
      const uint8_t* b = w + p * stride + g * block;
      for (int64_t line = 0; line < block; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(b + kPrefetchGroups * block + line), _MM_HINT_T0);
      sc[p] = _mm512_loadu_ps(b + 512);
    }
    for (int m = 0; m < MR; ++m) {
      const auto* xr = reinterpret_cast<const int32_t*>(xq + m * x.ld + 2 * g * kGroup);
      const __m512 d = _mm512_set1_ps(xd[m * G + g]);
      const __m512i off = _mm512_set1_epi32(128 * xi[m * G + g]);
      for (int p = 0; p < NP; ++p) {
        const uint8_t* b = w + p * stride + g * block;
        __m512i h = _mm512_setzero_si512(), l = _mm512_setzero_si512();
        for (int c = 0; c < 8; ++c) {
          const __m512i v = _mm512_loadu_si512(b + 64 * c);
          h = _mm512_dpbusd_epi32(h, v, _mm512_set1_epi32(xr[c]));
          l = _mm512_dpbusd_epi32(l, v, _mm512_set1_epi32(xr[8 + c]));
        }
        const __m512 dot = _mm512_cvtepi32_ps(_mm512_sub_epi32(join_halves(h, l), off));
        acc[m][p] = _mm512_fmadd_ps(dot, _mm512_mul_ps(sc[p], d), acc[m][p]);
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int p = 0; p < NP; ++p) _mm512_storeu_ps(tile[m][p], acc[m][p]);
#else
  for (int m = 0; m < MR; ++m)
    for (int p = 0; p < NP; ++p)
      for (int64_t j = 0; j < kCols; ++j) {
        float acc = 0.0f;
        for (int64_t g = 0; g < G; ++g) {
          const uint8_t* b = w + p * stride + g * block;
          const int8_t* grp = xq + m * x.ld + 2 * g * kGroup;
          int32_t dot = 0;
          for (int64_t c = 0; c < 8; ++c)
            for (int64_t r = 0; r < 4; ++r)
              dot += (static_cast<int32_t>(b[c * 64 + j * 4 + r]) - 128) * code_at(grp, 4 * c + r);
          acc = std::fma(static_cast<float>(dot), get_scale(b + 512, j, false) * xd[m * G + g], acc);
        }
        tile[m][p][j] = acc;
      }
#endif
}

template <int MR, int NP>
inline void run_tile(const Weight& w, const Rows& x, int64_t m0, int64_t p,
                     float (*tile)[NP][kCols]) {
  const uint8_t* b = w.panel(p);
  switch (w.kind) {
    case kF32: tile_f32<MR, NP>(x, m0, b, w.bytes, 0, x.k, false, tile); break;
    case kBF16: tile_bf16<MR, NP>(x, m0, b, w.bytes, 0, round_up(x.k, 2), false, tile); break;
    case kI4: tile_i4<MR, NP>(x, m0, b, w.bytes, w.half, tile); break;
    case kI8: tile_i8<MR, NP>(x, m0, b, w.bytes, tile); break;
  }
}

// ------------------------------------------------------------------ a GEMM over panels

// Where a GEMM's results go: row m, column c at ``f32[r * ld + c]`` or ``bf16[r * ld + c]``
// (rounded once, to nearest even), plus ``bias[c]`` when given; r is ``rows[m]`` where a row
// map is given (a verify step's live rows straight into their places), else m.
struct Output {
  float* f32 = nullptr;
  c10::BFloat16* bf16 = nullptr;
  int64_t ld = 0;
  const float* bias = nullptr;
  const int64_t* rows = nullptr;
  int64_t row(int64_t m) const { return rows != nullptr ? rows[m] : m; }
};

// Rows [m0, m0 + rows) of a tile for panels [p, p + NP) to their output columns.
template <int NP>
inline void store_tile(const Weight& w, int64_t p, int64_t m0, int64_t rows,
                       float (*tile)[NP][kCols], const Output& out) {
  for (int q = 0; q < NP; ++q) {
    const int64_t c0 = w.col(p + q), cols = w.valid(p + q);
    for (int64_t m = 0; m < rows; ++m) {
      float* v = tile[m][q];
      if (out.bias != nullptr) {
        for (int64_t j = 0; j < cols; ++j) v[j] += out.bias[c0 + j];
      }
      if (out.bf16 != nullptr) {
        c10::BFloat16* o = out.bf16 + out.row(m0 + m) * out.ld + c0;
        int64_t j = 0;
#ifdef HYLOOP_P512
        if (cols == kCols) {  // c10's rounding, 16 at once
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(o),
                              _mm512_cvtepi32_epi16(bf16_bits(_mm512_loadu_ps(v))));
          j = kCols;
        }
#endif
        for (; j < cols; ++j) o[j] = static_cast<c10::BFloat16>(v[j]);
      } else {
        std::memcpy(out.f32 + out.row(m0 + m) * out.ld + c0, v, cols * sizeof(float));
      }
    }
  }
}

template <int MR, int NP>
inline void panel_block(const Weight& w, const Rows& x, int64_t m0, int64_t p, const Output& out) {
  alignas(64) float tile[MR][NP][kCols];
  run_tile<MR, NP>(w, x, m0, p, tile);
  store_tile<NP>(w, p, m0, MR, tile, out);
}

// A dense tile of R rows over k in [k0, k1), continuing `tile` (R chosen at run time).
template <int NP>
inline void dense_rows(const Weight& w, const Rows& x, int64_t m0, int64_t R, const uint8_t* b,
                       int64_t k0, int64_t k1, float (*tile)[NP][kCols]) {
  const bool resume = k0 > 0;
  switch (R) {
#define HYLOOP_DENSE_CASE(N)                                                              \
  case N:                                                                                 \
    if (w.kind == kF32) {                                                                 \
      tile_f32<N, NP>(x, m0, b, w.bytes, k0, k1, resume, tile);                            \
    } else {                                                                              \
      tile_bf16<N, NP>(x, m0, b, w.bytes, k0, k1, resume, tile);                           \
    }                                                                                     \
    break;
    HYLOOP_DENSE_CASE(1)
    HYLOOP_DENSE_CASE(2)
    HYLOOP_DENSE_CASE(3)
    HYLOOP_DENSE_CASE(4)
    HYLOOP_DENSE_CASE(5)
    HYLOOP_DENSE_CASE(6)
    HYLOOP_DENSE_CASE(7)
    HYLOOP_DENSE_CASE(8)
#undef HYLOOP_DENSE_CASE
    default: break;
  }
}

// Dense panels [p, p + NP) for a few more rows than one tile holds (up to kBlockedRows): K in
// blocks of kBlockK, every 8-row block run over a block while its weights are in L1, so each
// weight byte comes from memory once for all the rows (one row block after another over the
// whole of K would stream it from memory for the first and from L2 for the rest, the two
// not overlapping).
constexpr int64_t kBlockedRows = 32, kBlockK = 64;

template <int NP>
inline void dense_blocked(const Weight& w, const Rows& x, int64_t p, const Output& out) {
  alignas(64) float tile[kBlockedRows][NP][kCols];
  const uint8_t* b = w.panel(p);
  const int64_t K = w.kind == kBF16 ? round_up(x.k, 2) : x.k;
  for (int64_t k0 = 0; k0 < K; k0 += kBlockK) {
    const int64_t k1 = std::min(K, k0 + kBlockK);
    for (int64_t m0 = 0; m0 < x.m; m0 += 8)
      dense_rows<NP>(w, x, m0, std::min<int64_t>(8, x.m - m0), b, k0, k1, tile + m0);
  }
  store_tile<NP>(w, p, 0, x.m, tile, out);
}

// Row blocks of up to MR rows over NP panels at a time.
template <int MR, int NP>
inline void rows_over(const Weight& w, const Rows& x, int64_t p, const Output& out) {
  int64_t m = 0;
  for (; m + MR <= x.m; m += MR) panel_block<MR, NP>(w, x, m, p, out);
  if constexpr (MR > 1) {
    // The last few rows: one block of exactly that many.
    switch (x.m - m) {
#define HYLOOP_ROWS_CASE(R) \
  case R:                   \
    if constexpr (R < MR) panel_block<R, NP>(w, x, m, p, out); \
    break;
      HYLOOP_ROWS_CASE(1)
      HYLOOP_ROWS_CASE(2)
      HYLOOP_ROWS_CASE(3)
      HYLOOP_ROWS_CASE(4)
      HYLOOP_ROWS_CASE(5)
      HYLOOP_ROWS_CASE(6)
      HYLOOP_ROWS_CASE(7)
#undef HYLOOP_ROWS_CASE
      default: break;
    }
  }
}

// Rows [0, x.m) times panels [p0, p1). The tile shapes: dense kinds 8 rows x 2 panels (a weight
// vector load feeds 8 rows, a row's broadcast feeds 2 panels: the multiply-adds, not the loads,
// set the pace; 9 to 32 rows in K blocks, ``dense_blocked``); integer kinds 8 x 1 at every row
// count past one (blocks of 8 rows and one of the rest, each panel's K run for every block while
// it sits in L1): with 16-bit activation codes a row takes two vpdpbusd per weight vector, so
// the rows a loaded, unpacked weight vector feeds set the pace, not the unpacking two panels'
// tiles would share (4 x 2 int4 tiles took 20 - 45 % longer at 2 - 4 rows with the weights in
// memory, 5 - 15 % at 12 - 256: ``bench/panel_gemm.py``); one row runs 4 panels at once (four
// independent chains in flight, four weight streams).
// Denormal inputs read as zero and denormal results flushed, for one GEMM (vdpbf16ps' rule,
// kept by the float32 path of bfloat16 weights).
struct FlushDenormals {
  explicit FlushDenormals(bool on) : on_(on) {
#ifdef HYLOOP_P512
    if (on_) {
      csr_ = _mm_getcsr();
      _mm_setcsr(csr_ | 0x8040);  // FTZ | DAZ
    }
#endif
  }
  ~FlushDenormals() {
#ifdef HYLOOP_P512
    if (on_) _mm_setcsr(csr_);
#endif
  }
  FlushDenormals(const FlushDenormals&) = delete;
  FlushDenormals& operator=(const FlushDenormals&) = delete;

 private:
  bool on_;
  unsigned csr_ = 0;
};

// Panels [p0, p1) of an int4 / int8 weight on AMX tiles (panels_amx.h); false where the CPU
// or the process cannot run them.
inline bool amx_int_gemm(const Weight& w, const Rows& x, int64_t p0, int64_t p1, const Output& out);

inline void gemm(const Weight& w, const Rows& x, int64_t p0, int64_t p1, const Output& out) {
  const bool dense = w.kind == kF32 || w.kind == kBF16;
  if (!dense && x.m >= kAmxMinRows && amx_int_gemm(w, x, p0, p1, out)) return;
  const FlushDenormals flush(w.kind == kBF16 && x.f32 != nullptr);
  int64_t p = p0;
  if (x.m == 1 && !dense) {
    for (; p < p1; ++p) rows_over<1, 1>(w, x, p, out);
  } else if (x.m == 1) {
    if (w.kind == kBF16) {
      for (; p + 8 <= p1; p += 8) rows_over<1, 8>(w, x, p, out);
    }
    for (; p + 4 <= p1; p += 4) rows_over<1, 4>(w, x, p, out);
  } else if (w.kind == kBF16 && x.f32 != nullptr && x.m == 16) {
    for (; p < p1; ++p) rows_over<16, 1>(w, x, p, out);
  } else if (dense && x.m > 8 && x.m <= kBlockedRows) {
    for (; p + 2 <= p1; p += 2) dense_blocked<2>(w, x, p, out);
    for (; p < p1; ++p) dense_blocked<1>(w, x, p, out);
  } else if (dense) {
    for (; p + 2 <= p1; p += 2) rows_over<8, 2>(w, x, p, out);
  }
  // the integer kinds past one row, and a dense weight's last odd panel
  for (; p < p1; ++p) rows_over<8, 1>(w, x, p, out);
}

}  // namespace hyloop::panels

#include "panels_amx.h"
