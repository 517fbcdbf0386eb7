// The GPU dispatch of the variable-length merge (RangeSource).
#include "merge_gpu.cuh"

namespace attnmerge {
namespace detail {

template attnmerge_status gpu_merge<RangeSource>(const MergeShape&, const RangeSource&, const OutView&, const CallFacts&, int,
                                          int, int, void*);

}  // namespace detail
}  // namespace attnmerge
