// A dense decoder stack's decode step in one operator (cpu_ops.py gives the contract).
//
// A decode step of a 30-layer model is a few hundred small operators; called one by one (from
// Python, or a compiled step's wrapper) each pays a dispatch and a wake-up of the threads it
// splits over, which at batch 1 costs as much as its arithmetic. Here one team of threads
// (cpu_pool.h) runs every layer, its phases separated by barriers:
//
//   norm (rows) | qkv GEMM (panels) | q/k norm, RoPE, K/V write, attention ((row, kv head) tasks;
//   a verify step: (a request's rows, kv head) tasks)
//   | o GEMM + residual (panels) | norm (rows) | gate/up GEMM + SiLU * up (panel pairs)
//   | down GEMM + residual (panels)
//
// Each GEMM reads its weight's panels (panels.h), and its input rows are written in that
// weight's format by the phase before. In a bfloat16 model every value is rounded where the
// PyTorch layers round it (each projection's output, the norms, RoPE's products, SiLU, the
// residual adds), so the two paths differ only in summation order.

#include "attend.h"
#include "cpu_pool.h"
#include "panel_rows.h"
#include "panels.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <tuple>
#include <unordered_map>
#include <vector>

namespace {

namespace P = hyloop::panels;

inline float round_to(float v, bool bf16) {
  return bf16 ? static_cast<float>(c10::BFloat16(v)) : v;
}

// v[0, n) rounded to bfloat16 in place (when `bf16`).
inline void round_all(float* v, int64_t n, bool bf16) {
  if (!bf16) return;
  int64_t i = 0;
#if defined(HYLOOP_P512)
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(v + i, P::round_bf16(_mm512_loadu_ps(v + i)));
#endif
  for (; i < n; ++i) v[i] = round_to(v[i], true);
}

#if defined(HYLOOP_P512)
inline __m512 round_if(__m512 v, bool bf16) { return bf16 ? P::round_bf16(v) : v; }
#endif

struct Proj {
  at::Tensor data;  // the panels (kept alive here)
  P::Weight w;
  at::Tensor bias;  // float32 [n] or undefined
  const float* bias_ptr() const { return bias.defined() ? bias.const_data_ptr<float>() : nullptr; }
};

struct Layer {
  at::Tensor in_norm, post_norm;  // float32 [hidden]
  at::Tensor q_norm, k_norm;      // float32 [head_dim], or undefined
  Proj qkv, o, gate_up, down;
};

struct Spec {
  int64_t hidden = 0, heads = 0, kv_heads = 0, head_dim = 0, inter = 0;
  double eps = 1e-6, scale = 1.0;
  bool bf16 = false;  // the model's dtype (else float32)
};

// Units [front, back) of a phase still to run, one rank's, packed in one word (front high).
struct alignas(64) Span {
  std::atomic<uint64_t> units{0};
};

// Per-call buffers, grown to the largest batch seen.
struct Workspace {
  int64_t rows = 0, threads = 0;  // capacity: the largest batch and team seen
  std::vector<float> resid, qkv, proj, gate_up, act;
  hyloop::RowsBuffer in_rows, attn_rows, mlp_rows, down_rows;
  // Per rank, for a batch of at most one row per rank: every rank normalises every row into
  // its own buffers, so the norm phases need no barrier (and no rank idles through them).
  std::vector<hyloop::RowsBuffer> own_in, own_mlp;
  std::vector<std::vector<float>> scratch;  // per rank: attention scores and accumulators
  std::unique_ptr<Span[]> spans;            // per rank: its units of the phase running now
  int64_t n_spans = 0;
};

// Where a step's time goes inside the stack, per rank (``stack_phase_times``): the GEMMs, the
// norms, attention (with q/k norms, RoPE and the K/V write) and the barriers' waits.
enum Phase : int { kNorm, kQkv, kAttn, kO, kGateUp, kDown, kWait, kPhases };
using PhaseSeconds = std::array<double, kPhases>;

struct Stack {
  Spec spec;
  std::vector<Layer> layers;
  Workspace ws;
  std::mutex use;  // one call at a time per stack (its workspace)
  bool timed = false;  // accumulate phase_s (set by stack_phase_times; read under `use`)
  std::vector<PhaseSeconds> phase_s;  // per rank
};

// A rank's clock over the phases: each ``mark`` charges the time since the last to `phase`.
class PhaseClock {
 public:
  explicit PhaseClock(PhaseSeconds* out) : out_(out), last_(now()) {}
  void mark(Phase phase) {
    if (out_ == nullptr) return;
    const auto t = now();
    (*out_)[phase] += std::chrono::duration<double>(t - last_).count();
    last_ = t;
  }

