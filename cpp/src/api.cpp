// The C ABI of libattnmerge: every argument is validated here, once, before anything is written;
// then the call goes to the CPU path or the GPU launchers with one of the sources of
// sources.h.
#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <type_traits>

#include "cuda_builds.h"
#include "internal.h"

#ifndef ATTNMERGE_CUDA_ARCHS
#define ATTNMERGE_CUDA_ARCHS "unknown"
#endif

namespace attnmerge {
namespace detail {

namespace {
thread_local char g_error[1024] = "";

// The start of every op: no error, nothing launched yet.
void begin_call() {
  g_error[0] = '\0';
  forget_launch();
}
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
    case ATTNMERGE_FLOAT8_E4M3: return "float8_e4m3";
    case ATTNMERGE_UINT8: return "uint8";
    case ATTNMERGE_BOOL: return "bool";
    case ATTNMERGE_INT32: return "int32";
    case ATTNMERGE_INT64: return "int64";
    default: return "unknown";
  }
}

namespace {

// Sets of dtypes an argument may have, and how a message names them.
constexpr uint32_t bit(int dtype) { return 1u << dtype; }
constexpr uint32_t kInputs = bit(ATTNMERGE_FLOAT32) | bit(ATTNMERGE_FLOAT16) | bit(ATTNMERGE_BFLOAT16);
constexpr uint32_t kOutputs = kInputs | bit(ATTNMERGE_FLOAT8_E4M3);
constexpr uint32_t kLse = bit(ATTNMERGE_FLOAT32);
constexpr uint32_t kMask = bit(ATTNMERGE_UINT8) | bit(ATTNMERGE_BOOL);
constexpr uint32_t kIndex = bit(ATTNMERGE_INT32) | bit(ATTNMERGE_INT64);

const char* dtypes_text(uint32_t set) {
  switch (set) {
    case kInputs: return "float32, float16 or bfloat16";
    case kOutputs: return "float32, float16, bfloat16 or float8_e4m3";
    case kLse: return "float32";
    case kMask: return "uint8 or bool";
    default: return "int32 or int64";
  }
}

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
  int64_t last = 0;   // the largest element offset, when not empty
  // [first byte, one past the last byte] the view spans; not empty.
  void byte_range(uintptr_t& lo, uintptr_t& hi) const {
    int64_t last = 0;
    for (int i = 0; i < ndim; ++i) last += (shape[i] - 1) * strides[i];
    lo = reinterpret_cast<uintptr_t>(t->data);
    hi = lo + static_cast<uintptr_t>(last + 1) * dtype_size(t->dtype);
  }
  StateView state(const View& lse) const {
    return StateView{t->data, strides[0], strides[1], static_cast<const float*>(lse.t->data), lse.strides[0],
                     lse.strides[1]};
  }
};

// Checks what one tensor can be checked for alone and fills `v` (swapping the two axes of an LSE
// given [heads, tokens]).  A NULL descriptor is an error unless the argument is optional.
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
  if (t->dtype < 0 || t->dtype >= 32 || !(dtypes & bit(t->dtype)))
    return fail(ATTNMERGE_ERROR_TYPE, "%s: expected dtype %s, got %s", name, dtypes_text(dtypes), dtype_name(t->dtype));
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
      return fail(ATTNMERGE_ERROR_VALUE, "%s: expected strides >= 0, got %" PRId64 " on axis %d", name, t->strides[i], i);
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

// v's logical shape must be `expected`, the sizes taken from `source`.
attnmerge_status check_shape(const View& v, const int64_t* expected, const View& source) {
  if (!v.present() || std::equal(expected, expected + v.ndim, v.shape)) return ATTNMERGE_SUCCESS;
  int64_t want[ATTNMERGE_MAX_NDIM] = {};
  std::copy(expected, expected + v.ndim, want);
  if (v.transposed) std::swap(want[0], want[1]);  // speak in the caller's layout
  return fail(ATTNMERGE_ERROR_VALUE, "%s: expected shape %s (the sizes of %s, shape %s), got %s", v.name,
              ShapeText(want, v.ndim).text, source.name, ShapeText(source.t->shape, source.ndim).text,
              ShapeText(v.t->shape, v.ndim).text);
}

// An output must not write one element twice: after sorting its axes by stride, each stride must
// clear the extent of the axes inside it.
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
                  "%s: expected an output whose elements do not overlap, got stride %" PRId64 " on an axis of size %" PRId64
                  " (shape %s)",
                  v.name, v.strides[i], v.shape[i], ShapeText(v.t->shape, v.ndim).text);
    extent = v.strides[i] * (v.shape[i] - 1) + extent;
  }
  return ATTNMERGE_SUCCESS;
}

bool same_view(const View& x, const View& y) {
  return x.t->data == y.t->data && x.t->dtype == y.t->dtype && x.ndim == y.ndim &&
         std::equal(x.shape, x.shape + x.ndim, y.shape) && std::equal(x.strides, x.strides + x.ndim, y.strides);
}

