// attnmerge._C: the binding of libattnmerge.  Each op reads its arguments as views
// (array_view.h), calls the C ABI without the GIL and turns its status into an exception; the raw
// layer builds descriptors from integer pointers.  It checks nothing the C ABI checks.
#include <dlfcn.h>
#include <pybind11/pybind11.h>

#include <string>

#include "array_view.h"
#include "flag_reader.h"
#include "attnmerge/attnmerge.h"

namespace py = pybind11;

namespace {

using attnmerge_py::ArgName;
using attnmerge_py::ArrayView;
using attnmerge_py::CallArrays;
using attnmerge_py::CallerNames;
using attnmerge_py::dtype_from_name;
using attnmerge_py::dtype_names;
using attnmerge_py::type_error;
using attnmerge_py::type_name;
using attnmerge_py::value_error;

void check(attnmerge_status status) {
  switch (status) {
    case ATTNMERGE_SUCCESS: return;
    case ATTNMERGE_ERROR_TYPE: throw py::type_error(attnmerge_last_error());
    case ATTNMERGE_ERROR_VALUE: throw py::value_error(attnmerge_last_error());
    default: throw std::runtime_error(attnmerge_last_error());
  }
}

// The C call without the GIL (the CPU path may run long), then its status as an exception.
template <typename F>
void call_library(F&& f) {
  attnmerge_status status;
  {
    py::gil_scoped_release release;
    status = f();
  }
  check(status);
}

// What an argument may be, for messages about dtypes the library has no code for (kF32 is also
// output_scale's: the C ABI's const float*).
const char* const kO = dtype_names(ATTNMERGE_ROLE_O_IN);
const char* const kOut = dtype_names(ATTNMERGE_ROLE_O_OUT);
const char* const kF32 = dtype_names(ATTNMERGE_ROLE_LSE);
const char* const kMaskDtypes = dtype_names(ATTNMERGE_ROLE_MASK);
const char* const kIndexDtypes = dtype_names(ATTNMERGE_ROLE_INDPTR);

// output_scale: None, a number, or a one-element float32 array on the op's device (read by the
// kernel, so no host synchronization).  `holder` keeps the array's view alive.
void set_output_scale(attnmerge_options& options, py::handle scale, ArrayView& holder, void* stream,
                      const ArgName& name) {
  if (scale.is_none()) return;
  if (PyFloat_Check(scale.ptr()) || PyLong_Check(scale.ptr())) {
    // A scale, as given: the Python layer (attnmerge._merge.output_scale_arg) refuses 0, the C ABI's
    // "no scale", which Python spells None; the C ABI checks the rest.
    options.output_scale = scale.cast<float>();
    return;
  }
  holder.read(scale, stream, name, kF32);
  int64_t n = 1;
  for (int i = 0; i < holder.t.ndim; ++i) n *= holder.t.shape[i];
  if (holder.t.dtype != ATTNMERGE_FLOAT32) type_error(name, "expected a float32 array, got another dtype");
  if (n != 1)
    value_error(name, "expected a number or a one-element float32 array, got " + std::to_string(n) + " elements");
  options.output_scale_ptr = static_cast<const float*>(holder.t.data);
}

// The per-group FP8 scales (None: none) and group size as options.group_scales and group_size: the
// layout that has them (a group_size without scales goes too, for the C ABI to refuse).
void set_group_scales(attnmerge_options& options, const attnmerge_tensor* scales, int32_t group_size) {
  if (scales == nullptr && group_size == 0) return;
  options.struct_size = sizeof(attnmerge_options);
  options.group_scales = scales;
  options.group_size = group_size;
}

// The sink (None: none) as options.sink: the layout that has it.
void set_sink(attnmerge_options& options, const attnmerge_tensor* sink) {
  if (sink == nullptr) return;
  options.struct_size = sizeof(attnmerge_options);
  options.sink = sink;
}

// ---- the ops: arguments as the C ABI takes them, then flags, options, the stream (None: that of
// the framework of the array outputs are allocated like, `like`) and the caller's names ----------

void merge(py::handle out, py::handle out_lse, py::handle o_a, py::handle lse_a, py::handle o_b, py::handle lse_b,
           uint32_t flags, int64_t a_tokens, py::handle output_scale, py::handle stream, py::handle names_table,
           py::handle group_scales, int32_t group_size, py::handle sink) {
  const CallerNames n(names_table);
  CallArrays<8> c({{out, n("out"), kOut},
                   {out_lse, n("out_lse"), kF32},
                   {o_a, n("o_a"), kO},
                   {lse_a, n("lse_a"), kF32},
                   {o_b, n("o_b"), kO},
                   {lse_b, n("lse_b"), kF32},
                   {group_scales, n("group_scales"), kF32},
                   {sink, n("sink"), kF32}},
                  stream, 4, 2);
  attnmerge_options options = {flags | (a_tokens >= 0 ? ATTNMERGE_A_TOKENS : 0u), a_tokens, 0.0f, nullptr};
  ArrayView scale;
  set_output_scale(options, output_scale, scale, c.stream(), n("output_scale"));
  set_sink(options, c.t[7]);
  set_group_scales(options, c.t[6], group_size);
  n.pass_to(options);
  call_library([&] { return attnmerge_merge(c.t[0], c.t[1], c.t[2], c.t[3], c.t[4], c.t[5], &options, c.stream()); });
}

void merge_inplace(py::handle o, py::handle lse, py::handle o_other, py::handle lse_other, py::handle mask,
                   uint32_t flags, py::handle stream, py::handle names_table) {
  const CallerNames n(names_table);
  CallArrays<5> c({{o, n("o"), kO},
                   {lse, n("lse"), kF32},
                   {o_other, n("o_other"), kO},
                   {lse_other, n("lse_other"), kF32},
                   {mask, n("mask"), kMaskDtypes}},
                  stream, 0);
  attnmerge_options options = {flags, 0, 0.0f, nullptr};
  n.pass_to(options);
  call_library([&] { return attnmerge_merge_inplace(c.t[0], c.t[1], c.t[2], c.t[3], c.t[4], &options, c.stream()); });
}

void merge_states(py::handle out, py::handle out_lse, py::handle o, py::handle lse, uint32_t flags, bool states_first,
                  py::handle output_scale, py::handle sink, py::handle stream, py::handle names_table,
                  py::handle group_scales, int32_t group_size) {
  const CallerNames n(names_table);
  CallArrays<6> c({{out, n("out"), kOut},
                   {out_lse, n("out_lse"), kF32},
                   {o, n("o"), kO},
                   {lse, n("lse"), kF32},
                   {sink, n("sink"), kF32},
                   {group_scales, n("group_scales"), kF32}},
                  stream, 2, 2);
  if (states_first) {  // an all-gather's [S, tokens, ...], read through its strides
    c.views[2].swap_leading_axes();
    c.views[3].swap_leading_axes();
  }
  attnmerge_options options = {flags, 0, 0.0f, nullptr};
  ArrayView scale;
  set_output_scale(options, output_scale, scale, c.stream(), n("output_scale"));
  set_sink(options, c.t[4]);
  set_group_scales(options, c.t[5], group_size);
  n.pass_to(options);
  call_library([&] { return attnmerge_merge_states(c.t[0], c.t[1], c.t[2], c.t[3], &options, c.stream()); });
}

void merge_varlen(py::handle out, py::handle out_lse, py::handle o, py::handle lse, py::handle indptr, uint32_t flags,
                  py::handle output_scale, py::handle sink, py::handle stream, py::handle names_table,
                  py::handle group_scales, int32_t group_size) {
  const CallerNames n(names_table);
  CallArrays<7> c({{out, n("out"), kOut},
                   {out_lse, n("out_lse"), kF32},
                   {o, n("o"), kO},
                   {lse, n("lse"), kF32},
                   {indptr, n("indptr"), kIndexDtypes},
                   {sink, n("sink"), kF32},
                   {group_scales, n("group_scales"), kF32}},
                  stream, 2, 2);
  attnmerge_options options = {flags, 0, 0.0f, nullptr};
  ArrayView scale;
  set_output_scale(options, output_scale, scale, c.stream(), n("output_scale"));
  set_sink(options, c.t[5]);
  set_group_scales(options, c.t[6], group_size);
  n.pass_to(options);
  call_library([&] { return attnmerge_merge_varlen(c.t[0], c.t[1], c.t[2], c.t[3], c.t[4], &options, c.stream()); });
}

void merge_share(py::handle out, py::handle out_lse, py::handle o, py::handle lse, int64_t index, uint32_t flags,
                 bool states_first, py::handle output_scale, py::handle sink, py::handle stream,
                 py::handle names_table, py::handle group_scales, int32_t group_size) {
  const CallerNames n(names_table);
  CallArrays<6> c({{out, n("out"), kOut},
                   {out_lse, n("out_lse"), kF32},
                   {o, n("o"), kO},
                   {lse, n("lse"), kF32},
                   {sink, n("sink"), kF32},
                   {group_scales, n("group_scales"), kF32}},
                  stream, 2, 2);
  if (states_first) c.views[3].swap_leading_axes();  // an all-gather's [S, tokens, heads], read through its strides
  attnmerge_options options = {flags, 0, 0.0f, nullptr};
  ArrayView scale;
  set_output_scale(options, output_scale, scale, c.stream(), n("output_scale"));
  set_sink(options, c.t[4]);
  set_group_scales(options, c.t[5], group_size);
  n.pass_to(options);
  call_library(
      [&] { return attnmerge_merge_share(c.t[0], c.t[1], c.t[2], c.t[3], index, &options, c.stream()); });
}

// A field of a raw descriptor that must be a Python int (pybind11's own cast error names no argument).
py::handle raw_int(py::handle v, const char* name, const char* field) {
  if (!PyLong_Check(v.ptr()) || PyBool_Check(v.ptr()))
    type_error(name, std::string("expected an int ") + field + ", got " + std::string(py::repr(v)) + " (" +
                         type_name(v) + ")");
  return v;
}

void* raw_pointer(py::handle v, const char* name) {
  const unsigned long long ptr = PyLong_AsUnsignedLongLong(raw_int(v, name, "ptr").ptr());
  if (ptr == static_cast<unsigned long long>(-1) && PyErr_Occurred()) {  // negative, or past 64 bits
    PyErr_Clear();
    value_error(name, "expected a ptr >= 0, got " + std::string(py::repr(v)));
  }
  return reinterpret_cast<void*>(static_cast<uintptr_t>(ptr));
}

// The backward of the three merges: the gradients first (None: not computed), then the incoming
// gradients, the forward's outputs and its inputs, as the C ABI takes them.
void merge_backward(py::handle grad_o_a, py::handle grad_lse_a, py::handle grad_o_b, py::handle grad_lse_b,
                    py::handle grad_out, py::handle grad_out_lse, py::handle out, py::handle out_lse, py::handle o_a,
                    py::handle lse_a, py::handle o_b, py::handle lse_b, uint32_t flags, int64_t a_tokens,
                    py::handle stream) {
  CallArrays<12> c({{grad_o_a, "grad_o_a", kO},
                    {grad_lse_a, "grad_lse_a", kF32},
                    {grad_o_b, "grad_o_b", kO},
                    {grad_lse_b, "grad_lse_b", kF32},
                    {grad_out, "grad_out", kO},
                    {grad_out_lse, "grad_out_lse", kF32},
                    {out, "out", kO},
                    {out_lse, "out_lse", kF32},
                    {o_a, "o_a", kO},
                    {lse_a, "lse_a", kF32},
                    {o_b, "o_b", kO},
                    {lse_b, "lse_b", kF32}},
                   stream, 10);
  const attnmerge_options options = {flags | (a_tokens >= 0 ? ATTNMERGE_A_TOKENS : 0u), a_tokens, 0.0f, nullptr};
  call_library([&] {
    return attnmerge_merge_backward(c.t[0], c.t[1], c.t[2], c.t[3], c.t[4], c.t[5], c.t[6], c.t[7], c.t[8], c.t[9],
                                    c.t[10], c.t[11], &options, c.stream());
  });
}

void merge_states_backward(py::handle grad_o, py::handle grad_lse, py::handle grad_out, py::handle grad_out_lse,
                           py::handle out, py::handle out_lse, py::handle o, py::handle lse, uint32_t flags,
                           bool states_first, py::handle stream) {
  CallArrays<8> c({{grad_o, "grad_o", kO},
                   {grad_lse, "grad_lse", kF32},
                   {grad_out, "grad_out", kO},
                   {grad_out_lse, "grad_out_lse", kF32},
                   {out, "out", kO},
                   {out_lse, "out_lse", kF32},
                   {o, "o", kO},
                   {lse, "lse", kF32}},
                  stream, 6);
  if (states_first)  // [S, tokens, ...] read through its strides, gradients likewise
    for (int i : {0, 1, 6, 7}) c.views[i].swap_leading_axes();
  const attnmerge_options options = {flags, 0, 0.0f, nullptr};
  call_library([&] {
    return attnmerge_merge_states_backward(c.t[0], c.t[1], c.t[2], c.t[3], c.t[4], c.t[5], c.t[6], c.t[7], &options,
                                           c.stream());
  });
}

void merge_varlen_backward(py::handle grad_o, py::handle grad_lse, py::handle grad_out, py::handle grad_out_lse,
                           py::handle out, py::handle out_lse, py::handle o, py::handle lse, py::handle indptr,
                           uint32_t flags, py::handle stream) {
  CallArrays<9> c({{grad_o, "grad_o", kO},
                   {grad_lse, "grad_lse", kF32},
                   {grad_out, "grad_out", kO},
                   {grad_out_lse, "grad_out_lse", kF32},
                   {out, "out", kO},
                   {out_lse, "out_lse", kF32},
                   {o, "o", kO},
                   {lse, "lse", kF32},
                   {indptr, "indptr", kIndexDtypes}},
                  stream, 6);
  const attnmerge_options options = {flags, 0, 0.0f, nullptr};
  call_library([&] {
    return attnmerge_merge_varlen_backward(c.t[0], c.t[1], c.t[2], c.t[3], c.t[4], c.t[5], c.t[6], c.t[7], c.t[8],
                                           &options, c.stream());
  });
}

// Raw layer: O as (ptr, dtype, stride_token, stride_head), LSE as (ptr, stride_0, stride_1) in the
// LSE's own layout, sizes given once.
void raw_tensor(attnmerge_tensor& dst, py::handle desc, bool is_o, int64_t d0, int64_t d1, int64_t head_size,
                int device, bool device_known, const char* name) {
  if (!PyTuple_Check(desc.ptr()) || PyTuple_GET_SIZE(desc.ptr()) != (is_o ? 4 : 3))
    type_error(name, std::string("expected a tuple ") +
                         (is_o ? "(ptr, dtype, stride_token, stride_head)" : "(ptr, stride_0, stride_1)") + ", got " +
                         std::string(py::repr(desc)));
  const py::tuple t = py::reinterpret_borrow<py::tuple>(desc);
  dst.data = raw_pointer(t[0], name);
  dst.device = device;
  dst.flags = device_known ? ATTNMERGE_DEVICE_KNOWN : 0u;  // the caller vouches for `device`
  if (is_o && !PyUnicode_Check(t[1].ptr()))  // a name, not a framework's dtype object
    type_error(name, std::string("expected a dtype name, ") + kOut + ", got " + std::string(py::repr(t[1])) + " (" +
                         type_name(t[1]) + ")");
  dst.dtype = is_o ? dtype_from_name(t[1].cast<std::string>(), name) : ATTNMERGE_FLOAT32;
  dst.ndim = is_o ? 3 : 2;
  dst.shape[0] = d0;
  dst.shape[1] = d1;
  dst.shape[2] = head_size;
  dst.strides[0] = raw_int(t[is_o ? 2 : 1], name, is_o ? "stride_token" : "stride_0").cast<int64_t>();
  dst.strides[1] = raw_int(t[is_o ? 3 : 2], name, is_o ? "stride_head" : "stride_1").cast<int64_t>();
  dst.strides[2] = 1;
}

void merge_raw(int64_t tokens, int64_t heads, int64_t head_size, py::handle out, py::handle out_lse, py::handle o_a,
               py::handle lse_a, py::handle o_b, py::handle lse_b, uint32_t flags, int64_t a_tokens, int device,
               uintptr_t stream, bool device_known) {
  const int64_t sizes[3] = {tokens, heads, head_size};
  const char* size_names[3] = {"tokens", "heads", "head_size"};
  for (int i = 0; i < 3; ++i)  // no shape can be built from a negative size
    if (sizes[i] < 0) value_error(size_names[i], "expected a size >= 0, got " + std::to_string(sizes[i]));
  const bool heads_first = flags & ATTNMERGE_LSE_HEADS_FIRST;
  const int64_t a_rows = a_tokens < 0 ? tokens : std::min(a_tokens, tokens);
  attnmerge_tensor args[6] = {};
  raw_tensor(args[0], out, true, tokens, heads, head_size, device, device_known, "out");
  if (!out_lse.is_none())
    raw_tensor(args[1], out_lse, false, heads_first ? heads : tokens, heads_first ? tokens : heads, 0, device,
               device_known, "out_lse");
  raw_tensor(args[2], o_a, true, a_rows, heads, head_size, device, device_known, "o_a");
  raw_tensor(args[3], lse_a, false, heads_first ? heads : a_rows, heads_first ? a_rows : heads, 0, device, device_known,
             "lse_a");
  raw_tensor(args[4], o_b, true, tokens, heads, head_size, device, device_known, "o_b");
  raw_tensor(args[5], lse_b, false, heads_first ? heads : tokens, heads_first ? tokens : heads, 0, device, device_known,
             "lse_b");
  const attnmerge_options options = {flags | (a_tokens >= 0 ? ATTNMERGE_A_TOKENS : 0u), a_tokens, 0.0f, nullptr};
  const attnmerge_tensor* lse_out = out_lse.is_none() ? nullptr : &args[1];
  call_library([&] {
    return attnmerge_merge(&args[0], lse_out, &args[2], &args[3], &args[4], &args[5], &options,
                           reinterpret_cast<void*>(stream));
  });
}

std::string library_path() {
  Dl_info info;
  if (dladdr(reinterpret_cast<void*>(&attnmerge_version), &info) && info.dli_fname) return info.dli_fname;
  return "";
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "attnmerge's binding of libattnmerge (internal; use the attnmerge package)";
  m.def("merge", &merge, py::arg("out"), py::arg("out_lse"), py::arg("o_a"), py::arg("lse_a"), py::arg("o_b"),
        py::arg("lse_b"), py::arg("flags"), py::arg("a_tokens"), py::arg("output_scale"), py::arg("stream"),
        py::arg("names") = py::none(), py::arg("group_scales") = py::none(), py::arg("group_size") = 0,
        py::arg("sink") = py::none());
  m.def("merge_inplace", &merge_inplace, py::arg("o"), py::arg("lse"), py::arg("o_other"), py::arg("lse_other"),
        py::arg("mask"), py::arg("flags"), py::arg("stream"), py::arg("names") = py::none());
  m.def("merge_states", &merge_states, py::arg("out"), py::arg("out_lse"), py::arg("o"), py::arg("lse"),
        py::arg("flags"), py::arg("states_first"), py::arg("output_scale"), py::arg("sink"), py::arg("stream"),
        py::arg("names") = py::none(), py::arg("group_scales") = py::none(), py::arg("group_size") = 0);
  m.def("merge_varlen", &merge_varlen, py::arg("out"), py::arg("out_lse"), py::arg("o"), py::arg("lse"),
        py::arg("indptr"), py::arg("flags"), py::arg("output_scale"), py::arg("sink"), py::arg("stream"),
        py::arg("names") = py::none(), py::arg("group_scales") = py::none(), py::arg("group_size") = 0);
  m.def("merge_share", &merge_share, py::arg("out"), py::arg("out_lse"), py::arg("o"), py::arg("lse"),
        py::arg("index"), py::arg("flags"), py::arg("states_first"), py::arg("output_scale"), py::arg("sink"),
        py::arg("stream"), py::arg("names") = py::none(), py::arg("group_scales") = py::none(),
        py::arg("group_size") = 0);
  m.def("merge_backward", &merge_backward, py::arg("grad_o_a"), py::arg("grad_lse_a"), py::arg("grad_o_b"),
        py::arg("grad_lse_b"), py::arg("grad_out"), py::arg("grad_out_lse"), py::arg("out"), py::arg("out_lse"),
        py::arg("o_a"), py::arg("lse_a"), py::arg("o_b"), py::arg("lse_b"), py::arg("flags"), py::arg("a_tokens"),
        py::arg("stream"));
  m.def("merge_states_backward", &merge_states_backward, py::arg("grad_o"), py::arg("grad_lse"), py::arg("grad_out"),
        py::arg("grad_out_lse"), py::arg("out"), py::arg("out_lse"), py::arg("o"), py::arg("lse"), py::arg("flags"),
        py::arg("states_first"), py::arg("stream"));
  m.def("merge_varlen_backward", &merge_varlen_backward, py::arg("grad_o"), py::arg("grad_lse"), py::arg("grad_out"),
        py::arg("grad_out_lse"), py::arg("out"), py::arg("out_lse"), py::arg("o"), py::arg("lse"), py::arg("indptr"),
        py::arg("flags"), py::arg("stream"));
  m.def("merge_raw", &merge_raw, py::arg("tokens"), py::arg("heads"), py::arg("head_size"), py::arg("out"),
        py::arg("out_lse"), py::arg("o_a"), py::arg("lse_a"), py::arg("o_b"), py::arg("lse_b"), py::arg("flags"),
        py::arg("a_tokens"), py::arg("device"), py::arg("stream"), py::arg("device_known"));
  m.def(
      "stream_synchronize",
      [](int device, uintptr_t stream) {
        call_library([&] { return attnmerge_stream_synchronize(device, reinterpret_cast<void*>(stream)); });
      },
      py::arg("device"), py::arg("stream"));
  m.def("last_launch", [] {
    attnmerge_launch_info info;
    attnmerge_last_launch(&info);
    static const char* const kernels[] = {"none", "rows", "rows_plain", "rows_inplace", "states", "backward"};
    const bool known = info.kernel >= 0 && info.kernel <= ATTNMERGE_KERNEL_BACKWARD;
    py::dict d;
    d["kernel"] = known ? kernels[info.kernel] : "unknown";
    d["launches"] = info.launches;
    d["state_groups"] = info.state_groups;
    d["index_bits"] = info.index_bits;
    d["vec"] = info.vec;
    d["pdl"] = info.pdl != 0;
    d["grid"] = py::make_tuple(info.grid[0], info.grid[1], info.grid[2]);
    d["block"] = py::make_tuple(info.block[0], info.block[1], info.block[2]);
    return d;
  });
  m.def("flag_reader", &attnmerge_py::flag_reader, py::arg("type"), py::arg("name"), py::arg("gate"),
        py::arg("tracing") = py::none());
  m.def("version_string", &attnmerge_version_string);
  m.def("version", &attnmerge_version);
  m.def("cuda_architectures", &attnmerge_cuda_architectures);
  m.def("cuda_ptx_architectures", &attnmerge_cuda_ptx_architectures);
  m.def("cuda_architectures_choice", &attnmerge_cuda_architectures_choice);
  m.def("cuda_build_version", &attnmerge_cuda_build_version);
  m.def("cuda_driver_version", &attnmerge_cuda_driver_version);
  m.def("device_count", &attnmerge_device_count);
  m.def("library_path", &library_path);
  m.def(
      "pointer_device", [](uintptr_t ptr) { return attnmerge_pointer_device(reinterpret_cast<void*>(ptr)); },
      py::arg("ptr"));
  // The C ABI's dtype table, rows (code, name, array_name, size, roles), which attnmerge._types reads.
  py::list dtypes;
  for (int32_t code = 0; const attnmerge_dtype_info* d = attnmerge_dtype_info_of(code); ++code)
    dtypes.append(py::make_tuple(code, d->name, d->array_name, d->size, d->roles));
  m.attr("DTYPES") = py::tuple(dtypes);
  m.attr("ROLE_O_IN") = ATTNMERGE_ROLE_O_IN;
  m.attr("ROLE_O_OUT") = ATTNMERGE_ROLE_O_OUT;
  m.attr("ROLE_LSE") = ATTNMERGE_ROLE_LSE;
  m.attr("ROLE_MASK") = ATTNMERGE_ROLE_MASK;
  m.attr("ROLE_INDPTR") = ATTNMERGE_ROLE_INDPTR;
  m.attr("LSE_BASE2") = ATTNMERGE_LSE_BASE2;
  m.attr("LSE_HEADS_FIRST") = ATTNMERGE_LSE_HEADS_FIRST;
  m.attr("LSE_B_BASE2") = ATTNMERGE_LSE_B_BASE2;
  m.attr("LSE_B_BASE_E") = ATTNMERGE_LSE_B_BASE_E;
  m.attr("OUT_LSE_BASE2") = ATTNMERGE_OUT_LSE_BASE2;
  m.attr("OUT_LSE_BASE_E") = ATTNMERGE_OUT_LSE_BASE_E;
  m.attr("PDL") = ATTNMERGE_PDL;
  m.attr("GROUP_SCALE_UE8M0") = ATTNMERGE_GROUP_SCALE_UE8M0;
}
