// Argument rules of the C ABI: a tensor described against what its argument must be, shapes,
// overlaps, aliasing and options; every check names the argument and writes nothing.
#pragma once

#include <cstdint>
#include <initializer_list>

#include "internal.h"

namespace attnmerge {
namespace detail {

// Sets of dtypes an argument may have (dtypes.h).
constexpr uint32_t kInputs = dtypes_of(ATTNMERGE_ROLE_O_IN);
constexpr uint32_t kOutputs = dtypes_of(ATTNMERGE_ROLE_O_OUT);
constexpr uint32_t kLse = dtypes_of(ATTNMERGE_ROLE_LSE);
constexpr uint32_t kMask = dtypes_of(ATTNMERGE_ROLE_MASK);
constexpr uint32_t kIndex = dtypes_of(ATTNMERGE_ROLE_INDPTR);

// A tensor as an op reads it: shape and strides in the op's logical axis order.
struct View {
  const attnmerge_tensor* t = nullptr;
  const char* name = "";
  int64_t shape[ATTNMERGE_MAX_NDIM] = {};
  int64_t strides[ATTNMERGE_MAX_NDIM] = {};
  int ndim = 0;
  bool transposed = false;  // an LSE given [heads, tokens]

  bool present() const { return t != nullptr; }
  bool empty = true;  // some size is 0 (set by describe, which also bounds the element count)
  int64_t last = 0;  // the largest element offset, when not empty
  // [first byte, one past the last byte] the view spans; not empty.
  void byte_range(uintptr_t& lo, uintptr_t& hi) const {
    int64_t last = 0;
    for (int i = 0; i < ndim; ++i) last += (shape[i] - 1) * strides[i];
    lo = reinterpret_cast<uintptr_t>(t->data);
    hi = lo + static_cast<uintptr_t>(last + 1) * dtype_size(t->dtype);
  }
  StateView state(const View& lse) const {
    return StateView{t->data,        strides[0],    strides[1], static_cast<const float*>(lse.t->data),
                     lse.strides[0], lse.strides[1]};
  }
};

// What every backward reads beside the forward's inputs: the incoming gradients (dO, dLSE) and
// the forward's outputs (O, LSE), all [rows, heads, ...].
struct BackwardViews {
  View grad_out, grad_out_lse, out, out_lse;
};

// Checks what one tensor can be checked for alone and fills `v` (swapping the two axes of an LSE
// given [heads, tokens]).  A NULL descriptor is an error unless the argument is optional.
attnmerge_status describe(const attnmerge_tensor* t, const char* name, int ndim, uint32_t dtypes, bool transpose,
                          bool optional, View& v);

attnmerge_status check_head_size(const char* name, int64_t head_size);

// v's logical shape must be `expected`, the sizes taken from `source`.
attnmerge_status check_shape(const View& v, const int64_t* expected, const View& source);

// An output must not write one element twice: after sorting its axes by stride, each stride must
// clear the extent of the axes inside it.
attnmerge_status check_no_self_overlap(const View& v);

bool same_view(const View& x, const View& y);

// An output may be an input itself where `may_alias` (element i is written after element i was
// read), never a partial overlap of one, nor overlap another output.
attnmerge_status check_disjoint(const View& out, const View& other, bool may_alias);

// Options every op shares, validated.  `allowed` are the flags the op understands.
attnmerge_status read_options(const attnmerge_options* options, uint32_t allowed, const View& out,
                              attnmerge_options& opt, float& inv_scale);

// Outputs: writable, no element written twice, out and out_lse apart.
attnmerge_status check_outputs(const View& out, const View& out_lse);

// The shapes of a two-way merge's state a (o_a, lse_a), whose tokens are limited to
// options.a_tokens with ATTNMERGE_A_TOKENS: `a_tokens` set to the tokens of a that are read.
attnmerge_status check_a_shapes(const attnmerge_options& opt, const int64_t (&o_shape)[3], const View& vb,
                                const View& va, const View& vla, int64_t& a_tokens);

// A variable-length merge's indptr [rows + 1] against the `total` states of o: on the host the
// offsets can be checked before anything is written (on the GPU they are clamped, never read back).
attnmerge_status check_indptr(const View& vi, const attnmerge_tensor* out, int64_t rows, int64_t total);

// `v` (if given) has the dtype of `like`.
attnmerge_status check_dtype_of(const View& v, const View& like);

// The gradients a backward writes: writable, no element written twice, apart from each other and
// from every input (no in-place backward: dO and O are read again for rows of many states).
attnmerge_status check_grads(std::initializer_list<const View*> grads, std::initializer_list<const View*> inputs);

// Described: grad_out_lse optional (dLSE = 0), out optional (<dO, O> from the states instead);
// grad_out in the dtype of out, which has a gradient: not FP8.
attnmerge_status describe_backward_outputs(const attnmerge_tensor* grad_out, const attnmerge_tensor* grad_out_lse,
                                           const attnmerge_tensor* out, const attnmerge_tensor* out_lse,
                                           bool heads_first, BackwardViews& v);

// Each of them of `out_shape` (sizes from `source`).
attnmerge_status check_backward_shapes(const BackwardViews& v, const int64_t (&out_shape)[3], const View& source);

// An FP8 output, hence an output scale, has no gradient: read_options refuses a scale for the
// (never FP8) grad_out.
attnmerge_status read_backward_options(const attnmerge_options* options, uint32_t allowed, const View& out,
                                       attnmerge_options& opt);

}  // namespace detail
}  // namespace attnmerge
