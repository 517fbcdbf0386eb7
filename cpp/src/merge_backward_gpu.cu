// The GPU path of the backward: the dispatch of the header-only backward kernel over (input dtype,
// output dtype, vector width), run through gpu_run (merge_gpu.cu: device selection, errors, the
// launch record).  Its own translation unit, so that it compiles beside the forward's.
#include <cuda_runtime.h>

#include "attnmerge/merge_backward_kernels.cuh"
#include "internal.h"

namespace attnmerge {
namespace detail {
namespace {

template <typename Src>
struct BackwardJob {
  const MergeShape& shape;
  const BackwardArgs<Src>& args;
  int vec;
  bool pdl;
  int in_dtype, out_dtype;
  cudaStream_t stream;
};

template <typename Src>
int run_backward(const DeviceInfo& device, void* ctx, attnmerge_launch_info* info) {
  const BackwardJob<Src>& job = *static_cast<const BackwardJob<Src>*>(ctx);
  const BackwardPlan plan = plan_backward(job.shape, backward_facts(job.args, job.vec, job.pdl), device);
  cudaError_t err = cudaSuccess;
  dispatch_in_dtype(job.in_dtype, [&](auto in_tag) {
    dispatch_in_dtype(job.out_dtype, [&](auto out_tag) {
      dispatch_vec(plan.vec, [&](auto vec_tag) {
        using TIn = decltype(in_tag);
        using TOut = decltype(out_tag);
        constexpr int kVec = decltype(vec_tag)::value;
        // Wider than 16 bytes per access is never chosen; do not instantiate it.
        if constexpr (kVec * sizeof(TIn) <= 16 && kVec * sizeof(TOut) <= 16)
          err = launch_merge_backward<TIn, TOut, kVec>(plan, job.args, job.stream);
      });
    });
  });
  info->kernel = plan.launches ? ATTNMERGE_KERNEL_BACKWARD : ATTNMERGE_KERNEL_NONE;
  info->launches = plan.launches;
  info->state_groups = plan.groups;
  info->index_bits = 64;
  info->vec = plan.vec;
  info->pdl = plan.pdl ? 1 : 0;
  for (int i = 0; i < 3; ++i) info->grid[i] = plan.dims.grid[i], info->block[i] = plan.dims.block[i];
  return static_cast<int>(err);
}

}  // namespace

template <typename Src>
attnmerge_status gpu_merge_backward(const MergeShape& shape, const BackwardArgs<Src>& args, int vec, bool pdl,
                                    int in_dtype, int out_dtype, int device, void* stream) {
  const auto known = [](auto) {};  // both codes name a type before anything is planned
  attnmerge_status status;
  if ((status = dispatch_in_dtype(in_dtype, known)) || (status = dispatch_in_dtype(out_dtype, known))) return status;
  BackwardJob<Src> job{shape, args, vec, pdl, in_dtype, out_dtype, static_cast<cudaStream_t>(stream)};
  return gpu_run(device, &run_backward<Src>, &job,
                 "launching the merge backward kernel (possibly an earlier, sticky error of other work)");
}

template attnmerge_status gpu_merge_backward<PairBackward>(const MergeShape&, const BackwardArgs<PairBackward>&, int, bool,
                                                           int, int, int, void*);
template attnmerge_status gpu_merge_backward<StackBackward>(const MergeShape&, const BackwardArgs<StackBackward>&, int, bool,
                                                           int, int, int, void*);
template attnmerge_status gpu_merge_backward<RangeBackward>(const MergeShape&, const BackwardArgs<RangeBackward>&, int, bool,
                                                           int, int, int, void*);

}  // namespace detail
}  // namespace attnmerge
