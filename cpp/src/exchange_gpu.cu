// The exchange on the GPU: its publish and its merge launched (exchange_kernels.cuh), the merge
// planned (plan_exchange) and dispatched over the ranks' O dtype and two vector widths (16-byte
// accesses, or one element: out's dtype is the kernel's to read), and a pad's failure record read
// back for attnmerge_exchange_status.
#include <cuda_runtime.h>

#include "attnmerge/exchange_kernels.cuh"
#include "merge_gpu.cuh"

namespace attnmerge {
namespace detail {

attnmerge_status gpu_exchange_publish(const exchange::Sync& sync, int device, void* stream) {
  DeviceGuard guard(device);
  if (guard.error() != cudaSuccess)
    return cuda_fail(guard.error(), "while selecting the device (an earlier error, not one of this call's arguments)");
  const cudaError_t err = launch_publish(sync, false, static_cast<cudaStream_t>(stream));
  if (err != cudaSuccess)
    return cuda_fail(err, "launching the exchange's publish (possibly an earlier, sticky error of other work)");
  LaunchPlan plan{MergeShape{0, 0, 1, false}};
  plan.variant = Variant::kExchange;
  plan.main.grid[0] = plan.main.grid[1] = plan.main.grid[2] = 1;
  plan.main.block[0] = 32, plan.main.block[1] = plan.main.block[2] = 1;
  record_launch(plan);
  return ATTNMERGE_SUCCESS;
}

attnmerge_status gpu_merge_exchange(const MergeShape& shape, const ExchangeSource& src, const OutView& out,
                                    const exchange::Sync& sync, const CallFacts& facts, int in_dtype, int out_dtype,
                                    int device, void* stream) {
  DeviceGuard guard(device);
  if (guard.error() != cudaSuccess)
    return cuda_fail(guard.error(), "while selecting the device (an earlier error, not one of this call's arguments)");
  const DeviceProps props = device_props(device);
  const LaunchPlan plan = plan_exchange(shape, facts, DeviceInfo{props.sms, props.major});
  Dtype out_type = Dtype::kUnknown;
  if (attnmerge_status s = dispatch_out_dtype(out_dtype, [&](auto tag) { out_type = dtype_of<decltype(tag)>(); }))
    return s;
  cudaError_t err = cudaSuccess;
  const attnmerge_status s = dispatch_in_dtype(in_dtype, [&](auto tag) {
    using TIn = decltype(tag);
    constexpr int kWide = 16 / sizeof(TIn);
    const cudaStream_t on = static_cast<cudaStream_t>(stream);
    err = plan.vec == kWide ? launch_exchange<TIn, kWide>(plan, src, out, sync, out_type, on)
                            : launch_exchange<TIn, 1>(plan, src, out, sync, out_type, on);
  });
  if (s) return s;
  if (err != cudaSuccess)
    return cuda_fail(err, "launching the exchange's merge (possibly an earlier, sticky error of other work)");
  record_launch(plan);
  return ATTNMERGE_SUCCESS;
}

attnmerge_status gpu_take_record(uint64_t* pad, int device, void* stream, exchange::Record& record) {
  DeviceGuard guard(device);
  if (guard.error() != cudaSuccess)
    return cuda_fail(guard.error(), "while selecting the device (an earlier error, not one of this call's arguments)");
  constexpr int kWords = exchange::kFailedTimeout - exchange::kFailure + 1;
  uint64_t words[kWords] = {};
  const cudaStream_t on = static_cast<cudaStream_t>(stream);
  uint64_t* const first = pad + exchange::kFailure;
  cudaError_t err = cudaMemcpyAsync(words, first, sizeof words, cudaMemcpyDeviceToHost, on);
  if (err == cudaSuccess) err = cudaStreamSynchronize(on);
  if (err == cudaSuccess && words[0] != 0) {
    err = cudaMemsetAsync(first, 0, sizeof words, on);
    if (err == cudaSuccess) err = cudaStreamSynchronize(on);
  }
  if (err != cudaSuccess)
    return cuda_fail(err, "reading the exchange's pad (possibly an earlier, sticky error of other work)");
  record.why = static_cast<exchange::Failure>(words[0]);
  record.peer = static_cast<int64_t>(words[exchange::kFailedPeer - exchange::kFailure]);
  record.epoch = words[exchange::kFailedEpoch - exchange::kFailure];
  record.seen = words[exchange::kFailedSeen - exchange::kFailure];
  record.timeout = words[exchange::kFailedTimeout - exchange::kFailure];
  return ATTNMERGE_SUCCESS;
}

}  // namespace detail
}  // namespace attnmerge
