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
constexpr int kBlockThreads = ATTNMERGE_BLOCK_THREADS;

// Rows (token, head) are spread over threadIdx.y and the grid; the head_size axis over threadIdx.x
// in packs of VEC elements.  Each thread takes its row's states from the source and computes their
// weights itself (a few instructions per state against VEC x sizeof(TIn) bytes read), with no
// shared memory or barrier.  The O packs of the first kChunk states are fetched before the weights
// are known, so that their latency overlaps the LSE loads; a zero-weight part is then dropped
// without being used.  Few registers per thread matter: they set how many loads are in flight.
template <typename Source, typename TIn, typename TOut, int VEC>
__global__ void __launch_bounds__(kBlockThreads, ATTNMERGE_MIN_BLOCKS_PER_SM)
    merge_kernel(const MergeShape shape, const Source src, const OutView out) {
  constexpr int kChunk = Source::kMaxStates == 2 ? 2 : 4;
  using P = Pack<TIn, VEC>;
  const int64_t packs = shape.head_size / VEC;
  const int64_t rows = shape.tokens * shape.heads;
  const int64_t row_step = static_cast<int64_t>(gridDim.x) * blockDim.y;
  const float inv_scale = out.inverse_scale();
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y; row < rows; row += row_step) {
    int64_t token, head;
    shape.split_row(row, token, head);
    const typename Source::Row states = src.template row<TIn>(token, head);
    if (states.skip()) continue;
    const int n = states.count();
    int64_t k = threadIdx.x;
    P first[kChunk];
#pragma unroll
    for (int c = 0; c < kChunk; ++c)
      first[c] = c < n && states.present(c) ? load_pack<TIn, VEC>(states.template o_at<TIn>(c) + k * VEC) : P{};
    RowMerge r(shape.base2);
    for (int s = 0; s < n; ++s) r.add(states.lse(s));
    TOut* dst = out.o_at<TOut>(token, head);
    while (true) {
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
      store_pack<TOut, VEC>(dst + k * VEC, acc, inv_scale, r.nan);
      k += blockDim.x;
      if (k >= packs) break;
#pragma unroll
      for (int c = 0; c < kChunk; ++c)
        first[c] = c < n && states.present(c) ? load_pack<TIn, VEC>(states.template o_at<TIn>(c) + k * VEC) : P{};
    }
    if (threadIdx.x == 0) out.store_lse(token, head, r.lse());
  }
}

// Block shape for `packs` vector accesses per row: one row per threadIdx.y.
inline void merge_launch_shape(int64_t packs, int64_t rows, dim3& grid, dim3& block) {
  const int bx = static_cast<int>(std::min<int64_t>(packs, kBlockThreads));
  const int by = std::max(1, kBlockThreads / bx);
  const int64_t blocks = (rows + by - 1) / by;
  block = dim3(bx, by, 1);
  grid = dim3(static_cast<unsigned>(std::min<int64_t>(blocks, int64_t{1} << 30)), 1, 1);
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
