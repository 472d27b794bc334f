// hyloop's thread pool for its own CPU kernels (the panel GEMMs, decode attention, the decoder stack).
//
// A decode step calls a few hundred short kernels (tens of microseconds each at batch 1). Under
// OpenMP each is a parallel region, and libgomp fixes when it loads how its helper threads wait
// between regions. Spinning (its default) collapses a step when another process shares the
// cores: the spinners take the time slices the late thread needs. Sleeping
// (OMP_WAIT_POLICY=PASSIVE, which hyloop sets) is right on a busy machine, where a futex wake-up
// is served promptly, but on a quiet virtual machine every region then pays for waking a halted
// vCPU (measured at ~80 us a region on a 2-core AMD EPYC VM, several times the kernel itself).
//
// So this pool runs a job one of two ways, chosen by what the rest of the machine is doing
// (sampled from /proc/stat at most every kSample):
// - quiet (the other processes leave at least our thread count of cores free): on its own
//   workers, which spin between jobs and call sched_yield every few dozen pauses. On an idle core
//   the yield returns at once and the next job starts within microseconds; when yields keep
//   taking long, another thread wants the core (this process's own host thread, say), and the
//   worker sleeps on a futex. A worker idle for kIdle sleeps too: an idle engine burns no core.
// - contended: through at::parallel_for, i.e. OpenMP under the passive policy, whose futex
//   wake-ups are what a shared core serves best.
// HYLOOP_CPU_POOL=0 makes every job take the OpenMP path.

#include "cpu_pool.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>
#include <pthread.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <exception>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
inline void cpu_relax() { _mm_pause(); }
#else
inline void cpu_relax() {}
#endif

namespace hyloop {
namespace {

using Clock = std::chrono::steady_clock;
constexpr auto kIdle = std::chrono::milliseconds(2);         // spin this long with no job, then sleep
constexpr auto kYieldTaken = std::chrono::microseconds(20);  // a yield this long: the core was wanted
constexpr auto kTakenBudget = std::chrono::microseconds(200);  // ... for this long in one wait: sleep
constexpr auto kSample = std::chrono::milliseconds(100);     // machine load sampling period
constexpr int kPausesPerYield = 64;

thread_local bool in_pool_job = false;

// ------------------------------------------------------------------ is the machine shared?

struct CpuTimes {
  double busy_s = 0.0;  // all CPUs, every process (/proc/stat, USER_HZ ticks)
  double ours_s = 0.0;  // this process
  bool ok = false;
};

CpuTimes read_cpu_times() {
  CpuTimes t;
  std::FILE* f = std::fopen("/proc/stat", "r");
  if (f == nullptr) return t;
  unsigned long long v[8] = {};
  const int n = std::fscanf(f, "cpu %llu %llu %llu %llu %llu %llu %llu %llu", &v[0], &v[1], &v[2],
                            &v[3], &v[4], &v[5], &v[6], &v[7]);
  std::fclose(f);
  if (n < 5) return t;
  const double hz = static_cast<double>(sysconf(_SC_CLK_TCK));
  // user nice system idle iowait irq softirq steal: busy is all but idle and iowait.
  t.busy_s = static_cast<double>(v[0] + v[1] + v[2] + v[5] + v[6] + v[7]) / hz;
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  t.ours_s = static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
  t.ok = true;
  return t;
}

class LoadMonitor {
 public:
  // Whether other processes now use the cores our `threads` need (re-sampled every kSample).
  bool contended(int threads) { return free_cores() < threads; }

  // The cores other processes leave us, whole (re-sampled every kSample): a core counts as
  // taken once others use more than 0.3 of it.
  int free_cores() {
    const auto now = Clock::now();
    const Clock::time_point last{Clock::duration(last_.load(std::memory_order_relaxed))};
    if (now - last < kSample) return free_.load(std::memory_order_relaxed);
    std::unique_lock<std::mutex> lock(m_, std::try_to_lock);
    if (!lock.owns_lock()) return free_.load(std::memory_order_relaxed);
    const CpuTimes t = read_cpu_times();
    const double wall = std::chrono::duration<double>(now - last).count();
    if (t.ok && prev_.ok && wall > 0.0) {
      const double others = std::max(0.0, (t.busy_s - prev_.busy_s) - (t.ours_s - prev_.ours_s));
      const int taken = static_cast<int>(std::ceil(others / wall - 0.3));
      free_.store(std::max(0, cpus_ - std::max(0, taken)), std::memory_order_relaxed);
    }
    prev_ = t;
    last_.store(now.time_since_epoch().count(), std::memory_order_relaxed);
    return free_.load(std::memory_order_relaxed);
  }

