// XLA FFI handlers of the merges, for attnmerge.jax (jax.ffi.ffi_call under jax.jit).  Like the
// pybind11 module, a thin layer over the C ABI: each handler describes XLA's buffers (row-major,
// on the device XLA names) as attnmerge_tensor and calls libattnmerge on the stream XLA gives,
// which validates everything; its status and message come back as the handler's error.
#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>

#include "attnmerge/attnmerge.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// attnmerge's dtype of an XLA element type; -1 (refused by the C ABI, naming the argument) otherwise.
int32_t dtype_of(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return ATTNMERGE_FLOAT32;
    case ffi::DataType::F16: return ATTNMERGE_FLOAT16;
    case ffi::DataType::BF16: return ATTNMERGE_BFLOAT16;
    case ffi::DataType::F8E4M3FN: return ATTNMERGE_FLOAT8_E4M3;
    default: return -1;
  }
}

// A dense row-major XLA buffer as a tensor on `device`, of `rank` dimensions: leading dimensions
// beyond them are folded into the first (tokens), so that a batch of calls under jax.vmap is one
// call over the flattened batch.
attnmerge_tensor tensor(const ffi::AnyBuffer& b, int32_t device, int rank) {
  attnmerge_tensor t = {};
  const auto dims = b.dimensions();
  t.data = b.untyped_data();
  t.dtype = dtype_of(b.element_type());
  t.device = device;
  t.flags = ATTNMERGE_DEVICE_KNOWN;  // XLA's own buffers on XLA's device
  const int ndim = static_cast<int>(dims.size());
  if (ndim < rank || rank > ATTNMERGE_MAX_NDIM) {
    t.ndim = ndim;  // refused by the C ABI as the wrong ndim
    return t;
  }
  t.ndim = rank;
  int64_t stride = 1;
  for (int i = rank - 1; i >= 1; --i) {
    t.shape[i] = dims[ndim - rank + i];
    t.strides[i] = stride;
    stride *= t.shape[i];
  }
  int64_t first = 1;
  for (int i = 0; i <= ndim - rank; ++i) first *= dims[i];
  t.shape[0] = first;
  t.strides[0] = stride;
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

ffi::Error result(attnmerge_status status) {
  if (status == ATTNMERGE_SUCCESS) return ffi::Error::Success();
  const std::string message = std::string("attnmerge: ") + attnmerge_last_error();
  return status == ATTNMERGE_ERROR_CUDA || status == ATTNMERGE_ERROR_NO_DEVICE ? ffi::Error::Internal(message)
                                                                             : ffi::Error::InvalidArgument(message);
}

// The options every call takes: the flags (attnmerge.h's ATTNMERGE_LSE_BASE2 and, for a forward,
// the mixed bases' and ATTNMERGE_GROUP_SCALE_UE8M0: the library checks them) and a_tokens (< 0:
// none).
attnmerge_options base_options(int64_t flags, int64_t a_tokens) {
  attnmerge_options opt = {};
  opt.flags = static_cast<uint32_t>(flags);
  if (a_tokens >= 0) {
    opt.flags |= ATTNMERGE_A_TOKENS;
    opt.a_tokens = a_tokens;
  }
  return opt;
}

// A forward's: those, the output scale as a number (0: none) or, with scale_in_buffer, the float32
// of the `scale` buffer (on the op's device), and the per-group scales where group_size > 0 (else
// that result, of no elements, is not written).
attnmerge_options options(int64_t flags, int64_t a_tokens, float output_scale, bool scale_in_buffer,
                          const ffi::AnyBuffer& scale, const attnmerge_tensor& group_scales, int64_t group_size) {
  attnmerge_options opt = base_options(flags, a_tokens);
  opt.output_scale = output_scale;
  if (scale_in_buffer) opt.output_scale_ptr = static_cast<const float*>(scale.untyped_data());
  if (group_size > 0) {
    opt.struct_size = sizeof(attnmerge_options);
    opt.group_scales = &group_scales;
    // Past int32: a value no power of two, which the C ABI refuses by name.
    opt.group_size = static_cast<int32_t>(std::min<int64_t>(group_size, INT32_MAX));
  }
  return opt;
}

// The sink [heads] as options.sink, where has_sink (else the `sink` buffer is not read).
void set_sink(attnmerge_options& opt, const attnmerge_tensor& sink, bool has_sink) {
  if (!has_sink) return;
  opt.struct_size = sizeof(attnmerge_options);
  opt.sink = &sink;
}

ffi::Error merge(void* stream, int32_t device, ffi::AnyBuffer o_a, ffi::AnyBuffer lse_a, ffi::AnyBuffer o_b,
                 ffi::AnyBuffer lse_b, ffi::AnyBuffer sink, ffi::AnyBuffer scale, ffi::Result<ffi::AnyBuffer> out,
                 ffi::Result<ffi::AnyBuffer> out_lse, ffi::Result<ffi::AnyBuffer> group_scales, int64_t flags,
                 int64_t a_tokens, float output_scale, bool scale_in_buffer, int64_t group_size, bool has_sink) {
  const attnmerge_tensor t_out = tensor(*out, device, 3), t_out_lse = tensor(*out_lse, device, 2);
  const attnmerge_tensor t_oa = tensor(o_a, device, 3), t_la = tensor(lse_a, device, 2);
  const attnmerge_tensor t_ob = tensor(o_b, device, 3), t_lb = tensor(lse_b, device, 2);
  const attnmerge_tensor t_gs = tensor(*group_scales, device, 3), t_sink = tensor(sink, device, 1);
  attnmerge_options opt = options(flags, a_tokens, output_scale, scale_in_buffer, scale, t_gs, group_size);
  set_sink(opt, t_sink, has_sink);
  return result(attnmerge_merge(&t_out, &t_out_lse, &t_oa, &t_la, &t_ob, &t_lb, &opt, stream));
}

ffi::Error merge_states(void* stream, int32_t device, ffi::AnyBuffer o, ffi::AnyBuffer lse, ffi::AnyBuffer sink,
                        ffi::AnyBuffer scale, ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> out_lse,
                        ffi::Result<ffi::AnyBuffer> group_scales, int64_t flags, int64_t a_tokens, float output_scale,
                        bool scale_in_buffer, int64_t group_size, bool has_sink) {
  const attnmerge_tensor t_out = tensor(*out, device, 3), t_out_lse = tensor(*out_lse, device, 2);
  const attnmerge_tensor t_o = tensor(o, device, 4), t_l = tensor(lse, device, 3), t_sink = tensor(sink, device, 1);
  const attnmerge_tensor t_gs = tensor(*group_scales, device, 3);
  attnmerge_options opt = options(flags, a_tokens, output_scale, scale_in_buffer, scale, t_gs, group_size);
  set_sink(opt, t_sink, has_sink);
  return result(attnmerge_merge_states(&t_out, &t_out_lse, &t_o, &t_l, &opt, stream));
}

ffi::Error merge_varlen(void* stream, int32_t device, ffi::AnyBuffer o, ffi::AnyBuffer lse, ffi::AnyBuffer indptr,
                        ffi::AnyBuffer sink, ffi::AnyBuffer scale, ffi::Result<ffi::AnyBuffer> out,
                        ffi::Result<ffi::AnyBuffer> out_lse, ffi::Result<ffi::AnyBuffer> group_scales, int64_t flags,
                        int64_t a_tokens, float output_scale, bool scale_in_buffer, int64_t group_size, bool has_sink) {
  const attnmerge_tensor t_indptr = index_tensor(indptr, device);
  const attnmerge_tensor t_out = tensor(*out, device, 3), t_out_lse = tensor(*out_lse, device, 2);
  const attnmerge_tensor t_o = tensor(o, device, 3), t_l = tensor(lse, device, 2), t_sink = tensor(sink, device, 1);
  const attnmerge_tensor t_gs = tensor(*group_scales, device, 3);
  attnmerge_options opt = options(flags, a_tokens, output_scale, scale_in_buffer, scale, t_gs, group_size);
  set_sink(opt, t_sink, has_sink);
  return result(attnmerge_merge_varlen(&t_out, &t_out_lse, &t_o, &t_l, &t_indptr, &opt, stream));
}

ffi::Error merge_share(void* stream, int32_t device, ffi::AnyBuffer o, ffi::AnyBuffer lse, ffi::AnyBuffer sink,
                       ffi::AnyBuffer scale, ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> out_lse,
                       ffi::Result<ffi::AnyBuffer> group_scales, int64_t flags, int64_t a_tokens, float output_scale,
                       bool scale_in_buffer, int64_t group_size, bool has_sink, int64_t index) {
  const attnmerge_tensor t_out = tensor(*out, device, 3), t_out_lse = tensor(*out_lse, device, 2);
  const attnmerge_tensor t_o = tensor(o, device, 3), t_l = tensor(lse, device, 3), t_sink = tensor(sink, device, 1);
  const attnmerge_tensor t_gs = tensor(*group_scales, device, 3);
  attnmerge_options opt = options(flags, a_tokens, output_scale, scale_in_buffer, scale, t_gs, group_size);
  set_sink(opt, t_sink, has_sink);
  return result(attnmerge_merge_share(&t_out, &t_out_lse, &t_o, &t_l, index, &opt, stream));
}

// The backward of each merge (attnmerge.jax's custom_vjp): the incoming gradients, the forward's
// results and inputs, then the inputs' gradients as results.

ffi::Error merge_backward(void* stream, int32_t device, ffi::AnyBuffer grad_out, ffi::AnyBuffer grad_out_lse,
                          ffi::AnyBuffer out, ffi::AnyBuffer out_lse, ffi::AnyBuffer o_a, ffi::AnyBuffer lse_a,
                          ffi::AnyBuffer o_b, ffi::AnyBuffer lse_b, ffi::Result<ffi::AnyBuffer> grad_o_a,
                          ffi::Result<ffi::AnyBuffer> grad_lse_a, ffi::Result<ffi::AnyBuffer> grad_o_b,
                          ffi::Result<ffi::AnyBuffer> grad_lse_b, bool base2, int64_t a_tokens) {
  const attnmerge_tensor t_goa = tensor(*grad_o_a, device, 3), t_gla = tensor(*grad_lse_a, device, 2);
  const attnmerge_tensor t_gob = tensor(*grad_o_b, device, 3), t_glb = tensor(*grad_lse_b, device, 2);
  const attnmerge_tensor t_go = tensor(grad_out, device, 3), t_gl = tensor(grad_out_lse, device, 2);
  const attnmerge_tensor t_out = tensor(out, device, 3), t_out_lse = tensor(out_lse, device, 2);
  const attnmerge_tensor t_oa = tensor(o_a, device, 3), t_la = tensor(lse_a, device, 2);
  const attnmerge_tensor t_ob = tensor(o_b, device, 3), t_lb = tensor(lse_b, device, 2);
  const attnmerge_options opt = base_options(base2 ? ATTNMERGE_LSE_BASE2 : 0, a_tokens);
  return result(attnmerge_merge_backward(&t_goa, &t_gla, &t_gob, &t_glb, &t_go, &t_gl, &t_out, &t_out_lse, &t_oa,
                                         &t_la, &t_ob, &t_lb, &opt, stream));
}

ffi::Error merge_states_backward(void* stream, int32_t device, ffi::AnyBuffer grad_out, ffi::AnyBuffer grad_out_lse,
                                 ffi::AnyBuffer out, ffi::AnyBuffer out_lse, ffi::AnyBuffer o, ffi::AnyBuffer lse,
                                 ffi::Result<ffi::AnyBuffer> grad_o, ffi::Result<ffi::AnyBuffer> grad_lse, bool base2,
                                 int64_t a_tokens) {
  const attnmerge_tensor t_gr = tensor(*grad_o, device, 4), t_grl = tensor(*grad_lse, device, 3);
  const attnmerge_tensor t_go = tensor(grad_out, device, 3), t_gl = tensor(grad_out_lse, device, 2);
  const attnmerge_tensor t_out = tensor(out, device, 3), t_out_lse = tensor(out_lse, device, 2);
  const attnmerge_tensor t_o = tensor(o, device, 4), t_l = tensor(lse, device, 3);
  const attnmerge_options opt = base_options(base2 ? ATTNMERGE_LSE_BASE2 : 0, a_tokens);
  return result(attnmerge_merge_states_backward(&t_gr, &t_grl, &t_go, &t_gl, &t_out, &t_out_lse, &t_o, &t_l, &opt,
                                                stream));
}

ffi::Error merge_varlen_backward(void* stream, int32_t device, ffi::AnyBuffer grad_out, ffi::AnyBuffer grad_out_lse,
                                 ffi::AnyBuffer out, ffi::AnyBuffer out_lse, ffi::AnyBuffer o, ffi::AnyBuffer lse,
                                 ffi::AnyBuffer indptr, ffi::Result<ffi::AnyBuffer> grad_o,
                                 ffi::Result<ffi::AnyBuffer> grad_lse, bool base2, int64_t a_tokens) {
  const attnmerge_tensor t_gr = tensor(*grad_o, device, 3), t_grl = tensor(*grad_lse, device, 2);
  const attnmerge_tensor t_go = tensor(grad_out, device, 3), t_gl = tensor(grad_out_lse, device, 2);
  const attnmerge_tensor t_out = tensor(out, device, 3), t_out_lse = tensor(out_lse, device, 2);
  const attnmerge_tensor t_o = tensor(o, device, 3), t_l = tensor(lse, device, 2);
  const attnmerge_tensor t_indptr = index_tensor(indptr, device);
  const attnmerge_options opt = base_options(base2 ? ATTNMERGE_LSE_BASE2 : 0, a_tokens);
  return result(attnmerge_merge_varlen_backward(&t_gr, &t_grl, &t_go, &t_gl, &t_out, &t_out_lse, &t_o, &t_l,
                                                &t_indptr, &opt, stream));
}

// The host handlers: the same, on the CPU (no stream, device ATTNMERGE_HOST).
ffi::Error merge_host(ffi::AnyBuffer o_a, ffi::AnyBuffer lse_a, ffi::AnyBuffer o_b, ffi::AnyBuffer lse_b,
                      ffi::AnyBuffer sink, ffi::AnyBuffer scale, ffi::Result<ffi::AnyBuffer> out,
                      ffi::Result<ffi::AnyBuffer> out_lse, ffi::Result<ffi::AnyBuffer> group_scales, int64_t flags,
                      int64_t a_tokens, float output_scale, bool scale_in_buffer, int64_t group_size, bool has_sink) {
  return merge(nullptr, ATTNMERGE_HOST, o_a, lse_a, o_b, lse_b, sink, scale, out, out_lse, group_scales, flags,
               a_tokens, output_scale, scale_in_buffer, group_size, has_sink);
}

ffi::Error merge_states_host(ffi::AnyBuffer o, ffi::AnyBuffer lse, ffi::AnyBuffer sink, ffi::AnyBuffer scale,
                             ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> out_lse,
                             ffi::Result<ffi::AnyBuffer> group_scales, int64_t flags, int64_t a_tokens,
                             float output_scale, bool scale_in_buffer, int64_t group_size, bool has_sink) {
  return merge_states(nullptr, ATTNMERGE_HOST, o, lse, sink, scale, out, out_lse, group_scales, flags, a_tokens,
                      output_scale, scale_in_buffer, group_size, has_sink);
}

ffi::Error merge_varlen_host(ffi::AnyBuffer o, ffi::AnyBuffer lse, ffi::AnyBuffer indptr, ffi::AnyBuffer sink,
                             ffi::AnyBuffer scale, ffi::Result<ffi::AnyBuffer> out,
                             ffi::Result<ffi::AnyBuffer> out_lse, ffi::Result<ffi::AnyBuffer> group_scales,
                             int64_t flags, int64_t a_tokens, float output_scale, bool scale_in_buffer,
                             int64_t group_size, bool has_sink) {
  return merge_varlen(nullptr, ATTNMERGE_HOST, o, lse, indptr, sink, scale, out, out_lse, group_scales, flags,
                      a_tokens, output_scale, scale_in_buffer, group_size, has_sink);
}

ffi::Error merge_share_host(ffi::AnyBuffer o, ffi::AnyBuffer lse, ffi::AnyBuffer sink, ffi::AnyBuffer scale,
                            ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> out_lse,
                            ffi::Result<ffi::AnyBuffer> group_scales, int64_t flags, int64_t a_tokens,
                            float output_scale, bool scale_in_buffer, int64_t group_size, bool has_sink,
                            int64_t index) {
  return merge_share(nullptr, ATTNMERGE_HOST, o, lse, sink, scale, out, out_lse, group_scales, flags, a_tokens,
                     output_scale, scale_in_buffer, group_size, has_sink, index);
}

ffi::Error merge_backward_host(ffi::AnyBuffer grad_out, ffi::AnyBuffer grad_out_lse, ffi::AnyBuffer out,
                               ffi::AnyBuffer out_lse, ffi::AnyBuffer o_a, ffi::AnyBuffer lse_a, ffi::AnyBuffer o_b,
                               ffi::AnyBuffer lse_b, ffi::Result<ffi::AnyBuffer> grad_o_a,
                               ffi::Result<ffi::AnyBuffer> grad_lse_a, ffi::Result<ffi::AnyBuffer> grad_o_b,
                               ffi::Result<ffi::AnyBuffer> grad_lse_b, bool base2, int64_t a_tokens) {
  return merge_backward(nullptr, ATTNMERGE_HOST, grad_out, grad_out_lse, out, out_lse, o_a, lse_a, o_b, lse_b,
                        grad_o_a, grad_lse_a, grad_o_b, grad_lse_b, base2, a_tokens);
}

ffi::Error merge_states_backward_host(ffi::AnyBuffer grad_out, ffi::AnyBuffer grad_out_lse, ffi::AnyBuffer out,
                                      ffi::AnyBuffer out_lse, ffi::AnyBuffer o, ffi::AnyBuffer lse,
                                      ffi::Result<ffi::AnyBuffer> grad_o, ffi::Result<ffi::AnyBuffer> grad_lse,
                                      bool base2, int64_t a_tokens) {
  return merge_states_backward(nullptr, ATTNMERGE_HOST, grad_out, grad_out_lse, out, out_lse, o, lse, grad_o,
                               grad_lse, base2, a_tokens);
}

ffi::Error merge_varlen_backward_host(ffi::AnyBuffer grad_out, ffi::AnyBuffer grad_out_lse, ffi::AnyBuffer out,
                                      ffi::AnyBuffer out_lse, ffi::AnyBuffer o, ffi::AnyBuffer lse,
                                      ffi::AnyBuffer indptr, ffi::Result<ffi::AnyBuffer> grad_o,
                                      ffi::Result<ffi::AnyBuffer> grad_lse, bool base2, int64_t a_tokens) {
  return merge_varlen_backward(nullptr, ATTNMERGE_HOST, grad_out, grad_out_lse, out, out_lse, o, lse, indptr, grad_o,
                               grad_lse, base2, a_tokens);
}

// The bindings: CUDA handlers take XLA's stream and device ordinal first; then the input
// buffers (the op's, then `sink`, then `scale`), the three results (out, out_lse, group_scales)
// and the attributes (then merge_share's index).
auto on_cuda() { return ffi::Ffi::Bind().Ctx<ffi::PlatformStream<void*>>().Ctx<ffi::DeviceOrdinal>(); }

auto on_host() { return ffi::Ffi::Bind(); }

// The results (out, out_lse, group_scales) and the attributes every forward takes.
template <typename Binding>
auto with_results(Binding binding) {
  return std::move(binding)
      .template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>()
      .template Attr<int64_t>("flags")
      .template Attr<int64_t>("a_tokens")
      .template Attr<float>("output_scale")
      .template Attr<bool>("scale_in_buffer")
      .template Attr<int64_t>("group_size")
      .template Attr<bool>("has_sink");
}

// `kInputs` (>= 1) buffers, the results and the attributes (the binding moves only as a temporary).
template <int kInputs, typename Binding>
auto with_buffers(Binding binding) {
  if constexpr (kInputs > 1) {
    return with_buffers<kInputs - 1>(std::move(binding).template Arg<ffi::AnyBuffer>());
  } else {
    return with_results(std::move(binding).template Arg<ffi::AnyBuffer>());
  }
}

// The backward's: `kInputs` buffers, `kResults` gradients, then the base and a_tokens.
template <int kInputs, int kResults, typename Binding>
auto with_grads(Binding binding) {
  if constexpr (kInputs > 0) {
    return with_grads<kInputs - 1, kResults>(std::move(binding).template Arg<ffi::AnyBuffer>());
  } else if constexpr (kResults > 0) {
    return with_grads<0, kResults - 1>(std::move(binding).template Ret<ffi::AnyBuffer>());
  } else {
    return std::move(binding).template Attr<bool>("base2").template Attr<int64_t>("a_tokens");
  }
}

}  // namespace

