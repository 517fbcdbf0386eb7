// The backward of the merges: for a row with the forward's output O and LSE, and the gradients dO
// and dLSE of them, each state i of the row gets, with p_i = b^(lse_i - LSE) (b = e or 2),
//
//   dO_i = p_i dO,   dlse_i = p_i (dLSE + ln(b) <dO, O_i - O>)      (<,> over head_size)
//
// No sum over states: a row's states are independent once O and LSE are known, so the walk is
// the forward's (one row (token, head) at a time, its states from the forward's sources) and each
// row reads dO, O and each O_i once.  Shared by the GPU kernel (merge_backward_kernels.cuh) and
// the CPU loop (cpp/src/merge_backward_cpu.cpp), like views.h and sources.h for the forward.
//
// A backward source pairs a forward source (where each state's O_i and lse_i are) with the same
// geometry over the gradient tensors (where dO_i and dlse_i go), and says which states of a row
// are written and which of those are the row's own:
//   PairBackward   the two-way merge (a_tokens: rows of later tokens have no state a, whose
//                  gradient tensors hold only a_tokens tokens);
//   StackBackward  the N-way merge, S stacked states;
//   RangeBackward  the variable-length merge; states no row takes (before indptr[0], from
//                  indptr[rows] on) are given to the first and last rows, which write zeros there.
// Each has a Real, its sources' (sources.h): float, or double for float64 calls on the CPU path.
#pragma once

#include <cmath>
#include <cstdint>

#include "attnmerge/pack.h"
#include "attnmerge/sources.h"
#include "attnmerge/views.h"
#include "attnmerge/row.h"

namespace attnmerge {

// A gradient pointer from the geometry of a forward source (whose pointers are const).
template <typename T>
ATTNMERGE_HD T* writable(const T* p) {
  return const_cast<T*>(p);
}

// The states of one row as the backward walks them: `in` the forward's row (lse(s), o_at<T>(s)),
// `grad` where state s's gradients go (o_at(s), lse_at(s); null: not written).  States [lo, hi)
// are walked; those in [live_lo, live_hi) are the row's own and get the formula, the others zeros.  has_out: the row is
// a row of the forward's output (false only for RangeBackward's row over states when there are no
// rows): O, LSE, dO and dLSE are read only where it is.
template <typename InRow, typename GradRow>
struct BackwardRow {
  InRow in;
  GradRow grad;
  int lo, hi, live_lo, live_hi;
  bool has_out;
  ATTNMERGE_HD bool live(int s) const { return s >= live_lo && s < live_hi; }
};

// Gradient pointers of a two-state row.
template <typename T, typename Real = float>
struct PairGradRow {
  T* o[2];
  Real* l[2];
  ATTNMERGE_HD T* o_at(int s) const { return o[s]; }
  ATTNMERGE_HD Real* lse_at(int s) const { return l[s]; }
};

// Gradient pointers of n states o_ss and l_ss elements apart.
template <typename T, typename I, typename Real = float>
struct StridedGradRow {
  T* o0;
  Real* l0;
  I o_ss, l_ss;
  ATTNMERGE_HD T* o_at(int s) const { return o0 + s * o_ss; }
  ATTNMERGE_HD Real* lse_at(int s) const { return l0 + s * l_ss; }
};

// The two-way merge.  grad: dO_a, dlse_a, dO_b, dlse_b in PairSource's geometry (its a_tokens and
// mask unused).  A row of a token >= in.a_tokens has no state a: only state b is written.  A
// gradient not asked for has a null pointer and zero strides: its addresses are null, not written.
template <typename R>
struct BasicPairBackward {
  static constexpr int kMaxStates = 2;
  using Real = R;
  BasicPairSource<Real> in, grad;

