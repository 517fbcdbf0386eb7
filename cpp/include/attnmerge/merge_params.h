// The launch-level description of a merge and the per-element steps every path shares.
// Plain data, 64-bit sizes and offsets; strides count elements.
#pragma once

#include <cstdint>

#include "attnmerge/numeric.h"
#include "attnmerge/row.h"

namespace attnmerge {

// One input state: O at o + token * o_st + head * o_sh (head_size contiguous), LSE likewise.
struct StateView {
  const void* o;
  int64_t o_st, o_sh;
  const float* lse;
  int64_t lse_st, lse_sh;

  ATTNMERGE_HD float lse_at(int64_t token, int64_t head) const { return lse[token * lse_st + head * lse_sh]; }
  template <typename T>
  ATTNMERGE_HD const T* o_at(int64_t token, int64_t head) const {
    return static_cast<const T*>(o) + token * o_st + head * o_sh;
  }
};

struct MergeParams {
  int64_t tokens, heads, head_size;
  int64_t a_tokens;  // rows of tokens >= a_tokens take b alone and never read a
  void* out;
  int64_t out_st, out_sh;
  float* out_lse;  // may be null
  int64_t out_lse_st, out_lse_sh;
  StateView a, b;
  bool base2;

  template <typename T>
  ATTNMERGE_HD T* out_at(int64_t token, int64_t head) const {
    return static_cast<T*>(out) + token * out_st + head * out_sh;
  }
  ATTNMERGE_HD void store_lse(int64_t token, int64_t head, float v) const {
    if (out_lse != nullptr) out_lse[token * out_lse_st + head * out_lse_sh] = v;
  }
  // (token, head) of a row; 32-bit division where the sizes allow it, being several times cheaper.
  ATTNMERGE_HD void split_row(int64_t row, int64_t& token, int64_t& head) const {
    if (((tokens * heads) >> 32) == 0) {
      token = static_cast<uint32_t>(row) / static_cast<uint32_t>(heads);
    } else {
      token = row / heads;
    }
    head = row - token * heads;
  }
  // The two-way row: both LSEs through the shared row math.
  ATTNMERGE_HD RowMerge row(int64_t token, int64_t head, float& la, float& lb) const {
    la = token < a_tokens ? a.lse_at(token, head) : -INFINITY;
    lb = b.lse_at(token, head);
    RowMerge r(base2);
    r.add(la);
    r.add(lb);
    return r;
  }
};

// N consecutive elements, aligned to their whole size so that one access moves them all.
template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

template <typename T, int N>
ATTNMERGE_HD Pack<T, N> load_pack(const T* src) {
  return *reinterpret_cast<const Pack<T, N>*>(src);
}

// src[0:N], or zeros without touching memory when scale is 0 (an empty or underflowed part).
template <typename T, int N>
ATTNMERGE_HD Pack<T, N> load_if(const T* src, float scale) {
  Pack<T, N> p = {};
  if (scale != 0.0f) p = load_pack<T, N>(src);
  return p;
}

// acc += scale * p, unless scale is 0: a part of zero weight never contributes, so NaN or
// garbage in it cannot reach the result even when it was fetched.
template <typename T, int N>
ATTNMERGE_HD void accumulate(float (&acc)[N], const Pack<T, N>& p, float scale) {
  if (scale == 0.0f) return;
  ATTNMERGE_UNROLL
  for (int i = 0; i < N; ++i) acc[i] += scale * Convert<T>::load(p.v[i]);
}

// dst[0:N] = acc rounded once to T, or NaN for a row with a NaN LSE.
template <typename T, int N>
ATTNMERGE_HD void store_pack(T* dst, const float (&acc)[N], bool nan) {
  Pack<T, N> p;
ATTNMERGE_UNROLL
  for (int i = 0; i < N; ++i) p.v[i] = Convert<T>::store(nan ? NAN : acc[i]);
  *reinterpret_cast<Pack<T, N>*>(dst) = p;
}

}  // namespace attnmerge
