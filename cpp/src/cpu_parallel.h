// How the CPU path spreads rows over threads and which instruction sets its row loops are built
// for; shared by the forward (merge_cpu.cpp) and the backward (merge_backward_cpu.cpp).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <thread>
#include <vector>

namespace attnmerge {
namespace detail {

// On x86-64 the row loops are also compiled for AVX2 and the copy to run is chosen once, when the
// library is loaded (function multiversioning): the 16-bit conversions, emulated with integer
// vector operations, run about twice as fast 8 lanes wide as 4.  The same operations element by
// element (no FMA contraction), so both copies give the same bits.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(ATTNMERGE_NO_CPU_CLONES)
#define ATTNMERGE_CPU_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define ATTNMERGE_CPU_CLONES
#endif

// Threads for `accesses` element reads and writes: one per 2^21, at most the hardware's (or
// ATTNMERGE_NUM_THREADS).  Each call starts its threads, some tens of microseconds: below that one
// thread finishes first (64 x 32 x 128 float32, 0.8M accesses: 82 us on one thread, 117 us on
// two).  Counted in elements, not bytes: a 16-bit element costs a conversion each way.
inline int64_t cpu_threads(int64_t accesses) {
  static const int64_t limit = [] {
    const char* env = std::getenv("ATTNMERGE_NUM_THREADS");
    const long n = env ? std::strtol(env, nullptr, 10) : 0;
    return n > 0 ? static_cast<int64_t>(n) : std::max<int64_t>(1, std::thread::hardware_concurrency());
  }();
  return std::max<int64_t>(1, std::min<int64_t>(limit, accesses >> 21));
}

// Runs body(row_begin, row_end) over [0, rows) on up to `threads` threads, the caller's included.
template <typename Body>
void parallel_rows(int64_t rows, int64_t threads, Body body) {
  threads = std::min(threads, rows);
  if (threads <= 1) return body(int64_t{0}, rows);
  std::vector<std::thread> helpers;
  helpers.reserve(threads - 1);
  const int64_t chunk = (rows + threads - 1) / threads;
  for (int64_t begin = chunk; begin < rows; begin += chunk) {
    const int64_t end = std::min(rows, begin + chunk);
    try {
      helpers.emplace_back(body, begin, end);
    } catch (...) {  // no thread to be had: do that range here rather than fail
      body(begin, end);
    }
  }
  body(int64_t{0}, std::min(rows, chunk));
  for (std::thread& t : helpers) t.join();
}

}  // namespace detail
}  // namespace attnmerge
