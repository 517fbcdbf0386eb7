// How the CPU path spreads rows over threads and which instruction sets its row loops are built
// for; shared by the forward (merge_cpu.cpp) and the backward (merge_backward_cpu.cpp).
#pragma once

#include <algorithm>
#include <cstdint>

#include "attnmerge/attnmerge.h"

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

// ATTNMERGE_NUM_THREADS, read at the first CPU call: ATTNMERGE_SUCCESS where it is a whole number
// from 1 to 1024 or unset, else an error naming it and its value, which every CPU call returns
// before it writes anything (the library never prints, so a bad value is never taken silently).
attnmerge_status check_cpu_threads();

// Threads for `accesses` element reads and writes: one per 2^21, at most the hardware's (or
// ATTNMERGE_NUM_THREADS).  Below that one thread finishes first
// (benchmarks/NOTES.md#cpu-threads).  Counted in elements, not bytes: a 16-bit element costs a conversion each way.
int64_t cpu_threads(int64_t accesses);

// Runs run(ctx, begin, end) over [0, rows), cut into `threads` ranges that the calling thread and
// the library's pool of threads (started on first use, kept for later calls) take in turn; returns
// when all are done.  The caller takes ranges too, so the call finishes whatever the pool does.
void run_on_pool(int64_t rows, int64_t threads, void (*run)(void* ctx, int64_t begin, int64_t end), void* ctx);

// Runs body(row_begin, row_end) over [0, rows) on up to `threads` threads, the caller's included.
template <typename Body>
void parallel_rows(int64_t rows, int64_t threads, Body body) {
  threads = std::min(threads, rows);
  if (threads <= 1) return body(int64_t{0}, rows);
  run_on_pool(
      rows, threads, [](void* ctx, int64_t begin, int64_t end) { (*static_cast<Body*>(ctx))(begin, end); }, &body);
}

}  // namespace detail
}  // namespace attnmerge
