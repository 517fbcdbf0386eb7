// attnmerge._C: the binding of libattnmerge.  Each op reads its arguments as views
// (array_view.h), calls the C ABI without the GIL and turns its status into an exception; the raw
// layer builds descriptors from integer pointers.  It checks nothing the C ABI checks.
#include <dlfcn.h>

#include <algorithm>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <utility>
#include <vector>
#include <string>
#include <type_traits>

#include "array_view.h"
#include "call_options.h"
#include "flag_reader.h"
#include "road.h"
#include "attnmerge/attnmerge.h"

namespace py = pybind11;

namespace {

using attnmerge_py::ArgName;
using attnmerge_py::CallOptions;
using attnmerge_py::kOptionCount;
using attnmerge_py::kOptionFields;
using attnmerge_py::options_of;
using attnmerge_py::Param;
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
    case ATTNMERGE_ERROR_TIMEOUT:
      PyErr_SetString(PyExc_TimeoutError, attnmerge_last_error());
      throw py::error_already_set();
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

// What an argument may be, for messages about dtypes the library has no code for.
const char* const kO = dtype_names(ATTNMERGE_ROLE_O_IN);
const char* const kOut = dtype_names(ATTNMERGE_ROLE_O_OUT);
const char* const kLse = dtype_names(ATTNMERGE_ROLE_LSE);
const char* const kScale = dtype_names(ATTNMERGE_ROLE_SCALE);  // group scales, and output_scale (a const float*)
const char* const kMaskDtypes = dtype_names(ATTNMERGE_ROLE_MASK);
const char* const kValidDtypes = dtype_names(ATTNMERGE_ROLE_MASK | ATTNMERGE_ROLE_INDPTR);  // options.valid
const char* const kIndexDtypes = dtype_names(ATTNMERGE_ROLE_INDPTR);

// ---- a call's options record (attnmerge._call.Options: call_options.h's fields, then the caller's
// names and the stream) ---------------------------------------------------------------------------

constexpr int kNamesField = kOptionCount, kStreamField = kOptionCount + 1;

// The record's fields the binding reads: its scalars, its arrays (None: not given), the names and
// the stream.  The Python layer built it (normalised once, attnmerge._call), so a wrong type here
// is the package's own bug, still reported by name rather than trusted.
struct Record {
  CallOptions c;
  py::handle scale, sink, group_scales, sum_a, sum_b, valid, num_tokens, a_tokens_tensor, names, stream;

  explicit Record(py::handle record) {
    if (!PyTuple_Check(record.ptr()) || PyTuple_GET_SIZE(record.ptr()) < kStreamField + 1)
      type_error("options", "expected an attnmerge._call.Options record, got " + type_name(record));
    const auto at = [&](int i) { return py::handle(PyTuple_GET_ITEM(record.ptr(), i)); };
    int i = 0;
#define ATTNMERGE_READ(type, name) c.name = read<type>(at(i++), #name);
    ATTNMERGE_CALL_OPTIONS(ATTNMERGE_READ)
#undef ATTNMERGE_READ
#define ATTNMERGE_READ(name) name = at(i++);
    ATTNMERGE_CALL_ARRAYS(ATTNMERGE_READ)
#undef ATTNMERGE_READ
    names = at(kNamesField);
    stream = at(kStreamField);
  }

