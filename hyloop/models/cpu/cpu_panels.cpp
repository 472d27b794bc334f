// Operators over panel weights (panels.h gives the layouts): packing at load time and
// panel_linear, a Linear's GEMM on its panels for any row count (cpu_ops.py gives each op's
// contract). The rows' format (float32, bfloat16, or 16-bit codes per group) is prepared once
// per call and the panels are split over a team of threads (cpu_pool.h).

#include "cpu_pool.h"
#include "panels.h"
#include "panel_rows.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/zeros.h>
#include <sys/mman.h>
#include <torch/library.h>

#include <chrono>
#include <cstdlib>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

namespace {

namespace P = hyloop::panels;

// A zeroed byte buffer for packed weights. Large ones are 2 MiB aligned and asked for as huge
// pages: a step streams every weight once, and with 4 KiB pages each page is a TLB miss (a
// two-dimensional walk under a hypervisor).
at::Tensor weight_buffer(int64_t bytes) {
  constexpr int64_t kHuge = int64_t{2} << 20;
  if (bytes < 2 * kHuge) return at::zeros({bytes}, at::kByte);
  const int64_t size = P::round_up(bytes, kHuge);
  void* p = nullptr;
  TORCH_CHECK(posix_memalign(&p, kHuge, size) == 0, "panels: cannot allocate ", size, " bytes");
#ifdef MADV_HUGEPAGE
  madvise(p, size, MADV_HUGEPAGE);
#endif
  std::memset(p, 0, size);
  return at::from_blob(p, {bytes}, [](void* q) { std::free(q); }, at::TensorOptions(at::kByte));
}

void check_split(int64_t n, int64_t split) {
  TORCH_CHECK(split == 0 || n == 2 * split, "panels: split ", split, " needs 2 x split = ", n,
              " output rows");
}

at::Tensor pack_panels(const at::Tensor& weight, int64_t split) {
  TORCH_CHECK(weight.dim() == 2, "pack_panels: weight [N, K], got ", weight.sizes());
  TORCH_CHECK(weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16,
              "pack_panels: float32 or bfloat16 weight, got ", weight.scalar_type());
  const int64_t n = weight.size(0), k = weight.size(1);
  check_split(n, split);
  const P::Kind kind = weight.scalar_type() == at::kFloat ? P::kF32 : P::kBF16;
  const at::Tensor w = weight.contiguous();
  at::Tensor out = weight_buffer(P::make_weight(kind, n, k, false, split, nullptr).panels *
                                 P::panel_bytes(kind, k, false));
  if (kind == P::kF32) {
    P::pack_dense(w.const_data_ptr<float>(), n, k, split, kind, out.mutable_data_ptr<uint8_t>());
  } else {
    P::pack_dense(w.const_data_ptr<c10::BFloat16>(), n, k, split, kind,
                  out.mutable_data_ptr<uint8_t>());
  }
  return out;
}

at::Tensor pack_panels_i4(const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& mins,
                          int64_t split, bool half) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte,
              "pack_panels_i4: codes uint8 [N, K]");
  const int64_t n = codes.size(0), k = codes.size(1);
  TORCH_CHECK(k % P::kGroup == 0, "pack_panels_i4: K = ", k, " is not whole groups of 32");
  const int64_t groups = k / P::kGroup;
  TORCH_CHECK(scale.scalar_type() == at::kFloat && mins.scalar_type() == at::kFloat &&
                  scale.numel() == n * groups && mins.numel() == n * groups,
              "pack_panels_i4: scale and mins float32 [N, K / 32]");
  check_split(n, split);
  const at::Tensor c = codes.contiguous(), s = scale.contiguous(), m = mins.contiguous();
  const P::Weight shape = P::make_weight(P::kI4, n, k, half, split, nullptr);
  at::Tensor out = weight_buffer(shape.panels * shape.bytes);
  P::pack_i4(c.const_data_ptr<uint8_t>(), s.const_data_ptr<float>(), m.const_data_ptr<float>(), n,
             k, split, half, out.mutable_data_ptr<uint8_t>());
  return out;
}

at::Tensor pack_panels_i8(const at::Tensor& codes, const at::Tensor& scale, int64_t split) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kChar,
              "pack_panels_i8: codes int8 [N, K]");
  const int64_t n = codes.size(0), k = codes.size(1);
  TORCH_CHECK(k % P::kGroup == 0, "pack_panels_i8: K = ", k, " is not whole groups of 32");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == n * (k / P::kGroup),
              "pack_panels_i8: scale float32 [N, K / 32]");
  check_split(n, split);
  const at::Tensor c = codes.contiguous(), s = scale.contiguous();
  const P::Weight shape = P::make_weight(P::kI8, n, k, false, split, nullptr);
  at::Tensor out = weight_buffer(shape.panels * shape.bytes);
  P::pack_i8(c.const_data_ptr<int8_t>(), s.const_data_ptr<float>(), n, k, split,
             out.mutable_data_ptr<uint8_t>());
  return out;
}

