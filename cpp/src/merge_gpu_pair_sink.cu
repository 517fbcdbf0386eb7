// The GPU dispatch of the two-way merge with a sink (SinkPairSource), a unit of its own: the kernels
// of the two-way merge without one (merge_gpu_pair.cu) carry nothing of it.
#include "merge_gpu.cuh"

namespace attnmerge {
namespace detail {

template attnmerge_status gpu_merge<SinkPairSource>(const MergeShape&, const SinkPairSource&, const OutView&,
                                                    const CallFacts&, int, int, int, void*);

}  // namespace detail
}  // namespace attnmerge
