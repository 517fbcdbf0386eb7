// The sources: each hands a row (token, head) of the output its states (how many, where each O
// starts, each LSE); the shared row math (row.h) turns their LSEs into weights.  Every op is one
// walk over the rows, and the GPU kernels and the CPU loop take the same sources:
//   PairSource   two states, a limited to its first a_tokens tokens, rows optionally masked
//                (the two-way merge and the in-place merge);
//   SinkPairSource  PairSource with each head's sink (the two-way merge's options.sink);
//   PlainPairSource  two states of every token, on an untiled launch whose output scale is a
//                number (not a pointer): the common two-way merge, without those steps (a mask
//                only in place: Mask::kByToken);
//   InPlaceSource  a two-state source whose merged LSE overwrites an input's, in the same launch:
//                each row in one warp, the LSE written after a warp barrier, or each row in one
//                block, the LSE written after a block barrier;
//   StackSource  S states stacked along a strided axis (the N-way merge);
//   RangeSource  states [indptr[r], indptr[r+1]) of a flat list (the variable-length merge);
//   ShareSource  S states' LSEs stacked and one state's O (the share of that state in the merge:
//                context parallelism's combine by reduce-scatter);
//   ExchangeSource  every rank's state where it lies, one pointer per rank (the exchange fused
//                with the merge: peer-mapped memory), a slice of its rows.
// SinkPairSource and the last four may add each head's sink to its rows (Traits::kSink: SinkView,
// sink_lse).  Each source's Traits (SourceTraits) name what its kernels fix when compiled.
// Each source's Real is the type of its LSEs and of its rows' math: float (the names above), or
// double for float64 calls, which the CPU path alone runs (Basic*Source<double>).
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "attnmerge/exchange.h"
#include "attnmerge/views.h"

namespace attnmerge {

// The choices a source fixes when its kernels are compiled, each named.
// O's loads and stores: evict-first or not as the plan chose at run time (MergeShape::evict_first), or
// fixed in the kernel (the plain sources: no access compiled twice).
enum class Cache : int8_t { kAsShape, kDefault, kEvictFirst };
// How a row is found: split into (token, head), or flat (token = row, head = 0: views flattened
// so, flat_rows).
enum class RowIndex : int8_t { kSplit, kFlat };
// Rows skipped whole: none, or those whose token's mask byte is 0 (masked_out).
enum class Mask : int8_t { kNone, kByToken };
// Where the merged LSE goes: to the output (kOut), or over an input's in the same launch, stored
// after a warp barrier (kWarp: each row in one warp) or a block barrier (kBlock: each row in one
// block), once every thread of the row has read the old one (InPlaceSource).
enum class LseWrite : int8_t { kOut, kWarp, kBlock };

// The traits of a source, as most sources have them: each source's Traits derives from these and
// states only what differs (a nested type, so that the sources stay aggregates: {a, b, ...}).
struct SourceTraits {
  static constexpr int kMaxStates = 0;   // states a row has at most; 0: known at run time only
  static constexpr bool kPlain = false;  // an untiled launch whose output scale is a number
  static constexpr bool kSink = false;   // each head's sink is one more state of its rows
  static constexpr Mask kMask = Mask::kNone;
  static constexpr Cache kCache = Cache::kAsShape;
  static constexpr RowIndex kRowIndex = RowIndex::kSplit;
  static constexpr LseWrite kLseWrite = LseWrite::kOut;
};

// Attention sinks (attnmerge_options.sink): each head's sink logit, in the LSE's base, one more
// state of every row of the head, whose output is 0: it takes a share of the weight and adds
// nothing to O.  lse null: no sink.
template <typename Real>
struct BasicSinkView {
  const Real* lse = nullptr;
  int64_t stride = 0;

  // The sink of `head` as a state's LSE: -inf (no weight) where there is none.
  template <typename I>
  ATTNMERGE_HD Real at(I head) const {
    return lse != nullptr ? lse[head * static_cast<I>(stride)] : Real(-INFINITY);
  }
};
using SinkView = BasicSinkView<float>;

// The sink of `head` for src's rows: -inf for a source that takes none (no kSink, known at
// compile time, so that its kernels compile as if sinks did not exist).
template <typename Source, typename I>
ATTNMERGE_HD typename Source::Real sink_lse(const Source& src, I head) {
  if constexpr (Source::Traits::kSink) {
    return src.sink.at(head);
  } else {
    return -INFINITY;
  }
}

// ---- sources: each gives a row's states through count(), lse(s), o_at<T>(s) and reads_o(s) ----
// Every state of a row has an O address that may be read, even one of no weight (a state the
// row lacks gets another's), so that the kernels load O without waiting for the LSEs.  reads_o(s)
// false: state s weighs the row but adds nothing to O (its O is not read), as a sink does (the
// CPU loop asks; the GPU's share kernel loads the own state's O alone).
// row<T>(token, head, at): o_at(s) points `at` elements into state s's row (a thread's pack),
// that offset added in the launch's index type with the row's own (fewer address instructions
// before the first load).

// Two states.  Rows of tokens >= a_tokens have no state a (it is not read); rows whose mask byte is
// 0 are skipped whole (the in-place merge leaves them untouched) and read nothing but that byte.
template <typename R>
struct BasicPairSource {
  struct Traits : SourceTraits {
    static constexpr int kMaxStates = 2;
    static constexpr Mask kMask = Mask::kByToken;  // where mask is not null
  };
  using Real = R;
  BasicStateView<Real> a, b;
  int64_t a_tokens;
  const uint8_t* mask;  // may be null
  int64_t mask_stride;
  // b's LSEs into a's base (base_change): 1 but for ATTNMERGE_LSE_B_*, which only this source
  // takes (the plan gives such calls no plain kernel).
  Real b_scale = 1;

