// attnmerge._C's array reader: a Python array of any framework (the DLPack C exchange API,
// __dlpack__, __cuda_array_interface__, NumPy, __array_interface__) as an attnmerge_tensor, and the
// one place that decides which stream `stream=None` means.  It checks nothing the C ABI checks: it
// fails only where an object cannot be described at all (not an array, a dtype or device the C ABI
// has no code for, too many dimensions, strides that are not whole elements).
#ifndef ATTNMERGE_PYTHON_ARRAY_VIEW_H_
#define ATTNMERGE_PYTHON_ARRAY_VIEW_H_

#include <pybind11/pybind11.h>

#include <string>

#include "attnmerge/attnmerge.h"

// DLPack's (third_party/dlpack/dlpack.h, read by array_view.cpp alone).
struct DLPackExchangeAPI;
struct DLManagedTensor;
struct DLManagedTensorVersioned;

namespace attnmerge_py {

namespace py = pybind11;

class CallerNames;

// An argument's name in messages: the binding's own, or the caller's from `names`, looked up only
// when a message is worded, so that a call that fails nothing pays nothing for it.
class ArgName {
 public:
  // Implicit: a plain name is the binding's own.
  ArgName(const char* name, const CallerNames* names = nullptr) : name_(name), names_(names) {}
  const char* str() const;  // the caller's name

 private:
  const char* name_;
  const CallerNames* names_;
};

// The caller's names of a call's arguments: a dict from the binding's names, which are the C
// ABI's ("o_a", "a_tokens"), to the caller's (vLLM's "prefix_output"), handed down by a compat
// layer; None keeps the binding's own.  One table for both layers: the binding's own messages
// look names up in it (of), and pass_to hands it to the C ABI (attnmerge_options.arg_names),
// whose messages name the arguments through it.  Built under the GIL, for one call, on the stack
// (a compat layer's call pays for no copy and no allocation).
// Python's word for a missing array, "None", is passed down with the names (attnmerge.h's arg
// "NULL"), so that the C ABI's messages say what the Python layer's say.
class CallerNames {
 public:
  static constexpr int kMaxNames = 16;  // more than an op names (the two-way backward: 12 arguments, a_tokens)

  explicit CallerNames(py::handle table);  // None or a dict of str to str
  CallerNames(const CallerNames&) = delete;
  CallerNames& operator=(const CallerNames&) = delete;
  ArgName operator()(const char* name) const { return ArgName(name, this); }
  const char* of(const char* name) const;  // the caller's name of `name`, else `name`
  void pass_to(attnmerge_options& options) const;  // no names: options as they are

 private:
  attnmerge_arg_name entries_[kMaxNames + 1];  // the caller's, then {"NULL", "None"}
  py::object held_[2 * kMaxNames];  // the strs the entries point into, referenced for the call
  int count_ = 0;
};

// Errors worded "name: what", naming the argument.
[[noreturn]] void type_error(const ArgName& name, const std::string& what);
[[noreturn]] void value_error(const ArgName& name, const std::string& what);
std::string type_name(py::handle obj);  // the __qualname__ of obj's type

// The dtypes, all read from the C ABI's one table (attnmerge_dtype_info_of): nothing here restates
// a dtype's code, name or roles.
//
// The library's code for a dtype's name as NumPy, ml_dtypes and the raw layer spell it
// (array_name); -1 for any other.
int code_of_name(const std::string& name);
// "float32, float16 or bfloat16": the names, as array libraries spell them, of the dtypes of
// `role` (ATTNMERGE_ROLE_* bits), for messages about dtypes the library has no code for.  The text
// lives as long as the process.  Under the GIL.
const char* dtype_names(uint32_t role);
// An output O dtype of the raw layer, by name: the array libraries' or the C ABI's ("float8_e4m3"
// there is float8_e4m3fn; an ml_dtypes array of that name is another type).
int dtype_from_name(const std::string& s, const ArgName& name);

// One array as the C ABI takes it: pointer, dtype, shape, strides in elements, device, flags (in
// `t`), the stream it was read for, and whatever must stay alive until the call returns.
class ArrayView {
 public:
  ArrayView() = default;
  ArrayView(const ArrayView&) = delete;
  ArrayView& operator=(const ArrayView&) = delete;
  ~ArrayView();

  // Reads `obj`, an array, for the consumer stream `stream` (what __dlpack__ is told); `name` and
  // `expected` (the dtypes the argument takes, in words) word the errors.
  void read(py::handle obj, void* stream, const ArgName& name, const char* expected);

  // Axis `from` moved to position `to` (the axes between shift by one), through the shape and
  // strides: an exchange's [S, tokens, ...] or [tokens, heads, S, ...] read as [tokens, S, ...].
  // An axis past ndim leaves the view as it is, for the C ABI to refuse its shape.
  void move_axis(int from, int to);

  attnmerge_tensor t{};
  void* stream = nullptr;

 private:
  friend class StreamRequest;
  const DLPackExchangeAPI* api_ = nullptr;  // set when the exchange API described it
  DLManagedTensorVersioned* versioned_ = nullptr;
  DLManagedTensor* legacy_ = nullptr;
};

// The stream of one call.  An explicit stream (an int handle, or an object with __cuda_stream__,
// .cuda_stream or .ptr) is taken as given.  None is the current stream of the framework that owns
// `like` (the array the call's outputs are allocated like), else the legacy default stream: asked
// of its DLPack exchange API (PyTorch >= 2.10) once `like` is read, as that needs its device; of
// PyTorch, CuPy, or Numba's __cuda_array_interface__ before, so that __dlpack__ is told it.
class StreamRequest {
 public:
  StreamRequest(py::handle stream, py::handle like);
  void* consumer() const { return handle_; }  // the stream to read the call's arrays for
  void* resolve(const ArrayView& like) const;  // the call's stream, `like` read

 private:
  void* handle_ = nullptr;
  bool ask_exchange_api_ = false;
};

// One argument of a call: the object, its name and the dtypes it takes (for messages).
struct Param {
  py::handle obj;
  ArgName name;
  const char* expected;
};

// The arguments of one call read as views for its stream; a None argument stays a NULL tensor (the
// C ABI names it).  The first `outputs` params are read last: an output the Python layer allocated
// like an input (a meta tensor's, say) must not take the blame for that input.
template <int N>
class CallArrays {
 public:
  CallArrays(const Param (&params)[N], py::handle stream, int like, int outputs = 0) {
    const StreamRequest request(stream, params[like].obj);
    for (int k = 0; k < N; ++k) {
      const int i = (k + outputs) % N;
      if (params[i].obj.is_none()) continue;
      views[i].read(params[i].obj, request.consumer(), params[i].name, params[i].expected);
      t[i] = &views[i].t;
    }
    stream_ = request.resolve(views[like]);
  }
  void* stream() const { return stream_; }

  ArrayView views[N];
  const attnmerge_tensor* t[N] = {};

 private:
  void* stream_ = nullptr;
};

}  // namespace attnmerge_py

#endif  // ATTNMERGE_PYTHON_ARRAY_VIEW_H_
