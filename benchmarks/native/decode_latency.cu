// What a decode-sized two-way merge costs by CUDA-graph replay, against what any launch and any
// one-pack-per-thread merge cost on the same GPU (T x 32 x 128 bfloat16, T = 1, 16, 128, 512, 32
// rotating input sets):
//   library          the two-way merge as the library plans it (plan_merge: the plain kernel,
//                    as the C ABI runs it), and the same kernel in blocks of 32, 64 and 256
//                    threads (w32, w64, w256);
//   minimal merge    a merge with nothing general about it (fixed shape, contiguous [T, H, D] O and
//                    [H, T] LSE, no NaN or empty-part handling beyond the formula, 1-D blocks of 128),
//                    and the same in 2-D blocks of (16, 8) and (16, 2) threads: the floor for a merge;
//   empty kernel     with 8 and 1024 bytes of parameters: the floor for any launch.
// Every variant's graph is replayed in turn, round after round, and the medians are printed: timed
// one after another, the same kernel moved by up to 0.2 us with its place in the sequence.  To
// compare two versions of the kernels, build this against each version's headers and run the two
// alternately.  Figures in benchmarks/NOTES.md.
#include <attnmerge/merge_kernels.cuh>
#include <cuda_bf16.h>

#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "common.h"

using namespace attnmerge;

namespace {

constexpr int kHeads = 32, kHeadSize = 128, kPacks = kHeadSize / 8;

// One 16-byte pack of one row per thread; the LSE layout is [heads, tokens], as vLLM's.
template <bool k2D>
__global__ void minimal_merge(uint4* out, float* out_lse, const uint4* a, const float* lse_a, const uint4* b,
                              const float* lse_b, unsigned tokens) {
  const unsigned g = k2D ? (blockIdx.x * blockDim.y + threadIdx.y) * kPacks + threadIdx.x : blockIdx.x * 128 + threadIdx.x;
  if (g >= tokens * kHeads * kPacks) return;
  const unsigned row = g / kPacks, token = row / kHeads, head = row % kHeads;
  const float la = lse_a[head * tokens + token], lb = lse_b[head * tokens + token];
  const uint4 pa = a[g], pb = b[g];
  const float m = fmaxf(la, lb), wa = __expf(la - m), wb = __expf(lb - m), total = wa + wb;
  const float sa = wa / total, sb = wb / total;
  const __nv_bfloat16* ha = reinterpret_cast<const __nv_bfloat16*>(&pa);
  const __nv_bfloat16* hb = reinterpret_cast<const __nv_bfloat16*>(&pb);
  uint4 r;
  __nv_bfloat16* hr = reinterpret_cast<__nv_bfloat16*>(&r);
#pragma unroll
  for (int i = 0; i < 8; ++i) hr[i] = __float2bfloat16(__bfloat162float(ha[i]) * sa + __bfloat162float(hb[i]) * sb);
  out[g] = r;
  if (g % kPacks == 0) out_lse[head * tokens + token] = __logf(total) + m;
}

template <int N>
struct Blob {
  int64_t v[N / 8];
};

template <int N>
__global__ void empty_kernel(const Blob<N> b) {
  if (b.v[0] == 12345 && threadIdx.x == 1000) asm volatile("trap;");  // reads a parameter, never true
}

struct Contender {
  std::string name;
  std::function<void(int)> launch;
  cudaGraphExec_t exec = nullptr;
  std::vector<double> us;
};

// Every variant's `calls` launches captured in one graph; then `rounds` rounds, each replaying
// every graph once (timed by events); the medians, us per launch.
void round_robin(std::vector<Contender>& vs, cudaStream_t s, int calls = 100, int rounds = 11) {
  for (Contender& v : vs) {
    for (int i = 0; i < 3; ++i) v.launch(i);
    cudaGraph_t graph;
    check_cuda(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), "begin capture");
    for (int i = 0; i < calls; ++i) v.launch(i);
    check_cuda(cudaStreamEndCapture(s, &graph), "end capture");
    check_cuda(cudaGraphInstantiate(&v.exec, graph, 0), "instantiate");
    cudaGraphDestroy(graph);
  }
  cudaEvent_t start, end;
  check_cuda(cudaEventCreate(&start), "event");
  check_cuda(cudaEventCreate(&end), "event");
  for (int r = 0; r < rounds; ++r)
    for (Contender& v : vs) {
      check_cuda(cudaEventRecord(start, s), "record");
      check_cuda(cudaGraphLaunch(v.exec, s), "replay");
      check_cuda(cudaEventRecord(end, s), "record");
      check_cuda(cudaEventSynchronize(end), "synchronize");
      float ms = 0;
      check_cuda(cudaEventElapsedTime(&ms, start, end), "elapsed");
      if (r > 0) v.us.push_back(ms * 1e3 / calls);  // round 0 warms up
    }
  cudaEventDestroy(start);
  cudaEventDestroy(end);
  for (Contender& v : vs) cudaGraphExecDestroy(v.exec);
}

}  // namespace

