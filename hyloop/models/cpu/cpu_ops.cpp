// hyloop's CPU kernels, built and loaded by cpu_ops.py (whose docstring gives each op's contract).
//
// decode_attention reads pool rows in place through the slot table, visible columns only, with
// fp32 math for every pool dtype (attend.h, shared with the decoder stack). topk_rows inserts into a k-long sorted run: for a sampler's
// few candidates far cheaper than aten's topk inside a decode step. packed_linear_native finds
// its packed weight by handle (register_packed / unregister_packed) and calls oneDNN through the
// dispatcher, so a compiled step's C++ wrapper reaches it with no Python in between.

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>

#include "attend.h"
#include "cpu_pool.h"
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <mutex>
#include <optional>
#include <tuple>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace {

template <typename T>
void attend(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
            const at::Tensor& slots, const at::Tensor& bias, double scale, at::Tensor& out) {
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t Hkv = k_buf.size(1), L = slots.size(1), G = Hq / Hkv;
  const T* qp = q.const_data_ptr<T>();
  const T* kp = k_buf.const_data_ptr<T>();
  const T* vp = v_buf.const_data_ptr<T>();
  const int64_t* sp = slots.const_data_ptr<int64_t>();
  const float* bp = bias.const_data_ptr<float>();
  T* op = out.mutable_data_ptr<T>();
  // One task per (sequence, kv head): its G query heads share every K and V row read.
  hyloop::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), acc(G * D), scratch(G * (L + 1));
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b = t / Hkv, h = t % Hkv;
      const T* qh = qp + (b * Hq + h * G) * D;
      for (int64_t i = 0; i < G * D; ++i) qf[i] = static_cast<float>(qh[i]);
      hyloop::attend::group(qf.data(), G, D, kp, k_buf.stride(0), vp, v_buf.stride(0), h,
                            sp + b * L, bp + b * L, L, static_cast<float>(scale), scratch.data(),
                            acc.data());
      T* o = op + (b * Hq + h * G) * D;
      for (int64_t i = 0; i < G * D; ++i) o[i] = static_cast<T>(acc[i]);
    }
  });
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
                            const at::Tensor& slots, const at::Tensor& bias, double scale) {
  TORCH_CHECK(q.dim() == 3, "decode_attention: q must be [B, Hq, D], got ", q.sizes());
  TORCH_CHECK(k_buf.dim() == 3 && v_buf.sizes() == k_buf.sizes(),
              "decode_attention: k_buf / v_buf must be [slots, Hkv, D] alike");
  TORCH_CHECK(k_buf.size(2) == q.size(2) && q.size(1) % k_buf.size(1) == 0,
              "decode_attention: head dims do not match");
  TORCH_CHECK(k_buf.stride(2) == 1 && k_buf.stride(1) == k_buf.size(2) && v_buf.stride(2) == 1 &&
                  v_buf.stride(1) == v_buf.size(2),
              "decode_attention: pool rows must be contiguous [Hkv, D]");
  TORCH_CHECK(q.scalar_type() == k_buf.scalar_type() && k_buf.scalar_type() == v_buf.scalar_type(),
              "decode_attention: q, k_buf and v_buf must share a dtype");
  TORCH_CHECK(slots.dim() == 2 && slots.size(0) == q.size(0) &&
                  slots.scalar_type() == at::kLong,
              "decode_attention: slots must be int64 [B, L]");
  TORCH_CHECK(bias.sizes() == slots.sizes() && bias.scalar_type() == at::kFloat,
              "decode_attention: bias must be float32 [B, L]");
  const auto qc = q.contiguous();
  const auto sc = slots.contiguous();
  const auto bc = bias.contiguous();
  auto out = at::empty_like(qc);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "decode_attention",
                                  [&] { attend<scalar_t>(qc, k_buf, v_buf, sc, bc, scale, out); });
  return out;
}

std::tuple<at::Tensor, at::Tensor> topk_rows(const at::Tensor& x, int64_t k) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "topk_rows: x must be fp32 [B, V]");
  const int64_t B = x.size(0), V = x.size(1);
  TORCH_CHECK(1 <= k && k <= V, "topk_rows: k=", k, " outside [1, ", V, "]");
  const auto xc = x.contiguous();
  auto values = at::empty({B, k}, xc.options());
  auto indices = at::empty({B, k}, xc.options().dtype(at::kLong));
  const float* xp = xc.const_data_ptr<float>();
  float* vp = values.mutable_data_ptr<float>();
  int64_t* ip = indices.mutable_data_ptr<int64_t>();
  hyloop::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const float* row = xp + b * V;
      float* vals = vp + b * k;
      int64_t* ids = ip + b * k;
      int64_t n = 0;
      for (int64_t i = 0; i < V; ++i) {
        const float v = row[i];
        if (n == k && !(v > vals[k - 1])) continue;  // strict: an equal later value stays out
        int64_t j = n < k ? n : k - 1;
        while (j > 0 && vals[j - 1] < v) {
          vals[j] = vals[j - 1];
          ids[j] = ids[j - 1];
          --j;
        }
        vals[j] = v;
        ids[j] = i;
        if (n < k) ++n;
      }
    }
  });
  return {values, indices};
}