// The handlers, exported with C linkage for attnmerge.jax to wrap in capsules (jax.ffi.pycapsule).
XLA_FFI_DEFINE_HANDLER_SYMBOL(attnmerge_xla_merge_cuda, merge, (with_buffers<6>(on_cuda())));
XLA_FFI_DEFINE_HANDLER_SYMBOL(attnmerge_xla_merge_host, merge_host, (with_buffers<6>(on_host())));
XLA_FFI_DEFINE_HANDLER_SYMBOL(attnmerge_xla_merge_states_cuda, merge_states, (with_buffers<4>(on_cuda())));
XLA_FFI_DEFINE_HANDLER_SYMBOL(attnmerge_xla_merge_states_host, merge_states_host, (with_buffers<4>(on_host())));
XLA_FFI_DEFINE_HANDLER_SYMBOL(attnmerge_xla_merge_varlen_cuda, merge_varlen, (with_buffers<5>(on_cuda())));
XLA_FFI_DEFINE_HANDLER_SYMBOL(attnmerge_xla_merge_varlen_host, merge_varlen_host, (with_buffers<5>(on_host())));
XLA_FFI_DEFINE_HANDLER_SYMBOL(attnmerge_xla_merge_share_cuda, merge_share,
                              (with_buffers<4>(on_cuda()).Attr<int64_t>("index")));
