// How fast any streaming kernel moves 2 reads + 1 write at the chunk and long sizes, beside the
// library's two-way merge: is what separates a merge from the roofline at 12.8 and 51 MB in the
// merge, or in the GPU?  T x 32 x 128 bfloat16, T = 512 to 32768, input sets rotated past L2,
// CUDA-graph replay, every variant timed in turn three times (medians of 7 replays each):
//   library      the two-way merge as the library plans it (plan_merge: the plain kernel, as the
//                C ABI runs it; [tokens, heads] LSEs; its own choice of evict-first accesses);
//   minimal      a two-way merge with nothing general about it (fixed head size, contiguous O
//                and LSE, 1-D blocks of 256, one 16-byte pack per thread);
//   add          c = (a + b) / 2 on the O arrays alone (1.5% fewer bytes than a merge), one pack
//                per thread in blocks of 256 or 1024 threads, 2 or 4 packs per thread, with the
//                L2::256B prefetch hint, as a persistent grid (8 blocks per SM, the next step's
//                loads issued before this step's stores), and through TMA bulk copies (one thread
//                asks for a block's 4 or 8 KB of each input, the block adds in shared memory, one
//                bulk store).
// Each variant's output is compared with its reference (the add's or the library's) bit for bit
// first.  Figures in benchmarks/NOTES.md.
#include <attnmerge/merge_kernels.cuh>

#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "common.h"

using namespace attnmerge;

namespace {

constexpr int64_t kHeads = 32, kHeadSize = 128, kPacks = kHeadSize / 8;

// bfloat16 values of +-[2^-7, 2^-5) from a hash of the index: no two rows alike.
__global__ void fill(uint16_t* p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const uint32_t h = hash_index(i, seed);
    p[i] = uint16_t(0x3c00u | (h & 0x1ffu) | ((h >> 16) & 0x8000u));
  }
}

__device__ __forceinline__ uint32_t half_sum(uint32_t a, uint32_t b) {
  const float lo = __uint_as_float(a << 16) * 0.5f + __uint_as_float(b << 16) * 0.5f;
  const float hi = __uint_as_float(a & 0xffff0000u) * 0.5f + __uint_as_float(b & 0xffff0000u) * 0.5f;
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}
__device__ __forceinline__ uint4 half_sum(uint4 a, uint4 b) {
  return make_uint4(half_sum(a.x, b.x), half_sum(a.y, b.y), half_sum(a.z, b.z), half_sum(a.w, b.w));
}

__device__ __forceinline__ uint4 load_prefetch_256(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

// U packs per thread, blockDim apart (coalesced), every load issued before any store.
template <int U, bool kPrefetch>
__global__ void add_packs(const uint4* a, const uint4* b, uint4* c, int n) {
  const int base = blockIdx.x * blockDim.x * U + threadIdx.x;
  uint4 x[U], y[U];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int i = base + u * blockDim.x;
    if (i < n) {
      x[u] = kPrefetch ? load_prefetch_256(a + i) : a[i];
      y[u] = kPrefetch ? load_prefetch_256(b + i) : b[i];
    }
  }
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int i = base + u * blockDim.x;
    if (i < n) c[i] = half_sum(x[u], y[u]);
  }
}

// A grid-stride loop; the next step's loads are in flight while this step's result is stored.
__global__ void add_persistent(const uint4* a, const uint4* b, uint4* c, int n) {
  const int stride = gridDim.x * blockDim.x;
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  uint4 x = {}, y = {};
  if (i < n) x = a[i], y = b[i];
  while (i < n) {
    const int next = i + stride;
    uint4 x2 = {}, y2 = {};
    if (next < n) x2 = a[next], y2 = b[next];
    c[i] = half_sum(x, y);
    x = x2, y = y2, i = next;
  }
}