 private:
  static std::chrono::steady_clock::time_point now() { return std::chrono::steady_clock::now(); }
  PhaseSeconds* out_;
  std::chrono::steady_clock::time_point last_;
};

std::mutex registry_mutex;
std::unordered_map<int64_t, std::shared_ptr<Stack>>& registry() {
  static std::unordered_map<int64_t, std::shared_ptr<Stack>> stacks;
  return stacks;
}
std::atomic<int64_t> next_handle{1};

std::shared_ptr<Stack> find(int64_t handle) {
  std::lock_guard<std::mutex> g(registry_mutex);
  const auto it = registry().find(handle);
  TORCH_CHECK(it != registry().end(), "decoder stack ", handle, " is not registered");
  return it->second;
}

int64_t stack_create(int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim,
                     int64_t inter, double eps, double scale, bool bf16) {
  TORCH_CHECK(hidden > 0 && heads > 0 && kv_heads > 0 && head_dim > 0 && inter > 0,
              "stack_create: sizes must be positive");
  TORCH_CHECK(heads % kv_heads == 0, "stack_create: ", heads, " heads over ", kv_heads,
              " kv heads");
  auto s = std::make_shared<Stack>();
  s->spec = Spec{hidden, heads, kv_heads, head_dim, inter, eps, scale, bf16};
  const int64_t handle = next_handle.fetch_add(1);
  std::lock_guard<std::mutex> g(registry_mutex);
  registry()[handle] = s;
  return handle;
}

void stack_free(int64_t handle) {
  std::lock_guard<std::mutex> g(registry_mutex);
  registry().erase(handle);
}

at::Tensor as_f32(const at::Tensor& t, int64_t n, const char* what) {
  TORCH_CHECK(t.numel() == n, "stack_add_layer: ", what, " has ", t.numel(), " values, not ", n);
  return t.to(at::kFloat).contiguous();
}

Proj make_proj(const at::Tensor& data, int64_t kind, bool half, int64_t n, int64_t k,
               int64_t split, const std::optional<at::Tensor>& bias, const char* what) {
  TORCH_CHECK(kind >= P::kF32 && kind <= P::kI8, "stack_add_layer: ", what, " kind ", kind);
  Proj p;
  p.data = data;
  p.w = P::make_weight(static_cast<P::Kind>(kind), n, k, half, split, data.const_data_ptr<uint8_t>());
  TORCH_CHECK(data.scalar_type() == at::kByte && data.numel() == p.w.panels * p.w.bytes,
              "stack_add_layer: ", what, " panels hold ", data.numel(), " bytes, expected ",
              p.w.panels * p.w.bytes);
  TORCH_CHECK(p.w.kind == P::kF32 || p.w.kind == P::kBF16 || k % P::kGroup == 0,
              "stack_add_layer: ", what, " is quantized but K = ", k, " is not whole groups");
  if (bias.has_value() && bias->defined()) p.bias = as_f32(*bias, n, what);
  return p;
}

// panels: qkv, o, gate_up (split halves), down; kinds and halves alike; norms: input, post
// attention, then (optional) q and k per-head norms; biases: qkv, o (each may be None).
void stack_add_layer(int64_t handle, at::TensorList panels, at::IntArrayRef kinds,
                     at::IntArrayRef halves, at::TensorList norms,
                     const c10::List<std::optional<at::Tensor>>& biases) {
  const auto s = find(handle);
  const Spec& sp = s->spec;
  TORCH_CHECK(panels.size() == 4 && kinds.size() == 4 && halves.size() == 4,
              "stack_add_layer: four projections (qkv, o, gate_up, down)");
  TORCH_CHECK(norms.size() == 2 || norms.size() == 4, "stack_add_layer: 2 or 4 norm weights");
  TORCH_CHECK(biases.size() == 2, "stack_add_layer: biases for qkv and o");
  const int64_t q = sp.heads * sp.head_dim, kv = sp.kv_heads * sp.head_dim;
  Layer l;
  l.in_norm = as_f32(norms[0], sp.hidden, "input norm");
  l.post_norm = as_f32(norms[1], sp.hidden, "post-attention norm");
  if (norms.size() == 4) {
    l.q_norm = as_f32(norms[2], sp.head_dim, "q norm");
    l.k_norm = as_f32(norms[3], sp.head_dim, "k norm");
  }
  l.qkv = make_proj(panels[0], kinds[0], halves[0] != 0, q + 2 * kv, sp.hidden, 0, biases.get(0), "qkv");
  l.o = make_proj(panels[1], kinds[1], halves[1] != 0, sp.hidden, q, 0, biases.get(1), "o");
  l.gate_up = make_proj(panels[2], kinds[2], halves[2] != 0, 2 * sp.inter, sp.hidden, sp.inter,
                        std::nullopt, "gate_up");
  l.down = make_proj(panels[3], kinds[3], halves[3] != 0, sp.hidden, sp.inter, 0, std::nullopt, "down");
  if (l.o.w.kind == P::kI4 || l.o.w.kind == P::kI8) {
    TORCH_CHECK((sp.heads / sp.kv_heads) * sp.head_dim % P::kGroup == 0,
                "stack_add_layer: a quantized o projection needs each kv head's queries to fill "
                "whole groups of 32");
  }
  if (l.down.w.kind == P::kI4 || l.down.w.kind == P::kI8) {
    TORCH_CHECK(sp.inter % P::kGroup == 0, "stack_add_layer: intermediate size ", sp.inter,
                " is not whole groups of 32");
  }
  std::lock_guard<std::mutex> g(s->use);
  if (!s->layers.empty()) {  // one rows format per projection for every layer (the workspace)
    const Layer& first = s->layers.front();
    const auto format = [](const Proj& p) { return p.w.kind == P::kI8 ? P::kI4 : p.w.kind; };
    TORCH_CHECK(format(first.qkv) == format(l.qkv) && format(first.o) == format(l.o) &&
                    format(first.gate_up) == format(l.gate_up) &&
                    format(first.down) == format(l.down),
                "stack_add_layer: layer ", s->layers.size(),
                " mixes dense and quantized projections differently from layer 0");
  }
  s->layers.push_back(std::move(l));
}

// ------------------------------------------------------------------ the phases

// An RMSNorm of one row as PyTorch computes it: float32 statistics, the normalised row in the
// model's dtype, then times the weight.
void rms_norm(const float* x, const float* weight, int64_t n, double eps, bool bf16, float* out) {
  const float ms = hyloop::attend::sum_squares(x, n) / static_cast<float>(n);
  const float r = 1.0f / std::sqrt(ms + static_cast<float>(eps));
  int64_t i = 0;
#if defined(HYLOOP_P512)
  const __m512 rv = _mm512_set1_ps(r);
  for (; i + 16 <= n; i += 16) {
    const __m512 a = round_if(_mm512_mul_ps(_mm512_loadu_ps(x + i), rv), bf16);
    _mm512_storeu_ps(out + i, round_if(_mm512_mul_ps(a, _mm512_loadu_ps(weight + i)), bf16));
  }
#endif
  for (; i < n; ++i) out[i] = round_to(round_to(x[i] * r, bf16) * weight[i], bf16);
}

// RoPE (rotate half) of one head in place: x * cos + rotate_half(x) * sin on the first
// `rot` dims, each product and the sum rounded as the model's dtype rounds them.
void rope(float* x, const float* cos, const float* sin, int64_t rot, bool bf16) {
  const int64_t half = rot / 2;
  float tmp[1024];
#if defined(HYLOOP_P512)
  if (half % 16 == 0) {
    const __m512 minus = _mm512_set1_ps(-0.0f);
    for (int64_t i = 0; i < rot; i += 16) {
      const __m512 xi = _mm512_loadu_ps(x + i);
      const __m512 r = i < half ? _mm512_xor_ps(_mm512_loadu_ps(x + i + half), minus)
                                : _mm512_loadu_ps(x + i - half);
      const __m512 a = round_if(_mm512_mul_ps(xi, _mm512_loadu_ps(cos + i)), bf16);
      const __m512 b = round_if(_mm512_mul_ps(r, _mm512_loadu_ps(sin + i)), bf16);
      _mm512_storeu_ps(tmp + i, round_if(_mm512_add_ps(a, b), bf16));
    }
    std::memcpy(x, tmp, rot * sizeof(float));
    return;
  }
#endif
  for (int64_t i = 0; i < rot; ++i) {
    const float r = i < half ? -x[i + half] : x[i - half];
    tmp[i] = round_to(round_to(x[i] * cos[i], bf16) + round_to(r * sin[i], bf16), bf16);
  }
  std::memcpy(x, tmp, rot * sizeof(float));
}

template <typename T>
inline void load_row(const T* src, int64_t n, float* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <typename T>
inline void store_row(const float* src, int64_t n, T* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}

// A shared step's attention task: rows [b0, b0 + rows) of one request for kv head `head`.
struct AttnTask {
  int64_t b0 = 0, rows = 0, head = 0;
};

struct StepInputs {
  std::vector<at::Tensor> k_bufs, v_bufs;
  const int64_t* loc = nullptr;    // [B]
  const int64_t* slots = nullptr;  // [B, L]
  const float* bias = nullptr;     // [B, L]
  const float* cos = nullptr;      // [B, rot]
  const float* sin = nullptr;
  int64_t ctx = 0, rot = 0;
  // `shared`: rows of one request (a verify step's positions) read each other's new K/V, so
  // every K/V is written, behind a barrier, before any row attends; then each attention task is
  // one of `tasks` (``attention_tasks``): a request's rows, or a part of them, for one kv head,
  // its columns read once for all its rows.
  bool shared = false;
  std::vector<AttnTask> tasks;
};

// Row b's key for kv head h (its norm and RoPE) and value, written at loc[b]: a shared step's
// first attention pass. The same arithmetic as `attend`'s.
template <typename T>
void write_kv(const Spec& sp, const Layer& l, const StepInputs& in, int64_t layer, int64_t b,
              int64_t h, const float* qkv_row) {
  const int64_t D = sp.head_dim;
  const bool bf = sp.bf16;
  thread_local std::vector<float> kv;
  kv.resize(2 * D);
  float* k = kv.data();
  float* v = k + D;
  std::memcpy(k, qkv_row + sp.heads * D + h * D, D * sizeof(float));
  std::memcpy(v, qkv_row + (sp.heads + sp.kv_heads) * D + h * D, D * sizeof(float));
  round_all(k, D, bf);
  round_all(v, D, bf);
  if (l.k_norm.defined()) rms_norm(k, l.k_norm.const_data_ptr<float>(), D, sp.eps, bf, k);
  rope(k, in.cos + b * in.rot, in.sin + b * in.rot, in.rot, bf);
  T* kb = in.k_bufs[layer].mutable_data_ptr<T>();
  T* vb = in.v_bufs[layer].mutable_data_ptr<T>();
  store_row(k, D, kb + in.loc[b] * in.k_bufs[layer].stride(0) + h * D);
  store_row(v, D, vb + in.loc[b] * in.v_bufs[layer].stride(0) + h * D);
}

// Task (b, h, g0): query heads [g0, g0 + n) of kv head h for row b, with that head's k / v:
// norms, RoPE, the K/V write at loc[b] (by the task holding the group's first head), then
// attention over row b's visible columns, the new column read from this task's own k / v;
// writes the n heads' outputs. Each head's arithmetic is the same however a group is split.
template <typename T>
void attend(const Spec& sp, const Layer& l, const StepInputs& in, int64_t layer, int64_t b,
            int64_t h, int64_t g0, int64_t n, const float* qkv_row, std::vector<float>& scratch,
            float* out_row) {
  const int64_t D = sp.head_dim, G = sp.heads / sp.kv_heads, L = in.ctx;
  const bool bf = sp.bf16;
  scratch.resize(n * D + 2 * D + n * (L + 1));
  float* q = scratch.data();
  float* k = q + n * D;
  float* v = k + D;
  std::memcpy(q, qkv_row + (h * G + g0) * D, n * D * sizeof(float));
  std::memcpy(k, qkv_row + sp.heads * D + h * D, D * sizeof(float));
  std::memcpy(v, qkv_row + (sp.heads + sp.kv_heads) * D + h * D, D * sizeof(float));
  round_all(q, n * D, bf);
  round_all(k, D, bf);
  round_all(v, D, bf);
  const float* cos = in.cos + b * in.rot;
  const float* sin = in.sin + b * in.rot;
  T* kb = in.k_bufs[layer].mutable_data_ptr<T>();
  T* vb = in.v_bufs[layer].mutable_data_ptr<T>();
  const int64_t k_row = in.k_bufs[layer].stride(0), v_row = in.v_bufs[layer].stride(0);
  for (int64_t g = 0; g <= n; ++g) {  // n query heads, then the key
    float* head = g < n ? q + g * D : k;
    const at::Tensor& norm = g < n ? l.q_norm : l.k_norm;
    if (norm.defined()) rms_norm(head, norm.const_data_ptr<float>(), D, sp.eps, bf, head);
    rope(head, cos, sin, in.rot, bf);
  }
  thread_local std::vector<T> own;  // this task's new K / V in the pool's dtype
  own.resize(2 * D);
  store_row(k, D, own.data());
  store_row(v, D, own.data() + D);
  if (g0 == 0) {
    std::memcpy(kb + in.loc[b] * k_row + h * D, own.data(), D * sizeof(T));
    std::memcpy(vb + in.loc[b] * v_row + h * D, own.data() + D, D * sizeof(T));
  }
  hyloop::attend::group(q, n, D, kb, k_row, vb, v_row, h, in.slots + b * L, in.bias + b * L, L,
                        static_cast<float>(sp.scale), v + D, out_row, in.loc[b], own.data(),
                        own.data() + D);
  round_all(out_row, n * D, bf);
}

// A shared step's task: rows [b0, b0 + np) of one request for kv head h, every query head of
// the group: the queries' norms and RoPE, then attention over the rows' columns read once for
// all of them (``attend::group_rows``; each row alone where their columns' slots differ or the
// build has no such kernel), each row's bits those of its own ``attend``.
template <typename T>
void attend_rows(const Spec& sp, const Layer& l, const StepInputs& in, int64_t layer, int64_t b0,
                 int64_t np, int64_t h, const float* qkv, int64_t nqkv, std::vector<float>& scratch,
                 float* act, hyloop::RowsBuffer& rows) {
  const int64_t D = sp.head_dim, G = sp.heads / sp.kv_heads, L = in.ctx, q = sp.heads * D;
  const bool bf = sp.bf16;
  scratch.resize(np * G * D + np * G * (L + 1));
  float* qs = scratch.data();
  std::array<const float*, 32> biases{};
  std::array<float*, 32> outs{};
  bool same = np <= 32;
  for (int64_t i = 0; i < np; ++i) {
    const int64_t b = b0 + i;
    float* qi = qs + i * G * D;
    std::memcpy(qi, qkv + b * nqkv + h * G * D, G * D * sizeof(float));
    round_all(qi, G * D, bf);
    for (int64_t g = 0; g < G; ++g) {
      if (l.q_norm.defined()) rms_norm(qi + g * D, l.q_norm.const_data_ptr<float>(), D, sp.eps,
                                       bf, qi + g * D);
      rope(qi + g * D, in.cos + b * in.rot, in.sin + b * in.rot, in.rot, bf);
    }
    if (i < 32) {
      biases[i] = in.bias + b * L;
      outs[i] = act + b * q + h * G * D;
    }
    same = same && std::memcmp(in.slots + b * L, in.slots + b0 * L, L * sizeof(int64_t)) == 0;
  }
  const T* kb = in.k_bufs[layer].const_data_ptr<T>();
  const T* vb = in.v_bufs[layer].const_data_ptr<T>();
  const int64_t k_row = in.k_bufs[layer].stride(0), v_row = in.v_bufs[layer].stride(0);
  const float scale = static_cast<float>(sp.scale);
  float* work = qs + np * G * D;
  if (!same || !hyloop::attend::group_rows(qs, np, G, D, kb, k_row, vb, v_row, h, in.slots + b0 * L,
                                           biases.data(), L, scale, work, outs.data())) {
    for (int64_t i = 0; i < np; ++i) {
      const int64_t b = b0 + i;
      hyloop::attend::group(qs + i * G * D, G, D, kb, k_row, vb, v_row, h, in.slots + b * L,
                            in.bias + b * L, L, scale, work, act + b * q + h * G * D);
    }
  }
  for (int64_t i = 0; i < np; ++i) {
    float* out = act + (b0 + i) * q + h * G * D;
    round_all(out, G * D, bf);
    rows.set_cols(b0 + i, h * G * D, G * D, out);
  }
}

// The fewest query heads a task may hold: one, unless the o GEMM's rows are integer codes per
// group of 32 and one head's columns are not whole groups (then the kv head's whole group).
inline int64_t heads_per_task(const Spec& sp, const hyloop::RowsBuffer& rows) {
  const bool grouped = rows.kind() == P::kI4 || rows.kind() == P::kI8;
  if (!grouped || sp.head_dim % P::kGroup == 0) return 1;
  return sp.heads / sp.kv_heads;
}

void ensure_workspace(Stack& s, int64_t rows, int64_t threads) {
  Workspace& ws = s.ws;
  const Spec& sp = s.spec;
  const Layer& l0 = s.layers.front();
  const int64_t q = sp.heads * sp.head_dim, nqkv = q + 2 * sp.kv_heads * sp.head_dim;
  if (rows > ws.rows) {  // grow only: a step's batch size varies
    ws.resid.resize(rows * sp.hidden);
    ws.qkv.resize(rows * nqkv);
    ws.proj.resize(rows * std::max(q, sp.hidden));
    ws.gate_up.resize(rows * 2 * sp.inter);
    ws.act.resize(rows * std::max(sp.inter, q));
    ws.rows = rows;
  }
  ws.in_rows.reset(l0.qkv.w.kind, rows, sp.hidden);
  ws.attn_rows.reset(l0.o.w.kind, rows, q);
  ws.mlp_rows.reset(l0.gate_up.w.kind, rows, sp.hidden);
  ws.down_rows.reset(l0.down.w.kind, rows, sp.inter);
  if (ws.threads < threads) {
    ws.scratch.resize(threads);
    ws.own_in.resize(threads);
    ws.own_mlp.resize(threads);
  }
  if (ws.n_spans < threads) {
    ws.spans = std::make_unique<Span[]>(threads);
    ws.n_spans = threads;
  }
  ws.threads = std::max(ws.threads, threads);
  if (rows <= threads) {
    for (int64_t r = 0; r < threads; ++r) {
      ws.own_in[r].reset(l0.qkv.w.kind, rows, sp.hidden);
      ws.own_mlp[r].reset(l0.gate_up.w.kind, rows, sp.hidden);
    }
  }
}

// [lo, hi) of `n` units for rank r of t.
inline std::pair<int64_t, int64_t> share(int64_t n, int r, int t) {
  return {n * r / t, n * (r + 1) / t};
}

inline uint64_t pack_units(int64_t front, int64_t back) {
  return (static_cast<uint64_t>(front) << 32) | static_cast<uint64_t>(back);
}

// Units taken from a span: up to `chunk` from its front, or one from its back; empty when the
// span is.
inline std::pair<int64_t, int64_t> take_units(std::atomic<uint64_t>& span, bool front,
                                              int64_t chunk) {
  for (uint64_t v = span.load(std::memory_order_acquire);;) {
    const int64_t f = static_cast<int64_t>(v >> 32), b = static_cast<int64_t>(v & 0xFFFFFFFFu);
    if (f >= b) return {0, 0};
    const int64_t u0 = front ? f : b - 1, u1 = front ? f + std::min(chunk, b - f) : b;
    const uint64_t left = front ? pack_units(u1, b) : pack_units(f, u0);
    if (span.compare_exchange_weak(v, left, std::memory_order_acq_rel)) return {u0, u1};
  }
}

// fn(u0, u1) over runs of a phase's units [0, n), each unit run once by some rank: rank r takes
// its own share (``share``) from the front, a few units at a time, then whatever the other ranks
// have left from their back, one unit at a time. So a rank that runs late (its core taken for a
// while, a slow wake-up) leaves its last units to the others instead of holding every rank at
// the barrier. No result depends on which rank runs a unit. Every phase ends at a barrier with
// every span empty, so a span read before its rank has set it for this phase is empty: nothing
// to take.
template <typename Fn>
void claim_units(Span* spans, int64_t n, int r, int t, Fn&& fn) {
  const auto [lo, hi] = share(n, r, t);
  spans[r].units.store(pack_units(lo, hi), std::memory_order_release);
  const int64_t chunk = std::max<int64_t>(1, (hi - lo) / 8);
  for (int k = 0; k < t; ++k) {  // its own first, from the front; then the others', from the back
    std::atomic<uint64_t>& span = spans[(r + k) % t].units;
    for (;;) {
      const auto [u0, u1] = take_units(span, k == 0, chunk);
      if (u0 >= u1) break;
      fn(u0, u1);
    }
  }
}

// A GEMM's panels [p0, p1) into `out` (row stride `ld`), the projection's bias added.
inline void gemm_panels(const Proj& p, const P::Rows& x, float* out, int64_t ld, int64_t p0,
                        int64_t p1) {
  P::Output o;
  o.f32 = out;
  o.ld = ld;
  o.bias = p.bias_ptr();
  if (p0 < p1) P::gemm(p.w, x, p0, p1, o);
}

// One GEMM of a phase over the ranks, in units of `unit` panels (``claim_units``); then
// epilogue(p0, p1) on the panels each run computed.
template <typename Epilogue>
void gemm_claimed(Workspace& ws, const Proj& p, const P::Rows& x, float* out, int64_t ld,
                  int64_t unit, int r, int t, Epilogue&& epilogue) {
  const int64_t units = (p.w.panels + unit - 1) / unit;
  claim_units(ws.spans.get(), units, r, t, [&](int64_t u0, int64_t u1) {
    const int64_t p0 = u0 * unit, p1 = std::min(p.w.panels, u1 * unit);
    gemm_panels(p, x, out, ld, p0, p1);
    epilogue(p0, p1);
  });
}

// This rank's share of a GEMM's panel bytes, the share it takes first (``claim_units``).
inline std::pair<const uint8_t*, const uint8_t*> share_bytes(const Proj& p, int64_t unit, int r,
                                                             int t) {
  const int64_t units = (p.w.panels + unit - 1) / unit;
  const auto [u0, u1] = share(units, r, t);
  const int64_t p0 = u0 * unit, p1 = std::min(p.w.panels, u1 * unit);
  return {p.w.panel(p0), p.w.panel(std::max(p0, p1))};
}

// Weight bytes to bring towards the core while a rank waits at a barrier: its share of the next
// GEMM, a few lines per call (``Team::sync``'s idle work), so that a rank that arrives early
// starts that GEMM from its L2 instead of memory. Prefetches change no result.
struct Prefetch {
  static constexpr int64_t kLinesPerCall = 16;
  const uint8_t* at = nullptr;
  const uint8_t* end = nullptr;

  void set(std::pair<const uint8_t*, const uint8_t*> range) { std::tie(at, end) = range; }
  static bool step(void* self) {
    auto* f = static_cast<Prefetch*>(self);
    if (f->at >= f->end) return false;
    const uint8_t* stop = std::min(f->end, f->at + 64 * kLinesPerCall);
#ifdef HYLOOP_P512
    for (; f->at < stop; f->at += 64) _mm_prefetch(reinterpret_cast<const char*>(f->at), _MM_HINT_T1);
#else
    f->at = stop;
#endif
    return true;
  }
};

// A projection back to the hidden size, added to the residual on the columns each run computed
// (the projection's output rounded, then the sum, as the layers' `x + o(...)` rounds them).
inline void gemm_residual(const Proj& p, const P::Rows& x, Workspace& ws, int64_t B, int64_t H,
                          bool bf, int r, int t) {
  gemm_claimed(ws, p, x, ws.proj.data(), H, 2, r, t, [&](int64_t p0, int64_t p1) {
    const int64_t c0 = p0 * P::kCols, c1 = std::min(H, p1 * P::kCols);
    for (int64_t b = 0; b < B; ++b) {
      float* res = ws.resid.data() + b * H;
      const float* y = ws.proj.data() + b * H;
      int64_t c = c0;
#if defined(HYLOOP_P512)
      for (; c + 16 <= c1; c += 16) {
        const __m512 o = round_if(_mm512_loadu_ps(y + c), bf);
        _mm512_storeu_ps(res + c, round_if(_mm512_add_ps(_mm512_loadu_ps(res + c), o), bf));
      }
#endif
      for (; c < c1; ++c) res[c] = round_to(res[c] + round_to(y[c], bf), bf);
    }
  });
}

template <typename T>
void run_layers(Stack& s, const StepInputs& in, int64_t B, int rank, hyloop::Team& team) {
  const Spec& sp = s.spec;
  Workspace& ws = s.ws;
  const int T_ = team.size();
  const bool bf = sp.bf16;
  const int64_t H = sp.hidden, D = sp.head_dim, q = sp.heads * D;
  const int64_t nqkv = q + 2 * sp.kv_heads * D, I = sp.inter, G = sp.heads / sp.kv_heads;
  std::vector<float>& scratch = ws.scratch[rank];
  float norm_row[8192];
  PhaseClock clock(s.timed ? &s.phase_s[rank] : nullptr);
  Prefetch ahead;
  // The end of a phase: wait for the others, prefetching this rank's share of `next` meanwhile.
  const auto sync = [&](Phase done, const Proj& next, int64_t unit) {
    clock.mark(done);
    ahead.set(share_bytes(next, unit, rank, T_));
    team.sync(&Prefetch::step, &ahead);
    clock.mark(kWait);
  };
  const size_t n_layers = s.layers.size();
  const bool own = B <= T_;  // every rank normalises every row (Workspace::own_in)
  for (size_t li = 0; li < n_layers; ++li) {
    const Layer& l = s.layers[li];
    const Layer& after = s.layers[li + 1 < n_layers ? li + 1 : li];
    // 1. input norm -> the qkv GEMM's rows (a row per rank, or each rank all rows: `own`)
    hyloop::RowsBuffer& in_rows = own ? ws.own_in[rank] : ws.in_rows;
    for (int64_t b = own ? 0 : rank; b < B; b += own ? 1 : T_) {
      rms_norm(ws.resid.data() + b * H, l.in_norm.const_data_ptr<float>(), H, sp.eps, bf, norm_row);
      in_rows.set_row(b, norm_row);
    }
    if (own) {
      clock.mark(kNorm);
    } else {
      sync(kNorm, l.qkv, 2);
    }
    // 2. qkv
    gemm_claimed(ws, l.qkv, in_rows.view(), ws.qkv.data(), nqkv, 2, rank, T_,
                 [](int64_t, int64_t) {});
    sync(kQkv, l.o, 2);
    // 3. attention, (row, kv head, query heads) tasks; each writes its heads' columns of the o
    // GEMM's rows. Contiguous runs of tasks per rank: a row's kv heads read neighbouring parts
    // of the same pool rows, one after another. A kv head's group is split into `per`-head
    // tasks when there are too few groups to share out evenly (a batch of one row).
    if (in.shared) {  // every K/V of the step first: a row reads its request's earlier rows'
      const auto [w0, w1] = share(B * sp.kv_heads, rank, T_);
      for (int64_t t = w0; t < w1; ++t) {
        write_kv<T>(sp, l, in, static_cast<int64_t>(li), t / sp.kv_heads, t % sp.kv_heads,
                    ws.qkv.data() + (t / sp.kv_heads) * nqkv);
      }
      sync(kAttn, l.o, 2);
    }
    if (in.shared) {
      const auto n_tasks = static_cast<int64_t>(in.tasks.size());
      claim_units(ws.spans.get(), n_tasks, rank, T_, [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; ++t) {
          const AttnTask& a = in.tasks[t];
          attend_rows<T>(sp, l, in, static_cast<int64_t>(li), a.b0, a.rows, a.head,
                         ws.qkv.data(), nqkv, scratch, ws.act.data(), ws.attn_rows);
        }
      });
      sync(kAttn, l.o, 2);
    } else {
      const bool few = B * sp.kv_heads < std::max(4, 2 * T_);
      const int64_t per = few ? heads_per_task(sp, ws.attn_rows) : G;
      const int64_t tasks_per_row = sp.heads / per;
      claim_units(ws.spans.get(), B * tasks_per_row, rank, T_, [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; ++t) {  // task t: row b, query heads [first, first + per)
          const int64_t b = t / tasks_per_row, first = (t % tasks_per_row) * per;
          const int64_t h = first / G, g0 = first % G;
          float* out = ws.act.data() + b * q + first * D;
          attend<T>(sp, l, in, static_cast<int64_t>(li), b, h, g0, per,
                    ws.qkv.data() + b * nqkv, scratch, out);
          ws.attn_rows.set_cols(b, first * D, per * D, out);
        }
      });
      sync(kAttn, l.o, 2);
    }
    // 4. o + residual
    gemm_residual(l.o, ws.attn_rows.view(), ws, B, H, bf, rank, T_);
    sync(kO, l.gate_up, 4);
    // 5. post-attention norm -> the gate/up GEMM's rows
    hyloop::RowsBuffer& mlp_rows = own ? ws.own_mlp[rank] : ws.mlp_rows;
    for (int64_t b = own ? 0 : rank; b < B; b += own ? 1 : T_) {
      rms_norm(ws.resid.data() + b * H, l.post_norm.const_data_ptr<float>(), H, sp.eps, bf,
               norm_row);
      mlp_rows.set_row(b, norm_row);
    }
    if (own) {
      clock.mark(kNorm);
    } else {
      sync(kNorm, l.gate_up, 4);
    }
    // 6. gate/up in units of two panel pairs (32 columns: whole groups for a quantized down),
    // then SiLU(gate) * up on this rank's columns -> the down GEMM's rows
    gemm_claimed(ws, l.gate_up, mlp_rows.view(), ws.gate_up.data(), 2 * I, 4, rank, T_,
                 [&](int64_t p0, int64_t p1) {
      const int64_t c0 = p0 / 2 * P::kCols, c1 = std::min(I, p1 / 2 * P::kCols);
      for (int64_t b = 0; b < B && c0 < c1; ++b) {
        float* a = ws.act.data() + b * I;
        float* gate = ws.gate_up.data() + b * 2 * I + c0;  // rounded in place, then SiLU
        float* up = gate + I;
        round_all(gate, c1 - c0, bf);
        round_all(up, c1 - c0, bf);
        hyloop::attend::silu(gate, a + c0, c1 - c0);
        round_all(a + c0, c1 - c0, bf);
        for (int64_t c = c0; c < c1; ++c) a[c] *= up[c - c0];
        round_all(a + c0, c1 - c0, bf);
        ws.down_rows.set_cols(b, c0, c1 - c0, a + c0);
      }
    });
    sync(kGateUp, l.down, 2);
    // 7. down + residual
    gemm_residual(l.down, ws.down_rows.view(), ws, B, H, bf, rank, T_);
    sync(kDown, after.qkv, 2);
  }
}

