// The launch-level description of a merge and the per-element steps every path shares.
// Plain data, 64-bit sizes and strides (counting elements).  Offsets are computed in the index type
// I of the launch: int32_t when every offset of every array of the call fits in 31 bits (the
// common case, and half the address arithmetic), int64_t otherwise.
//
// Every op is one walk over the rows (token, head) of the output: a *source* hands each row its
// states (how many, where each O starts, each LSE), the shared row math (row.h) turns their LSEs
// into weights, and the element steps below combine the O packs.  The GPU kernel and the CPU
// loop take the same sources:
//   PairSource   two states, a limited to its first a_tokens tokens, rows optionally masked
//                (the two-way merge and the in-place merge);
//   PlainPairSource  two states of every token, no mask, on an untiled launch whose output scale
//                is a number (not a pointer): the common two-way merge, without those steps;
//   InPlaceSource  PairSource whose merged LSE overwrites an input's, on a launch that keeps each
//                row inside one block: the LSE is written after a block barrier, in the same launch;
//   StackSource  S states stacked along a strided axis (the N-way merge);
//   RangeSource  states [indptr[r], indptr[r+1]) of a flat list (the variable-length merge).
// Which source and kernel a GPU call gets is the launch plan's decision (plan.h).
#pragma once

#include <cstdint>
#include <cstring>

#include "attnmerge/numeric.h"
#include "attnmerge/row.h"

namespace attnmerge {

struct MergeShape {
  int64_t tokens, heads, head_size;
  int64_t rows;  // rows the launch covers: tokens * heads, rounded up to whole tiles when tiled
  int64_t packs;  // vector accesses per row (head_size / the launch's vector width): the plan's
  bool stream;    // evict-first O loads and stores: the plan's
  bool base2;
  // kRows N-way: the row's threads that share the reading of its LSEs (consecutive lanes of one
  // warp, a power of two), or 1: each reads them all.  The plan's.
  int lse_lanes;
  // Row order.  Untiled (tile_shift < 0): row = token * heads + head.  Tiled: tokens taken
  // 2^tile_shift at a time, and a tile's rows head-major (row = (tile * heads + head) * 2^tile_shift
  // + token in the tile), so that a warp's rows are consecutive tokens of one head: with LSEs laid
  // out [heads, tokens] they share one 32-byte sector instead of one each, while a block's O stays
  // in runs of whole rows.  Rows past the last token of the last tile do nothing.
  int tile_shift;
  // row / group (group: heads, or heads << tile_shift) as (umulhi(row, magic) + row) >> shift for
  // rows below 2^31: a division takes some twenty instructions, as many as the rest of a row's
  // index math.
  uint32_t magic;
  int shift;

  ATTNMERGE_HD MergeShape(int64_t tokens_, int64_t heads_, int64_t head_size_, bool base2_)
      : tokens(tokens_), heads(heads_), head_size(head_size_), rows(tokens_ * heads_), packs(head_size_), stream(false), base2(base2_), lse_lanes(1),
        tile_shift(-1), magic(0), shift(0) {
    set_divisor(heads);
  }

  // Tiles of 2^tile_shift_ tokens (see tile_shift); rows rounded up to whole tiles.
  ATTNMERGE_HD void tile(int tile_shift_) {
    tile_shift = tile_shift_;
    const int64_t per_tile = int64_t{1} << tile_shift;
    rows = (tokens + per_tile - 1) / per_tile * per_tile * heads;
    set_divisor(heads << tile_shift);
  }

  ATTNMERGE_HD int64_t group() const { return tile_shift < 0 ? heads : heads << tile_shift; }

  // (token, head) of a row; token may be >= tokens in the last tile (a row to skip).  With
  // I = int32_t the caller guarantees rows < 2^31.
  // kMayTile false: the caller knows the launch is untiled (no tile step compiled in).
  template <bool kMayTile = true, typename I>
  ATTNMERGE_HD void split_row(I row, I& token, I& head) const {
    const I g = static_cast<I>(kMayTile ? group() : heads);
    I q;
#if defined(__CUDA_ARCH__)
    if (sizeof(I) == 4 || (rows >> 31) == 0) {
      const uint32_t r = static_cast<uint32_t>(row);
      q = static_cast<I>((__umulhi(r, magic) + r) >> shift);
    } else {
      q = row / g;
    }
#else
    q = row / g;
#endif
    const I rem = row - q * g;
    if (!kMayTile || tile_shift < 0) {
      token = q;
      head = rem;
    } else {
      head = rem >> tile_shift;
      token = (q << tile_shift) + (rem & ((I{1} << tile_shift) - 1));
    }
  }

