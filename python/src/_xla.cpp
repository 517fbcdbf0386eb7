// XLA FFI handlers of the merges, for attnmerge.jax (jax.ffi.ffi_call under jax.jit).  Like the
// pybind11 module, a thin layer over the C ABI: each handler describes XLA's buffers (row-major,
// on the device XLA names) as attnmerge_tensor and calls libattnmerge on the stream XLA gives,
// which validates everything; its status and message come back as the handler's error.
#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>

#include "attnmerge/attnmerge.h"
#include "call_options.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using attnmerge_py::CallOptions;
using attnmerge_py::options_of;

namespace {

// attnmerge's dtype of an XLA element type; -1 (refused by the C ABI, naming the argument) otherwise.
int32_t dtype_of(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return ATTNMERGE_FLOAT32;
    case ffi::DataType::F16: return ATTNMERGE_FLOAT16;
    case ffi::DataType::BF16: return ATTNMERGE_BFLOAT16;
    case ffi::DataType::F8E4M3FN: return ATTNMERGE_FLOAT8_E4M3;
    case ffi::DataType::U8: return ATTNMERGE_UINT8;  // NVFP4's out, MXFP8's scales
    case ffi::DataType::F64: return ATTNMERGE_FLOAT64;  // the CPU path's (jax_enable_x64)
    default: return -1;
  }
}

// A dense row-major XLA buffer as a tensor on `device`, of `rank` dimensions: leading dimensions
// beyond them are folded into the first (tokens), so that a batch of calls under jax.vmap is one
// call over the flattened batch.
attnmerge_tensor tensor(const ffi::AnyBuffer& b, int32_t device, int rank) {
  const auto dims = b.dimensions();
  const int ndim = static_cast<int>(dims.size());
  if (ndim < rank || rank > ATTNMERGE_MAX_NDIM) {  // refused by the C ABI as the wrong ndim
    attnmerge_tensor t = {};
    t.data = b.untyped_data();
    t.dtype = dtype_of(b.element_type());
    t.device = device;
    t.ndim = ndim;
    return t;
  }
  int64_t shape[ATTNMERGE_MAX_NDIM] = {1};
  for (int i = 0; i <= ndim - rank; ++i) shape[0] *= dims[i];
  for (int i = 1; i < rank; ++i) shape[i] = dims[ndim - rank + i];
  attnmerge_tensor t = attnmerge_contiguous_tensor(b.untyped_data(), dtype_of(b.element_type()), device, rank, shape);
  t.flags = ATTNMERGE_DEVICE_KNOWN;  // XLA's own buffers on XLA's device
  return t;
}

// indptr: int32 or int64 [rows + 1].
attnmerge_tensor index_tensor(const ffi::AnyBuffer& indptr, int32_t device) {
  attnmerge_tensor t = tensor(indptr, device, 1);
  switch (indptr.element_type()) {
    case ffi::DataType::S32: t.dtype = ATTNMERGE_INT32; break;
    case ffi::DataType::S64: t.dtype = ATTNMERGE_INT64; break;
    default: break;  // -1: refused by the C ABI, naming indptr
  }
  return t;
}

// options.valid: uint8, bool, int32 or int64, 0 where a state holds no key.
attnmerge_tensor valid_tensor(const ffi::AnyBuffer& valid, int32_t device, int rank) {
  attnmerge_tensor t = tensor(valid, device, rank);
  switch (valid.element_type()) {
    case ffi::DataType::U8: t.dtype = ATTNMERGE_UINT8; break;
    case ffi::DataType::PRED: t.dtype = ATTNMERGE_BOOL; break;
    case ffi::DataType::S32: t.dtype = ATTNMERGE_INT32; break;
    case ffi::DataType::S64: t.dtype = ATTNMERGE_INT64; break;
    default: break;  // -1: refused by the C ABI, naming valid
  }
  return t;
}

ffi::Error result(attnmerge_status status) {
  if (status == ATTNMERGE_SUCCESS) return ffi::Error::Success();
  const std::string message = std::string("attnmerge: ") + attnmerge_last_error();
  return status == ATTNMERGE_ERROR_CUDA || status == ATTNMERGE_ERROR_NO_DEVICE ? ffi::Error::Internal(message)
                                                                             : ffi::Error::InvalidArgument(message);
}