// An output may be an input itself where `may_alias` (element i is written after element i was
// read), never a partial overlap of one, nor overlap another output.
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

// The widest vector (elements) that every O tensor's pointer, strides and head_size allow,
// within 16 bytes per access.
int choose_vec(std::initializer_list<const View*> os, int64_t head_size) {
  std::size_t widest = 0;
  for (const View* v : os) widest = std::max(widest, dtype_size(v->t->dtype));
  for (int vec = static_cast<int>(16 / widest); vec > 1; vec /= 2) {
    bool ok = head_size % vec == 0;
    for (const View* v : os) {
      if (!ok || v->empty) continue;
      ok = reinterpret_cast<uintptr_t>(v->t->data) % (vec * dtype_size(v->t->dtype)) == 0;
      for (int axis = 0; ok && axis < v->ndim - 1; ++axis) ok = v->shape[axis] <= 1 || v->strides[axis] % vec == 0;
    }
    if (ok) return vec;
  }
  return 1;
}

// Options every op shares, validated.  `allowed` are the flags the op understands.
attnmerge_status read_options(const attnmerge_options* options, uint32_t allowed, const View& out,
                              attnmerge_options& opt, float& inv_scale) {
  opt = options ? *options : attnmerge_options{};
  if (opt.struct_size != 0 && opt.struct_size != sizeof(attnmerge_options))
    return fail(ATTNMERGE_ERROR_VALUE, "options.struct_size: expected 0 or %u (this library's attnmerge_options), got %u",
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

// Outputs: writable, no element written twice, out and out_lse apart.
attnmerge_status check_outputs(const View& out, const View& out_lse) {
  for (const View* v : {&out, &out_lse})
    if (v->present() && (v->t->flags & ATTNMERGE_READ_ONLY))
      return fail(ATTNMERGE_ERROR_VALUE, "%s: expected a writable tensor, got a read-only one", v->name);
  attnmerge_status s;
  if ((s = check_no_self_overlap(out)) || (s = check_no_self_overlap(out_lse)) || (s = check_disjoint(out_lse, out, false)))
    return s;
  return ATTNMERGE_SUCCESS;
}

// One device for every non-empty tensor, and memory it can address (`scale`: the output scale in
// memory, or null): `device` (ATTNMERGE_HOST for the CPU path).  go: there is work to do (some
// tensor is not empty and no_rows is false); nothing is checked beyond the devices' agreement
// where there is not.
attnmerge_status locate(std::initializer_list<const View*> views, const float* scale, bool no_rows, int& device,
                        bool& go) {
  device = ATTNMERGE_HOST;
  go = false;
  const View* first = nullptr;
  for (const View* v : views) {
    if (!v->present() || v->empty) continue;  // an empty tensor is never touched, wherever it lives
    if (first == nullptr) {
      first = v;
      device = v->t->device;
    } else if (v->t->device != device) {
      return fail(ATTNMERGE_ERROR_VALUE, "%s: expected the device of %s (%d), got device %d (-1 is the host)", v->name,
                  first->name, device, v->t->device);
    }
  }
  go = first != nullptr && !no_rows;
  if (!go) return ATTNMERGE_SUCCESS;
  if (device == ATTNMERGE_HOST) {
    // Device memory handed to the CPU path would crash the process: refuse it where CUDA can tell.
    if (gpu_device_count() > 0)
      for (const View* v : views)
        if (v->present() && !v->empty && !(v->t->flags & ATTNMERGE_DEVICE_KNOWN) &&
            gpu_pointer_device(v->t->data) != ATTNMERGE_HOST)
          return fail(ATTNMERGE_ERROR_VALUE, "%s: expected host memory (device -1), got memory of CUDA device %d",
                      v->name, gpu_pointer_device(v->t->data));
    if (scale != nullptr && gpu_device_count() > 0 && gpu_pointer_device(scale) != ATTNMERGE_HOST)
      return fail(ATTNMERGE_ERROR_VALUE, "output_scale: expected host memory (device -1), got memory of CUDA device %d",
                  gpu_pointer_device(scale));
    return ATTNMERGE_SUCCESS;
  }
  const int count = gpu_device_count();
  if (count == 0) {
    char why[512];
    if (describe_old_driver(why, sizeof why, gpu_driver_version(), gpu_build_version()))
      return fail(ATTNMERGE_ERROR_NO_DEVICE, "%s: lives on CUDA device %d, but %s", first->name, device, why);
    return fail(ATTNMERGE_ERROR_NO_DEVICE, "%s: lives on CUDA device %d, but no CUDA driver or device is available",
                first->name, device);
  }
  if (device >= count)
    return fail(ATTNMERGE_ERROR_VALUE, "%s: expected a CUDA device below %d, got device %d", first->name, count, device);
  attnmerge_status s;
  for (const View* v : views)
    if (v->present() && !v->empty && !(v->t->flags & ATTNMERGE_DEVICE_KNOWN) &&
        (s = gpu_check_pointer(v->t->data, device, v->name)))
      return s;
  if (scale != nullptr && (s = gpu_check_pointer(scale, device, "output_scale"))) return s;
  return ATTNMERGE_SUCCESS;
}

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

OutView out_view(const View& out, const View& out_lse, float inv_scale, const attnmerge_options& opt) {
  return OutView{out.t->data,
                 out.strides[0],
                 out.strides[1],
                 out_lse.present() ? static_cast<float*>(out_lse.t->data) : nullptr,
                 out_lse.present() ? out_lse.strides[0] : 0,
                 out_lse.present() ? out_lse.strides[1] : 0,
                 inv_scale,
                 opt.output_scale_ptr,
                 false};
}

// The shapes of a two-way merge's state a (o_a, lse_a), whose tokens are limited to
// options.a_tokens with ATTNMERGE_A_TOKENS: `a_tokens` set to the tokens of a that are read.
attnmerge_status check_a_shapes(const attnmerge_options& opt, const int64_t (&o_shape)[3], const View& vb, const View& va,
                                const View& vla, int64_t& a_tokens) {
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
      return fail(ATTNMERGE_ERROR_VALUE, "%s: expected at least %" PRId64 " tokens (a_tokens), %" PRId64 " heads%s, got shape %s",
                  v->name, a_tokens, heads, v->ndim == 3 ? " and the head_size of o_b" : "",
                  ShapeText(v->t->shape, v->ndim).text);
  return ATTNMERGE_SUCCESS;
}

// Argument names of the two ops built on PairSource.
struct PairNames {
  const char *out, *out_lse, *o_a, *lse_a, *o_b, *lse_b, *mask;
};

// The two-way and in-place merges: (out, out_lse) = merge(a, b), rows optionally masked.
attnmerge_status merge_pair(const PairNames& n, const attnmerge_tensor* out, const attnmerge_tensor* out_lse,
                            const attnmerge_tensor* o_a, const attnmerge_tensor* lse_a, const attnmerge_tensor* o_b,
                            const attnmerge_tensor* lse_b, const attnmerge_tensor* mask,
                            const attnmerge_options* options, uint32_t allowed_flags, void* stream) {
  begin_call();
  const bool heads_first = options && (options->flags & ATTNMERGE_LSE_HEADS_FIRST);
  View vout, vout_lse, va, vla, vb, vlb, vmask;
  attnmerge_status s;
  if ((s = describe(out, n.out, 3, kOutputs, false, false, vout)) ||
      (s = describe(out_lse, n.out_lse, 2, kLse, heads_first, true, vout_lse)) ||
      (s = describe(o_a, n.o_a, 3, kInputs, false, false, va)) ||
      (s = describe(lse_a, n.lse_a, 2, kLse, heads_first, false, vla)) ||
      (s = describe(o_b, n.o_b, 3, kInputs, false, false, vb)) ||
      (s = describe(lse_b, n.lse_b, 2, kLse, heads_first, false, vlb)) ||
      (s = describe(mask, n.mask, 1, kMask, false, true, vmask)))
    return s;
  attnmerge_options opt;
  float inv_scale;
  if ((s = read_options(options, allowed_flags, vout, opt, inv_scale))) return s;
  if (o_a->dtype != o_b->dtype)
    return fail(ATTNMERGE_ERROR_TYPE, "%s: expected the dtype of %s (%s), got %s", n.o_b, n.o_a, dtype_name(o_a->dtype),
                dtype_name(o_b->dtype));

  // Sizes come from o_b, the one input that always covers every token; the rest must agree.
  const int64_t tokens = vb.shape[0], heads = vb.shape[1], head_size = vb.shape[2];
  if ((s = check_head_size(n.o_b, head_size))) return s;
  const int64_t o_shape[3] = {tokens, heads, head_size};
  if ((s = check_shape(vlb, o_shape, vb)) || (s = check_shape(vout, o_shape, vb)) ||
      (s = check_shape(vout_lse, o_shape, vb)) || (s = check_shape(vmask, o_shape, vb)))
    return s;
  int64_t a_tokens;
  if ((s = check_a_shapes(opt, o_shape, vb, va, vla, a_tokens))) return s;
  if ((s = check_outputs(vout, vout_lse))) return s;
  // out may be o_a or o_b itself and out_lse lse_a or lse_b; nothing else may touch the outputs.
  for (const View* in : {&va, &vla, &vb, &vlb, &vmask})
    if ((s = check_disjoint(vout, *in, in == &va || in == &vb)) ||
        (s = check_disjoint(vout_lse, *in, in == &vla || in == &vlb)))
      return s;

  const MergeShape shape{tokens, heads, head_size, (opt.flags & ATTNMERGE_LSE_BASE2) != 0};
  PairSource src{va.state(vla), vb.state(vlb), a_tokens, nullptr, 0};
  if (vmask.present() && !vmask.empty) {
    src.mask = static_cast<const uint8_t*>(mask->data);
    src.mask_stride = vmask.strides[0];
  }
  OutView dst = out_view(vout, vout_lse, inv_scale, opt);
  dst.lse_in_place = vout_lse.present() && !vout_lse.empty &&
                     ((vla.present() && !vla.empty && same_view(vout_lse, vla)) || (!vlb.empty && same_view(vout_lse, vlb)));
  return run({&vout, &vout_lse, &va, &vla, &vb, &vlb, &vmask}, shape, src, dst, o_a->dtype, out->dtype,
             choose_vec({&vout, &va, &vb}, head_size), stream, opt.flags);
}

// A variable-length merge's indptr [rows + 1] against the `total` states of o: on the host the
// offsets can be checked before anything is written (on the GPU they are clamped, never read back).
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
                    total, r, v, v > total ? " (past the end)" : r == 0 ? " (below 0)" : " (decreasing)");
      previous = v;
    }
  }
  return ATTNMERGE_SUCCESS;
}

