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
// in packs of VEC elements.  Each thread computes its row's weights itself: a few instructions
// against 2 x VEC x sizeof(TIn) bytes read, with no shared memory or barrier.  The first O packs
// are fetched before the weights are known, so that their latency overlaps the LSE loads; a
// zero-weight part is then dropped without being used.  Rows past a_tokens never touch a.
// Few registers per thread matter more than anything else here: they set how many loads are in
// flight per multiprocessor.
template <typename TIn, typename TOut, int VEC>
__global__ void __launch_bounds__(kBlockThreads, ATTNMERGE_MIN_BLOCKS_PER_SM) merge2_kernel(const MergeParams p) {
  const int64_t packs = p.head_size / VEC;
  const int64_t rows = p.tokens * p.heads;
  const int64_t row_step = static_cast<int64_t>(gridDim.x) * blockDim.y;
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y; row < rows; row += row_step) {
    int64_t token, head;
    p.split_row(row, token, head);
    const bool has_a = token < p.a_tokens;
    const TIn* a = p.a.o_at<TIn>(token, head);
    const TIn* b = p.b.o_at<TIn>(token, head);
    int64_t k = threadIdx.x;
    Pack<TIn, VEC> pa = has_a ? load_pack<TIn, VEC>(a + k * VEC) : Pack<TIn, VEC>{};
    Pack<TIn, VEC> pb = load_pack<TIn, VEC>(b + k * VEC);
    const float la = has_a ? p.a.lse_at(token, head) : -INFINITY;
    const float lb = p.b.lse_at(token, head);
    RowMerge r(p.base2);
    r.add(la);
    r.add(lb);
    const float sa = r.scale(la), sb = r.scale(lb);
    TOut* out = p.out_at<TOut>(token, head);
    while (true) {
      float acc[VEC] = {};
      accumulate(acc, pa, sa);
      accumulate(acc, pb, sb);
      store_pack<TOut, VEC>(out + k * VEC, acc, r.nan);
      k += blockDim.x;
      if (k >= packs) break;
      pa = has_a ? load_pack<TIn, VEC>(a + k * VEC) : Pack<TIn, VEC>{};
      pb = load_pack<TIn, VEC>(b + k * VEC);
    }
    if (threadIdx.x == 0) p.store_lse(token, head, r.lse());
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

template <typename TIn, typename TOut, int VEC>
cudaError_t launch_merge2(const MergeParams& p, cudaStream_t stream) {
  const int64_t rows = p.tokens * p.heads;
  if (rows == 0) return cudaSuccess;
  cudaLaunchConfig_t config = {};
  config.stream = stream;
  merge_launch_shape(p.head_size / VEC, rows, config.gridDim, config.blockDim);
  return cudaLaunchKernelEx(&config, merge2_kernel<TIn, TOut, VEC>, p);
}

}  // namespace attnmerge