 private:
  ATTNMERGE_HD void set_divisor(int64_t d) {
    magic = 0;
    shift = 0;
    if (d > 0 && d < (int64_t{1} << 31)) {
      while ((int64_t{1} << shift) < d) ++shift;
      magic = static_cast<uint32_t>(((uint64_t{1} << 32) * ((uint64_t{1} << shift) - static_cast<uint64_t>(d))) /
                                        static_cast<uint64_t>(d) + 1);
    }
  }
};

// Where results go: O at o + token * o_st + head * o_sh, and the merged LSE unless lse is null.
// O is scaled by 1 / the output scale before its one rounding (FP8 outputs).
struct OutView {
  void* o;
  int64_t o_st, o_sh;
  float* lse;
  int64_t lse_st, lse_sh;
  float inv_scale;
  const float* scale;  // when set, the scale is read from memory instead (no host round trip)
  // lse is also an input's LSE (an in-place merge).  Every thread of a row reads the row's LSEs
  // and one writes the merged LSE: on the GPU after a block barrier, or in a second launch where a
  // row spans blocks (the launch plan's choice, plan.h).
  bool lse_in_place;

  ATTNMERGE_HD float inverse_scale() const { return scale != nullptr ? 1.0f / *scale : inv_scale; }

  template <typename T, typename I>
  ATTNMERGE_HD T* o_at(I token, I head) const {
    return static_cast<T*>(o) + (token * static_cast<I>(o_st) + head * static_cast<I>(o_sh));
  }
  // Where the row's merged LSE goes: null when none is written.
  template <typename I>
  ATTNMERGE_HD float* lse_at(I token, I head) const {
    return lse != nullptr ? lse + (token * static_cast<I>(lse_st) + head * static_cast<I>(lse_sh)) : nullptr;
  }
  template <typename I>
  ATTNMERGE_HD void store_lse(I token, I head, float v) const {
    if (float* p = lse_at(token, head)) *p = v;
  }
};

// One state laid out [tokens, heads, head_size]: O at o + token * o_st + head * o_sh, LSE likewise.
struct StateView {
  const void* o;
  int64_t o_st, o_sh;
  const float* lse;
  int64_t lse_st, lse_sh;

  template <typename T, typename I>
  ATTNMERGE_HD const T* o_at(I token, I head) const {
    return static_cast<const T*>(o) + (token * static_cast<I>(o_st) + head * static_cast<I>(o_sh));
  }
  template <typename I>
  ATTNMERGE_HD float lse_at(I token, I head) const {
    return lse[token * static_cast<I>(lse_st) + head * static_cast<I>(lse_sh)];
  }
};

// ---- sources: each gives a row's states through count(), lse(s) and o_at<T>(s) ----
// Every state of a row has an O address that may be read, even one of no weight (a state the
// row lacks gets another's), so that the kernels load O without waiting for the LSEs.

// Two states.  Rows of tokens >= a_tokens have no state a (it is not read); rows whose mask byte is
// 0 are skipped whole (the in-place merge leaves them untouched) and read nothing but that byte.
struct PairSource {
  static constexpr int kMaxStates = 2;
  static constexpr bool kPlain = false;
  static constexpr bool kFusedLse = false;
  static constexpr int kStream = -1;  // evict-first O accesses or not: MergeShape::stream
  StateView a, b;
  int64_t a_tokens;
  const uint8_t* mask;  // may be null
  int64_t mask_stride;

  struct Row {
    const void* o[2];
    float l[2];
    ATTNMERGE_HD int count() const { return 2; }
    ATTNMERGE_HD float lse(int s) const { return l[s]; }
    template <typename T>
    ATTNMERGE_HD const T* o_at(int s) const { return static_cast<const T*>(o[s]); }
  };

  // Whether the rows of `token` are left as they are: asked before anything else of them is read.
  template <typename I>
  ATTNMERGE_HD bool masked_out(I token) const {
    return mask != nullptr && mask[token * static_cast<I>(mask_stride)] == 0;
  }

  template <typename T, typename I>
  ATTNMERGE_HD Row row(I token, I head) const {
    Row r;
    const bool has_a = token < static_cast<I>(a_tokens);  // a_tokens <= tokens: fits in I
    const I token_a = has_a ? token : I{0};  // a may have fewer tokens: no offset past its end
    r.o[1] = b.o_at<T>(token, head);
    r.o[0] = has_a ? a.o_at<T>(token_a, head) : r.o[1];  // no a: weight 0, b's row stands in
    r.l[0] = has_a ? a.lse_at(token_a, head) : -INFINITY;
    r.l[1] = b.lse_at(token, head);
    return r;
  }
};

// PairSource with every token in a and b and no mask; a launch with it must be untiled and have
// no output scale pointer (kPlain), and its evict-first choice is made at compile time (kStream),
// so that no access is compiled twice.  What those options cost, every launch paid: on an H200
// the kernel without them took 1.37 against 1.45 us at 1 x 32 x 128 bfloat16 and was 1% faster at
// 2048 tokens (benchmarks/NOTES.md).
template <bool kStreamO>
struct PlainPairSource {
  static constexpr int kMaxStates = 2;
  static constexpr bool kPlain = true;
  static constexpr bool kFusedLse = false;
  static constexpr int kStream = kStreamO ? 1 : 0;
  StateView a, b;

