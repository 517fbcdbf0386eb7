// Header-only CUDA kernels of attnmerge and their launchers.  A C++/CUDA program may include this
// directly; the launchers validate nothing (libattnmerge's C ABI does) and return the launch's
// cudaError_t.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "attnmerge/pack.h"
#include "attnmerge/row.h"
#include "attnmerge/sources.h"
#include "attnmerge/views.h"
#include "attnmerge/plan.h"

namespace attnmerge {

// kRows: the widest block and the blocks per SM the compiler must leave room for.  Two-state
// kernels: about 30 registers, full occupancy, compiled for blocks of up to kPairMaxBlockThreads
// (the plan's widths, pair_block_threads), no cap.  N-way kernels of 8 states in flight: 3 blocks
// cap them at 85 registers (faster than uncapped and than 4 states per chunk: benchmarks/NOTES.md#nway-chunk);
// of 4 states: 4 blocks, 64 registers.
template <typename Source>
constexpr int max_threads() {
  return Source::Traits::kMaxStates == 2 ? kPairMaxBlockThreads : kBlockThreads;
}
template <typename Source, int kChunk>
constexpr int min_blocks() {
  return Source::Traits::kMaxStates == 2 ? 1 : kChunk <= kSmallChunk ? 4 : 3;
}

// The weights of a row of at most kChunk states into `r` (see, weigh, finish: row.h), from their
// LSEs in `l` (-inf past the row's states); their weights go to `w`.  kSink: the row's sink (LSE
// `sink`, output 0) is one more state, in the max and the total only.  Shared by merge_kernel and
// merge_lse_kernel.
template <int kChunk, bool kSink = false>
__device__ __forceinline__ void weigh_row(const float (&l)[kChunk], float (&w)[kChunk], float factor, RowMerge& r,
                                          float sink = -INFINITY) {
  if constexpr (kSink) r.see(sink);
#pragma unroll
  for (int c = 0; c < kChunk; ++c) r.see(l[c]);
#pragma unroll
  for (int c = 0; c < kChunk; ++c) w[c] = r.weight(l[c]);
  r.total = w[0];  // weights are >= +0: no 0 + w[0] on the chain
#pragma unroll
  for (int c = 1; c < kChunk; ++c) r.total += w[c];
  if constexpr (kSink) r.total += r.weight(sink);
  r.finish(factor);
}

// How far ahead a call with StateExtras prefetches its states into L1, as it takes them one at a
// time (merge_body, merge_states_body, merge_share_body): a chunk's worth, as the calls without
// take in one round trip.
constexpr int kPrefetchAhead = kStateChunk;

// How a kernel body takes a row's states: kChunked, a chunk's LSEs and O packs in flight at once
// (the calls without StateExtras); kSettled, one state at a time, each LSE settled (its softmax
// sum, its valid entry: ExtrasRow::settled) before its O load goes out (the calls with them).
enum class StateRead : uint8_t { kChunked, kSettled };

// A row's ExtrasRow where kTake (a call with StateExtras whose states a kernel takes one at a
// time), else 0: nothing of the extras in the code.
template <bool kTake, typename Source, typename I>
__device__ __forceinline__ auto extras_row_if(const Source& src, I token, I head) {
  if constexpr (kTake) {
    return src.extras_row(token, head);
  } else {
    return 0;
  }
}

// A row's (or a group's) states 0 .. n-1 in one pass: `r` keeps the running max and total weight
// and `acc` the O packs weighted against that max, both rescaled when a chunk raises the max, so
// that the LSEs are read once and every memory round trip carries O (a first walk of the LSEs for
// the max was measured slower on long rows: benchmarks/NOTES.md#online-pass).  The first chunk is loaded
// already (LSEs in `l`, -inf past n, packs in `o`) and weighed against its own max (nothing to
// rescale yet); each later chunk's LSEs and packs are loaded together before any is used, by
// predicated loads.  lse_of(s) and o_of(s): where state s's LSE and this thread's pack of its O
// lie (computed past n too, never read there).  After it, r.finish(factor) and acc[i] * r.inv give
// the merged row; a zero-weight part is dropped unread as in the one-chunk path, and a NaN LSE
// makes the row NaN.  kSink: the row's sink (LSE `sink`, output 0) is one more state, weighed with
// the first chunk.  kRead kSettled (the source's StateExtras in this call): each later chunk's
// LSEs settled, settle(l, s) (states s .. s + kChunk - 1 into l, the states ahead prefetched),
// before its O loads go out (the first chunk's are the caller's to settle); NoSettle without.
struct NoSettle {
  template <int kChunk>
  __device__ void operator()(float (&)[kChunk], int) const {}
};
template <int kChunk, bool kSink = false, StateRead kRead = StateRead::kChunked, typename TIn, int VEC, typename LseOf,
          typename OOf, typename Settle = NoSettle>
__device__ __forceinline__ void accumulate_online(int n, float (&l)[kChunk], Pack<TIn, VEC> (&o)[kChunk], LseOf lse_of,
                                                  OOf o_of, bool evict_first, RowMerge& r, float (&acc)[VEC],
                                                  float sink = -INFINITY, Settle settle = {}) {
  constexpr bool kSettled = kRead == StateRead::kSettled;
  // A chunk's states weighed against r.m, without a branch: a state past n has LSE -inf, so
  // weight 0, and accumulate clears the words of its pack (never loaded).
  const auto add = [&] {
#pragma unroll
    for (int c = 0; c < kChunk; ++c) {
      const float w = r.weight(l[c]);
      r.total += w;
      accumulate(acc, o[c], w, w);
    }
  };
#pragma unroll
  for (int c = 0; c < kChunk; ++c) r.see(l[c]);
  if constexpr (kSink) {
    r.see(sink);
    r.total += r.weight(sink);
  }
  add();
  for (int s = kChunk; s < n; s += kChunk) {
    if constexpr (kSettled) {  // settled (and the states ahead prefetched) before the O loads go out
      settle(l, s);
#pragma unroll
      for (int c = 0; c < kChunk; ++c) o[c] = load_pack_if<TIn, VEC>(o_of(s + c), s + c < n, evict_first);
    } else {
#pragma unroll
      for (int c = 0; c < kChunk; ++c) {
        l[c] = load_lse_if(lse_of(s + c), s + c < n);
        o[c] = load_pack_if<TIn, VEC>(o_of(s + c), s + c < n, evict_first);
      }
    }
    const float before = r.m;
#pragma unroll
    for (int c = 0; c < kChunk; ++c) r.see(l[c]);
    // What was accumulated against the old max, rescaled to the new one; where that underflows to
    // 0 it is dropped whole (a select: a NaN O of a part whose weight is now 0 must not survive as
    // 0 * NaN, as the one-chunk path never reads such a part).
    const float keep = r.weight(before);
    r.total *= keep;
#pragma unroll
    for (int i = 0; i < VEC; ++i) acc[i] = keep != 0.0f ? acc[i] * keep : 0.0f;
    add();
  }
}

// Programmatic dependent launch: wait for the kernel before us (a no-op unless launched with it),
// then let the kernel after us be scheduled into our tail (benchmarks/NOTES.md#pdl).
__device__ __forceinline__ void pdl_wait_then_release() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;");
#endif
}

