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
// sink_lse).  The general sources (the pair, stack, range, share and exchange sources) may also take
// their states' LSEs as softmax statistics and skip the states a mask says are empty (StateExtras,
// the exchange's PeerExtras, read at run time: Traits::kExtras, settle).  Each source's Traits (SourceTraits) name what its kernels
// fix when compiled.  Each source's Real is the type of its LSEs and of its rows' math: float (the
// names above), or double for float64 calls, which the CPU path alone runs (Basic*Source<double>).
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "attnmerge/exchange.h"
#include "attnmerge/pack.h"
#include "attnmerge/row.h"
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
  static constexpr bool kExtras = false;  // the source has StateExtras (read where extras.on)
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

// Softmax statistics in place of an LSE (attnmerge_options.sum_a, sum_b): the LSE argument holds
// each row's running max and `p` the sum of exp(score - max) (in the LSE's base) over the part's
// keys, with strides of its own in the LSE's logical axes: token (or a variable-length merge's
// state), state (the N-way merge's S) and head, of the LSE's type Real.  p null: the argument holds
// LSEs.
template <typename Real>
struct BasicSumView {
  const Real* p = nullptr;
  int64_t st = 0, ss = 0, sh = 0;

  template <typename I>
  ATTNMERGE_HD const Real* at(I token, I s, I head) const {
    return p + (token * static_cast<I>(st) + s * static_cast<I>(ss) + head * static_cast<I>(sh));
  }
  // The sum of state (token, s, head) where `take` and the call gives sums, else 1 (nothing read).
  template <typename I>
  ATTNMERGE_HD Real at_or_one(I token, I s, I head, bool take) const {
    if constexpr (std::is_same<Real, float>::value) {
      return load_float_if(at(token, s, head), take && p != nullptr, 1.0f);
    } else {  // float64: the CPU path
      return take && p != nullptr ? *at(token, s, head) : Real{1};
    }
  }
};
using SumView = BasicSumView<float>;

// Which states of a row hold keys (attnmerge_options.valid): an entry per (token, state) ([tokens,
// S], the two-way and in-place merges' S = 2; a variable-length merge's per state of its list, token
// = the state, s = 0), 0 where the state holds none.  uint8 or bool (a mask), int32 or int64 (a
// count of keys, vLLM's per-rank lengths): `bytes` an entry.  p null: every state holds keys.
struct ValidView {
  const void* p = nullptr;
  int64_t st = 0, ss = 0;
  int32_t bytes = 1;

  // Whether state s of `token` holds keys, read where `take` (true where the call gives no valid).
  template <typename I>
  ATTNMERGE_HD bool holds(I token, I s, bool take) const {
    return load_nonzero_if(entry(token, s), bytes, take && p != nullptr);
  }
  template <typename I>
  ATTNMERGE_HD const void* entry(I token, I s) const {
    return static_cast<const char*>(p) + (token * static_cast<I>(st) + s * static_cast<I>(ss)) * static_cast<I>(bytes);
  }
};

// What a general source's states may carry beside their LSEs, read at run time: the kernels
// without them (`on` false) take one uniform branch past it.  sum_a: the sums of the first LSE
// argument (the two-way merge's a, every state of the N-way and variable-length merges and the
// share); sum_b: the two-way merge's b.
template <typename Real>
struct BasicStateExtras {
  BasicSumView<Real> sum_a, sum_b;
  ValidView valid;
  bool on = false;  // any of them given
};
using StateExtras = BasicStateExtras<float>;

// A state's LSE as the merge reads it where the call has StateExtras: -inf (no weight, nothing of
// it taken) where the state is not `valid` (a state the row lacks, or one the mask says is empty),
// whatever its LSE and O hold; `lse` as loaded where it has no softmax sum (has_sum false); else
// max + log(sum) in the inputs' base (`base2`; a state of another base was converted as its max was
// read: log(sum) in the inputs' base is its own times the same factor), and -inf for a sum of 0,
// whatever the max holds (the max of no scores).  Selects, no branch.
template <typename Real>
ATTNMERGE_HD Real settled_lse(Real lse, bool valid, Real sum, bool has_sum, bool base2) {
  const Real ln_b = base2 ? Real{1} : RealConstants<Real>::ln2;  // log2 into the inputs' base
  const Real stats = sum == Real{0} ? Real(-INFINITY) : lse + fast_log2<Subnormal::kKeep>(sum) * ln_b;
  return valid ? (has_sum ? stats : lse) : Real(-INFINITY);
}

