// The N-way merge's two strategies side by side (plan.h): kRows (one thread per pack walks a row's
// states, 8 or 4 in flight, blocks of up to 256 or of 128 threads) against kStates with 2 to 16
// groups of threads a row, and the plan's own choice with and without evict-first accesses, by
// CUDA-graph replay through the header-only launcher on T x S x 32 x 128 states ([tokens, S,
// heads, D], FlashInfer's layout) with bfloat16 or float32 partials into a bfloat16 output, input
// sets rotated past L2.  Each variant's output is compared with kRows' (max |difference| of O and
// LSE over the whole output, random inputs).  Figures go to benchmarks/NOTES.md.
#include <attnmerge/merge_kernels.cuh>

#include <array>
#include <cmath>
#include <cstring>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "common.h"

using namespace attnmerge;

namespace {

constexpr int64_t kHeads = 32, kHeadSize = 128;

// Values from a hash of the index: O in [-1, 1), LSE in [-4, 4).
__global__ void fill_o(uint16_t* bf16, float* f32, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float v = float(hash_index(i, seed) & 0xffff) / 32768.0f - 1.0f;
    if (bf16) bf16[i] = uint16_t(__float_as_uint(v) >> 16);
    if (f32) f32[i] = v;
  }
}
__global__ void fill_lse(float* lse, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    lse[i] = float(hash_index(i, seed) & 0xffff) / 8192.0f - 4.0f;
}

struct Set {
  void* o;
  float* lse;
  void* out;
  float* out_lse;
};