// Waits for the lanes of this thread's row, the first `packs` of the row's blockDim.x (a power of
// two, at most 32: each row lies in one warp at aligned lanes, and its lanes past `packs` have
// left): past it every lane of the row has read the row's LSEs, so one of them may overwrite them
// (benchmarks/NOTES.md#inplace-lanes).
__device__ __forceinline__ void sync_row_lanes(int packs) {
  const unsigned first = ((threadIdx.y * blockDim.x + threadIdx.x) & 31u) - threadIdx.x;
  __syncwarp(packs >= 32 ? 0xffffffffu : ((1u << packs) - 1u) << first);
}

// Whether a kernel of Source writing TOut may quantize per group (OutView::group): FP8 outputs of
// the general sources (the plan keeps the plain ones for calls without groups), so that the other
// kernels carry none of it.  The block-scaled formats are run-time modes of these kernels
// (OutView::block): NVFP4 calls take the FP8 kernels, whose stores they replace by their own.
template <typename Source, typename TOut>
ATTNMERGE_HD constexpr bool takes_groups() {
  return std::is_same<TOut, float8_e4m3_t>::value && !Source::Traits::kPlain;
}

// A block's quantization, its largest magnitude known (bits `amax`, magnitude_bits): this thread's
// N elements `x` of block j of the merged row (token, head) scaled by the block's scale, in place
// for FP8 (false: the caller stores them), or stored as E2M1 codes at `packed` (NVFP4: true).  An
// `owner` thread takes part `part` of the block's `parts` in its scale: part 0 stores it, and each
// zeroes its share of the swizzled tiles' padding (OutView::zero_padding).
template <int N, typename I>
__device__ __forceinline__ bool quantize_block(float (&x)[N], uint32_t amax, const OutView& out,
                                               const MergeShape& shape, I token, I head, I j, bool owner, I part,
                                               I parts, uint8_t* packed, bool evict_first) {
  const OutView::Scale s = out.block_scale(amax);
  if (owner) {
    if (part == 0) out.store_scale(token, head, j, s);
    if (out.swizzled) {
      const I per_head = static_cast<I>(out.head_groups);
      out.zero_padding(token, head * per_head + j, static_cast<I>(shape.tokens), static_cast<I>(shape.heads) * per_head,
                       part, parts);
    }
  }
  if (out.block == BlockScales::kNvfp4) {
    if constexpr (N % 2 == 0) store_e2m1<N>(packed, x, s.multiplier, evict_first);  // N even: the C ABI's condition
    return true;
  }
#pragma unroll
  for (int e = 0; e < N; ++e) x[e] *= s.multiplier;
  return false;
}

// Per-group FP8 and the block-scaled formats (OutView::group, OutView::block) of this thread's pack
// `acc` of the merged row (token, head), pack k: the group's largest magnitude over its lanes by
// shuffles, then quantize_block (its first lane stores the scale).  A group is group / VEC
// consecutive lanes of one warp, aligned (a power of two, at most 32, dividing the block's x
// extent or the row's packs: the C ABI's and the plan's conditions), and its lanes are all live or
// all gone, as a row's threads leave together.  true: the pack is stored (NVFP4).
template <int VEC, typename I>
__device__ __forceinline__ bool quantize_group(float (&acc)[VEC], const OutView& out, const MergeShape& shape,
                                               I token, I head, I k, bool evict_first) {
  const int lanes = out.group / VEC;
  const bool keep_nan = out.block != BlockScales::kFloat;
  uint32_t amax = 0;
#pragma unroll
  for (int i = 0; i < VEC; ++i) amax = max_bits(amax, magnitude_bits(acc[i], keep_nan));
  const unsigned lane = (threadIdx.y * blockDim.x + threadIdx.x) & 31u;
  const unsigned mask = lanes >= 32 ? 0xffffffffu : ((1u << lanes) - 1u) << (lane & ~static_cast<unsigned>(lanes - 1));
  for (int d = 1; d < lanes; d <<= 1) amax = max_bits(amax, __shfl_xor_sync(mask, amax, d));
  const I parts = static_cast<I>(lanes);
  return quantize_block<VEC>(acc, amax, out, shape, token, head, k / parts, true, k & (parts - 1), parts,
                             out.o_at<uint8_t>(token, head, k * VEC / 2), evict_first);
}

// Per-group FP8 and the block formats under kStates, where a group's elements lie with several
// finishing threads (its packs' finishers, in several warps): their largest magnitudes meet in the
// row's `slots` (one per group, zeroed before the block's first barrier) by atomicMax of their
// bits (magnitude_bits: a maximum is the same in any order), then each finisher quantizes its `x`,
// the elements e0 .. e0 + N - 1 of pack k (quantize_block; the finishers of a group's packs' first
// elements own its scale).  Every thread of the block comes here (a barrier), finishing or not.
// true: this thread's elements are stored (NVFP4).
template <int VEC, int N>
__device__ __forceinline__ bool quantize_group_shared(float (&x)[N], const OutView& out, const MergeShape& shape,
                                                      unsigned* slots, bool finishing, int32_t token, int32_t head,
                                                      int k, int e0) {
  // A group's packs, a power of two (group >= 8 >= VEC, kStates' VEC being 4 or 8): by shifts.
  const int shift = __ffs(out.group / VEC) - 1, j = k >> shift;
  unsigned* const slot = slots + j;
  if (finishing) {
    const bool keep_nan = out.block != BlockScales::kFloat;
    uint32_t amax = 0;
#pragma unroll
    for (int e = 0; e < N; ++e) amax = max_bits(amax, magnitude_bits(x[e], keep_nan));
    atomicMax(slot, amax);
  }
  __syncthreads();
  if (!finishing) return false;
  return quantize_block<N, int32_t>(x, *slot, out, shape, token, head, j, e0 == 0, k - (j << shift), 1 << shift,
                                    out.o_at<uint8_t>(token, head, (k * VEC + e0) / 2), true);
}