// A state's LSE as the merge reads it (settled_lse), loaded where `take` (else -inf): its LSE at
// `lse`, its sum at `sum` where `has_sum`, its valid entry (`bytes` wide) at `valid` where
// `has_valid`: a kernel's one reading of a state with extras, whichever source holds it.
ATTNMERGE_HD float load_settled(const float* lse, const float* sum, bool has_sum, const char* valid, bool has_valid,
                                int32_t bytes, bool take, bool base2) {
  const float l = load_lse_if(lse, take);
  const bool ok = take && load_nonzero_if(valid, bytes, take && has_valid);
  const float total = load_float_if(sum, take && has_sum, 1.0f);
  return settled_lse(l, ok, total, has_sum, base2);
}

// A row's states as a kernel takes them one at a time where the call has StateExtras: state s's
// LSE at lse + s * lse_ss, its sum at sum + s * sum_ss (sum null: none), its valid entry at valid + s
// * valid_ss bytes (valid null: none), offsets from the row's own pointers (Source::extras_row), so
// that each state costs a multiply-add an address.
template <typename I>
struct ExtrasRow {
  const float* lse;
  const float* sum;
  const char* valid;
  I lse_ss, sum_ss, valid_ss;
  int32_t bytes;

  // State s's LSE as the merge reads it (settled_lse), read where `take` (else -inf).
  ATTNMERGE_HD float settled(int s, bool take, bool base2) const {
    const I si = static_cast<I>(s);
    return load_settled(lse + si * lse_ss, sum + si * sum_ss, sum != nullptr, valid + si * valid_ss,
                        valid != nullptr, bytes, take, base2);
  }
  // The prefetch into L1 of what settled(s) reads, where `take`.
  ATTNMERGE_HD void prefetch(int s, bool take) const {
    const I si = static_cast<I>(s);
    prefetch_if(lse + si * lse_ss, take);
    prefetch_if(sum + si * sum_ss, take && sum != nullptr);
    prefetch_if(valid + si * valid_ss, take && valid != nullptr);
  }
};

// Row (`index`, head)'s ExtrasRow from the row's own LSE pointer `lse`: the sums and valid entries
// of `e` at (index, state 0, head), each next state `lse_step`, `sum_step` and `valid_step` entries
// on (a stacked source's state strides; a variable-length merge's token strides, its states
// consecutive entries of the list).
template <typename I, typename Real>
ATTNMERGE_HD ExtrasRow<I> extras_row_of(const Real* lse, const BasicStateExtras<Real>& e, I index, I head, I lse_step,
                                        int64_t sum_step, int64_t valid_step) {
  const auto& sm = e.sum_a;
  const ValidView& v = e.valid;
  return ExtrasRow<I>{lse,
                      sm.p != nullptr ? sm.at(index, I{0}, head) : nullptr,
                      v.p != nullptr ? static_cast<const char*>(v.entry(index, I{0})) : nullptr,
                      lse_step,
                      static_cast<I>(sum_step),
                      static_cast<I>(valid_step) * static_cast<I>(v.bytes),
                      v.bytes};
}

