// The CPU path: the same sources, row math and conversions as the kernels, over host memory, split
// into contiguous row ranges across threads when the input is large enough to pay for them.  Unlike
// the kernels it reads no O of zero weight at all: on the CPU nothing is gained by fetching early.
// A source's Real is what a row is computed in: float, or double for float64 calls (theirs alone).
#include <algorithm>
#include <cmath>
#include <type_traits>

#include "cpu_parallel.h"
#include "internal.h"

namespace attnmerge {
namespace detail {
namespace {

constexpr int64_t kChunk = 256;  // head_size elements accumulated at a time, on the stack (whole FP8 groups)
constexpr int kCached = 64;      // the weights of a row's first states, kept rather than recomputed

// Per-group FP8 and the block-scaled formats (OutView::group, OutView::block) of acc, the merged
// elements d0 .. d0 + len of row (token, head): whole groups, as kChunk is a multiple of every
// group.  Each group's scale is stored (and its share of the swizzled tiles' padding zeroed), its
// values scaled in place for FP8, or stored at dst (the row's bytes) for NVFP4: true then.
bool quantize_groups(float* acc, int64_t len, const OutView& out, const MergeShape& shape, int64_t token,
                     int64_t head, int64_t d0, uint8_t* dst) {
  const bool keep_nan = out.block != BlockScales::kFloat;
  const int64_t per_head = shape.head_size / out.group;
  for (int64_t g0 = 0; g0 < len; g0 += out.group) {
    uint32_t amax = 0;
    for (int64_t e = g0; e < g0 + out.group; ++e) amax = max_bits(amax, magnitude_bits(acc[e], keep_nan));
    const OutView::Scale s = out.block_scale(amax);
    const int64_t j = (d0 + g0) / out.group;
    out.store_scale(token, head, j, s);
    if (out.swizzled) out.zero_padding(token, head * per_head + j, shape.tokens, shape.heads * per_head, int64_t{0},
                                       int64_t{1});
    if (out.block == BlockScales::kNvfp4) {
      for (int64_t e = g0; e < g0 + out.group; e += 2) store_e2m1<2>(dst + (d0 + e) / 2, acc + e, s.multiplier, false);
    } else {
      for (int64_t e = g0; e < g0 + out.group; ++e) acc[e] *= s.multiplier;
    }
  }
  return out.block == BlockScales::kNvfp4;
}

template <typename Source, typename TIn, typename TOut>
ATTNMERGE_CPU_CLONES void merge_rows(const MergeShape& shape, const Source& src,
                                     const BasicOutView<typename Source::Real>& out, int64_t row_begin,
                                     int64_t row_end) {
  using Real = typename Source::Real;
  const Real factor = out.inverse_scale();
  int64_t token, head;
  shape.split_row(row_begin, token, head);  // then stepped: no division per row
  for (int64_t row = row_begin; row < row_end; ++row) {
    if (!src.masked_out(token)) {
      const auto states = src.template row<TIn>(token, head);
      const int n = states.count();
      // State s's LSE as the merge reads it (the source's StateExtras, where the call has them).
      const auto lse_of = [&](int s) -> Real {
        if constexpr (Source::Traits::kExtras) {
          if (src.extras.on) return src.settle(states.lse(s), token, head, s, true, shape.base2);
        }
        return states.lse(s);
      };
      BasicRowMerge<Real> r(shape.base2);
      const Real sink = sink_lse(src, head);  // a state of output 0: in the max and the total only
      if constexpr (Source::Traits::kSink) r.see(sink);
      for (int s = 0; s < n; ++s) r.see(lse_of(s));
      Real w[kCached];
      for (int s = 0; s < n; ++s) {
        const Real ws = r.weight(lse_of(s));
        if (s < kCached) w[s] = ws;
        r.total += ws;
      }
      if constexpr (Source::Traits::kSink) r.total += r.weight(sink);
      r.finish(factor);
      TOut* dst = out.template o_at<TOut>(token, head);
      // The parts that contribute (a part of zero weight is never read); two of them, the common
      // case, in one fused pass over head_size.
      int live = 0, first = -1, second = -1;
      for (int s = 0; s < n && live <= 2; ++s) {
        if (!states.reads_o(s) || (s < kCached ? w[s] : r.weight(lse_of(s))) == Real{0}) continue;
        (live++ == 0 ? first : second) = s;
      }
      if (live == 2 && n <= kCached && out.group == 0) {
        const TIn* x = states.template o_at<TIn>(first);
        const TIn* y = states.template o_at<TIn>(second);
        const Real sx = r.scale(w[first]), sy = r.scale(w[second]);
        // No loop-carried dependence: dst is x or y itself (in place) or disjoint from both.
#pragma GCC ivdep
        for (int64_t d = 0; d < shape.head_size; ++d)
          dst[d] = Convert<TOut>::store(sx * Convert<TIn>::load(x[d]) + sy * Convert<TIn>::load(y[d]));
      } else {
        for (int64_t d0 = 0; d0 < shape.head_size; d0 += kChunk) {
          const int64_t len = std::min(kChunk, shape.head_size - d0);
          Real acc[kChunk];  // NaN where an LSE is (a sink's too: it has no O to carry the NaN into the sum)
          std::fill(acc, acc + len, r.nan ? Real(NAN) : Real{0});
          for (int s = 0; s < n; ++s) {
            if (!states.reads_o(s)) continue;  // it weighs the row and adds nothing to O
            const Real ws = s < kCached ? w[s] : r.weight(lse_of(s));
            if (ws == Real{0}) continue;
            const Real scale = r.scale(ws);
            const TIn* o = states.template o_at<TIn>(s) + d0;
            for (int64_t d = 0; d < len; ++d) acc[d] += scale * Convert<TIn>::load(o[d]);
          }
          if constexpr (std::is_same<TOut, float8_e4m3_t>::value) {
            if (out.group > 0 &&
                quantize_groups(acc, len, out, shape, token, head, d0, out.template o_at<uint8_t>(token, head)))
              continue;  // NVFP4: stored
          }
#pragma GCC ivdep
          for (int64_t d = 0; d < len; ++d) dst[d0 + d] = Convert<TOut>::store(acc[d]);
        }
      }
      out.store_lse(token, head, r.lse());
    }
    if (++head == shape.heads) {
      head = 0;
      ++token;
    }
  }
}

// The O rows one row of the op reads, for the thread count: each input state's once (a share
// reads its own state's alone).
template <typename Source>
int64_t states_per_row(const Source&) { return 2; }
template <typename Real>
int64_t states_per_row(const BasicStackSource<Real>& src) { return src.states; }
template <typename Real>
int64_t states_per_row(const BasicShareSource<Real>&) { return 1; }
int64_t states_per_row(const ExchangeSource& src) { return src.world; }

}  // namespace

template <typename Source>
attnmerge_status cpu_merge(const MergeShape& shape, const Source& src, const BasicOutView<typename Source::Real>& out,
                           int in_dtype, int out_dtype) {
  using Real = typename Source::Real;
  // Rows are token-major: those of the live tokens come first, and the rest are left alone.
  const int64_t rows = shape.live() * shape.heads;
  const int64_t accesses = rows * shape.head_size * (states_per_row(src) + 1);
  return dispatch_cpu_in_dtype<Real>(in_dtype, [&](auto in_tag) {
    return dispatch_cpu_out_dtype<Real>(out_dtype, [&](auto out_tag) {
      using TIn = decltype(in_tag);
      using TOut = decltype(out_tag);
      parallel_rows(rows, cpu_threads(accesses), [&](int64_t begin, int64_t end) {
        merge_rows<Source, TIn, TOut>(shape, src, out, begin, end);
      });
    });
  });
}

#define ATTNMERGE_CPU_MERGE(Real)                                                                                    \
  template attnmerge_status cpu_merge(const MergeShape&, const BasicPairSource<Real>&, const BasicOutView<Real>&, int, \
                                      int);                                                                            \
  template attnmerge_status cpu_merge(const MergeShape&, const BasicSinkPairSource<Real>&, const BasicOutView<Real>&,  \
                                      int, int);                                                                       \
  template attnmerge_status cpu_merge(const MergeShape&, const BasicStackSource<Real>&, const BasicOutView<Real>&,     \
                                      int, int);                                                                       \
  template attnmerge_status cpu_merge(const MergeShape&, const BasicRangeSource<Real>&, const BasicOutView<Real>&,     \
                                      int, int);                                                                       \
  template attnmerge_status cpu_merge(const MergeShape&, const BasicShareSource<Real>&, const BasicOutView<Real>&,     \
                                      int, int);
ATTNMERGE_CPU_MERGE(float)
ATTNMERGE_CPU_MERGE(double)
#undef ATTNMERGE_CPU_MERGE
template attnmerge_status cpu_merge(const MergeShape&, const ExchangeSource&, const OutView&, int, int);

}  // namespace detail
}  // namespace attnmerge