int main() {
  if (!have_gpu("decode_latency")) return 1;
  cudaDeviceProp prop;
  check_cuda(cudaGetDeviceProperties(&prop, 0), "properties");
  cudaStream_t s;
  check_cuda(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream");
  const int sms = prop.multiProcessorCount;
  std::printf("%s: T x 32 x 128 bfloat16, us per launch by graph replay, variants round-robin (median)\n", prop.name);
  for (int tokens : {1, 16, 128, 512}) {
    const size_t o_bytes = size_t(tokens) * kHeads * kHeadSize * 2, lse_bytes = size_t(tokens) * kHeads * 4;
    std::vector<PairSet> sets = alloc_pair_sets(32, o_bytes, lse_bytes);
    const int64_t bytes = 3 * int64_t(o_bytes + lse_bytes);
    const int64_t st = kHeads * kHeadSize;
    const unsigned threads = unsigned(tokens) * kHeads * kPacks;  // one pack of one row each
    std::vector<Contender> vs;
    // The library's kernel in blocks of the width its plan picks, and of fixed widths (the SM
    // count is what narrows the blocks of a small grid: see row_dims).
    const auto library = [&](const char* name, int width) {
      vs.push_back({name, [&, width](int i) {
        const PairSet& x = sets[i % 32];
        const MergeShape shape{tokens, kHeads, kHeadSize, false};
        const PairSource src{StateView{x.o_a, st, kHeadSize, x.lse_a, 1, tokens},
                             StateView{x.o_b, st, kHeadSize, x.lse_b, 1, tokens}, tokens, nullptr, 0};
        const OutView dst{x.out, st, kHeadSize, x.out_lse, 1, tokens, 1.0f, nullptr, false};
        const LaunchPlan plan = bf16_plan(shape, src, dst, bytes, width == 0 ? sms : int(std::max(1u, threads / width)));
        check_cuda(launch_bf16(plan, src, dst, s), name);
      }});
    };
    library("library", 0);
    library("w32", 32);
    library("w64", 64);
    library("w256", 256);
    const auto minimal = [&](const char* name, int by) {  // by: rows a 2-D block holds, 0 for 1-D blocks
      vs.push_back({name, [&, by](int i) {
        const PairSet& x = sets[i % 32];
        uint4* out = static_cast<uint4*>(x.out);
        const uint4 *a = static_cast<const uint4*>(x.o_a), *b = static_cast<const uint4*>(x.o_b);
        if (by == 0)
          minimal_merge<false><<<(threads + 127) / 128, 128, 0, s>>>(out, x.out_lse, a, x.lse_a, b, x.lse_b, tokens);
        else
          minimal_merge<true><<<(threads + 16 * by - 1) / (16 * by), dim3(16, by), 0, s>>>(out, x.out_lse, a, x.lse_a, b,
                                                                                           x.lse_b, tokens);
      }});
    };
    minimal("minimal merge", 0);
    minimal("minimal (16,8)", 8);
    minimal("minimal (16,2)", 2);
    vs.push_back({"empty 8 B", [&](int) { empty_kernel<8><<<1, 32, 0, s>>>(Blob<8>{}); }});
    vs.push_back({"empty 1024 B", [&](int) { empty_kernel<1024><<<1, 32, 0, s>>>(Blob<1024>{}); }});
    round_robin(vs, s);
    std::printf("%5d tokens (%6.2f MB):", tokens, bytes / 1e6);
    for (Contender& v : vs) std::printf(" | %s %.2f", v.name.c_str(), median(v.us));
    std::printf("\n");
    free_pair_sets(sets);
  }
  return 0;
}
