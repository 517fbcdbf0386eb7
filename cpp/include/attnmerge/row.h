// The per-row math of every merge: the weights of S states from their LSEs, and the merged LSE.
// Shared by the GPU kernels and the CPU path, and by the two-way and N-way merges.
#pragma once

#include <cfloat>
#include <cmath>

#include "attnmerge/numeric.h"

namespace attnmerge {

// Exponentials are taken in base 2 whatever the LSE base: lse * to_log2 is a base-2 log-sum-exp.
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// The type a row's math is done in, Real: float, or double for float64 storage (the CPU path
// only), and its constants; each float one is the very value of a float32 merge, so float32 calls
// keep every bit.  lowest: the lowest finite value.
template <typename Real>
struct RealConstants;
template <>
struct RealConstants<float> {
  static constexpr float log2e = kLog2e, ln2 = kLn2, lowest = -FLT_MAX;
};
template <>
struct RealConstants<double> {
  static constexpr double log2e = 1.4426950408889634074, ln2 = 0.69314718055994530942, lowest = -DBL_MAX;
};

// The factor that turns an LSE of one base into the other's (mixed bases: attnmerge.h's
// ATTNMERGE_LSE_B_* and ATTNMERGE_OUT_LSE_*): exactly 1 where the bases agree, so that a call of
// one base multiplies by 1 and its results keep every bit.
template <typename Real = float>
ATTNMERGE_HD constexpr Real base_change(bool from_base2, bool to_base2) {
  return from_base2 == to_base2 ? Real{1} : from_base2 ? RealConstants<Real>::ln2 : RealConstants<Real>::log2e;
}

// 2^x and log2(x).  On the device, the hardware's approximations (relative error near 2^-22,
// below a float32 ulp of any LSE that matters; subnormal weights flush to 0, which only drops
// parts already 2^-126 below the largest): each is one instruction where the exact versions
// take a dozen, and the merge issues them once per row and thread.
ATTNMERGE_HD float fast_exp2(float x) {
#if defined(__CUDA_ARCH__)
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return std::exp2(x);
#endif
}

// Whether fast_log2 flushes a subnormal input to 0 (kFlush: a row's total weight, 0 or >= 1, has
// none) or takes it as it is (kKeep: a state's softmax sum, any float32 a caller hands over).
enum class Subnormal : uint8_t { kFlush, kKeep };

template <Subnormal kInput = Subnormal::kFlush>
ATTNMERGE_HD float fast_log2(float x) {
#if defined(__CUDA_ARCH__)
  float y;
  if constexpr (kInput == Subnormal::kFlush) {
    asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  } else {
    asm("lg2.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  }
  return y;
#else
  return std::log2(x);
#endif
}

ATTNMERGE_HD bool is_nan(float x) { return x != x; }
ATTNMERGE_HD bool is_nan(double x) { return x != x; }

// The larger of two values, the other where one is NaN.
ATTNMERGE_HD float max_of(float a, float b) { return fmaxf(a, b); }

// 1 / x for x >= 1 (a row's total weight): the hardware's approximation is within an ulp there.
ATTNMERGE_HD float reciprocal(float x) {
#if defined(__CUDA_ARCH__)
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return 1.0f / x;
#endif
}

// float64 (the CPU path only): the exact functions.
inline double fast_exp2(double x) { return std::exp2(x); }
template <Subnormal = Subnormal::kFlush>
inline double fast_log2(double x) {
  return std::log2(x);
}
inline double reciprocal(double x) { return 1.0 / x; }
inline double max_of(double a, double b) { return std::fmax(a, b); }

// The weights of a row's states, in three steps, each over the row's LSEs:
//   see(lse) for every state       the max LSE and whether any is NaN;
//   total += weight(lse) for each  exp(lse - max), exactly 1 for the max state, so total >= 1;
//   finish(factor), then scale(weight(lse)) the multiplier of that state's O, factor folded in.
// Branch-free apart from the NaN flag: an empty part (LSE -inf, or +inf as FlashAttention-2
// writes it) gets weight 0 whatever the others are, and a row of only empty parts gets total 0,
// every scale 0 and LSE -inf.  A NaN LSE makes every scale and the merged LSE NaN.  Shared by
// the GPU kernels and the CPU path, and by the two-way and N-way merges; in Real (float, or double
// for float64 calls on the CPU path: RowMerge is the float one).
template <typename Real>
struct BasicRowMerge {
  // Max LSE seen, in the input's units; the lowest finite value rather than -inf while no part
  // has a finite LSE, so that weight() needs no select: an empty part's -inf - lowest is still -inf.
  Real m = RealConstants<Real>::lowest;
  Real total = 0;   // sum of weight(lse) over the states
  Real pre = 0;     // factor, or NaN where a NaN LSE was seen: set by finish()
  Real rinv = 0;    // 1 / total, 0 where total is 0: set by finish()
  Real inv = 0;     // pre * rinv: the multiplier of an accumulation of weighted parts
  bool nan = false;
  Real to_log2;     // 1 for base-2 LSEs, log2(e) for base e
  Real from_log2;   // its inverse

  ATTNMERGE_HD explicit BasicRowMerge(bool base2)
      : to_log2(base2 ? Real{1} : RealConstants<Real>::log2e), from_log2(base2 ? Real{1} : RealConstants<Real>::ln2) {}

  // An LSE as the merge reads it: +inf (an empty FlashAttention-2 part) counts as -inf.
  static ATTNMERGE_HD Real effective(Real lse) { return lse == INFINITY ? -INFINITY : lse; }

  ATTNMERGE_HD void see(Real lse) {
    const Real l = effective(lse);
    nan |= is_nan(l);
    m = max_of(m, l);  // ignores a NaN
  }

  // exp(lse - max) through exp2: 0 for an empty part, or one 2^-126 below the max; NaN for a NaN
  // LSE.  Always >= +0, so a total of weights needs no 0 to start from.
  ATTNMERGE_HD Real weight(Real lse) const { return fast_exp2((effective(lse) - m) * to_log2); }

  // After every weight is in total: scale(w) = w * factor / total (factor: 1 / the output scale).
  // finish() and scale() select rather than branch, and keep the NaN flag and the factor off the
  // chain that starts at the reciprocal: on the GPU they run after the loads, where each dependent
  // instruction adds to a decode-sized merge's latency.
  ATTNMERGE_HD void finish(Real factor) {
    pre = nan ? Real(NAN) : factor;
    const Real r = reciprocal(total);
    rinv = total > Real{0} ? r : Real{0};
    inv = pre * rinv;
  }

  ATTNMERGE_HD Real scale(Real weight) const { return (weight * pre) * rinv; }

  // The merged LSE in the input's base: NaN if any LSE was NaN, -inf when every part is empty.
  ATTNMERGE_HD Real lse() const {
    const Real v = m + fast_log2(total) * from_log2;
    return nan ? Real(NAN) : (total == Real{0} ? Real(-INFINITY) : v);
  }
};
using RowMerge = BasicRowMerge<float>;

}  // namespace attnmerge
