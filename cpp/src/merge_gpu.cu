// The GPU path: device selection, pointer checks and the dispatch of the header-only kernels over
// (input dtype, output dtype, vector width).
#include <cuda_runtime.h>

#include <atomic>

#include "attnmerge/merge_kernels.cuh"
#include "internal.h"

namespace attnmerge {
namespace detail {
namespace {

attnmerge_status cuda_fail(cudaError_t err, const char* what) {
  return fail(ATTNMERGE_ERROR_CUDA, "CUDA error %s (%s) %s", cudaGetErrorName(err), cudaGetErrorString(err), what);
}

// Makes `device` current for its lifetime and restores the caller's device after.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    err_ = cudaGetDevice(&previous_);
    if (err_ == cudaSuccess && previous_ != device) {
      err_ = cudaSetDevice(device);
      switched_ = err_ == cudaSuccess;
    }
  }
  ~DeviceGuard() {
    if (switched_) cudaSetDevice(previous_);
  }
  cudaError_t error() const { return err_; }

 private:
  int previous_ = 0;
  bool switched_ = false;
  cudaError_t err_;
};

// The SM count and compute capability of a device, asked once per device (the ordinal's bits
// beyond kCached are asked every time).  0: not asked yet.
struct DeviceProps {
  int sms = 0, major = 0;
};
DeviceProps device_props(int device) {
  constexpr int kCached = 64;
  static std::atomic<int> cache[kCached];  // sms | major << 20
  int packed = device < kCached ? cache[device].load(std::memory_order_relaxed) : 0;
  if (packed == 0) {
    int sms = 0, major = 0;
    if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) {
      cudaGetLastError();
      return {};  // blocks of the default width and no PDL: still correct
    }
    packed = sms | (major << 20);
    if (device < kCached) cache[device].store(packed, std::memory_order_relaxed);
  }
  return {packed & ((1 << 20) - 1), packed >> 20};
}

}  // namespace

int gpu_build_version() { return CUDART_VERSION; }

int gpu_device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // no driver or device: not an error of anyone's launch
    return 0;
  }
  return count;
}

int gpu_driver_version() {
  int version = 0;
  if (cudaDriverGetVersion(&version) != cudaSuccess) return 0;
  return version;
}

int gpu_pointer_device(const void* ptr) {
  cudaPointerAttributes attr;
  if (cudaPointerGetAttributes(&attr, ptr) != cudaSuccess) {
    cudaGetLastError();
    return ATTNMERGE_HOST;
  }
  return attr.type == cudaMemoryTypeDevice ? attr.device : ATTNMERGE_HOST;
}

attnmerge_status gpu_check_pointer(const void* ptr, int device, const char* arg) {
  cudaPointerAttributes attr;
  const cudaError_t err = cudaPointerGetAttributes(&attr, ptr);
  if (err != cudaSuccess) {
    if (err == cudaErrorInvalidValue) {
      cudaGetLastError();
      return fail(ATTNMERGE_ERROR_VALUE, "%s: expected memory of CUDA device %d, got a pointer CUDA does not know", arg,
                  device);
    }
    return cuda_fail(err, "while checking a pointer (an earlier error, not one of this call's arguments)");
  }
  switch (attr.type) {
    case cudaMemoryTypeDevice:
      if (attr.device != device)
        return fail(ATTNMERGE_ERROR_VALUE, "%s: expected memory of CUDA device %d, got memory of device %d", arg, device,
                    attr.device);
      return ATTNMERGE_SUCCESS;
    case cudaMemoryTypeManaged:
    case cudaMemoryTypeHost:  // pinned or registered host memory is addressable from the device
      return ATTNMERGE_SUCCESS;
    default:
      return fail(ATTNMERGE_ERROR_VALUE, "%s: expected memory of CUDA device %d, got ordinary host memory", arg, device);
  }
}