// The row (token, head) of this thread under kRows.  With I = int32_t the grid has no z extent
// (rows < 2^31) and these products fit.
template <typename I>
__device__ __forceinline__ I launch_row() {
  pdl_wait_then_release();
  return (static_cast<I>(blockIdx.z) * static_cast<I>(gridDim.x) + static_cast<I>(blockIdx.x)) *
             static_cast<I>(blockDim.y) + static_cast<I>(threadIdx.y);
}

// The (token, head) of a row; false for a row past the last tile's tokens.  A plain source's
// launch is untiled: no tile step, no such rows.
template <typename Source, typename I>
__device__ __forceinline__ bool locate_row(const MergeShape& shape, I row, I& token, I& head) {
  if constexpr (Source::Traits::kPlain) {
    if constexpr (Source::Traits::kRowIndex == RowIndex::kFlat) {
      token = row, head = 0;
    } else {
      shape.split_row<Tiles::kNone>(row, token, head);
    }
    return true;
  } else {
    shape.split_row(row, token, head);
    return token < static_cast<I>(shape.tokens);
  }
}

// The token of `row` (`token`, as located): a flat row's own token for a plain source, whose rows
// are located as (row, 0).  Its mask byte and the live count (MergeShape::live_tokens) rule the row.
template <typename Source, typename I>
__device__ __forceinline__ I row_token(const MergeShape& shape, I row, I token) {
  if constexpr (Source::Traits::kRowIndex == RowIndex::kFlat) {
    I t, h;
    shape.split_row<Tiles::kNone>(row, t, h);
    return t;
  }
  return token;
}