// A call's attributes: the options record's fields by their names (call_options.h; attnmerge.jax
// passes every one), and, for a forward, whether its sink, output-scale, softmax-sum, valid and
// live-count buffers are read (has_sink, scale_in_buffer, has_sum_a, has_sum_b, has_valid,
// has_num_tokens: XLA hands every operand over, given or not).
struct Attributes {
  CallOptions c;
  bool has_sink = false, scale_in_buffer = false, has_sum_a = false, has_sum_b = false, has_valid = false,
       has_num_tokens = false;
};

ffi::ErrorOr<Attributes> read(const ffi::Dictionary& attrs, bool forward) {
  Attributes a;
#define ATTNMERGE_READ(type, name) \
  if (auto v = attrs.get<type>(#name); v.has_value()) { \
    a.c.name = *v; \
  } else { \
    return ffi::Unexpected(v.error()); \
  }
  ATTNMERGE_CALL_OPTIONS(ATTNMERGE_READ)
#undef ATTNMERGE_READ
  if (forward) {
    for (auto [name, field] : {std::pair{"has_sink", &a.has_sink}, std::pair{"scale_in_buffer", &a.scale_in_buffer},
                               std::pair{"has_sum_a", &a.has_sum_a}, std::pair{"has_sum_b", &a.has_sum_b},
                               std::pair{"has_valid", &a.has_valid}, std::pair{"has_num_tokens", &a.has_num_tokens}}) {
      auto v = attrs.get<bool>(name);
      if (!v.has_value()) return ffi::Unexpected(v.error());
      *field = *v;
    }
  }
  return a;
}

// A forward's option buffers as tensors: the sink [heads], the softmax sums of the first and second
// LSE arguments (of `sum_rank` dimensions: the first LSE's), the states holding keys (`valid_rank`),
// the live number of tokens (one int32 or int64).
struct ForwardOptions {
  attnmerge_tensor sink, sum_a, sum_b, valid, num_tokens;
  ForwardOptions(int32_t device, const ffi::AnyBuffer& sink_, const ffi::AnyBuffer& sum_a_,
                 const ffi::AnyBuffer& sum_b_, const ffi::AnyBuffer& valid_, const ffi::AnyBuffer& num_tokens_,
                 int sum_rank, int valid_rank)
      : sink(tensor(sink_, device, 1)),
        sum_a(tensor(sum_a_, device, sum_rank)),
        sum_b(tensor(sum_b_, device, 2)),
        valid(valid_tensor(valid_, device, valid_rank)),
        num_tokens(index_tensor(num_tokens_, device)) {}
};

// A forward's C ABI options: the attributes', the sink, sums and valid states where has_*, the
// output scale's buffer (one float32 on the op's device) where scale_in_buffer, and the group
// scales where group_size > 0 (else that result, of no elements, is not written).
attnmerge_options forward_options(const Attributes& a, const ForwardOptions& t, const ffi::AnyBuffer& scale,
                                  const attnmerge_tensor& group_scales) {
  return options_of(a.c,
                    {a.has_sink ? &t.sink : nullptr, a.c.group_size > 0 ? &group_scales : nullptr,
                     a.has_sum_a ? &t.sum_a : nullptr, a.has_sum_b ? &t.sum_b : nullptr,
                     a.has_valid ? &t.valid : nullptr, a.has_num_tokens ? &t.num_tokens : nullptr},
                    a.scale_in_buffer ? static_cast<const float*>(scale.untyped_data()) : nullptr);
}

// A handler's body, given its attributes read: a bad or missing attribute is attnmerge.jax's own
// error, returned as XLA's.
template <typename F>
ffi::Error with(const ffi::Dictionary& attrs, bool forward, F&& f) {
  auto a = read(attrs, forward);
  if (!a.has_value()) return a.error();
  return f(*a);
}

ffi::Error merge(void* stream, int32_t device, ffi::AnyBuffer o_a, ffi::AnyBuffer lse_a, ffi::AnyBuffer o_b,
                 ffi::AnyBuffer lse_b, ffi::AnyBuffer sink, ffi::AnyBuffer scale, ffi::AnyBuffer sum_a,
                 ffi::AnyBuffer sum_b, ffi::AnyBuffer valid, ffi::AnyBuffer num_tokens, ffi::Result<ffi::AnyBuffer> out,
                 ffi::Result<ffi::AnyBuffer> out_lse, ffi::Result<ffi::AnyBuffer> group_scales,
                 ffi::Dictionary attrs) {
  return with(attrs, true, [&](const Attributes& a) {
    const attnmerge_tensor t_out = tensor(*out, device, 3), t_out_lse = tensor(*out_lse, device, 2);
    const attnmerge_tensor t_oa = tensor(o_a, device, 3), t_la = tensor(lse_a, device, 2);
    const attnmerge_tensor t_ob = tensor(o_b, device, 3), t_lb = tensor(lse_b, device, 2);
    const attnmerge_tensor t_gs = tensor(*group_scales, device, 3);
    const ForwardOptions t(device, sink, sum_a, sum_b, valid, num_tokens, 2, 2);
    const attnmerge_options opt = forward_options(a, t, scale, t_gs);
    return result(attnmerge_merge(&t_out, &t_out_lse, &t_oa, &t_la, &t_ob, &t_lb, &opt, stream));
  });
}

ffi::Error merge_states(void* stream, int32_t device, ffi::AnyBuffer o, ffi::AnyBuffer lse, ffi::AnyBuffer sink,
                        ffi::AnyBuffer scale, ffi::AnyBuffer sum_a, ffi::AnyBuffer sum_b, ffi::AnyBuffer valid,
                        ffi::AnyBuffer num_tokens, ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> out_lse,
                        ffi::Result<ffi::AnyBuffer> group_scales, ffi::Dictionary attrs) {
  return with(attrs, true, [&](const Attributes& a) {
    const attnmerge_tensor t_out = tensor(*out, device, 3), t_out_lse = tensor(*out_lse, device, 2);
    const attnmerge_tensor t_o = tensor(o, device, 4), t_l = tensor(lse, device, 3);
    const attnmerge_tensor t_gs = tensor(*group_scales, device, 3);
    const ForwardOptions t(device, sink, sum_a, sum_b, valid, num_tokens, 3, 2);
    const attnmerge_options opt = forward_options(a, t, scale, t_gs);
    return result(attnmerge_merge_states(&t_out, &t_out_lse, &t_o, &t_l, &opt, stream));
  });
}

ffi::Error merge_varlen(void* stream, int32_t device, ffi::AnyBuffer o, ffi::AnyBuffer lse, ffi::AnyBuffer indptr,
                        ffi::AnyBuffer sink, ffi::AnyBuffer scale, ffi::AnyBuffer sum_a, ffi::AnyBuffer sum_b,
                        ffi::AnyBuffer valid, ffi::AnyBuffer num_tokens, ffi::Result<ffi::AnyBuffer> out,
                        ffi::Result<ffi::AnyBuffer> out_lse, ffi::Result<ffi::AnyBuffer> group_scales,
                        ffi::Dictionary attrs) {
  return with(attrs, true, [&](const Attributes& a) {
    const attnmerge_tensor t_indptr = index_tensor(indptr, device);
    const attnmerge_tensor t_out = tensor(*out, device, 3), t_out_lse = tensor(*out_lse, device, 2);
    const attnmerge_tensor t_o = tensor(o, device, 3), t_l = tensor(lse, device, 2);
    const attnmerge_tensor t_gs = tensor(*group_scales, device, 3);
    const ForwardOptions t(device, sink, sum_a, sum_b, valid, num_tokens, 2, 1);
    const attnmerge_options opt = forward_options(a, t, scale, t_gs);
    return result(attnmerge_merge_varlen(&t_out, &t_out_lse, &t_o, &t_l, &t_indptr, &opt, stream));
  });
}

ffi::Error merge_share(void* stream, int32_t device, ffi::AnyBuffer o, ffi::AnyBuffer lse, ffi::AnyBuffer sink,
                       ffi::AnyBuffer scale, ffi::AnyBuffer sum_a, ffi::AnyBuffer sum_b, ffi::AnyBuffer valid,
                       ffi::AnyBuffer num_tokens, ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> out_lse,
                       ffi::Result<ffi::AnyBuffer> group_scales, ffi::Dictionary attrs) {
  return with(attrs, true, [&](const Attributes& a) {
    const attnmerge_tensor t_out = tensor(*out, device, 3), t_out_lse = tensor(*out_lse, device, 2);
    const attnmerge_tensor t_o = tensor(o, device, 3), t_l = tensor(lse, device, 3);
    const attnmerge_tensor t_gs = tensor(*group_scales, device, 3);
    const ForwardOptions t(device, sink, sum_a, sum_b, valid, num_tokens, 3, 2);
    const attnmerge_options opt = forward_options(a, t, scale, t_gs);
    return result(attnmerge_merge_share(&t_out, &t_out_lse, &t_o, &t_l, a.c.index, &opt, stream));
  });
}

// The backward of each merge (attnmerge.jax's custom_vjp): the incoming gradients, the forward's
// results and inputs, then the inputs' gradients as results.

ffi::Error merge_backward(void* stream, int32_t device, ffi::AnyBuffer grad_out, ffi::AnyBuffer grad_out_lse,
                          ffi::AnyBuffer out, ffi::AnyBuffer out_lse, ffi::AnyBuffer o_a, ffi::AnyBuffer lse_a,
                          ffi::AnyBuffer o_b, ffi::AnyBuffer lse_b, ffi::Result<ffi::AnyBuffer> grad_o_a,
                          ffi::Result<ffi::AnyBuffer> grad_lse_a, ffi::Result<ffi::AnyBuffer> grad_o_b,
                          ffi::Result<ffi::AnyBuffer> grad_lse_b, ffi::Dictionary attrs) {
  return with(attrs, false, [&](const Attributes& a) {
    const attnmerge_tensor t_goa = tensor(*grad_o_a, device, 3), t_gla = tensor(*grad_lse_a, device, 2);
    const attnmerge_tensor t_gob = tensor(*grad_o_b, device, 3), t_glb = tensor(*grad_lse_b, device, 2);
    const attnmerge_tensor t_go = tensor(grad_out, device, 3), t_gl = tensor(grad_out_lse, device, 2);
    const attnmerge_tensor t_out = tensor(out, device, 3), t_out_lse = tensor(out_lse, device, 2);
    const attnmerge_tensor t_oa = tensor(o_a, device, 3), t_la = tensor(lse_a, device, 2);
    const attnmerge_tensor t_ob = tensor(o_b, device, 3), t_lb = tensor(lse_b, device, 2);
    const attnmerge_options opt = options_of(a.c);
    return result(attnmerge_merge_backward(&t_goa, &t_gla, &t_gob, &t_glb, &t_go, &t_gl, &t_out, &t_out_lse, &t_oa,
                                           &t_la, &t_ob, &t_lb, &opt, stream));
  });
}

ffi::Error merge_states_backward(void* stream, int32_t device, ffi::AnyBuffer grad_out, ffi::AnyBuffer grad_out_lse,
                                 ffi::AnyBuffer out, ffi::AnyBuffer out_lse, ffi::AnyBuffer o, ffi::AnyBuffer lse,
                                 ffi::Result<ffi::AnyBuffer> grad_o, ffi::Result<ffi::AnyBuffer> grad_lse,
                                 ffi::Dictionary attrs) {
  return with(attrs, false, [&](const Attributes& a) {
    const attnmerge_tensor t_gr = tensor(*grad_o, device, 4), t_grl = tensor(*grad_lse, device, 3);
    const attnmerge_tensor t_go = tensor(grad_out, device, 3), t_gl = tensor(grad_out_lse, device, 2);
    const attnmerge_tensor t_out = tensor(out, device, 3), t_out_lse = tensor(out_lse, device, 2);
    const attnmerge_tensor t_o = tensor(o, device, 4), t_l = tensor(lse, device, 3);
    const attnmerge_options opt = options_of(a.c);
    return result(attnmerge_merge_states_backward(&t_gr, &t_grl, &t_go, &t_gl, &t_out, &t_out_lse, &t_o, &t_l, &opt,
                                                  stream));
  });
}

ffi::Error merge_varlen_backward(void* stream, int32_t device, ffi::AnyBuffer grad_out, ffi::AnyBuffer grad_out_lse,
                                 ffi::AnyBuffer out, ffi::AnyBuffer out_lse, ffi::AnyBuffer o, ffi::AnyBuffer lse,
                                 ffi::AnyBuffer indptr, ffi::Result<ffi::AnyBuffer> grad_o,
                                 ffi::Result<ffi::AnyBuffer> grad_lse, ffi::Dictionary attrs) {
  return with(attrs, false, [&](const Attributes& a) {
    const attnmerge_tensor t_gr = tensor(*grad_o, device, 3), t_grl = tensor(*grad_lse, device, 2);
    const attnmerge_tensor t_go = tensor(grad_out, device, 3), t_gl = tensor(grad_out_lse, device, 2);
    const attnmerge_tensor t_out = tensor(out, device, 3), t_out_lse = tensor(out_lse, device, 2);
    const attnmerge_tensor t_o = tensor(o, device, 3), t_l = tensor(lse, device, 2);
    const attnmerge_tensor t_indptr = index_tensor(indptr, device);
    const attnmerge_options opt = options_of(a.c);
    return result(attnmerge_merge_varlen_backward(&t_gr, &t_grl, &t_go, &t_gl, &t_out, &t_out_lse, &t_o, &t_l,
                                                  &t_indptr, &opt, stream));
  });
}

// The host handlers: the same, on the CPU (no stream, device ATTNMERGE_HOST): each handler above
// with those two arguments bound.
template <auto Handler>
struct OnHost;
template <typename... Args, ffi::Error (*Handler)(void*, int32_t, Args...)>
struct OnHost<Handler> {
  static ffi::Error call(Args... args) { return Handler(nullptr, ATTNMERGE_HOST, std::move(args)...); }
};

// The bindings: CUDA handlers take XLA's stream and device ordinal first; then the input buffers
// (a forward's: the op's, then `sink`, `scale`, `sum_a`, `sum_b`, `valid`, `num_tokens`), the results (a forward's: out, out_lse,
// group_scales; a backward's: the gradients), then every attribute, as one dictionary.
auto on_cuda() { return ffi::Ffi::Bind().Ctx<ffi::PlatformStream<void*>>().Ctx<ffi::DeviceOrdinal>(); }

auto on_host() { return ffi::Ffi::Bind(); }

// `kInputs` buffers, `kResults` results, then the attributes (the binding moves only as a temporary).
template <int kInputs, int kResults, typename Binding>
auto with_buffers(Binding binding) {
  if constexpr (kInputs > 0) {
    return with_buffers<kInputs - 1, kResults>(std::move(binding).template Arg<ffi::AnyBuffer>());
  } else if constexpr (kResults > 0) {
    return with_buffers<0, kResults - 1>(std::move(binding).template Ret<ffi::AnyBuffer>());
  } else {
    return std::move(binding).template Attrs<ffi::Dictionary>();
  }
}

}  // namespace

// The handlers, exported with C linkage for attnmerge.jax to wrap in capsules (jax.ffi.pycapsule).
#define ATTNMERGE_XLA_OP(op, inputs, results)                                                              \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(attnmerge_xla_##op##_cuda, op, (with_buffers<inputs, results>(on_cuda()))); \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(attnmerge_xla_##op##_host, OnHost<op>::call,                               \
                                (with_buffers<inputs, results>(on_host())));
ATTNMERGE_XLA_OP(merge, 10, 3)
ATTNMERGE_XLA_OP(merge_states, 8, 3)
ATTNMERGE_XLA_OP(merge_varlen, 9, 3)
ATTNMERGE_XLA_OP(merge_share, 8, 3)
ATTNMERGE_XLA_OP(merge_backward, 8, 4)
ATTNMERGE_XLA_OP(merge_states_backward, 6, 2)
ATTNMERGE_XLA_OP(merge_varlen_backward, 7, 2)
#undef ATTNMERGE_XLA_OP