 private:
  std::mutex m_;
  std::atomic<Clock::rep> last_{0};  // when prev_ was read
  CpuTimes prev_{};
  const int cpus_ = static_cast<int>(std::max(1L, sysconf(_SC_NPROCESSORS_ONLN)));
  std::atomic<int> free_{cpus_};
};

// ------------------------------------------------------------------ the workers

// Waits until `flag` differs from `seen`: spin and yield while the core is ours, sleep on the
// futex once yields show another thread wants it (other threads held the core for kTakenBudget
// of this wait, in yields of over kYieldTaken each) or the wait has lasted `idle`. A single slow
// yield is no evidence: on a virtual machine one now and then takes tens of microseconds with
// no other thread about, and the sleep it led to cost a wake-up of milliseconds.
template <typename T>
void wait_while(const std::atomic<T>& flag, T seen, Clock::duration idle) {
  const auto start = Clock::now();
  Clock::duration taken{0};
  for (;;) {
    for (int i = 0; i < kPausesPerYield; ++i) {
      if (flag.load(std::memory_order_acquire) != seen) return;
      cpu_relax();
    }
    const auto t0 = Clock::now();
    sched_yield();
    const auto t1 = Clock::now();
    if (t1 - t0 > kYieldTaken) taken += t1 - t0;
    if (taken > kTakenBudget || t1 - start > idle) break;
  }
  while (flag.load(std::memory_order_acquire) == seen) flag.wait(seen, std::memory_order_acquire);
}

struct alignas(64) Worker {
  std::atomic<int> go{0};  // bumped by the caller: run chunk `index` of the current job
  int index = 0;
};

class Pool {
 public:
  void run(int64_t begin, int64_t end, int64_t chunk, int chunks,
           const std::function<void(int64_t, int64_t)>& fn) {
    grow(chunks - 1);
    fn_ = &fn;
    begin_ = begin;
    end_ = end;
    chunk_ = chunk;
    error_ = nullptr;
    remaining_.store(chunks - 1, std::memory_order_relaxed);
    for (int w = 0; w < chunks - 1; ++w) {
      workers_[w]->go.fetch_add(1, std::memory_order_release);
      workers_[w]->go.notify_one();  // a syscall only when that worker sleeps
    }
    in_pool_job = true;
    try {
      fn(begin, std::min(end, begin + chunk));
    } catch (...) {
      keep_error();
    }
    in_pool_job = false;
    for (int left; (left = remaining_.load(std::memory_order_acquire)) != 0;)
      wait_while(remaining_, left, Clock::duration::max());
    if (error_) std::rethrow_exception(error_);
  }

  std::mutex use;  // one caller at a time
  LoadMonitor load;

 private:
  void grow(int n) {
    while (static_cast<int>(workers_.size()) < n) {
      auto* w = new Worker();  // never freed: a detached thread reads it for the process's life
      w->index = static_cast<int>(workers_.size()) + 1;
      workers_.push_back(w);
      std::thread([this, w] { loop(w); }).detach();
    }
  }

  void loop(Worker* w) {
    in_pool_job = true;  // a kernel a worker runs never re-enters the pool
    int seen = 0;
    for (;;) {
      wait_while(w->go, seen, kIdle);
      seen = w->go.load(std::memory_order_acquire);
      const int64_t lo = begin_ + w->index * chunk_;
      try {
        if (lo < end_) (*fn_)(lo, std::min(end_, lo + chunk_));
      } catch (...) {
        keep_error();
      }
      if (remaining_.fetch_sub(1, std::memory_order_acq_rel) == 1) remaining_.notify_one();
    }
  }

  void keep_error() {
    std::lock_guard<std::mutex> g(error_lock_);
    if (!error_) error_ = std::current_exception();
  }