// ---- the backward ---------------------------------------------------------------------------

// `v` (if given) has the dtype of `like`.
attnmerge_status check_dtype_of(const View& v, const View& like) {
  if (!v.present() || v.t->dtype == like.t->dtype) return ATTNMERGE_SUCCESS;
  return fail(ATTNMERGE_ERROR_TYPE, "%s: expected the dtype of %s (%s), got %s", v.name, like.name,
              dtype_name(like.t->dtype), dtype_name(v.t->dtype));
}

// The gradients a backward writes: writable, no element written twice, apart from each other and
// from every input (no in-place backward: dO and O are read again for rows of many states).
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

// O [tokens, heads, ...] and an LSE, either of which may be absent (null: never read).
StateView state_of(const View& o, const View& lse) {
  return StateView{o.present() ? o.t->data : nullptr, o.present() ? o.strides[0] : 0, o.present() ? o.strides[1] : 0,
                   lse.present() ? static_cast<const float*>(lse.t->data) : nullptr,
                   lse.present() ? lse.strides[0] : 0, lse.present() ? lse.strides[1] : 0};
}

// A gradient's pointer and strides where it is given; null and zero strides where it is not, so
// that every address of it a source computes is null (not written).
const void* data_or_null(const View& v) { return v.present() ? v.t->data : nullptr; }
int64_t stride_or_0(const View& v, int axis) { return v.present() ? v.strides[axis] : 0; }

