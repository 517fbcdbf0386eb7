// The GPU dispatch of the two-way and in-place merges (PairSource).
#include "merge_gpu.cuh"

namespace attnmerge {
namespace detail {

template attnmerge_status gpu_merge<PairSource>(const MergeShape&, const PairSource&, const OutView&, const CallFacts&, int,
                                          int, int, void*);

}  // namespace detail
}  // namespace attnmerge
