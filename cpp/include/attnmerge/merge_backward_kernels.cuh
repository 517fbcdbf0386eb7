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

// Registers (sm_90): a chunk of 4 states keeps the chunk's LSEs, 4 packs of O_i with their
// 64-bit addresses and dots, and the lane's first packs of dO and O: 70 to 114 uncapped (108 for
// bfloat16 in 16-byte packs), so the N-way cap is 2 blocks of 256 an SM (128 registers, no
// spills; at 3 blocks, 85 registers, up to 208 bytes spilled).  A chunk of 8 needed 135 to 140.
// Two states: 46 to 64, no spills, 4 blocks an SM (N-way rows of two states: 3 blocks, whose
// strided addresses spill at 64).  ATTNMERGE_BACKWARD_MIN_BLOCKS overrides the
// N-way cap: an A/B knob for the native benchmark (neither setting measured yet).
#ifndef ATTNMERGE_BACKWARD_MIN_BLOCKS
#define ATTNMERGE_BACKWARD_MIN_BLOCKS 2
#endif
// How many chunks ahead a lane asks L2 (prefetch_l2) for its packs of the states' O before it
// uses the current chunk (0: none), and whether the lane of the row's first pack asks for their
// LSEs too: A/B knobs for the native benchmark.
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
// of the group's states: their LSEs and O_i packs are loaded together (dO and O with the first
// chunk), then their LSEs give p_i; for
// each of the lane's packs the lane's part of each dot is summed and p_i dO stored; then the dots
// are summed over the row's lanes and the dlse stored.  A state's gradient address that is null (a two-way merge's
// gradient not asked for, the other's being) is not written.  The lane's first packs of dO and O
// are kept for every chunk: each is read once for rows of up to 32 packs (256 16-bit or 128
// float32 elements); wider rows read their further packs again for each chunk.  An empty part
// gets zeros, and a part of zero weight is loaded but not used (its O may hold NaN), as in the
// forward.  64-bit offsets: the backward moves 2S + 2 vectors a row, so the index arithmetic
// should not be on its critical path (not measured against 32-bit yet).
template <typename Src, typename TIn, typename TOut, int VEC, int kChunk>
__global__ void __launch_bounds__(kBackwardBlockThreads, backward_min_blocks<Src, kChunk>())
    merge_backward_kernel(const MergeShape shape, const BackwardArgs<Src> args, const int group_shift, const int span) {
  using I = int64_t;
  pdl_wait_then_release();
  const I slot = (static_cast<I>(blockIdx.z) * gridDim.x + blockIdx.x) * blockDim.y + threadIdx.y;
  const I row = slot >> group_shift;
  if (row >= shape.rows) return;  // the row's lanes leave together
  I token, head;
  shape.split_row<false>(row, token, head);
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
  // Without the forward's O, <dO, O_i - O> is <dO, O_i> - sum_j p_j <dO, O_j> (one vector a row
  // less to read): the dots of a row of more than a chunk of states are stored raw, then
  // finished once the sum is known.
  const bool o_free = args.out.o == nullptr;
  const bool two_pass = o_free && hi - lo > kChunk;  // o_free: one group a row (plan_backward)
  float dot_o = 0.0f;  // <dO, O>, or the part of sum_j p_j <dO, O_j> seen so far
  // The lane's first packs of dO and O, kept for every chunk (loaded with the first chunk's).
  Pack<TOut, VEC> pd0{}, po0{};
  if (r.has_out && lane < packs) {
    pd0 = load_pack<TOut, VEC>(d_out + lane * VEC, false);
    if (args.want_lse && !o_free) po0 = load_pack<TOut, VEC>(o_out + lane * VEC, false);
  }
  for (int s0 = lo; s0 < hi; s0 += kChunk) {
    // The chunk's LSEs and the O_i packs of the lane's first pack, all in flight before any is
    // used (p after the loads): one memory round trip a chunk, as in the forward.
    float l[kChunk], p[kChunk], dot[kChunk];
    Pack<TIn, VEC> pi[kChunk];
#pragma unroll
    for (int c = 0; c < kChunk; ++c) l[c] = s0 + c < hi ? r.in.lse(s0 + c) : -INFINITY;
    const auto load_states = [&](I k) {
      if (args.want_lse) {
#pragma unroll
        for (int c = 0; c < kChunk; ++c)
          if (s0 + c < hi) pi[c] = load_pack<TIn, VEC>(r.in.template o_at<TIn>(s0 + c) + k * VEC, false);
      }
    };
    if (lane < packs) load_states(lane);
    if constexpr (ATTNMERGE_PREFETCH_BACKWARD != 0) {
      // At the first chunk every chunk within reach; later only the one that just came into it.
      constexpr int kAhead = ATTNMERGE_PREFETCH_BACKWARD * kChunk;
      const int from = s0 == lo ? kChunk : kAhead;
      if (args.want_lse && lane < packs) {
#pragma unroll
        for (int c = kChunk; c < kAhead + kChunk; ++c) {
          if (c < from || s0 + c >= hi) continue;
          prefetch_l2(r.in.template o_at<TIn>(s0 + c) + lane * VEC);
          if constexpr (ATTNMERGE_PREFETCH_BACKWARD_LSE != 0 && Src::kMaxStates != 2) {
            if (lane == 0) prefetch_l2(r.in.lse_ptr(s0 + c));
          }
        }
      }
    }
#pragma unroll
    for (int c = 0; c < kChunk; ++c) {
      p[c] = r.live(s0 + c) ? g.p(l[c]) : 0.0f;
      dot[c] = 0.0f;
    }
    // One pack of the row: the lane's part of each dot, and p_i dO stored.
    const auto use_pack = [&](I k, const Pack<TOut, VEC>& pd, const Pack<TOut, VEC>& po) {
#pragma unroll
      for (int c = 0; c < kChunk; ++c) {
        if (s0 + c >= hi) continue;
        if (args.want_lse) {
          float part = 0.0f;
#pragma unroll
          for (int j = 0; j < VEC; ++j) part += pd.get(j) * (pi[c].get(j) - po.get(j));
          dot[c] += part;
        }
        TIn* const y = r.grad.o_at(s0 + c);
        if (args.want_o && y != nullptr) {
          float v[VEC];
#pragma unroll
          for (int j = 0; j < VEC; ++j) v[j] = GradWeights::grad_o(p[c], pd.get(j));
          store_pack<TIn, VEC>(y + k * VEC, v, false);
        }
      }
    };
    if (lane < packs) use_pack(lane, pd0, po0);
    for (I k = lane + lanes; k < packs; k += lanes) {  // rows wider than 32 packs
      Pack<TOut, VEC> pd{}, po{};
      if (r.has_out) {
        pd = load_pack<TOut, VEC>(d_out + k * VEC, false);
        if (args.want_lse && !o_free) po = load_pack<TOut, VEC>(o_out + k * VEC, false);
      }
      load_states(k);
      use_pack(k, pd, po);
    }
    if (args.want_lse) {
      for (int offset = lanes >> 1; offset > 0; offset >>= 1) {
#pragma unroll
        for (int c = 0; c < kChunk; ++c) dot[c] += __shfl_xor_sync(mask, dot[c], offset);
      }
      if (o_free) {
#pragma unroll
        for (int c = 0; c < kChunk; ++c) dot_o += p[c] != 0.0f ? p[c] * dot[c] : 0.0f;
      }
#pragma unroll
      for (int c = 0; c < kChunk; ++c)
        if (s0 + c < hi && lane == c % lanes) {
          float* const q = r.grad.lse_at(s0 + c);
          if (q != nullptr) *q = two_pass ? dot[c] : g.grad_lse(p[c], dot[c] - dot_o);
        }
    }
  }
  if (two_pass && args.want_lse) {  // each lane finishes the dots it stored
    for (int s0 = lo; s0 < hi; s0 += kChunk) {
#pragma unroll
      for (int c = 0; c < kChunk; ++c) {
        const int s = s0 + c;
        float* const q = s < hi && lane == c % lanes ? r.grad.lse_at(s) : nullptr;
        if (q != nullptr) *q = g.grad_lse(r.live(s) ? g.p(r.in.lse(s)) : 0.0f, *q - dot_o);
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

// The backward as `plan` (plan_backward of the same call) says.  TIn: the storage type of the
// inputs' O and of their gradients; TOut: that of the forward's output and of its gradient dO;
// VEC = plan.vec.
template <typename TIn, typename TOut, int VEC, typename Src>
cudaError_t launch_merge_backward(const BackwardPlan& plan, const BackwardArgs<Src>& args, cudaStream_t stream) {
  if (plan.launches == 0) return cudaSuccess;
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
