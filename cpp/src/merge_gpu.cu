// The GPU path's device side: device count, driver, pointer checks, the properties cache, the
// record of the last launch and stream synchronization.  The merges' dispatch is merge_gpu.cuh,
// instantiated once per source in merge_gpu_{pair,stack,range,share}.cu (compiled in parallel).
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>

#include "merge_gpu.cuh"

namespace attnmerge {
namespace detail {

attnmerge_status cuda_fail(cudaError_t err, const char* what) {
  return fail(ATTNMERGE_ERROR_CUDA, "CUDA error %s (%s) %s", cudaGetErrorName(err), cudaGetErrorString(err), what);
}

// Asked once per device (the ordinal's bits beyond kCached are asked every time).
namespace {
// A kernel of the library's own fatbinary, asked which code the device runs of it (every unit is
// compiled for the same architectures).
__global__ void code_probe() {}
}  // namespace

// The device's SM count and the compute capability of the code it runs: its own, or lower where the
// driver JIT-compiles older PTX (a build without SASS for it), whose kernels do not wait for the
// kernel before them (pdl_wait_then_release is compiled for sm_90 and newer): such code is never
// launched with programmatic dependent launch.
DeviceProps device_props(int device) {
  constexpr int kCached = 64;
  static std::atomic<int> cache[kCached];  // sms | code major << 20
  int packed = device < kCached ? cache[device].load(std::memory_order_relaxed) : 0;
  if (packed == 0) {
    int sms = 0, major = 0;
    cudaFuncAttributes code = {};
    if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
        cudaFuncGetAttributes(&code, code_probe) != cudaSuccess) {
      cudaGetLastError();
      return {};  // blocks of the default width and no PDL: still correct
    }
    major = std::min(major, code.ptxVersion / 10);
    packed = sms | (major << 20);
    if (device < kCached) cache[device].store(packed, std::memory_order_relaxed);
  }
  return {packed & ((1 << 20) - 1), packed >> 20};
}

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

attnmerge_status gpu_check_pointer(const void* ptr, int device, const ArgNames& names, const char* arg) {
  cudaPointerAttributes attr;
  const cudaError_t err = cudaPointerGetAttributes(&attr, ptr);
  if (err != cudaSuccess) {
    if (err == cudaErrorInvalidValue) {
      cudaGetLastError();
      return fail(ATTNMERGE_ERROR_VALUE, "%s: expected memory of CUDA device %d, got a pointer CUDA does not know",
                  names.of(arg), device);
    }
    return cuda_fail(err, "while checking a pointer (an earlier error, not one of this call's arguments)");
  }
  switch (attr.type) {
    case cudaMemoryTypeDevice:
      if (attr.device != device)
        return fail(ATTNMERGE_ERROR_VALUE, "%s: expected memory of CUDA device %d, got memory of device %d",
                    names.of(arg), device, attr.device);
      return ATTNMERGE_SUCCESS;
    case cudaMemoryTypeManaged:
    case cudaMemoryTypeHost:  // pinned or registered host memory is addressable from the device
      return ATTNMERGE_SUCCESS;
    default:
      return fail(ATTNMERGE_ERROR_VALUE, "%s: expected memory of CUDA device %d, got ordinary host memory",
                  names.of(arg), device);
  }
}

attnmerge_status gpu_check_peer_pointer(const void* ptr, int device, const char* name) {
  cudaPointerAttributes attr;
  const cudaError_t err = cudaPointerGetAttributes(&attr, ptr);
  if (err != cudaSuccess) {
    if (err == cudaErrorInvalidValue) {
      cudaGetLastError();
      return fail(ATTNMERGE_ERROR_VALUE,
                  "%s: expected memory of CUDA device %d or of a peer it can access, got a pointer CUDA does not know",
                  name, device);
    }
    return cuda_fail(err, "while checking a pointer (an earlier error, not one of this call's arguments)");
  }
  if (attr.type == cudaMemoryTypeManaged || (attr.type == cudaMemoryTypeDevice && attr.device == device))
    return ATTNMERGE_SUCCESS;
  if (attr.type != cudaMemoryTypeDevice)
    return fail(ATTNMERGE_ERROR_VALUE, "%s: expected memory of CUDA device %d or of a peer it can access, got host memory",
                name, device);
  int peer = 0;
  if (cudaDeviceCanAccessPeer(&peer, device, attr.device) != cudaSuccess) cudaGetLastError();
  if (peer) return ATTNMERGE_SUCCESS;
  return fail(ATTNMERGE_ERROR_VALUE,
              "%s: expected memory of CUDA device %d or of a peer it can access, got memory of device %d, which device "
              "%d cannot access",
              name, device, attr.device, device);
}

namespace {
thread_local attnmerge_launch_info g_last_launch = {};
}  // namespace

namespace {

// The C ABI's name of a variant's kernel (attnmerge_launch_info::kernel).
int32_t kernel_of(Variant v) {
  switch (v) {
    case Variant::kNone: return ATTNMERGE_KERNEL_NONE;
    case Variant::kStates: return ATTNMERGE_KERNEL_STATES;
    case Variant::kInPlaceWarp:
    case Variant::kInPlaceBlock:
    case Variant::kInPlacePlainFlat: return ATTNMERGE_KERNEL_ROWS_INPLACE;
    case Variant::kRowsPlain:
    case Variant::kRowsPlainFlat: return ATTNMERGE_KERNEL_ROWS_PLAIN;
    case Variant::kRows:
    case Variant::kRowsLseAfter:
    case Variant::kShare: return ATTNMERGE_KERNEL_ROWS;
    case Variant::kExchange: return ATTNMERGE_KERNEL_EXCHANGE;
  }
  return ATTNMERGE_KERNEL_ROWS;
}

}  // namespace

void record_launch(const LaunchPlan& plan) {
  attnmerge_launch_info& info = g_last_launch;
  info.launches = plan.launches();
  info.kernel = kernel_of(plan.variant);
  info.state_groups = plan.groups;
  info.index_bits = plan.index32 ? 32 : 64;
  info.vec = plan.vec;
  info.pdl = plan.pdl ? 1 : 0;
  for (int i = 0; i < 3; ++i) info.grid[i] = plan.main.grid[i], info.block[i] = plan.main.block[i];
}

void forget_launch() { g_last_launch = attnmerge_launch_info{}; }
attnmerge_launch_info last_launch() { return g_last_launch; }

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
