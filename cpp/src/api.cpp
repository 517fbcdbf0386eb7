// The C ABI of libattnmerge: every argument is validated here, once, before anything is written;
// then the call goes to the CPU path or the GPU launchers.
#include <algorithm>
#include <cinttypes>
#include <cstdarg>
#include <cstdio>
#include <cstring>

#include "internal.h"

#ifndef ATTNMERGE_CUDA_ARCHS
#define ATTNMERGE_CUDA_ARCHS "unknown"
#endif

namespace attnmerge {
namespace detail {

namespace {
thread_local char g_error[1024] = "";
}  // namespace

attnmerge_status fail(attnmerge_status status, const char* fmt, ...) {
  va_list args;
  va_start(args, fmt);
  std::vsnprintf(g_error, sizeof g_error, fmt, args);
  va_end(args);
  return status;
}

const char* dtype_name(int dtype) {
  switch (dtype) {
    case ATTNMERGE_FLOAT32: return "float32";
    case ATTNMERGE_FLOAT16: return "float16";
    case ATTNMERGE_BFLOAT16: return "bfloat16";
    default: return "unknown";
  }
}

namespace {

bool is_float_dtype(int dtype) {
  return dtype == ATTNMERGE_FLOAT32 || dtype == ATTNMERGE_FLOAT16 || dtype == ATTNMERGE_BFLOAT16;
}

// "[4, 8, 128]" for error messages.
struct ShapeText {
  char text[96];
  ShapeText(const int64_t* shape, int ndim) {
    int n = std::snprintf(text, sizeof text, "[");
    for (int i = 0; i < ndim && n < static_cast<int>(sizeof text); ++i)
      n += std::snprintf(text + n, sizeof text - n, i ? ", %" PRId64 : "%" PRId64, shape[i]);
    if (n < static_cast<int>(sizeof text)) std::snprintf(text + n, sizeof text - n, "]");
  }
};

// A tensor as the merge reads it: logical [tokens, heads(, head_size)] order, strides in elements.
struct View {
  const attnmerge_tensor* t;
  const char* name;
  int64_t shape[ATTNMERGE_MAX_NDIM];
  int64_t strides[ATTNMERGE_MAX_NDIM];
  int ndim;
  bool present() const { return t != nullptr; }
  int64_t numel() const {
    int64_t n = 1;
    for (int i = 0; i < ndim; ++i) n *= shape[i];
    return n;
  }
  // [first byte, one past the last byte] touched by the view; numel() > 0.
  void byte_range(uintptr_t& lo, uintptr_t& hi) const {
    int64_t last = 0;
    for (int i = 0; i < ndim; ++i) last += (shape[i] - 1) * strides[i];
    lo = reinterpret_cast<uintptr_t>(t->data);
    hi = lo + static_cast<uintptr_t>(last + 1) * dtype_size(t->dtype);
  }
};

attnmerge_status check_descriptor(const attnmerge_tensor* t, const char* name, int ndim, bool heads_first, View& v) {
  v.t = t;
  v.name = name;
  v.ndim = ndim;
  if (t->ndim != ndim) return fail(ATTNMERGE_ERROR_VALUE, "%s: expected %d dimensions, got %d", name, ndim, t->ndim);
  for (int i = 0; i < ndim; ++i) {
    // LSE laid out [heads, tokens]: read it as its transpose.
    const int src = (heads_first && ndim == 2) ? 1 - i : i;
    v.shape[i] = t->shape[src];
    v.strides[i] = t->strides[src];
    if (t->shape[i] < 0)
      return fail(ATTNMERGE_ERROR_VALUE, "%s: expected sizes >= 0, got shape %s", name, ShapeText(t->shape, ndim).text);
  }
  if (v.numel() == 0) {  // an empty tensor is never addressed: its strides and pointer do not matter
    if (ndim == 2 && t->dtype != ATTNMERGE_FLOAT32)
      return fail(ATTNMERGE_ERROR_TYPE, "%s: expected dtype float32, got %s", name, dtype_name(t->dtype));
    if (ndim == 3 && !is_float_dtype(t->dtype))
      return fail(ATTNMERGE_ERROR_TYPE, "%s: expected dtype float32, float16 or bfloat16, got dtype code %d", name,
                  t->dtype);
    return ATTNMERGE_SUCCESS;
  }
  for (int i = 0; i < ndim; ++i)
    if (t->strides[i] < 0)
      return fail(ATTNMERGE_ERROR_VALUE, "%s: expected strides >= 0, got %" PRId64 " on axis %d", name, t->strides[i], i);
  if (ndim == 3) {
    if (!is_float_dtype(t->dtype))
      return fail(ATTNMERGE_ERROR_TYPE, "%s: expected dtype float32, float16 or bfloat16, got dtype code %d", name, t->dtype);
    if (t->strides[2] != 1 && t->shape[2] > 1)
      return fail(ATTNMERGE_ERROR_VALUE, "%s: expected a unit stride on the head_size axis, got stride %" PRId64, name,
                  t->strides[2]);
  } else if (t->dtype != ATTNMERGE_FLOAT32) {
    return fail(ATTNMERGE_ERROR_TYPE, "%s: expected dtype float32, got %s", name, dtype_name(t->dtype));
  }
  if (t->device < ATTNMERGE_HOST)
    return fail(ATTNMERGE_ERROR_VALUE, "%s: expected a device >= -1 (host), got %d", name, t->device);
  if (t->data == nullptr) return fail(ATTNMERGE_ERROR_VALUE, "%s: expected a data pointer, got NULL", name);
  const std::size_t size = dtype_size(t->dtype);
  if (reinterpret_cast<uintptr_t>(t->data) % size != 0)
    return fail(ATTNMERGE_ERROR_VALUE, "%s: expected a data pointer aligned to %zu bytes, got %p", name, size, t->data);
  // The largest element offset must fit in 63 bits, in bytes.
  int64_t last = 0;
  for (int i = 0; i < ndim; ++i) {
    int64_t term;
    if (__builtin_mul_overflow(v.shape[i] - 1, v.strides[i], &term) || __builtin_add_overflow(last, term, &last) ||
        __builtin_mul_overflow(last + 1, static_cast<int64_t>(size), &term))
      return fail(ATTNMERGE_ERROR_VALUE, "%s: shape %s with these strides spans more than 2^63 bytes", name,
                  ShapeText(t->shape, ndim).text);
  }
  return ATTNMERGE_SUCCESS;
}

attnmerge_status check_shape(const View& v, const int64_t* expected, int ndim, const View* source) {
  if (std::equal(expected, expected + ndim, v.shape)) return ATTNMERGE_SUCCESS;
  const bool transposed = v.t->ndim == 2 && v.shape[0] != v.t->shape[0];
  int64_t want[ATTNMERGE_MAX_NDIM] = {};
  std::copy(expected, expected + ndim, want);
  if (transposed) std::swap(want[0], want[1]);  // speak in the caller's layout
  return fail(ATTNMERGE_ERROR_VALUE, "%s: expected shape %s (the sizes of %s, shape %s), got %s", v.name,
              ShapeText(want, ndim).text, source->name, ShapeText(source->t->shape, source->ndim).text,
              ShapeText(v.t->shape, ndim).text);
}

// An output must not write one element twice: after sorting its axes by stride, each stride must
// clear the extent of the axes inside it.
attnmerge_status check_no_self_overlap(const View& v) {
  if (v.numel() == 0) return ATTNMERGE_SUCCESS;
  int order[ATTNMERGE_MAX_NDIM] = {0, 1, 2, 3};
  for (int i = 1; i < v.ndim; ++i)  // insertion sort of at most 3 axes by stride
    for (int j = i; j > 0 && v.strides[order[j]] < v.strides[order[j - 1]]; --j) std::swap(order[j], order[j - 1]);
  int64_t extent = 1;
  for (int k = 0; k < v.ndim; ++k) {
    const int i = order[k];
    if (v.shape[i] <= 1) continue;
    if (v.strides[i] < extent)
      return fail(ATTNMERGE_ERROR_VALUE,
                  "%s: expected an output whose elements do not overlap, got stride %" PRId64 " on axis %d of shape %s",
                  v.name, v.t->strides[i], i, ShapeText(v.t->shape, v.ndim).text);
    extent = v.strides[i] * (v.shape[i] - 1) + extent;
  }
  return ATTNMERGE_SUCCESS;
}

bool same_view(const View& x, const View& y) {
  return x.t->data == y.t->data && x.t->dtype == y.t->dtype && std::equal(x.shape, x.shape + x.ndim, y.shape) &&
         std::equal(x.strides, x.strides + x.ndim, y.strides);
}

// An output may be an input itself (element i written after element i was read), never a part
// overlap of one, nor overlap another output.
attnmerge_status check_disjoint(const View& out, const View& other, bool may_alias) {
  if (!other.present() || out.numel() == 0 || other.numel() == 0) return ATTNMERGE_SUCCESS;
  if (may_alias && same_view(out, other)) return ATTNMERGE_SUCCESS;
  uintptr_t lo1, hi1, lo2, hi2;
  out.byte_range(lo1, hi1);
  other.byte_range(lo2, hi2);
  if (lo1 < hi2 && lo2 < hi1)
    return fail(ATTNMERGE_ERROR_VALUE, "%s: expected memory disjoint from %s%s, got overlapping ranges", out.name,
                other.name, may_alias ? " (or the very same view)" : "");
  return ATTNMERGE_SUCCESS;
}

// The widest vector (elements) that every O tensor's pointer, strides and head_size allow,
// within 16 bytes per access.
int choose_vec(const View* os, int n, int64_t head_size) {
  std::size_t widest = 0;
  for (int i = 0; i < n; ++i) widest = std::max(widest, dtype_size(os[i].t->dtype));
  for (int vec = static_cast<int>(16 / widest); vec > 1; vec /= 2) {
    bool ok = head_size % vec == 0;
    for (int i = 0; ok && i < n; ++i) {
      const View& v = os[i];
      if (v.numel() == 0) continue;
      ok = reinterpret_cast<uintptr_t>(v.t->data) % (vec * dtype_size(v.t->dtype)) == 0;
      for (int axis = 0; ok && axis < 2; ++axis) ok = v.shape[axis] <= 1 || v.strides[axis] % vec == 0;
    }
    if (ok) return vec;
  }
  return 1;
}

StateView state_view(const View& o, const View& lse) {
  return StateView{o.t->data, o.strides[0], o.strides[1], static_cast<const float*>(lse.t->data), lse.strides[0],
                   lse.strides[1]};
}

}  // namespace
}  // namespace detail
}  // namespace attnmerge