// kRows.  Work: rows (token, head) over threadIdx.y and the x (and, past 2^31 blocks, z) grid
// axes; the head_size axis over threadIdx.x in packs of VEC elements, and over the y grid axis
// where a row has more packs than a block has threads.  Each thread handles one pack of one row,
// with no shared memory.  The kernel is as lean in instructions as in registers: at the HBM
// roofline an SM retires a thread every few cycles, so every instruction per thread counts.
//
// A thread takes its row's states from the source and computes their weights itself.  States
// come kChunk at a time, the LSEs and O packs of a chunk all loaded before any is used and without
// a branch between them (a source gives every state of a row an O address it may read), so that a
// row of up to kChunk states costs one memory round trip; a zero-weight part is then dropped
// without being used.  Rows of more states take theirs in one pass against a running max
// (accumulate_online), each further chunk one round trip.  The output scale and a NaN LSE are folded into the
// weights, so the O path is one multiply-add per element and state.  A masked-out row reads its
// mask byte and nothing else.  A source's sink (Traits::kSink: the N-way and variable-length merges) is one
// more state whose O is 0: it enters the weights alone.  kRead kSettled (a general source's
// StateExtras in this call: softmax sums, empty states): a row of more than two states is taken one
// state at a time, each state's LSE settled (ExtrasRow::settled) before its O load goes out, the states a chunk
// ahead prefetched into L1 (kC below).
//
// An InPlaceSource writes the merged LSE over an input's.  With LseWrite::kWarp each row lies in
// one warp, whose lanes all read its LSEs and meet at a warp barrier (sync_row_lanes) before the
// row's first lane stores the merged one, and a masked-out row's threads leave at once.  With
// LseWrite::kBlock every thread reaches one block barrier after it has read its row's LSEs, and
// only then is the LSE stored, so the launch's rows lie inside blocks (the plan's condition) and
// no thread leaves before the barrier.
template <StateRead kRead, typename Source, typename TIn, typename TOut, int VEC, typename I, int kChunk>
__device__ __forceinline__ void merge_body(const MergeShape& shape, const Source& src, const OutView& out) {
  constexpr bool kSettled = kRead == StateRead::kSettled;
  using Traits = typename Source::Traits;
  constexpr bool kLanes = Traits::kLseWrite == LseWrite::kWarp;
  constexpr bool kBarrier = Traits::kLseWrite == LseWrite::kBlock;  // every thread reaches the block barrier
  constexpr bool kInPlace = Traits::kLseWrite != LseWrite::kOut;
  // Rows taken flat (flat rows, unmasked): one grid axis, x, and each row's packs along the
  // block's x axis alone (Variant::kRowsPlainFlat), so that a thread finds its row and pack in two
  // instructions.  At full occupancy every instruction before a thread's loads delays every
  // warp's loads: the launch's start is on its critical path.  A masked source keeps the general
  // row: measured faster there (benchmarks/NOTES.md#flat-rows).
  constexpr bool kFlatLaunch = Traits::kRowIndex == RowIndex::kFlat && Traits::kMask == Mask::kNone;
  using P = Pack<TIn, VEC>;
  I row, k;
  if constexpr (kFlatLaunch) {
    pdl_wait_then_release();
    row = static_cast<I>(blockIdx.x) * static_cast<I>(blockDim.y) + static_cast<I>(threadIdx.y);
    k = static_cast<I>(threadIdx.x);
  } else {
    row = launch_row<I>();
    k = static_cast<I>(blockIdx.y) * static_cast<I>(blockDim.x) + static_cast<I>(threadIdx.x);
  }
  // rows and packs fit in I (int32_t only for calls of fewer than 2^30 elements an array); a flat
  // launch's blocks are a row's packs wide, but for the lanes of an in-place row (a power of two)
  bool live = row < static_cast<I>(shape.rows) && ((kFlatLaunch && !kLanes) || k < static_cast<I>(shape.packs));
  if constexpr (!kBarrier) {
    if (!live) return;
  }
  I token = 0, head = 0;
  if (live) live = locate_row<Source>(shape, row, token, head);
  if constexpr (!kBarrier) {
    if (!live) return;
  }
  if (live && src.masked_out(row_token<Source>(shape, row, token))) live = false;
  // A row past the live count: the one place each kRows kernel learns it, before any read of its own.
  if (live && shape.live_tokens != nullptr && shape.past_live(row_token<Source>(shape, row, token))) live = false;
  if constexpr (!kBarrier) {
    if (!live) return;
  }
  // token 0, head 0 for a thread with no row; o_at(s) is this thread's pack of state s.  Under a
  // block barrier a thread with no row (or a masked-out one) stays, reading nothing of it.
  const auto states = [&] {
    if constexpr (kBarrier) {
      return src.template row<TIn>(token, head, k * VEC, live);
    } else {
      return src.template row<TIn>(token, head, k * VEC);
    }
  }();
  const int n = kBarrier && !live ? 0 : states.count();
  const bool evict_first = Traits::kCache == Cache::kAsShape ? shape.evict_first : Traits::kCache == Cache::kEvictFirst;
  // A call with StateExtras takes a row of more than two states in code of its own (kSettled),
  // one state at a time (kC = 1), each state's LSE settled (ExtrasRow::settled: its softmax sum, its
  // valid entry) and the states a chunk ahead prefetched into L1: a loop that holds one state's
  // loads and addresses.  The two states of a two-state source are settled together, in the same
  // code as the calls without, once their loads are in flight.
  static_assert(!kSettled || Traits::kMaxStates != 2, "a two-state source settles its extras in place");
  constexpr int kC = kSettled ? 1 : kChunk;
  constexpr bool kFew = Traits::kMaxStates > 0 && Traits::kMaxStates <= kC;  // at most a chunk, always
  // The states first .. first + kC - 1's LSEs as the merge reads them, into lc, with the states a
  // chunk ahead prefetched (the two states of a two-state source: from the LSEs row() read).
  // None for the calls without extras and for a two-state row (settled from row()'s LSEs).
  const auto extras = extras_row_if<kSettled && !kFew>(src, token, head);
  const auto settle = [&](float (&lc)[kC], int first) {
    if constexpr (kFew && Traits::kExtras) {
#pragma unroll
      for (int c = 0; c < kC; ++c) lc[c] = src.settle(lc[c], token, head, first + c, first + c < n, shape.base2);
    } else if constexpr (kSettled) {
      const int ahead = first + kPrefetchAhead;
      extras.prefetch(ahead, ahead < n);
      prefetch_if(states.template o_at<TIn>(ahead), ahead < n);
      lc[0] = extras.settled(first, first < n, shape.base2);
    }
  };
  // The first chunk: every load in flight at once.
  float l[kC];
  P o[kC];
  const auto load_o = [&](int c) {
    if constexpr (kFew) {  // a count known at compile time: no predicate
      if (c < n) o[c] = load_pack<TIn, VEC>(states.template o_at<TIn>(c), evict_first);
    } else {
      o[c] = load_pack_if<TIn, VEC>(states.template o_at<TIn>(c), c < n, evict_first);
    }
  };
  if constexpr (kSettled) {
#pragma unroll 1
    for (int s = 1; s < kPrefetchAhead; ++s) {  // the states before settle's first prefetch
      extras.prefetch(s, s < n);
      prefetch_if(states.template o_at<TIn>(s), s < n);
    }
    settle(l, 0);
#pragma unroll
    for (int c = 0; c < kC; ++c) load_o(c);
  } else {
#pragma unroll
    for (int c = 0; c < kC; ++c) {
      if constexpr (kFew) {
        l[c] = c < n ? states.lse(c) : -INFINITY;  // -inf: no weight, no NaN
      } else {
        l[c] = load_lse_if(states.lse_ptr(c), c < n);
      }
      load_o(c);
    }
    // A two-state source's StateExtras, where the call has them: both states settled from the LSEs
    // row() read, once every load is in flight (a branch the same for every thread).
    if constexpr (kFew && Traits::kExtras) {
      if (src.extras.on) settle(l, 0);
    }
  }
  const float sink = sink_lse(src, head);  // -inf without one
  // Where the results go, worked out while the loads are in flight: at decode sizes a merge
  // lasts as long as its longest chain of dependent instructions, and everything after the loads
  // is on it.
  TOut* dst;
  float* lse_dst;
  bool writes_lse;  // this thread stores the row's merged LSE (at lse_dst)
  // A flat two-way merge's output offsets are its inputs' (RowIndex::kFlat); in place, the
  // output's own views are measured faster (benchmarks/NOTES.md#flat-rows), and its LSE is always written
  // (the plan's condition): no null check.
  if constexpr (kFlatLaunch && !kInPlace) {
    dst = static_cast<TOut*>(out.o) + src.offset(row, k * VEC);
    lse_dst = out.lse != nullptr ? out.lse + src.lse_offset(row) : nullptr;
    writes_lse = k == 0 && lse_dst != nullptr;
  } else if constexpr (kInPlace) {
    dst = out.o_at<TOut>(token, head, k * VEC);
    lse_dst = out.lse_row(token, head);
    writes_lse = k == 0;
  } else {
    dst = out.o_at<TOut>(token, head, k * VEC);
    lse_dst = out.lse_at(token, head);
    writes_lse = k == 0 && lse_dst != nullptr;
  }
  RowMerge r(shape.base2);
  // The merged LSE as the output takes it (OutView::lse_value): a plain source has one base, the
  // plan's condition, so its kernels do not multiply by 1.
  const auto merged_lse = [&] { return Traits::kPlain ? r.lse() : out.lse_value(r.lse()); };
  const float factor = Traits::kPlain ? out.inv_scale : out.inverse_scale();
  float acc[VEC] = {};
  if (kFew || n <= kC) {  // one round trip, the weights from the row's own max
    float w[kC];
    weigh_row<kC, Traits::kSink>(l, w, factor, r, sink);
    if constexpr (Traits::kSink) {  // a NaN sink has no O to carry its NaN into the sum
#pragma unroll
      for (int i = 0; i < VEC; ++i) acc[i] = r.nan ? NAN : 0.0f;
    }
    if constexpr (kBarrier) {
      __syncthreads();  // every thread of the block has read its row's old LSEs
      if (!live) return;
    }
    if constexpr (kLanes) sync_row_lanes(static_cast<int>(shape.packs));
    const float lse_v = merged_lse();  // computed unconditionally: a store under a predicate, no branch
    if (writes_lse) *lse_dst = lse_v;  // its latency hidden behind the O math
#pragma unroll
    for (int c = 0; c < kC; ++c)
      if (c < n) accumulate(acc, o[c], r.scale(w[c]), w[c]);
  } else if constexpr (!kFew) {
    accumulate_online<kC, Traits::kSink, kRead>(
        n, l, o, [&](int s) { return states.lse_ptr(s); }, [&](int s) { return states.template o_at<TIn>(s); },
        evict_first, r, acc, sink, settle);
    r.finish(factor);
    if (writes_lse) *lse_dst = merged_lse();
#pragma unroll
    for (int i = 0; i < VEC; ++i) acc[i] *= r.inv;
  }
  if constexpr (takes_groups<Source, TOut>()) {
    if (out.group > 0 && quantize_group(acc, out, shape, token, head, k, evict_first)) return;
  }
  store_pack<TOut, VEC>(dst, acc, evict_first);
}

// kRows: merge_body, a row of more than two states in its code for calls with StateExtras apart
// from that for calls without, one uniform branch at the start between them (each whole, so that
// the calls without keep their code).
template <typename Source, typename TIn, typename TOut, int VEC, typename I, int kChunk>
__global__ void __launch_bounds__(max_threads<Source>(), (min_blocks<Source, kChunk>()))
    merge_kernel(const MergeShape shape, const Source src, const OutView out) {
  if constexpr (takes_extras<Source, kChunk>() && Source::Traits::kMaxStates != 2) {
    if (src.extras.on) return merge_body<StateRead::kSettled, Source, TIn, TOut, VEC, I, kChunk>(shape, src, out);
  }
  merge_body<StateRead::kChunked, Source, TIn, TOut, VEC, I, kChunk>(shape, src, out);
}