  struct Row {
    const void* o[2];
    Real l[2];
    ATTNMERGE_HD int count() const { return 2; }
    ATTNMERGE_HD Real lse(int s) const { return l[s]; }
    template <typename T>
    ATTNMERGE_HD const T* o_at(int s) const { return static_cast<const T*>(o[s]); }
    ATTNMERGE_HD constexpr bool reads_o(int) const { return true; }
  };

  // Whether the rows of `token` are left as they are: asked before anything else of them is read.
  template <typename I>
  ATTNMERGE_HD bool masked_out(I token) const {
    return mask != nullptr && mask[token * static_cast<I>(mask_stride)] == 0;
  }

  // take false: the row's LSEs are -inf and nothing of it is read (a thread off the rows, or of a
  // masked-out row, that must still reach a barrier).
  template <typename T, typename I>
  ATTNMERGE_HD Row row(I token, I head, I at = I{0}, bool take = true) const {
    Row r;
    const bool has_a = take && token < static_cast<I>(a_tokens);  // a_tokens <= tokens: fits in I
    const I token_a = has_a ? token : I{0};  // a may have fewer tokens: no offset past its end
    r.o[1] = b.template o_at<T>(token, head, at);
    r.o[0] = has_a ? a.template o_at<T>(token_a, head, at) : r.o[1];  // no a: weight 0, b's row stands in
    r.l[0] = has_a ? a.lse_at(token_a, head) : Real(-INFINITY);
    r.l[1] = take ? b.lse_at(token, head) * b_scale : Real(-INFINITY);
    return r;
  }
};
using PairSource = BasicPairSource<float>;

// PairSource with each head's sink, one more state of output 0 in every row (kSink): a type of its
// own, so that the two-way merge's calls without one, and the in-place merge (which takes none),
// keep kernels that carry nothing of it.
template <typename Real>
struct BasicSinkPairSource : BasicPairSource<Real> {
  struct Traits : BasicPairSource<Real>::Traits {
    static constexpr bool kSink = true;
  };
  BasicSinkView<Real> sink;
};
using SinkPairSource = BasicSinkPairSource<float>;

// Whether Source is a two-way merge's (PairSource, SinkPairSource), which the plan lays out by the
// two-way rules.
template <typename Source>
ATTNMERGE_HD constexpr bool is_pair_source() {
  return std::is_same<Source, PairSource>::value || std::is_same<Source, SinkPairSource>::value;
}

// PairSource with every token in a and b and no mask; a launch with it must be untiled and have
// no output scale pointer (kPlain), and its cache policy is fixed at compile time (kCache), so
// that no access is compiled twice: the common call does not pay for those options
// (benchmarks/NOTES.md#plain-pair-kernel).
// RowIndex::kFlat: every array is [rows, head_size] and [rows] in effect (heads dense within
// tokens, the plan's `dense`), its views flattened so (flat_rows): a row is (token = row, head =
// 0), with no division of the row into token and head, and the same row strides in a, b and the
// output (the plan's condition too): one O offset and one LSE offset per thread for a and b, and
// for the output of a two-way merge (offset, lse_offset; merge_kernel), each stride read once
// (separate strides per view measured slower: benchmarks/NOTES.md#flat-rows).
// Mask::kByToken: rows whose token's mask byte is 0 are skipped whole, as PairSource's (the
// in-place merge with flat rows: the kernel divides the row by the heads for the mask's token alone).
template <Cache kCacheO, RowIndex kRows = RowIndex::kSplit, Mask kMasked = Mask::kNone>
struct PlainPairSource {
  struct Traits : SourceTraits {
    static constexpr int kMaxStates = 2;
    static constexpr bool kPlain = true;
    static constexpr Cache kCache = kCacheO;
    static constexpr RowIndex kRowIndex = kRows;
    static constexpr Mask kMask = kMasked;
  };
  using Real = float;  // the GPU's
  StateView a, b;
  const uint8_t* mask = nullptr;  // Mask::kByToken only
  int64_t mask_stride = 0;