// What every backward reads beside the forward's inputs: the incoming gradients (dO, dLSE) and
// the forward's outputs (O, LSE), all [rows, heads, ...].
struct BackwardViews {
  View grad_out, grad_out_lse, out, out_lse;
};

// Described: grad_out_lse optional (dLSE = 0), out optional (<dO, O> from the states instead);
// grad_out in the dtype of out, which has a gradient: not FP8.
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

// Each of them of `out_shape` (sizes from `source`).
attnmerge_status check_backward_shapes(const BackwardViews& v, const int64_t (&out_shape)[3], const View& source) {
  attnmerge_status s;
  for (const View* w : {&v.grad_out, &v.grad_out_lse, &v.out, &v.out_lse})
    if ((s = check_shape(*w, out_shape, source))) return s;
  return ATTNMERGE_SUCCESS;
}

// An FP8 output, hence an output scale, has no gradient: read_options refuses a scale for the
// (never FP8) grad_out.
attnmerge_status read_backward_options(const attnmerge_options* options, uint32_t allowed, const View& out,
                                       attnmerge_options& opt) {
  float inv_scale;
  return read_options(options, allowed, out, opt, inv_scale);
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
  static const PairNames names = {"out", "out_lse", "o_a", "lse_a", "o_b", "lse_b", "mask"};
  return merge_pair(names, out, out_lse, o_a, lse_a, o_b, lse_b, nullptr, options,
                    ATTNMERGE_LSE_BASE2 | ATTNMERGE_LSE_HEADS_FIRST | ATTNMERGE_A_TOKENS | ATTNMERGE_PDL, stream);
}

attnmerge_status attnmerge_merge_inplace(const attnmerge_tensor* o, const attnmerge_tensor* lse,
                                         const attnmerge_tensor* o_other, const attnmerge_tensor* lse_other,
                                         const attnmerge_tensor* mask, const attnmerge_options* options, void* stream) {
  static const PairNames names = {"o", "lse", "o", "lse", "o_other", "lse_other", "mask"};
  if (o != nullptr && lse == nullptr) {
    begin_call();
    return fail(ATTNMERGE_ERROR_TYPE, "lse: expected a tensor, got NULL");
  }
  return merge_pair(names, o, lse, o, lse, o_other, lse_other, mask, options,
                    ATTNMERGE_LSE_BASE2 | ATTNMERGE_LSE_HEADS_FIRST | ATTNMERGE_PDL, stream);
}