namespace {

thread_local attnmerge_launch_info g_last_launch = {};

void record_launch(const LaunchPlan& plan) {
  attnmerge_launch_info& info = g_last_launch;
  info.launches = plan.launches;
  info.kernel = plan.launches == 0                      ? ATTNMERGE_KERNEL_NONE
                : plan.strategy == Strategy::kStates ? ATTNMERGE_KERNEL_STATES
                : plan.plain                         ? ATTNMERGE_KERNEL_ROWS_PLAIN
                : plan.fused_lse                     ? ATTNMERGE_KERNEL_ROWS_INPLACE
                                                     : ATTNMERGE_KERNEL_ROWS;
  info.state_groups = plan.groups;
  info.index_bits = plan.index32 ? 32 : 64;
  info.vec = plan.vec;
  info.pdl = plan.pdl ? 1 : 0;
  for (int i = 0; i < 3; ++i) info.grid[i] = plan.main.grid[i], info.block[i] = plan.main.block[i];
}

}  // namespace

void forget_launch() { g_last_launch = attnmerge_launch_info{}; }
attnmerge_launch_info last_launch() { return g_last_launch; }

template <typename Source>
attnmerge_status gpu_merge(const MergeShape& shape, const Source& src, const OutView& out, const CallFacts& facts,
                           int in_dtype, int out_dtype, int device, void* stream) {
  DeviceGuard guard(device);
  if (guard.error() != cudaSuccess)
    return cuda_fail(guard.error(), "while selecting the device (an earlier error, not one of this call's arguments)");
  const DeviceProps props = device_props(device);
  const LaunchPlan plan = plan_merge(shape, src, out, facts, DeviceInfo{props.sms, props.major});
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  cudaError_t err = cudaSuccess;
  dispatch_in_dtype(in_dtype, [&](auto in_tag) {
    dispatch_out_dtype(out_dtype, [&](auto out_tag) {
      dispatch_vec(plan.vec, [&](auto vec_tag) {
        using TIn = decltype(in_tag);
        using TOut = decltype(out_tag);
        constexpr int kVec = decltype(vec_tag)::value;
        // Wider than 16 bytes per access is never chosen; do not instantiate it.
        if constexpr (kVec * sizeof(TIn) <= 16 && kVec * sizeof(TOut) <= 16)
          err = launch_merge<TIn, TOut, kVec>(plan, src, out, s);
      });
    });
  });
  if (err != cudaSuccess)
    return cuda_fail(err, "launching the merge kernel (possibly an earlier, sticky error of other work)");
  record_launch(plan);
  return ATTNMERGE_SUCCESS;
}

template attnmerge_status gpu_merge<PairSource>(const MergeShape&, const PairSource&, const OutView&,
                                                const CallFacts&, int, int, int, void*);
template attnmerge_status gpu_merge<StackSource>(const MergeShape&, const StackSource&, const OutView&,
                                                 const CallFacts&, int, int, int, void*);
template attnmerge_status gpu_merge<RangeSource>(const MergeShape&, const RangeSource&, const OutView&,
                                                 const CallFacts&, int, int, int, void*);

attnmerge_status gpu_stream_synchronize(int device, void* stream) {
  DeviceGuard guard(device);
  if (guard.error() != cudaSuccess) return cuda_fail(guard.error(), "while selecting the device");
  const cudaError_t err = cudaStreamSynchronize(static_cast<cudaStream_t>(stream));
  if (err != cudaSuccess) return cuda_fail(err, "while synchronizing the stream");
  return ATTNMERGE_SUCCESS;
}

attnmerge_status gpu_run(int device, GpuJob job, void* ctx, const char* what) {
  DeviceGuard guard(device);
  if (guard.error() != cudaSuccess)
    return cuda_fail(guard.error(), "while selecting the device (an earlier error, not one of this call's arguments)");
  const DeviceProps props = device_props(device);
  attnmerge_launch_info info = {};
  const cudaError_t err = static_cast<cudaError_t>(job(DeviceInfo{props.sms, props.major}, ctx, &info));
  if (err != cudaSuccess) return cuda_fail(err, what);
  g_last_launch = info;
  return ATTNMERGE_SUCCESS;
}

}  // namespace detail
}  // namespace attnmerge
