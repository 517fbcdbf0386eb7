// Header-only CUDA kernels of attnmerge and their launchers.  A C++/CUDA program may include this
// directly; the launchers validate nothing (libattnmerge's C ABI does) and return the launch's
// cudaError_t.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "attnmerge/merge_params.h"

namespace attnmerge {

#ifndef ATTNMERGE_BLOCK_THREADS
#define ATTNMERGE_BLOCK_THREADS 256
#endif
#ifndef ATTNMERGE_STATE_CHUNK
#define ATTNMERGE_STATE_CHUNK 8
#endif
#ifndef ATTNMERGE_NWAY_MIN_BLOCKS
#define ATTNMERGE_NWAY_MIN_BLOCKS 3
#endif
constexpr int kBlockThreads = ATTNMERGE_BLOCK_THREADS;
// States of the N-way and variable-length merges whose LSE and O loads a thread keeps in flight
// at once: 8 moves a row of up to 8 states in one memory round trip.
constexpr int kStateChunk = ATTNMERGE_STATE_CHUNK;

// Blocks per SM the compiler must leave room for: 3 caps the N-way kernels at 85 registers
// (measured on an H200: S = 8 in 141 us against 154 us uncapped at 96, and 159 us with 4 states
// a chunk).  The two-way kernel needs 32 registers, full occupancy, and no cap.
template <typename Source>
constexpr int min_blocks() {
  return Source::kMaxStates == 2 ? 1 : ATTNMERGE_NWAY_MIN_BLOCKS;
}

// The weights of a row's states into `r` (see, weigh, finish: row.h): `l` holds the LSEs of
// the first kChunk states (-inf past n), their weights go to `w`; the LSEs of later states are
// read again from `states`.  Shared by merge_kernel and merge_lse_kernel.
template <int kChunk, typename Row>
__device__ __forceinline__ void weigh_row(const Row& states, int n, const float (&l)[kChunk], float (&w)[kChunk],
                                          float factor, RowMerge& r) {
#pragma unroll
  for (int c = 0; c < kChunk; ++c) r.see(l[c]);
  for (int s = kChunk; s < n; s += kChunk) {
    float m[kChunk];
#pragma unroll
    for (int c = 0; c < kChunk; ++c) m[c] = s + c < n ? states.lse(s + c) : -INFINITY;
#pragma unroll
    for (int c = 0; c < kChunk; ++c) r.see(m[c]);
  }
#pragma unroll
  for (int c = 0; c < kChunk; ++c) {
    w[c] = r.weight(l[c]);
    r.total += w[c];
  }
  for (int s = kChunk; s < n; s += kChunk) {
    float m[kChunk];
#pragma unroll
    for (int c = 0; c < kChunk; ++c) m[c] = s + c < n ? states.lse(s + c) : -INFINITY;
#pragma unroll
    for (int c = 0; c < kChunk; ++c) r.total += r.weight(m[c]);
  }
  r.finish(factor);
}

// The row (token, head) of this thread, and programmatic dependent launch: wait for the kernel
// before us (a no-op unless launched with it), then let the kernel after us be scheduled into our
// tail.  With I = int32_t the grid has no z extent (rows < 2^31) and these products fit.
template <typename I>
__device__ __forceinline__ I launch_row() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;");
#endif
  return (static_cast<I>(blockIdx.z) * static_cast<I>(gridDim.x) + static_cast<I>(blockIdx.x)) *
             static_cast<I>(blockDim.y) + static_cast<I>(threadIdx.y);
}

// The (token, head) of a row; false for a row past the last tile's tokens.  A plain source's
// launch is untiled: no tile step, no such rows.
template <typename Source, typename I>
__device__ __forceinline__ bool locate_row(const MergeShape& shape, I row, I& token, I& head) {
  if constexpr (Source::kPlain) {
    shape.split_row<false>(row, token, head);
    return true;
  } else {
    shape.split_row(row, token, head);
    return token < static_cast<I>(shape.tokens);
  }
}