attnmerge_status attnmerge_merge_states(const attnmerge_tensor* out, const attnmerge_tensor* out_lse,
                                        const attnmerge_tensor* o, const attnmerge_tensor* lse,
                                        const attnmerge_options* options, void* stream) {
  begin_call();
  View vout, vout_lse, vo, vl;
  attnmerge_status s;
  if ((s = describe(out, "out", 3, kOutputs, false, false, vout)) ||
      (s = describe(out_lse, "out_lse", 2, kLse, false, true, vout_lse)) ||
      (s = describe(o, "o", 4, kInputs, false, false, vo)) || (s = describe(lse, "lse", 3, kLse, false, false, vl)))
    return s;
  attnmerge_options opt;
  float inv_scale;
  if ((s = read_options(options, ATTNMERGE_LSE_BASE2 | ATTNMERGE_PDL, vout, opt, inv_scale))) return s;
  const int64_t tokens = vo.shape[0], states = vo.shape[1], heads = vo.shape[2], head_size = vo.shape[3];
  if ((s = check_head_size("o", head_size))) return s;
  if (states > INT32_MAX) return fail(ATTNMERGE_ERROR_VALUE, "o: expected at most 2^31 - 1 states, got %" PRId64, states);
  const int64_t lse_shape[3] = {tokens, states, heads};
  const int64_t out_shape[3] = {tokens, heads, head_size};
  if ((s = check_shape(vl, lse_shape, vo)) || (s = check_shape(vout, out_shape, vo)) ||
      (s = check_shape(vout_lse, out_shape, vo)) || (s = check_outputs(vout, vout_lse)))
    return s;
  for (const View* v : {&vo, &vl})
    for (const View* w : {&vout, &vout_lse})
      if ((s = check_disjoint(*w, *v, false))) return s;
  const MergeShape shape{tokens, heads, head_size, (opt.flags & ATTNMERGE_LSE_BASE2) != 0};
  const OutView dst = out_view(vout, vout_lse, inv_scale, opt);
  if (states == 2) {  // the two-way merge's kernel: the same weights, fewer registers
    // (no offset from the pointer of an empty tensor, which may be null and is never read)
    const char* o1 = static_cast<const char*>(o->data) +
                     (vo.empty ? 0 : vo.strides[1] * static_cast<int64_t>(dtype_size(o->dtype)));
    const float* l0 = static_cast<const float*>(lse->data);
    const StateView a{o->data, vo.strides[0], vo.strides[2], l0, vl.strides[0], vl.strides[2]};
    const StateView b{o1, vo.strides[0], vo.strides[2], l0 + (vl.empty ? 0 : vl.strides[1]), vl.strides[0],
                      vl.strides[2]};
    return run({&vout, &vout_lse, &vo, &vl}, shape, PairSource{a, b, tokens, nullptr, 0}, dst, o->dtype, out->dtype,
               choose_vec({&vout, &vo}, head_size), stream, opt.flags);
  }
  const StackSource src{o->data,  vo.strides[0], vo.strides[1], vo.strides[2], static_cast<const float*>(lse->data),
                        vl.strides[0], vl.strides[1], vl.strides[2], states};
  return run({&vout, &vout_lse, &vo, &vl}, shape, src, dst, o->dtype, out->dtype, choose_vec({&vout, &vo}, head_size),
             stream, opt.flags);
}

attnmerge_status attnmerge_merge_varlen(const attnmerge_tensor* out, const attnmerge_tensor* out_lse,
                                        const attnmerge_tensor* o, const attnmerge_tensor* lse,
                                        const attnmerge_tensor* indptr, const attnmerge_options* options, void* stream) {
  begin_call();
  View vout, vout_lse, vo, vl, vi;
  attnmerge_status s;
  if ((s = describe(out, "out", 3, kOutputs, false, false, vout)) ||
      (s = describe(out_lse, "out_lse", 2, kLse, false, true, vout_lse)) ||
      (s = describe(o, "o", 3, kInputs, false, false, vo)) || (s = describe(lse, "lse", 2, kLse, false, false, vl)) ||
      (s = describe(indptr, "indptr", 1, kIndex, false, false, vi)))
    return s;
  attnmerge_options opt;
  float inv_scale;
  if ((s = read_options(options, ATTNMERGE_LSE_BASE2 | ATTNMERGE_PDL, vout, opt, inv_scale))) return s;
  const int64_t total = vo.shape[0], heads = vo.shape[1], head_size = vo.shape[2];
  if ((s = check_head_size("o", head_size))) return s;
  if (vi.shape[0] < 1) return fail(ATTNMERGE_ERROR_VALUE, "indptr: expected rows + 1 >= 1 entries, got 0");
  const int64_t rows = vi.shape[0] - 1;
  const int64_t lse_shape[2] = {total, heads};
  const int64_t out_shape[3] = {rows, heads, head_size};
  if ((s = check_shape(vl, lse_shape, vo)) || (s = check_shape(vout, out_shape, vo)) ||
      (s = check_shape(vout_lse, out_shape, vo)) || (s = check_outputs(vout, vout_lse)))
    return s;
  for (const View* v : {&vo, &vl, &vi})
    for (const View* w : {&vout, &vout_lse})
      if ((s = check_disjoint(*w, *v, false))) return s;
  const bool wide = indptr->dtype == ATTNMERGE_INT64;
  if ((s = check_indptr(vi, out, rows, total))) return s;
  const MergeShape shape{rows, heads, head_size, (opt.flags & ATTNMERGE_LSE_BASE2) != 0};
  const RangeSource src{o->data,      vo.strides[0], vo.strides[1], static_cast<const float*>(lse->data),
                        vl.strides[0], vl.strides[1], indptr->data, vi.strides[0], wide, total};
  return run({&vout, &vout_lse, &vo, &vl, &vi}, shape, src, out_view(vout, vout_lse, inv_scale, opt), o->dtype,
             out->dtype, choose_vec({&vout, &vo}, head_size), stream, opt.flags);
}

