// Internals of libattnmerge shared by its translation units; nothing here is exported.
#pragma once

#include <cstddef>
#include <type_traits>

#include "attnmerge/attnmerge.h"
#include "attnmerge/pack.h"
#include "attnmerge/row.h"
#include "attnmerge/sources.h"
#include "attnmerge/views.h"
#include "attnmerge/backward_params.h"
#include "attnmerge/plan.h"
#include "dtypes.h"
#include "errors.h"

namespace attnmerge {
namespace detail {

// f(tag)'s status, ATTNMERGE_SUCCESS where f returns nothing.
template <typename F, typename Tag>
attnmerge_status call_with(F& f, Tag tag) {
  if constexpr (std::is_void<decltype(f(tag))>::value) {
    f(tag);
    return ATTNMERGE_SUCCESS;
  } else {
    return f(tag);
  }
}

// The one dispatch idiom: calls f with a value of the storage type of `dtype` (validated), so that
// `using T = decltype(tag)` names it, and returns its status (unknown_dtype's for a code with no
// type).  Inputs are float32, float16 or bfloat16; outputs also FP8.  These are the GPU's (and the
// CPU path's for float32 calls); float64 is the CPU path's alone (dispatch_cpu_in_dtype), so that
// no kernel is compiled for it.
template <typename F>
attnmerge_status dispatch_in_dtype(int dtype, F&& f) {
  switch (dtype) {
    case ATTNMERGE_FLOAT32: return call_with(f, float{});
    case ATTNMERGE_FLOAT16: return call_with(f, half_t{});
    case ATTNMERGE_BFLOAT16: return call_with(f, bfloat16_t{});
  }
  return unknown_dtype(dtype);
}

template <typename F>
attnmerge_status dispatch_out_dtype(int dtype, F&& f) {
  if (dtype == ATTNMERGE_FLOAT8_E4M3) return call_with(f, float8_e4m3_t{});
  return dispatch_in_dtype(dtype, f);
}

// What a call computes in: float32 (whatever its dtypes), or float64 where every O and LSE is
// float64 (validation decides, and refuses a mix).
enum class Precision : uint8_t { kFloat32, kFloat64 };

// Calls f with a value of the type a call of `precision` computes in and stores its LSEs in
// (float, or double for a float64 call), so that `using Real = decltype(tag)` names it.
template <typename F>
attnmerge_status dispatch_real(Precision precision, F&& f) {
  if (precision == Precision::kFloat64) return call_with(f, double{});
  return call_with(f, float{});
}

// The CPU path's dispatch for a call computing in Real: float64 storage alone for double (a
// float64 call is float64 throughout), the dispatch above for float.
template <typename Real, typename F>
attnmerge_status dispatch_cpu_in_dtype(int dtype, F&& f) {
  if constexpr (std::is_same<Real, double>::value) {
    return dtype == ATTNMERGE_FLOAT64 ? call_with(f, double{}) : unknown_dtype(dtype);
  } else {
    return dispatch_in_dtype(dtype, f);
  }
}

template <typename Real, typename F>
attnmerge_status dispatch_cpu_out_dtype(int dtype, F&& f) {
  if constexpr (std::is_same<Real, double>::value) {
    return dispatch_cpu_in_dtype<Real>(dtype, f);
  } else {
    return dispatch_out_dtype(dtype, f);
  }
}

// Every dtype the table lets an O be has a type above: validated calls never reach unknown_dtype.
// The GPU's are the dtypes that may live anywhere; float64 lives on the host.
constexpr uint32_t kGpuInDtypes = 1u << ATTNMERGE_FLOAT32 | 1u << ATTNMERGE_FLOAT16 | 1u << ATTNMERGE_BFLOAT16;
static_assert((dtypes_of(ATTNMERGE_ROLE_O_IN) & ~host_only_dtypes()) == kGpuInDtypes,
              "dispatch_in_dtype has a type for every O a merge reads on the GPU");
static_assert((dtypes_of(ATTNMERGE_ROLE_O_OUT) & ~host_only_dtypes()) == (kGpuInDtypes | 1u << ATTNMERGE_FLOAT8_E4M3),
              "dispatch_out_dtype has a type for every O a merge writes on the GPU");
static_assert(host_only_dtypes() == 1u << ATTNMERGE_FLOAT64 &&
                  (dtypes_of(ATTNMERGE_ROLE_O_IN) & host_only_dtypes()) == 1u << ATTNMERGE_FLOAT64 &&
                  (dtypes_of(ATTNMERGE_ROLE_O_OUT) & host_only_dtypes()) == 1u << ATTNMERGE_FLOAT64,
              "dispatch_cpu_in_dtype and dispatch_cpu_out_dtype have a type for every host-only O");

// Calls f with std::integral_constant<int, vec> for vec in {1, 2, 4, 8}.
template <typename F>
void dispatch_vec(int vec, F&& f) {
  switch (vec) {
    case 16: f(std::integral_constant<int, 16>{}); break;
    case 8: f(std::integral_constant<int, 8>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    default: f(std::integral_constant<int, 1>{}); break;
  }
}

// CPU path (merge_cpu.cpp): runs on the calling thread, and helpers for large inputs; fails only
// for a dtype with no type (unknown_dtype).  In Source::Real: float, or double for float64 calls.
template <typename Source>
attnmerge_status cpu_merge(const MergeShape& shape, const Source& src, const BasicOutView<typename Source::Real>& out,
                           int in_dtype, int out_dtype);

// The backward on the CPU (merge_backward_cpu.cpp); `states`: a row's states (the mean for the
// variable-length merge), for the thread count.  in_dtype: the inputs' O and their gradients';
// out_dtype: the forward's output and dO.
template <typename Src>
attnmerge_status cpu_merge_backward(const MergeShape& shape, const BackwardArgs<Src>& args, int64_t states,
                                    int in_dtype, int out_dtype);

// GPU path (merge_gpu.cu).  Every function restores the caller's current device.
int gpu_build_version();  // CUDART_VERSION of the toolkit that compiled the library
int gpu_device_count();
int gpu_driver_version();
int gpu_pointer_device(const void* ptr);  // ATTNMERGE_HOST unless device memory
// Checks that `ptr` is memory the GPU `device` can address; names `arg` (as `names` has it) in the error.
attnmerge_status gpu_check_pointer(const void* ptr, int device, const ArgNames& names, const char* arg);
// Plans the call (plan.h) and launches it on `stream`; records what it enqueued for
// attnmerge_last_launch.
template <typename Source>
attnmerge_status gpu_merge(const MergeShape& shape, const Source& src, const OutView& out, const CallFacts& facts,
                           int in_dtype, int out_dtype, int device, void* stream);
// The calling thread's record of its last op's launches; forget_launch() at the start of each op.
void forget_launch();
attnmerge_launch_info last_launch();
attnmerge_status gpu_stream_synchronize(int device, void* stream);
// For launches planned outside merge_gpu.cu: runs job(device's properties, ctx, info) with
// `device` current (the caller's restored after), where job returns its cudaError_t; a failure is
// reported naming `what`, a success records `info` for attnmerge_last_launch.
using GpuJob = int (*)(const DeviceInfo& device, void* ctx, attnmerge_launch_info* info);
attnmerge_status gpu_run(int device, GpuJob job, void* ctx, const char* what);
// Checks that `ptr` is memory the GPU `device` can read: its own, a peer's it can access, or managed
// memory (an exchange's ranks); names `name` in the error.
attnmerge_status gpu_check_peer_pointer(const void* ptr, int device, const char* name);

// The exchange (attnmerge.h's "Context parallelism on one node").  On the host (exchange.cpp): each
// call runs this rank's part on the calling thread, returns a failure it meets (recorded in the
// pad too) or one recorded before, and refuses a stale epoch first.  On the GPU (exchange_gpu.cu):
// launched on `stream`, failures recorded by the kernels.  exchange_status: the pad's record,
// described, then cleared; `device` ATTNMERGE_HOST for host pads.
attnmerge_status cpu_exchange_publish(const exchange::Sync& sync);
attnmerge_status cpu_merge_exchange(const MergeShape& shape, const ExchangeSource& src, const OutView& out,
                                    const exchange::Sync& sync, int in_dtype, int out_dtype);
attnmerge_status gpu_exchange_publish(const exchange::Sync& sync, int device, void* stream);
attnmerge_status gpu_merge_exchange(const MergeShape& shape, const ExchangeSource& src, const OutView& out,
                                    const exchange::Sync& sync, const CallFacts& facts, int in_dtype, int out_dtype,
                                    int device, void* stream);
attnmerge_status exchange_status(const exchange::Sync& sync, int device, void* stream);
// The words of a rank's failure record, as its calls return it: a timeout (ATTNMERGE_ERROR_TIMEOUT)
// or a stale epoch (ATTNMERGE_ERROR_VALUE), naming `rank`, the rank waited for and the epoch.
attnmerge_status exchange_failure(const exchange::Record& record, int rank);
// The record in a pad on the GPU (exchange_gpu.cu): read after the work before it on `stream`, and cleared.
attnmerge_status gpu_take_record(uint64_t* pad, int device, void* stream, exchange::Record& record);

// The backward on the GPU (merge_backward_gpu.cu): planned (plan_backward) and launched on `stream`.
template <typename Src>
attnmerge_status gpu_merge_backward(const MergeShape& shape, const BackwardArgs<Src>& args, int vec, bool pdl,
                                    int in_dtype, int out_dtype, int device, void* stream);

}  // namespace detail
}  // namespace attnmerge
