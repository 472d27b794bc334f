// hyloop's thread pool for its own CPU kernels (cpu_pool.cpp says why it is not OpenMP's).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <functional>

namespace hyloop {

// fn(chunk_begin, chunk_end) over [begin, end) in at most torch's thread count of contiguous
// chunks, each at least `grain` long (at::parallel_for's contract). The calling thread runs the
// first chunk; it returns when every chunk is done. Nested calls, calls from a second thread
// while the pool is busy, and one-chunk calls run inline.
void parallel_for(int64_t begin, int64_t end, int64_t grain,
                  const std::function<void(int64_t, int64_t)>& fn);

// parallel_for over [0, n) in one chunk per thread (the GEMMs' split over output tiles).
inline void parallel_chunks(int64_t n, const std::function<void(int64_t, int64_t)>& fn) {
  const int64_t threads = std::max(1, at::get_num_threads());
  parallel_for(0, n, std::max<int64_t>(1, (n + threads - 1) / threads), fn);
}

}  // namespace hyloop