// What reading a shared attention task's columns costs, in rows of its arithmetic (a kv head's
// K/V come from memory for the first of its tasks, from cache for the others).
constexpr double kTaskRows = 2.0;
constexpr int64_t kGroupRows = 32;  // the most rows ``attend_rows`` attends together

// A shared step's attention tasks (``StepInputs::tasks``), laid out for ``claim_units``. Each
// request's rows (`request`: the request of each row, ascending) are cut into the same number
// of parts, as even as can be, one task a part and kv head. Of the part counts up to the longest
// request's rows (at most 8), the one kept is that whose tasks, dealt largest first to the
// least loaded rank (each rank as many as its ``share``), leave the most loaded rank the least
// work (a task costs its rows plus ``kTaskRows``), the fewest tasks on a tie. Rank r's deal fills
// its share, largest first, so what another rank takes from its back is its smallest. (9 rows
// of one request, 3 kv heads, 2 ranks: parts of 5 and 4 rows, 14 and 13 rows a rank, where 3
// parts of 3 gave 15 and 12.) No part is longer than ``kGroupRows``. Which rank runs a task
// changes no result.
std::vector<AttnTask> attention_tasks(const std::vector<int64_t>& request, int64_t kv_heads,
                                      int threads) {
  std::vector<std::pair<int64_t, int64_t>> runs;  // (first row, rows) per request
  const auto B = static_cast<int64_t>(request.size());
  for (int64_t b = 0; b < B; ++b) {
    if (b == 0 || request[b] != request[b - 1]) runs.emplace_back(b, 0);
    ++runs.back().second;
  }
  int64_t longest = 1;
  for (const auto& run : runs) longest = std::max(longest, run.second);
  const int T = std::max(1, threads);
  std::vector<AttnTask> best;
  double best_span = std::numeric_limits<double>::infinity();
  const int64_t fewest = (longest + kGroupRows - 1) / kGroupRows;  // parts group_rows takes whole
  for (int64_t parts = fewest; parts <= std::max(fewest, std::min<int64_t>(longest, 8)); ++parts) {
    std::vector<AttnTask> tasks;
    for (const auto& [b0, n] : runs) {
      const int64_t cut = std::min(parts, n);
      for (int64_t i = 0, b = b0; i < cut; ++i) {
        const int64_t rows = n / cut + (i < n % cut ? 1 : 0);
        for (int64_t h = 0; h < kv_heads; ++h) tasks.push_back({b, rows, h});
        b += rows;
      }
    }
    std::stable_sort(tasks.begin(), tasks.end(), [](const AttnTask& x, const AttnTask& y) {
      return x.rows != y.rows ? x.rows > y.rows : x.head < y.head;
    });
    const auto n = static_cast<int64_t>(tasks.size());
    std::vector<std::vector<AttnTask>> deal(T);
    std::vector<double> load(T, 0.0);
    for (const AttnTask& a : tasks) {
      int pick = -1;
      for (int r = 0; r < T; ++r) {
        const auto [lo, hi] = share(n, r, T);
        const bool room = static_cast<int64_t>(deal[r].size()) < hi - lo;
        if (room && (pick < 0 || load[r] < load[pick])) pick = r;
      }
      deal[pick].push_back(a);
      load[pick] += static_cast<double>(a.rows) + kTaskRows;
    }
    const double span = *std::max_element(load.begin(), load.end());
    if (span < best_span) {
      best_span = span;
      best.clear();
      for (const auto& own : deal) best.insert(best.end(), own.begin(), own.end());
    }
  }
  return best;
}

