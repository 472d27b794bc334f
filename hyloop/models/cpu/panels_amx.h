// The integer panels' dot products on AMX tiles, where the CPU has them (included by panels.h).
//
// An int4 / int8 group's dot product is an exact integer sum, so which unit computes it changes
// no bit: a tile of up to 16 rows takes each group's two activation halves as two A tiles
// (rows x 32 signed bytes, read in place at the rows' stride), the group's weight codes as a B
// tile (8 k-quads x 16 columns x 4 unsigned bytes: the kI8 chunks in place, the kI4 ones once
// unpacked from their nibbles), and TDPBSUD leaves the two halves' sums per row and column; the
// group's step of the chain (the same fused multiply-adds as ``tile_i4`` / ``tile_i8``, in the
// same order) then runs on vectors. Where the VNNI tiles issue 16 vpdpbusd per row, column block
// and group, the tile unit takes two instructions for 16 rows.
//
// Tiles are per thread state: a GEMM loads its configuration (rows per block) itself, since
// oneDNN or a previous GEMM may have left another, and releases the tiles when done. Linux
// hands a process the tile data state when it asks once (``amx_permitted``).

#pragma once

#if defined(HYLOOP_P512_VNNI) && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define HYLOOP_AMX_INT8 1
#include <sys/syscall.h>
#include <unistd.h>

#include <vector>
#endif

