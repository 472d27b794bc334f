// A GEMM's input rows held in its weight kind's format (panels.h: ``Rows``): float32 rows,
// bfloat16 rows (even length; with their float32 widening where bfloat16 GEMMs run as float32
// multiply-adds, ``panels::g_bf16_fma``), or 16-bit codes (as int8 halves) per group of 32 with
// their scales and sums.
#pragma once

#include "panels.h"

#include <ATen/core/Tensor.h>

#include <type_traits>
#include <vector>

namespace hyloop {

class RowsBuffer {
 public:
  RowsBuffer() = default;
  RowsBuffer(panels::Kind kind, int64_t m, int64_t k) { reset(kind, m, k); }

  // Rows for an [m, k] input of `kind`; the buffers only grow (a step's batch size varies).
  void reset(panels::Kind kind, int64_t m, int64_t k) {
    borrowed_ = at::Tensor();
    const bool widened = kind == panels::kBF16 && panels::g_bf16_fma;
    const bool same_widening = kind != panels::kBF16 || f32_.empty() != widened;
    if (kind == kind_ && k == k_ && m <= capacity_ && same_widening) {
      m_ = m;
      return;
    }
    kind_ = kind;
    m_ = m;
    k_ = k;
    capacity_ = m;
    switch (kind) {
      case panels::kF32: f32_.resize(m * k); break;
      case panels::kBF16:
        bf16_.assign(m * panels::round_up(k, 2), c10::BFloat16(0.0f));
        f32_.assign(widened ? bf16_.size() : 0, 0.0f);
        break;
      case panels::kI4:
      case panels::kI8: {
        const int64_t groups = k / panels::kGroup;
        q_.resize(m * 2 * k);  // 16-bit codes as two int8 halves
        scale_.resize(m * groups);
        fsum_.resize(m * groups);
        isum_.resize(m * groups);
        break;
      }
    }
  }

  // Row i from `k` float32 or bfloat16 values.
  template <typename T>
  void set_row(int64_t i, const T* src) {
    set_cols(i, 0, k_, src);
  }

  // Columns [c0, c0 + n) of row i (whole groups of 32 for the integer kinds).
  template <typename T>
  void set_cols(int64_t i, int64_t c0, int64_t n, const T* src) {
    switch (kind_) {
      case panels::kF32:
        for (int64_t j = 0; j < n; ++j) f32_[i * k_ + c0 + j] = static_cast<float>(src[j]);
        break;
      case panels::kBF16: {
        const int64_t at = i * panels::round_up(k_, 2) + c0;
        c10::BFloat16* dst = bf16_.data() + at;
        int64_t j = 0;
#ifdef HYLOOP_P512
        if constexpr (std::is_same_v<T, float>) {
          for (; j + 16 <= n; j += 16) {
            const __m512i b = panels::bf16_bits(_mm512_loadu_ps(src + j));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + j), _mm512_cvtepi32_epi16(b));
            if (!f32_.empty()) _mm512_storeu_si512(f32_.data() + at + j, _mm512_slli_epi32(b, 16));
          }
        }
#endif
        for (int64_t t = j; t < n; ++t) dst[t] = static_cast<c10::BFloat16>(src[t]);
        if (!f32_.empty()) {
          for (; j < n; ++j) f32_[at + j] = static_cast<float>(dst[j]);
        }
        break;
      }
      case panels::kI4:
      case panels::kI8: {
        const int64_t groups = k_ / panels::kGroup, g0 = c0 / panels::kGroup;
        panels::quantize_row(src, n, q_.data() + 2 * (i * k_ + c0), scale_.data() + i * groups + g0,
                             fsum_.data() + i * groups + g0, isum_.data() + i * groups + g0);
        break;
      }
    }
  }

  // Every row of x2 [m, k] (float32 or bfloat16); a contiguous float32 x2 feeding float32
  // panels is read in place.
  void fill(const at::Tensor& x2) {
    if (kind_ == panels::kF32 && x2.scalar_type() == at::kFloat && x2.is_contiguous()) {
      borrowed_ = x2;
      return;
    }
    const at::Tensor xc = x2.contiguous();
    for (int64_t i = 0; i < m_; ++i) {
      if (xc.scalar_type() == at::kFloat) {
        set_row(i, xc.const_data_ptr<float>() + i * k_);
      } else {
        set_row(i, xc.const_data_ptr<c10::BFloat16>() + i * k_);
      }
    }
  }

  panels::Rows view() const {
    panels::Rows r;
    r.m = m_;
    r.k = k_;
    switch (kind_) {
      case panels::kF32:
        r.f32 = borrowed_.defined() ? borrowed_.const_data_ptr<float>() : f32_.data();
        r.ld = k_;
        break;
      case panels::kBF16:
        r.bf16 = bf16_.data();
        r.f32 = f32_.empty() ? nullptr : f32_.data();
        r.ld = panels::round_up(k_, 2);
        break;
      case panels::kI4:
      case panels::kI8:
        r.q = q_.data();
        r.scale = scale_.data();
        r.fsum = fsum_.data();
        r.isum = isum_.data();
        r.ld = 2 * k_;
        break;
    }
    return r;
  }

  panels::Kind kind() const { return kind_; }

 private:
  panels::Kind kind_ = panels::kF32;
  int64_t m_ = 0, k_ = 0, capacity_ = 0;
  at::Tensor borrowed_;
  std::vector<float> f32_;
  std::vector<c10::BFloat16> bf16_;
  std::vector<int8_t> q_;
  std::vector<float> scale_, fsum_;
  std::vector<int32_t> isum_;
};

}  // namespace hyloop