// The stack over x's rows; with `request` (the request of each row, ascending: a verify step's
// positions) rows read the new K/V of their request's rows (a shared step), else none.
at::Tensor stack_rows(const at::Tensor& x, int64_t handle, at::TensorList k_bufs,
                      at::TensorList v_bufs, const at::Tensor& loc, const at::Tensor& slots,
                      const at::Tensor& bias, const at::Tensor& cos, const at::Tensor& sin,
                      const std::vector<int64_t>& request) {
  const auto s = find(handle);
  const Spec& sp = s->spec;
  const int64_t H = sp.hidden, D = sp.head_dim;
  TORCH_CHECK(!s->layers.empty(), "decode_layers: the stack has no layers");
  const auto n_layers = static_cast<int64_t>(s->layers.size());
  TORCH_CHECK(x.size(-1) == H, "decode_layers: x has ", x.size(-1), " columns, hidden is ", H);
  TORCH_CHECK(x.scalar_type() == (sp.bf16 ? at::kBFloat16 : at::kFloat),
              "decode_layers: x must be ", sp.bf16 ? "bfloat16" : "float32");
  TORCH_CHECK(static_cast<int64_t>(k_bufs.size()) == n_layers &&
                  static_cast<int64_t>(v_bufs.size()) == n_layers,
              "decode_layers: one K and one V buffer per layer (", n_layers, ")");
  for (int64_t i = 0; i < n_layers; ++i) {
    const at::Tensor& kb = k_bufs[i];
    const at::Tensor& vb = v_bufs[i];
    TORCH_CHECK(kb.dim() == 3 && kb.size(1) == sp.kv_heads && kb.size(2) == D &&
                    kb.stride(2) == 1 && kb.stride(1) == D && vb.sizes() == kb.sizes() &&
                    vb.strides() == kb.strides() && kb.scalar_type() == x.scalar_type() &&
                    vb.scalar_type() == x.scalar_type(),
                "decode_layers: layer ", i, "'s K/V buffers must be [slots, ", sp.kv_heads, ", ",
                D, "] rows in the model's dtype");
  }
  const int64_t B = x.numel() / H;
  TORCH_CHECK(loc.numel() == B && loc.scalar_type() == at::kLong, "decode_layers: loc int64 [B]");
  TORCH_CHECK(slots.dim() == 2 && slots.size(0) == B && slots.scalar_type() == at::kLong,
              "decode_layers: slots int64 [B, L]");
  TORCH_CHECK(bias.sizes() == slots.sizes() && bias.scalar_type() == at::kFloat,
              "decode_layers: bias float32 [B, L]");
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == B && cos.size(1) <= D && cos.size(1) % 2 == 0 &&
                  cos.size(1) <= 1024 && sin.sizes() == cos.sizes() &&
                  cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              "decode_layers: cos / sin float32 [B, rotary dims <= head_dim]");
  TORCH_CHECK(H <= 8192 && sp.heads / sp.kv_heads <= 64, "decode_layers: hidden ", H,
              " or query group too large");
  const int64_t slots_n = k_bufs[0].size(0);
  const at::Tensor lc = loc.contiguous(), sc = slots.contiguous(), bc = bias.contiguous();
  const at::Tensor cc = cos.contiguous(), snc = sin.contiguous();
  const int64_t* lp = lc.const_data_ptr<int64_t>();
  const int64_t* spp = sc.const_data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lp[b] >= 0 && lp[b] < slots_n, "decode_layers: loc[", b, "] = ", lp[b],
                " outside the pool's ", slots_n, " slots");
  }
  for (int64_t i = 0; i < sc.numel(); ++i) {
    TORCH_CHECK(spp[i] >= 0 && spp[i] < slots_n, "decode_layers: slot ", spp[i],
                " outside the pool's ", slots_n, " slots");
  }
  StepInputs in;
  in.k_bufs.assign(k_bufs.begin(), k_bufs.end());
  in.v_bufs.assign(v_bufs.begin(), v_bufs.end());
  in.loc = lp;
  in.slots = spp;
  in.bias = bc.const_data_ptr<float>();
  in.cos = cc.const_data_ptr<float>();
  in.sin = snc.const_data_ptr<float>();
  in.ctx = slots.size(1);
  in.rot = cos.size(1);
  std::lock_guard<std::mutex> guard(s->use);
  const int threads = hyloop::team_size();
  in.shared = !request.empty();
  if (in.shared) {
    TORCH_CHECK(static_cast<int64_t>(request.size()) == B, "decode_layers: a request per row");
    in.tasks = attention_tasks(request, sp.kv_heads, threads);
  }
  ensure_workspace(*s, B, threads);
  if (s->timed && static_cast<int>(s->phase_s.size()) < threads) s->phase_s.resize(threads);
  const at::Tensor xc = x.reshape({B, H}).contiguous();
  if (sp.bf16) {
    load_row(xc.const_data_ptr<c10::BFloat16>(), B * H, s->ws.resid.data());
  } else {
    std::memcpy(s->ws.resid.data(), xc.const_data_ptr<float>(), B * H * sizeof(float));
  }
  hyloop::run_team(threads, [&](int rank, hyloop::Team& team) {
    if (sp.bf16) {
      run_layers<c10::BFloat16>(*s, in, B, rank, team);
    } else {
      run_layers<float>(*s, in, B, rank, team);
    }
  });
  at::Tensor out = at::empty(x.sizes(), x.options());
  if (sp.bf16) {
    store_row(s->ws.resid.data(), B * H, out.mutable_data_ptr<c10::BFloat16>());
  } else {
    std::memcpy(out.mutable_data_ptr<float>(), s->ws.resid.data(), B * H * sizeof(float));
  }
  return out;
}