template <typename TIn>
void run_case(int64_t tokens, int64_t states, int sms, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(TIn);
  const bool f32 = sizeof(TIn) == 4;
  const int64_t elems = tokens * states * kHeads * kHeadSize, lse_elems = tokens * states * kHeads;
  const int64_t out_elems = tokens * kHeads * kHeadSize;
  const int64_t bytes = elems * int64_t(sizeof(TIn)) + lse_elems * 4 + out_elems * 2 + tokens * kHeads * 4;
  // Input sets rotated over at least 512 MB (as vs_flashinfer rotates them), so that decode-sized
  // calls read HBM rather than L2.
  const int64_t count = std::max<int64_t>(1, ((int64_t{512} << 20) + bytes - 1) / bytes);
  std::vector<Set> sets(count);
  uint32_t seed = 1;
  for (Set& s : sets) {
    check_cuda(cudaMalloc(&s.o, elems * sizeof(TIn)), "cudaMalloc");
    check_cuda(cudaMalloc(&s.lse, lse_elems * 4), "cudaMalloc");
    check_cuda(cudaMalloc(&s.out, out_elems * 2), "cudaMalloc");
    check_cuda(cudaMalloc(&s.out_lse, tokens * kHeads * 4), "cudaMalloc");
    fill_o<<<1024, 256, 0, stream>>>(f32 ? nullptr : static_cast<uint16_t*>(s.o), f32 ? static_cast<float*>(s.o) : nullptr,
                                     elems, seed++);
    fill_lse<<<1024, 256, 0, stream>>>(s.lse, lse_elems, seed++);
  }
  check_cuda(cudaStreamSynchronize(stream), "fill");
  const MergeShape shape{tokens, kHeads, kHeadSize, true};
  const auto source = [&](const Set& s) {
    return StackSource{s.o, states * kHeads * kHeadSize, kHeads * kHeadSize, kHeadSize, s.lse, states * kHeads, kHeads, 1,
                       states, SinkView{}};
  };
  const auto dest = [&](const Set& s) {
    return OutView{s.out, kHeads * kHeadSize, kHeadSize, s.out_lse, kHeads, 1, 1.0f, nullptr, false};
  };
  CallFacts facts;
  facts.in = dtype_of<TIn>();
  facts.out = Dtype::kBFloat16;
  facts.vec = kVec;
  facts.access_bytes = 16;
  facts.bytes = bytes;
  const LaunchPlan library = plan_merge(shape, source(sets[0]), dest(sets[0]), facts, DeviceInfo{sms, 9});
  // Contenders: the plan's, kRows, kStates with G groups.
  struct Contender {
    std::string name;
    LaunchPlan plan;
  };
  std::vector<Contender> vs;
  vs.push_back({"plan", library});
  const auto planned = [&](int groups) {
    CallFacts f = facts;
    f.groups = groups;
    return plan_merge(shape, source(sets[0]), dest(sets[0]), f, DeviceInfo{sms, 9});
  };
  const LaunchPlan rows = planned(1);
  vs.push_back({"rows", rows});
  LaunchPlan rows4 = rows;  // 4 states in flight (the kernel of rows of <= 4 states)
  rows4.chunk = kSmallChunk;
  vs.push_back({"rows4", rows4});
  LaunchPlan rows128 = rows;  // narrower blocks: more of them an SM
  rows128.main = row_dims(rows.shape.packs, rows.shape.rows, sms, kMinBlockThreads, kMinBlockThreads);
  vs.push_back({"rows128", rows128});
  LaunchPlan evict = library;  // the plan with the other evict-first choice
  evict.shape.evict_first = !library.shape.evict_first;
  vs.push_back({library.shape.evict_first ? "plan-cached" : "plan-evict", evict});
  // kStates with G groups, where kRows would not fill the GPU twice over.
  if (rows.shape.rows * rows.shape.packs <= int64_t{sms} * 4096)
    for (int g = 2; g <= kMaxStateGroups && rows.shape.packs * g <= kStateBlockThreads; g *= 2)
      vs.push_back({"G" + std::to_string(g), planned(g)});
  const auto launch_one = [&](const LaunchPlan& plan, const Set& s) {
    check_cuda(launch_merge<TIn, bfloat16_t, kVec>(plan, source(s), dest(s), stream), "launch");
  };
  // Outputs against kRows' on set 0.
  std::vector<uint16_t> ref_o(out_elems), o(out_elems);
  std::vector<float> ref_l(tokens * kHeads), l(tokens * kHeads);
  // Outputs poisoned (0xff: NaN) before each launch, and the stream waited for before each copy:
  // cudaMemcpy does not wait for a non-blocking stream.
  const auto run_into_set0 = [&](const LaunchPlan& plan) {
    check_cuda(cudaMemsetAsync(sets[0].out, 0xff, out_elems * 2, stream), "poison");
    check_cuda(cudaMemsetAsync(sets[0].out_lse, 0xff, tokens * kHeads * 4, stream), "poison");
    launch_one(plan, sets[0]);
    check_cuda(cudaStreamSynchronize(stream), "merge");
  };
  run_into_set0(rows);
  check_cuda(cudaMemcpy(ref_o.data(), sets[0].out, out_elems * 2, cudaMemcpyDeviceToHost), "copy");
  check_cuda(cudaMemcpy(ref_l.data(), sets[0].out_lse, ref_l.size() * 4, cudaMemcpyDeviceToHost), "copy");
  // kRows itself against a float64 merge on the host, over the first tokens.
  {
    const int64_t check_tokens = std::min<int64_t>(tokens, 4), per_token = states * kHeads * kHeadSize;
    std::vector<TIn> hin(check_tokens * per_token);
    std::vector<float> hl(check_tokens * states * kHeads);
    check_cuda(cudaMemcpy(hin.data(), sets[0].o, hin.size() * sizeof(TIn), cudaMemcpyDeviceToHost), "copy");
    check_cuda(cudaMemcpy(hl.data(), sets[0].lse, hl.size() * 4, cudaMemcpyDeviceToHost), "copy");
    double worst_o = 0, worst_l = 0;
    for (int64_t t = 0; t < check_tokens; ++t)
      for (int64_t h = 0; h < kHeads; ++h) {
        double m = -INFINITY, total = 0;
        for (int64_t s = 0; s < states; ++s) m = std::max(m, double(hl[(t * states + s) * kHeads + h]));
        for (int64_t s = 0; s < states; ++s) total += std::exp2(double(hl[(t * states + s) * kHeads + h]) - m);
        worst_l = std::max(worst_l, std::fabs(m + std::log2(total) - ref_l[t * kHeads + h]));
        for (int64_t d = 0; d < kHeadSize; ++d) {
          double acc = 0;
          for (int64_t s = 0; s < states; ++s) {
            const TIn x = hin[((t * states + s) * kHeads + h) * kHeadSize + d];
            const double v = f32 ? double(reinterpret_cast<const float&>(x)) : double(bf16_to_float(reinterpret_cast<const uint16_t&>(x)));
            acc += std::exp2(double(hl[(t * states + s) * kHeads + h]) - m) / total * v;
          }
          worst_o = std::max(worst_o, std::fabs(acc - bf16_to_float(ref_o[(t * kHeads + h) * kHeadSize + d])));
        }
      }
    if (worst_o > 1e-2 || worst_l > 1e-3)
      std::printf("rows WRONG against the host merge: |dO| %.2e |dLSE| %.2e\n", worst_o, worst_l);
  }
  std::printf("S=%-4lld %5lld tok %-9s %8.1f MB | plan %s", static_cast<long long>(states), static_cast<long long>(tokens),
              f32 ? "f32->bf16" : "bf16", bytes / 1e6,
              library.strategy() == Strategy::kStates
                  ? ("G" + std::to_string(library.groups)).c_str()
                  : "rows");
  const int calls = bytes > (int64_t{256} << 20) ? 10 : 100;
  for (Contender& v : vs) {
    run_into_set0(v.plan);
    check_cuda(cudaMemcpy(o.data(), sets[0].out, out_elems * 2, cudaMemcpyDeviceToHost), "copy");
    check_cuda(cudaMemcpy(l.data(), sets[0].out_lse, l.size() * 4, cudaMemcpyDeviceToHost), "copy");
    double d_o = 0, d_l = 0;
    for (int64_t i = 0; i < out_elems; ++i) d_o = std::max(d_o, double(std::fabs(bf16_to_float(o[i]) - bf16_to_float(ref_o[i]))));
    for (size_t i = 0; i < l.size(); ++i) d_l = std::max(d_l, double(std::fabs(l[i] - ref_l[i])));
    const double us = graph_us([&](int i) { launch_one(v.plan, sets[i % count]); }, stream, calls);
    std::printf(" | %s %.2f us (dO %.1e dL %.1e)", v.name.c_str(), us, d_o, d_l);
  }
  std::printf(" | floor %.2f us\n", 2.04 + bytes / 4.37e6);
  for (Set& s : sets)
    for (void* p : {s.o, static_cast<void*>(s.lse), s.out, static_cast<void*>(s.out_lse)}) cudaFree(p);
}

}  // namespace

