// The launch-level description of a merge and the per-element steps every path shares.
// Plain data, 64-bit sizes and offsets; strides count elements.
//
// Every op is one walk over the rows (token, head) of the output: a *source* hands each row its
// states (how many, where each O starts, each LSE), the shared row math (row.h) turns their LSEs
// into weights, and the element steps below combine the O packs.  The GPU kernel and the CPU
// loop take the same sources:
//   PairSource   two states, a limited to its first a_tokens tokens, rows optionally masked
//                (the two-way merge and the in-place merge);
//   StackSource  S states stacked along a strided axis (the N-way merge);
//   RangeSource  states [indptr[r], indptr[r+1]) of a flat list (the variable-length merge).
#pragma once

#include <cstdint>

#include "attnmerge/numeric.h"
#include "attnmerge/row.h"

namespace attnmerge {

struct MergeShape {
  int64_t tokens, heads, head_size;
  bool base2;

  // (token, head) of a row; 32-bit division where the sizes allow it, being several times cheaper.
  ATTNMERGE_HD void split_row(int64_t row, int64_t& token, int64_t& head) const {
    if (((tokens * heads) >> 32) == 0) {
      token = static_cast<uint32_t>(row) / static_cast<uint32_t>(heads);
    } else {
      token = row / heads;
    }
    head = row - token * heads;
  }
};

// Where results go: O at o + token * o_st + head * o_sh, divided by the output scale before the
// one rounding (FP8 outputs), and the merged LSE unless lse is null.
struct OutView {
  void* o;
  int64_t o_st, o_sh;
  float* lse;
  int64_t lse_st, lse_sh;
  float inv_scale;
  const float* scale;  // when set, the scale is read from memory instead (no host round trip)

  ATTNMERGE_HD float inverse_scale() const { return scale != nullptr ? 1.0f / *scale : inv_scale; }

  template <typename T>
  ATTNMERGE_HD T* o_at(int64_t token, int64_t head) const {
    return static_cast<T*>(o) + token * o_st + head * o_sh;
  }
  ATTNMERGE_HD void store_lse(int64_t token, int64_t head, float v) const {
    if (lse != nullptr) lse[token * lse_st + head * lse_sh] = v;
  }
};

// One state laid out [tokens, heads, head_size]: O at o + token * o_st + head * o_sh, LSE likewise.
struct StateView {
  const void* o;
  int64_t o_st, o_sh;
  const float* lse;
  int64_t lse_st, lse_sh;
};

// ---- sources: each gives a row's states through count(), present(s), lse(s) and o<T>(s) -----

// Two states.  Rows of tokens >= a_tokens have no state a (it is not read); rows whose mask byte is
// 0 are skipped whole (the in-place merge leaves them untouched).
struct PairSource {
  static constexpr int kMaxStates = 2;
  StateView a, b;
  int64_t a_tokens;
  const uint8_t* mask;  // may be null
  int64_t mask_stride;

  struct Row {
    const char* o[2];
    float l[2];
    bool has_a, skipped;
    ATTNMERGE_HD bool skip() const { return skipped; }
    ATTNMERGE_HD int count() const { return 2; }
    ATTNMERGE_HD bool present(int s) const { return s == 1 || has_a; }
    ATTNMERGE_HD float lse(int s) const { return l[s]; }
    template <typename T>
    ATTNMERGE_HD const T* o_at(int s) const { return reinterpret_cast<const T*>(o[s]); }
  };

  template <typename T>
  ATTNMERGE_HD Row row(int64_t token, int64_t head) const {
    Row r;
    r.skipped = mask != nullptr && mask[token * mask_stride] == 0;
    r.has_a = token < a_tokens;
    r.o[0] = reinterpret_cast<const char*>(static_cast<const T*>(a.o) + token * a.o_st + head * a.o_sh);
    r.o[1] = reinterpret_cast<const char*>(static_cast<const T*>(b.o) + token * b.o_st + head * b.o_sh);
    r.l[0] = r.has_a && !r.skipped ? a.lse[token * a.lse_st + head * a.lse_sh] : -INFINITY;
    r.l[1] = r.skipped ? -INFINITY : b.lse[token * b.lse_st + head * b.lse_sh];
    return r;
  }
};

// S states along a strided axis: O [tokens, S, heads, head_size] and LSE [tokens, S, heads] in
// logical order, any strides (FlashInfer's [tokens, S, ...] and an all-gather's [S, tokens, ...]).
struct StackSource {
  static constexpr int kMaxStates = 0;  // known at run time only
  const void* o;
  int64_t o_st, o_ss, o_sh;
  const float* lse;
  int64_t lse_st, lse_ss, lse_sh;
  int64_t states;