using namespace attnmerge;
using namespace attnmerge::detail;

extern "C" {

attnmerge_status attnmerge_merge(const attnmerge_tensor* out, const attnmerge_tensor* out_lse,
                                 const attnmerge_tensor* o_a, const attnmerge_tensor* lse_a,
                                 const attnmerge_tensor* o_b, const attnmerge_tensor* lse_b,
                                 const attnmerge_options* options, void* stream) {
  g_error[0] = '\0';
  const attnmerge_tensor* given[] = {out, o_a, lse_a, o_b, lse_b};
  const char* names[] = {"out", "o_a", "lse_a", "o_b", "lse_b"};
  for (int i = 0; i < 5; ++i)
    if (given[i] == nullptr) return fail(ATTNMERGE_ERROR_TYPE, "%s: expected a tensor, got NULL", names[i]);
  const attnmerge_options defaults = {0u, -1};
  const attnmerge_options& opt = options ? *options : defaults;
  constexpr uint32_t known = ATTNMERGE_LSE_BASE2 | ATTNMERGE_LSE_HEADS_FIRST;
  if (opt.flags & ~known)
    return fail(ATTNMERGE_ERROR_VALUE, "options: expected flags within 0x%x, got 0x%x", known, opt.flags);
  const bool heads_first = opt.flags & ATTNMERGE_LSE_HEADS_FIRST;

  View vout, vout_lse{}, va, vla, vb, vlb;
  attnmerge_status s;
  if ((s = check_descriptor(out, "out", 3, false, vout)) || (s = check_descriptor(o_a, "o_a", 3, false, va)) ||
      (s = check_descriptor(lse_a, "lse_a", 2, heads_first, vla)) || (s = check_descriptor(o_b, "o_b", 3, false, vb)) ||
      (s = check_descriptor(lse_b, "lse_b", 2, heads_first, vlb)))
    return s;
  if (out_lse && (s = check_descriptor(out_lse, "out_lse", 2, heads_first, vout_lse))) return s;
  if (out->flags & ATTNMERGE_READ_ONLY) return fail(ATTNMERGE_ERROR_VALUE, "out: expected a writable tensor, got a read-only one");
  if (out_lse && (out_lse->flags & ATTNMERGE_READ_ONLY))
    return fail(ATTNMERGE_ERROR_VALUE, "out_lse: expected a writable tensor, got a read-only one");
  if (o_a->dtype != o_b->dtype)
    return fail(ATTNMERGE_ERROR_TYPE, "o_b: expected the dtype of o_a (%s), got %s", dtype_name(o_a->dtype),
                dtype_name(o_b->dtype));

  // Sizes come from o_b, the one input that always covers every token; the rest must agree.
  const int64_t tokens = vb.shape[0], heads = vb.shape[1], head_size = vb.shape[2];
  if (head_size < 1) return fail(ATTNMERGE_ERROR_VALUE, "o_b: expected head_size >= 1, got 0");
  const int64_t rows_shape[2] = {tokens, heads};
  const int64_t o_shape[3] = {tokens, heads, head_size};
  if ((s = check_shape(vlb, rows_shape, 2, &vb)) || (s = check_shape(vout, o_shape, 3, &vb))) return s;
  if (out_lse && (s = check_shape(vout_lse, rows_shape, 2, &vb))) return s;
  if (opt.a_tokens > tokens)
    return fail(ATTNMERGE_ERROR_VALUE, "a_tokens: expected at most the %" PRId64 " tokens of o_b, got %" PRId64, tokens,
                opt.a_tokens);
  const int64_t a_tokens = opt.a_tokens < 0 ? tokens : opt.a_tokens;
  if (opt.a_tokens < 0) {
    if ((s = check_shape(va, o_shape, 3, &vb)) || (s = check_shape(vla, rows_shape, 2, &vb))) return s;
  } else {
    // o_a and lse_a need only the first a_tokens tokens.
    const View* parts[] = {&va, &vla};
    for (const View* v : parts) {
      if (v->shape[0] < a_tokens || v->shape[1] != heads || (v->ndim == 3 && v->shape[2] != head_size))
        return fail(ATTNMERGE_ERROR_VALUE,
                    "%s: expected at least %" PRId64 " tokens (a_tokens), %" PRId64 " heads%s, got shape %s", v->name,
                    a_tokens, heads, v->ndim == 3 ? " and out's head_size" : "", ShapeText(v->t->shape, v->ndim).text);
    }
  }
  if ((s = check_no_self_overlap(vout))) return s;
  if (out_lse && (s = check_no_self_overlap(vout_lse))) return s;
  if ((s = check_disjoint(vout, va, true)) || (s = check_disjoint(vout, vb, true))) return s;
  if (out_lse && ((s = check_disjoint(vout_lse, vla, true)) || (s = check_disjoint(vout_lse, vlb, true)) ||
                  (s = check_disjoint(vout_lse, vout, false))))
    return s;

  // One device for all: that of the first non-empty tensor.
  int device = out->device;
  for (const View* v : {&vout, &vb, &va})
    if (v->numel() > 0) {
      device = v->t->device;
      break;
    }
  const View* all[] = {&vout, &va, &vla, &vb, &vlb, &vout_lse};
  for (const View* v : all)  // an empty tensor is never touched, wherever it lives
    if (v->present() && v->numel() > 0 && v->t->device != device)
      return fail(ATTNMERGE_ERROR_VALUE, "%s: expected the device of the other tensors (%d), got device %d (-1 is the host)",
                  v->name, device, v->t->device);

  MergeParams p{};
  p.tokens = tokens;
  p.heads = heads;
  p.head_size = head_size;
  p.a_tokens = a_tokens;
  p.out = out->data;
  p.out_st = vout.strides[0];
  p.out_sh = vout.strides[1];
  p.out_lse = out_lse ? static_cast<float*>(out_lse->data) : nullptr;
  p.out_lse_st = out_lse ? vout_lse.strides[0] : 0;
  p.out_lse_sh = out_lse ? vout_lse.strides[1] : 0;
  p.a = state_view(va, vla);
  p.b = state_view(vb, vlb);
  p.base2 = opt.flags & ATTNMERGE_LSE_BASE2;
  if (tokens * heads == 0) return ATTNMERGE_SUCCESS;

  const View* touched[] = {&vout, &va, &vla, &vb, &vlb, &vout_lse};
  if (device == ATTNMERGE_HOST) {
    // Device memory handed to the CPU path would crash the process: refuse it where CUDA can tell.
    if (gpu_device_count() > 0)
      for (const View* v : touched)
        if (v->present() && v->numel() > 0 && gpu_pointer_device(v->t->data) != ATTNMERGE_HOST)
          return fail(ATTNMERGE_ERROR_VALUE, "%s: expected host memory (device -1), got memory of CUDA device %d", v->name,
                      gpu_pointer_device(v->t->data));
    cpu_merge2(p, o_a->dtype, out->dtype);
    return ATTNMERGE_SUCCESS;
  }
  const int count = gpu_device_count();
  if (count == 0)
    return fail(ATTNMERGE_ERROR_NO_DEVICE, "out: lives on CUDA device %d, but no CUDA driver or device is available", device);
  if (device >= count)
    return fail(ATTNMERGE_ERROR_VALUE, "out: expected a CUDA device below %d, got device %d", count, device);
  for (const View* v : touched)
    if (v->present() && v->numel() > 0 && (s = gpu_check_pointer(v->t->data, device, v->name)))
      return s;
  const View os[] = {vout, va, vb};
  return gpu_merge2(p, o_a->dtype, out->dtype, choose_vec(os, 3, head_size), device, stream);
}

const char* attnmerge_last_error(void) { return g_error; }

const char* attnmerge_status_string(attnmerge_status status) {
  switch (status) {
    case ATTNMERGE_SUCCESS: return "success";
    case ATTNMERGE_ERROR_VALUE: return "invalid value";
    case ATTNMERGE_ERROR_TYPE: return "invalid type";
    case ATTNMERGE_ERROR_NO_DEVICE: return "no CUDA device";
    case ATTNMERGE_ERROR_CUDA: return "CUDA runtime error";
  }
  return "unknown status";
}

int attnmerge_version(void) { return ATTNMERGE_VERSION_NUMBER; }
const char* attnmerge_version_string(void) { return ATTNMERGE_VERSION_STRING; }
const char* attnmerge_cuda_architectures(void) { return ATTNMERGE_CUDA_ARCHS; }
int attnmerge_cuda_build_version(void) { return gpu_build_version(); }
int attnmerge_cuda_driver_version(void) { return gpu_driver_version(); }
int attnmerge_device_count(void) { return gpu_device_count(); }
int attnmerge_pointer_device(const void* ptr) { return gpu_pointer_device(ptr); }

attnmerge_status attnmerge_stream_synchronize(int32_t device, void* stream) {
  g_error[0] = '\0';
  if (device < 0 || device >= gpu_device_count())
    return fail(ATTNMERGE_ERROR_VALUE, "device: expected a CUDA device below %d, got %d", gpu_device_count(), device);
  return gpu_stream_synchronize(device, stream);
}

}  // extern "C"
