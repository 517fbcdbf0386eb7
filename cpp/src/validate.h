// Argument rules of the C ABI, declared per op: a table gives each argument's contract (ArgSpec:
// name, role, shape, use, presence, aliasing, dtype agreement), and validate() reads it, in one
// order for every op.  Every check names the argument and writes nothing; nothing aborts or prints.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>

#include "internal.h"

namespace attnmerge {
namespace detail {

// An axis of an argument, in the sizes of its op (Sizes).
enum class Dim : uint8_t {
  kNone,  // past the last axis
  kTokens,
  kHeads,
  kHeadSize,
  kStates,  // S of an N-way merge
  kTotal,  // the states of a variable-length merge
  kRows,  // the rows of a variable-length merge
  kRowsPlus1,  // indptr's entries
  kATokens,  // the tokens of a two-way merge's a that are read: options.a_tokens, or tokens
  kATokensOrMore,  // a itself: at least those with ATTNMERGE_A_TOKENS (only they are read), else exactly
  kPair,  // 2: the two states of a two-way or in-place merge (options.valid's)
  kOne,  // 1: options.num_tokens' one element
  kOutHeadSize,  // an output's last axis: head_size, or head_size / 2 bytes (NVFP4's two values per byte)
  kScales0,  // options.group_scales' axes (Sizes::scales): [rows, heads, head_size / options.group_size],
  kScales1,  // or in the 128 x 4 tiles of ATTNMERGE_SCALE_SWIZZLED [ceil(rows / 128),
  kScales2,  // ceil(heads * head_size / group_size / 4), 512]
  kSliceTokens,  // an exchange's output: the tokens of its slice
  kSliceHeads,  // an exchange's output: the heads of its slice
};

enum class Use : uint8_t {
  kRead,  // an input
  kWrite,  // an output: writable, no element written twice, apart from every other argument
  kReadWrite,  // the in-place merge's state: an output that is read first
};

enum class Presence : uint8_t {
  kRequired,  // NULL is refused
  kOptional,  // NULL: not given (not read, or not written)
};

enum class Alias : uint8_t {
  kNone,
  kMayBeOutput,  // an output of its kind (O or LSE) may be this very view: element i is read before it is written
};

// What one argument of an op must be.
struct ArgSpec {
  const char* name;
  uint32_t role;  // ATTNMERGE_ROLE_*: the dtypes it may have (dtypes.h), and whether it is an O
  Dim shape[ATTNMERGE_MAX_NDIM];
  Use use;
  Presence presence;
  Alias alias = Alias::kNone;
  const char* dtype_of = nullptr;  // the argument whose dtype it shares, where both are given

  constexpr int ndim() const {
    int n = 0;
    while (n < ATTNMERGE_MAX_NDIM && shape[n] != Dim::kNone) ++n;
    return n;
  }
  // O [..., head_size], whose head_size axis is unit-stride; otherwise an LSE, mask or indptr.
  constexpr bool is_o() const { return (role & (ATTNMERGE_ROLE_O_IN | ATTNMERGE_ROLE_O_OUT)) != 0; }
  constexpr bool is_output() const { return use != Use::kRead; }
};

// "float32, float16 or bfloat16": the names of a set of dtypes (bit `code` for each), for messages.
struct DtypesText {
  char text[128];
  explicit DtypesText(uint32_t set);
};

// A tensor as an op reads it: shape and strides in the op's logical axis order.
struct View {
  const ArgSpec* spec = nullptr;
  const attnmerge_tensor* t = nullptr;  // null where an optional argument is not given
  const ArgNames* names = nullptr;  // the call's
  int64_t shape[ATTNMERGE_MAX_NDIM] = {};
  int64_t strides[ATTNMERGE_MAX_NDIM] = {};
  int ndim = 0;
  bool transposed = false;  // an LSE given [heads, tokens]
  bool empty = true;  // some size is 0 (set by describe, which also bounds the element count)
  int64_t last = 0;  // the largest element offset, when not empty