// kStates.  A block holds whole rows: threadIdx.x the pack, threadIdx.y the group, threadIdx.z
// the row within the block.  Group g of a row takes the row's states g, g + G, g + 2G, ... (G =
// kGroups) in one pass, kSmallChunk of them in flight at a time (accumulate_online): its partial max,
// total weight and accumulators against that max.  The groups' partials meet in shared memory;
// then each of the first min(G, VEC) groups finishes VEC / min(G, VEC) of each pack's elements:
// it rescales every group's partial to the row's max and sums them in a fixed order, so that
// results are bit-identical from run to run, with the semantics of kRows (a zero-weight part is
// dropped unread, a NaN LSE makes the row NaN, an all-empty row gives O = 0 and LSE -inf); a
// source's sink is counted once, by the finishing threads.  Per-group FP8 (takes_groups) meets
// once more, in shared memory (quantize_group_shared).
// Built for latency, as split-KV decode calls it: no division, each chunk's loads predicated and
// issued back to back with evict-first accesses (the plan makes every kStates call's so), and the
// finishing reads of shared memory all in flight together.  32-bit offsets and VEC a multiple of
// 4 (the plan's conditions).  Every thread reaches the barrier: none leaves early.
template <StateRead kRead, typename Source, typename TIn, typename TOut, int VEC, int kGroups>
__device__ __forceinline__ void merge_states_body(const MergeShape& shape, const Source& src, const OutView& out) {
  constexpr bool kSettled = kRead == StateRead::kSettled;
  static_assert(VEC % 4 == 0, "kStates stores a pack's accumulators as float4s");
  static_assert(kGroups >= 2 && (kGroups & (kGroups - 1)) == 0, "kStates groups: a power of two");
  using I = int32_t;
  using P = Pack<TIn, VEC>;
  constexpr int kChunk = kSmallChunk;
  constexpr int kShift = kGroups == 2 ? 1 : kGroups == 4 ? 2 : kGroups == 8 ? 3 : 4;
  constexpr int kFinishers = kGroups < VEC ? kGroups : VEC;
  constexpr int kEach = VEC / kFinishers;  // elements of a pack each finishing thread takes
  pdl_wait_then_release();
  const int k = static_cast<int>(threadIdx.x), g = static_cast<int>(threadIdx.y);
  const int packs = static_cast<int>(blockDim.x);
  const I row = static_cast<I>(blockIdx.x) * static_cast<I>(blockDim.z) + static_cast<I>(threadIdx.z);
  bool live = row < static_cast<I>(shape.rows);
  I token = 0, head = 0;
  if (live) shape.split_row<Tiles::kNone>(row, token, head);
  if (live && shape.past_live(token)) live = false, token = 0, head = 0;  // past the live count: reads nothing
  const auto states = src.template row<TIn>(token, head);
  const int n = live ? states.count() : 0;
  const int mine = n > g ? ((n - g - 1) >> kShift) + 1 : 0;  // this group's states
  const float sink = sink_lse(src, head);  // the finishing threads' (head 0 where not live: valid)
  // The group's j-th state is the row's g + j G: 32-bit offsets from the row's first state by
  // fixed steps, each address one multiply-add from the row's pointers.
  const TIn* const orow = states.template o_at<TIn>(0);
  const I o_first = g * states.o_ss + k * VEC, lse_first = g * states.l_ss;
  const I lse_step = states.l_ss << kShift, o_step = states.o_ss << kShift;
  const auto lse_of = [&](int j) { return states.l0 + (lse_first + j * lse_step); };
  const auto o_of = [&](int j) { return orow + (o_first + j * o_step); };
  // The group's j-th state is the row's g + j G.  A call with StateExtras takes the group's states
  // one at a time (kC = 1: merge_body's reason), each settled, the states a chunk ahead prefetched.
  constexpr int kC = kSettled ? 1 : kChunk;
  const auto extras = extras_row_if<kSettled>(src, token, head);
  const auto settle = [&](float (&lc)[kC], int j) {
    if constexpr (kSettled) {
      const int ahead = j + kPrefetchAhead;
      extras.prefetch(g + (ahead << kShift), ahead < mine);
      prefetch_if(o_of(ahead), ahead < mine);
      lc[0] = extras.settled(g + (j << kShift), j < mine, shape.base2);
    }
  };
  float l[kC];
  Pack<TIn, VEC> o[kC];
  if constexpr (kSettled) {
#pragma unroll 1
    for (int j = 1; j < kPrefetchAhead; ++j) {  // the states before settle's first prefetch
      extras.prefetch(g + (j << kShift), j < mine);
      prefetch_if(o_of(j), j < mine);
    }
    settle(l, 0);
    o[0] = load_pack_if<TIn, VEC>(o_of(0), 0 < mine, true);
  } else {
#pragma unroll
    for (int c = 0; c < kC; ++c) {
      l[c] = load_lse_if(lse_of(c), c < mine);
      o[c] = load_pack_if<TIn, VEC>(o_of(c), c < mine, true);
    }
  }
  RowMerge part(shape.base2);
  float acc[VEC] = {};
  accumulate_online<kC, false, kRead>(mine, l, o, lse_of, o_of, true, part, acc, -INFINITY, settle);
  // Shared memory: each slot's (row, group) accumulators, [slot][pack][VEC] floats, then its
  // (max, total), then (per-group FP8) each row's groups' amax slots, a pack's worth per row.
  extern __shared__ float4 shared[];
  const int slot = static_cast<int>(threadIdx.z) * kGroups;
  float* const part_acc = reinterpret_cast<float*>(shared);
  float2* const part_mt =
      reinterpret_cast<float2*>(shared + static_cast<int>(blockDim.z) * kGroups * packs * (VEC / 4));
  unsigned* const amax_slots =
      reinterpret_cast<unsigned*>(part_mt + static_cast<int>(blockDim.z) * kGroups) + threadIdx.z * packs;
  constexpr bool kQuantize = takes_groups<Source, TOut>();
  if constexpr (kQuantize) {
    if (out.group > 0 && g == 0) amax_slots[k] = 0u;
  }
#pragma unroll
  for (int q = 0; q < VEC / 4; ++q)
    shared[((slot + g) * packs + k) * (VEC / 4) + q] =
        make_float4(acc[4 * q], acc[4 * q + 1], acc[4 * q + 2], acc[4 * q + 3]);
  if (k == 0) part_mt[slot + g] = make_float2(part.m, part.nan ? NAN : part.total);  // a NaN travels as a total
  __syncthreads();
  const bool finishing = g < kFinishers && live;
  RowMerge r(shape.base2);
  float sum[kEach] = {};
  // The row's finish, this thread's kEach elements of pack k.
  const auto finish = [&] {
    float2 mt[kGroups];
#pragma unroll
    for (int j = 0; j < kGroups; ++j) {
      mt[j] = part_mt[slot + j];
      r.m = fmaxf(r.m, mt[j].x);
    }
    if constexpr (Source::Traits::kSink) r.see(sink);  // once a row, by its finishers, not by every group
    // Each group's partial rescaled to the row's max; one whose factor underflows to 0 is dropped
    // whole (as accumulate_online drops its own), a NaN total makes the row NaN.
    float f[kGroups];
    r.total = 0.0f;
#pragma unroll
    for (int j = 0; j < kGroups; ++j) {
      f[j] = r.weight(mt[j].x);
      r.total += f[j] != 0.0f ? mt[j].y * f[j] : 0.0f;
      r.nan |= is_nan(mt[j].y);
    }
    if constexpr (Source::Traits::kSink) r.total += r.weight(sink);
#pragma unroll
    for (int j = 0; j < kGroups; ++j) {
      const float* const a = part_acc + ((slot + j) * packs + k) * VEC + g * kEach;
#pragma unroll
      for (int e = 0; e < kEach; ++e) sum[e] += f[j] != 0.0f ? f[j] * a[e] : 0.0f;
    }
    r.finish(out.inverse_scale());
#pragma unroll
    for (int e = 0; e < kEach; ++e) sum[e] *= r.inv;
  };
  if constexpr (kQuantize) {
    if (finishing) finish();
    // out.group is the same for every thread of the launch: all meet at its barrier
    const bool stored =
        out.group > 0 && quantize_group_shared<VEC>(sum, out, shape, amax_slots, finishing, token, head, k, g * kEach);
    if (!finishing || stored) {
      if (finishing && k == 0 && g == 0) out.store_lse(token, head, r.lse());
      return;
    }
  } else {
    if (!finishing) return;
    finish();
  }
  store_pack<TOut, kEach>(out.o_at<TOut>(token, head) + k * VEC + g * kEach, sum, true);
  if (k == 0 && g == 0) out.store_lse(token, head, r.lse());
}