attnmerge_status attnmerge_merge_backward(const attnmerge_tensor* grad_o_a, const attnmerge_tensor* grad_lse_a,
                                          const attnmerge_tensor* grad_o_b, const attnmerge_tensor* grad_lse_b,
                                          const attnmerge_tensor* grad_out, const attnmerge_tensor* grad_out_lse,
                                          const attnmerge_tensor* out, const attnmerge_tensor* out_lse,
                                          const attnmerge_tensor* o_a, const attnmerge_tensor* lse_a,
                                          const attnmerge_tensor* o_b, const attnmerge_tensor* lse_b,
                                          const attnmerge_options* options, void* stream) {
  begin_call();
  const bool heads_first = options && (options->flags & ATTNMERGE_LSE_HEADS_FIRST);
  BackwardViews v;
  View vga, vgla, vgb, vglb, va, vla, vb, vlb;
  attnmerge_status s;
  if ((s = describe(grad_o_a, "grad_o_a", 3, kInputs, false, true, vga)) ||
      (s = describe(grad_lse_a, "grad_lse_a", 2, kLse, heads_first, true, vgla)) ||
      (s = describe(grad_o_b, "grad_o_b", 3, kInputs, false, true, vgb)) ||
      (s = describe(grad_lse_b, "grad_lse_b", 2, kLse, heads_first, true, vglb)) ||
      (s = describe_backward_outputs(grad_out, grad_out_lse, out, out_lse, heads_first, v)) ||
      (s = describe(o_a, "o_a", 3, kInputs, false, false, va)) ||
      (s = describe(lse_a, "lse_a", 2, kLse, heads_first, false, vla)) ||
      (s = describe(o_b, "o_b", 3, kInputs, false, false, vb)) ||
      (s = describe(lse_b, "lse_b", 2, kLse, heads_first, false, vlb)))
    return s;
  attnmerge_options opt;
  if ((s = read_backward_options(options, ATTNMERGE_LSE_BASE2 | ATTNMERGE_LSE_HEADS_FIRST | ATTNMERGE_A_TOKENS | ATTNMERGE_PDL,
                                 v.grad_out, opt)) ||
      (s = check_dtype_of(vb, va)) || (s = check_dtype_of(vga, va)) || (s = check_dtype_of(vgb, va)))
    return s;
  // Sizes come from o_b, as in the forward.
  const int64_t tokens = vb.shape[0], heads = vb.shape[1], head_size = vb.shape[2];
  if ((s = check_head_size("o_b", head_size))) return s;
  const int64_t o_shape[3] = {tokens, heads, head_size};
  int64_t a_tokens;
  if ((s = check_shape(vlb, o_shape, vb)) || (s = check_backward_shapes(v, o_shape, vb)) ||
      (s = check_shape(vgb, o_shape, vb)) || (s = check_shape(vglb, o_shape, vb)) ||
      (s = check_a_shapes(opt, o_shape, vb, va, vla, a_tokens)))
    return s;
  const int64_t a_shape[3] = {a_tokens, heads, head_size};  // a's gradients: the tokens of a that were read
  if ((s = check_shape(vga, a_shape, vb)) || (s = check_shape(vgla, a_shape, vb)) ||
      (s = check_grads({&vga, &vgla, &vgb, &vglb}, {&v.grad_out, &v.grad_out_lse, &v.out, &v.out_lse, &va, &vla, &vb, &vlb})))
    return s;
  const MergeShape shape{tokens, heads, head_size, (opt.flags & ATTNMERGE_LSE_BASE2) != 0};
  const auto grad_state = [](const View& o, const View& l) {
    return StateView{data_or_null(o), stride_or_0(o, 0), stride_or_0(o, 1), static_cast<const float*>(data_or_null(l)),
                     stride_or_0(l, 0), stride_or_0(l, 1)};
  };
  const PairSource in{va.state(vla), vb.state(vlb), a_tokens, nullptr, 0};
  const PairSource grad{grad_state(vga, vgla), grad_state(vgb, vglb), a_tokens, nullptr, 0};
  const BackwardArgs<PairBackward> args{PairBackward{in, grad}, state_of(v.out, v.out_lse),
                                        state_of(v.grad_out, v.grad_out_lse), vga.present() || vgb.present(),
                                        vgla.present() || vglb.present()};
  return run_backward({&vga, &vgla, &vgb, &vglb, &v.grad_out, &v.grad_out_lse, &v.out, &v.out_lse, &va, &vla, &vb, &vlb},
                      shape, args, 2, o_a->dtype, grad_out->dtype,
                      choose_vec({vga.present() ? &vga : &va, vgb.present() ? &vgb : &vb, &v.grad_out,
                                  v.out.present() ? &v.out : &v.grad_out, &va, &vb},
                                 head_size),
                      stream, opt.flags);
}