 private:
  template <typename T>
  static T read(py::handle v, const char* field) {
    if constexpr (std::is_floating_point<T>::value) {
      const double x = PyFloat_AsDouble(v.ptr());
      if (x == -1.0 && PyErr_Occurred()) {
        PyErr_Clear();
        type_error(field, "expected a number, got " + type_name(v));
      }
      return x;
    } else {
      if (!PyLong_Check(v.ptr())) type_error(field, "expected an int, got " + type_name(v));
      const long long x = PyLong_AsLongLong(v.ptr());
      if (x == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        value_error(field, "expected an int within 64 bits, got " + std::string(py::repr(v)));
      }
      return static_cast<T>(x);
    }
  }
};

// The output scale given as an array: a one-element float32 array on the op's device, read by the
// kernel (no host synchronization).
const float* scale_pointer(const attnmerge_tensor* scale, const ArgName& name) {
  if (scale == nullptr) return nullptr;
  int64_t n = 1;
  for (int i = 0; i < scale->ndim; ++i) n *= scale->shape[i];
  if (scale->dtype != ATTNMERGE_FLOAT32)
    type_error(name, std::string("expected a float32 array, got ") + attnmerge_dtype_info_of(scale->dtype)->array_name);
  if (n != 1)
    value_error(name, "expected a number or a one-element float32 array, got " + std::to_string(n) + " elements");
  return static_cast<const float*>(scale->data);
}

// The states' axis of an N-way merge's o and lse (and their gradients) at `axis` of the caller's
// arrays, read where the C ABI takes it (axis 1: [tokens, S, ...]) through the strides: an
// all-gather's [S, tokens, ...] (axis 0), a [tokens, heads, S, ...] exchange (axis 2), no copy.
void states_at(ArrayView& v, int64_t axis) {
  if (axis != 1) v.move_axis(static_cast<int>(axis), 1);
}

// One forward call: the op's own arrays (`N`, as the C ABI takes them), then the record's arrays
// (output scale, sinks, group scales, softmax sums, valid states, live tokens, a_tokens), read for the
// call's stream;
// `like` (the array outputs are allocated like, which says what stream=None means) and `outputs`
// (the first arrays, read last) as CallArrays takes them.  options() is the C ABI's
// attnmerge_options of the call, names passed down.
template <int N>
class Forward {
 public:
  static constexpr int kArrays = N + 8;
  static constexpr int kSumA = N + 3;  // the sums of the first LSE argument (laid out as it)
  Forward(const Record& r, const CallerNames& n, const Param (&own)[N], int like, int outputs)
      : r_(r), c(read(r, n, own, like, outputs, std::make_index_sequence<N>{})) {}

  attnmerge_options options(const CallerNames& n) const {
    attnmerge_options opt = options_of(r_.c, {c.t[N + 1], c.t[N + 2], c.t[N + 3], c.t[N + 4], c.t[N + 5], c.t[N + 6],
                                                  c.t[N + 7]},
                                       scale_pointer(c.t[N], n("output_scale")));
    n.pass_to(opt);
    return opt;
  }

 private:
  const Record& r_;

  template <std::size_t... I>
  static CallArrays<kArrays> read(const Record& r, const CallerNames& n, const Param (&own)[N], int like, int outputs,
                                  std::index_sequence<I...>) {
    const Param params[kArrays] = {own[I]...,
                                   {r.scale, n("output_scale"), kScale},
                                   {r.sink, n("sink"), kLse},
                                   {r.group_scales, n("group_scales"), kScale},
                                   {r.sum_a, n("sum_a"), kLse},
                                   {r.sum_b, n("sum_b"), kLse},
                                   {r.valid, n("valid"), kValidDtypes},
                                   {r.num_tokens, n("num_tokens"), kIndexDtypes},
                                   {r.a_tokens_tensor, n("a_tokens"), kIndexDtypes}};
    return CallArrays<kArrays>(params, r.stream, like, outputs);
  }