// kStates: merge_states_body, with and without StateExtras apart (as merge_kernel); the branch is the
// same for every thread of the launch, which all meet at its barriers either way.
template <typename Source, typename TIn, typename TOut, int VEC, int kGroups>
__global__ void __launch_bounds__(kStateBlockThreads, kStateThreadsPerSM / kStateBlockThreads)
    merge_states_kernel(const MergeShape shape, const Source src, const OutView out) {
  if (src.extras.on) return merge_states_body<StateRead::kSettled, Source, TIn, TOut, VEC, kGroups>(shape, src, out);
  merge_states_body<StateRead::kChunked, Source, TIn, TOut, VEC, kGroups>(shape, src, out);
}

// A state's share (ShareSource), laid out as kRows: one thread per pack of a row.  The thread's
// one O load, the own state's pack, goes out first; the row's LSEs follow kChunk at a time, floats
// only, weighed against a running max (each chunk's loads predicated and issued together, the
// total rescaled when a chunk raises the max); the pack is scaled once, by its weight against the
// final max.  A thread holds one pack and a chunk of floats, so an SM holds as many threads as
// the two-way merge's, each O load in flight with its LSEs: the N-way merge's kernel, which keeps
// a pack per state of a chunk, left a share latency-bound (benchmarks/NOTES.md#share-kernel).  The semantics
// are the N-way merge's: a zero-weight share is 0 and its pack cleared unread, a NaN LSE (or
// sink) makes the row NaN, an all-empty row gives O = 0 and LSE -inf.
template <StateRead kRead, typename TIn, typename TOut, int VEC, typename I, int kChunk>
__device__ __forceinline__ void merge_share_body(const MergeShape& shape, const ShareSource& src, const OutView& out) {
  constexpr bool kSettled = kRead == StateRead::kSettled;
  const I row = launch_row<I>();
  const I k = static_cast<I>(blockIdx.y) * static_cast<I>(blockDim.x) + static_cast<I>(threadIdx.x);
  if (row >= static_cast<I>(shape.rows) || k >= static_cast<I>(shape.packs)) return;
  I token, head;
  if (!locate_row<ShareSource>(shape, row, token, head) || shape.past_live(token)) return;
  const auto states = src.template row<TIn>(token, head, k * VEC);
  const bool evict_first = shape.evict_first;
  const Pack<TIn, VEC> own = load_pack<TIn, VEC>(states.template o_at<TIn>(states.own), evict_first);
  float own_lse = states.lse(states.own);
  const int n = states.count();
  // A call with StateExtras takes the LSEs one state at a time (kC = 1: merge_body's reason), each
  // settled, the states a chunk ahead prefetched.
  constexpr int kC = kSettled ? 1 : kChunk;
  const auto extras = extras_row_if<kSettled>(src, token, head);
  if constexpr (kSettled) {
    own_lse = extras.settled(states.own, true, shape.base2);
#pragma unroll 1
    for (int s = 1; s < kPrefetchAhead; ++s) extras.prefetch(s, s < n);
  }
  RowMerge r(shape.base2);
  const float sink = src.sink.at(head);  // -inf without one: weight 0
  r.see(sink);
  r.total = r.weight(sink);
  for (int s = 0; s < n; s += kC) {
    float l[kC];
    if constexpr (kSettled) {
      extras.prefetch(s + kPrefetchAhead, s + kPrefetchAhead < n);
      l[0] = extras.settled(s, s < n, shape.base2);
    } else {
#pragma unroll
      for (int c = 0; c < kC; ++c) l[c] = load_lse_if(states.lse_ptr(s + c), s + c < n);
    }
    const float before = r.m;
#pragma unroll
    for (int c = 0; c < kC; ++c) r.see(l[c]);
    r.total *= r.weight(before);  // 1 while the max stands, 0 from -FLT_MAX: no branch
#pragma unroll
    for (int c = 0; c < kC; ++c) r.total += r.weight(l[c]);
  }
  r.finish(out.inverse_scale());
  const float w = r.weight(own_lse);
  float acc[VEC] = {};
  accumulate(acc, own, r.scale(w), w);  // a NaN row: the scale is NaN, so is every element
  if constexpr (takes_groups<ShareSource, TOut>()) {
    if (out.group > 0 && quantize_group(acc, out, shape, token, head, k, evict_first)) {
      if (k == 0) out.store_lse(token, head, r.lse());
      return;
    }
  }
  store_pack<TOut, VEC>(out.o_at<TOut>(token, head, k * VEC), acc, evict_first);
  if (k == 0) out.store_lse(token, head, r.lse());
}