// Every layer for the rows of x (runs of `group` rows of one request each, a verify step's
// positions, which read each other's new K/V). A row's bits do not depend on the rows beside
// it, so ``decode_layers_live``'s rows are what they are with the padding computed.
at::Tensor decode_layers(const at::Tensor& x, int64_t handle, at::TensorList k_bufs,
                         at::TensorList v_bufs, const at::Tensor& loc, const at::Tensor& slots,
                         const at::Tensor& bias, const at::Tensor& cos, const at::Tensor& sin,
                         int64_t group) {
  const int64_t B = x.numel() / x.size(-1);
  TORCH_CHECK(group >= 1 && B % group == 0, "decode_layers: ", B, " rows are not runs of ",
              group);
  std::vector<int64_t> request;
  for (int64_t b = 0; group > 1 && b < B; ++b) request.push_back(b / group);
  return stack_rows(x, handle, k_bufs, v_bufs, loc, slots, bias, cos, sin, request);
}

// ``decode_layers`` with `live` (bool, a row each): only the live rows are computed (a verify
// step's padding positions are not: no K/V written, zeros out).
at::Tensor decode_layers_live(const at::Tensor& x, int64_t handle, at::TensorList k_bufs,
                              at::TensorList v_bufs, const at::Tensor& loc,
                              const at::Tensor& slots, const at::Tensor& bias,
                              const at::Tensor& cos, const at::Tensor& sin, int64_t group,
                              const at::Tensor& live) {
  const int64_t H = x.size(-1), B = x.numel() / H;
  TORCH_CHECK(live.scalar_type() == at::kBool && live.numel() == B,
              "decode_layers_live: live bool [B]");
  const at::Tensor rows = live.reshape({B}).nonzero().reshape({-1});
  at::Tensor out = at::zeros(x.sizes(), x.options());
  if (rows.numel() == 0) return out;
  const auto pick = [&](const at::Tensor& t) { return t.reshape({B, -1}).index_select(0, rows); };
  std::vector<int64_t> request;  // a live row's request: its run of `group` rows
  if (group > 1) {
    const int64_t* r = rows.const_data_ptr<int64_t>();
    for (int64_t i = 0; i < rows.numel(); ++i) request.push_back(r[i] / group);
  }
  const at::Tensor part = stack_rows(pick(x), handle, k_bufs, v_bufs, pick(loc).reshape({-1}),
                                     pick(slots), pick(bias), pick(cos), pick(sin), request);
  out.view({B, H}).index_copy_(0, rows, part);
  return out;
}