// Whether src's states carry StateExtras in this call: false, known at compile time, for a source
// that has none (the plain ones), so that their kernels compile as if extras did not exist.
template <typename Source>
ATTNMERGE_HD bool extras_on(const Source& src) {
  if constexpr (Source::Traits::kExtras) {
    return src.extras.on;
  } else {
    return false;
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
// a_tokens_at: a_tokens read from the call's memory instead (one int32, int64 where
// a_tokens_wide), clamped to [0, a_tokens], so that a captured graph takes a new one each replay.
template <typename R>
struct BasicPairSource {
  struct Traits : SourceTraits {
    static constexpr int kMaxStates = 2;
    static constexpr Mask kMask = Mask::kByToken;  // where mask is not null
    static constexpr bool kExtras = true;
  };
  using Real = R;
  BasicStateView<Real> a, b;
  int64_t a_tokens;
  const uint8_t* mask;  // may be null
  int64_t mask_stride;
  const void* a_tokens_at = nullptr;
  bool a_tokens_wide = false;
  // b's LSEs into a's base (base_change): 1 but for ATTNMERGE_LSE_B_*, which only this source
  // takes (the plan gives such calls no plain kernel).
  Real b_scale = 1;
  BasicStateExtras<Real> extras;  // sum_a of a, sum_b of b; valid [tokens, 2] (the plan gives no plain kernel)

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

  // The tokens whose rows merge a with b.
  ATTNMERGE_HD int64_t a_count() const {
    return a_tokens_at == nullptr ? a_tokens : read_count(a_tokens_at, a_tokens_wide, a_tokens);
  }

  // take false: the row's LSEs are -inf and nothing of it is read (a thread off the rows, or of a
  // masked-out row, that must still reach a barrier).
  template <typename T, typename I>
  ATTNMERGE_HD Row row(I token, I head, I at = I{0}, bool take = true) const {
    Row r;
    const bool has_a = take && token < static_cast<I>(a_count());  // a_tokens <= tokens: fits in I
    const I token_a = has_a ? token : I{0};  // a may have fewer tokens: no offset past its end
    r.o[1] = b.template o_at<T>(token, head, at);
    r.o[0] = has_a ? a.template o_at<T>(token_a, head, at) : r.o[1];  // no a: weight 0, b's row stands in
    r.l[0] = has_a ? a.lse_at(token_a, head) : Real(-INFINITY);
    r.l[1] = take ? b.lse_at(token, head) * b_scale : Real(-INFINITY);
    return r;
  }

  // State s's LSE as the merge reads it (settled_lse), from `l` as row() gave it; `take`: s is one
  // of the row's states (a row without a has none of a's read).  Where extras.on.
  template <typename I>
  ATTNMERGE_HD Real settle(Real l, I token, I head, int s, bool take, bool base2) const {
    take = take && (s == 1 || token < static_cast<I>(a_count()));
    const BasicSumView<Real>& sum = s == 0 ? extras.sum_a : extras.sum_b;
    const bool valid = take && extras.valid.holds(token, static_cast<I>(s), take);
    return settled_lse(l, valid, sum.at_or_one(token, I{0}, head, take), sum.p != nullptr, base2);
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
    static constexpr bool kExtras = true;
  };
  using Real = R;
  const void* o;
  int64_t o_st, o_ss, o_sh;
  const Real* lse;
  int64_t lse_st, lse_ss, lse_sh;
  int64_t states;
  BasicSinkView<Real> sink;
  BasicStateExtras<Real> extras;  // sum_a [tokens, S, heads]; valid [tokens, S]

  template <typename I>
  ATTNMERGE_HD bool masked_out(I) const { return false; }

  // State s's LSE as the merge reads it (settled_lse), from `l` as loaded; `take`: s < the row's
  // count.  Where extras.on.
  template <typename I>
  ATTNMERGE_HD Real settle(Real l, I token, I head, int s, bool take, bool base2) const {
    const I si = static_cast<I>(s);
    const bool valid = take && extras.valid.holds(token, si, take);
    return settled_lse(l, valid, extras.sum_a.at_or_one(token, si, head, take), extras.sum_a.p != nullptr, base2);
  }
  // Row (token, head)'s states as the kernels take them one at a time where extras.on.
  template <typename I>
  ATTNMERGE_HD ExtrasRow<I> extras_row(I token, I head) const {
    return extras_row_of(lse + (token * static_cast<I>(lse_st) + head * static_cast<I>(lse_sh)), extras, token, head,
                         static_cast<I>(lse_ss), extras.sum_a.ss, extras.valid.ss);
  }

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
    static constexpr bool kExtras = true;
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
  BasicStateExtras<Real> extras;  // sum_a [total, heads]; valid [total] (each state of the list)

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

  // State s of row `token`'s LSE as the merge reads it (settled_lse), from `l` as loaded; `take`: s
  // < the row's count.  The state is number bound(token) + s of the list.  Where extras.on.
  template <typename I>
  ATTNMERGE_HD Real settle(Real l, I token, I head, int s, bool take, bool base2) const {
    const I state = bound(token) + static_cast<I>(s);
    const bool valid = take && extras.valid.holds(state, I{0}, take);
    return settled_lse(l, valid, extras.sum_a.at_or_one(state, I{0}, head, take), extras.sum_a.p != nullptr,
                       base2);
  }
  // Row `token`'s states (from state bound(token) of the list on) as the kernels take them one at a
  // time where extras.on.
  template <typename I>
  ATTNMERGE_HD ExtrasRow<I> extras_row(I token, I head) const {
    const I first = bound(token);
    return extras_row_of(lse + (first * static_cast<I>(lse_st) + head * static_cast<I>(lse_sh)), extras, first, head,
                         static_cast<I>(lse_st), extras.sum_a.st, extras.valid.st);
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

// What the ranks' states of an exchange carry beside their LSEs, read at run time: softmax sums
// (ExchangeSource::sum, every rank's laid out as its LSE) and which ranks hold keys for a token
// (valid [tokens of the slice, world], as the N-way merge's [tokens, S]).
struct PeerExtras {
  bool sums = false;  // ExchangeSource::sum holds every rank's sums
  ValidView valid;
  bool on = false;  // any of them given
};

// Row (token, head)'s states with their extras as a kernel takes them one at a time: ExtrasRow's
// settled and prefetch over the ranks' pointers.
template <typename I>
struct PeerExtrasRow {
  const float* const* lse;
  const float* const* sum;
  I l_off;
  const char* valid;  // the row's token's entry of rank 0; null: none
  I valid_ss;
  int32_t bytes;
  bool sums;

  ATTNMERGE_HD float settled(int s, bool take, bool base2) const {
    return load_settled(lse[s] + l_off, sum[s] + l_off, sums, valid + static_cast<I>(s) * valid_ss, valid != nullptr,
                        bytes, take, base2);
  }
  ATTNMERGE_HD void prefetch(int s, bool take) const {
    prefetch_if(lse[s] + l_off, take);
    prefetch_if(sum[s] + l_off, take && sums);
    prefetch_if(valid + static_cast<I>(s) * valid_ss, take && valid != nullptr);
  }
};

// The states of an exchange's ranks (attnmerge_merge_exchange), read where they lie: state s of
// row (token, head) is rank s's row (token + token0, head + head0) of O [tokens, heads, head_size]
// and LSE [tokens, heads], every rank's laid out alike (o_st, o_sh, lse_st, lse_sh), so that a
// rank's slice of the rows (a range of tokens or of heads) is the output's rows.  The ranks'
// pointers are held by value (a kernel's parameters, indexed by state), as this rank addresses
// them; each head's sink is indexed as the output's heads, and the extras' valid as the output's
// tokens.  Where extras.sums, rank s's LSE holds its running maxima and sum[s] its softmax sums.
struct ExchangeSource {
  using Real = float;  // the merge's arithmetic: ranks' states come from the GPU engines' float32 LSEs
  struct Traits : SourceTraits {
    static constexpr bool kSink = true;
    static constexpr bool kExtras = true;
  };
  const void* o[exchange::kMaxWorld];
  const float* lse[exchange::kMaxWorld];
  const float* sum[exchange::kMaxWorld];  // the LSEs' where there are no sums (never read then)
  int64_t o_st, o_sh, lse_st, lse_sh;
  int64_t token0, head0;
  int world;
  SinkView sink;
  PeerExtras extras;

  template <typename I>
  ATTNMERGE_HD bool masked_out(I) const { return false; }

  template <typename I>
  ATTNMERGE_HD I lse_offset(I token, I head) const {
    return (token + static_cast<I>(token0)) * static_cast<I>(lse_st) + (head + static_cast<I>(head0)) * static_cast<I>(lse_sh);
  }

  template <typename T, typename I>
  ATTNMERGE_HD PeerRow<I> row(I token, I head, I at = I{0}) const {
    const I t = token + static_cast<I>(token0), h = head + static_cast<I>(head0);
    return PeerRow<I>{o, lse, t * static_cast<I>(o_st) + h * static_cast<I>(o_sh) + at, lse_offset(token, head),
                      world};
  }

  // State s's LSE as the merge reads it (settled_lse), from `l` as loaded; `take`: s < world.
  // Where extras.on (the CPU loop's reading).
  template <typename I>
  ATTNMERGE_HD float settle(float l, I token, I head, int s, bool take, bool base2) const {
    const bool valid = take && extras.valid.holds(token, static_cast<I>(s), take);
    const float total = take && extras.sums ? sum[s][lse_offset(token, head)] : 1.0f;
    return settled_lse(l, valid, total, extras.sums, base2);
  }
  // Row (token, head)'s states as the kernels take them one at a time where extras.on.
  template <typename I>
  ATTNMERGE_HD PeerExtrasRow<I> extras_row(I token, I head) const {
    const ValidView& v = extras.valid;
    return PeerExtrasRow<I>{lse,
                            sum,
                            lse_offset(token, head),
                            v.p != nullptr ? static_cast<const char*>(v.entry(token, I{0})) : nullptr,
                            static_cast<I>(v.ss) * static_cast<I>(v.bytes),
                            v.bytes,
                            extras.sums};
  }
};

}  // namespace attnmerge
