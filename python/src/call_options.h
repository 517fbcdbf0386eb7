// A call's options as the Python package's one record holds them (attnmerge._call.Options), and the
// C ABI's attnmerge_options made from them: shared by the pybind11 module (which reads the record's
// fields by position) and the XLA FFI handlers (which read them as attributes by name), so that an
// option the C ABI reads is one row below, one field of the record, and its use.
#ifndef ATTNMERGE_PYTHON_CALL_OPTIONS_H_
#define ATTNMERGE_PYTHON_CALL_OPTIONS_H_

#include <algorithm>
#include <cstdint>

#include "attnmerge/attnmerge.h"

// The record's first fields, in this order and by these names (type, name):
//   flags         attnmerge_options.flags (bases, PDL, UE8M0 scales, [heads, tokens] LSEs)
//   a_tokens      the two-way merge's a_tokens, < 0: none
//   output_scale  FP8 outputs store value / output_scale; 0: none (or given as an array, `scale`)
//   group_size    per-group FP8's group, 0: none
//   index         merge_share's state
//   states_axis   the states' axis of o and lse in an N-way merge, share or their backward
#define ATTNMERGE_CALL_OPTIONS(X) \
  X(int64_t, flags)               \
  X(int64_t, a_tokens)            \
  X(double, output_scale)         \
  X(int64_t, group_size)          \
  X(int64_t, index)               \
  X(int64_t, states_axis)

// The record's arrays after them, in this order (None: not given): the output scale as a
// one-element float32 array read by the kernel, the sinks, the per-group FP8 scales, the softmax
// sums of the first and second LSE arguments, the states holding keys, the live number of tokens
// and the two-way merge's a_tokens (each a one-element int32 or int64 array read by the kernel).
// Then the caller's names
// and the stream (the pybind11 module's alone: XLA names no argument and gives the stream).
#define ATTNMERGE_CALL_ARRAYS(X) \
  X(scale)                       \
  X(sink)                        \
  X(group_scales)                \
  X(sum_a)                       \
  X(sum_b)                       \
  X(valid)                       \
  X(num_tokens)                  \
  X(a_tokens_tensor)

namespace attnmerge_py {

struct CallOptions {
#define ATTNMERGE_FIELD(type, name) type name = 0;
  ATTNMERGE_CALL_OPTIONS(ATTNMERGE_FIELD)
#undef ATTNMERGE_FIELD
};

// The record's field names in order, the scalars' then the arrays': what the module exports as
// OPTION_FIELDS (then "names" and "stream"), which attnmerge._call checks its record against.
inline constexpr const char* kOptionFields[] = {
#define ATTNMERGE_NAME(type, name) #name,
    ATTNMERGE_CALL_OPTIONS(ATTNMERGE_NAME)
#undef ATTNMERGE_NAME
#define ATTNMERGE_NAME(name) #name,
        ATTNMERGE_CALL_ARRAYS(ATTNMERGE_NAME)
#undef ATTNMERGE_NAME
};
inline constexpr int kOptionCount = sizeof(kOptionFields) / sizeof(kOptionFields[0]);

// The option tensors of a call (null: none), in the record's order after the output scale.
struct OptionTensors {
  const attnmerge_tensor *sink = nullptr, *group_scales = nullptr, *sum_a = nullptr, *sum_b = nullptr,
                         *valid = nullptr, *num_tokens = nullptr, *a_tokens_tensor = nullptr;
};

// The C ABI's options of a call: its scalars and option tensors (null: none).  The library checks
// every value; a group size past int32 becomes one that is no power of two, refused by name.
inline attnmerge_options options_of(const CallOptions& c, const OptionTensors& tensors = {},
                                    const float* scale_ptr = nullptr) {
  attnmerge_options o = {};
  o.flags = static_cast<uint32_t>(c.flags) | (c.a_tokens >= 0 ? ATTNMERGE_A_TOKENS : 0u);
  o.a_tokens = c.a_tokens >= 0 ? c.a_tokens : 0;
  o.output_scale = static_cast<float>(c.output_scale);
  o.output_scale_ptr = scale_ptr;
  o.sink = tensors.sink;
  o.group_scales = tensors.group_scales;
  o.sum_a = tensors.sum_a;
  o.sum_b = tensors.sum_b;
  o.valid = tensors.valid;
  o.num_tokens = tensors.num_tokens;
  o.a_tokens_tensor = tensors.a_tokens_tensor;
  o.group_size = static_cast<int32_t>(std::min<int64_t>(std::max<int64_t>(c.group_size, INT32_MIN), INT32_MAX));
  return o;
}

}  // namespace attnmerge_py

#endif  // ATTNMERGE_PYTHON_CALL_OPTIONS_H_
