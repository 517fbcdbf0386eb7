// Where a validated call runs: one device for every tensor, memory it can address, then the CPU
// path or a GPU launch.
#pragma once

#include <algorithm>
#include <initializer_list>

#include "validate.h"

namespace attnmerge {
namespace detail {

// One device for every non-empty tensor, and memory it can address (`scale`: the output scale in
// memory, or null): `device` (ATTNMERGE_HOST for the CPU path).  go: there is work to do (some
// tensor is not empty and no_rows is false); nothing is checked beyond the devices' agreement
// where there is not.
attnmerge_status locate(std::initializer_list<const View*> views, const float* scale, bool no_rows, int& device,
                        bool& go);

// The widest vector (elements) that every O tensor's pointer, strides and head_size allow,
// within 16 bytes per access.
int choose_vec(std::initializer_list<const View*> os, int64_t head_size);

// One device for every non-empty tensor, memory it can address, then the CPU path or a launch.
template <typename Source>
attnmerge_status run(std::initializer_list<const View*> views, const MergeShape& shape, const Source& src,
                     const OutView& out, int in_dtype, int out_dtype, int vec, void* stream, uint32_t flags) {
  // What the launch plan needs to know of the arrays (plan.h).
  CallFacts facts;
  facts.vec = vec;
  facts.pdl = (flags & ATTNMERGE_PDL) != 0;
  for (const View* v : views) {
    if (!v->present() || v->empty) continue;
    facts.max_offset = std::max(facts.max_offset, v->last);
    const int64_t span = (v->last + 1) * static_cast<int64_t>(dtype_size(v->t->dtype));  // < 2^63 (describe)
    if (__builtin_add_overflow(facts.bytes, span, &facts.bytes)) facts.bytes = INT64_MAX;
    if (v->ndim == 2 && v->strides[0] < v->strides[1]) facts.lse_tokens_inner = true;
  }
  int device;
  bool go;
  attnmerge_status s = locate(views, out.scale, shape.rows == 0, device, go);
  if (s || !go) return s;
  if (device == ATTNMERGE_HOST) {
    cpu_merge(shape, src, out, in_dtype, out_dtype);
    return ATTNMERGE_SUCCESS;
  }
  return gpu_merge(shape, src, out, facts, in_dtype, out_dtype, device, stream);
}

// One device for every non-empty tensor, memory it can address, then the CPU loop or the launch
// (nothing to do where no gradient is asked for).
template <typename Src>
attnmerge_status run_backward(std::initializer_list<const View*> views, const MergeShape& shape,
                              const BackwardArgs<Src>& args, int64_t states, int in_dtype, int out_dtype, int vec,
                              void* stream, uint32_t flags) {
  int device;
  bool go;
  attnmerge_status s = locate(views, nullptr, shape.rows == 0, device, go);
  if (s || !go || (!args.want_o && !args.want_lse)) return s;
  if (device == ATTNMERGE_HOST) {
    cpu_merge_backward(shape, args, states, in_dtype, out_dtype);
    return ATTNMERGE_SUCCESS;
  }
  return gpu_merge_backward(shape, args, vec, (flags & ATTNMERGE_PDL) != 0, in_dtype, out_dtype, device, stream);
}

}  // namespace detail
}  // namespace attnmerge
