// The GPU dispatch of a state's share of an N-way merge (ShareSource).
#include "merge_gpu.cuh"

namespace attnmerge {
namespace detail {

template attnmerge_status gpu_merge<ShareSource>(const MergeShape&, const ShareSource&, const OutView&, const CallFacts&, int,
                                          int, int, void*);

}  // namespace detail
}  // namespace attnmerge