// TMA bulk copies of kChunk bytes per input per block (n a multiple of kChunk / 16).
template <int kChunk>
__global__ void __launch_bounds__(128) add_bulk(const uint4* a, const uint4* b, uint4* c) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(128) uint4 tile[];
  __shared__ __align__(8) uint64_t barrier;
  const uint32_t sa = static_cast<uint32_t>(__cvta_generic_to_shared(tile));
  const uint32_t sbar = static_cast<uint32_t>(__cvta_generic_to_shared(&barrier));
  const int64_t base = int64_t(blockIdx.x) * (kChunk / 16);
  if (threadIdx.x == 0) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(sbar));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(sbar), "r"(2 * kChunk) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(sa),
                 "l"(a + base), "r"(kChunk), "r"(sbar)
                 : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                     sa + kChunk),
                 "l"(b + base), "r"(kChunk), "r"(sbar)
                 : "memory");
  }
  __syncthreads();  // the barrier is initialized before anyone waits on it
  asm volatile(
      "{\n .reg .pred p;\n WAIT_%=:\n mbarrier.try_wait.parity.shared::cta.b64 p, [%0], 0;\n @!p bra WAIT_%=;\n}\n" ::"r"(sbar)
      : "memory");
  for (int i = threadIdx.x; i < kChunk / 16; i += blockDim.x) tile[i] = half_sum(tile[i], tile[kChunk / 16 + i]);
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // our writes, visible to the bulk store
  __syncthreads();
  if (threadIdx.x == 0) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(c + base), "r"(sa), "r"(kChunk)
                 : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");  // shared memory read before the block exits
  }
#endif
}

// The minimal two-way merge: the library's row math (row.h) and element steps, nothing general.
__global__ void __launch_bounds__(256) minimal_merge(const uint4* oa, const float* la, const uint4* ob, const float* lb,
                                                     uint4* oc, float* lc, int rows) {
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  const int row = t / kPacks, k = t % kPacks;
  if (row >= rows) return;
  const float l0 = la[row], l1 = lb[row];
  const uint4 x = oa[t], y = ob[t];
  RowMerge r(false);
  r.see(l0);
  r.see(l1);
  const float w0 = r.weight(l0), w1 = r.weight(l1);
  r.total = w0 + w1;
  r.finish(1.0f);
  if (k == 0) lc[row] = r.lse();
  Pack<bfloat16_t, 8> p, q;
  p.w[0] = x.x, p.w[1] = x.y, p.w[2] = x.z, p.w[3] = x.w;
  q.w[0] = y.x, q.w[1] = y.y, q.w[2] = y.z, q.w[3] = y.w;
  float acc[8] = {};
  accumulate(acc, p, r.scale(w0), w0);
  accumulate(acc, q, r.scale(w1), w1);
  store_pack<bfloat16_t, 8>(reinterpret_cast<bfloat16_t*>(oc + t), acc, false);
}

struct Contender {
  std::string name;
  bool merge;  // moves the LSEs too (else only O), and is checked against the library
  std::function<void(const PairSet&)> run;
  std::vector<double> us;
};

}  // namespace

