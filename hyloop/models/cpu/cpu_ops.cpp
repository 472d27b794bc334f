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
  m.def("vector_math(Tensor x, int op) -> Tensor", &vector_math);
}

TORCH_LIBRARY_IMPL(hyloop, CPU, m) {
  m.impl("decode_attention", &decode_attention);
  m.impl("packed_linear_native", &packed_linear_native);
  m.impl("topk_rows", &topk_rows);
}
