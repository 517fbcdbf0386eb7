// The GPU dispatch of the N-way merge (StackSource).
#include "merge_gpu.cuh"

namespace attnmerge {
namespace detail {

template attnmerge_status gpu_merge<StackSource>(const MergeShape&, const StackSource&, const OutView&, const CallFacts&, int,
                                          int, int, void*);

}  // namespace detail
}  // namespace attnmerge