  struct Row {
    const char* o0;
    const float* l0;
    int64_t o_ss, l_ss;
    int n;
    ATTNMERGE_HD bool skip() const { return false; }
    ATTNMERGE_HD int count() const { return n; }
    ATTNMERGE_HD bool present(int) const { return true; }
    ATTNMERGE_HD float lse(int s) const { return l0[s * l_ss]; }
    template <typename T>
    ATTNMERGE_HD const T* o_at(int s) const { return reinterpret_cast<const T*>(o0) + s * o_ss; }
  };

  template <typename T>
  ATTNMERGE_HD Row row(int64_t token, int64_t head) const {
    return Row{reinterpret_cast<const char*>(static_cast<const T*>(o) + token * o_st + head * o_sh),
               lse + token * lse_st + head * lse_sh, o_ss, lse_ss, static_cast<int>(states)};
  }
};

// Row r merges states [indptr[r], indptr[r + 1]) of O [total, heads, head_size], LSE [total, heads].
// The bounds are clamped to [0, total] and made non-decreasing, so that no indptr can make a read
// leave the arrays (the C ABI refuses bad indptr on the CPU; on the GPU the clamped rows result).
struct RangeSource {
  static constexpr int kMaxStates = 0;
  const void* o;
  int64_t o_st, o_sh;
  const float* lse;
  int64_t lse_st, lse_sh;
  const void* indptr;
  int64_t indptr_stride;
  bool indptr64;
  int64_t total;

  ATTNMERGE_HD int64_t bound(int64_t r) const {
    const int64_t v = indptr64 ? static_cast<const int64_t*>(indptr)[r * indptr_stride]
                               : static_cast<const int32_t*>(indptr)[r * indptr_stride];
    return v < 0 ? 0 : (v > total ? total : v);
  }

  using Row = StackSource::Row;

  template <typename T>
  ATTNMERGE_HD Row row(int64_t token, int64_t head) const {
    const int64_t begin = bound(token);
    const int64_t end = bound(token + 1);
    const int64_t n = end > begin ? end - begin : 0;
    return Row{reinterpret_cast<const char*>(static_cast<const T*>(o) + begin * o_st + head * o_sh),
               lse + begin * lse_st + head * lse_sh, o_st, lse_st, static_cast<int>(n < INT32_MAX ? n : INT32_MAX)};
  }
};

// ---- element steps ------------------------------------------------------------------------------

// N consecutive elements, aligned to their whole size so that one access moves them all.
template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

template <typename T, int N>
ATTNMERGE_HD Pack<T, N> load_pack(const T* src) {
  return *reinterpret_cast<const Pack<T, N>*>(src);
}

// acc += scale * p, unless scale is 0: a part of zero weight never contributes, so NaN or
// garbage in it cannot reach the result even when it was fetched.
template <typename T, int N>
ATTNMERGE_HD void accumulate(float (&acc)[N], const Pack<T, N>& p, float scale) {
  if (scale == 0.0f) return;
  ATTNMERGE_UNROLL
  for (int i = 0; i < N; ++i) acc[i] += scale * Convert<T>::load(p.v[i]);
}

// dst[0:N] = acc * inv_scale rounded once to T, or NaN for a row with a NaN LSE.
template <typename T, int N>
ATTNMERGE_HD void store_pack(T* dst, const float (&acc)[N], float inv_scale, bool nan) {
  Pack<T, N> p;
  ATTNMERGE_UNROLL
  for (int i = 0; i < N; ++i) p.v[i] = Convert<T>::store(nan ? NAN : acc[i] * inv_scale);
  *reinterpret_cast<Pack<T, N>*>(dst) = p;
}

}  // namespace attnmerge
