// The CPU path of the backward: the backward sources and per-state math of backward_params.h over
// host memory, rows split across threads as the forward splits them (cpu_parallel.h).  Per row,
// head_size is taken kChunk elements at a time: that chunk of dO and O is converted to the source's
// Real (float32, or float64 for float64 calls) once for a block of up to kBlock states, each
// state's part of its dot summed and p_i dO stored, so dO, O and every O_i are read once for rows
// of up to kBlock states.  Like the forward's CPU path it reads no O_i of zero weight at all.
#include <algorithm>

#include "cpu_parallel.h"
#include "internal.h"

namespace attnmerge {
namespace detail {
namespace {

constexpr int64_t kChunk = 256;  // head_size elements of dO and O held in Real, on the stack
constexpr int kBlock = 64;       // states whose dots are summed together

// <dv, x - ov> over len elements, in kLanes partial sums: a single running sum is a chain of
// dependent adds that the compiler may not reorder (no -ffast-math), so it would not vectorize.
constexpr int kLanes = 8;
template <typename Real, typename TIn>
inline Real dot_chunk(const Real* dv, const Real* ov, const TIn* x, int64_t len) {
  Real part[kLanes] = {};
  int64_t d = 0;
  for (; d + kLanes <= len; d += kLanes)
    for (int j = 0; j < kLanes; ++j) part[j] += dv[d + j] * (Convert<TIn>::load(x[d + j]) - ov[d + j]);
  Real sum = 0;
  for (int j = 0; j < kLanes; ++j) sum += part[j];
  for (; d < len; ++d) sum += dv[d] * (Convert<TIn>::load(x[d]) - ov[d]);
  return sum;
}

template <typename Src, typename TIn, typename TOut>
ATTNMERGE_CPU_CLONES void backward_rows(const MergeShape& shape, const BackwardArgs<Src>& a, int64_t row_begin,
                                        int64_t row_end) {
  using Real = typename Src::Real;
  int64_t token, head;
  shape.split_row(row_begin, token, head);  // then stepped: no division per row
  for (int64_t row = row_begin; row < row_end; ++row) {
    const auto r = a.src.template row<TIn>(token, head);
    Real lse = -INFINITY, dlse = 0;
    if (r.has_out) {
      lse = a.out.lse_at(token, head);
      if (a.grad_out.lse != nullptr) dlse = a.grad_out.lse_at(token, head);
    }
    const BasicGradWeights<Real> g(lse, dlse, shape.base2);
    const TOut* const d_out = a.grad_out.template o_at<TOut>(token, head);
    const TOut* const o_out = a.out.template o_at<TOut>(token, head);
    // Without the forward's O, <dO, O_i - O> is <dO, O_i> - sum_j p_j <dO, O_j>: the dots of a row
    // of more than a block of states are stored raw, then finished once the sum is known.
    const bool o_free = a.out.o == nullptr;
    const bool two_pass = o_free && r.hi - r.lo > kBlock;
    Real dot_o = 0;  // <dO, O>, or the part of sum_j p_j <dO, O_j> seen so far
    for (int s0 = r.lo; s0 < r.hi; s0 += kBlock) {
      const int m = std::min(kBlock, r.hi - s0);
      Real p[kBlock], dot[kBlock];
      for (int c = 0; c < m; ++c) {
        p[c] = r.live(s0 + c) ? g.p(r.in.lse(s0 + c)) : Real{0};
        dot[c] = 0;
      }
      for (int64_t d0 = 0; d0 < shape.head_size; d0 += kChunk) {
        const int64_t len = std::min(kChunk, shape.head_size - d0);
        Real dv[kChunk], ov[kChunk];  // only [0, len) set: zeroing all of them took as long as a row
        if (r.has_out) {
          for (int64_t d = 0; d < len; ++d) dv[d] = Convert<TOut>::load(d_out[d0 + d]);
        } else {
          std::fill(dv, dv + len, Real{0});  // a row with no output: every p is 0
        }
        if (r.has_out && a.want_lse && !o_free) {
          for (int64_t d = 0; d < len; ++d) ov[d] = Convert<TOut>::load(o_out[d0 + d]);
        } else {
          std::fill(ov, ov + len, Real{0});
        }
        for (int c = 0; c < m; ++c) {
          const int s = s0 + c;
          if (a.want_lse && p[c] != Real{0}) {
            dot[c] += dot_chunk(dv, ov, r.in.template o_at<TIn>(s) + d0, len);
          }
          if (a.want_o && r.grad.o_at(s) != nullptr) {  // null: that gradient not asked for
            TIn* const y = r.grad.o_at(s) + d0;
            const Real pc = p[c];
#pragma GCC ivdep
            for (int64_t d = 0; d < len; ++d) y[d] = Convert<TIn>::store(BasicGradWeights<Real>::grad_o(pc, dv[d]));
          }
        }
      }
      if (a.want_lse) {
        if (o_free)
          for (int c = 0; c < m; ++c) dot_o += p[c] != Real{0} ? p[c] * dot[c] : Real{0};
        for (int c = 0; c < m; ++c)
          if (Real* const q = r.grad.lse_at(s0 + c)) *q = two_pass ? dot[c] : g.grad_lse(p[c], dot[c] - dot_o);
      }
    }
    if (two_pass && a.want_lse)
      for (int s = r.lo; s < r.hi; ++s)
        if (Real* const q = r.grad.lse_at(s)) *q = g.grad_lse(r.live(s) ? g.p(r.in.lse(s)) : Real{0}, *q - dot_o);
    if (++head == shape.heads) {
      head = 0;
      ++token;
    }
  }
}

}  // namespace

template <typename Src>
attnmerge_status cpu_merge_backward(const MergeShape& shape, const BackwardArgs<Src>& args, int64_t states,
                                    int in_dtype, int out_dtype) {
  const int64_t rows = shape.tokens * shape.heads;
  const int64_t accesses = rows * shape.head_size * (2 * states + 2);  // O_i and dO_i, dO and O
  using Real = typename Src::Real;
  return dispatch_cpu_in_dtype<Real>(in_dtype, [&](auto in_tag) {
    return dispatch_cpu_in_dtype<Real>(out_dtype, [&](auto out_tag) {
      using TIn = decltype(in_tag);
      using TOut = decltype(out_tag);
      parallel_rows(rows, cpu_threads(accesses), [&](int64_t begin, int64_t end) {
        backward_rows<Src, TIn, TOut>(shape, args, begin, end);
      });
    });
  });
}

#define ATTNMERGE_CPU_MERGE_BACKWARD(Real)                                                                   \
  template attnmerge_status cpu_merge_backward(const MergeShape&, const BackwardArgs<BasicPairBackward<Real>>&,  \
                                               int64_t, int, int);                                             \
  template attnmerge_status cpu_merge_backward(const MergeShape&, const BackwardArgs<BasicStackBackward<Real>>&, \
                                               int64_t, int, int);                                             \
  template attnmerge_status cpu_merge_backward(const MergeShape&, const BackwardArgs<BasicRangeBackward<Real>>&, \
                                               int64_t, int, int);
ATTNMERGE_CPU_MERGE_BACKWARD(float)
ATTNMERGE_CPU_MERGE_BACKWARD(double)
#undef ATTNMERGE_CPU_MERGE_BACKWARD

}  // namespace detail
}  // namespace attnmerge
