// Header-only CUDA kernels of attnmerge and their launchers.  A C++/CUDA program may include this
// directly; the launchers validate nothing (libattnmerge's C ABI does) and return the launch's
// cudaError_t.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "attnmerge/merge_params.h"

namespace attnmerge {

#ifndef ATTNMERGE_BLOCK_THREADS
#define ATTNMERGE_BLOCK_THREADS 256
#endif
#ifndef ATTNMERGE_MIN_BLOCKS_PER_SM
#define ATTNMERGE_MIN_BLOCKS_PER_SM 1
#endif
#ifndef ATTNMERGE_STATE_CHUNK
#define ATTNMERGE_STATE_CHUNK 2
#endif
constexpr int kBlockThreads = ATTNMERGE_BLOCK_THREADS;
// States of the N-way and variable-length merges whose O loads a thread keeps in flight at once.
constexpr int kStateChunk = ATTNMERGE_STATE_CHUNK;

// Work: rows (token, head) over threadIdx.y and the x (and, past 2^31 blocks, z) grid axes; the
// head_size axis over threadIdx.x in packs of VEC elements, and over the y grid axis where a row
// has more packs than a block has threads.  Each thread handles one pack of one row, with no loop
// and no shared memory: few registers per thread, which sets how many loads are in flight.  It
// takes its row's states from the source and computes their weights itself (a few instructions
// per state against VEC x sizeof(TIn) bytes read).  The O packs of the first kChunk states are
// fetched before the weights are known, so that their latency overlaps the LSE loads; a
// zero-weight part is then dropped without being used.
template <typename Source, typename TIn, typename TOut, int VEC>
__global__ void __launch_bounds__(kBlockThreads, ATTNMERGE_MIN_BLOCKS_PER_SM)
    merge_kernel(const MergeShape shape, const Source src, const OutView out) {
  constexpr int kChunk = Source::kMaxStates == 2 ? 2 : kStateChunk;
  using P = Pack<TIn, VEC>;
  const int64_t row = (static_cast<int64_t>(blockIdx.z) * gridDim.x + blockIdx.x) * blockDim.y + threadIdx.y;
  const int64_t k = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  if (row >= shape.tokens * shape.heads || k >= shape.head_size / VEC) return;
  int64_t token, head;
  shape.split_row(row, token, head);
  const typename Source::Row states = src.template row<TIn>(token, head);
  if (states.skip()) return;
  const int n = states.count();
  P first[kChunk];
#pragma unroll
  for (int c = 0; c < kChunk; ++c)
    first[c] = c < n && states.present(c) ? load_pack<TIn, VEC>(states.template o_at<TIn>(c) + k * VEC) : P{};
  RowMerge r(shape.base2);
  for (int s = 0; s < n; ++s) r.add(states.lse(s));
  float acc[VEC] = {};
#pragma unroll
  for (int c = 0; c < kChunk; ++c)
    if (c < n) accumulate(acc, first[c], r.scale(states.lse(c)));
  for (int s = kChunk; s < n; s += kChunk) {  // the rest, kChunk loads in flight at a time
    P more[kChunk];
#pragma unroll
    for (int c = 0; c < kChunk; ++c)
      more[c] = s + c < n ? load_pack<TIn, VEC>(states.template o_at<TIn>(s + c) + k * VEC) : P{};
#pragma unroll
    for (int c = 0; c < kChunk; ++c)
      if (s + c < n) accumulate(acc, more[c], r.scale(states.lse(s + c)));
  }
  store_pack<TOut, VEC>(out.o_at<TOut>(token, head) + k * VEC, acc, out.inverse_scale(), r.nan);
  if (k == 0) out.store_lse(token, head, r.lse());
}

// Grid and block for `packs` vector accesses per row over `rows` rows (see merge_kernel).
inline void merge_launch_shape(int64_t packs, int64_t rows, dim3& grid, dim3& block) {
  const int bx = static_cast<int>(std::min<int64_t>(packs, kBlockThreads));
  const int by = std::max(1, kBlockThreads / bx);
  const int64_t row_blocks = (rows + by - 1) / by;
  const int64_t max_x = (int64_t{1} << 31) - 1;
  const int64_t gx = std::min(row_blocks, max_x);
  block = dim3(bx, by, 1);
  grid = dim3(static_cast<unsigned>(gx), static_cast<unsigned>((packs + bx - 1) / bx),
              static_cast<unsigned>((row_blocks + gx - 1) / gx));
}

template <typename Source, typename TIn, typename TOut, int VEC>
cudaError_t launch_merge(const MergeShape& shape, const Source& src, const OutView& out, cudaStream_t stream) {
  const int64_t rows = shape.tokens * shape.heads;
  if (rows == 0) return cudaSuccess;
  cudaLaunchConfig_t config = {};
  config.stream = stream;
  merge_launch_shape(shape.head_size / VEC, rows, config.gridDim, config.blockDim);
  return cudaLaunchKernelEx(&config, merge_kernel<Source, TIn, TOut, VEC>, shape, src, out);
}

}  // namespace attnmerge
