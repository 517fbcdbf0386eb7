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

// The factor that turns an LSE of one base into the other's (mixed bases: attnmerge.h's
// ATTNMERGE_LSE_B_* and ATTNMERGE_OUT_LSE_*): exactly 1 where the bases agree, so that a call of
// one base multiplies by 1 and its results keep every bit.
ATTNMERGE_HD constexpr float base_change(bool from_base2, bool to_base2) {
  return from_base2 == to_base2 ? 1.0f : from_base2 ? kLn2 : kLog2e;
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

ATTNMERGE_HD float fast_log2(float x) {
#if defined(__CUDA_ARCH__)
  float y;  // only ever of a row's total weight, 0 or >= 1: no subnormal inputs to scale first
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return std::log2(x);
#endif
}

// log2(x) of a state's softmax sum (settled_lse, sources.h): the hardware's approximation without
// flushing subnormal inputs to 0 (a sum is any float32 the caller hands over).
ATTNMERGE_HD float log2_of(float x) {
#if defined(__CUDA_ARCH__)
  float y;
  asm("lg2.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return std::log2(x);
#endif
}

ATTNMERGE_HD bool is_nan(float x) { return x != x; }

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

// The weights of a row's states, in three steps, each over the row's LSEs:
//   see(lse) for every state       the max LSE and whether any is NaN;
//   total += weight(lse) for each  exp(lse - max), exactly 1 for the max state, so total >= 1;
//   finish(factor), then scale(weight(lse)) the multiplier of that state's O, factor folded in.
// Branch-free apart from the NaN flag: an empty part (LSE -inf, or +inf as FlashAttention-2
// writes it) gets weight 0 whatever the others are, and a row of only empty parts gets total 0,
// every scale 0 and LSE -inf.  A NaN LSE makes every scale and the merged LSE NaN.  Shared by
// the GPU kernels and the CPU path, and by the two-way and N-way merges.
struct RowMerge {
  // Max LSE seen, in the input's units; -FLT_MAX rather than -inf while no part has a finite
  // LSE, so that weight() needs no select: an empty part's -inf - (-FLT_MAX) is still -inf.
  float m = -FLT_MAX;
  float total = 0.0f;   // sum of weight(lse) over the states
  float pre = 0.0f;     // factor, or NaN where a NaN LSE was seen: set by finish()
  float rinv = 0.0f;    // 1 / total, 0 where total is 0: set by finish()
  float inv = 0.0f;     // pre * rinv: the multiplier of an accumulation of weighted parts
  bool nan = false;
  float to_log2;        // 1 for base-2 LSEs, log2(e) for base e
  float from_log2;      // its inverse

  ATTNMERGE_HD explicit RowMerge(bool base2) : to_log2(base2 ? 1.0f : kLog2e), from_log2(base2 ? 1.0f : kLn2) {}

  // An LSE as the merge reads it: +inf (an empty FlashAttention-2 part) counts as -inf.
  static ATTNMERGE_HD float effective(float lse) { return lse == INFINITY ? -INFINITY : lse; }

  ATTNMERGE_HD void see(float lse) {
    const float l = effective(lse);
    nan |= is_nan(l);
    m = fmaxf(m, l);  // ignores a NaN
  }

  // exp(lse - max) through exp2: 0 for an empty part, or one 2^-126 below the max; NaN for a NaN
  // LSE.  Always >= +0, so a total of weights needs no 0 to start from.
  ATTNMERGE_HD float weight(float lse) const { return fast_exp2((effective(lse) - m) * to_log2); }

  // After every weight is in total: scale(w) = w * factor / total (factor: 1 / the output scale).
  // finish() and scale() select rather than branch, and keep the NaN flag and the factor off the
  // chain that starts at the reciprocal: on the GPU they run after the loads, where each dependent
  // instruction adds to a decode-sized merge's latency.
  ATTNMERGE_HD void finish(float factor) {
    pre = nan ? NAN : factor;
    const float r = reciprocal(total);
    rinv = total > 0.0f ? r : 0.0f;
    inv = pre * rinv;
  }

  ATTNMERGE_HD float scale(float weight) const { return (weight * pre) * rinv; }

  // The merged LSE in the input's base: NaN if any LSE was NaN, -inf when every part is empty.
  ATTNMERGE_HD float lse() const {
    const float v = m + fast_log2(total) * from_log2;
    return nan ? NAN : (total == 0.0f ? -INFINITY : v);
  }
};

}  // namespace attnmerge