int main() {
  if (!have_gpu("stream_ceiling")) return 1;
  cudaDeviceProp prop;
  check_cuda(cudaGetDeviceProperties(&prop, 0), "properties");
  const int sms = prop.multiProcessorCount;
  cudaStream_t stream;
  check_cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  std::printf("%s (%d SMs, %d MB L2): T x 32 x 128 bfloat16, us by graph replay (median of 3 rounds), GB/s\n", prop.name,
              sms, prop.l2CacheSize >> 20);
  for (int64_t tokens : {512, 1024, 2048, 4096, 8192, 32768}) {
    const size_t o_bytes = tokens * kHeads * kHeadSize * 2, lse_bytes = tokens * kHeads * 4;
    const int64_t bytes = 3 * int64_t(o_bytes + lse_bytes);
    const int64_t count = std::max<int64_t>(2, std::min<int64_t>(32, (int64_t{512} << 20) / bytes));
    std::vector<PairSet> sets = alloc_pair_sets(count, o_bytes, lse_bytes);
    uint32_t seed = 1;
    for (PairSet& s : sets) {
      check_cuda(cudaMemset(s.lse_b, 0x3f, lse_bytes), "cudaMemset");  // ~0.75 against 0: unequal weights
      fill<<<1024, 256, 0, stream>>>(static_cast<uint16_t*>(s.o_a), o_bytes / 2, seed++);
      fill<<<1024, 256, 0, stream>>>(static_cast<uint16_t*>(s.o_b), o_bytes / 2, seed++);
    }
    check_cuda(cudaStreamSynchronize(stream), "fill");
    const int n = static_cast<int>(o_bytes / 16), rows = static_cast<int>(tokens * kHeads);
    const auto o = [](void* p) { return static_cast<uint4*>(p); };
    std::vector<Contender> vs;
    vs.push_back({"library", true, [&](const PairSet& s) {
                    const MergeShape shape{tokens, kHeads, kHeadSize, false};
                    const int64_t st = kHeads * kHeadSize;
                    const PairSource src{StateView{s.o_a, st, kHeadSize, s.lse_a, kHeads, 1},
                                         StateView{s.o_b, st, kHeadSize, s.lse_b, kHeads, 1}, tokens, nullptr, 0};
                    const OutView dst{s.out, st, kHeadSize, s.out_lse, kHeads, 1, 1.0f, nullptr, false};
                    check_cuda(launch_bf16(bf16_plan(shape, src, dst, bytes, sms), src, dst, stream),
                               "library");
                  }});
    vs.push_back({"minimal merge", true, [&](const PairSet& s) {
                    minimal_merge<<<(n + 255) / 256, 256, 0, stream>>>(o(s.o_a), s.lse_a, o(s.o_b), s.lse_b, o(s.out),
                                                                       s.out_lse, rows);
                  }});
    const auto add = [&](const char* name, auto kernel, int threads, int per_thread) {
      vs.push_back({name, false, [&, kernel, threads, per_thread](const PairSet& s) {
                      const int blocks = (n + threads * per_thread - 1) / (threads * per_thread);
                      kernel<<<blocks, threads, 0, stream>>>(o(s.o_a), o(s.o_b), o(s.out), n);
                    }});
    };
    add("add, 256 threads", add_packs<1, false>, 256, 1);  // the reference of the adds
    add("add, 1024 threads", add_packs<1, false>, 1024, 1);
    add("add, 2 packs each", add_packs<2, false>, 256, 2);
    add("add, 4 packs each", add_packs<4, false>, 256, 4);
    add("add, L2::256B hint", add_packs<1, true>, 256, 1);
    vs.push_back({"add, persistent", false, [&](const PairSet& s) {
                    add_persistent<<<sms * 8, 256, 0, stream>>>(o(s.o_a), o(s.o_b), o(s.out), n);
                  }});
    if (prop.major >= 9) {  // TMA: sm_90 and newer
    vs.push_back({"add, TMA 4 KB", false, [&](const PairSet& s) {
                    add_bulk<4096><<<n / 256, 128, 2 * 4096, stream>>>(o(s.o_a), o(s.o_b), o(s.out));
                  }});
    vs.push_back({"add, TMA 8 KB", false, [&](const PairSet& s) {
                    add_bulk<8192><<<n / 512, 128, 2 * 8192, stream>>>(o(s.o_a), o(s.o_b), o(s.out));
                  }});
    }
    // Every variant against its reference, on set 0, outputs poisoned first.
    std::vector<uint16_t> ref_merge(o_bytes / 2), ref_add(o_bytes / 2), got(o_bytes / 2);
    for (size_t v = 0; v < vs.size(); ++v) {
      check_cuda(cudaMemsetAsync(sets[0].out, 0xff, o_bytes, stream), "poison");
      vs[v].run(sets[0]);
      check_cuda(cudaStreamSynchronize(stream), vs[v].name.c_str());
      std::vector<uint16_t>& dst = v == 0 ? ref_merge : v == 2 ? ref_add : got;
      check_cuda(cudaMemcpy(dst.data(), sets[0].out, o_bytes, cudaMemcpyDeviceToHost), "copy");
      if (v != 0 && v != 2 && got != (vs[v].merge ? ref_merge : ref_add))
        std::printf("  %s: OUTPUT DIFFERS from its reference\n", vs[v].name.c_str());
    }
    for (int round = 0; round < 3; ++round)
      for (Contender& v : vs) v.us.push_back(graph_us([&](int i) { v.run(sets[i % count]); }, stream));
    check_cuda(cudaGetLastError(), "launches");
    std::printf("%6lld tokens: merge %.1f MB, add %.1f MB, %lld sets\n", static_cast<long long>(tokens), bytes / 1e6,
                3 * o_bytes / 1e6, static_cast<long long>(count));
    for (Contender& v : vs) {
      const double us = median(v.us);
      std::printf("  %-20s %9.2f us %6.0f GB/s\n", v.name.c_str(), us, (v.merge ? bytes : 3.0 * o_bytes) / us / 1e3);
    }
    free_pair_sets(sets);
  }
  return 0;
}
