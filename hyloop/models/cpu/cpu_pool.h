// hyloop's thread pool for its own CPU kernels (cpu_pool.cpp says why it is not OpenMP's).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>

namespace hyloop {

// fn(chunk_begin, chunk_end) over [begin, end) in at most torch's thread count of contiguous
// chunks, each at least `grain` long (at::parallel_for's contract). The calling thread runs the
// first chunk; it returns when every chunk is done. Nested calls, calls from a second thread
// while the pool is busy, and one-chunk calls run inline.
void parallel_for(int64_t begin, int64_t end, int64_t grain,
                  const std::function<void(int64_t, int64_t)>& fn);

// A team of threads running one job together (``run_team``): each member gets its rank, and
// ``sync()`` waits until every member has reached it (a barrier between a job's phases).
class Team {
 public:
  explicit Team(int size) : size_(size) {}
  int size() const { return size_; }
  void sync();
  // sync(), calling idle(ctx) while the others have not arrived, until it returns false (its
  // work is done): a member that arrives early does useful work instead of spinning.
  void sync(bool (*idle)(void*), void* ctx);

 private:
  int size_;
  alignas(64) std::atomic<int> arrived_{0};
  alignas(64) std::atomic<int> phase_{0};
};

// How many threads a team gets now: torch's thread count on a quiet machine, fewer as other
// processes take cores (at least 1: then the job runs on the calling thread alone, with no
// barrier to wait at).
int team_size();

// fn(rank, team) on `threads` threads (the calling thread is rank 0); returns when all are
// done. A member's exception is rethrown here after the others finish (a member that throws
// must not leave the others waiting at a barrier: jobs check their inputs before the first one).
void run_team(int threads, const std::function<void(int, Team&)>& fn);

// parallel_for over [0, n) in one chunk per thread (the GEMMs' split over output tiles).
inline void parallel_chunks(int64_t n, const std::function<void(int64_t, int64_t)>& fn) {
  const int64_t threads = std::max(1, at::get_num_threads());
  parallel_for(0, n, std::max<int64_t>(1, (n + threads - 1) / threads), fn);
}

}  // namespace hyloop