// A share: merge_share_body, with and without StateExtras apart (as merge_kernel).
template <typename TIn, typename TOut, int VEC, typename I, int kChunk>
__global__ void __launch_bounds__(kBlockThreads) merge_share_kernel(const MergeShape shape, const ShareSource src,
                                                                    const OutView out) {
  if constexpr (takes_extras<ShareSource, kChunk>()) {
    if (src.extras.on) return merge_share_body<StateRead::kSettled, TIn, TOut, VEC, I, kChunk>(shape, src, out);
  }
  merge_share_body<StateRead::kChunked, TIn, TOut, VEC, I, kChunk>(shape, src, out);
}

// The merged LSEs alone, one thread per row: the second launch of an in-place merge whose rows
// span blocks (every thread of a row in merge_kernel reads the row's LSEs, so none may write it
// there).  O and its dtypes play no part.
template <typename Source, typename I>
__global__ void __launch_bounds__(max_threads<Source>())
    merge_lse_kernel(const MergeShape shape, const Source src, const OutView out) {
  constexpr int kChunk = 2;  // two-state sources only
  const I row = launch_row<I>();
  if (row >= static_cast<I>(shape.rows)) return;
  I token, head;
  if (!locate_row<Source>(shape, row, token, head)) return;
  if (src.masked_out(row_token<Source>(shape, row, token)) || shape.past_live(row_token<Source>(shape, row, token)))
    return;
  const auto states = src.template row<float>(token, head);
  const int n = states.count();
  float l[kChunk], w[kChunk];
#pragma unroll
  for (int c = 0; c < kChunk; ++c) l[c] = c < n ? states.lse(c) : -INFINITY;
  if (extras_on(src)) {
#pragma unroll
    for (int c = 0; c < kChunk; ++c) l[c] = src.settle(l[c], token, head, c, c < n, shape.base2);
  }
  RowMerge r(shape.base2);
  weigh_row<kChunk>(l, w, 1.0f, r);
  out.store_lse(token, head, r.lse());
}

// One launch of `kernel` over `dims` on `stream`, with programmatic dependent launch where `pdl`
// (the forward's and the backward's launches alike).
template <typename... Params, typename... Args>
cudaError_t launch_kernel(void (*kernel)(Params...), const LaunchDims& dims, bool pdl, cudaStream_t stream,
                          const Args&... args) {
  cudaLaunchConfig_t config = {};
  config.stream = stream;
  config.gridDim = dim3(dims.grid[0], dims.grid[1], dims.grid[2]);
  config.blockDim = dim3(dims.block[0], dims.block[1], dims.block[2]);
  config.dynamicSmemBytes = dims.smem;
  cudaLaunchAttribute attribute;
  if (pdl) {
    attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attribute.val.programmaticStreamSerializationAllowed = 1;
    config.attrs = &attribute;
    config.numAttrs = 1;
  }
  return cudaLaunchKernelEx(&config, kernel, args...);
}

// One launch of a merge kernel with the plan's dimensions and PDL.
template <typename Source>
cudaError_t launch(void (*kernel)(MergeShape, Source, OutView), const LaunchPlan& plan, const LaunchDims& dims,
                   const Source& src, const OutView& out, cudaStream_t stream) {
  return launch_kernel(kernel, dims, plan.pdl, stream, plan.shape, src, out);
}

namespace launch_detail {

// kRows with index type I and kChunk states in flight.
template <typename Source, typename TIn, typename TOut, int VEC, typename I, int kChunk>
cudaError_t rows(const LaunchPlan& plan, const Source& src, const OutView& out, cudaStream_t stream) {
  return launch(merge_kernel<Source, TIn, TOut, VEC, I, kChunk>, plan, plan.main, src, out, stream);
}

// kRows with the plan's index type and chunk.
template <typename Source, typename TIn, typename TOut, int VEC>
cudaError_t rows(const LaunchPlan& plan, const Source& src, const OutView& out, cudaStream_t stream) {
  if constexpr (Source::Traits::kMaxStates == 2) {
    return plan.index32 ? rows<Source, TIn, TOut, VEC, int32_t, 2>(plan, src, out, stream)
                        : rows<Source, TIn, TOut, VEC, int64_t, 2>(plan, src, out, stream);
  } else if (plan.chunk <= kSmallChunk) {
    return plan.index32 ? rows<Source, TIn, TOut, VEC, int32_t, kSmallChunk>(plan, src, out, stream)
                        : rows<Source, TIn, TOut, VEC, int64_t, kSmallChunk>(plan, src, out, stream);
  } else {
    return plan.index32 ? rows<Source, TIn, TOut, VEC, int32_t, kStateChunk>(plan, src, out, stream)
                        : rows<Source, TIn, TOut, VEC, int64_t, kStateChunk>(plan, src, out, stream);
  }
}

// kRowsLseAfter with index type I: the merge without the LSE, then the LSEs.
template <typename TIn, typename TOut, int VEC, typename I>
cudaError_t rows_lse_after(const LaunchPlan& plan, const PairSource& src, const OutView& out, cudaStream_t stream) {
  OutView first = out;
  first.lse = nullptr;
  const cudaError_t err = rows<PairSource, TIn, TOut, VEC, I, 2>(plan, src, first, stream);
  return err != cudaSuccess ? err : launch(merge_lse_kernel<PairSource, I>, plan, plan.lse, src, out, stream);
}

// A share (merge_share_kernel) with the plan's index type and chunk of LSEs in flight.
template <typename TIn, typename TOut, int VEC>
cudaError_t share(const LaunchPlan& plan, const ShareSource& src, const OutView& out, cudaStream_t stream) {
  const auto go = [&](auto kernel) { return launch(kernel, plan, plan.main, src, out, stream); };
  if (plan.chunk <= kSmallChunk)
    return plan.index32 ? go(merge_share_kernel<TIn, TOut, VEC, int32_t, kSmallChunk>)
                        : go(merge_share_kernel<TIn, TOut, VEC, int64_t, kSmallChunk>);
  return plan.index32 ? go(merge_share_kernel<TIn, TOut, VEC, int32_t, kStateChunk>)
                      : go(merge_share_kernel<TIn, TOut, VEC, int64_t, kStateChunk>);
}

// kStates with the plan's groups.
template <typename Source, typename TIn, typename TOut, int VEC>
cudaError_t states(const LaunchPlan& plan, const Source& src, const OutView& out, cudaStream_t stream) {
  const auto go = [&](auto kernel) { return launch(kernel, plan, plan.main, src, out, stream); };
  switch (plan.groups) {
    case 2: return go(merge_states_kernel<Source, TIn, TOut, VEC, 2>);
    case 4: return go(merge_states_kernel<Source, TIn, TOut, VEC, 4>);
    case 8: return go(merge_states_kernel<Source, TIn, TOut, VEC, 8>);
    default: return go(merge_states_kernel<Source, TIn, TOut, VEC, 16>);
  }
}

}  // namespace launch_detail