// Rows x2 [m, k] @ W.T (+ bias) into `out` (x's dtype, row stride n): row i at out row
// rows[i] where `rows` is given, else i. Panel pairs are split over the team.
void linear_into(const at::Tensor& x2, const at::Tensor& panels, int64_t kind, int64_t n,
                 int64_t k, int64_t split, bool half, const std::optional<at::Tensor>& bias,
                 at::Tensor& out, const int64_t* rows) {
  TORCH_CHECK(kind >= P::kF32 && kind <= P::kI8, "panel_linear: kind ", kind);
  TORCH_CHECK(x2.scalar_type() == at::kFloat || x2.scalar_type() == at::kBFloat16,
              "panel_linear: float32 or bfloat16 x");
  const P::Weight w =
      P::make_weight(static_cast<P::Kind>(kind), n, k, half, split, panels.const_data_ptr<uint8_t>());
  TORCH_CHECK(panels.scalar_type() == at::kByte && panels.numel() == w.panels * w.bytes,
              "panel_linear: panels hold ", panels.numel(), " bytes, expected ", w.panels * w.bytes);
  std::optional<at::Tensor> b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == n, "panel_linear: bias has ", bias->numel(), " values, not ", n);
    b = bias->to(at::kFloat).contiguous();
  }
  const int64_t m = x2.size(0);
  hyloop::RowsBuffer buffer(w.kind, m, k);
  buffer.fill(x2);
  P::Output o;
  o.ld = n;
  o.bias = b.has_value() ? b->const_data_ptr<float>() : nullptr;
  o.rows = rows;
  if (x2.scalar_type() == at::kFloat) {
    o.f32 = out.mutable_data_ptr<float>();
  } else {
    o.bf16 = out.mutable_data_ptr<c10::BFloat16>();
  }
  const int64_t units = (w.panels + 1) / 2;  // pairs of panels: gate/up pairs stay together
  const P::Rows r = buffer.view();
  if (m > 0) {
    hyloop::run_team(std::min<int64_t>(hyloop::team_size(), units), [&](int rank, hyloop::Team& team) {
      const int64_t u0 = units * rank / team.size(), u1 = units * (rank + 1) / team.size();
      P::gemm(w, r, 2 * u0, std::min(w.panels, 2 * u1), o);
    });
  }
}

std::vector<int64_t> out_shape(const at::Tensor& x, int64_t n) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  return shape;
}

// y = x @ W.T (+ bias) over the panels, in x's dtype.
at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels, int64_t kind, int64_t n,
                        int64_t k, int64_t split, bool half, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.size(-1) == k, "panel_linear: x has ", x.size(-1), " columns, the weight ", k);
  const at::Tensor x2 = x.reshape({-1, k});
  at::Tensor out = at::empty({x2.size(0), n}, x.options());
  linear_into(x2, panels, kind, n, k, split, half, bias, out, nullptr);
  return out.view(out_shape(x, n));
}

// ``panel_linear`` with `live` (bool, one per row of x): only the live rows are computed, each
// written straight into its place, and the others are zeros (a verify step's padding
// positions): a row's bits do not depend on the rows beside it.
at::Tensor panel_linear_live(const at::Tensor& x, const at::Tensor& panels, int64_t kind,
                             int64_t n, int64_t k, int64_t split, bool half,
                             const std::optional<at::Tensor>& bias, const at::Tensor& live) {
  TORCH_CHECK(x.size(-1) == k, "panel_linear: x has ", x.size(-1), " columns, the weight ", k);
  const at::Tensor x2 = x.reshape({-1, k});
  const int64_t m = x2.size(0);
  TORCH_CHECK(live.scalar_type() == at::kBool && live.numel() == m,
              "panel_linear_live: live bool, one per row");
  const at::Tensor flags = live.reshape({m}).contiguous();
  const at::Tensor rows = flags.nonzero().reshape({-1}).contiguous();
  at::Tensor out = at::empty({m, n}, x.options());
  const bool* on = flags.const_data_ptr<bool>();
  const int64_t row_bytes = n * static_cast<int64_t>(out.element_size());
  auto* base = static_cast<char*>(out.data_ptr());
  for (int64_t i = 0; i < m; ++i) {  // the padding's rows alone are zeroed
    if (!on[i]) std::memset(base + i * row_bytes, 0, row_bytes);
  }
  if (rows.numel() > 0) {
    linear_into(x2.index_select(0, rows), panels, kind, n, k, split, half, bias, out,
                rows.const_data_ptr<int64_t>());
  }
  return out.view(out_shape(x, n));
}