// Work: rows (token, head) over threadIdx.y and the x (and, past 2^31 blocks, z) grid axes; the
// head_size axis over threadIdx.x in packs of VEC elements, and over the y grid axis where a row
// has more packs than a block has threads.  Each thread handles one pack of one row, with no
// shared memory.  The kernel is as lean in instructions as in registers: at the HBM roofline an
// SM retires a thread every few cycles, so every instruction per thread counts.
//
// A thread takes its row's states from the source and computes their weights itself.  States
// come kChunk at a time, the LSEs and O packs of a chunk all loaded before any is used and without
// a branch between them (a source gives every state of a row an O address it may read), so that a
// row of up to kChunk states costs one memory round trip; a zero-weight part is then dropped
// without being used.  Rows of more states first walk their LSEs (max and total weight), then
// their O packs with the LSEs again.  The output scale and a NaN LSE are folded into the
// weights, so the O path is one multiply-add per element and state.
template <typename Source, typename TIn, typename TOut, int VEC, typename I>
__global__ void __launch_bounds__(kBlockThreads, min_blocks<Source>())
    merge_kernel(const MergeShape shape, const Source src, const OutView out) {
  constexpr int kChunk = Source::kMaxStates == 2 ? 2 : kStateChunk;
  using P = Pack<TIn, VEC>;
  const I row = launch_row<I>();
  const I k = static_cast<I>(blockIdx.y) * static_cast<I>(blockDim.x) + static_cast<I>(threadIdx.x);
  // rows and packs fit in I (int32_t only for calls of fewer than 2^30 elements an array)
  if (row >= static_cast<I>(shape.rows) || k >= static_cast<I>(shape.packs)) return;
  I token, head;
  if (!locate_row<Source>(shape, row, token, head)) return;
  const auto states = src.template row<TIn>(token, head);
  const int n = states.count();
  const bool stream = Source::kStream < 0 ? shape.stream : Source::kStream == 1;
  // The first chunk: every load in flight at once.
  float l[kChunk];
  P o[kChunk];
#pragma unroll
  for (int c = 0; c < kChunk; ++c) {
    l[c] = c < n ? states.lse(c) : -INFINITY;  // -inf: no weight, no NaN
    if (c < n) o[c] = load_pack<TIn, VEC>(states.template o_at<TIn>(c) + k * VEC, stream);
  }
  // Where the results go, worked out while the loads are in flight: at decode sizes a merge
  // lasts as long as its longest chain of dependent instructions, and everything after the loads
  // is on it.
  TOut* const dst = out.o_at<TOut>(token, head) + k * VEC;
  float* const lse_dst = k == 0 ? out.lse_at(token, head) : nullptr;
  if (states.skip()) return;
  float w[kChunk];
  RowMerge r(shape.base2);
  weigh_row<kChunk>(states, n, l, w, Source::kPlain ? out.inv_scale : out.inverse_scale(), r);
  if (lse_dst != nullptr) *lse_dst = r.lse();  // its latency hidden behind the O math
  float acc[VEC] = {};
#pragma unroll
  for (int c = 0; c < kChunk; ++c)
    if (c < n) accumulate(acc, o[c], r.scale(w[c]));
  for (int s = kChunk; s < n; s += kChunk) {  // the other chunks' O packs, with their LSEs again
    float m[kChunk];
#pragma unroll
    for (int c = 0; c < kChunk; ++c) {
      m[c] = s + c < n ? states.lse(s + c) : -INFINITY;
      if (s + c < n) o[c] = load_pack<TIn, VEC>(states.template o_at<TIn>(s + c) + k * VEC, stream);
    }
#pragma unroll
    for (int c = 0; c < kChunk; ++c)
      if (s + c < n) accumulate(acc, o[c], r.scale(r.weight(m[c])));
  }
  store_pack<TOut, VEC>(dst, acc, stream);
}

// The merged LSEs alone, one thread per row: the second launch of a merge whose out_lse is also
// an input's LSE (every thread of a row in merge_kernel reads the row's LSEs, so none may write it
// there).  O and its dtypes play no part.
template <typename Source, typename I>
__global__ void __launch_bounds__(kBlockThreads)
    merge_lse_kernel(const MergeShape shape, const Source src, const OutView out) {
  constexpr int kChunk = Source::kMaxStates == 2 ? 2 : kStateChunk;
  const I row = launch_row<I>();
  if (row >= static_cast<I>(shape.rows)) return;
  I token, head;
  if (!locate_row<Source>(shape, row, token, head)) return;
  const auto states = src.template row<float>(token, head);
  if (states.skip()) return;
  const int n = states.count();
  float l[kChunk], w[kChunk];
#pragma unroll
  for (int c = 0; c < kChunk; ++c) l[c] = c < n ? states.lse(c) : -INFINITY;
  RowMerge r(shape.base2);
  weigh_row<kChunk>(states, n, l, w, 1.0f, r);
  out.store_lse(token, head, r.lse());
}