// Arguments (optional): the cases to run, each T:S (bfloat16 states) or T:S:f32 (float32 states);
// none: every case below.
int main(int argc, char** argv) {
  if (!have_gpu("state_strategies")) return 1;
  cudaDeviceProp prop;
  check_cuda(cudaGetDeviceProperties(&prop, 0), "properties");
  cudaStream_t stream;
  check_cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  const int sms = prop.multiProcessorCount;
  std::printf("%s (%d SMs): N-way merge T x S x 32 x 128 -> bfloat16, us per merge by graph replay (median)\n", prop.name,
              sms);
  if (argc > 1) {
    for (int i = 1; i < argc; ++i) {
      long long t = 0, st = 0;
      char kind[8] = "";
      if (std::sscanf(argv[i], "%lld:%lld:%7s", &t, &st, kind) < 2) {
        std::fprintf(stderr, "state_strategies: a case is T:S or T:S:f32, not %s\n", argv[i]);
        return 2;
      }
      if (std::strcmp(kind, "f32") == 0) {
        run_case<float>(t, st, sms, stream);
      } else {
        run_case<bfloat16_t>(t, st, sms, stream);
      }
    }
    return 0;
  }
  for (const auto& c : std::vector<std::array<int64_t, 2>>{{16, 16}, {16, 32}, {16, 64}, {16, 128}, {4, 128}, {32, 64}, {64, 64},
                                                            {128, 16}, {128, 64}, {128, 128}, {256, 16}, {256, 64},
                                                            {512, 16}, {1, 16}, {1, 64}, {16, 12}, {16, 9},
                                                            {8192, 4}, {8192, 8}, {8192, 16}, {8192, 64}})
    run_case<bfloat16_t>(c[0], c[1], sms, stream);
  for (const auto& c : std::vector<std::array<int64_t, 2>>{{16, 64}, {16, 128}, {16, 256}, {128, 64}, {256, 64}, {8192, 16}})
    run_case<float>(c[0], c[1], sms, stream);
  return 0;
}