  template <typename T, typename I>
  ATTNMERGE_HD BackwardRow<typename BasicPairSource<Real>::Row, PairGradRow<T, Real>> row(I token, I head) const {
    const bool has_a = token < static_cast<I>(in.a_tokens);
    const I ta = has_a ? token : I{0};  // no offset past the end of a's gradients
    BackwardRow<typename BasicPairSource<Real>::Row, PairGradRow<T, Real>> r;
    r.in = in.template row<T>(token, head);
    r.grad.o[0] = has_a ? writable(grad.a.template o_at<T>(ta, head)) : nullptr;
    r.grad.o[1] = writable(grad.b.template o_at<T>(token, head));
    r.grad.l[0] = has_a ? writable(grad.a.lse + (ta * static_cast<I>(grad.a.lse_st) + head * static_cast<I>(grad.a.lse_sh)))
                        : nullptr;
    r.grad.l[1] = writable(grad.b.lse + (token * static_cast<I>(grad.b.lse_st) + head * static_cast<I>(grad.b.lse_sh)));
    // Both states walked (a fixed count keeps the state index a constant: the kernel's arrays stay
    // in registers); state a, when the row has none, is not live and has no gradient address.
    r.lo = 0;
    r.hi = 2;
    r.live_lo = has_a ? 0 : 1;
    r.live_hi = 2;
    r.has_out = true;
    return r;
  }
};
using PairBackward = BasicPairBackward<float>;

// The N-way merge.  grad: dO [tokens, S, heads, head_size] and dlse [tokens, S, heads] in
// StackSource's geometry.
template <typename R>
struct BasicStackBackward {
  static constexpr int kMaxStates = 0;
  using Real = R;
  BasicStackSource<Real> in, grad;

  template <typename T, typename I>
  ATTNMERGE_HD BackwardRow<StridedRow<I, Real>, StridedGradRow<T, I, Real>> row(I token, I head) const {
    BackwardRow<StridedRow<I, Real>, StridedGradRow<T, I, Real>> r;
    r.in = in.template row<T>(token, head);
    r.grad.o0 = writable(static_cast<const T*>(grad.o) +
                         (token * static_cast<I>(grad.o_st) + head * static_cast<I>(grad.o_sh)));
    r.grad.l0 = writable(grad.lse + (token * static_cast<I>(grad.lse_st) + head * static_cast<I>(grad.lse_sh)));
    r.grad.o_ss = static_cast<I>(grad.o_ss);
    r.grad.l_ss = static_cast<I>(grad.lse_ss);
    r.lo = r.live_lo = 0;
    r.hi = r.live_hi = r.in.count();
    r.has_out = true;
    return r;
  }
};
using StackBackward = BasicStackBackward<float>;

// The variable-length merge.  grad: dO [total, heads, head_size] and dlse [total, heads] in
// RangeSource's geometry (its indptr unused).  Row r's states are in.bound(r) .. in.bound(r + 1)
// (clamped as the forward clamps them); row 0 also walks the states before its first and the last
// row those after its last, writing zeros there, so that every state's gradient is written.  With
// no rows at all, the walk has one row (rows == 0 here) over every state, all zeros.
template <typename R>
struct BasicRangeBackward {
  static constexpr int kMaxStates = 0;
  using Real = R;
  BasicRangeSource<Real> in, grad;
  int64_t rows;  // of the forward's output

