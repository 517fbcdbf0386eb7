// Shared by the native benchmarks: CUDA error checks, the library's plan for a call, and timers.
#pragma once

#include <cuda_runtime.h>

#include "attnmerge/merge_kernels.cuh"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

inline void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

// A well-mixed 32-bit hash of an element index: benchmark inputs with no two rows alike.
__host__ __device__ inline uint32_t hash_index(uint64_t i, uint32_t seed) {
  uint32_t h = uint32_t(i) * 2654435761u ^ seed;
  h ^= h >> 15;
  h *= 2246822519u;
  h ^= h >> 13;
  return h;
}

// The float value of bfloat16 bits (host side: checking a benchmark's output).
inline float bf16_to_float(uint16_t b) {
  const uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Whether a CUDA device is visible; says so (as `program`) when not.
inline bool have_gpu(const char* program) {
  int count = 0;
  if (cudaGetDeviceCount(&count) == cudaSuccess && count > 0) return true;
  std::printf("%s: no CUDA device\n", program);
  return false;
}

// The buffers of one two-way merge of bfloat16 O: inputs filled (O ~0.011, LSE 0), outputs not.
struct PairSet {
  void *o_a, *o_b, *out;
  float *lse_a, *lse_b, *out_lse;
};

// `count` sets of `o_bytes` per O and `lse_bytes` per LSE (rotated so that inputs exceed L2).
inline std::vector<PairSet> alloc_pair_sets(int64_t count, size_t o_bytes, size_t lse_bytes) {
  std::vector<PairSet> sets(count);
  for (PairSet& s : sets) {
    for (void** p : {&s.o_a, &s.o_b, &s.out}) check_cuda(cudaMalloc(p, o_bytes), "cudaMalloc");
    for (float** p : {&s.lse_a, &s.lse_b, &s.out_lse}) check_cuda(cudaMalloc(p, lse_bytes), "cudaMalloc");
    for (void* p : {s.o_a, s.o_b}) check_cuda(cudaMemset(p, 0x3c, o_bytes), "cudaMemset");  // bf16 ~0.011
    for (float* p : {s.lse_a, s.lse_b}) check_cuda(cudaMemset(p, 0, lse_bytes), "cudaMemset");
  }
  return sets;
}

inline void free_pair_sets(std::vector<PairSet>& sets) {
  for (PairSet& s : sets)
    for (void* p : {s.o_a, s.o_b, s.out, static_cast<void*>(s.lse_a), static_cast<void*>(s.lse_b),
                    static_cast<void*>(s.out_lse)})
      cudaFree(p);
  sets.clear();
}

// The plan the C ABI makes for a call with bfloat16 O (16-byte accesses unless `access_bytes` says
// otherwise, 32-bit offsets) on an sm_90 GPU of `sms` SMs (0: blocks of the default width), moving
// `bytes` (which decides evict-first accesses).  Benchmarks launch it with launch_bf16, and may
// change a field first to time an alternative.
template <typename Source>
attnmerge::LaunchPlan bf16_plan(const attnmerge::MergeShape& shape, const Source& src, const attnmerge::OutView& out,
                                int64_t bytes, int sms, bool pdl = false, bool lse_tokens_inner = false,
                                int access_bytes = 16) {
  attnmerge::CallFacts facts;
  facts.in = facts.out = attnmerge::Dtype::kBFloat16;
  facts.vec = 8;
  facts.access_bytes = access_bytes;
  facts.bytes = bytes;
  facts.pdl = pdl;
  facts.lse_tokens_inner = lse_tokens_inner;
  return attnmerge::plan_merge(shape, src, out, facts, attnmerge::DeviceInfo{sms, 9});
}

// A bf16_plan's launch (bfloat16 in and out): the kernel of the plan's elements a thread, one
// 16-byte access or (two-state sources) two.
template <typename Source>
cudaError_t launch_bf16(const attnmerge::LaunchPlan& plan, const Source& src, const attnmerge::OutView& out,
                        cudaStream_t stream) {
  using attnmerge::bfloat16_t;
  if constexpr (Source::Traits::kMaxStates == 2) {
    if (plan.vec == 16) return attnmerge::launch_merge<bfloat16_t, bfloat16_t, 16>(plan, src, out, stream);
  }
  return attnmerge::launch_merge<bfloat16_t, bfloat16_t, 8>(plan, src, out, stream);
}

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Host time per call of `call`, us: the median over 15 batches of 200 calls, nothing waited for
// inside a batch.
template <typename F>
double host_us(F&& call, cudaStream_t stream) {
  constexpr int kBatch = 200, kBatches = 15;
  for (int i = 0; i < 50; ++i) call();
  check_cuda(cudaStreamSynchronize(stream), "synchronize");
  std::vector<double> us;
  for (int b = 0; b < kBatches; ++b) {
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < kBatch; ++i) call();
    const auto end = std::chrono::steady_clock::now();
    check_cuda(cudaStreamSynchronize(stream), "synchronize");
    us.push_back(std::chrono::duration<double, std::micro>(end - start).count() / kBatch);
  }
  return median(us);
}

// GPU time per call of `call(i)`, us, by CUDA-graph replay: `calls` calls captured in one graph
// (i = 0 .. calls-1, for rotating inputs), the median of 7 replays timed by events.
template <typename F>
double graph_us(F&& call, cudaStream_t stream, int calls = 50) {
  for (int i = 0; i < 3; ++i) call(i);
  check_cuda(cudaStreamSynchronize(stream), "warm-up");
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  check_cuda(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "begin capture");
  for (int i = 0; i < calls; ++i) call(i);
  check_cuda(cudaStreamEndCapture(stream, &graph), "end capture");
  check_cuda(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
  cudaEvent_t start, end;
  check_cuda(cudaEventCreate(&start), "event");
  check_cuda(cudaEventCreate(&end), "event");
  check_cuda(cudaGraphLaunch(exec, stream), "replay");
  std::vector<double> us;
  for (int r = 0; r < 7; ++r) {
    check_cuda(cudaEventRecord(start, stream), "record");
    check_cuda(cudaGraphLaunch(exec, stream), "replay");
    check_cuda(cudaEventRecord(end, stream), "record");
    check_cuda(cudaEventSynchronize(end), "synchronize");
    float ms = 0;
    check_cuda(cudaEventElapsedTime(&ms, start, end), "elapsed");
    us.push_back(ms * 1e3 / calls);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(end);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  return median(us);
}