  template <typename I>
  ATTNMERGE_HD bool masked_out(I) const { return false; }

  template <typename T, typename I>
  ATTNMERGE_HD PairSource::Row row(I token, I head) const {
    PairSource::Row r;
    r.o[0] = a.o_at<T>(token, head);
    r.o[1] = b.o_at<T>(token, head);
    r.l[0] = a.lse_at(token, head);
    r.l[1] = b.lse_at(token, head);
    return r;
  }
};

// PairSource whose out.lse is an input's LSE (the in-place merge), launched so that every row lies
// inside one block: the kernel writes the merged LSE after a block barrier, once every thread of
// the row has read the old one, instead of in a second launch.
struct InPlaceSource : PairSource {
  static constexpr bool kFusedLse = true;
};

// n states from o0 and l0 on, o_ss and l_ss elements apart.
template <typename I>
struct StridedRow {
  const void* o0;
  const float* l0;
  I o_ss, l_ss;
  int n;
  ATTNMERGE_HD int count() const { return n; }
  ATTNMERGE_HD float lse(int s) const { return l0[s * l_ss]; }
  template <typename T>
  ATTNMERGE_HD const T* o_at(int s) const { return static_cast<const T*>(o0) + s * o_ss; }
};

// S states along a strided axis: O [tokens, S, heads, head_size] and LSE [tokens, S, heads] in
// logical order, any strides (FlashInfer's [tokens, S, ...] and an all-gather's [S, tokens, ...]).
struct StackSource {
  static constexpr int kMaxStates = 0;  // known at run time only
  static constexpr bool kPlain = false;
  static constexpr bool kFusedLse = false;
  static constexpr int kStream = -1;  // evict-first O accesses or not: MergeShape::stream
  const void* o;
  int64_t o_st, o_ss, o_sh;
  const float* lse;
  int64_t lse_st, lse_ss, lse_sh;
  int64_t states;

  template <typename I>
  ATTNMERGE_HD bool masked_out(I) const { return false; }

  template <typename T, typename I>
  ATTNMERGE_HD StridedRow<I> row(I token, I head) const {
    return StridedRow<I>{static_cast<const T*>(o) + (token * static_cast<I>(o_st) + head * static_cast<I>(o_sh)),
                         lse + (token * static_cast<I>(lse_st) + head * static_cast<I>(lse_sh)),
                         static_cast<I>(o_ss), static_cast<I>(lse_ss), static_cast<int>(states)};
  }
};

// Row r merges states [indptr[r], indptr[r + 1]) of O [total, heads, head_size], LSE [total, heads].
// The bounds are clamped to [0, total] and made non-decreasing, so that no indptr can make a read
// leave the arrays (the C ABI refuses bad indptr on the CPU; on the GPU the clamped rows result).
struct RangeSource {
  static constexpr int kMaxStates = 0;
  static constexpr bool kPlain = false;
  static constexpr bool kFusedLse = false;
  static constexpr int kStream = -1;  // evict-first O accesses or not: MergeShape::stream
  const void* o;
  int64_t o_st, o_sh;
  const float* lse;
  int64_t lse_st, lse_sh;
  const void* indptr;
  int64_t indptr_stride;
  bool indptr64;
  int64_t total;

  template <typename I>
  ATTNMERGE_HD bool masked_out(I) const { return false; }

  template <typename I>
  ATTNMERGE_HD I bound(I r) const {
    const I at = r * static_cast<I>(indptr_stride);
    const int64_t v = indptr64 ? static_cast<const int64_t*>(indptr)[at] : static_cast<const int32_t*>(indptr)[at];
    return static_cast<I>(v < 0 ? 0 : (v > total ? total : v));
  }

  template <typename T, typename I>
  ATTNMERGE_HD StridedRow<I> row(I token, I head) const {
    const I begin = bound(token);
    const I end = bound(token + 1);
    const int64_t n = end > begin ? end - begin : 0;
    return StridedRow<I>{static_cast<const T*>(o) + (begin * static_cast<I>(o_st) + head * static_cast<I>(o_sh)),
                         lse + (begin * static_cast<I>(lse_st) + head * static_cast<I>(lse_sh)),
                         static_cast<I>(o_st), static_cast<I>(lse_st), static_cast<int>(n < INT32_MAX ? n : INT32_MAX)};
  }
};

// ---- element steps ------------------------------------------------------------------------------

// N elements of T, moved as one access of N * sizeof(T) bytes and held as 32-bit words (a pack
// narrower than a word sits in the low bits of w[0]).
template <typename T, int N>
struct Pack {
  static constexpr int kBytes = N * static_cast<int>(sizeof(T));
  static constexpr int kWords = kBytes >= 4 ? kBytes / 4 : 1;
  uint32_t w[kWords];

