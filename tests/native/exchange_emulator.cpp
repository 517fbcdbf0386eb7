// The exchange's GPU kernels (attnmerge/exchange_kernels.cuh) run on the CPU, for the tests: the
// library's plan (plan_exchange) and launchers (launch_exchange, launch_publish) with the kernels'
// own code compiled as host C++ against emulated_cuda/cuda_runtime.h, whose launch runs each
// block's threads as fibers that meet at its barriers, and the protocol's accesses (exchange.h)
// compiled as the host's atomics.  Each rank calls from a thread of its own (ctypes releases the
// GIL), so that the kernels' waits are met by other ranks' launches running meanwhile: what is
// checked is the kernels' logic (every block's wait and verdict, the rows, the chunks of states,
// the last block's count and signals, the records of a failure), not the device's instructions.
// Each function returns the launch's cudaError_t (emulate_error: why).
#include <attnmerge/attnmerge.h>
#include <attnmerge/exchange_kernels.cuh>

#include "emulator.h"

using namespace attnmerge;

namespace {

thread_local LaunchPlan t_plan{MergeShape{0, 0, 0, false}};

// The protocol's part of rank `rank` of `world`: pads[p] rank p's pad.
exchange::Sync sync_of(uint64_t** pads, int rank, int world, uint64_t epoch, uint64_t timeout_ns, int reuse) {
  exchange::Sync sync{};
  for (int p = 0; p < exchange::kMaxWorld; ++p) sync.pads[p] = pads[p < world ? p : 0];
  sync.rank = rank, sync.world = world, sync.epoch = epoch, sync.timeout_ns = timeout_ns;
  sync.reuse = static_cast<exchange::Reuse>(reuse);
  return sync;
}

// f(TIn{}) for the ranks' O dtype code; cudaErrorInvalidValue for another.
template <typename F>
cudaError_t with_input(int code, F&& f) {
  switch (code) {
    case ATTNMERGE_FLOAT32: return f(float{});
    case ATTNMERGE_FLOAT16: return f(half_t{});
    case ATTNMERGE_BFLOAT16: return f(bfloat16_t{});
  }
  return cudaErrorInvalidValue;
}

}  // namespace

extern "C" {

// The publish of rank `rank` of `world` (pads[p]: rank p's pad), epoch `epoch` (0: the pad's + 1).
int emulate_exchange_publish(uint64_t** pads, int rank, int world, uint64_t epoch) {
  return launch_publish(sync_of(pads, rank, world, epoch, 1, 0), false, nullptr);
}

// The merge of rank `rank` of `world` into out [tokens, heads, head_size] (strides out_s) and
// out_lse [tokens, heads] (null: none), from every rank's O o[p] and LSE lse[p] (one layout: os,
// ls), its rows offset by token0 and head0 (its slice); the sink [heads] (null: none); `bases` the
// C ABI's base flags; FP8 outputs scaled by inv_scale or *scale; `vec` elements per access (16
// bytes of the input's, or 1), `sms` the GPU's SMs (0: unknown), which the plan lays out blocks by;
// sums[p] rank p's softmax sums laid out as its LSE (sums null: LSEs), valid [tokens of out, world]
// (strides vs, valid_bytes an entry; null: none).
int emulate_merge_exchange(int64_t tokens, int64_t heads, int64_t head_size, int in_dtype, int out_dtype, int vec,
                           int sms, int bases, float inv_scale, const float* scale, void* out, const int64_t* out_s,
                           float* out_lse, const int64_t* ol_s, const void** o, const int64_t* os, const float** lse,
                           const int64_t* ls, int world, int rank, int64_t token0, int64_t head0, const float* sink,
                           int64_t sink_stride, uint64_t** pads, uint64_t epoch, uint64_t timeout_ns, int reuse,
                           const float** sums, const void* valid, const int64_t* vs, int valid_bytes) {
  const bool base2 = (bases & ATTNMERGE_LSE_BASE2) != 0;
  const bool out_base2 = (bases & ATTNMERGE_OUT_LSE_BASE2) ? true : (bases & ATTNMERGE_OUT_LSE_BASE_E) ? false : base2;
  ExchangeSource src{};
  for (int p = 0; p < exchange::kMaxWorld; ++p) {
    src.o[p] = o[p < world ? p : 0];
    src.lse[p] = lse[p < world ? p : 0];
    src.sum[p] = (sums != nullptr ? sums : lse)[p < world ? p : 0];
  }
  src.extras.sums = sums != nullptr;
  if (valid != nullptr) src.extras.valid = ValidView{valid, vs[0], vs[1], valid_bytes};
  src.extras.on = src.extras.sums || valid != nullptr;
  src.o_st = os[0], src.o_sh = os[1], src.lse_st = ls[0], src.lse_sh = ls[1];
  src.token0 = token0, src.head0 = head0, src.world = world;
  src.sink = SinkView{sink, sink_stride};
  OutView dst{out, out_s[0], out_s[1], out_lse, out_lse ? ol_s[0] : 0, out_lse ? ol_s[1] : 0, inv_scale, scale, false,
              base_change(base2, out_base2)};
  CallFacts facts;
  facts.vec = vec;
  t_plan = plan_exchange(MergeShape{tokens, heads, head_size, base2}, facts, DeviceInfo{sms, 9});
  const exchange::Sync sync = sync_of(pads, rank, world, epoch, timeout_ns, reuse);
  const Dtype out_type = emu::dtype_of_code(out_dtype);
  return with_input(in_dtype, [&](auto tag) {
    using TIn = decltype(tag);
    constexpr int kWide = 16 / sizeof(TIn);
    return vec == kWide ? launch_exchange<TIn, kWide>(t_plan, src, dst, sync, out_type, nullptr)
                        : launch_exchange<TIn, 1>(t_plan, src, dst, sync, out_type, nullptr);
  });
}

// The last merge's plan: vec, blocks (the grid's), threads per block, at fields[0 .. 2].
void emulate_exchange_plan(int64_t* fields) {
  const LaunchDims& d = t_plan.main;
  fields[0] = t_plan.vec;
  fields[1] = int64_t{d.grid[0]} * d.grid[1] * d.grid[2];
  fields[2] = int64_t{d.block[0]} * d.block[1] * d.block[2];
}

}  // extern "C"