// The first index of each row's largest value, as torch's argmax over a row: a NaN is the
// largest (the first NaN's index), ties go to the lower index.
at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "argmax_rows: x must be fp32 [B, V]");
  const int64_t B = x.size(0), V = x.size(1);
  TORCH_CHECK(V > 0, "argmax_rows: empty rows");
  const auto xc = x.contiguous();
  auto out = at::empty({B}, xc.options().dtype(at::kLong));
  const float* xp = xc.const_data_ptr<float>();
  int64_t* op = out.mutable_data_ptr<int64_t>();
  hyloop::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const float* row = xp + b * V;
      int64_t i = 0, best = 0;
      float top = row[0];
#ifdef HYLOOP_A512
      if (V >= 32 && V <= INT32_MAX) {
        // Per lane: its largest value and the first index holding it; a NaN lane ends the
        // vector scan and the row is finished by the scalar loop from its first NaN block.
        __m512 lane_max = _mm512_loadu_ps(row);
        __m512i lane_idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        __m512i idx = lane_idx;
        const __m512i step = _mm512_set1_epi32(16);
        bool nan = _mm512_cmp_ps_mask(lane_max, lane_max, _CMP_UNORD_Q) != 0;
        for (i = 16; !nan && i + 16 <= V; i += 16) {
          idx = _mm512_add_epi32(idx, step);
          const __m512 v = _mm512_loadu_ps(row + i);
          nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) != 0;
          const __mmask16 gt = _mm512_cmp_ps_mask(v, lane_max, _CMP_GT_OQ);
          lane_max = _mm512_mask_mov_ps(lane_max, gt, v);
          lane_idx = _mm512_mask_mov_epi32(lane_idx, gt, idx);
        }
        if (!nan) {
          alignas(64) float vals[16];
          alignas(64) int32_t ids[16];
          _mm512_store_ps(vals, lane_max);
          _mm512_store_si512(ids, lane_idx);
          top = vals[0];
          best = ids[0];
          for (int l = 1; l < 16; ++l)
            if (vals[l] > top || (vals[l] == top && ids[l] < best)) {
              top = vals[l];
              best = ids[l];
            }
        } else {
          i = 0;  // a NaN somewhere: the scalar rule over the whole row
          top = row[0];
          best = 0;
        }
      }
#endif
      for (i = std::max<int64_t>(i, 1); i < V; ++i) {
        const float v = row[i];
        if (std::isnan(top)) break;
        if (std::isnan(v) || v > top) {
          top = v;
          best = i;
        }
      }
      op[b] = best;
    }
  });
  return out;
}

template <typename T>
inline float widen(T v) {
  return static_cast<float>(v);
}

// hyloop::rms_norm's CPU kernel (layers/norm.py gives the op, numerics.py the definition): per
// row r = 1 / sqrt(lane sum of squares / n + eps); plain: weight * (x * r in x's dtype), in the
// promoted dtype; zero-centred: x * r * (1 + weight) in x's dtype.
template <typename X, typename W, typename O>
void rms_rows(const X* x, const W* w, O* out, int64_t rows, int64_t n, float eps, bool zc) {
  hyloop::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> h(n), wf(n);
    for (int64_t i = 0; i < n; ++i) wf[i] = zc ? 1.0f + widen(w[i]) : widen(w[i]);
    for (int64_t r = begin; r < end; ++r) {
      const X* xr = x + r * n;
      for (int64_t i = 0; i < n; ++i) h[i] = widen(xr[i]);
      const float ms = hyloop::attend::sum_squares(h.data(), n) / static_cast<float>(n);
      const float inv = 1.0f / std::sqrt(ms + eps);
      O* o = out + r * n;
      for (int64_t i = 0; i < n; ++i) {
        const float v = h[i] * inv;
        o[i] = zc ? static_cast<O>(v * wf[i]) : static_cast<O>(widen(static_cast<X>(v)) * wf[i]);
      }
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool zero_centered) {
  const int64_t n = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == n, "rms_norm: weight must be [", n, "]");
  const auto xc = x.contiguous();
  const auto wc = weight.contiguous();
  const auto out_type = zero_centered ? x.scalar_type() : c10::promoteTypes(weight.scalar_type(), x.scalar_type());
  auto out = at::empty(x.sizes(), x.options().dtype(out_type));
  const int64_t rows = n == 0 ? 0 : x.numel() / n;
  const float e = static_cast<float>(eps);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm x", [&] {
    using X = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, wc.scalar_type(), "rms_norm w", [&] {
      using W = scalar_t;
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out_type, "rms_norm out", [&] {
        rms_rows<X, W, scalar_t>(xc.const_data_ptr<X>(), wc.const_data_ptr<W>(),
                                 out.mutable_data_ptr<scalar_t>(), rows, n, e, zero_centered);
      });
    });
  });
  return out;
}

