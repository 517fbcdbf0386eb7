// Argument rules of the C ABI (validate.h).
#include "validate.h"

#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdio>

namespace attnmerge {
namespace detail {

namespace {

// "float32, float16 or bfloat16": the names of a set of dtypes, for error messages.
struct DtypesText {
  char text[128];
  explicit DtypesText(uint32_t set) {
    int count = 0, n = 0;
    for (int i = 0; i < kDtypeCount; ++i) count += in_set(set, i);
    text[0] = '\0';
    for (int i = 0, k = 0; i < kDtypeCount && n < static_cast<int>(sizeof text); ++i) {
      if (!in_set(set, i)) continue;
      const char* separator = k == 0 ? "" : k == count - 1 ? " or " : ", ";
      n += std::snprintf(text + n, sizeof text - n, "%s%s", separator, dtype_name(i));
      ++k;
    }
  }
};

// "[4, 8, 128]" for error messages.
struct ShapeText {
  char text[128];
  ShapeText(const int64_t* shape, int ndim) {
    int n = std::snprintf(text, sizeof text, "[");
    for (int i = 0; i < ndim && n < static_cast<int>(sizeof text); ++i)
      n += std::snprintf(text + n, sizeof text - n, i ? ", %" PRId64 : "%" PRId64, shape[i]);
    if (n < static_cast<int>(sizeof text)) std::snprintf(text + n, sizeof text - n, "]");
  }
};

}  // namespace

attnmerge_status describe(const attnmerge_tensor* t, const char* name, int ndim, uint32_t dtypes, bool transpose,
                          bool optional, View& v) {
  v = View{};
  v.name = name;
  if (t == nullptr) {
    if (optional) return ATTNMERGE_SUCCESS;
    return fail(ATTNMERGE_ERROR_TYPE, "%s: expected a tensor, got NULL", name);
  }
  v.t = t;
  v.ndim = ndim;
  v.transposed = transpose;
  if (t->ndim != ndim) return fail(ATTNMERGE_ERROR_VALUE, "%s: expected %d dimensions, got %d", name, ndim, t->ndim);
  if (!in_set(dtypes, t->dtype))
    return fail(ATTNMERGE_ERROR_TYPE, "%s: expected dtype %s, got %s", name, DtypesText(dtypes).text,
                dtype_name(t->dtype));
  constexpr uint32_t kTensorFlags = ATTNMERGE_READ_ONLY | ATTNMERGE_DEVICE_KNOWN;
  if (t->flags & ~kTensorFlags)
    return fail(ATTNMERGE_ERROR_VALUE, "%s: expected flags within 0x%x, got 0x%x", name, kTensorFlags, t->flags);
  if (t->device < ATTNMERGE_HOST)
    return fail(ATTNMERGE_ERROR_VALUE, "%s: expected a device >= -1 (the host), got %d", name, t->device);
  for (int i = 0; i < ndim; ++i) {
    const int src = transpose ? 1 - i : i;
    v.shape[i] = t->shape[src];
    v.strides[i] = t->strides[src];
    if (t->shape[i] < 0)
      return fail(ATTNMERGE_ERROR_VALUE, "%s: expected sizes >= 0, got shape %s", name, ShapeText(t->shape, ndim).text);
  }
  v.empty = std::find(v.shape, v.shape + ndim, 0) != v.shape + ndim;
  if (v.empty) return ATTNMERGE_SUCCESS;  // never addressed: its strides and pointer do not matter
  int64_t count = 1;
  for (int i = 0; i < ndim; ++i)
    if (__builtin_mul_overflow(count, v.shape[i], &count))
      return fail(ATTNMERGE_ERROR_VALUE, "%s: expected fewer than 2^63 elements, got shape %s", name,
                  ShapeText(t->shape, ndim).text);
  for (int i = 0; i < ndim; ++i)
    if (t->strides[i] < 0)
      return fail(ATTNMERGE_ERROR_VALUE, "%s: expected strides >= 0, got %" PRId64 " on axis %d", name, t->strides[i],
                  i);
  const bool is_o = dtypes == kInputs || dtypes == kOutputs;  // head_size is the last axis
  if (is_o && t->strides[ndim - 1] != 1 && t->shape[ndim - 1] > 1)
    return fail(ATTNMERGE_ERROR_VALUE, "%s: expected a unit stride on the head_size axis, got stride %" PRId64, name,
                t->strides[ndim - 1]);
  if (t->data == nullptr) return fail(ATTNMERGE_ERROR_VALUE, "%s: expected a data pointer, got NULL", name);
  const std::size_t size = dtype_size(t->dtype);
  if (reinterpret_cast<uintptr_t>(t->data) % size != 0)
    return fail(ATTNMERGE_ERROR_VALUE, "%s: expected a data pointer aligned to %zu bytes, got %p", name, size, t->data);
  int64_t last = 0, term;  // the largest byte offset must fit in 63 bits
  for (int i = 0; i < ndim; ++i)
    if (__builtin_mul_overflow(v.shape[i] - 1, v.strides[i], &term) || __builtin_add_overflow(last, term, &last) ||
        __builtin_add_overflow(last, 1, &term) || __builtin_mul_overflow(term, static_cast<int64_t>(size), &term))
      return fail(ATTNMERGE_ERROR_VALUE, "%s: shape %s with these strides spans more than 2^63 bytes", name,
                  ShapeText(t->shape, ndim).text);
  v.last = last;
  return ATTNMERGE_SUCCESS;
}

// The largest head_size: a row's packs span at most 65535 blocks of 256 threads.
constexpr int64_t kMaxHeadSize = int64_t{65535} * 256;

attnmerge_status check_head_size(const char* name, int64_t head_size) {
  if (head_size >= 1 && head_size <= kMaxHeadSize) return ATTNMERGE_SUCCESS;
  return fail(ATTNMERGE_ERROR_VALUE, "%s: expected a head_size from 1 to %" PRId64 ", got %" PRId64, name, kMaxHeadSize,
              head_size);
}

attnmerge_status check_shape(const View& v, const int64_t* expected, const View& source) {
  if (!v.present() || std::equal(expected, expected + v.ndim, v.shape)) return ATTNMERGE_SUCCESS;
  int64_t want[ATTNMERGE_MAX_NDIM] = {};
  std::copy(expected, expected + v.ndim, want);
  if (v.transposed) std::swap(want[0], want[1]);  // speak in the caller's layout
  return fail(ATTNMERGE_ERROR_VALUE, "%s: expected shape %s (the sizes of %s, shape %s), got %s", v.name,
              ShapeText(want, v.ndim).text, source.name, ShapeText(source.t->shape, source.ndim).text,
              ShapeText(v.t->shape, v.ndim).text);
}

attnmerge_status check_no_self_overlap(const View& v) {
  if (!v.present() || v.empty) return ATTNMERGE_SUCCESS;
  int order[ATTNMERGE_MAX_NDIM] = {0, 1, 2, 3};
  for (int i = 1; i < v.ndim; ++i)  // insertion sort of at most 4 axes by stride
    for (int j = i; j > 0 && v.strides[order[j]] < v.strides[order[j - 1]]; --j) std::swap(order[j], order[j - 1]);
  int64_t extent = 1;
  for (int k = 0; k < v.ndim; ++k) {
    const int i = order[k];
    if (v.shape[i] <= 1) continue;
    if (v.strides[i] < extent)
      return fail(ATTNMERGE_ERROR_VALUE,
                  "%s: expected an output whose elements do not overlap, got stride %" PRId64
                  " on an axis of size %" PRId64 " (shape %s)",
                  v.name, v.strides[i], v.shape[i], ShapeText(v.t->shape, v.ndim).text);
    extent = v.strides[i] * (v.shape[i] - 1) + extent;
  }
  return ATTNMERGE_SUCCESS;
}

bool same_view(const View& x, const View& y) {
  return x.t->data == y.t->data && x.t->dtype == y.t->dtype && x.ndim == y.ndim &&
         std::equal(x.shape, x.shape + x.ndim, y.shape) && std::equal(x.strides, x.strides + x.ndim, y.strides);
}

attnmerge_status check_disjoint(const View& out, const View& other, bool may_alias) {
  if (!out.present() || !other.present() || out.empty || other.empty) return ATTNMERGE_SUCCESS;
  if (may_alias && same_view(out, other)) return ATTNMERGE_SUCCESS;
  uintptr_t lo1, hi1, lo2, hi2;
  out.byte_range(lo1, hi1);
  other.byte_range(lo2, hi2);
  if (lo1 < hi2 && lo2 < hi1)
    return fail(ATTNMERGE_ERROR_VALUE, "%s: expected memory disjoint from %s%s, got overlapping ranges", out.name,
                other.name, may_alias ? " (or the very same view)" : "");
  return ATTNMERGE_SUCCESS;
}

attnmerge_status read_options(const attnmerge_options* options, uint32_t allowed, const View& out,
                              attnmerge_options& opt, float& inv_scale) {
  opt = options ? *options : attnmerge_options{};
  if (opt.struct_size != 0 && opt.struct_size != sizeof(attnmerge_options))
    return fail(ATTNMERGE_ERROR_VALUE,
                "options.struct_size: expected 0 or %u (this library's attnmerge_options), got %u",
                static_cast<unsigned>(sizeof(attnmerge_options)), opt.struct_size);
  if (opt.flags & ~allowed)
    return fail(ATTNMERGE_ERROR_VALUE, "options.flags: expected flags within 0x%x for this op, got 0x%x", allowed,
                opt.flags);
  const float scale = opt.output_scale;
  const bool fp8 = out.t->dtype == ATTNMERGE_FLOAT8_E4M3;
  if (scale != 0.0f && scale != 1.0f && !fp8)
    return fail(ATTNMERGE_ERROR_VALUE, "output_scale: expected none (or 1) for a %s output, got %g",
                dtype_name(out.t->dtype), scale);
  if (opt.output_scale_ptr != nullptr && !fp8)
    return fail(ATTNMERGE_ERROR_VALUE, "output_scale: expected none for a %s output, got a scale in memory",
                dtype_name(out.t->dtype));
  if (opt.output_scale_ptr != nullptr && scale != 0.0f)
    return fail(ATTNMERGE_ERROR_VALUE, "output_scale: expected a value or a pointer, got both");
  if (reinterpret_cast<uintptr_t>(opt.output_scale_ptr) % alignof(float) != 0)
    return fail(ATTNMERGE_ERROR_VALUE, "output_scale: expected a pointer aligned to 4 bytes, got %p",
                static_cast<const void*>(opt.output_scale_ptr));
  if (!(scale >= 0.0f) || std::isinf(scale))
    return fail(ATTNMERGE_ERROR_VALUE, "output_scale: expected a finite scale > 0, got %g", scale);
  inv_scale = scale == 0.0f ? 1.0f : 1.0f / scale;
  return ATTNMERGE_SUCCESS;
}

attnmerge_status check_outputs(const View& out, const View& out_lse) {
  for (const View* v : {&out, &out_lse})
    if (v->present() && (v->t->flags & ATTNMERGE_READ_ONLY))
      return fail(ATTNMERGE_ERROR_VALUE, "%s: expected a writable tensor, got a read-only one", v->name);
  attnmerge_status s;
  if ((s = check_no_self_overlap(out)) || (s = check_no_self_overlap(out_lse)) ||
      (s = check_disjoint(out_lse, out, false)))
    return s;
  return ATTNMERGE_SUCCESS;
}

attnmerge_status check_a_shapes(const attnmerge_options& opt, const int64_t (&o_shape)[3], const View& vb,
                                const View& va, const View& vla, int64_t& a_tokens) {
  const int64_t tokens = o_shape[0], heads = o_shape[1], head_size = o_shape[2];
  a_tokens = tokens;
  if (!(opt.flags & ATTNMERGE_A_TOKENS)) {
    attnmerge_status s;
    if ((s = check_shape(va, o_shape, vb)) || (s = check_shape(vla, o_shape, vb))) return s;
    return ATTNMERGE_SUCCESS;
  }
  if (opt.a_tokens < 0 || opt.a_tokens > tokens)
    return fail(ATTNMERGE_ERROR_VALUE, "a_tokens: expected 0 to the %" PRId64 " tokens of %s, got %" PRId64, tokens,
                vb.name, opt.a_tokens);
  a_tokens = opt.a_tokens;
  for (const View* v : {&va, &vla})  // a needs only its first a_tokens tokens
    if (v->shape[0] < a_tokens || v->shape[1] != heads || (v->ndim == 3 && v->shape[2] != head_size))
      return fail(ATTNMERGE_ERROR_VALUE,
                  "%s: expected at least %" PRId64 " tokens (a_tokens), %" PRId64 " heads%s, got shape %s", v->name,
                  a_tokens, heads, v->ndim == 3 ? " and the head_size of o_b" : "",
                  ShapeText(v->t->shape, v->ndim).text);
  return ATTNMERGE_SUCCESS;
}

attnmerge_status check_indptr(const View& vi, const attnmerge_tensor* out, int64_t rows, int64_t total) {
  const attnmerge_tensor* indptr = vi.t;
  const bool wide = indptr->dtype == ATTNMERGE_INT64;
  if (indptr->device == ATTNMERGE_HOST && out->device == ATTNMERGE_HOST &&
      ((indptr->flags & ATTNMERGE_DEVICE_KNOWN) || gpu_pointer_device(indptr->data) == ATTNMERGE_HOST)) {
    int64_t previous = 0;
    for (int64_t r = 0; r <= rows; ++r) {
      const int64_t v = wide ? static_cast<const int64_t*>(indptr->data)[r * vi.strides[0]]
                             : static_cast<const int32_t*>(indptr->data)[r * vi.strides[0]];
      if (v < previous || v > total)
        return fail(ATTNMERGE_ERROR_VALUE,
                    "indptr: expected non-decreasing offsets from 0 or more up to the %" PRId64
                    " states of o, got indptr[%" PRId64 "] = %" PRId64 "%s",
                    total, r, v,
                    v > total ? " (past the end)"
                    : r == 0  ? " (below 0)"
                              : " (decreasing)");
      previous = v;
    }
  }
  return ATTNMERGE_SUCCESS;
}

attnmerge_status check_dtype_of(const View& v, const View& like) {
  if (!v.present() || v.t->dtype == like.t->dtype) return ATTNMERGE_SUCCESS;
  return fail(ATTNMERGE_ERROR_TYPE, "%s: expected the dtype of %s (%s), got %s", v.name, like.name,
              dtype_name(like.t->dtype), dtype_name(v.t->dtype));
}

attnmerge_status check_grads(std::initializer_list<const View*> grads, std::initializer_list<const View*> inputs) {
  attnmerge_status s;
  for (const View* g : grads) {
    if (g->present() && (g->t->flags & ATTNMERGE_READ_ONLY))
      return fail(ATTNMERGE_ERROR_VALUE, "%s: expected a writable tensor, got a read-only one", g->name);
    if ((s = check_no_self_overlap(*g))) return s;
  }
  for (const View* g : grads) {
    for (const View* h : grads)
      if (h != g && (s = check_disjoint(*g, *h, false))) return s;
    for (const View* in : inputs)
      if ((s = check_disjoint(*g, *in, false))) return s;
  }
  return ATTNMERGE_SUCCESS;
}

attnmerge_status describe_backward_outputs(const attnmerge_tensor* grad_out, const attnmerge_tensor* grad_out_lse,
                                           const attnmerge_tensor* out, const attnmerge_tensor* out_lse,
                                           bool heads_first, BackwardViews& v) {
  attnmerge_status s;
  if ((s = describe(grad_out, "grad_out", 3, kInputs, false, false, v.grad_out)) ||
      (s = describe(grad_out_lse, "grad_out_lse", 2, kLse, heads_first, true, v.grad_out_lse)) ||
      (s = describe(out, "out", 3, kInputs, false, true, v.out)) ||
      (s = describe(out_lse, "out_lse", 2, kLse, heads_first, false, v.out_lse)) ||
      (v.out.present() && (s = check_dtype_of(v.grad_out, v.out))))
    return s;
  return ATTNMERGE_SUCCESS;
}

attnmerge_status check_backward_shapes(const BackwardViews& v, const int64_t (&out_shape)[3], const View& source) {
  attnmerge_status s;
  for (const View* w : {&v.grad_out, &v.grad_out_lse, &v.out, &v.out_lse})
    if ((s = check_shape(*w, out_shape, source))) return s;
  return ATTNMERGE_SUCCESS;
}

attnmerge_status read_backward_options(const attnmerge_options* options, uint32_t allowed, const View& out,
                                       attnmerge_options& opt) {
  float inv_scale;
  return read_options(options, allowed, out, opt, inv_scale);
}

}  // namespace detail
}  // namespace attnmerge