  std::vector<Worker*> workers_;
  const std::function<void(int64_t, int64_t)>* fn_ = nullptr;
  int64_t begin_ = 0, end_ = 0, chunk_ = 1;
  std::exception_ptr error_;
  std::mutex error_lock_;
  alignas(64) std::atomic<int> remaining_{0};
};

Pool* pool = nullptr;
std::mutex pool_create;

Pool& the_pool() {
  static const bool atfork = [] {
    // A forked child has none of the parent's threads: it starts a pool of its own.
    return pthread_atfork(nullptr, nullptr, [] { pool = nullptr; }) == 0;
  }();
  (void)atfork;
  std::lock_guard<std::mutex> g(pool_create);
  if (pool == nullptr) pool = new Pool();  // never freed: its workers outlive static teardown
  return *pool;
}

bool pool_enabled() {
  static const bool enabled = [] {
    const char* v = std::getenv("HYLOOP_CPU_POOL");
    return v == nullptr || std::strcmp(v, "0") != 0;
  }();
  return enabled;
}

}  // namespace

void parallel_for(int64_t begin, int64_t end, int64_t grain,
                  const std::function<void(int64_t, int64_t)>& fn) {
  if (begin >= end) return;
  const int64_t range = end - begin, g = std::max<int64_t>(grain, 1);
  const int threads = in_pool_job ? 1 : std::max(1, at::get_num_threads());
  const int64_t chunks = std::min<int64_t>(threads, (range + g - 1) / g);
  if (chunks <= 1) return fn(begin, end);
  if (!pool_enabled()) return at::parallel_for(begin, end, grain, fn);
  Pool& p = the_pool();
  if (p.load.contended(threads)) return at::parallel_for(begin, end, grain, fn);
  std::unique_lock<std::mutex> lock(p.use, std::try_to_lock);
  if (!lock.owns_lock()) return fn(begin, end);  // another thread has the pool: run here
  const int64_t chunk = (range + chunks - 1) / chunks;
  p.run(begin, end, chunk, static_cast<int>((range + chunk - 1) / chunk), fn);
}

void Team::sync() {
  if (size_ <= 1) return;
  const int phase = phase_.load(std::memory_order_acquire);
  if (arrived_.fetch_add(1, std::memory_order_acq_rel) == size_ - 1) {
    arrived_.store(0, std::memory_order_relaxed);
    phase_.fetch_add(1, std::memory_order_release);
    phase_.notify_all();  // a syscall only when a member sleeps
  } else {
    wait_while(phase_, phase, kIdle);
  }
}

void Team::sync(bool (*idle)(void*), void* ctx) {
  if (size_ <= 1) return;
  const int phase = phase_.load(std::memory_order_acquire);
  if (arrived_.fetch_add(1, std::memory_order_acq_rel) == size_ - 1) {
    arrived_.store(0, std::memory_order_relaxed);
    phase_.fetch_add(1, std::memory_order_release);
    phase_.notify_all();
    return;
  }
  while (phase_.load(std::memory_order_acquire) == phase) {
    if (!idle(ctx)) return wait_while(phase_, phase, kIdle);
  }
}

int team_size() {
  const int threads = in_pool_job ? 1 : std::max(1, at::get_num_threads());
  if (threads <= 1 || !pool_enabled()) return 1;
  return std::clamp(the_pool().load.free_cores(), 1, threads);
}

void run_team(int threads, const std::function<void(int, Team&)>& fn) {
  if (threads > 1 && !in_pool_job) {
    Pool& p = the_pool();
    std::unique_lock<std::mutex> lock(p.use, std::try_to_lock);
    if (lock.owns_lock()) {  // else another thread has the pool: this job runs alone
      Team team(threads);
      const std::function<void(int64_t, int64_t)> member = [&](int64_t rank, int64_t) {
        fn(static_cast<int>(rank), team);
      };
      p.run(0, threads, 1, threads, member);
      return;
    }
  }
  Team alone(1);
  const bool nested = in_pool_job;
  in_pool_job = true;  // its kernels never start jobs of their own
  try {
    fn(0, alone);
  } catch (...) {
    in_pool_job = nested;
    throw;
  }
  in_pool_job = nested;
}

}  // namespace hyloop

namespace {

// What a test checks of the pool: visits per index of [0, n) over one parallel_for (each must be
// exactly 1), then the number of distinct threads that ran a chunk.
at::Tensor pool_cover(int64_t n, int64_t grain) {
  at::Tensor out = at::zeros({n + 1}, at::kLong);
  int64_t* p = out.mutable_data_ptr<int64_t>();
  std::mutex m;
  std::set<std::thread::id> ids;
  hyloop::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) ++p[i];
    std::lock_guard<std::mutex> g(m);
    ids.insert(std::this_thread::get_id());
  });
  p[n] = static_cast<int64_t>(ids.size());
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hyloop, m) { m.def("pool_cover(int n, int grain) -> Tensor"); }

TORCH_LIBRARY_IMPL(hyloop, CompositeExplicitAutograd, m) { m.impl("pool_cover", &pool_cover); }
