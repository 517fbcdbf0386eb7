// Where a validated call runs: one device for every tensor and memory it can address, then the CPU
// path or a GPU launch, with what the launch plan (plan.h) needs to know of the arrays.
#pragma once

#include "cpu_parallel.h"
#include "validate.h"

namespace attnmerge {
namespace detail {

// One device for every non-empty tensor, and memory it can address (`scale`: the output scale in
// memory, or null): `device` (ATTNMERGE_HOST for the CPU path), which takes every tensor's dtype
// (host-only dtypes, float64, on the host).  go: there is work to do (some tensor is not empty and
// no_rows is false); nothing is checked beyond the devices' agreement and dtypes where there is not.
attnmerge_status locate(Views views, const float* scale, bool no_rows, int& device, bool& go);

// What the launch plan needs to know of the arrays of a forward call (plan.h).
CallFacts call_facts(Views views, int64_t head_size, uint32_t flags);

// Whether calls computing in Real may run on a GPU: float ones; float64 ones (double) run on the
// CPU path alone, and locate() refuses their GPU tensors, so no kernel is compiled for them.
template <typename Real>
constexpr bool runs_on_gpu() {
  return std::is_same<Real, float>::value;
}

// A forward merge: on its device, the CPU path or a launch.
template <typename Source>
attnmerge_status run(Views views, const MergeShape& shape, const Source& src,
                     const BasicOutView<typename Source::Real>& out, int in_dtype, int out_dtype, void* stream,
                     uint32_t flags) {
  int device;
  bool go;
  // The output scale in memory, or NVFP4's global one (out_view keeps it apart from the merge's weights).
  attnmerge_status s = locate(views, out.scale != nullptr ? out.scale : out.global_ptr, shape.rows == 0, device, go);
  if (s || !go) return s;
  if (device == ATTNMERGE_HOST) {
    if ((s = check_cpu_threads())) return s;
    return cpu_merge(shape, src, out, in_dtype, out_dtype);
  }
  if constexpr (runs_on_gpu<typename Source::Real>()) {
    return gpu_merge(shape, src, out, call_facts(views, shape.head_size, flags), in_dtype, out_dtype, device, stream);
  } else {
    return unknown_dtype(in_dtype);  // not reached: locate() keeps float64 on the host
  }
}

// An exchange's device, this rank's (its layouts'; for the merge also its tensors', by locate's
// rule), then every rank's pointers the op reads, unless the layout vouches for them
// (ATTNMERGE_DEVICE_KNOWN): host memory for the CPU path; on a GPU, memory of this device, of a
// device it can access as a peer, or managed memory.  `scale`: the output scale in memory, or null.
attnmerge_status locate_exchange(Views views, const float* scale, const attnmerge_exchange* x, ExchangeUse use,
                                 int& device);

// What the launch plan (plan_exchange) needs of an exchange's merge: the vector width (16-byte
// loads of every rank's O, and stores of out they allow, or one element), PDL.
CallFacts exchange_facts(Views views, const attnmerge_exchange* x, int64_t head_size, int out_dtype, uint32_t flags);

// An exchange's merge, on this rank's device: the CPU path (the calling thread waits) or the launch.
attnmerge_status run_exchange(Views views, const MergeShape& shape, const ExchangeSource& src, const OutView& out,
                              const exchange::Sync& sync, const attnmerge_exchange* x, int in_dtype, int out_dtype,
                              void* stream, uint32_t flags);

// A backward: on its device, the CPU loop or the launch (nothing to do where no gradient is asked
// for).  `states`: a row's states (the mean for the variable-length merge), for the CPU's threads.
template <typename Src>
attnmerge_status run_backward(Views views, const MergeShape& shape, const BackwardArgs<Src>& args, int64_t states,
                              int in_dtype, int out_dtype, void* stream, uint32_t flags) {
  int device;
  bool go;
  attnmerge_status s = locate(views, nullptr, shape.rows == 0, device, go);
  if (s || !go || (!args.want_o && !args.want_lse)) return s;
  if (device == ATTNMERGE_HOST) {
    if ((s = check_cpu_threads())) return s;
    return cpu_merge_backward(shape, args, states, in_dtype, out_dtype);
  }
  if constexpr (runs_on_gpu<typename Src::Real>()) {
    return gpu_merge_backward(shape, args, choose_vec(views, shape.head_size), (flags & ATTNMERGE_PDL) != 0,
                              in_dtype, out_dtype, device, stream);
  } else {
    return unknown_dtype(in_dtype);  // not reached: locate() keeps float64 on the host
  }
}

}  // namespace detail
}  // namespace attnmerge