XLA_FFI_DEFINE_HANDLER_SYMBOL(attnmerge_xla_merge_share_host, merge_share_host,
                              (with_buffers<4>(on_host()).Attr<int64_t>("index")));
XLA_FFI_DEFINE_HANDLER_SYMBOL(attnmerge_xla_merge_backward_cuda, merge_backward, (with_grads<8, 4>(on_cuda())));
XLA_FFI_DEFINE_HANDLER_SYMBOL(attnmerge_xla_merge_backward_host, merge_backward_host, (with_grads<8, 4>(on_host())));
XLA_FFI_DEFINE_HANDLER_SYMBOL(attnmerge_xla_merge_states_backward_cuda, merge_states_backward,
                              (with_grads<6, 2>(on_cuda())));
XLA_FFI_DEFINE_HANDLER_SYMBOL(attnmerge_xla_merge_states_backward_host, merge_states_backward_host,
                              (with_grads<6, 2>(on_host())));
XLA_FFI_DEFINE_HANDLER_SYMBOL(attnmerge_xla_merge_varlen_backward_cuda, merge_varlen_backward,
                              (with_grads<7, 2>(on_cuda())));
XLA_FFI_DEFINE_HANDLER_SYMBOL(attnmerge_xla_merge_varlen_backward_host, merge_varlen_backward_host,
                              (with_grads<7, 2>(on_host())));
