// The header-only CUDA kernel of the merges' backward (backward_params.h) and its launcher (its
// plan is plan_backward, plan.h).  Like merge_kernels.cuh, the launcher validates nothing
// (libattnmerge's C ABI does) and returns the launch's cudaError_t.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "attnmerge/backward_params.h"
#include "attnmerge/merge_kernels.cuh"
#include "attnmerge/plan.h"

namespace attnmerge {

// Registers (sm_90): a chunk of 4 states keeps the chunk's LSEs, 4 packs of O_i and their dots
// and the lane's packs of dO and O, so the N-way cap is 2 blocks of 256 per SM; two states per
// chunk fit 3 blocks (N-way) or 4 (two-way) without spills.  ATTNMERGE_BACKWARD_MIN_BLOCKS
// overrides the N-way cap of 4 states: an A/B knob for the native benchmark
// (benchmarks/NOTES.md#backward-chunk).
#ifndef ATTNMERGE_BACKWARD_MIN_BLOCKS
#define ATTNMERGE_BACKWARD_MIN_BLOCKS 2
#endif
// How many chunks ahead a lane asks L2 (prefetch_l2) for its packs of the states' O before it
// uses the current chunk (0: none), and whether the lane of the row's first pack asks for their
// LSEs too: A/B knobs for the native benchmark (benchmarks/NOTES.md#backward-prefetch).
#ifndef ATTNMERGE_PREFETCH_BACKWARD
#define ATTNMERGE_PREFETCH_BACKWARD 1
#endif
#ifndef ATTNMERGE_PREFETCH_BACKWARD_LSE
#define ATTNMERGE_PREFETCH_BACKWARD_LSE 1
#endif
template <typename Src, int kChunk>
constexpr int backward_min_blocks() {
  return kChunk > 2 ? ATTNMERGE_BACKWARD_MIN_BLOCKS : Src::kMaxStates == 2 ? 4 : kBackwardTwoChunkBlocks;
}

// One row per `lanes` threads, or, split into 2^group_shift groups of `span` states (plan_backward:
// only with the forward's O), per that many sets of them (threadIdx.x the lane, threadIdx.y the
// row's group in the block, rows over the x and, past 2^31 blocks, z grid axes).  For each chunk
// of the group's states: their LSEs and O_i packs are loaded together (the first chunk's before
// dO and O), then their LSEs give p_i; for each of the lane's packs the lane's part of each dot
// is summed and p_i dO stored; then the dots are summed over the row's lanes and the dlse stored;
// then the next chunk's loads go out.  A state's gradient address that is null (a two-way merge's
// gradient not asked for, the other's being) is not written.  The lane's first packs of dO and O
// are kept for every chunk: each is read once for rows of up to 32 packs (256 16-bit or 128
// float32 elements); wider rows read their further packs again for each chunk.  An empty part
// gets zeros, and a part of zero weight is loaded but not used (its O may hold NaN), as in the
// forward.  The N-way backward at 8192 tokens was measured issue-bound, not memory-bound (ncu,
// benchmarks/NOTES.md#backward-instructions), so instructions per state count: a strided row's addresses are stepped a
// chunk at a time, dO unpacked once, the dots of a chunk of two summed in half the shuffles.
template <typename Src, typename TIn, typename TOut, int VEC, int kChunk>
__global__ void __launch_bounds__(kBackwardBlockThreads, backward_min_blocks<Src, kChunk>())
    merge_backward_kernel(const MergeShape shape, const BackwardArgs<Src> args, const int group_shift, const int span) {
  using I = int64_t;
  pdl_wait_then_release();
  const I slot = (static_cast<I>(blockIdx.z) * gridDim.x + blockIdx.x) * blockDim.y + threadIdx.y;
  const I row = slot >> group_shift;
  if (row >= shape.rows) return;  // the row's lanes leave together
  I token, head;
  shape.split_row<Tiles::kNone>(row, token, head);
  const auto r = args.src.template row<TIn>(token, head);
  // Two-state rows are never split: their state indices stay constants (their pointers in registers).
  const bool split = Src::kMaxStates != 2 && group_shift != 0;
  const int group = static_cast<int>(slot & ((I{1} << group_shift) - 1));
  const int lo = split ? r.lo + group * span : r.lo;
  const int hi = split && r.hi - lo > span ? lo + span : r.hi;
  if (lo >= hi) return;  // a group past the row's states (all of the row's lanes alike)
  const int lane = static_cast<int>(threadIdx.x), lanes = static_cast<int>(blockDim.x);
  const unsigned warp_lane = (threadIdx.x + blockDim.x * threadIdx.y) & 31u;
  const unsigned mask = lanes == 32 ? 0xffffffffu : ((1u << lanes) - 1u) << (warp_lane & ~(lanes - 1u));
  const TOut* const d_out = args.grad_out.template o_at<TOut>(token, head);
  const TOut* const o_out = args.out.template o_at<TOut>(token, head);
  float lse = -INFINITY, dlse = 0.0f;
  if (r.has_out) {
    lse = args.out.lse_at(token, head);
    if (args.grad_out.lse != nullptr) dlse = args.grad_out.lse_at(token, head);
  }
  const GradWeights g(lse, dlse, shape.base2);
  const I packs = static_cast<I>(shape.packs);
  // Without the forward's O, <dO, O_i - O> is <dO, O_i> - sum_j p_j <dO, O_j> (one vector per row
  // less to read): the dots of a row of more than a chunk of states are stored raw, then
  // finished once the sum is known.
  const bool o_free = args.out.o == nullptr;
  // (o_free: one group per row; the kernel of 2 states in flight only for rows of at most 2 states,
  // which take one chunk: plan_backward, and launch_merge_backward refuses other plans.)
  const bool two_pass = kChunk > 2 && o_free && hi - lo > kChunk;
  float dot_o = 0.0f;  // <dO, O>, or the part of sum_j p_j <dO, O_j> seen so far
  // The lane that stores dlse of the chunk's state c: with two states per chunk the row's dots are
  // summed transposed (below), state 0's ending in its lower half of lanes, state 1's in its upper.
  const int half = lanes >> 1;
  const auto writer = [&](int c) { return kChunk == 2 ? c * half : c & (lanes - 1); };
  // The states' addresses: a two-state row's own pointers (its state indices are constants), or
  // a strided row's, stepped from the group's first state a chunk at a time (no multiplication
  // per state).
  auto in = r.in;
  auto grad = r.grad;
  constexpr bool kStrided = Src::kMaxStates != 2;
  // (A strided row's O pointers also start at the lane's first pack.)
  if constexpr (kStrided) {
    in.o0 = in.template o_at<TIn>(lo) + lane * VEC, in.l0 = in.lse_ptr(lo);
    grad.o0 = grad.o0 != nullptr ? grad.o_at(lo) + lane * VEC : nullptr, grad.l0 = grad.lse_at(lo);  // null: not asked for
  }
  // Pack k of the chunk's state c (c a constant), its O and where its dO goes.
  const auto o_of = [&](int c, I k) {
    return kStrided ? in.template o_at<TIn>(c) + (k - lane) * VEC : in.template o_at<TIn>(lo + c) + k * VEC;
  };
  const auto grad_o_of = [&](int c, I k) {
    TIn* const y = grad.o_at(kStrided ? c : lo + c);
    return y == nullptr ? y : kStrided ? y + (k - lane) * VEC : y + k * VEC;
  };
  const auto lse_of = [&](int c) { return in.lse(kStrided ? c : lo + c); };
  const auto grad_lse_of = [&](int c) { return grad.lse_at(kStrided ? c : lo + c); };
  // A chunk's LSEs and the O_i packs of the lane's first pack (relative to the chunk's first
  // state), all in flight before any is used (p after the loads): one memory round trip per chunk,
  // as in the forward.
  float l[kChunk];
  Pack<TIn, VEC> pi[kChunk];
  const auto load_chunk = [&](int s0, I k) {
    if (args.want_lse) {
#pragma unroll
      for (int c = 0; c < kChunk; ++c)
        if (s0 + c < hi) pi[c] = load_pack<TIn, VEC>(o_of(c, k), false);
    }
  };
  const auto load_lses = [&](int s0) {
#pragma unroll
    for (int c = 0; c < kChunk; ++c) l[c] = s0 + c < hi ? lse_of(c) : -INFINITY;
  };
  // L2 prefetches of the states' O past the chunk's: at the first chunk every chunk within reach,
  // later only the one that just came into it.
  const auto prefetch_ahead = [&](int s0) {
    if constexpr (ATTNMERGE_PREFETCH_BACKWARD != 0 && kStrided) {
      constexpr int kAhead = ATTNMERGE_PREFETCH_BACKWARD * kChunk;
      const int from = s0 == lo ? kChunk : kAhead;
      if (args.want_lse && lane < packs) {
#pragma unroll
        for (int c = kChunk; c < kAhead + kChunk; ++c) {
          if (c < from || s0 + c >= hi) continue;
          prefetch_l2(o_of(c, lane));
          if constexpr (ATTNMERGE_PREFETCH_BACKWARD_LSE != 0) {
            if (lane == 0) prefetch_l2(in.lse_ptr(c));
          }
        }
      }
    }
  };
  // The first chunk's loads go out before dO and O are read and unpacked.
  load_lses(lo);
  if (lane < packs) load_chunk(lo, lane);
  prefetch_ahead(lo);
  // The lane's first packs of dO and O as floats, kept for every chunk (read once for rows of up
  // to 32 packs; wider rows read their further packs again for each chunk).
  float gd[VEC] = {};
  Pack<TOut, VEC> go{};
  if (r.has_out && lane < packs) {
    const Pack<TOut, VEC> pd = load_pack<TOut, VEC>(d_out + lane * VEC, false);
    if (args.want_lse && !o_free) go = load_pack<TOut, VEC>(o_out + lane * VEC, false);
#pragma unroll
    for (int j = 0; j < VEC; ++j) gd[j] = pd.get(j);
  }
  for (int s0 = lo;;) {  // the chunk s0's loads are under way
    float p[kChunk], dot[kChunk];
    const auto load_states = [&](I k) { load_chunk(s0, k); };
#pragma unroll
    for (int c = 0; c < kChunk; ++c) {
      const float w = g.p(l[c]);
      p[c] = r.live(s0 + c) ? w : 0.0f;
      dot[c] = 0.0f;
    }
    // One pack of the row: the lane's part of each dot, and p_i dO stored (fma(p, dO, +0): +0,
    // not -0, where the product is zero; a part of zero weight gets zeros whatever dO holds).
    const auto use_pack = [&](I k, const float (&d)[VEC], const Pack<TOut, VEC>& o) {
#pragma unroll
      for (int c = 0; c < kChunk; ++c) {
        if (s0 + c >= hi) continue;
        if (args.want_lse) {
          float part = 0.0f;
#pragma unroll
          for (int j = 0; j < VEC; ++j) part += d[j] * (pi[c].get(j) - o.get(j));
          dot[c] += part;
        }
        TIn* const y = grad_o_of(c, k);
        if (args.want_o && y != nullptr) {
          float v[VEC];
#pragma unroll
          for (int j = 0; j < VEC; ++j) v[j] = fmaf(p[c], d[j], 0.0f);
          if (p[c] == 0.0f) {  // whatever dO holds
            const float zeros[VEC] = {};
            store_pack<TIn, VEC>(y, zeros, false);
          } else {
            store_pack<TIn, VEC>(y, v, false);
          }
        }
      }
    };
    if (lane < packs) use_pack(lane, gd, go);
    for (I k = lane + lanes; k < packs; k += lanes) {  // rows wider than 32 packs
      float d[VEC] = {};
      Pack<TOut, VEC> o{};
      if (r.has_out) {
        const Pack<TOut, VEC> pd = load_pack<TOut, VEC>(d_out + k * VEC, false);
        if (args.want_lse && !o_free) o = load_pack<TOut, VEC>(o_out + k * VEC, false);
#pragma unroll
        for (int j = 0; j < VEC; ++j) d[j] = pd.get(j);
      }
      load_states(k);
      use_pack(k, d, o);
    }
    if (args.want_lse) {
      if constexpr (kChunk == 2) {
        // Summed transposed: the lower half of the row's lanes keeps state 0's parts and takes
        // the upper half's, the upper half state 1's, then each half sums its own (half the
        // shuffles; each sum in the order the plain butterfly adds it).
        if (half > 0) {
          const bool upper = (lane & half) != 0;
          float mine = upper ? dot[1] : dot[0];
          mine += __shfl_xor_sync(mask, upper ? dot[0] : dot[1], half);
          for (int offset = half >> 1; offset > 0; offset >>= 1) mine += __shfl_xor_sync(mask, mine, offset);
          dot[0] = dot[1] = mine;
          if (o_free) {  // every lane's dot_o needs both sums
            const float theirs = __shfl_xor_sync(mask, mine, half);
            dot[0] = upper ? theirs : mine, dot[1] = upper ? mine : theirs;
          }
        }
      } else {
        for (int offset = half; offset > 0; offset >>= 1) {
#pragma unroll
          for (int c = 0; c < kChunk; ++c) dot[c] += __shfl_xor_sync(mask, dot[c], offset);
        }
      }
      if (o_free) {
#pragma unroll
        for (int c = 0; c < kChunk; ++c) dot_o += p[c] != 0.0f ? p[c] * dot[c] : 0.0f;
      }
#pragma unroll
      for (int c = 0; c < kChunk; ++c)
        if (s0 + c < hi && lane == writer(c)) {
          float* const q = grad_lse_of(c);
          if (q != nullptr) *q = two_pass ? dot[c] : g.grad_lse(p[c], dot[c] - dot_o);
        }
    }
    s0 += kChunk;
    if (s0 >= hi) break;
    if constexpr (kStrided) {
      in.o0 = in.template o_at<TIn>(kChunk), in.l0 = in.lse_ptr(kChunk);
      grad.o0 = grad.o_at(kChunk), grad.l0 = grad.lse_at(kChunk);
    }
    load_lses(s0);
    if (lane < packs) load_chunk(s0, lane);
    prefetch_ahead(s0);
  }
  if (two_pass && args.want_lse) {  // each lane finishes the dots it stored
    const auto again = args.src.template row<TIn>(token, head);  // (not kept in registers all along)
    for (int s0 = lo; s0 < hi; s0 += kChunk) {
#pragma unroll
      for (int c = 0; c < kChunk; ++c) {
        const int s = s0 + c;
        float* const q = s < hi && lane == writer(c) ? again.grad.lse_at(s) : nullptr;
        if (q != nullptr) *q = g.grad_lse(again.live(s) ? g.p(again.in.lse(s)) : 0.0f, *q - dot_o);
      }
    }
  }
}

// What plan_backward needs to know of a call beyond its shape, read off its arguments: the
// elements per vector access (`vec`) and PDL are the caller's.
template <typename Src>
inline BackwardFacts backward_facts(const BackwardArgs<Src>& args, int vec, bool pdl) {
  BackwardFacts facts;
  facts.vec = vec;
  facts.max_states = max_states(args.src);
  facts.saved_o = args.out.o != nullptr;
  facts.pdl = pdl;
  return facts;
}

// Whether `plan` can run `args`: the kernel of 2 states in flight only where plan_backward's rule
// allows it (two_states_in_flight: it has no second pass); a plan made for other facts is
// refused, not run wrong.
template <typename Src>
inline bool backward_plan_fits(const BackwardPlan& plan, const BackwardArgs<Src>& args) {
  return plan.chunk != 2 || two_states_in_flight(backward_facts(args, plan.vec, plan.pdl));
}

// The backward as `plan` (plan_backward of the same call) says.  TIn: the storage type of the
// inputs' O and of their gradients; TOut: that of the forward's output and of its gradient dO;
// VEC = plan.vec.
template <typename TIn, typename TOut, int VEC, typename Src>
cudaError_t launch_merge_backward(const BackwardPlan& plan, const BackwardArgs<Src>& args, cudaStream_t stream) {
  if (plan.launches == 0) return cudaSuccess;
  if (!backward_plan_fits(plan, args)) return cudaErrorInvalidValue;
  void (*kernel)(MergeShape, BackwardArgs<Src>, int, int) = nullptr;
  if constexpr (Src::kMaxStates == 2) {
    kernel = merge_backward_kernel<Src, TIn, TOut, VEC, 2>;
  } else {
    kernel = plan.chunk == 2 ? merge_backward_kernel<Src, TIn, TOut, VEC, 2>
                             : merge_backward_kernel<Src, TIn, TOut, VEC, kSmallChunk>;
  }
  return launch_kernel(kernel, plan.dims, plan.pdl, stream, plan.shape, args, plan.group_shift, plan.span);
}

}  // namespace attnmerge
