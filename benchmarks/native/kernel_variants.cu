// Launch choices of the two-way merge side by side, by CUDA-graph replay through the header-only
// launcher (merge_kernels.cuh), on 1 to 32768 x 32 x 128 bfloat16 with input sets rotated past L2:
//   flat      the plan's rows taken flat (one offset a view, no row division) against split into
//             token and head;
//   accesses  the plan's two 16-byte accesses a thread against one;
//   evict     evict-first O loads and stores: the library's choice (plan.h evict_first_o), always, never;
//   pdl       a chain of two dependent merges with and without programmatic dependent launch;
//   in place  the in-place merge, unmasked and half masked: the plan's (rows in warps meeting at a
//             warp barrier before the LSE store) against the block barrier, the general source and
//             one access a thread;
//   tiles     with vLLM's [heads, tokens] LSEs, rows in tiles of 8 tokens (MergeShape::tile) against
//             the token-major order, at several head sizes; the two outputs compared byte for byte.
// Prints us per merge and the ratio to the library's choice; figures go to benchmarks/NOTES.md.
#include <attnmerge/merge_kernels.cuh>

#include <array>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "common.h"

using namespace attnmerge;

namespace {

constexpr int64_t kHeads = 32, kHeadSize = 128;

using Set = PairSet;

struct Case {
  int64_t tokens;
  std::vector<Set> sets;
  int64_t bytes;
};

// Input sets to rotate through for a merge moving `bytes`: 2 to 32, some 512 MB in all (past L2).
int64_t rotation(int64_t bytes) { return std::max<int64_t>(2, std::min<int64_t>(32, (int64_t{512} << 20) / bytes)); }

Case make_case(int64_t tokens) {
  const int64_t bytes = 3 * tokens * kHeads * (kHeadSize * 2 + 4);
  return Case{tokens, alloc_pair_sets(rotation(bytes), tokens * kHeads * kHeadSize * 2, tokens * kHeads * 4), bytes};
}

void free_case(Case& c) { free_pair_sets(c.sets); }

// The launch knobs timed here: the SM count the plan sizes blocks for, programmatic dependent
// launch, and whether the plan may take rows flat (PlainPairSource's kFlatRows).
struct Knobs {
  int sms;
  bool pdl;
  bool unflat = false;
  bool one_access = false;  // one 16-byte access a thread, not the plan's two
  int width = 0;            // blocks up to this many threads (0: the plan's)
};

// One merge of set `s` (a_o/a_lse may be another set's output, for the chain) as the library plans
// it, evict-first forced by the `bytes` the call claims (the plan's evict_first_o reads it).
cudaError_t merge(const void* o_a, const float* lse_a, const Set& s, void* out, float* out_lse, int64_t tokens,
                  int64_t claimed_bytes, Knobs knobs, cudaStream_t stream) {
  const MergeShape shape{tokens, kHeads, kHeadSize, false};
  const int64_t st = kHeads * kHeadSize;
  const PairSource src{StateView{o_a, st, kHeadSize, lse_a, kHeads, 1}, StateView{s.o_b, st, kHeadSize, s.lse_b, kHeads, 1},
                       tokens, nullptr, 0};
  const OutView dst{out, st, kHeadSize, out_lse, kHeads, 1, 1.0f, nullptr, false};
  LaunchPlan plan = bf16_plan(shape, src, dst, claimed_bytes, knobs.sms, knobs.pdl, false, knobs.one_access ? 0 : 16);
  if (knobs.unflat && plan.variant == Variant::kRowsPlainFlat) plan.variant = Variant::kRowsPlain;
  if (knobs.width > 0) plan.main = row_dims(plan.shape.packs, plan.shape.rows, knobs.sms, knobs.width);
  return launch_bf16(plan, src, dst, stream);
}

// The two-way merge of T x H x D bfloat16 with [heads, tokens] LSEs, rows token-major (the plan
// told the LSEs are [tokens, heads]: the plain kernel) or in tiles of 8 tokens (the plan's choice
// for these LSEs): us per merge for each, and whether both wrote the same bytes.
void tiles(int64_t tokens, int64_t heads, int64_t head_size, int sms, cudaStream_t stream) {
  const size_t o_bytes = tokens * heads * head_size * 2, lse_bytes = tokens * heads * 4;
  const int64_t bytes = 3 * int64_t(o_bytes + lse_bytes);
  const int64_t n = rotation(bytes);
  std::vector<Set> sets = alloc_pair_sets(n, o_bytes, lse_bytes);
  for (Set& s : sets) check_cuda(cudaMemset(s.lse_b, 0x3f, lse_bytes), "cudaMemset");  // ~0.75: unequal weights
  const auto run = [&](const Set& s, void* out, float* out_lse, bool tiled) {
    const MergeShape shape{tokens, heads, head_size, false};
    const int64_t st = heads * head_size;
    const PairSource src{StateView{s.o_a, st, head_size, s.lse_a, 1, tokens}, StateView{s.o_b, st, head_size, s.lse_b, 1, tokens},
                         tokens, nullptr, 0};
    const OutView dst{out, st, head_size, out_lse, 1, tokens, 1.0f, nullptr, false};
    const LaunchPlan plan = bf16_plan(shape, src, dst, bytes, sms, false, tiled);
    check_cuda(launch_bf16(plan, src, dst, stream), "launch");
  };
  double t[2][2];
  for (int round = 0; round < 2; ++round)
    for (int tiled = 0; tiled < 2; ++tiled)
      t[round][tiled] = graph_us([&](int i) { const Set& s = sets[i % n]; run(s, s.out, s.out_lse, tiled == 1); }, stream);
  // Both orders into set 1's outputs and set 0's, from set 0's inputs: the same bytes?
  run(sets[0], sets[0].out, sets[0].out_lse, false);
  run(sets[0], sets[1].out, sets[1].out_lse, true);
  check_cuda(cudaStreamSynchronize(stream), "merge");  // cudaMemcpy does not wait for a non-blocking stream
  std::vector<char> a(o_bytes + lse_bytes), b(o_bytes + lse_bytes);
  check_cuda(cudaMemcpy(a.data(), sets[0].out, o_bytes, cudaMemcpyDeviceToHost), "copy");
  check_cuda(cudaMemcpy(a.data() + o_bytes, sets[0].out_lse, lse_bytes, cudaMemcpyDeviceToHost), "copy");
  check_cuda(cudaMemcpy(b.data(), sets[1].out, o_bytes, cudaMemcpyDeviceToHost), "copy");
  check_cuda(cudaMemcpy(b.data() + o_bytes, sets[1].out_lse, lse_bytes, cudaMemcpyDeviceToHost), "copy");
  std::printf("%6lld x %3lld x %3lld %7.1f MB: token-major %8.2f %8.2f us | tiles of 8 %8.2f %8.2f us | %.3fx | %s\n",
              static_cast<long long>(tokens), static_cast<long long>(heads), static_cast<long long>(head_size), bytes / 1e6,
              t[0][0], t[1][0], t[0][1], t[1][1], (t[0][0] + t[1][0]) / (t[0][1] + t[1][1]),
              a == b ? "same bytes" : "OUTPUTS DIFFER");
  free_pair_sets(sets);
}

// The in-place merge of T x 32 x 128 bfloat16 (a's O and LSE overwritten), with no mask or with
// about half the tokens' rows masked out: the plan's launch (rows in warps meeting at a warp
// barrier before the LSE store; the plain source where the plan takes it) against the block barrier
// (every thread reads the LSEs, the store after __syncthreads) and against the general source
// (PairSource) with the lanes, each timed twice.
void in_place(int64_t tokens, bool masked, int sms, cudaStream_t stream) {
  const size_t o_bytes = tokens * kHeads * kHeadSize * 2, lse_bytes = tokens * kHeads * 4;
  const int64_t bytes = 3 * int64_t(o_bytes + lse_bytes);
  const int64_t n = rotation(bytes);
  std::vector<Set> sets = alloc_pair_sets(n, o_bytes, lse_bytes);
  uint8_t* mask = nullptr;
  if (masked) {
    std::vector<uint8_t> host(tokens);
    for (int64_t t = 0; t < tokens; ++t) host[t] = (hash_index(t, 7) & 1) || t == 0;
    check_cuda(cudaMalloc(&mask, tokens), "cudaMalloc");
    check_cuda(cudaMemcpy(mask, host.data(), tokens, cudaMemcpyHostToDevice), "copy");
  }
  // 0 the plan's, 1 the block barrier, 2 the general source, 3 one access a thread
  const auto run = [&](const Set& s, int variant) {
    const MergeShape shape{tokens, kHeads, kHeadSize, false};
    const int64_t st = kHeads * kHeadSize;
    const PairSource src{StateView{s.o_a, st, kHeadSize, s.lse_a, kHeads, 1}, StateView{s.o_b, st, kHeadSize, s.lse_b, kHeads, 1},
                         tokens, mask, 1};
    const OutView dst{s.o_a, st, kHeadSize, s.lse_a, kHeads, 1, 1.0f, nullptr, true};
    LaunchPlan plan = bf16_plan(shape, src, dst, bytes, sms, false, false, variant == 3 ? 0 : 16);
    const bool lanes_planned = plan.variant == Variant::kInPlaceWarp || plan.variant == Variant::kInPlacePlainFlat;
    if (variant == 1) {
      plan.main = row_dims(plan.shape.packs, plan.shape.rows, sms, kPairBlockThreads, plan.shape.packs);
      plan.variant = Variant::kInPlaceBlock;
    }
    if (variant == 2 && lanes_planned) plan.variant = Variant::kInPlaceWarp;
    if (variant >= 4) {  // the plan's kernel in wider blocks (rows kept whole in a block or a warp)
      int64_t lanes = 1;
      while (lanes < plan.shape.packs) lanes *= 2;
      plan.main = row_dims(plan.shape.packs, plan.shape.rows, sms, variant == 4 ? 512 : 1024,
                           lanes_planned ? 0 : plan.shape.packs, lanes_planned ? lanes : 0);
    }
    check_cuda(launch_bf16(plan, src, dst, stream), "launch");
  };
  double t[2][6];
  for (int round = 0; round < 2; ++round)
    for (int v = 0; v < 6; ++v) t[round][v] = graph_us([&](int i) { run(sets[i % n], v); }, stream);
  std::printf("%7lld %s %7.1f MB: library %7.2f %7.2f | barrier %7.2f %7.2f | general %7.2f %7.2f | 1 access %7.2f %7.2f"
              " | w512 %7.2f %7.2f | w1024 %7.2f %7.2f us\n",
              static_cast<long long>(tokens), masked ? "half masked" : "no mask    ", bytes / 1e6, t[0][0], t[1][0], t[0][1],
              t[1][1], t[0][2], t[1][2], t[0][3], t[1][3], t[0][4], t[1][4], t[0][5], t[1][5]);
  if (mask) cudaFree(mask);
  free_pair_sets(sets);
}

}  // namespace