constexpr int64_t kSiluChunk = 2048;

inline void silu_chunk(const float* x, float* out, int64_t m) { hyloop::attend::silu(x, out, m); }

template <typename T>
void silu_chunk(const T* x, T* out, int64_t m) {
  float in[kSiluChunk], res[kSiluChunk];
  for (int64_t i = 0; i < m; ++i) in[i] = widen(x[i]);
  hyloop::attend::silu(in, res, m);
  for (int64_t i = 0; i < m; ++i) out[i] = static_cast<T>(res[i]);
}

// hyloop::silu's CPU kernel: attend.h's SiLU in float32, in x's dtype.
at::Tensor silu(const at::Tensor& x) {
  const auto xc = x.contiguous();
  auto out = at::empty_like(xc);
  const int64_t total = xc.numel();
  constexpr int64_t kChunk = kSiluChunk;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu", [&] {
    const scalar_t* xp = xc.const_data_ptr<scalar_t>();
    scalar_t* op = out.mutable_data_ptr<scalar_t>();
    hyloop::parallel_for(0, (total + kChunk - 1) / kChunk, 1, [&](int64_t begin, int64_t end) {
      for (int64_t c = begin; c < end; ++c) {
        const int64_t i0 = c * kChunk, m = std::min(kChunk, total - i0);
        silu_chunk(xp + i0, op + i0, m);
      }
    });
  });
  return out;
}

// attend.h's vector math on x (float32), for tests: 0 e^x, 1 SiLU (elementwise), 2 the lane sum
// of squares of each row of x [R, n] -> [R].
at::Tensor vector_math(const at::Tensor& x, int64_t op) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2, "vector_math: x float32 [R, n]");
  TORCH_CHECK(op >= 0 && op <= 2, "vector_math: op ", op, " is not 0, 1 or 2");
  const auto xc = x.contiguous();
  const int64_t R = xc.size(0), n = xc.size(1);
  const float* xp = xc.const_data_ptr<float>();
  if (op == 2) {
    auto out = at::empty({R}, xc.options());
    for (int64_t r = 0; r < R; ++r)
      out.mutable_data_ptr<float>()[r] = hyloop::attend::sum_squares(xp + r * n, n);
    return out;
  }
  auto out = at::empty_like(xc);
  float* op_ = out.mutable_data_ptr<float>();
  if (op == 0) {
    std::copy(xp, xp + R * n, op_);
    hyloop::attend::exp_inplace(op_, R * n);
  } else {
    hyloop::attend::silu(xp, op_, R * n);
  }
  return out;
}

struct Packed {
  at::Tensor weight;  // oneDNN-packed (mkldnn layout)
  std::optional<at::Tensor> bias;
};

std::mutex registry_mutex;
std::unordered_map<int64_t, Packed>& registry() {
  static std::unordered_map<int64_t, Packed> packed;
  return packed;
}

void register_packed(int64_t handle, const at::Tensor& weight,
                     const std::optional<at::Tensor>& bias) {
  std::lock_guard<std::mutex> guard(registry_mutex);
  registry()[handle] = Packed{weight, bias};
}

void unregister_packed(int64_t handle) {
  std::lock_guard<std::mutex> guard(registry_mutex);
  registry().erase(handle);
}

at::Tensor packed_linear_native(const at::Tensor& x, int64_t handle) {
  Packed layer;
  {
    std::lock_guard<std::mutex> guard(registry_mutex);
    const auto it = registry().find(handle);
    TORCH_CHECK(it != registry().end(), "packed_linear_native: no packed weight ", handle);
    layer = it->second;
  }
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack;
  stack.reserve(6);
  stack.emplace_back(x);
  stack.emplace_back(layer.weight);
  stack.emplace_back(layer.bias);
  stack.emplace_back(std::string("none"));
  stack.emplace_back(c10::List<std::optional<at::Scalar>>());
  stack.emplace_back(std::string(""));
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hyloop, m) {
  m.def("register_packed(int handle, Tensor weight, Tensor? bias) -> ()", &register_packed);
  m.def("unregister_packed(int handle) -> ()", &unregister_packed);
  m.def("packed_linear_native(Tensor x, int handle) -> Tensor");
  m.def("topk_rows(Tensor x, int k) -> (Tensor values, Tensor indices)");
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.def("vector_math(Tensor x, int op) -> Tensor", &vector_math);
}

TORCH_LIBRARY_IMPL(hyloop, CPU, m) {
  m.impl("decode_attention", &decode_attention);
  m.impl("packed_linear_native", &packed_linear_native);
  m.impl("topk_rows", &topk_rows);
  m.impl("argmax_rows", &argmax_rows);
  m.impl("rms_norm", &rms_norm);
  m.impl("silu", &silu);
}