// Grid and block for `packs` vector accesses per row over `rows` rows (see merge_kernel).  Blocks
// are kBlockThreads wide unless that leaves SMs idle (`sms`, the GPU's count, 0: unknown): a
// decode-sized merge is spread over more SMs, down to blocks of 128 threads.  On an H200 at 1 and
// 16 tokens x 32 x 128, 128-thread blocks were 0.15 us faster than 256 and as fast as 32 or 64,
// with fewer blocks (benchmarks/native/decode_latency, NOTES.md).
constexpr int kMinBlockThreads = 128;
inline void merge_launch_shape(int64_t packs, int64_t rows, int sms, dim3& grid, dim3& block) {
  int threads = kBlockThreads;
  const int64_t total = packs * rows;
  while (threads > kMinBlockThreads && (total + threads - 1) / threads < sms) threads /= 2;
  const int bx = static_cast<int>(std::min<int64_t>(packs, threads));
  const int by = std::max(1, threads / bx);
  const int64_t row_blocks = (rows + by - 1) / by;
  const int64_t max_x = (int64_t{1} << 31) - 1;
  const int64_t gx = std::min(row_blocks, max_x);
  block = dim3(bx, by, 1);
  grid = dim3(static_cast<unsigned>(gx), static_cast<unsigned>((packs + bx - 1) / bx),
              static_cast<unsigned>((row_blocks + gx - 1) / gx));
}

// How to launch: the GPU's SM count (0: unknown, blocks of kBlockThreads) and programmatic
// dependent launch (sm_90 and newer only; see ATTNMERGE_PDL in attnmerge.h).
struct LaunchOptions {
  int sms = 0;
  bool pdl = false;
};

// Evict-first O accesses, as measured on an H200 against plain ones: 5 to 13% faster for two-way
// merges moving 3 to 13 MB, for the N-way merge of S = 64 and for the variable-length merge; 2
// to 6% slower for two-way merges of 51 to 818 MB and for S = 8.
template <typename Source>
bool stream_o(const MergeShape& shape, const Source& src) {
  if constexpr (std::is_same<Source, RangeSource>::value) {
    return true;
  } else if constexpr (std::is_same<Source, StackSource>::value) {
    if (src.states > kStateChunk) return true;
  }
  return shape.bytes < (int64_t{32} << 20);
}

// A launch of `kernel` over `packs` threads per row, with the launch options.
template <typename Source>
cudaError_t launch(void (*kernel)(MergeShape, Source, OutView), const MergeShape& shape, const Source& src,
                   const OutView& out, cudaStream_t stream, LaunchOptions options) {
  cudaLaunchConfig_t config = {};
  config.stream = stream;
  merge_launch_shape(shape.packs, shape.rows, options.sms, config.gridDim, config.blockDim);
  cudaLaunchAttribute attribute;
  if (options.pdl) {
    attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attribute.val.programmaticStreamSerializationAllowed = 1;
    config.attrs = &attribute;
    config.numAttrs = 1;
  }
  return cudaLaunchKernelEx(&config, kernel, shape, src, out);
}

// The merge: O and, unless out.lse is null, the merged LSEs.
template <typename Source, typename TIn, typename TOut, int VEC, typename I>
cudaError_t launch_merge(MergeShape shape, const Source& src, const OutView& out, cudaStream_t stream,
                         LaunchOptions options = {}) {
  if (shape.rows == 0) return cudaSuccess;
  shape.packs = shape.head_size / VEC;
  shape.stream = stream_o(shape, src);
  return launch(merge_kernel<Source, TIn, TOut, VEC, I>, shape, src, out, stream, options);
}

// The merged LSEs alone (out.o is not written).
template <typename Source, typename I>
cudaError_t launch_merge_lse(MergeShape shape, const Source& src, const OutView& out, cudaStream_t stream,
                             LaunchOptions options = {}) {
  if (shape.rows == 0) return cudaSuccess;
  shape.packs = 1;
  return launch(merge_lse_kernel<Source, I>, shape, src, out, stream, options);
}

}  // namespace attnmerge