  template <typename T, typename I>
  ATTNMERGE_HD BackwardRow<StridedRow<I, Real>, StridedGradRow<T, I, Real>> row(I token, I head) const {
    const I total = static_cast<I>(in.total);
    const bool has_out = rows > 0;
    const I own_lo = has_out ? in.bound(token) : total;
    const I own_hi_raw = has_out ? in.bound(token + 1) : total;
    const I own_hi = own_hi_raw > own_lo ? own_hi_raw : own_lo;  // bounds that cross: no states
    const I begin = token == 0 ? I{0} : own_lo;
    const I end = token + 1 >= static_cast<I>(rows) ? total : own_hi;
    const int64_t n = end > begin ? end - begin : 0;
    BackwardRow<StridedRow<I, Real>, StridedGradRow<T, I, Real>> r;
    r.in = StridedRow<I, Real>{static_cast<const T*>(in.o) +
                                   (begin * static_cast<I>(in.o_st) + head * static_cast<I>(in.o_sh)),
                         in.lse + (begin * static_cast<I>(in.lse_st) + head * static_cast<I>(in.lse_sh)),
                         static_cast<I>(in.o_st), static_cast<I>(in.lse_st),
                         static_cast<int>(n < INT32_MAX ? n : INT32_MAX)};
    r.grad.o0 = writable(static_cast<const T*>(grad.o) +
                         (begin * static_cast<I>(grad.o_st) + head * static_cast<I>(grad.o_sh)));
    r.grad.l0 = writable(grad.lse + (begin * static_cast<I>(grad.lse_st) + head * static_cast<I>(grad.lse_sh)));
    r.grad.o_ss = static_cast<I>(grad.o_st);
    r.grad.l_ss = static_cast<I>(grad.lse_st);
    r.lo = 0;
    r.hi = r.in.count();
    r.live_lo = static_cast<int>(own_lo - begin);
    r.live_hi = static_cast<int>(own_hi - begin);
    r.has_out = has_out;
    return r;
  }
};
using RangeBackward = BasicRangeBackward<float>;

// The most states a row of each source has, for plan_backward (0: not known before the launch).
template <typename Real>
int64_t max_states(const BasicPairBackward<Real>&) { return 2; }
template <typename Real>
int64_t max_states(const BasicStackBackward<Real>& s) { return s.in.states; }
template <typename Real>
int64_t max_states(const BasicRangeBackward<Real>&) { return 0; }

// What a backward reads beside its states and where it writes: the forward's output (O and LSE)
// and the gradients dO and dLSE of them, each [tokens, heads, ...] (dLSE may be absent: zero).
// want_o / want_lse: the states' dO_i / dlse_i are wanted (an absent one is neither written nor,
// for dlse, computed: without it no O_i or O is read at all).
template <typename Src>
struct BackwardArgs {
  Src src;
  BasicStateView<typename Src::Real> out;  // O and LSE of the forward (o null: O not read, see the C ABI's out = NULL)
  BasicStateView<typename Src::Real> grad_out;  // dO and dLSE (lse null: dLSE = 0)
  bool want_o, want_lse;
};

// A row's weights p_i and gradients of the LSEs, in Real (float32 on host and device alike, or
// float64 for float64 calls on the CPU path; GradWeights is the float one).
template <typename Real>
struct BasicGradWeights {
  Real lse;       // the forward's merged LSE of the row
  Real dlse_out;  // dLSE
  Real to_log2;   // 1 for base-2 LSEs, log2(e) for base e
  Real ln_base;   // ln(b): 1 for base e, ln(2) for base 2

  ATTNMERGE_HD BasicGradWeights(Real lse_, Real dlse_out_, bool base2)
      : lse(lse_),
        dlse_out(dlse_out_),
        to_log2(base2 ? Real{1} : RealConstants<Real>::log2e),
        ln_base(base2 ? RealConstants<Real>::ln2 : Real{1}) {}

  // p = b^(lse_i - LSE); exactly 0 for an empty part (LSE -inf, or +inf as FlashAttention-2
  // writes it) whatever LSE is, so an all-empty row (LSE -inf) gets zeros, not NaN.  A NaN
  // lse_i or LSE gives NaN.
  ATTNMERGE_HD Real p(Real lse_i) const {
    const Real l = BasicRowMerge<Real>::effective(lse_i);
    return l == -INFINITY ? Real{0} : fast_exp2((l - lse) * to_log2);
  }

  // dO_i's element for dO's element g: zero for a part of zero weight, whatever dO holds.
  static ATTNMERGE_HD Real grad_o(Real p, Real g) { return p != Real{0} ? p * g : Real{0}; }

  // dlse_i from p_i and <dO, O_i - O>: zero for a part of zero weight, whatever its O held.
  ATTNMERGE_HD Real grad_lse(Real p, Real dot) const { return p != Real{0} ? p * (dlse_out + ln_base * dot) : Real{0}; }
};
using GradWeights = BasicGradWeights<float>;

}  // namespace attnmerge
