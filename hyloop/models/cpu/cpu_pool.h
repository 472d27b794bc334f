// hyloop's thread pool for its own CPU kernels (cpu_pool.cpp says why it is not OpenMP's).
#pragma once

#include <cstdint>
#include <functional>

namespace hyloop {

// fn(chunk_begin, chunk_end) over [begin, end) in at most torch's thread count of contiguous
// chunks, each at least `grain` long (at::parallel_for's contract). The calling thread runs the
// first chunk; it returns when every chunk is done. Nested calls, calls from a second thread
// while the pool is busy, and one-chunk calls run inline.
void parallel_for(int64_t begin, int64_t end, int64_t grain,
                  const std::function<void(int64_t, int64_t)>& fn);

}  // namespace hyloop