  template <typename I>
  ATTNMERGE_HD bool masked_out(I token) const {
    if constexpr (kMasked == Mask::kByToken) {
      return mask[token * static_cast<I>(mask_stride)] == 0;
    } else {
      return false;
    }
  }

  // RowIndex::kFlat: the element offsets of row `row` (+ `at`) and of its LSE, in a, b and the output alike.
  template <typename I>
  ATTNMERGE_HD I offset(I row, I at) const { return row * static_cast<I>(a.o_st) + at; }
  template <typename I>
  ATTNMERGE_HD I lse_offset(I row) const { return row * static_cast<I>(a.lse_st); }

  template <typename T, typename I>
  ATTNMERGE_HD PairSource::Row row(I token, I head, I at = I{0}) const {
    PairSource::Row r;
    if constexpr (kRows == RowIndex::kFlat) {  // token = row, head = 0
      const I o = offset(token, at), l = lse_offset(token);
      r.o[0] = static_cast<const T*>(a.o) + o;
      r.o[1] = static_cast<const T*>(b.o) + o;
      r.l[0] = a.lse[l];
      r.l[1] = b.lse[l];
    } else {
      r.o[0] = a.o_at<T>(token, head, at);
      r.o[1] = b.o_at<T>(token, head, at);
      r.l[0] = a.lse_at(token, head);
      r.l[1] = b.lse_at(token, head);
    }
    return r;
  }
};

// A two-state source (PairSource, or PlainPairSource with flat rows) whose out.lse is an input's
// LSE (the in-place merge), written in the merge's own launch rather than a second one.
// LseWrite::kWarp: every row lies in one warp at aligned lanes (a power of two of them: the plan's
// Variant::kInPlaceWarp): the row's first lane stores the merged LSE after a warp barrier that the
// row's lanes reach once each has read the old one.  LseWrite::kBlock: every row lies inside one
// block and the LSE is stored after a block barrier, once every thread of the row has read the old one.
template <typename Base, LseWrite kWrite>
struct InPlaceSource : Base {
  static_assert(kWrite != LseWrite::kOut, "an in-place source writes its LSE over an input's");
  struct Traits : Base::Traits {
    static constexpr LseWrite kLseWrite = kWrite;
  };
};

// n states from o0 and l0 on, o_ss and l_ss elements apart.
template <typename I, typename Real = float>
struct StridedRow {
  const void* o0;
  const Real* l0;
  I o_ss, l_ss;
  int n;
  ATTNMERGE_HD int count() const { return n; }
  ATTNMERGE_HD const Real* lse_ptr(int s) const { return l0 + s * l_ss; }
  ATTNMERGE_HD Real lse(int s) const { return *lse_ptr(s); }
  template <typename T>
  ATTNMERGE_HD const T* o_at(int s) const { return static_cast<const T*>(o0) + s * o_ss; }
  ATTNMERGE_HD constexpr bool reads_o(int) const { return true; }
};

// S states along a strided axis: O [tokens, S, heads, head_size] and LSE [tokens, S, heads] in
// logical order, any strides (FlashInfer's [tokens, S, ...] and an all-gather's [S, tokens, ...]).
template <typename R>
struct BasicStackSource {
  struct Traits : SourceTraits {
    static constexpr bool kSink = true;
  };
  using Real = R;
  const void* o;
  int64_t o_st, o_ss, o_sh;
  const Real* lse;
  int64_t lse_st, lse_ss, lse_sh;
  int64_t states;
  BasicSinkView<Real> sink;

  template <typename I>
  ATTNMERGE_HD bool masked_out(I) const { return false; }

  template <typename T, typename I>
  ATTNMERGE_HD StridedRow<I, Real> row(I token, I head, I at = I{0}) const {
    return StridedRow<I, Real>{
        static_cast<const T*>(o) + (token * static_cast<I>(o_st) + head * static_cast<I>(o_sh) + at),
                         lse + (token * static_cast<I>(lse_st) + head * static_cast<I>(lse_sh)),
                         static_cast<I>(o_ss), static_cast<I>(lse_ss), static_cast<int>(states)};
  }
};
using StackSource = BasicStackSource<float>;

// Row r merges states [indptr[r], indptr[r + 1]) of O [total, heads, head_size], LSE [total, heads].
// The bounds are clamped to [0, total] and made non-decreasing, so that no indptr can make a read
// leave the arrays (the C ABI refuses bad indptr on the CPU; on the GPU the clamped rows result).
template <typename R>
struct BasicRangeSource {
  struct Traits : SourceTraits {
    static constexpr bool kSink = true;
  };
  using Real = R;
  const void* o;
  int64_t o_st, o_sh;
  const Real* lse;
  int64_t lse_st, lse_sh;
  const void* indptr;
  int64_t indptr_stride;
  bool indptr64;
  int64_t total;
  BasicSinkView<Real> sink;