int main() {
  if (!have_gpu("kernel_variants")) return 1;
  cudaDeviceProp prop;
  check_cuda(cudaGetDeviceProperties(&prop, 0), "properties");
  cudaStream_t stream;
  check_cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  const int sms = prop.multiProcessorCount;
  std::printf("%s (%d SMs), two-way merge T x 32 x 128 bfloat16, us per merge by graph replay (median)\n", prop.name, sms);
  std::printf("%7s %9s | %10s %10s %8s | %10s %8s | %10s %10s %10s | %9s %9s %9s\n", "tokens", "MB", "library", "not flat",
              "ratio", "1 access", "ratio", "evict-1st", "plain", "ratio", "w512", "w1024", "library");
  const int64_t always = 0, never = INT64_MAX;
  for (int64_t tokens : {1, 16, 128, 512, 1024, 2048, 4096, 8192, 32768}) {
    Case c = make_case(tokens);
    const auto time = [&](int64_t claimed, Knobs lo) {
      return graph_us(
          [&](int i) {
            const Set& s = c.sets[i % c.sets.size()];
            check_cuda(merge(s.o_a, s.lse_a, s, s.out, s.out_lse, tokens, claimed, lo, stream), "launch");
          },
          stream);
    };
    const Knobs lib{sms, false}, wide{sms, false, true}, one{sms, false, false, true};
    const double t_lib = time(c.bytes, lib), t_wide = time(c.bytes, wide), t_one = time(c.bytes, one);
    const double t_evict = time(always, lib), t_plain = time(never, lib);
    Knobs w512 = lib, w1024 = lib;
    w512.width = 512, w1024.width = 1024;
    const double t_512 = time(c.bytes, w512), t_1024 = time(c.bytes, w1024), t_lib2 = time(c.bytes, lib);
    std::printf("%7lld %9.1f | %10.2f %10.2f %8.3f | %10.2f %8.3f | %10.2f %10.2f %10.3f | %9.2f %9.2f %9.2f\n",
                static_cast<long long>(tokens), c.bytes / 1e6, t_lib, t_wide, t_wide / t_lib, t_one, t_one / t_lib, t_evict,
                t_plain, t_plain / t_evict, t_512, t_1024, t_lib2);
    free_case(c);
  }
  std::printf("chain of two dependent merges (the second reads the first's output), us per chain\n");
  for (int64_t tokens : {1, 16, 128, 2048}) {
    Case c = make_case(tokens);
    double t[2];
    for (int pdl = 0; pdl < 2; ++pdl) {
      const Knobs lo{sms, pdl == 1};
      t[pdl] = graph_us(
          [&](int i) {
            const Set& s = c.sets[i % c.sets.size()];
            const Set& u = c.sets[(i + 1) % c.sets.size()];
            check_cuda(merge(s.o_a, s.lse_a, s, s.out, s.out_lse, tokens, c.bytes, lo, stream), "launch");
            check_cuda(merge(s.out, s.out_lse, u, u.out, u.out_lse, tokens, c.bytes, lo, stream), "launch");
          },
          stream);
    }
    std::printf("%7lld tokens: plain %7.2f  pdl %7.2f  (%.3fx)\n", static_cast<long long>(tokens), t[0], t[1], t[0] / t[1]);
    free_case(c);
  }
  std::printf("in-place merge: the library, the block barrier, the general source (each timed twice)\n");
  for (int64_t tokens : {1, 512, 8192})
    for (bool masked : {false, true}) in_place(tokens, masked, sms, stream);
  std::printf("[heads, tokens] LSEs, rows token-major against tiles of 8 tokens (each timed twice)\n");
  for (const auto& shape : {std::array<int64_t, 3>{16384, 64, 64}, {8192, 32, 128}, {8192, 32, 80}, {16384, 16, 256},
                            {2048, 32, 128}, {512, 32, 128}})
    tiles(shape[0], shape[1], shape[2], sms, stream);
  return 0;
}
