// Header-only CUDA kernels of the exchange fused with the merge (attnmerge.h's "Context parallelism
// on one node") and their launchers: the publish, one block that signals every rank, and the merge,
// whose blocks wait for every rank's state, read their rows of each where it lies and write the
// merged rows, then (Reuse::kWaitReaders) tell every rank that its state has been read.  The
// protocol's steps are exchange.h's, the row math row.h's, the loads and stores pack.h's.  Like
// merge_kernels.cuh, a C++/CUDA program may include this directly; the launchers validate nothing.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "attnmerge/exchange.h"
#include "attnmerge/merge_kernels.cuh"

namespace attnmerge {

// The merged pack `acc` stored at element `at` of row (token, head) of `out`, as `dtype` (read at
// run time: one kernel per input dtype and width serves every output dtype, a uniform branch per
// thread).
template <int VEC, typename I>
__device__ __forceinline__ void store_as(Dtype dtype, const OutView& out, I token, I head, I at,
                                         const float (&acc)[VEC]) {
  switch (dtype) {
    case Dtype::kFloat32: return store_pack<float, VEC>(out.o_at<float>(token, head, at), acc, false);
    case Dtype::kFloat16: return store_pack<half_t, VEC>(out.o_at<half_t>(token, head, at), acc, false);
    case Dtype::kBFloat16: return store_pack<bfloat16_t, VEC>(out.o_at<bfloat16_t>(token, head, at), acc, false);
    default: return store_pack<float8_e4m3_t, VEC>(out.o_at<float8_e4m3_t>(token, head, at), acc, false);
  }
}

// A thread's pack of its row (`mine`), merged from every rank's state and stored, once every rank
// has published (merge_exchange_kernel's step 2): the ranks' LSEs and packs a chunk at a time, every
// load of a chunk in flight at once (kChunked), as merge_kernel's rows (the same semantics: an empty
// part is not read, a NaN LSE makes the row NaN, an all-empty row gives O = 0 and LSE = -inf); or,
// where the call has PeerExtras (kSettled), one rank at a time, each LSE settled (its softmax sum,
// its valid entry: PeerExtrasRow::settled) before its O load goes out, the ranks a chunk ahead
// prefetched into L1, as merge_body's rows with StateExtras.
template <StateRead kRead, typename TIn, int VEC, typename I, typename States>
__device__ __forceinline__ void merge_exchange_row(const MergeShape& shape, const ExchangeSource& src,
                                                   const OutView& out, Dtype out_dtype, I token, I head, I k,
                                                   const States& states) {
  constexpr bool kSettled = kRead == StateRead::kSettled;
  constexpr int kC = kSettled ? 1 : kStateChunk;
  const int n = states.count();
  const auto extras = extras_row_if<kSettled>(src, token, head);
  const auto settle = [&](float (&lc)[kC], int first) {
    if constexpr (kSettled) {
      // The rank a chunk ahead, or `first` past the last: the ranks' pointers are kMaxWorld
      // entries, and no index past them is formed.
      const bool go = first + kPrefetchAhead < n;
      const int ahead = go ? first + kPrefetchAhead : first;
      extras.prefetch(ahead, go);
      prefetch_if(states.template o_at<TIn>(ahead), go);
      lc[0] = extras.settled(first, first < n, shape.base2);
    }
  };
  float l[kC];
  Pack<TIn, VEC> o[kC];
  if constexpr (kSettled) {
#pragma unroll 1
    for (int s = 1; s < kPrefetchAhead; ++s) {  // the ranks before settle's first prefetch
      extras.prefetch(s, s < n);
      prefetch_if(states.template o_at<TIn>(s), s < n);
    }
    settle(l, 0);
    o[0] = load_pack_if<TIn, VEC>(states.template o_at<TIn>(0), 0 < n, false);
  } else {
#pragma unroll
    for (int c = 0; c < kC; ++c) {
      l[c] = load_lse_if(states.lse_ptr(c), c < n);
      o[c] = load_pack_if<TIn, VEC>(states.template o_at<TIn>(c), c < n, false);
    }
  }
  const float sink = src.sink.at(head);  // -inf without one
  RowMerge r(shape.base2);
  float acc[VEC];
  if (n <= kC) {  // one round trip, the weights from the row's own max
    float w[kC];
    weigh_row<kC, true>(l, w, out.inverse_scale(), r, sink);
#pragma unroll
    for (int i = 0; i < VEC; ++i) acc[i] = r.nan ? NAN : 0.0f;  // a NaN sink has no O to carry it
#pragma unroll
    for (int c = 0; c < kC; ++c)
      if (c < n) accumulate(acc, o[c], r.scale(w[c]), w[c]);
  } else {
#pragma unroll
    for (int i = 0; i < VEC; ++i) acc[i] = 0.0f;
    accumulate_online<kC, true, kRead>(
        n, l, o, [&](int s) { return states.lse_ptr(s); }, [&](int s) { return states.template o_at<TIn>(s); },
        false, r, acc, sink, settle);
    r.finish(out.inverse_scale());
#pragma unroll
    for (int i = 0; i < VEC; ++i) acc[i] *= r.inv;
  }
  store_as<VEC>(out_dtype, out, token, head, k * VEC, acc);
  if (k == 0) out.store_lse(token, head, r.lse());
}

// The merge of an exchange, laid out as kRows (plan_exchange): one thread per pack of a row.
//   1. Every block waits until every rank has published its state of the epoch (exchange.h's
//      await_states: thread p of the block waits for rank p), the block's verdict met at one
//      barrier, its rows' first lines prefetched into L2 meanwhile; a block that gives up (a failure
//      recorded: a timeout, a stale epoch, or an earlier call's) reads and writes nothing.
//   2. Each thread merges its pack of its row (merge_exchange_row): the ranks' states as LSEs, or
//      with their softmax sums and valid entries (PeerExtras), one uniform branch between the two.
//   3. Reuse::kWaitReaders: each block counts itself in this rank's pad once its rows are read;
//      the last one resets the count, tells every rank that its state has been read and waits
//      until every rank has read this one's (signal_read, await_readers).
// Every thread reaches every barrier: none leaves early.
template <typename TIn, int VEC>
__global__ void __launch_bounds__(kBlockThreads)
    merge_exchange_kernel(const MergeShape shape, const ExchangeSource src, const OutView out,
                          const exchange::Sync sync, const Dtype out_dtype) {
  using I = int64_t;
  const I row = launch_row<I>();  // after the kernel before this one, under PDL
  const I k = static_cast<I>(blockIdx.y) * static_cast<I>(blockDim.x) + static_cast<I>(threadIdx.x);
  const int lane = static_cast<int>(threadIdx.y * blockDim.x + threadIdx.x);
  const int lanes = static_cast<int>(blockDim.x * blockDim.y);
  const bool mine = row < static_cast<I>(shape.rows) && k < static_cast<I>(shape.packs);
  I token = 0, head = 0;
  if (mine) shape.split_row<Tiles::kNone>(row, token, head);
  const auto states = src.template row<TIn>(token, head, k * VEC);  // read only where mine
  const int n = states.count();
  // The first chunk's lines asked of L2 while the block waits: a prefetch reads no value, and L2 is
  // where memory is coherent (a GPU's own, for its memory; a peer's is served by the peer's), so the
  // loads after the wait find what the ranks published, one round trip sooner.
  if (mine) {
#pragma unroll
    for (int c = 0; c < kStateChunk; ++c) {
      if (c < n) prefetch_l2(states.template o_at<TIn>(c));
      if (c < n && k == 0) prefetch_l2(states.lse_ptr(c));
    }
  }
  uint64_t epoch = 0;
  const bool gave_up = !exchange::await_states(sync, lane, lanes, exchange::clock_ns(), epoch);
  const bool ready = __syncthreads_or(gave_up) == 0;
  if (ready && mine) {
    if (src.extras.on) {
      merge_exchange_row<StateRead::kSettled, TIn, VEC>(shape, src, out, out_dtype, token, head, k, states);
    } else {
      merge_exchange_row<StateRead::kChunked, TIn, VEC>(shape, src, out, out_dtype, token, head, k, states);
    }
  }
  if (sync.reuse == exchange::Reuse::kWaitReaders) {
    __syncthreads();  // every row of the block has been read: its stores used them
    bool last = false;
    if (lane == 0) {
      const uint64_t blocks = uint64_t{gridDim.x} * gridDim.y * gridDim.z;
      last = exchange::fetch_add(sync.own() + exchange::kArrivals, 1) + 1 == blocks;
    }
    if (__syncthreads_or(last)) {  // the last block of the merge to have read its rows
      if (lane == 0) sync.own()[exchange::kArrivals] = 0;  // for the next merge, after this one on the stream
      const bool told = exchange::signal_read(sync, lane, lanes, epoch);
      __syncthreads();  // every rank told before any lane waits
      if (told) exchange::await_readers(sync, lane, lanes, epoch);
    }
  }
}

// The publish of an exchange: one block of one warp; every lane reads the pad's last epoch before
// lane 0 writes the new one, then the lanes signal every rank (exchange.h's publish).  Nothing
// where the pad records a failure.
__global__ void __launch_bounds__(32) exchange_publish_kernel(const exchange::Sync sync) {
  pdl_wait_then_release();  // the state's writes, by the kernels before this one, are done
  const uint64_t published = exchange::load_relaxed(sync.own() + exchange::kPublished);
  const uint64_t failure = exchange::load_relaxed(sync.own() + exchange::kFailure);
  __syncwarp();
  if (failure == 0) exchange::publish(sync, published, static_cast<int>(threadIdx.x), static_cast<int>(blockDim.x));
}

// The merge as `plan` (plan_exchange of the same call) says.  TIn: the ranks' O dtype; VEC =
// plan.vec; out's dtype is `out_dtype`.
template <typename TIn, int VEC>
cudaError_t launch_exchange(const LaunchPlan& plan, const ExchangeSource& src, const OutView& out,
                            const exchange::Sync& sync, Dtype out_dtype, cudaStream_t stream) {
  if (plan.variant != Variant::kExchange || plan.vec != VEC) return cudaErrorInvalidValue;
  return launch_kernel(merge_exchange_kernel<TIn, VEC>, plan.main, plan.pdl, stream, plan.shape, src, out, sync,
                       out_dtype);
}

// The publish, with programmatic dependent launch where `pdl` (its block waits for the kernel
// before it all the same).
inline cudaError_t launch_publish(const exchange::Sync& sync, bool pdl, cudaStream_t stream) {
  LaunchDims dims;
  dims.grid[0] = dims.grid[1] = dims.grid[2] = 1;
  dims.block[0] = 32, dims.block[1] = dims.block[2] = 1;
  return launch_kernel(exchange_publish_kernel, dims, pdl, stream, sync);
}

}  // namespace attnmerge
