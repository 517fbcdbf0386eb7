// The GPU merge of one source: the device made current, the launch plan made for its SM count
// and compute capability, the header-only kernel dispatched over (input dtype, output dtype,
// vector width), the launch recorded.  Included by merge_gpu_{pair,stack,range,share}.cu, one
// instantiation each, so that the kernels compile in parallel.
#pragma once

#include <cuda_runtime.h>

#include "attnmerge/merge_kernels.cuh"
#include "internal.h"

namespace attnmerge {
namespace detail {

attnmerge_status cuda_fail(cudaError_t err, const char* what);

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

// The SM count of a device and the compute capability of the code it runs (device_props, in
// merge_gpu.cu), asked once per device.  0: not known.
struct DeviceProps {
  int sms = 0, major = 0;
};
DeviceProps device_props(int device);

// Records the plan as the calling thread's last launch (attnmerge_last_launch).
void record_launch(const LaunchPlan& plan);

template <typename Source>
attnmerge_status gpu_merge(const MergeShape& shape, const Source& src, const OutView& out, const CallFacts& facts,
                           int in_dtype, int out_dtype, int device, void* stream) {
  DeviceGuard guard(device);
  if (guard.error() != cudaSuccess)
    return cuda_fail(guard.error(), "while selecting the device (an earlier error, not one of this call's arguments)");
  const DeviceProps props = device_props(device);
  CallFacts typed = facts;  // the plan's dtypes, from the C ABI's codes (unknown_dtype's status for none)
  attnmerge_status status;
  if ((status = dispatch_in_dtype(in_dtype, [&](auto tag) { typed.in = dtype_of<decltype(tag)>(); })) ||
      (status = dispatch_out_dtype(out_dtype, [&](auto tag) { typed.out = dtype_of<decltype(tag)>(); })))
    return status;
  const LaunchPlan plan = plan_merge(shape, src, out, typed, DeviceInfo{props.sms, props.major});
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  cudaError_t err = cudaSuccess;
  dispatch_in_dtype(in_dtype, [&](auto in_tag) {
    dispatch_out_dtype(out_dtype, [&](auto out_tag) {
      dispatch_vec(plan.vec, [&](auto vec_tag) {
        using TIn = decltype(in_tag);
        using TOut = decltype(out_tag);
        constexpr int kVec = decltype(vec_tag)::value;
        // A thread's elements span one access of at most 16 bytes (two for two-state sources: the
        // plan's vec); no wider combination is ever planned, so none is instantiated (launch_merge
        // compiles, of each combination, the variants the plan may give it).
        constexpr std::size_t kMost = std::is_same<Source, PairSource>::value ? 32 : 16;
        if constexpr (kVec * sizeof(TIn) <= kMost && kVec * sizeof(TOut) <= kMost)
          err = launch_merge<TIn, TOut, kVec>(plan, src, out, s);
      });
    });
  });
  if (err != cudaSuccess)
    return cuda_fail(err, "launching the merge kernel (possibly an earlier, sticky error of other work)");
  record_launch(plan);
  return ATTNMERGE_SUCCESS;
}

}  // namespace detail
}  // namespace attnmerge
