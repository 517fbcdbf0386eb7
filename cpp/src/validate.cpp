// Argument rules of the C ABI (validate.h).
#include "validate.h"

#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <utility>

namespace attnmerge {
namespace detail {

namespace {

// "o_a", "o_a and o_b", "o_a, lse_a and o_b": the names of some of a call's views, for messages.
struct NamesText {
  char text[256];
  NamesText(const View* const* views, int count) {
    int n = 0;
    text[0] = '\0';
    for (int k = 0; k < count && n < static_cast<int>(sizeof text); ++k) {
      const char* separator = k == 0 ? "" : k == count - 1 ? " and " : ", ";
      n += std::snprintf(text + n, sizeof text - n, "%s%s", separator, views[k]->name());
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

// v's logical shape must be `expected`, the sizes taken from `source`.
attnmerge_status check_shape(const View& v, const int64_t* expected, const View& source) {
  if (!v.present() || std::equal(expected, expected + v.ndim, v.shape)) return ATTNMERGE_SUCCESS;
  int64_t want[ATTNMERGE_MAX_NDIM] = {};
  std::copy(expected, expected + v.ndim, want);
  if (v.transposed) std::swap(want[0], want[1]);  // speak in the caller's layout
  return fail(ATTNMERGE_ERROR_VALUE, "%s: expected shape %s (the sizes of %s, shape %s), got %s", v.name(),
              ShapeText(want, v.ndim).text, source.name(), ShapeText(source.t->shape, source.ndim).text,
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
                  "%s: expected an output whose elements do not overlap, got stride %" PRId64
                  " on an axis of size %" PRId64 " (shape %s)",
                  v.name(), v.strides[i], v.shape[i], ShapeText(v.t->shape, v.ndim).text);
    extent = v.strides[i] * (v.shape[i] - 1) + extent;
  }
  return ATTNMERGE_SUCCESS;
}

// `out` apart from `other`, or (`alias`) the very same view.
attnmerge_status check_disjoint(const View& out, const View& other, Alias alias) {
  if (!out.present() || !other.present() || out.empty || other.empty) return ATTNMERGE_SUCCESS;
  const bool may_alias = alias == Alias::kMayBeOutput;
  if (may_alias && same_view(out, other)) return ATTNMERGE_SUCCESS;
  uintptr_t lo1, hi1, lo2, hi2;
  out.byte_range(lo1, hi1);
  other.byte_range(lo2, hi2);
  if (lo1 < hi2 && lo2 < hi1)
    return fail(ATTNMERGE_ERROR_VALUE, "%s: expected memory disjoint from %s%s, got overlapping ranges", out.name(),
                other.name(), may_alias ? " (or the very same view)" : "");
  return ATTNMERGE_SUCCESS;
}

// a (kATokensOrMore) under ATTNMERGE_A_TOKENS: at least the a_tokens tokens read, the sizes of
// `source` otherwise.
attnmerge_status check_a_shape(const View& v, const Sizes& n, const View& source) {
  if (v.shape[0] >= n.a_tokens && v.shape[1] == n.heads && (v.ndim != 3 || v.shape[2] == n.head_size))
    return ATTNMERGE_SUCCESS;
  return fail(ATTNMERGE_ERROR_VALUE,
              "%s: expected at least %" PRId64 " tokens (%s), %" PRId64 " heads%s%s, got shape %s", v.name(),
              n.a_tokens, v.names->of("a_tokens"), n.heads, v.ndim == 3 ? " and the head_size of " : "",
              v.ndim == 3 ? source.name() : "", ShapeText(v.t->shape, v.ndim).text);
}

int64_t size_of(Dim d, const Sizes& n) {
  switch (d) {
    case Dim::kTokens: return n.tokens;
    case Dim::kHeads: return n.heads;
    case Dim::kHeadSize: return n.head_size;
    case Dim::kStates: return n.states;
    case Dim::kTotal: return n.total;
    case Dim::kRows: return n.rows;
    case Dim::kRowsPlus1: return n.rows + 1;
    case Dim::kATokens:
    case Dim::kATokensOrMore: return n.a_tokens;
    case Dim::kPair: return 2;
    case Dim::kOne: return 1;
    case Dim::kOutHeadSize: return n.out_head_size;
    case Dim::kScales0: return n.scales[0];
    case Dim::kScales1: return n.scales[1];
    case Dim::kScales2: return n.scales[2];
    case Dim::kSliceTokens: return n.slice_tokens;
    case Dim::kSliceHeads: return n.slice_heads;
    case Dim::kNone: break;
  }
  return 0;
}

// How a call lays out its two-axis LSEs: [tokens, heads], or [heads, tokens] where the op takes
// ATTNMERGE_LSE_HEADS_FIRST and the options ask for it.
enum class LseLayout : uint8_t { kTokensFirst, kHeadsFirst };

LseLayout lse_layout(const attnmerge_options& opt, uint32_t op_flags) {
  return (op_flags & opt.flags & ATTNMERGE_LSE_HEADS_FIRST) ? LseLayout::kHeadsFirst : LseLayout::kTokensFirst;
}

// One tensor against its spec, into `v` (swapping the two axes of an LSE given [heads, tokens]).
// The dtypes an argument of `spec` may have in a call of `formats` (the block-scaled format its
// options ask for, where its op takes one): the block scales a format's (uint8 UE8M0, FP8 E4M3),
// NVFP4's output uint8 (two values per byte); else its role's (dtypes.h).
uint32_t dtypes_for(const ArgSpec& spec, uint32_t formats) {
  const uint32_t bit8 = 1u << ATTNMERGE_UINT8, fp8 = 1u << ATTNMERGE_FLOAT8_E4M3;
  if (spec.role == ATTNMERGE_ROLE_SCALE && formats == ATTNMERGE_BLOCK_MXFP8) return bit8;
  if (spec.role == ATTNMERGE_ROLE_SCALE && formats == ATTNMERGE_BLOCK_NVFP4) return fp8;
  if (spec.role == ATTNMERGE_ROLE_O_OUT && formats == ATTNMERGE_BLOCK_NVFP4) return bit8;
  return dtypes_of(spec.role);
}

attnmerge_status describe_one(const attnmerge_tensor* t, const ArgSpec& spec, LseLayout layout, const ArgNames& names,
                              uint32_t formats, View& v) {
  // `v` is as Checked made it (View's defaults): absent, its sizes 0; a given tensor sets the rest.
  v.spec = &spec;
  v.names = &names;
  const int ndim = spec.ndim();
  const uint32_t dtypes = dtypes_for(spec, formats);
  const bool transpose = spec.role == ATTNMERGE_ROLE_LSE && ndim == 2 && layout == LseLayout::kHeadsFirst;
  if (t == nullptr) {
    if (spec.presence == Presence::kOptional) return ATTNMERGE_SUCCESS;
    return fail(ATTNMERGE_ERROR_TYPE, "%s: expected an array, got %s", v.name(), names.of("NULL"));
  }
  v.t = t;
  v.ndim = ndim;
  v.transposed = transpose;
  if (t->ndim != ndim)
    return fail(ATTNMERGE_ERROR_VALUE, "%s: expected %d dimensions, got %d", v.name(), ndim, t->ndim);
  if (!in_set(dtypes, t->dtype))
    return fail(ATTNMERGE_ERROR_TYPE, "%s: expected dtype %s, got %s", v.name(), DtypesText(dtypes).text,
                dtype_name(t->dtype));
  constexpr uint32_t kTensorFlags = ATTNMERGE_READ_ONLY | ATTNMERGE_DEVICE_KNOWN;
  if (t->flags & ~kTensorFlags)
    return fail(ATTNMERGE_ERROR_VALUE, "%s: expected flags within 0x%x, got 0x%x", v.name(), kTensorFlags, t->flags);
  if (t->device < ATTNMERGE_HOST)
    return fail(ATTNMERGE_ERROR_VALUE, "%s: expected a device >= -1 (the host), got %d", v.name(), t->device);
  for (int i = 0; i < ndim; ++i) {
    const int src = transpose ? 1 - i : i;
    v.shape[i] = t->shape[src];
    v.strides[i] = t->strides[src];
    if (t->shape[i] < 0)
      return fail(ATTNMERGE_ERROR_VALUE, "%s: expected sizes >= 0, got shape %s", v.name(),
                  ShapeText(t->shape, ndim).text);
  }
  v.empty = std::find(v.shape, v.shape + ndim, 0) != v.shape + ndim;
  if (v.empty) return ATTNMERGE_SUCCESS;  // never addressed: its strides and pointer do not matter
  int64_t count = 1;
  for (int i = 0; i < ndim; ++i)
    if (__builtin_mul_overflow(count, v.shape[i], &count))
      return fail(ATTNMERGE_ERROR_VALUE, "%s: expected fewer than 2^63 elements, got shape %s", v.name(),
                  ShapeText(t->shape, ndim).text);
  for (int i = 0; i < ndim; ++i)
    if (t->strides[i] < 0)
      return fail(ATTNMERGE_ERROR_VALUE, "%s: expected strides >= 0, got %" PRId64 " on axis %d", v.name(),
                  t->strides[i], i);
  if (spec.is_o() && t->strides[ndim - 1] != 1 && t->shape[ndim - 1] > 1)
    return fail(ATTNMERGE_ERROR_VALUE, "%s: expected a unit stride on the head_size axis, got stride %" PRId64,
                v.name(), t->strides[ndim - 1]);
  if (t->data == nullptr) return fail(ATTNMERGE_ERROR_VALUE, "%s: expected a data pointer, got NULL", v.name());
  const std::size_t size = dtype_size(t->dtype);
  if (reinterpret_cast<uintptr_t>(t->data) % size != 0)
    return fail(ATTNMERGE_ERROR_VALUE, "%s: expected a data pointer aligned to %zu bytes, got %p", v.name(), size,
                t->data);
  int64_t last = 0, term;  // the largest byte offset must fit in 63 bits
  for (int i = 0; i < ndim; ++i)
    if (__builtin_mul_overflow(v.shape[i] - 1, v.strides[i], &term) || __builtin_add_overflow(last, term, &last) ||
        __builtin_add_overflow(last, 1, &term) || __builtin_mul_overflow(term, static_cast<int64_t>(size), &term))
      return fail(ATTNMERGE_ERROR_VALUE, "%s: shape %s with these strides spans more than 2^63 bytes", v.name(),
                  ShapeText(t->shape, ndim).text);
  v.last = last;
  return ATTNMERGE_SUCCESS;
}

// The released layouts of attnmerge_options, by the struct_size a caller built against each passes.
// 0.2.0's is the baseline, which 0 also names (zero-initialized options are the defaults); it is
// this header's.  A release that adds fields at the end adds its layout's size here, and
// read_layout reads those fields only where struct_size is that size (or a later one).
constexpr uint32_t kBaselineSize = sizeof(attnmerge_options);
static_assert(sizeof(void*) != 8 || kBaselineSize == 120,
              "attnmerge_options grew: until 0.2.0 is released the baseline grows with it (update 120), after "
              "that a new field makes a new layout, accepted by a size of its own (kBaselineSize stays 0.2.0's)");

bool known_layout(uint32_t size) { return size == 0 || size == kBaselineSize; }

// A string of the caller's names table: NULL and "" are refused, as they would name nothing.
attnmerge_status check_name_text(const char* text, int i, const char* field) {
  if (text != nullptr && text[0] != '\0') return ATTNMERGE_SUCCESS;
  return fail(ATTNMERGE_ERROR_VALUE, "options.arg_names[%d].%s: expected a non-empty string, got %s", i, field,
              text == nullptr ? "NULL" : "\"\"");
}

}  // namespace

// Step 0 (validate.h): the fields struct_size covers, into `opt` (the others zero), and the caller's names.
attnmerge_status read_layout(const attnmerge_options* options, attnmerge_options& opt, ArgNames& names) {
  opt = attnmerge_options{};
  if (options == nullptr) return ATTNMERGE_SUCCESS;
  const uint32_t size = options->struct_size;
  if (!known_layout(size))
    return fail(ATTNMERGE_ERROR_VALUE,
                "options.struct_size: expected 0 or %u (sizeof(attnmerge_options) of attnmerge 0.2.0), got %u",
                static_cast<unsigned>(kBaselineSize), size);
  // Field by field, the baseline's: a caller of a layout owns no bytes past its end.
  opt.flags = options->flags;
  opt.a_tokens = options->a_tokens;
  opt.output_scale = options->output_scale;
  opt.output_scale_ptr = options->output_scale_ptr;
  opt.struct_size = size;
  opt.sink = options->sink;
  opt.group_scales = options->group_scales;
  opt.group_size = options->group_size;
  opt.sum_a = options->sum_a;
  opt.sum_b = options->sum_b;
  opt.valid = options->valid;
  opt.num_tokens = options->num_tokens;
  opt.a_tokens_tensor = options->a_tokens_tensor;
  opt.arg_names = options->arg_names;
  opt.num_arg_names = options->num_arg_names;
  if (opt.num_arg_names < 0)
    return fail(ATTNMERGE_ERROR_VALUE, "options.num_arg_names: expected a count >= 0, got %d", opt.num_arg_names);
  if (opt.num_arg_names > 0 && opt.arg_names == nullptr)
    return fail(ATTNMERGE_ERROR_VALUE, "options.arg_names: expected %d entries, got NULL", opt.num_arg_names);
  attnmerge_status s;
  for (int i = 0; i < opt.num_arg_names; ++i)
    if ((s = check_name_text(opt.arg_names[i].arg, i, "arg")) ||
        (s = check_name_text(opt.arg_names[i].name, i, "name")))
      return s;
  names = ArgNames{opt.arg_names, opt.num_arg_names};
  return ATTNMERGE_SUCCESS;
}

namespace {

// Step 1: tensors[i] against specs[i], each alone, into views[i] (a fresh Checked's), in table order.
attnmerge_status describe(const ArgSpec* specs, const attnmerge_tensor* const* tensors, int n, LseLayout layout,
                          const ArgNames& names, uint32_t formats, View* views) {
  for (int i = 0; i < n; ++i)
    if (attnmerge_status s = describe_one(tensors[i], specs[i], layout, names, formats, views[i])) return s;
  return ATTNMERGE_SUCCESS;
}

// Step 2: the options every op shares, as read_layout read them.  `op` says which flags and option
// tensors it takes; the dtype of `out` decides whether an output scale or group scales are allowed
// (FP8 only).
attnmerge_status read_options(const attnmerge_options& opt, const OpSpec& op, const View& out, float& inv_scale) {
  const uint32_t op_flags = op.flags;
  const bool takes_sink = op.sink >= 0, takes_groups = op.group_scales >= 0;
  if (opt.flags & ~op_flags)
    return fail(ATTNMERGE_ERROR_VALUE, "options.flags: expected flags within 0x%x for this op, got 0x%x", op_flags,
                opt.flags);
  // An argument's base (attnmerge.h's mixed bases) is one or the other.
  for (const auto& pair : {std::pair<uint32_t, const char*>{ATTNMERGE_LSE_B_BASE2 | ATTNMERGE_LSE_B_BASE_E,
                                                            "ATTNMERGE_LSE_B_BASE2 and ATTNMERGE_LSE_B_BASE_E"},
                           {ATTNMERGE_OUT_LSE_BASE2 | ATTNMERGE_OUT_LSE_BASE_E,
                            "ATTNMERGE_OUT_LSE_BASE2 and ATTNMERGE_OUT_LSE_BASE_E"}})
    if ((opt.flags & pair.first) == pair.first)
      return fail(ATTNMERGE_ERROR_VALUE, "options.flags: expected at most one of %s, got both (0x%x)", pair.second,
                  opt.flags);
  if (opt.sink != nullptr && !takes_sink)
    return fail(ATTNMERGE_ERROR_VALUE,
                "%s: expected none for this op (the in-place merge and the backwards take none), got a tensor",
                out.names->of("sink"));
  // The option tensors of some ops only, each refused by name elsewhere, with who takes it.
  const struct {
    const attnmerge_tensor* given;
    int arg;
    const char *name, *who;
  } only_some[] = {
      {opt.sum_a, op.sum_a, "sum_a",
       "the sums of lse_a, or of lse of the N-way and variable-length merges and the share; the in-place merge "
       "writes its merged LSE over lse, the exchange takes its ranks' sums in exchange.sum, and the backwards take "
       "LSEs"},
      {opt.sum_b, op.sum_b, "sum_b", "the sums of lse_b of the two-way merge or lse_other of the in-place merge"},
      {opt.valid, op.valid, "valid", "the forward merges, the share and the exchange take it, the backwards do not"},
      {opt.num_tokens, op.num_tokens, "num_tokens",
       "the forward merges and the share take it, the exchange and the backwards do not"},
      {opt.a_tokens_tensor, op.a_tokens_tensor, "a_tokens",
       "a tensor of a_tokens: the two-way merge takes one, its backward takes options.a_tokens"},
  };
  for (const auto& x : only_some)
    if (x.given != nullptr && x.arg < 0)
      return fail(ATTNMERGE_ERROR_VALUE, "%s: expected none for this op (%s), got a tensor", out.names->of(x.name),
                  x.who);
  if (opt.a_tokens_tensor != nullptr && (opt.flags & ATTNMERGE_A_TOKENS))
    return fail(ATTNMERGE_ERROR_VALUE,
                "%s: expected options.a_tokens (with ATTNMERGE_A_TOKENS) or a tensor of it "
                "(options.a_tokens_tensor), got both",
                out.names->of("a_tokens"));
  const bool groups = opt.group_scales != nullptr;
  if (groups && !takes_groups)
    return fail(ATTNMERGE_ERROR_VALUE,
                "%s: expected none for this op (the two-way, N-way and variable-length merges and the share take "
                "group scales), got a tensor",
                out.names->of("group_scales"));
  if (!groups && opt.group_size != 0)
    return fail(ATTNMERGE_ERROR_VALUE, "%s: expected 0 without group_scales, got %d", out.names->of("group_size"),
                opt.group_size);
  if (!groups && (opt.flags & ATTNMERGE_GROUP_SCALE_UE8M0))
    return fail(ATTNMERGE_ERROR_VALUE,
                "options.flags: expected ATTNMERGE_GROUP_SCALE_UE8M0 only with group_scales, got 0x%x and none",
                opt.flags);
  const uint32_t formats = opt.flags & (ATTNMERGE_BLOCK_MXFP8 | ATTNMERGE_BLOCK_NVFP4);
  if (formats == (ATTNMERGE_BLOCK_MXFP8 | ATTNMERGE_BLOCK_NVFP4))
    return fail(ATTNMERGE_ERROR_VALUE,
                "options.flags: expected at most one of ATTNMERGE_BLOCK_MXFP8 and ATTNMERGE_BLOCK_NVFP4, got both (0x%x)",
                opt.flags);
  const char* format = formats == ATTNMERGE_BLOCK_NVFP4 ? "NVFP4" : "MXFP8";
  if (formats != 0 && !groups)
    return fail(ATTNMERGE_ERROR_VALUE, "%s: expected a tensor for %s's block scales, got none",
                out.names->of("group_scales"), format);
  if (formats != 0 && (opt.flags & ATTNMERGE_GROUP_SCALE_UE8M0))
    return fail(ATTNMERGE_ERROR_VALUE,
                "options.flags: expected no ATTNMERGE_GROUP_SCALE_UE8M0 (per-group FP8's) with %s, got 0x%x", format,
                opt.flags);
  if ((opt.flags & ATTNMERGE_SCALE_RCEIL) && formats != ATTNMERGE_BLOCK_MXFP8)
    return fail(ATTNMERGE_ERROR_VALUE, "options.flags: expected ATTNMERGE_SCALE_RCEIL only with ATTNMERGE_BLOCK_MXFP8, "
                "got 0x%x", opt.flags);
  if ((opt.flags & ATTNMERGE_SCALE_SWIZZLED) && formats == 0)
    return fail(ATTNMERGE_ERROR_VALUE,
                "options.flags: expected ATTNMERGE_SCALE_SWIZZLED only with a block-scaled format "
                "(ATTNMERGE_BLOCK_MXFP8 or ATTNMERGE_BLOCK_NVFP4), got 0x%x",
                opt.flags);
  const bool nvfp4 = formats == ATTNMERGE_BLOCK_NVFP4;  // out is uint8 then (describe_one)
  const bool fp8 = out.t->dtype == ATTNMERGE_FLOAT8_E4M3;
  if (groups && !fp8 && !nvfp4)
    return fail(ATTNMERGE_ERROR_TYPE, "%s: expected dtype float8_e4m3 for %s (%s), got %s", out.name(),
                formats != 0 ? "MXFP8" : "per-group scales", out.names->of("group_scales"), dtype_name(out.t->dtype));
  const auto name = [&] { return out.names->of("output_scale"); };  // looked up only where a check fails
  if (groups && !nvfp4 && (opt.output_scale != 0.0f || opt.output_scale_ptr != nullptr))
    return fail(ATTNMERGE_ERROR_VALUE, "%s: expected none with %s (each %s has its own scale), got a scale",
                name(), out.names->of("group_scales"), formats != 0 ? "block" : "group");
  const float scale = opt.output_scale;
  if (scale != 0.0f && scale != 1.0f && !fp8 && !nvfp4)
    return fail(ATTNMERGE_ERROR_VALUE, "%s: expected none (or 1) for a %s output, got %g", name(),
                dtype_name(out.t->dtype), scale);
  if (opt.output_scale_ptr != nullptr && !fp8 && !nvfp4)
    return fail(ATTNMERGE_ERROR_VALUE, "%s: expected none for a %s output, got a scale in memory", name(),
                dtype_name(out.t->dtype));
  if (opt.output_scale_ptr != nullptr && scale != 0.0f)
    return fail(ATTNMERGE_ERROR_VALUE, "%s: expected a value or a pointer, got both", name());
  if (reinterpret_cast<uintptr_t>(opt.output_scale_ptr) % alignof(float) != 0)
    return fail(ATTNMERGE_ERROR_VALUE, "%s: expected a pointer aligned to 4 bytes, got %p", name(),
                static_cast<const void*>(opt.output_scale_ptr));
  if (!(scale >= 0.0f) || std::isinf(scale))
    return fail(ATTNMERGE_ERROR_VALUE, "%s: expected a finite scale > 0, got %g", name(), scale);
  inv_scale = scale == 0.0f ? 1.0f : 1.0f / scale;
  return ATTNMERGE_SUCCESS;
}

// An argument the call writes and does not read: it has no say in the sizes or the precision the
// inputs agree on (Python allocates outputs like an input, which would vote twice for it).
bool is_output_only(const View& v) { return v.spec->use == Use::kWrite; }

// The arguments a call's precision counts: its O and LSE (not masks, indptr or scales).
bool takes_precision(const View& v) {
  return v.present() && (v.spec->role & (ATTNMERGE_ROLE_O_IN | ATTNMERGE_ROLE_O_OUT | ATTNMERGE_ROLE_LSE)) != 0;
}

// Step 3: one precision per call: every O and LSE float64 (computed in float64, on the CPU path),
// or none of them.  The inputs decide, as for shapes (check_agreement): where they are mixed, the
// side with fewer of them is named (the float64 one where the two are as many: float64 is the
// rarer choice); where they agree, the outputs that do not.
attnmerge_status check_precision(Views views, Precision& precision) {
  precision = Precision::kFloat32;
  bool wide_seen = false;  // the common call has no float64 at all: nothing to sort or name
  for (const View& v : views) wide_seen = wide_seen || (takes_precision(v) && v.t->dtype == ATTNMERGE_FLOAT64);
  if (!wide_seen) return ATTNMERGE_SUCCESS;
  const View* side[2][kMaxArgs];  // [0] not float64, [1] float64
  int count[2] = {0, 0};
  for (const View& v : views)
    if (takes_precision(v) && !is_output_only(v)) {
      const int wide = v.t->dtype == ATTNMERGE_FLOAT64;
      side[wide][count[wide]++] = &v;
    }
  int odd = count[1] <= count[0] ? 1 : 0;  // where both sides have inputs
  if (count[0] == 0 || count[1] == 0) {  // the inputs agree: the outputs that do not
    const int agreed = count[1] > 0 ? 1 : 0;
    odd = 1 - agreed;
    count[odd] = 0;
    for (const View& v : views)
      if (takes_precision(v) && is_output_only(v) && (v.t->dtype == ATTNMERGE_FLOAT64) == (odd == 1))
        side[odd][count[odd]++] = &v;
    precision = agreed == 1 ? Precision::kFloat64 : Precision::kFloat32;
    if (count[odd] == 0 || count[1 - odd] == 0) return ATTNMERGE_SUCCESS;
  }
  uint32_t expected = 0, got = 0;
  for (int k = 0; k < count[odd]; ++k) {
    expected |= dtypes_of(side[odd][k]->spec->role);
    got |= 1u << side[odd][k]->t->dtype;
  }
  expected = odd == 1 ? expected & ~(1u << ATTNMERGE_FLOAT64) : 1u << ATTNMERGE_FLOAT64;
  const View* other = side[1 - odd][0];  // the first of the others, one of the named one's kind if any
  for (int k = count[1 - odd] - 1; k >= 0; --k)
    if (side[1 - odd][k]->spec->role == side[odd][0]->spec->role) other = side[1 - odd][k];
  return fail(ATTNMERGE_ERROR_TYPE,
              "%s: expected dtype %s (a call's O and LSE are float64 all or none, and %s is %s), got %s",
              NamesText(side[odd], count[odd]).text, DtypesText(expected).text, other->name(),
              dtype_name(other->t->dtype), DtypesText(got).text);
}

// Step 3: every ArgSpec::dtype_of, where both are given.
attnmerge_status check_dtypes(const OpSpec& op, Views views) {
  for (int i = 0; i < op.count; ++i) {
    const View& v = views.v[i];
    if (op.dtype_of[i] < 0 || !v.present()) continue;
    const View& like = views.v[op.dtype_of[i]];
    if (like.present() && like.t->dtype != v.t->dtype)
      return fail(ATTNMERGE_ERROR_TYPE, "%s: expected the dtype of %s (%s), got %s", v.name(), like.name(),
                  dtype_name(like.t->dtype), dtype_name(v.t->dtype));
  }
  return ATTNMERGE_SUCCESS;
}

}  // namespace

DtypesText::DtypesText(uint32_t set) {
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

// The largest head_size: a row's packs span at most 65535 blocks of 256 threads.
constexpr int64_t kMaxHeadSize = int64_t{65535} * 256;

attnmerge_status check_head_size(const View& source, int64_t head_size) {
  if (head_size >= 1 && head_size <= kMaxHeadSize) return ATTNMERGE_SUCCESS;
  return fail(ATTNMERGE_ERROR_VALUE, "%s: expected a head_size from 1 to %" PRId64 ", got %" PRId64, source.name(),
              kMaxHeadSize, head_size);
}

attnmerge_status read_a_tokens(const attnmerge_options& opt, const View& source, Sizes& n) {
  n.a_tokens = n.tokens;
  n.a_tokens_given = (opt.flags & ATTNMERGE_A_TOKENS) != 0;
  if (!n.a_tokens_given) return ATTNMERGE_SUCCESS;
  if (opt.a_tokens < 0 || opt.a_tokens > n.tokens)
    return fail(ATTNMERGE_ERROR_VALUE, "%s: expected 0 to the %" PRId64 " tokens of %s, got %" PRId64,
                source.names->of("a_tokens"), n.tokens, source.name(), opt.a_tokens);
  n.a_tokens = opt.a_tokens;
  return ATTNMERGE_SUCCESS;
}

namespace {

// Step 4: options.group_size (or the block format's), where group scales are given, against
// head_size (read off `source`) and the vectors of the O arrays (a group's lanes lie in one
// warp), and the scales' shape (Sizes::scales) in their layout, the swizzled tiles' alignment;
// out's last axis (Sizes::out_head_size).
attnmerge_status check_group_size(const attnmerge_options& opt, Views views, const View& source, Sizes& n) {
  const uint32_t formats = opt.flags & (ATTNMERGE_BLOCK_MXFP8 | ATTNMERGE_BLOCK_NVFP4);
  const bool nvfp4 = formats == ATTNMERGE_BLOCK_NVFP4;
  n.out_head_size = n.head_size;
  if (opt.group_scales == nullptr) return ATTNMERGE_SUCCESS;
  int64_t g = opt.group_size;
  const char* name = views.names->of("group_size");
  if (formats != 0) {
    const char* format = nvfp4 ? "NVFP4" : "MXFP8";
    const int64_t block = nvfp4 ? 16 : 32;
    if (g != 0 && g != block)
      return fail(ATTNMERGE_ERROR_VALUE, "%s: expected 0 or %" PRId64 " (%s's block), got %" PRId64, name, block, format,
                  g);
    g = block;
    if (n.head_size % g != 0)
      return fail(ATTNMERGE_ERROR_VALUE, "%s: expected a head_size that %s's block of %" PRId64 " divides, got %" PRId64,
                  source.name(), format, g, n.head_size);
  } else {
    if (g < 8 || (g & (g - 1)) != 0)
      return fail(ATTNMERGE_ERROR_VALUE, "%s: expected a power of two >= 8, got %" PRId64, name, g);
    if (n.head_size % g != 0)
      return fail(ATTNMERGE_ERROR_VALUE, "%s: expected a divisor of head_size (%" PRId64 "), got %" PRId64, name,
                  n.head_size, g);
  }
  const int vec = choose_vec(views, n.head_size, nvfp4);
  if (nvfp4 && vec < 2)
    return fail(ATTNMERGE_ERROR_VALUE,
                "%s: expected O arrays whose pointers and strides allow vectors of 2 elements (NVFP4 stores two "
                "values per byte), got arrays of single elements",
                source.name());
  if (g > 32 * vec)
    return fail(ATTNMERGE_ERROR_VALUE,
                "%s: expected at most %d (a warp's 32 lanes of %d elements each, the vector the O arrays' pointers "
                "and strides allow), got %" PRId64,
                name, 32 * vec, vec, g);
  if (nvfp4) n.out_head_size = n.head_size / 2;
  // The output's rows: its first axis (tokens, or a variable-length merge's rows).
  int64_t rows = 0;
  const View* scales = nullptr;
  for (const View& v : views) {
    if (v.spec->role == ATTNMERGE_ROLE_O_OUT) rows = size_of(v.spec->shape[0], n);
    if (v.spec->role == ATTNMERGE_ROLE_SCALE) scales = &v;
  }
  const int64_t per_head = n.head_size / g;
  if (!(opt.flags & ATTNMERGE_SCALE_SWIZZLED)) {
    n.scales[0] = rows, n.scales[1] = n.heads, n.scales[2] = per_head;
    return ATTNMERGE_SUCCESS;
  }
  n.scales[0] = (rows + 127) / 128, n.scales[1] = (n.heads * per_head + 3) / 4, n.scales[2] = 512;
  if (scales == nullptr || !scales->present() || scales->empty) return ATTNMERGE_SUCCESS;
  const int64_t* st = scales->strides;
  if (reinterpret_cast<uintptr_t>(scales->t->data) % 16 != 0 || st[0] % 16 != 0 || st[1] % 16 != 0 ||
      (st[2] != 1 && scales->shape[2] > 1))
    return fail(ATTNMERGE_ERROR_VALUE,
                "%s: expected the 128 x 4 tiles' alignment (a pointer and tile strides of multiples of 16 bytes, a "
                "unit stride within a tile), got pointer %p, strides [%" PRId64 ", %" PRId64 ", %" PRId64 "]",
                scales->name(), scales->t->data, st[0], st[1], st[2]);
  return ATTNMERGE_SUCCESS;
}

// Step 4, where it fails: the inputs agree on the call's sizes, so that a wrong one is named and
// not the others through it.  Each input's axes vote for the sizes of their Dims (voted_dim); the size
// most inputs give a Dim is the call's, and an input that gives another is named, against those
// that gave it.  Where two sizes have as many votes, the op's source (OpSpec::sizes_from) decides
// (every LSE given [heads, tokens] against every O: the LSEs are named), but where only two inputs
// vote and disagree (o_a's head_size against o_b's) both are named.  Outputs do not vote (an
// output is checked against the sizes afterwards): Python allocates them like an input, which
// would then outvote the others.

// The Dim axis `axis` of `v` gives its size to, and that size (Dim::kNone: none): a's tokens are
// the call's unless options.a_tokens says how many of them are read; indptr holds rows + 1.
Dim voted_dim(const View& v, int axis, bool a_tokens_given, int64_t& size) {
  size = v.shape[axis];
  switch (v.spec->shape[axis]) {
    case Dim::kATokensOrMore: return a_tokens_given ? Dim::kNone : Dim::kTokens;
    case Dim::kRowsPlus1: size -= 1; return Dim::kRows;
    case Dim::kATokens:
    case Dim::kOutHeadSize:
    case Dim::kScales0:
    case Dim::kScales1:
    case Dim::kScales2: return Dim::kNone;  // the options' sizes
    default: return v.spec->shape[axis];
  }
}

// The votes on one Dim: each size given, by how many inputs, and the first of them.
struct Tally {
  int64_t size[kMaxArgs];
  int votes[kMaxArgs];
  const View* first[kMaxArgs];
  int count = 0;
  int top = -1, second = -1;  // the sizes with the most votes; second >= 0: as many as top's (a tie)

  void add(int64_t s, const View* v) {
    int i = 0;
    while (i < count && size[i] != s) ++i;
    if (i == count) size[count] = s, votes[count] = 0, first[count++] = v;
    ++votes[i];
  }
  // `source_size`: the source's vote, or null where it has none on this Dim.
  void decide(const int64_t* source_size) {
    for (int i = 0; i < count; ++i)
      if (top < 0 || votes[i] > votes[top]) top = i;
    for (int i = 0; i < count; ++i)
      if (i != top && votes[i] == votes[top] && second < 0) second = i;
    if (second < 0 || votes[top] + votes[second] == 2 || source_size == nullptr) return;
    for (int i = 0; i < count; ++i)
      if (votes[i] == votes[top] && size[i] == *source_size) top = i, second = -1;  // the source breaks the tie
  }
  bool decided() const { return top >= 0 && second < 0; }
};

const char* dim_words(Dim d) {
  switch (d) {
    case Dim::kTokens: return "number of tokens";
    case Dim::kHeads: return "number of heads";
    case Dim::kHeadSize: return "head_size";
    case Dim::kStates:
    case Dim::kTotal: return "number of states";
    case Dim::kRows: return "number of rows";
    default: return "size";
  }
}

// The shape `v` was given in, with the sizes of `want` (its logical order) where set: the
// caller's layout (an LSE given [heads, tokens] swapped back).
void callers_shape(const View& v, int64_t* want) {
  if (v.transposed) std::swap(want[0], want[1]);
}

attnmerge_status check_agreement(Views views, const View& source, bool a_tokens_given) {
  constexpr Dim kVoted[] = {Dim::kTokens, Dim::kHeads, Dim::kHeadSize, Dim::kStates, Dim::kTotal, Dim::kRows};
  constexpr int kKinds = static_cast<int>(sizeof kVoted / sizeof kVoted[0]);
  Tally tally[kKinds];
  const auto kind_of = [&](Dim d) {
    for (int k = 0; k < kKinds; ++k)
      if (kVoted[k] == d) return k;
    return -1;
  };
  for (const View& v : views) {
    if (!v.present() || is_output_only(v)) continue;
    for (int axis = 0; axis < v.ndim; ++axis) {
      int64_t size;
      const int k = kind_of(voted_dim(v, axis, a_tokens_given, size));
      if (k >= 0) tally[k].add(size, &v);
    }
  }
  int64_t source_size[kKinds];
  bool source_votes[kKinds] = {};
  for (int axis = 0; axis < source.ndim; ++axis) {
    int64_t size;
    const int k = kind_of(voted_dim(source, axis, a_tokens_given, size));
    if (k >= 0) source_size[k] = size, source_votes[k] = true;
  }
  for (int k = 0; k < kKinds; ++k) tally[k].decide(source_votes[k] ? &source_size[k] : nullptr);
  // An input at odds with a size the inputs decided.
  for (const View& v : views) {
    if (!v.present() || is_output_only(v)) continue;
    int64_t want[ATTNMERGE_MAX_NDIM] = {};
    int odd = -1;  // the kind of v's first axis at odds
    for (int axis = 0; axis < v.ndim; ++axis) {
      int64_t size;
      const int k = kind_of(voted_dim(v, axis, a_tokens_given, size));
      want[axis] = v.shape[axis];
      if (k < 0 || !tally[k].decided() || tally[k].size[tally[k].top] == size) continue;
      want[axis] = tally[k].size[tally[k].top] + (v.spec->shape[axis] == Dim::kRowsPlus1 ? 1 : 0);
      if (odd < 0) odd = k;
    }
    if (odd < 0) continue;
    const View* agree[kMaxArgs];
    int n = 0;
    for (const View& u : views) {
      if (!u.present() || is_output_only(u) || &u == &v) continue;
      for (int axis = 0; axis < u.ndim; ++axis) {
        int64_t size;
        if (kind_of(voted_dim(u, axis, a_tokens_given, size)) == odd && size == tally[odd].size[tally[odd].top]) {
          agree[n++] = &u;
          break;
        }
      }
    }
    callers_shape(v, want);
    return fail(ATTNMERGE_ERROR_VALUE, "%s: expected shape %s (the %s of %s), got %s", v.name(),
                ShapeText(want, v.ndim).text, dim_words(kVoted[odd]), NamesText(agree, n).text,
                ShapeText(v.t->shape, v.ndim).text);
  }
  // Two sizes with as many votes: both sides named.
  for (int k = 0; k < kKinds; ++k) {
    const Tally& t = tally[k];
    if (t.top < 0 || t.decided()) continue;
    const View& a = *t.first[std::min(t.top, t.second)];
    const View& b = *t.first[std::max(t.top, t.second)];
    const int64_t size_a = t.size[std::min(t.top, t.second)], size_b = t.size[std::max(t.top, t.second)];
    return fail(ATTNMERGE_ERROR_VALUE,
                "%s and %s: expected the same %s, got %" PRId64 " (%s, shape %s) and %" PRId64 " (%s, shape %s)",
                a.name(), b.name(), dim_words(kVoted[k]), size_a, a.name(), ShapeText(a.t->shape, a.ndim).text,
                size_b, b.name(), ShapeText(b.t->shape, b.ndim).text);
  }
  return ATTNMERGE_SUCCESS;
}

// Step 4: every given argument has the shape its Dims give in `sizes` (read off `source`), `first`
// before the others.
attnmerge_status check_shape_of(const View& v, const Sizes& sizes, const View& source) {
  if (!v.present()) return ATTNMERGE_SUCCESS;
  if (v.spec->shape[0] == Dim::kATokensOrMore && sizes.a_tokens_given) return check_a_shape(v, sizes, source);
  int64_t expected[ATTNMERGE_MAX_NDIM] = {};
  for (int i = 0; i < v.ndim; ++i) expected[i] = size_of(v.spec->shape[i], sizes);
  return check_shape(v, expected, source);
}

attnmerge_status check_shapes(Views views, const Sizes& sizes, const View& source, const View& first) {
  if (attnmerge_status s = check_shape_of(first, sizes, source)) return s;
  for (const View& v : views)
    if (&v != &first)
      if (attnmerge_status s = check_shape_of(v, sizes, source)) return s;
  return ATTNMERGE_SUCCESS;
}

// Step 5: the outputs, against themselves, the outputs before them and every input (the given
// views alone, gathered first: an op's table lists every option tensor, most of them absent).
attnmerge_status check_outputs(Views views) {
  const View *outs[kMaxArgs], *ins[kMaxArgs];
  int n_out = 0, n_in = 0;
  for (const View& v : views)
    if (v.present()) (v.spec->is_output() ? outs[n_out++] : ins[n_in++]) = &v;
  for (int i = 0; i < n_out; ++i)
    if (outs[i]->t->flags & ATTNMERGE_READ_ONLY)
      return fail(ATTNMERGE_ERROR_VALUE, "%s: expected a writable tensor, got a read-only one", outs[i]->name());
  attnmerge_status s;
  for (int i = 0; i < n_out; ++i)
    if ((s = check_no_self_overlap(*outs[i]))) return s;
  for (int i = 0; i < n_out; ++i)
    for (int j = 0; j < i; ++j)
      if ((s = check_disjoint(*outs[i], *outs[j], Alias::kNone))) return s;
  for (int k = 0; k < n_in; ++k)
    for (int i = 0; i < n_out; ++i) {
      const bool same_kind = ins[k]->spec->is_o() == outs[i]->spec->is_o();
      if ((s = check_disjoint(*outs[i], *ins[k], same_kind ? ins[k]->spec->alias : Alias::kNone))) return s;
    }
  return ATTNMERGE_SUCCESS;
}

}  // namespace

const attnmerge_tensor* option_tensor(const attnmerge_options* options,
                                      const attnmerge_tensor* const attnmerge_options::*field) {
  return options != nullptr && known_layout(options->struct_size) ? options->*field : nullptr;
}

attnmerge_status validate(const OpSpec& op, const attnmerge_tensor* const* tensors, const attnmerge_options* options,
                          Checked& call) {
  call.count = op.count;
  const Views views = call.all();
  attnmerge_status s;
  if ((s = read_layout(options, call.opt, call.names)) ||
      (s = describe(op.args, tensors, op.count, lse_layout(call.opt, op.flags), call.names,
                    call.opt.flags & op.flags & (ATTNMERGE_BLOCK_MXFP8 | ATTNMERGE_BLOCK_NVFP4), call.views)))
    return s;
  const View& source = call.views[op.sizes_from];
  if ((s = read_options(call.opt, op, call.views[op.scale_of], call.inv_scale)) ||
      (s = check_precision(views, call.precision)) || (s = check_dtypes(op, views)))
    return s;
  if ((s = op.equations(views, source, call.opt, call.sizes)) || (s = check_group_size(call.opt, views, source, call.sizes)) ||
      (s = check_shapes(views, call.sizes, source, call.views[op.sizes_lse]))) {
    // Inputs at odds with each other fail here, the source's sizes against the others': the vote
    // names the one at odds instead (a call that passes pays for no vote).
    const attnmerge_status odd =
        check_agreement(views, source, (call.opt.flags & op.flags & ATTNMERGE_A_TOKENS) != 0);
    return odd != ATTNMERGE_SUCCESS ? odd : s;
  }
  call.num_tokens = op.num_tokens >= 0 && call.views[op.num_tokens].present() ? op.num_tokens : -1;
  return check_outputs(views);
}

attnmerge_status check_indptr(const View& vi, const View& o, const attnmerge_tensor* out, int64_t rows) {
  const attnmerge_tensor* indptr = vi.t;
  const int64_t total = o.shape[0];
  const bool wide = indptr->dtype == ATTNMERGE_INT64;
  if (indptr->device == ATTNMERGE_HOST && out->device == ATTNMERGE_HOST &&
      ((indptr->flags & ATTNMERGE_DEVICE_KNOWN) || gpu_pointer_device(indptr->data) == ATTNMERGE_HOST)) {
    int64_t previous = 0;
    for (int64_t r = 0; r <= rows; ++r) {
      const int64_t v = wide ? static_cast<const int64_t*>(indptr->data)[r * vi.strides[0]]
                             : static_cast<const int32_t*>(indptr->data)[r * vi.strides[0]];
      if (v < previous || v > total)
        return fail(ATTNMERGE_ERROR_VALUE,
                    "%s: expected non-decreasing offsets from 0 or more up to the %" PRId64
                    " states of %s, got %s[%" PRId64 "] = %" PRId64 "%s",
                    vi.name(), total, o.name(), vi.name(), r, v,
                    v > total ? " (past the end)"
                    : r == 0  ? " (below 0)"
                              : " (decreasing)");
      previous = v;
    }
  }
  return ATTNMERGE_SUCCESS;
}

std::size_t widest_o(Views views) {
  std::size_t widest = 0;
  for (const View& v : views)
    if (v.present() && v.spec->is_o()) widest = std::max(widest, dtype_size(v.t->dtype));
  return widest;
}

int choose_vec(Views views, int64_t head_size, bool packed_out) {
  const std::size_t widest = widest_o(views);
  for (int vec = static_cast<int>(16 / widest); vec > 1; vec /= 2) {
    bool ok = head_size % vec == 0;
    for (const View& v : views) {
      if (!ok || !v.present() || !v.spec->is_o() || v.empty) continue;
      const int items = packed_out && v.spec->role == ATTNMERGE_ROLE_O_OUT ? vec / 2 : vec;  // a vector's
      ok = reinterpret_cast<uintptr_t>(v.t->data) % (items * dtype_size(v.t->dtype)) == 0;
      for (int axis = 0; ok && axis < v.ndim - 1; ++axis) ok = v.shape[axis] <= 1 || v.strides[axis] % items == 0;
    }
    if (ok) return vec;
  }
  return 1;
}

bool same_view(const View& x, const View& y) {
  return x.t->data == y.t->data && x.t->dtype == y.t->dtype && x.ndim == y.ndim &&
         std::equal(x.shape, x.shape + x.ndim, y.shape) && std::equal(x.strides, x.strides + x.ndim, y.strides);
}

// ---- the exchange ---------------------------------------------------------------------------------

namespace {

// The released layouts of attnmerge_exchange (as attnmerge_options', read_layout): 0.2.0's is the
// baseline, which 0 also names.
constexpr uint32_t kExchangeBaselineSize = sizeof(attnmerge_exchange);
static_assert(sizeof(void*) != 8 || kExchangeBaselineSize == 232,
              "attnmerge_exchange grew: until 0.2.0 is released the baseline grows with it (update 232), after "
              "that a new field makes a new layout, accepted by a size of its own");
static_assert(ATTNMERGE_EXCHANGE_MAX_WORLD == exchange::kMaxWorld, "exchange.h's kMaxWorld is the header's");

// The arrays of pointers an op reads of the exchange: the pads, and (the merge) o, lse and the
// sums where given (NULL: LSEs).
struct RankArray {
  const char* field;
  const void* const* entries;
  std::size_t align;  // bytes each entry is aligned to
};
constexpr int kRankArrays = 4;

int rank_arrays(const attnmerge_exchange* x, ExchangeUse use, RankArray (&arrays)[kRankArrays]) {
  arrays[0] = RankArray{"pads", const_cast<const void* const*>(x->pads), sizeof(uint64_t)};
  if (use == ExchangeUse::kPads) return 1;
  arrays[1] = RankArray{"o", x->o, dtype_size(x->o_layout.dtype)};
  arrays[2] = RankArray{"lse", x->lse, sizeof(float)};
  if (x->sum == nullptr) return 3;
  arrays[3] = RankArray{"sum", x->sum, sizeof(float)};
  return 4;
}

}  // namespace

attnmerge_status check_exchange(const attnmerge_exchange* x, ExchangeUse use, const ArgNames& names) {
  const char* name = names.of("exchange");
  if (x == nullptr) return fail(ATTNMERGE_ERROR_VALUE, "%s: expected the ranks of an exchange, got NULL", name);
  if (x->struct_size != 0 && x->struct_size != kExchangeBaselineSize)
    return fail(ATTNMERGE_ERROR_VALUE,
                "%s.struct_size: expected 0 or %u (sizeof(attnmerge_exchange) of attnmerge 0.2.0), got %u", name,
                static_cast<unsigned>(kExchangeBaselineSize), x->struct_size);
  if (x->world_size < 1 || x->world_size > ATTNMERGE_EXCHANGE_MAX_WORLD)
    return fail(ATTNMERGE_ERROR_VALUE, "%s.world_size: expected 1 to %d ranks, got %d", name,
                ATTNMERGE_EXCHANGE_MAX_WORLD, x->world_size);
  if (x->rank < 0 || x->rank >= x->world_size)
    return fail(ATTNMERGE_ERROR_VALUE, "%s.rank: expected 0 <= rank < %d (world_size), got %d", name, x->world_size,
                x->rank);
  if (x->reuse != ATTNMERGE_EXCHANGE_WAIT_READERS && x->reuse != ATTNMERGE_EXCHANGE_ALTERNATE)
    return fail(ATTNMERGE_ERROR_VALUE,
                "%s.reuse: expected ATTNMERGE_EXCHANGE_WAIT_READERS (0) or ATTNMERGE_EXCHANGE_ALTERNATE (1), got %d",
                name, x->reuse);
  if (x->timeout_ns <= 0)
    return fail(ATTNMERGE_ERROR_VALUE, "%s.timeout_ns: expected nanoseconds > 0 (a wait that can end), got %" PRId64,
                name, x->timeout_ns);
  RankArray arrays[kRankArrays];
  for (int a = 0, n = rank_arrays(x, use, arrays); a < n; ++a)
    if (arrays[a].entries == nullptr)
      return fail(ATTNMERGE_ERROR_VALUE, "%s.%s: expected %d pointers (one per rank), got NULL", name, arrays[a].field,
                  x->world_size);
  return ATTNMERGE_SUCCESS;
}

attnmerge_status check_exchange_pointers(const attnmerge_exchange* x, ExchangeUse use, const ArgNames& names) {
  const char* name = names.of("exchange");
  RankArray arrays[kRankArrays];
  for (int a = 0, n = rank_arrays(x, use, arrays); a < n; ++a)
    for (int p = 0; p < x->world_size; ++p) {
      const void* ptr = arrays[a].entries[p];
      if (ptr == nullptr)
        return fail(ATTNMERGE_ERROR_VALUE, "%s.%s[%d]: expected rank %d's pointer, got NULL", name, arrays[a].field, p,
                    p);
      if (reinterpret_cast<uintptr_t>(ptr) % arrays[a].align != 0)
        return fail(ATTNMERGE_ERROR_VALUE, "%s.%s[%d]: expected a pointer aligned to %zu bytes, got %p", name,
                    arrays[a].field, p, arrays[a].align, ptr);
    }
  return ATTNMERGE_SUCCESS;
}

attnmerge_status check_slice(int32_t slice, int64_t begin, const View& out, const Sizes& n) {
  const ArgNames& names = *out.names;
  if (slice != ATTNMERGE_SLICE_TOKENS && slice != ATTNMERGE_SLICE_HEADS)
    return fail(ATTNMERGE_ERROR_VALUE, "%s: expected ATTNMERGE_SLICE_TOKENS (0) or ATTNMERGE_SLICE_HEADS (1), got %d",
                names.of("slice"), slice);
  const bool heads = slice == ATTNMERGE_SLICE_HEADS;
  const char* whole = heads ? "tokens" : "heads";
  const int64_t other = heads ? n.slice_tokens : n.slice_heads, states_other = heads ? n.tokens : n.heads;
  if (other != states_other)
    return fail(ATTNMERGE_ERROR_VALUE, "%s: expected the %" PRId64 " %s of the states (a slice of %s takes every one), "
                "got %" PRId64, out.name(), states_other, whole, heads ? "heads" : "tokens", other);
  const int64_t extent = heads ? n.slice_heads : n.slice_tokens, states = heads ? n.heads : n.tokens;
  if (begin < 0 || begin > states - extent)
    return fail(ATTNMERGE_ERROR_VALUE,
                "%s: expected 0 to %" PRId64 " (the states' %" PRId64 " %s less the %" PRId64 " of %s), got %" PRId64,
                names.of("slice_begin"), states - extent, states, heads ? "heads" : "tokens", extent, out.name(),
                begin);
  return ATTNMERGE_SUCCESS;
}

attnmerge_status check_apart_from_ranks(const attnmerge_exchange* x, Views views, const View& o, const View& lse) {
  for (const View& w : views) {
    if (!w.spec->is_output() || !w.present() || w.empty) continue;
    for (int p = 0; p < x->world_size; ++p) {
      // Each rank's O, LSE and sums (laid out as its LSE), where given.
      const struct {
        const View& layout;
        const void* const* ranks;
        const char* field;
      } arrays[] = {{o, x->o, "o"}, {lse, x->lse, "lse"}, {lse, x->sum, "sum"}};
      for (const auto& a : arrays) {
        if (a.layout.empty || a.ranks == nullptr) continue;
        attnmerge_tensor t = *a.layout.t;
        t.data = const_cast<void*>(a.ranks[p]);
        View rank_view = a.layout;
        rank_view.t = &t;
        uintptr_t lo1, hi1, lo2, hi2;
        w.byte_range(lo1, hi1);
        rank_view.byte_range(lo2, hi2);
        if (lo1 < hi2 && lo2 < hi1)
          return fail(ATTNMERGE_ERROR_VALUE, "%s: expected memory apart from every rank's state, got a range "
                      "overlapping %s.%s[%d]", w.name(), w.names->of("exchange"), a.field, p);
      }
    }
  }
  return ATTNMERGE_SUCCESS;
}

}  // namespace detail
}  // namespace attnmerge