  template <typename I>
  ATTNMERGE_HD bool masked_out(I) const { return false; }

  template <typename I>
  ATTNMERGE_HD I bound(I r) const {
    const I at = r * static_cast<I>(indptr_stride);
    const int64_t v = indptr64 ? static_cast<const int64_t*>(indptr)[at] : static_cast<const int32_t*>(indptr)[at];
    return static_cast<I>(v < 0 ? 0 : (v > total ? total : v));
  }

  template <typename T, typename I>
  ATTNMERGE_HD StridedRow<I, Real> row(I token, I head, I at = I{0}) const {
    const I begin = bound(token);
    const I end = bound(token + 1);
    const int64_t n = end > begin ? end - begin : 0;
    return StridedRow<I, Real>{
        static_cast<const T*>(o) + (begin * static_cast<I>(o_st) + head * static_cast<I>(o_sh) + at),
                         lse + (begin * static_cast<I>(lse_st) + head * static_cast<I>(lse_sh)),
                         static_cast<I>(o_st), static_cast<I>(lse_st), static_cast<int>(n < INT32_MAX ? n : INT32_MAX)};
  }
};
using RangeSource = BasicRangeSource<float>;

// A row of ShareSource: a StridedRow whose states' O addresses are all own's (a states stride of
// 0), read for own alone.
template <typename I, typename Real = float>
struct ShareRow : StridedRow<I, Real> {
  int own;
  ATTNMERGE_HD bool reads_o(int s) const { return s == own; }
};

// The share of state `own` in the merge of S states, each head's sink too: StackSource's LSE
// [tokens, S, heads] (any strides: an all-gather's [S, tokens, heads]) and own's O alone, O
// [tokens, heads, head_size] (o_ss 0): the output is (w_own / W) O_own and the merged LSE, so that
// the states' shares summed (a reduce-scatter across context-parallel ranks) are the merge.
template <typename Real>
struct BasicShareSource : BasicStackSource<Real> {
  int64_t own;  // 0 <= own < states

  template <typename T, typename I>
  ATTNMERGE_HD ShareRow<I, Real> row(I token, I head, I at = I{0}) const {
    return ShareRow<I, Real>{BasicStackSource<Real>::template row<T>(token, head, at), static_cast<int>(own)};
  }
};
using ShareSource = BasicShareSource<float>;

// A row of ExchangeSource: state s at rank s's pointers, the row's offsets added (the same in every
// rank's arrays, which share one layout).
template <typename I>
struct PeerRow {
  const void* const* o;
  const float* const* l;
  I o_off, l_off;
  int n;
  ATTNMERGE_HD int count() const { return n; }
  ATTNMERGE_HD const float* lse_ptr(int s) const { return l[s] + l_off; }
  ATTNMERGE_HD float lse(int s) const { return *lse_ptr(s); }
  template <typename T>
  ATTNMERGE_HD const T* o_at(int s) const { return static_cast<const T*>(o[s]) + o_off; }
  ATTNMERGE_HD constexpr bool reads_o(int) const { return true; }
};

// The states of an exchange's ranks (attnmerge_merge_exchange), read where they lie: state s of
// row (token, head) is rank s's row (token + token0, head + head0) of O [tokens, heads, head_size]
// and LSE [tokens, heads], every rank's laid out alike (o_st, o_sh, lse_st, lse_sh), so that a
// rank's slice of the rows (a range of tokens or of heads) is the output's rows.  The ranks'
// pointers are held by value (a kernel's parameters, indexed by state), as this rank addresses
// them; each head's sink is indexed as the output's heads.
struct ExchangeSource {
  using Real = float;  // the merge's arithmetic: ranks' states come from the GPU engines' float32 LSEs
  struct Traits : SourceTraits {
    static constexpr bool kSink = true;
  };
  const void* o[exchange::kMaxWorld];
  const float* lse[exchange::kMaxWorld];
  int64_t o_st, o_sh, lse_st, lse_sh;
  int64_t token0, head0;
  int world;
  SinkView sink;

  template <typename I>
  ATTNMERGE_HD bool masked_out(I) const { return false; }

  template <typename T, typename I>
  ATTNMERGE_HD PeerRow<I> row(I token, I head, I at = I{0}) const {
    const I t = token + static_cast<I>(token0), h = head + static_cast<I>(head0);
    return PeerRow<I>{o, lse, t * static_cast<I>(o_st) + h * static_cast<I>(o_sh) + at,
                      t * static_cast<I>(lse_st) + h * static_cast<I>(lse_sh), world};
  }
};

}  // namespace attnmerge