 public:
  CallArrays<kArrays> c;
};

// ---- the ops: their arrays as the C ABI takes them, then the call's options record -------------

void merge(py::handle out, py::handle out_lse, py::handle o_a, py::handle lse_a, py::handle o_b, py::handle lse_b,
           py::handle record) {
  const Record r(record);
  const CallerNames n(r.names);
  Forward<6> f(r, n,
               {{out, n("out"), kOut},
                {out_lse, n("out_lse"), kLse},
                {o_a, n("o_a"), kO},
                {lse_a, n("lse_a"), kLse},
                {o_b, n("o_b"), kO},
                {lse_b, n("lse_b"), kLse}},
               4, 2);
  const attnmerge_options opt = f.options(n);
  const auto& t = f.c.t;
  call_library([&] { return attnmerge_merge(t[0], t[1], t[2], t[3], t[4], t[5], &opt, f.c.stream()); });
}

void merge_inplace(py::handle o, py::handle lse, py::handle o_other, py::handle lse_other, py::handle mask,
                   py::handle record) {
  const Record r(record);
  const CallerNames n(r.names);
  Forward<5> f(r, n,
               {{o, n("o"), kO},
                {lse, n("lse"), kLse},
                {o_other, n("o_other"), kO},
                {lse_other, n("lse_other"), kLse},
                {mask, n("mask"), kMaskDtypes}},
               0, 0);
  const attnmerge_options opt = f.options(n);
  const auto& t = f.c.t;
  call_library([&] { return attnmerge_merge_inplace(t[0], t[1], t[2], t[3], t[4], &opt, f.c.stream()); });
}

void merge_states(py::handle out, py::handle out_lse, py::handle o, py::handle lse, py::handle record) {
  const Record r(record);
  const CallerNames n(r.names);
  Forward<4> f(r, n, {{out, n("out"), kOut}, {out_lse, n("out_lse"), kLse}, {o, n("o"), kO}, {lse, n("lse"), kLse}},
               2, 2);
  for (int i : {2, 3, f.kSumA}) states_at(f.c.views[i], r.c.states_axis);  // valid is [tokens, S] as given
  const attnmerge_options opt = f.options(n);
  const auto& t = f.c.t;
  call_library([&] { return attnmerge_merge_states(t[0], t[1], t[2], t[3], &opt, f.c.stream()); });
}

void merge_varlen(py::handle out, py::handle out_lse, py::handle o, py::handle lse, py::handle indptr,
                  py::handle record) {
  const Record r(record);
  const CallerNames n(r.names);
  Forward<5> f(r, n,
               {{out, n("out"), kOut},
                {out_lse, n("out_lse"), kLse},
                {o, n("o"), kO},
                {lse, n("lse"), kLse},
                {indptr, n("indptr"), kIndexDtypes}},
               2, 2);
  const attnmerge_options opt = f.options(n);
  const auto& t = f.c.t;
  call_library([&] { return attnmerge_merge_varlen(t[0], t[1], t[2], t[3], t[4], &opt, f.c.stream()); });
}

void merge_share(py::handle out, py::handle out_lse, py::handle o, py::handle lse, py::handle record) {
  const Record r(record);
  const CallerNames n(r.names);
  Forward<4> f(r, n, {{out, n("out"), kOut}, {out_lse, n("out_lse"), kLse}, {o, n("o"), kO}, {lse, n("lse"), kLse}},
               2, 2);
  for (int i : {3, f.kSumA}) states_at(f.c.views[i], r.c.states_axis);
  const attnmerge_options opt = f.options(n);
  const auto& t = f.c.t;
  const int64_t index = r.c.index;
  call_library([&] { return attnmerge_merge_share(t[0], t[1], t[2], t[3], index, &opt, f.c.stream()); });
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
// gradients, the forward's outputs and its inputs, as the C ABI takes them, then the record (its
// flags, a_tokens and states_axis).
void merge_backward(py::handle grad_o_a, py::handle grad_lse_a, py::handle grad_o_b, py::handle grad_lse_b,
                    py::handle grad_out, py::handle grad_out_lse, py::handle out, py::handle out_lse, py::handle o_a,
                    py::handle lse_a, py::handle o_b, py::handle lse_b, py::handle record) {
  const Record r(record);
  CallArrays<12> c({{grad_o_a, "grad_o_a", kO},
                    {grad_lse_a, "grad_lse_a", kLse},
                    {grad_o_b, "grad_o_b", kO},
                    {grad_lse_b, "grad_lse_b", kLse},
                    {grad_out, "grad_out", kO},
                    {grad_out_lse, "grad_out_lse", kLse},
                    {out, "out", kO},
                    {out_lse, "out_lse", kLse},
                    {o_a, "o_a", kO},
                    {lse_a, "lse_a", kLse},
                    {o_b, "o_b", kO},
                    {lse_b, "lse_b", kLse}},
                   r.stream, 10);
  attnmerge_options options = options_of(r.c);
  const CallerNames n(r.names);  // a missing array is "None" from Python
  n.pass_to(options);
  call_library([&] {
    return attnmerge_merge_backward(c.t[0], c.t[1], c.t[2], c.t[3], c.t[4], c.t[5], c.t[6], c.t[7], c.t[8], c.t[9],
                                    c.t[10], c.t[11], &options, c.stream());
  });
}

void merge_states_backward(py::handle grad_o, py::handle grad_lse, py::handle grad_out, py::handle grad_out_lse,
                           py::handle out, py::handle out_lse, py::handle o, py::handle lse, py::handle record) {
  const Record r(record);
  CallArrays<8> c({{grad_o, "grad_o", kO},
                   {grad_lse, "grad_lse", kLse},
                   {grad_out, "grad_out", kO},
                   {grad_out_lse, "grad_out_lse", kLse},
                   {out, "out", kO},
                   {out_lse, "out_lse", kLse},
                   {o, "o", kO},
                   {lse, "lse", kLse}},
                  r.stream, 6);
  for (int i : {0, 1, 6, 7}) states_at(c.views[i], r.c.states_axis);  // the gradients laid out as o and lse
  attnmerge_options options = options_of(r.c);
  const CallerNames n(r.names);  // a missing array is "None" from Python
  n.pass_to(options);
  call_library([&] {
    return attnmerge_merge_states_backward(c.t[0], c.t[1], c.t[2], c.t[3], c.t[4], c.t[5], c.t[6], c.t[7], &options,
                                           c.stream());
  });
}

void merge_varlen_backward(py::handle grad_o, py::handle grad_lse, py::handle grad_out, py::handle grad_out_lse,
                           py::handle out, py::handle out_lse, py::handle o, py::handle lse, py::handle indptr,
                           py::handle record) {
  const Record r(record);
  CallArrays<9> c({{grad_o, "grad_o", kO},
                   {grad_lse, "grad_lse", kLse},
                   {grad_out, "grad_out", kO},
                   {grad_out_lse, "grad_out_lse", kLse},
                   {out, "out", kO},
                   {out_lse, "out_lse", kLse},
                   {o, "o", kO},
                   {lse, "lse", kLse},
                   {indptr, "indptr", kIndexDtypes}},
                  r.stream, 6);
  attnmerge_options options = options_of(r.c);
  const CallerNames n(r.names);  // a missing array is "None" from Python
  n.pass_to(options);
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
               py::handle lse_a, py::handle o_b, py::handle lse_b, py::handle record, int device, uintptr_t stream,
               bool device_known) {
  const Record r(record);
  const int64_t a_tokens = r.c.a_tokens;
  const int64_t sizes[3] = {tokens, heads, head_size};
  const char* size_names[3] = {"tokens", "heads", "head_size"};
  for (int i = 0; i < 3; ++i)  // no shape can be built from a negative size
    if (sizes[i] < 0) value_error(size_names[i], "expected a size >= 0, got " + std::to_string(sizes[i]));
  const bool heads_first = r.c.flags & ATTNMERGE_LSE_HEADS_FIRST;
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
  const attnmerge_options options = options_of(r.c);
  const attnmerge_tensor* lse_out = out_lse.is_none() ? nullptr : &args[1];
  call_library([&] {
    return attnmerge_merge(&args[0], lse_out, &args[2], &args[3], &args[4], &args[5], &options,
                           reinterpret_cast<void*>(stream));
  });
}

// ---- the exchange fused with the merge ---------------------------------------------------------

// One rank of an exchange, its C descriptor built once: every rank's O, LSE, softmax sum (none:
// LSEs) and pad pointers (as this rank addresses them) and the layout they share, read off this
// rank's own O and LSE arrays, its sums laid out as its LSE (kept alive by the Python object that
// holds this one).
class Exchange {
 public:
  Exchange(py::handle o, py::handle lse, py::handle sum, std::vector<uintptr_t> o_ptrs,
           std::vector<uintptr_t> lse_ptrs, std::vector<uintptr_t> sum_ptrs, std::vector<uintptr_t> pad_ptrs,
           int32_t rank, int32_t reuse, int64_t timeout_ns)
      : layout_(py::reinterpret_borrow<py::object>(o)), o_(begin_ptrs(o_ptrs)), lse_(begin_ptrs(lse_ptrs)),
        sum_(begin_ptrs(sum_ptrs)), pads_(pad_ptrs.size()) {
    for (std::size_t i = 0; i < pad_ptrs.size(); ++i) pads_[i] = reinterpret_cast<void*>(pad_ptrs[i]);
    CallArrays<3> c({{o, "o", kO}, {lse, "lse", kLse}, {sum, "lse[1]", kLse}}, py::none(), 0);
    if (c.t[2] != nullptr) {  // the sums share the LSE's layout: the C ABI takes one for both
      const attnmerge_tensor &m = *c.t[1], &t = *c.t[2];
      if (t.ndim != m.ndim || !std::equal(t.shape, t.shape + t.ndim, m.shape) ||
          !std::equal(t.strides, t.strides + t.ndim, m.strides) || t.device != m.device)
        value_error("lse[1]", "expected the layout of lse[0] (the same shape, strides and device: the ranks' sums "
                              "are laid out as their maxima), got another");
    }
    x_.struct_size = 0;
    x_.rank = rank;
    x_.world_size = static_cast<int32_t>(pad_ptrs.size());
    x_.reuse = reuse;
    x_.timeout_ns = timeout_ns;
    x_.o = o_.data();
    x_.lse = lse_.data();
    x_.pads = pads_.data();
    x_.sum = c.t[2] != nullptr ? sum_.data() : nullptr;
    x_.o_layout = *c.t[0];
    x_.lse_layout = *c.t[1];
    x_.o_layout.data = x_.lse_layout.data = nullptr;  // each rank's is o[p], lse[p]
    if (o_.size() != pads_.size() || lse_.size() != pads_.size())
      value_error("o, lse, pads", "expected one entry per rank each, got " + std::to_string(o_.size()) + ", " +
                                      std::to_string(lse_.size()) + " and " + std::to_string(pads_.size()));
    if (c.t[2] != nullptr && sum_.size() != pads_.size())
      value_error("sum", "expected one entry per rank, got " + std::to_string(sum_.size()) + " for " +
                             std::to_string(pads_.size()) + " ranks");
  }

  void publish(int64_t epoch, py::handle stream) {
    void* s = stream_of(stream);
    call_library([&] { return attnmerge_exchange_publish(&x_, epoch, s); });
  }

  void merge(py::handle out, py::handle out_lse, int32_t slice, int64_t slice_begin, int64_t epoch,
             py::handle record) {
    const Record r(record);
    const CallerNames n(r.names);
    Forward<2> f(r, n, {{out, n("out"), kOut}, {out_lse, n("out_lse"), kLse}}, 0, 2);
    const attnmerge_options opt = f.options(n);
    const auto& t = f.c.t;
    void* const s = f.c.stream();
    call_library([&] { return attnmerge_merge_exchange(t[0], t[1], &x_, slice, slice_begin, epoch, &opt, s); });
  }

  void status(py::handle stream) {
    void* s = stream_of(stream);
    call_library([&] { return attnmerge_exchange_status(&x_, s); });
  }

  int32_t device() const { return x_.o_layout.device; }

 private:
  static std::vector<const void*> begin_ptrs(const std::vector<uintptr_t>& ptrs) {
    std::vector<const void*> v(ptrs.size());
    for (std::size_t i = 0; i < ptrs.size(); ++i) v[i] = reinterpret_cast<const void*>(ptrs[i]);
    return v;
  }
  // The stream of a call that takes no array of its own: as given, or for None that of the
  // framework of this rank's O (array_view.h's one reading of stream=None).
  void* stream_of(py::handle stream) { return CallArrays<1>({{layout_, "o", kO}}, stream, 0).stream(); }

  py::object layout_;  // this rank's O, whose framework says what stream=None means
  std::vector<const void*> o_, lse_, sum_;
  std::vector<void*> pads_;
  attnmerge_exchange x_ = {};
};

// The forward ops as METH_FASTCALL functions: the public functions' per-call path calls them on
// every eager call, where pybind11's dispatcher (an argument tuple, the overload search) was a
// share of the host time (benchmarks/NOTES.md#routing-check).  Errors as pybind11 would raise them.
template <auto F, std::size_t... I>
void call_with(PyObject* const* args, std::index_sequence<I...>) {
  F(py::handle(args[I])...);
}

template <auto F, std::size_t N>
PyObject* fastcall(PyObject*, PyObject* const* args, Py_ssize_t n) {
  if (n != static_cast<Py_ssize_t>(N)) {
    PyErr_Format(PyExc_TypeError, "expected %zd arguments, got %zd", static_cast<Py_ssize_t>(N), n);
    return nullptr;
  }
  try {
    call_with<F>(args, std::make_index_sequence<N>{});
  } catch (py::error_already_set& e) {
    e.restore();
    return nullptr;
  } catch (const py::builtin_exception& e) {
    e.set_error();
    return nullptr;
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
  Py_RETURN_NONE;
}

#define ATTNMERGE_FASTCALL(f, n, params)                                                                \
  PyMethodDef{#f, reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&fastcall<&f, n>)), METH_FASTCALL, \
              #f "(" params ") -> None"}
PyMethodDef kForward[] = {
    ATTNMERGE_FASTCALL(merge, 7,
                       "out: object, out_lse: object, o_a: object, lse_a: object, o_b: object, lse_b: object, "
                       "options: object"),
    ATTNMERGE_FASTCALL(merge_inplace, 6,
                       "o: object, lse: object, o_other: object, lse_other: object, mask: object, options: object"),
    ATTNMERGE_FASTCALL(merge_states, 5, "out: object, out_lse: object, o: object, lse: object, options: object"),
    ATTNMERGE_FASTCALL(merge_varlen, 6,
                       "out: object, out_lse: object, o: object, lse: object, indptr: object, options: object"),
    ATTNMERGE_FASTCALL(merge_share, 5, "out: object, out_lse: object, o: object, lse: object, options: object"),
};
#undef ATTNMERGE_FASTCALL

std::string library_path() {
  Dl_info info;
  if (dladdr(reinterpret_cast<void*>(&attnmerge_version), &info) && info.dli_fname) return info.dli_fname;
  return "";
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "attnmerge's binding of libattnmerge (internal; use the attnmerge package)";
  // Each op: its arrays as the C ABI takes them, then the call's options record (attnmerge._call.Options).
  const py::object module_name = m.attr("__name__");
  for (PyMethodDef& def : kForward)
    m.attr(def.ml_name) = py::reinterpret_steal<py::object>(PyCFunction_NewEx(&def, nullptr, module_name.ptr()));
  m.def("merge_backward", &merge_backward, py::arg("grad_o_a"), py::arg("grad_lse_a"), py::arg("grad_o_b"),
        py::arg("grad_lse_b"), py::arg("grad_out"), py::arg("grad_out_lse"), py::arg("out"), py::arg("out_lse"),
        py::arg("o_a"), py::arg("lse_a"), py::arg("o_b"), py::arg("lse_b"), py::arg("options"));
  m.def("merge_states_backward", &merge_states_backward, py::arg("grad_o"), py::arg("grad_lse"), py::arg("grad_out"),
        py::arg("grad_out_lse"), py::arg("out"), py::arg("out_lse"), py::arg("o"), py::arg("lse"),
        py::arg("options"));
  m.def("merge_varlen_backward", &merge_varlen_backward, py::arg("grad_o"), py::arg("grad_lse"), py::arg("grad_out"),
        py::arg("grad_out_lse"), py::arg("out"), py::arg("out_lse"), py::arg("o"), py::arg("lse"), py::arg("indptr"),
        py::arg("options"));
  m.def("merge_raw", &merge_raw, py::arg("tokens"), py::arg("heads"), py::arg("head_size"), py::arg("out"),
        py::arg("out_lse"), py::arg("o_a"), py::arg("lse_a"), py::arg("o_b"), py::arg("lse_b"), py::arg("options"),
        py::arg("device"), py::arg("stream"), py::arg("device_known"));
  // The options record's fields this module reads, in order (call_options.h): attnmerge._call
  // builds its record with exactly these first.
  py::tuple fields(kOptionCount + 2);
  for (int i = 0; i < kOptionCount; ++i) fields[i] = kOptionFields[i];
  fields[kNamesField] = "names";
  fields[kStreamField] = "stream";
  m.attr("OPTION_FIELDS") = fields;
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
  // The public functions' per-call path and their road (road.h), registered by attnmerge._roads and
  // attnmerge._call.
  m.def("use_roads", &attnmerge_py::use_roads, py::arg("jax_types"), py::arg("is_jax"), py::arg("refuse"),
        py::arg("jax"), py::arg("native"), py::arg("op_fields"), py::arg("record_fields"));
  m.def("use_torch", &attnmerge_py::use_torch, py::arg("takes"), py::arg("run"), py::arg("transforming"));
  m.def("torch_road", &attnmerge_py::torch_road);
  m.attr("road") = attnmerge_py::road_function();
  py::tuple slots(attnmerge_py::kSlotKinds);
  for (int i = 0; i < attnmerge_py::kSlotKinds; ++i) slots[i] = attnmerge_py::kSlotNames[i];
  m.attr("CALLER_SLOTS") = slots;
  m.def("caller", &attnmerge_py::caller, py::arg("op"), py::arg("slots"), py::arg("defaults"), py::arg("lses"),
        py::arg("record"), py::arg("general"));
  m.def("flag_reader", &attnmerge_py::flag_reader, py::arg("type"), py::arg("name"), py::arg("gate"),
        py::arg("tracing") = py::none());
  py::class_<Exchange>(m, "Exchange")
      .def(py::init<py::handle, py::handle, py::handle, std::vector<uintptr_t>, std::vector<uintptr_t>,
                    std::vector<uintptr_t>, std::vector<uintptr_t>, int32_t, int32_t, int64_t>(),
           py::arg("o"), py::arg("lse"), py::arg("sum"), py::arg("o_ptrs"), py::arg("lse_ptrs"), py::arg("sum_ptrs"),
           py::arg("pad_ptrs"), py::arg("rank"), py::arg("reuse"), py::arg("timeout_ns"))
      .def("publish", &Exchange::publish, py::arg("epoch"), py::arg("stream"))
      .def("merge", &Exchange::merge, py::arg("out"), py::arg("out_lse"), py::arg("slice"), py::arg("slice_begin"),
           py::arg("epoch"), py::arg("options"))
      .def("status", &Exchange::status, py::arg("stream"))
      .def_property_readonly("device", &Exchange::device);
  m.def("exchange_pad_bytes", &attnmerge_exchange_pad_bytes, py::arg("world_size"));
  m.attr("EXCHANGE_WAIT_READERS") = static_cast<int>(ATTNMERGE_EXCHANGE_WAIT_READERS);
  m.attr("EXCHANGE_ALTERNATE") = static_cast<int>(ATTNMERGE_EXCHANGE_ALTERNATE);
  m.attr("SLICE_TOKENS") = static_cast<int>(ATTNMERGE_SLICE_TOKENS);
  m.attr("SLICE_HEADS") = static_cast<int>(ATTNMERGE_SLICE_HEADS);
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
  m.attr("ROLE_SCALE") = ATTNMERGE_ROLE_SCALE;
  m.attr("LSE_BASE2") = ATTNMERGE_LSE_BASE2;
  m.attr("LSE_HEADS_FIRST") = ATTNMERGE_LSE_HEADS_FIRST;
  m.attr("LSE_B_BASE2") = ATTNMERGE_LSE_B_BASE2;
  m.attr("LSE_B_BASE_E") = ATTNMERGE_LSE_B_BASE_E;
  m.attr("OUT_LSE_BASE2") = ATTNMERGE_OUT_LSE_BASE2;
  m.attr("OUT_LSE_BASE_E") = ATTNMERGE_OUT_LSE_BASE_E;
  m.attr("PDL") = ATTNMERGE_PDL;
  m.attr("GROUP_SCALE_UE8M0") = ATTNMERGE_GROUP_SCALE_UE8M0;
  m.attr("BLOCK_MXFP8") = ATTNMERGE_BLOCK_MXFP8;
  m.attr("BLOCK_NVFP4") = ATTNMERGE_BLOCK_NVFP4;
  m.attr("SCALE_RCEIL") = ATTNMERGE_SCALE_RCEIL;
  m.attr("SCALE_SWIZZLED") = ATTNMERGE_SCALE_SWIZZLED;
  m.attr("BATCH_INVARIANT") = ATTNMERGE_BATCH_INVARIANT;
}