  bool present() const { return t != nullptr; }
  const char* name() const { return names->of(spec->name); }  // as the caller calls it
  // [first byte, one past the last byte] the view spans; not empty.
  void byte_range(uintptr_t& lo, uintptr_t& hi) const {
    lo = reinterpret_cast<uintptr_t>(t->data);
    hi = lo + static_cast<uintptr_t>(last + 1) * dtype_size(t->dtype);
  }
};

// The views of one call, in the order of its ArgSpec table, and the call's names.
struct Views {
  View* v;
  int n;
  const ArgNames* names;
  View* begin() const { return v; }
  View* end() const { return v + n; }
};

// The sizes of an op's shape equations, which every argument's Dims are read in.
struct Sizes {
  int64_t tokens = 0, heads = 0, head_size = 0, states = 0, total = 0, rows = 0;
  int64_t out_head_size = 0;  // kOutHeadSize
  int64_t scales[3] = {0, 0, 0};  // kScales0 .. kScales2
  int64_t slice_tokens = 0, slice_heads = 0;  // kSliceTokens, kSliceHeads
  int64_t a_tokens = 0;  // kATokens
  bool a_tokens_given = false;  // ATTNMERGE_A_TOKENS: kATokensOrMore means at least a_tokens
};

// head_size, read off `source`: from 1 to the largest, where a row's packs span at most 65535
// blocks of 256 threads.
attnmerge_status check_head_size(const View& source, int64_t head_size);

// options.a_tokens (with ATTNMERGE_A_TOKENS: 0 to sizes.tokens) into sizes.a_tokens.
attnmerge_status read_a_tokens(const attnmerge_options& opt, const View& source, Sizes& sizes);

// An op's shape equations: its Sizes, read off `source` (and for a variable-length merge indptr),
// with the checks on them that no single argument's shape states (head_size, the states' count).
using Equations = attnmerge_status (*)(Views views, const View& source, const attnmerge_options& opt, Sizes& sizes);

// The largest number of arguments of an op (the two-way merge).
constexpr int kMaxArgs = 13;

// An op's contract: its arguments' table and what validate() needs beside it, the names of the
// table resolved to indices (-1: none) when the OpSpec is built (make_op).
struct OpSpec {
  const ArgSpec* args;
  int count;
  uint32_t flags;  // the options.flags it takes
  // The argument whose dtype says whether it takes an output scale (FP8 only).
  int scale_of;
  // The argument its sizes are read off, named where a shape disagrees, and that state's LSE,
  // whose shape is checked first: a state at odds with its own LSE is named as such, not through
  // every other argument that disagrees with it.
  int sizes_from, sizes_lse;
  int sink;  // the argument "sink" (options.sink), or -1: the op refuses one
  int group_scales;  // the argument "group_scales" (options.group_scales), or -1: the op refuses them
  // The arguments "sum_a", "sum_b", "valid", "num_tokens" and "a_tokens" (options.sum_a, ...,
  // a_tokens_tensor), or -1: refused.
  int sum_a, sum_b, valid, num_tokens, a_tokens_tensor;
  int dtype_of[kMaxArgs];  // ArgSpec::dtype_of
  Equations equations;
};

constexpr bool same_name(const char* a, const char* b) {
  while (*a != '\0' && *a == *b) ++a, ++b;
  return *a == *b;
}

constexpr int index_of(const ArgSpec* args, int count, const char* name) {
  for (int i = 0; name != nullptr && i < count; ++i)
    if (same_name(args[i].name, name)) return i;
  return -1;
}

template <std::size_t K>
constexpr OpSpec make_op(const ArgSpec (&args)[K], uint32_t flags, const char* scale_of, const char* sizes_from,
                         const char* sizes_lse, Equations equations) {
  static_assert(K <= kMaxArgs, "Checked holds kMaxArgs views");
  const int count = static_cast<int>(K);
  OpSpec op{args,
            count,
            flags,
            index_of(args, count, scale_of),
            index_of(args, count, sizes_from),
            index_of(args, count, sizes_lse),
            index_of(args, count, "sink"),
            index_of(args, count, "group_scales"),
            index_of(args, count, "sum_a"),
            index_of(args, count, "sum_b"),
            index_of(args, count, "valid"),
            index_of(args, count, "num_tokens"),
            index_of(args, count, "a_tokens"),
            {},
            equations};
  for (int i = 0; i < kMaxArgs; ++i) op.dtype_of[i] = i < count ? index_of(args, count, args[i].dtype_of) : -1;
  return op;
}

// Every name an OpSpec was built from is one of its arguments (for a static_assert).
constexpr bool names_resolve(const OpSpec& op) {
  if (op.scale_of < 0 || op.sizes_from < 0 || op.sizes_lse < 0) return false;
  for (int i = 0; i < op.count; ++i)
    if (op.args[i].dtype_of != nullptr && op.dtype_of[i] < 0) return false;
  return true;
}

// An argument's index in its op's table, and its name there: the entries of an op's index enum
// (ops.cpp: c.views[MergeArg::kSink]), which indexed() holds to the table.
struct ArgIndex {
  int index;
  const char* name;
};

// `indices` are 0, 1, ... and name the table's arguments in its order, every one of them (for a
// static_assert beside each table).
template <std::size_t K>
constexpr bool indexed(const ArgSpec (&args)[K], std::initializer_list<ArgIndex> indices) {
  if (indices.size() != K) return false;
  int i = 0;
  for (const ArgIndex& x : indices) {
    if (x.index != i || !same_name(args[i].name, x.name)) return false;
    ++i;
  }
  return true;
}

// A call checked against its OpSpec.
struct Checked {
  View views[kMaxArgs];
  int count = 0;
  attnmerge_options opt{};
  ArgNames names;
  float inv_scale = 1.0f;
  Precision precision = Precision::kFloat32;
  Sizes sizes;
  int num_tokens = -1;  // the view of options.num_tokens where given, else -1: every token
  Views all() { return Views{views, count, &names}; }
};

// A tensor of the options, options->*field (sink, group_scales, sum_a, sum_b, valid, num_tokens), where
// struct_size names a layout the library reads, else NULL (validate() then refuses the size): what
// an op whose table has that argument passes validate() for it.
const attnmerge_tensor* option_tensor(const attnmerge_options* options,
                                      const attnmerge_tensor* const attnmerge_options::*field);
inline const attnmerge_tensor* sink_of(const attnmerge_options* options) {
  return option_tensor(options, &attnmerge_options::sink);
}
inline const attnmerge_tensor* group_scales_of(const attnmerge_options* options) {
  return option_tensor(options, &attnmerge_options::group_scales);
}
inline const attnmerge_tensor* sum_a_of(const attnmerge_options* options) {
  return option_tensor(options, &attnmerge_options::sum_a);
}
inline const attnmerge_tensor* sum_b_of(const attnmerge_options* options) {
  return option_tensor(options, &attnmerge_options::sum_b);
}
inline const attnmerge_tensor* valid_of(const attnmerge_options* options) {
  return option_tensor(options, &attnmerge_options::valid);
}
inline const attnmerge_tensor* num_tokens_of(const attnmerge_options* options) {
  return option_tensor(options, &attnmerge_options::num_tokens);
}
inline const attnmerge_tensor* a_tokens_of(const attnmerge_options* options) {
  return option_tensor(options, &attnmerge_options::a_tokens_tensor);
}

// The size of the widest O dtype among the call's arrays.
std::size_t widest_o(Views views);

// The widest vector (elements) that the pointer and strides of every O of the call and head_size
// allow, within 16 bytes per access; `packed_out`: the outputs hold two elements per byte (NVFP4),
// a vector of them half as many bytes.
int choose_vec(Views views, int64_t head_size, bool packed_out = false);

// The options' fields struct_size covers, into `opt` (the others zero), and the caller's names:
// validate()'s step 0, for an op whose own arguments are checked before its tensors (the exchange).
attnmerge_status read_layout(const attnmerge_options* options, attnmerge_options& opt, ArgNames& names);

// Validates tensors[i] against op.args[i] into call.views[i], in one order for every op:
//   0. the options' layout (struct_size) and the caller's names (arg_names), which every message
//      after names the arguments by;
//   1. each tensor alone: NULL, ndim, dtype, flags, device, sizes, strides, the unit-stride
//      head_size axis of an O, pointer, alignment, a span within 2^63 bytes;
//   2. the options (op.flags; an output scale or group scales only where op.scale_of is FP8; a sink
//      (group scales, sums, valid) only where op.sink (op.group_scales, ...) is an argument, which
//      step 1 has described);
//   3. one precision (Precision) for every O and LSE (softmax sums too): all float64 or none; then
//      every ArgSpec::dtype_of, where both are given;
//   4. op.equations, options.group_size (or the block format's) against head_size and the arrays'
//      vectors, the swizzled scales' alignment, then every
//      given argument's shape against its Dims (op.sizes_lse first, then in table order); where
//      these fail, the inputs' sizes are put to a vote, and an input at odds with those most
//      inputs give (or two inputs at odds with each other) is named instead;
//   5. the outputs: writable, no element written twice, apart from the outputs before them and
//      from every input (an input with Alias::kMayBeOutput may be the very same view as an output
//      of its kind).
attnmerge_status validate(const OpSpec& op, const attnmerge_tensor* const* tensors, const attnmerge_options* options,
                          Checked& call);

// A variable-length merge's indptr [rows + 1] against the states of o [total, ...]: on the host the
// offsets can be checked before anything is written (on the GPU they are clamped, never read back).
// `out`: an output of the call, which tells whether it runs on the host.
attnmerge_status check_indptr(const View& indptr, const View& o, const attnmerge_tensor* out, int64_t rows);

bool same_view(const View& x, const View& y);

// ---- the exchange (attnmerge_exchange) ----------------------------------------------------------

// What each exchange op reads of an attnmerge_exchange: its pads (every op), its ranks' states (the
// merge).
enum class ExchangeUse : uint8_t { kPads, kStates };

// The exchange's own fields, before anything else of the call: not NULL, struct_size, world_size,
// rank, reuse and timeout_ns, and the arrays of pointers the op reads.  `names`: the caller's (the
// exchange is named as "exchange" is).
attnmerge_status check_exchange(const attnmerge_exchange* x, ExchangeUse use, const ArgNames& names);

// Every rank's pointers the op reads, each alone: not NULL, aligned to its element (O: to the
// dtype of o_layout, `o_dtype`) or its pad's words.
attnmerge_status check_exchange_pointers(const attnmerge_exchange* x, ExchangeUse use, const ArgNames& names);

// The slice of an exchange's merge: `slice` an attnmerge_slice, out's other axis whole, and
// [begin, begin + out's size on the axis) within the states' (`n`: the sizes validate() read off
// the layouts and out).  `out`: the output's view, named where a size disagrees.
attnmerge_status check_slice(int32_t slice, int64_t begin, const View& out, const Sizes& n);

// out and out_lse (each where present and not empty) apart from every rank's O and LSE (the spans
// of o_layout and lse_layout, `o` and `lse`, at each rank's pointer).
attnmerge_status check_apart_from_ranks(const attnmerge_exchange* x, Views views, const View& o, const View& lse);

}  // namespace detail
}  // namespace attnmerge