// Which bfloat16 GEMM path runs (panels.h: ``g_bf16_fma``); returns the one now set (a build
// without vdpbf16ps keeps the float32 path).
bool set_bf16_dot(bool fma) {
#ifdef HYLOOP_P512_BF16
  P::g_bf16_fma = fma;
#endif
  return P::g_bf16_fma;
}

// Seconds one 16-row, 8-panel bfloat16 GEMM over K = 1024 takes on this core (weights in L2,
// best of 7 timings of 16 runs) on the vdpbf16ps path and on the float32 path; the first is
// +inf where the build has no vdpbf16ps. What the rule in kernel_choice measures: both paths
// compute the same bits, so only their speed tells them apart.
std::tuple<double, double> bf16_dot_times() {
  constexpr int64_t kRows = 16, kK = 1024, kPanels = 8;
  std::vector<c10::BFloat16> wsrc(kPanels * P::kCols * kK), xsrc(kRows * kK);
  for (size_t i = 0; i < wsrc.size(); ++i) wsrc[i] = c10::BFloat16(0.001f * static_cast<float>(i % 97));
  for (size_t i = 0; i < xsrc.size(); ++i) xsrc[i] = c10::BFloat16(0.01f * static_cast<float>(i % 89));
  const P::Weight shape = P::make_weight(P::kBF16, kPanels * P::kCols, kK, false, 0, nullptr);
  std::vector<uint8_t> packed(shape.panels * shape.bytes, 0);
  P::pack_dense(wsrc.data(), kPanels * P::kCols, kK, 0, P::kBF16, packed.data());
  const P::Weight w = P::make_weight(P::kBF16, kPanels * P::kCols, kK, false, 0, packed.data());
  std::vector<float> xf(xsrc.begin(), xsrc.end()), out(kRows * kPanels * P::kCols);
  P::Output o;
  o.f32 = out.data();
  o.ld = kPanels * P::kCols;
  auto time = [&](const float* widened) {
    P::Rows r;
    r.m = kRows;
    r.k = r.ld = kK;
    r.bf16 = xsrc.data();
    r.f32 = widened;
    double best = 1e30;
    for (int t = 0; t < 7; ++t) {
      const auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < 16; ++i) P::gemm(w, r, 0, w.panels, o);
      best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    return best / 16;
  };
  const double fma = time(xf.data());
#ifdef HYLOOP_P512_BF16
  return {time(nullptr), fma};
#else
  return {std::numeric_limits<double>::infinity(), fma};
#endif
}

// Whether integer GEMMs of a few rows or more may run on AMX tiles (panels_amx.h); returns
// whether they now do (false where the CPU or the build has none).
bool set_amx(bool on) { return P::set_amx_int8(on); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(hyloop, m) {
  m.def("pack_panels(Tensor weight, int split) -> Tensor");
  m.def("pack_panels_i4(Tensor codes, Tensor scale, Tensor mins, int split, bool half) -> Tensor");
  m.def("pack_panels_i8(Tensor codes, Tensor scale, int split) -> Tensor");
  m.def(
      "panel_linear(Tensor x, Tensor panels, int kind, int n, int k, int split, bool half, "
      "Tensor? bias) -> Tensor");
  m.def(
      "panel_linear_live(Tensor x, Tensor panels, int kind, int n, int k, int split, bool half, "
      "Tensor? bias, Tensor live) -> Tensor");
  m.def("set_bf16_dot(bool fma) -> bool");
  m.def("bf16_dot_times() -> (float, float)");
  m.def("set_amx(bool on) -> bool");
}

TORCH_LIBRARY_IMPL(hyloop, CPU, m) {
  m.impl("pack_panels", &pack_panels);
  m.impl("pack_panels_i4", &pack_panels_i4);
  m.impl("pack_panels_i8", &pack_panels_i8);
  m.impl("panel_linear", &panel_linear);
  m.impl("panel_linear_live", &panel_linear_live);
}

TORCH_LIBRARY_IMPL(hyloop, CompositeExplicitAutograd, m) {
  m.impl("set_bf16_dot", &set_bf16_dot);
  m.impl("bf16_dot_times", &bf16_dot_times);
  m.impl("set_amx", &set_amx);
}
