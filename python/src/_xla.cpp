// XLA FFI handlers of the merges, for attnmerge.jax (jax.ffi.ffi_call under jax.jit).  Like the
// pybind11 module, a thin layer over the C ABI: each handler describes XLA's buffers (row-major,
// on the device XLA names) as attnmerge_tensor and calls libattnmerge on the stream XLA gives,
// which validates everything; its status and message come back as the handler's error.
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

// A dense row-major XLA buffer as a tensor on `device`.
attnmerge_tensor tensor(const ffi::AnyBuffer& b, int32_t device) {
  attnmerge_tensor t = {};
  const auto dims = b.dimensions();
  t.data = b.untyped_data();
  t.ndim = static_cast<int32_t>(dims.size());
  t.dtype = dtype_of(b.element_type());
  t.device = device;
  t.flags = ATTNMERGE_DEVICE_KNOWN;  // XLA's own buffers on XLA's device
  if (dims.size() > ATTNMERGE_MAX_NDIM) {
    t.ndim = static_cast<int32_t>(dims.size());  // refused by the C ABI as the wrong ndim
    return t;
  }
  int64_t stride = 1;
  for (int i = static_cast<int>(dims.size()) - 1; i >= 0; --i) {
    t.shape[i] = dims[i];
    t.strides[i] = stride;
    stride *= dims[i];
  }
  return t;
}

ffi::Error result(attnmerge_status status) {
  if (status == ATTNMERGE_SUCCESS) return ffi::Error::Success();
  const std::string message = std::string("attnmerge: ") + attnmerge_last_error();
  return status == ATTNMERGE_ERROR_CUDA || status == ATTNMERGE_ERROR_NO_DEVICE ? ffi::Error::Internal(message)
                                                                             : ffi::Error::InvalidArgument(message);
}

attnmerge_options options(bool base2) {
  attnmerge_options opt = {};
  opt.flags = base2 ? ATTNMERGE_LSE_BASE2 : 0u;
  return opt;
}

ffi::Error merge(void* stream, int32_t device, ffi::AnyBuffer o_a, ffi::AnyBuffer lse_a, ffi::AnyBuffer o_b,
                 ffi::AnyBuffer lse_b, ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> out_lse,
                 bool base2) {
  const attnmerge_tensor t_out = tensor(*out, device), t_out_lse = tensor(*out_lse, device);
  const attnmerge_tensor t_oa = tensor(o_a, device), t_la = tensor(lse_a, device);
  const attnmerge_tensor t_ob = tensor(o_b, device), t_lb = tensor(lse_b, device);
  const attnmerge_options opt = options(base2);
  return result(attnmerge_merge(&t_out, &t_out_lse, &t_oa, &t_la, &t_ob, &t_lb, &opt, stream));
}

ffi::Error merge_states(void* stream, int32_t device, ffi::AnyBuffer o, ffi::AnyBuffer lse,
                        ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> out_lse, bool base2) {
  const attnmerge_tensor t_out = tensor(*out, device), t_out_lse = tensor(*out_lse, device);
  const attnmerge_tensor t_o = tensor(o, device), t_l = tensor(lse, device);
  const attnmerge_options opt = options(base2);
  return result(attnmerge_merge_states(&t_out, &t_out_lse, &t_o, &t_l, &opt, stream));
}

ffi::Error merge_host(ffi::AnyBuffer o_a, ffi::AnyBuffer lse_a, ffi::AnyBuffer o_b, ffi::AnyBuffer lse_b,
                      ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> out_lse, bool base2) {
  return merge(nullptr, ATTNMERGE_HOST, o_a, lse_a, o_b, lse_b, out, out_lse, base2);
}

ffi::Error merge_states_host(ffi::AnyBuffer o, ffi::AnyBuffer lse, ffi::Result<ffi::AnyBuffer> out,
                             ffi::Result<ffi::AnyBuffer> out_lse, bool base2) {
  return merge_states(nullptr, ATTNMERGE_HOST, o, lse, out, out_lse, base2);
}

// The bindings: the CUDA handlers take XLA's stream and device ordinal first; then `inputs`
// buffers, the two results (out, out_lse) and the base attribute.
// The bindings: CUDA handlers take XLA's stream and device ordinal first; then the input buffers,
// the two results (out, out_lse) and the LSE base attribute.
auto on_cuda() { return ffi::Ffi::Bind().Ctx<ffi::PlatformStream<void*>>().Ctx<ffi::DeviceOrdinal>(); }

auto on_host() { return ffi::Ffi::Bind(); }

template <int kInputs, typename Binding>
auto with_buffers(Binding binding) {
  if constexpr (kInputs == 0) {
    return std::move(binding).template Ret<ffi::AnyBuffer>().template Ret<ffi::AnyBuffer>().template Attr<bool>(
        "base2");
  } else {
    return with_buffers<kInputs - 1>(std::move(binding).template Arg<ffi::AnyBuffer>());
  }
}

}  // namespace

// The handlers, exported with C linkage for attnmerge.jax to wrap in capsules (jax.ffi.pycapsule).
XLA_FFI_DEFINE_HANDLER_SYMBOL(attnmerge_xla_merge_cuda, merge, with_buffers<4>(on_cuda()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(attnmerge_xla_merge_host, merge_host, with_buffers<4>(on_host()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(attnmerge_xla_merge_states_cuda, merge_states, with_buffers<2>(on_cuda()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(attnmerge_xla_merge_states_host, merge_states_host, with_buffers<2>(on_host()));