attnmerge_status attnmerge_merge_states_backward(const attnmerge_tensor* grad_o, const attnmerge_tensor* grad_lse,
                                                 const attnmerge_tensor* grad_out, const attnmerge_tensor* grad_out_lse,
                                                 const attnmerge_tensor* out, const attnmerge_tensor* out_lse,
                                                 const attnmerge_tensor* o, const attnmerge_tensor* lse,
                                                 const attnmerge_options* options, void* stream) {
  begin_call();
  BackwardViews v;
  View vg, vgl, vo, vl;
  attnmerge_status s;
  if ((s = describe(grad_o, "grad_o", 4, kInputs, false, true, vg)) ||
      (s = describe(grad_lse, "grad_lse", 3, kLse, false, true, vgl)) ||
      (s = describe_backward_outputs(grad_out, grad_out_lse, out, out_lse, false, v)) ||
      (s = describe(o, "o", 4, kInputs, false, false, vo)) || (s = describe(lse, "lse", 3, kLse, false, false, vl)))
    return s;
  attnmerge_options opt;
  if ((s = read_backward_options(options, ATTNMERGE_LSE_BASE2 | ATTNMERGE_PDL, v.grad_out, opt)) ||
      (s = check_dtype_of(vg, vo)))
    return s;
  const int64_t tokens = vo.shape[0], states = vo.shape[1], heads = vo.shape[2], head_size = vo.shape[3];
  if ((s = check_head_size("o", head_size))) return s;
  if (states > INT32_MAX) return fail(ATTNMERGE_ERROR_VALUE, "o: expected at most 2^31 - 1 states, got %" PRId64, states);
  const int64_t lse_shape[3] = {tokens, states, heads};
  const int64_t out_shape[3] = {tokens, heads, head_size};
  if ((s = check_shape(vl, lse_shape, vo)) || (s = check_shape(vg, vo.shape, vo)) ||
      (s = check_shape(vgl, lse_shape, vo)) || (s = check_backward_shapes(v, out_shape, vo)) ||
      (s = check_grads({&vg, &vgl}, {&v.grad_out, &v.grad_out_lse, &v.out, &v.out_lse, &vo, &vl})))
    return s;
  const MergeShape shape{tokens, heads, head_size, (opt.flags & ATTNMERGE_LSE_BASE2) != 0};
  const std::initializer_list<const View*> views = {&vg, &vgl, &v.grad_out, &v.grad_out_lse, &v.out, &v.out_lse, &vo, &vl};
  const int vec =
      choose_vec({vg.present() ? &vg : &vo, &v.grad_out, v.out.present() ? &v.out : &v.grad_out, &vo}, head_size);
  const StackSource in{o->data,      vo.strides[0], vo.strides[1], vo.strides[2], static_cast<const float*>(lse->data),
                       vl.strides[0], vl.strides[1], vl.strides[2], states};
  const StackSource grad{data_or_null(vg), stride_or_0(vg, 0), stride_or_0(vg, 1), stride_or_0(vg, 2),
                         static_cast<const float*>(data_or_null(vgl)), stride_or_0(vgl, 0), stride_or_0(vgl, 1),
                         stride_or_0(vgl, 2), states};
  if (states == 2) {  // the two-way merge's kernel, as in the forward: 64 registers against 108
    // (no offset from the pointer of an empty tensor, which may be null and is never read)
    const auto pair = [&](const StackSource& x, int dtype, bool empty_o, bool empty_lse) {
      const char* o1 = static_cast<const char*>(x.o) + (empty_o ? 0 : x.o_ss * static_cast<int64_t>(dtype_size(dtype)));
      return PairSource{StateView{x.o, x.o_st, x.o_sh, x.lse, x.lse_st, x.lse_sh},
                        StateView{o1, x.o_st, x.o_sh, x.lse + (empty_lse ? 0 : x.lse_ss), x.lse_st, x.lse_sh}, tokens,
                        nullptr, 0};
    };
    const BackwardArgs<PairBackward> args{
        PairBackward{pair(in, o->dtype, vo.empty, vl.empty), pair(grad, o->dtype, vg.empty, vgl.empty)},
        state_of(v.out, v.out_lse), state_of(v.grad_out, v.grad_out_lse), vg.present(), vgl.present()};
    return run_backward(views, shape, args, states, o->dtype, grad_out->dtype, vec, stream, opt.flags);
  }
  const BackwardArgs<StackBackward> args{StackBackward{in, grad}, state_of(v.out, v.out_lse),
                                         state_of(v.grad_out, v.grad_out_lse), vg.present(), vgl.present()};
  return run_backward(views, shape, args, states, o->dtype, grad_out->dtype, vec, stream, opt.flags);
}