// The merge as `plan` (plan_merge of the same call) says: O and, unless out.lse is null, the
// merged LSEs.  TIn, TOut: the storage types of the inputs' and the output's O; VEC = plan.vec.
// One case a variant, each compiled only where the plan may give it (may_plan): a plan made for
// another source, other types or another vector width is refused, not run wrong.
template <typename TIn, typename TOut, int VEC, typename Source>
cudaError_t launch_merge(const LaunchPlan& plan, const Source& src, const OutView& out, cudaStream_t stream) {
  using namespace launch_detail;
  constexpr Dtype kIn = dtype_of<TIn>(), kOut = dtype_of<TOut>();
  constexpr int kAccess = VEC * static_cast<int>(sizeof(TIn) > sizeof(TOut) ? sizeof(TIn) : sizeof(TOut));
  const bool evict = plan.shape.evict_first;
  switch (plan.variant) {
    case Variant::kNone:
      return cudaSuccess;
    case Variant::kRows:
      if constexpr (may_plan<Source>(Variant::kRows, kIn, kOut, kAccess))
        return rows<Source, TIn, TOut, VEC>(plan, src, out, stream);
      break;
    case Variant::kRowsLseAfter:
      if constexpr (may_plan<Source>(Variant::kRowsLseAfter, kIn, kOut, kAccess))
        return plan.index32 ? rows_lse_after<TIn, TOut, VEC, int32_t>(plan, src, out, stream)
                            : rows_lse_after<TIn, TOut, VEC, int64_t>(plan, src, out, stream);
      break;
    case Variant::kRowsPlain:
      if constexpr (may_plan<Source>(Variant::kRowsPlain, kIn, kOut, kAccess, Cache::kAsShape, Mask::kNone))
        return evict ? rows<PlainPairSource<Cache::kEvictFirst>, TIn, TOut, VEC>(plan, {src.a, src.b}, out, stream)
                     : rows<PlainPairSource<Cache::kDefault>, TIn, TOut, VEC>(plan, {src.a, src.b}, out, stream);
      break;
    case Variant::kRowsPlainFlat:  // 32-bit offsets (the plan's condition)
      if constexpr (may_plan<Source>(Variant::kRowsPlainFlat, kIn, kOut, kAccess, Cache::kAsShape, Mask::kNone)) {
        using Evict = PlainPairSource<Cache::kEvictFirst, RowIndex::kFlat>;
        using Keep = PlainPairSource<Cache::kDefault, RowIndex::kFlat>;
        const StateView a = flat_rows(src.a), b = flat_rows(src.b);
        const OutView o = flat_rows(out);
        return evict ? rows<Evict, TIn, TOut, VEC, int32_t, 2>(plan, {a, b}, o, stream)
                     : rows<Keep, TIn, TOut, VEC, int32_t, 2>(plan, {a, b}, o, stream);
      }
      break;
    case Variant::kInPlaceWarp:
      if constexpr (may_plan<Source>(Variant::kInPlaceWarp, kIn, kOut, kAccess))
        return rows<InPlaceSource<PairSource, LseWrite::kWarp>, TIn, TOut, VEC>(plan, {src}, out, stream);
      break;
    case Variant::kInPlaceBlock:
      if constexpr (may_plan<Source>(Variant::kInPlaceBlock, kIn, kOut, kAccess))
        return rows<InPlaceSource<PairSource, LseWrite::kBlock>, TIn, TOut, VEC>(plan, {src}, out, stream);
      break;
    case Variant::kInPlacePlainFlat:  // rows in warps and flat, 32-bit offsets (the plan's conditions)
      if constexpr (may_plan<Source>(Variant::kInPlacePlainFlat, kIn, kOut, kAccess)) {
        const auto in_warps = [&](auto flat) {
          flat.a = flat_rows(src.a), flat.b = flat_rows(src.b);
          flat.mask = src.mask, flat.mask_stride = src.mask_stride;
          using InPlace = InPlaceSource<decltype(flat), LseWrite::kWarp>;
          return rows<InPlace, TIn, TOut, VEC, int32_t, 2>(plan, {flat}, flat_rows(out), stream);
        };
        constexpr Variant kV = Variant::kInPlacePlainFlat;
        constexpr bool kEvictMasked = may_plan<Source>(kV, kIn, kOut, kAccess, Cache::kEvictFirst, Mask::kByToken);
        constexpr bool kUnmasked = may_plan<Source>(kV, kIn, kOut, kAccess, Cache::kDefault, Mask::kNone);
        constexpr bool kEvictUnmasked = may_plan<Source>(kV, kIn, kOut, kAccess, Cache::kEvictFirst, Mask::kNone);
        constexpr RowIndex kFlat = RowIndex::kFlat;
        if (src.mask != nullptr) {
          if (!evict) return in_warps(PlainPairSource<Cache::kDefault, kFlat, Mask::kByToken>{});
          if constexpr (kEvictMasked) return in_warps(PlainPairSource<Cache::kEvictFirst, kFlat, Mask::kByToken>{});
        } else if (!evict) {
          if constexpr (kUnmasked) return in_warps(PlainPairSource<Cache::kDefault, kFlat>{});
        } else {
          if constexpr (kEvictUnmasked) return in_warps(PlainPairSource<Cache::kEvictFirst, kFlat>{});
        }
      }
      break;
    case Variant::kStates:  // 16-byte accesses (the plan's condition)
      if constexpr (may_plan<Source>(Variant::kStates, kIn, kOut, kAccess))
        return states<Source, TIn, TOut, VEC>(plan, src, out, stream);
      break;
    case Variant::kShare:
      if constexpr (may_plan<Source>(Variant::kShare, kIn, kOut, kAccess))
        return share<TIn, TOut, VEC>(plan, src, out, stream);
      break;
    case Variant::kExchange:  // launch_exchange's (exchange_kernels.cuh), which also takes the protocol's
      break;
  }
  return cudaErrorInvalidValue;  // a plan made for other facts than these
}

}  // namespace attnmerge