namespace hyloop::panels {

// Whether integer GEMMs of at least ``kAmxMinRows`` (panels.h) rows run on AMX tiles (settable for tests:
// ``set_amx``); the same bits either way.
inline bool g_amx_int8 = true;
constexpr int64_t kAmxRows = 16;  // rows per tile

#ifdef HYLOOP_AMX_INT8

inline bool amx_permitted() {
  // arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA): once per process.
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

inline bool amx_int8_ready() { return g_amx_int8 && amx_permitted(); }

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0, 1: a group's h and l halves of `rows` rows; per panel q (0, 1): 2 + 3q its codes,
// 3 + 3q and 4 + 3q the h and l sums.
inline void amx_configure(int rows) {
  TileConfig c;
  c.rows[0] = c.rows[1] = static_cast<uint8_t>(rows);
  c.colsb[0] = c.colsb[1] = kGroup;
  for (int q = 0; q < 2; ++q) {
    c.rows[2 + 3 * q] = kGroup / 4;
    c.colsb[2 + 3 * q] = 64;
    c.rows[3 + 3 * q] = c.rows[4 + 3 * q] = static_cast<uint8_t>(rows);
    c.colsb[3 + 3 * q] = c.colsb[4 + 3 * q] = 64;
  }
  _tile_loadconfig(&c);
}

// An int4 panel's codes for every group as B tiles: [G][8 k-quads][16 columns][4 bytes].
inline void unpack_i4_panel(const uint8_t* panel, int64_t G, int64_t block, uint8_t* dst) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* b = panel + g * block;
    for (int c = 0; c < 4; ++c) {
      const __m512i v = _mm512_loadu_si512(b + 64 * c);
      _mm512_storeu_si512(dst + g * 512 + 64 * c, _mm512_and_si512(v, low));
      _mm512_storeu_si512(dst + g * 512 + 64 * (4 + c),
                          _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
    }
  }
}

// Rows [0, x.m) times panels [p, p + NP) of an int4 / int8 weight (NP 1 or 2).
template <int NP>
inline void amx_int_panels(const Weight& w, const Rows& x, int64_t p, const Output& out) {
  const int64_t G = x.k / kGroup, sb = w.half ? 2 : 4;
  const bool i4 = w.kind == kI4;
  const int64_t block = i4 ? 256 + 2 * kCols * sb : 512 + kCols * 4;
  thread_local std::vector<uint8_t> unpacked;
  const uint8_t* codes[NP];
  if (i4) {
    unpacked.resize(NP * G * 512);
    for (int q = 0; q < NP; ++q) unpack_i4_panel(w.panel(p + q), G, block, unpacked.data() + q * G * 512);
  }
  for (int q = 0; q < NP; ++q) codes[q] = i4 ? unpacked.data() + q * G * 512 : w.panel(p + q);
  const int64_t code_step = i4 ? 512 : block;
  alignas(64) int32_t hs[NP][kAmxRows][kCols], ls[NP][kAmxRows][kCols];
  alignas(64) float tile[kAmxRows][NP][kCols];
  int configured = 0;
  for (int64_t m0 = 0; m0 < x.m; m0 += kAmxRows) {
    const int rows = static_cast<int>(std::min<int64_t>(kAmxRows, x.m - m0));
    if (rows != configured) amx_configure(configured = rows);
    __m512 acc[NP];
    for (int m = 0; m < rows; ++m)
      for (int q = 0; q < NP; ++q) _mm512_store_ps(tile[m][q], _mm512_setzero_ps());
    for (int64_t g = 0; g < G; ++g) {
      const int8_t* a = x.q + m0 * x.ld + 2 * g * kGroup;
      _tile_loadd(0, a, x.ld);
      _tile_loadd(1, a + kGroup, x.ld);
      _tile_loadd(2, codes[0] + g * code_step, 64);
      _tile_zero(3);
      _tile_zero(4);
      _tile_dpbsud(3, 0, 2);
      _tile_dpbsud(4, 1, 2);
      if constexpr (NP == 2) {
        _tile_loadd(5, codes[1] + g * code_step, 64);
        _tile_zero(6);
        _tile_zero(7);
        _tile_dpbsud(6, 0, 5);
        _tile_dpbsud(7, 1, 5);
      }
      _tile_stored(3, hs[0], 64);
      _tile_stored(4, ls[0], 64);
      if constexpr (NP == 2) {
        _tile_stored(6, hs[NP - 1], 64);
        _tile_stored(7, ls[NP - 1], 64);
      }
      for (int q = 0; q < NP; ++q) {
        const uint8_t* b = w.panel(p + q) + g * block;
        const __m512 sc = i4 ? load_scales(b + 256, w.half) : _mm512_loadu_ps(b + 512);
        const __m512 mn = i4 ? load_scales(b + 256 + kCols * sb, w.half) : _mm512_setzero_ps();
        for (int m = 0; m < rows; ++m) {
          const int64_t r = (m0 + m) * G + g;
          __m512i dot = join_halves(_mm512_load_si512(hs[q][m]), _mm512_load_si512(ls[q][m]));
          if (!i4) dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(128 * x.isum[r]));
          acc[q] = _mm512_load_ps(tile[m][q]);
          acc[q] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(sc, _mm512_set1_ps(x.scale[r])),
                                   acc[q]);
          if (i4) acc[q] = _mm512_fmadd_ps(mn, _mm512_set1_ps(x.fsum[r]), acc[q]);
          _mm512_store_ps(tile[m][q], acc[q]);
        }
      }
    }
    store_tile<NP>(w, p, m0, rows, tile, out);
  }
}

// Panels [p0, p1) of an integer weight on tiles; false where tiles cannot run here.
inline bool amx_int_gemm(const Weight& w, const Rows& x, int64_t p0, int64_t p1, const Output& out) {
  if (!amx_int8_ready()) return false;
  int64_t p = p0;
  for (; p + 2 <= p1; p += 2) amx_int_panels<2>(w, x, p, out);
  if (p < p1) amx_int_panels<1>(w, x, p, out);
  _tile_release();
  return true;
}

#else

inline bool amx_int_gemm(const Weight&, const Rows&, int64_t, int64_t, const Output&) { return false; }

#endif

// Whether integer GEMMs may run on tiles (``set_amx``); returns whether they now do.
inline bool set_amx_int8(bool on) {
  g_amx_int8 = on;
#ifdef HYLOOP_AMX_INT8
  return on && amx_permitted();
#else
  return false;
#endif
}

}  // namespace hyloop::panels
