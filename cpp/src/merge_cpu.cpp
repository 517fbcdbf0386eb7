// The CPU path: the same row math and element steps as the kernels, over host memory, split into
// contiguous row ranges across threads when the input is large enough to pay for them.
#include <algorithm>
#include <cstdlib>
#include <thread>
#include <vector>

#include "internal.h"

namespace attnmerge {
namespace detail {
namespace {

template <typename TIn, typename TOut>
void merge2_rows(const MergeParams& p, int64_t row_begin, int64_t row_end) {
  for (int64_t row = row_begin; row < row_end; ++row) {
    int64_t token, head;
    p.split_row(row, token, head);
    float la, lb;
    const RowMerge r = p.row(token, head, la, lb);
    const float sa = r.scale(la), sb = r.scale(lb);
    const TIn* a = p.a.o_at<TIn>(token, head);
    const TIn* b = p.b.o_at<TIn>(token, head);
    TOut* out = p.out_at<TOut>(token, head);
    for (int64_t d = 0; d < p.head_size; ++d) {
      const Pack<TIn, 1> pa = load_if<TIn, 1>(a + d, sa);
      const Pack<TIn, 1> pb = load_if<TIn, 1>(b + d, sb);
      float acc[1] = {};
      accumulate(acc, pa, sa);
      accumulate(acc, pb, sb);
      store_pack<TOut, 1>(out + d, acc, r.nan);
    }
    p.store_lse(token, head, r.lse());
  }
}

// Threads for `bytes` of traffic: one per 1 MiB, at most the hardware's (or ATTNMERGE_NUM_THREADS).
int64_t cpu_threads(int64_t bytes) {
  static const int64_t limit = [] {
    const char* env = std::getenv("ATTNMERGE_NUM_THREADS");
    const long n = env ? std::strtol(env, nullptr, 10) : 0;
    return n > 0 ? static_cast<int64_t>(n) : std::max<int64_t>(1, std::thread::hardware_concurrency());
  }();
  return std::max<int64_t>(1, std::min<int64_t>(limit, bytes >> 20));
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

}  // namespace

void cpu_merge2(const MergeParams& p, int in_dtype, int out_dtype) {
  const int64_t rows = p.tokens * p.heads;
  const int64_t bytes = rows * p.head_size * static_cast<int64_t>(2 * dtype_size(in_dtype) + dtype_size(out_dtype));
  dispatch_dtype(in_dtype, [&](auto in_tag) {
    dispatch_dtype(out_dtype, [&](auto out_tag) {
      using TIn = decltype(in_tag);
      using TOut = decltype(out_tag);
      parallel_rows(rows, cpu_threads(bytes),
                    [&p](int64_t begin, int64_t end) { merge2_rows<TIn, TOut>(p, begin, end); });
    });
  });
}

}  // namespace detail
}  // namespace attnmerge
