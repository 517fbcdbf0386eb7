// The per-row math of every merge: the weights of S states from their LSEs, and the merged LSE.
// Shared by the GPU kernels and the CPU path, and by the two-way and N-way merges.
#pragma once

#include <cmath>

#include "attnmerge/numeric.h"

namespace attnmerge {

// Exponentials are taken in base 2 whatever the LSE base: lse * to_log2 is a base-2 log-sum-exp.
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

ATTNMERGE_HD float fast_exp2(float x) {
#if defined(__CUDA_ARCH__)
  return exp2f(x);
#else
  return std::exp2(x);
#endif
}

ATTNMERGE_HD float fast_log2(float x) {
#if defined(__CUDA_ARCH__)
  return log2f(x);
#else
  return std::log2(x);
#endif
}

// x / y for y in [1, number of states]: the hardware's fast division is exact enough there.
ATTNMERGE_HD float div_by_weight(float x, float y) {
#if defined(__CUDA_ARCH__)
  return __fdividef(x, y);
#else
  return x / y;
#endif
}

ATTNMERGE_HD bool is_nan(float x) { return x != x; }

// Running (max, sum of weights) over the states of one row; add() takes each LSE once.
// The max stays in the input's units, so a row with one live state returns its LSE bit for bit;
// differences are scaled to base 2 before exponentiation.
struct RowMerge {
  float m = -INFINITY;  // max LSE seen
  float w = 0.0f;       // sum of exp(lse - m) in the input's base
  bool nan = false;
  float to_log2;        // 1 for base-2 LSEs, log2(e) for base e

  ATTNMERGE_HD explicit RowMerge(bool base2) : to_log2(base2 ? 1.0f : kLog2e) {}

  // An LSE as the merge reads it: +inf (an empty FlashAttention-2 part) counts as -inf.
  static ATTNMERGE_HD float effective(float lse) { return lse == INFINITY ? -INFINITY : lse; }

  ATTNMERGE_HD void add(float lse) {
    const float l = effective(lse);
    if (is_nan(l)) { nan = true; return; }
    if (l == -INFINITY) return;  // an empty part adds no weight
    if (l > m) {
      w = w * fast_exp2((m - l) * to_log2) + 1.0f;  // exp2(-inf) = 0 on the first state
      m = l;
    } else {
      w += fast_exp2((l - m) * to_log2);
    }
  }

  // The multiplier of the state with LSE `lse` in the merged O: exactly 0 for an empty part or
  // one whose weight underflows, so such a part is never read.  NaN rows are the caller's.
  ATTNMERGE_HD float scale(float lse) const {
    const float l = effective(lse);
    if (!(l > -INFINITY) || w == 0.0f) return 0.0f;
    return div_by_weight(fast_exp2((l - m) * to_log2), w);  // w >= 1: the max state adds exactly 1
  }

  // The merged LSE in the input's base: NaN if any LSE was NaN, -inf when every part is empty.
  ATTNMERGE_HD float lse() const {
    if (nan) return NAN;
    if (w == 0.0f) return -INFINITY;
    return m + fast_log2(w) / to_log2;
  }
};

}  // namespace attnmerge