  ATTNMERGE_HD float get(int i) const { return Word<T>::get(w[i / Word<T>::kCount], i % Word<T>::kCount); }
};

// The kernels' accesses are vector loads and stores of the pack's width, spelled with CUDA's
// vector types (the compiler would otherwise split a 16-byte store into 4-byte pieces); `stream`
// marks them evict-first where the launch chose so (see launch_merge).
#if defined(__CUDA_ARCH__)
// A load or store of one vector, streaming (evict first) or cached as usual.
template <typename V>
__device__ __forceinline__ V load_bits(const V* p, bool stream) {
  return stream ? __ldcs(p) : *p;
}
template <typename V>
__device__ __forceinline__ void store_bits(V* p, V v, bool stream) {
  if (stream) {
    __stcs(p, v);
  } else {
    *p = v;
  }
}
#endif

template <typename T, int N>
ATTNMERGE_HD Pack<T, N> load_pack(const T* src, bool stream) {
  Pack<T, N> p;
  constexpr int kBytes = Pack<T, N>::kBytes;
#if defined(__CUDA_ARCH__)
  if constexpr (kBytes == 16) {
    const uint4 v = load_bits(reinterpret_cast<const uint4*>(src), stream);
    p.w[0] = v.x, p.w[1] = v.y, p.w[2] = v.z, p.w[3] = v.w;
  } else if constexpr (kBytes == 8) {
    const uint2 v = load_bits(reinterpret_cast<const uint2*>(src), stream);
    p.w[0] = v.x, p.w[1] = v.y;
  } else if constexpr (kBytes == 4) {
    p.w[0] = load_bits(reinterpret_cast<const unsigned int*>(src), stream);
  } else if constexpr (kBytes == 2) {
    p.w[0] = load_bits(reinterpret_cast<const unsigned short*>(src), stream);
  } else {
    p.w[0] = load_bits(reinterpret_cast<const unsigned char*>(src), stream);
  }
#else
  (void)stream;
  p.w[0] = 0;
  std::memcpy(p.w, src, kBytes);
#endif
  return p;
}

// acc += scale * p, where a part of zero weight adds zeros: its words are cleared first, so NaN or
// garbage in it cannot reach the result even when it was fetched.  A select per word rather than
// a branch: at decode sizes the instructions after the loads are the merge's latency.
template <typename T, int N>
ATTNMERGE_HD void accumulate(float (&acc)[N], Pack<T, N> p, float scale) {
  const uint32_t keep = scale != 0.0f ? ~0u : 0u;
  ATTNMERGE_UNROLL
  for (int j = 0; j < Pack<T, N>::kWords; ++j) p.w[j] &= keep;
  ATTNMERGE_UNROLL
  for (int i = 0; i < N; ++i) acc[i] += scale * p.get(i);
}

// dst[0:N] = acc, each rounded once to T.
template <typename T, int N>
ATTNMERGE_HD void store_pack(T* dst, const float (&acc)[N], bool stream) {
  using P = Pack<T, N>;
  constexpr int kPer = Word<T>::kCount;
  uint32_t w[P::kWords];
  if constexpr (N >= kPer) {
    ATTNMERGE_UNROLL
    for (int j = 0; j < P::kWords; ++j) w[j] = Word<T>::put(acc + j * kPer);
  } else {
    float x[kPer] = {};
    for (int i = 0; i < N; ++i) x[i] = acc[i];
    w[0] = Word<T>::put(x);
  }
#if defined(__CUDA_ARCH__)
  if constexpr (P::kBytes == 16) {
    store_bits(reinterpret_cast<uint4*>(dst), make_uint4(w[0], w[1], w[2], w[3]), stream);
  } else if constexpr (P::kBytes == 8) {
    store_bits(reinterpret_cast<uint2*>(dst), make_uint2(w[0], w[1]), stream);
  } else if constexpr (P::kBytes == 4) {
    store_bits(reinterpret_cast<unsigned int*>(dst), w[0], stream);
  } else if constexpr (P::kBytes == 2) {
    store_bits(reinterpret_cast<unsigned short*>(dst), static_cast<unsigned short>(w[0]), stream);
  } else {
    store_bits(reinterpret_cast<unsigned char*>(dst), static_cast<unsigned char>(w[0]), stream);
  }
#else
  (void)stream;
  std::memcpy(dst, w, P::kBytes);
#endif
}

}  // namespace attnmerge