// The seconds each rank spent per phase since the last call ([ranks, phases]: norm, qkv,
// attention, o, gate/up, down, barrier waits), then resets them; `enable` turns the clocks on or
// off for the calls that follow (off: no clock is read).
at::Tensor stack_phase_times(int64_t handle, bool enable) {
  const auto s = find(handle);
  std::lock_guard<std::mutex> guard(s->use);
  const auto ranks = static_cast<int64_t>(s->phase_s.size());
  at::Tensor out = at::zeros({ranks, kPhases}, at::kDouble);
  double* o = out.mutable_data_ptr<double>();
  for (int64_t r = 0; r < ranks; ++r)
    for (int p = 0; p < kPhases; ++p) o[r * kPhases + p] = s->phase_s[r][p];
  s->phase_s.assign(s->phase_s.size(), PhaseSeconds{});
  s->timed = enable;
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hyloop, m) {
  m.def(
      "stack_create(int hidden, int heads, int kv_heads, int head_dim, int intermediate, "
      "float eps, float scale, bool bf16) -> int",
      &stack_create);
  m.def(
      "stack_add_layer(int handle, Tensor[] panels, int[] kinds, int[] halves, Tensor[] norms, "
      "Tensor?[] biases) -> ()",
      &stack_add_layer);
  m.def("stack_free(int handle) -> ()", &stack_free);
  m.def("stack_phase_times(int handle, bool enable) -> Tensor", &stack_phase_times);
  m.def(
      "decode_layers(Tensor x, int handle, Tensor(a!)[] k_bufs, Tensor(b!)[] v_bufs, Tensor loc, "
      "Tensor slots, Tensor bias, Tensor cos, Tensor sin, int group=1) -> Tensor");
  m.def(
      "decode_layers_live(Tensor x, int handle, Tensor(a!)[] k_bufs, Tensor(b!)[] v_bufs, "
      "Tensor loc, Tensor slots, Tensor bias, Tensor cos, Tensor sin, int group, Tensor live) -> "
      "Tensor");
}

TORCH_LIBRARY_IMPL(hyloop, CPU, m) {
  m.impl("decode_layers", &decode_layers);
  m.impl("decode_layers_live", &decode_layers_live);
}