attnmerge_status attnmerge_merge_varlen_backward(const attnmerge_tensor* grad_o, const attnmerge_tensor* grad_lse,
                                                 const attnmerge_tensor* grad_out, const attnmerge_tensor* grad_out_lse,
                                                 const attnmerge_tensor* out, const attnmerge_tensor* out_lse,
                                                 const attnmerge_tensor* o, const attnmerge_tensor* lse,
                                                 const attnmerge_tensor* indptr, const attnmerge_options* options,
                                                 void* stream) {
  begin_call();
  BackwardViews v;
  View vg, vgl, vo, vl, vi;
  attnmerge_status s;
  if ((s = describe(grad_o, "grad_o", 3, kInputs, false, true, vg)) ||
      (s = describe(grad_lse, "grad_lse", 2, kLse, false, true, vgl)) ||
      (s = describe_backward_outputs(grad_out, grad_out_lse, out, out_lse, false, v)) ||
      (s = describe(o, "o", 3, kInputs, false, false, vo)) || (s = describe(lse, "lse", 2, kLse, false, false, vl)) ||
      (s = describe(indptr, "indptr", 1, kIndex, false, false, vi)))
    return s;
  attnmerge_options opt;
  if ((s = read_backward_options(options, ATTNMERGE_LSE_BASE2 | ATTNMERGE_PDL, v.grad_out, opt)) ||
      (s = check_dtype_of(vg, vo)))
    return s;
  const int64_t total = vo.shape[0], heads = vo.shape[1], head_size = vo.shape[2];
  if ((s = check_head_size("o", head_size))) return s;
  if (vi.shape[0] < 1) return fail(ATTNMERGE_ERROR_VALUE, "indptr: expected rows + 1 >= 1 entries, got 0");
  const int64_t rows = vi.shape[0] - 1;
  const int64_t o_shape[3] = {total, heads, head_size};
  const int64_t out_shape[3] = {rows, heads, head_size};
  if ((s = check_shape(vl, o_shape, vo)) || (s = check_shape(vg, o_shape, vo)) || (s = check_shape(vgl, o_shape, vo)) ||
      (s = check_backward_shapes(v, out_shape, vo)) ||
      (s = check_grads({&vg, &vgl}, {&v.grad_out, &v.grad_out_lse, &v.out, &v.out_lse, &vo, &vl, &vi})) ||
      (s = check_indptr(vi, grad_out, rows, total)))
    return s;
  // With no rows, one row over every state writes their zeros (RangeBackward).
  const MergeShape shape{rows > 0 ? rows : total > 0 ? 1 : 0, heads, head_size, (opt.flags & ATTNMERGE_LSE_BASE2) != 0};
  const bool wide = indptr->dtype == ATTNMERGE_INT64;
  const RangeSource in{o->data,      vo.strides[0], vo.strides[1], static_cast<const float*>(lse->data),
                       vl.strides[0], vl.strides[1], indptr->data, vi.strides[0], wide, total};
  const RangeSource grad{data_or_null(vg), stride_or_0(vg, 0), stride_or_0(vg, 1),
                         static_cast<const float*>(data_or_null(vgl)), stride_or_0(vgl, 0), stride_or_0(vgl, 1),
                         indptr->data, vi.strides[0], wide, total};
  const BackwardArgs<RangeBackward> args{RangeBackward{in, grad, rows}, state_of(v.out, v.out_lse),
                                         state_of(v.grad_out, v.grad_out_lse), vg.present(), vgl.present()};
  const int64_t states = rows > 0 ? (total + rows - 1) / rows : total;
  return run_backward({&vg, &vgl, &v.grad_out, &v.grad_out_lse, &v.out, &v.out_lse, &vo, &vl, &vi}, shape, args, states,
                      o->dtype, grad_out->dtype,
                      choose_vec({vg.present() ? &vg : &vo, &v.grad_out, v.out.present() ? &v.out : &v.grad_out, &vo}, head_size),
                      stream, opt.flags);
}

const char* attnmerge_last_error(void) { return g_error; }

void attnmerge_last_launch(attnmerge_launch_info* info) {
  if (info != nullptr) *info = last_launch();
}

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
  char why[512];
  if (gpu_device_count() == 0 && describe_old_driver(why, sizeof why, gpu_driver_version(), gpu_build_version()))
    return fail(ATTNMERGE_ERROR_NO_DEVICE, "device %d: %s", device, why);
  if (device < 0 || device >= gpu_device_count())
    return fail(ATTNMERGE_ERROR_VALUE, "device: expected a CUDA device below %d, got %d", gpu_device_count(), device);
  return gpu_stream_synchronize(device, stream);
}

}  // extern "C"
