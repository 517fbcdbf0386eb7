// attnmerge._C: turns Python arrays of any framework into attnmerge_tensor descriptors and C ABI
// status codes into exceptions.  It checks nothing the C ABI checks; it only fails where an object
// cannot be described at all (not an array, an unsupported dtype or device, too many dimensions).
#include <dlfcn.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstring>
#include <string>
#include <unordered_map>
#include <vector>

#include "attnmerge/attnmerge.h"

namespace py = pybind11;

namespace {

// ---- DLPack, as the DLPack specification lays it out (ABI v1) -------------------------------
enum DLDeviceType : int32_t { kDLCPU = 1, kDLCUDA = 2, kDLCUDAHost = 3, kDLCUDAManaged = 13 };
enum DLTypeCode : uint8_t { kDLInt = 0, kDLUInt = 1, kDLFloat = 2, kDLBfloat = 4, kDLBool = 6, kDLFloat8_e4m3fn = 10 };
struct DLDevice { int32_t device_type; int32_t device_id; };
struct DLDataType { uint8_t code; uint8_t bits; uint16_t lanes; };
struct DLTensor {
  void* data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t* shape;
  int64_t* strides;
  uint64_t byte_offset;
};
struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor*);
};
struct DLPackVersion { uint32_t major, minor; };
struct DLManagedTensorVersioned {
  DLPackVersion version;
  void* manager_ctx;
  void (*deleter)(DLManagedTensorVersioned*);
  uint64_t flags;
  DLTensor dl_tensor;
};
constexpr uint64_t kDLReadOnly = 1;
struct DLPackExchangeAPIHeader {
  DLPackVersion version;
  DLPackExchangeAPIHeader* prev_api;
};
struct DLPackExchangeAPI {
  DLPackExchangeAPIHeader header;
  void* managed_tensor_allocator;
  int (*managed_tensor_from_py_object_no_sync)(void*, DLManagedTensorVersioned**);
  void* managed_tensor_to_py_object_no_sync;
  int (*dltensor_from_py_object_no_sync)(void*, DLTensor*);
  int (*current_work_stream)(int32_t device_type, int32_t device_id, void** out_stream);
};

// ---- descriptors --------------------------------------------------------------------------------
// An argument turned into a descriptor, holding whatever must stay alive until the call returns.
struct Arg {
  attnmerge_tensor t{};
  const DLPackExchangeAPI* api = nullptr;  // set when the exchange API described it
  DLManagedTensorVersioned* versioned = nullptr;
  DLManagedTensor* legacy = nullptr;
  Arg() = default;
  Arg(const Arg&) = delete;
  Arg& operator=(const Arg&) = delete;
  ~Arg() {
    if (versioned && versioned->deleter) versioned->deleter(versioned);
    if (legacy && legacy->deleter) legacy->deleter(legacy);
  }
};

[[noreturn]] void type_error(const char* name, const std::string& what) {
  throw py::type_error(std::string(name) + ": " + what);
}
[[noreturn]] void value_error(const char* name, const std::string& what) {
  throw py::value_error(std::string(name) + ": " + what);
}

std::string type_name(py::handle obj) { return py::str(py::type::handle_of(obj).attr("__qualname__")); }

// "int32", "float64", "bool", ... as the frameworks spell them, for error messages.
std::string dl_dtype_name(DLDataType dt) {
  static const char* const kinds[] = {"int", "uint", "float", "opaque", "bfloat", "complex", "bool"};
  std::string s = dt.code < 7 ? kinds[dt.code] : "DLPack type code " + std::to_string(dt.code) + " of ";
  if (dt.code != 6) s += std::to_string(dt.bits);
  if (dt.lanes != 1) s += "x" + std::to_string(dt.lanes);
  return s;
}

// The library's code for a DLPack dtype; dtypes it has no code for fail here, naming what the
// argument expects (`expected`), and every other check is the C ABI's.
int dtype_from_dl(DLDataType dt, const char* expected, const char* name) {
  if (dt.lanes == 1) {
    switch (dt.code) {
      case kDLFloat:
        if (dt.bits == 32) return ATTNMERGE_FLOAT32;
        if (dt.bits == 16) return ATTNMERGE_FLOAT16;
        break;
      case kDLBfloat:
        if (dt.bits == 16) return ATTNMERGE_BFLOAT16;
        break;
      case kDLFloat8_e4m3fn:
        if (dt.bits == 8) return ATTNMERGE_FLOAT8_E4M3;
        break;
      case kDLUInt:
        if (dt.bits == 8) return ATTNMERGE_UINT8;
        break;
      case kDLBool:
        if (dt.bits == 8) return ATTNMERGE_BOOL;
        break;
      case kDLInt:
        if (dt.bits == 32) return ATTNMERGE_INT32;
        if (dt.bits == 64) return ATTNMERGE_INT64;
        break;
    }
  }
  type_error(name, std::string("expected dtype ") + expected + ", got " + dl_dtype_name(dt));
}

// The library's code for a dtype's name as NumPy, ml_dtypes and the raw layer spell it (the C ABI's
// table, attnmerge_dtype_info_of); -1 for any other.
int code_of_name(const std::string& s) {
  for (int32_t code = 0; const attnmerge_dtype_info* d = attnmerge_dtype_info_of(code); ++code)
    if (s == d->array_name) return code;
  return -1;
}

// "float32, float16 or bfloat16": the names of the dtypes of `role` as array libraries spell them,
// for messages about dtypes the library has no code for.
const char* dtype_names(uint32_t role) {
  static std::unordered_map<uint32_t, std::string> texts;  // one per role, built at import
  std::string& text = texts[role];
  if (!text.empty()) return text.c_str();
  std::vector<const char*> names;
  for (int32_t code = 0; const attnmerge_dtype_info* d = attnmerge_dtype_info_of(code); ++code)
    if (d->roles & role) names.push_back(d->array_name);
  for (std::size_t i = 0; i < names.size(); ++i)
    text += (i == 0 ? "" : i + 1 == names.size() ? " or " : ", ") + std::string(names[i]);
  return text.c_str();
}

// An output O dtype of the raw layer, by name: the array libraries' or the C ABI's ("float8_e4m3"
// there is float8_e4m3fn; an ml_dtypes array of that name is another type).
int dtype_from_name(const std::string& s, const char* name) {
  for (int32_t code = 0; const attnmerge_dtype_info* d = attnmerge_dtype_info_of(code); ++code)
    if ((s == d->array_name || s == d->name) && (d->roles & ATTNMERGE_ROLE_O_OUT)) return code;
  type_error(name, std::string("expected dtype ") + dtype_names(ATTNMERGE_ROLE_O_OUT) + ", got " + s);
}

// The code of a dtype object (NumPy's, ml_dtypes'), from its name, asked once per object: the
// objects are singletons, held here so that an address stays its own (at most 64: a program minting
// dtype objects is asked every time).  Under the GIL.
int code_of_dtype(py::handle dtype) {
  static std::unordered_map<PyObject*, int> cache;
  const auto it = cache.find(dtype.ptr());
  if (it != cache.end()) return it->second;
  const int code = code_of_name(py::str(dtype));
  if (cache.size() < 64) {
    cache.emplace(dtype.ptr(), code);
    dtype.inc_ref();
  }
  return code;
}

void set_ndim(Arg& a, int64_t ndim, const char* name) {
  if (ndim > ATTNMERGE_MAX_NDIM)
    value_error(name, "expected at most " + std::to_string(ATTNMERGE_MAX_NDIM) + " dimensions, got " + std::to_string(ndim));
  a.t.ndim = static_cast<int32_t>(ndim);
}

void from_dltensor(Arg& a, const DLTensor& d, bool read_only, const char* expected, const char* name) {
  switch (d.device.device_type) {
    case kDLCPU:
    case kDLCUDAHost: a.t.device = ATTNMERGE_HOST; break;
    case kDLCUDA:
    case kDLCUDAManaged: a.t.device = d.device.device_id; break;
    default: value_error(name, "expected a CPU or CUDA array, got DLPack device type " + std::to_string(d.device.device_type));
  }
  a.t.dtype = dtype_from_dl(d.dtype, expected, name);
  set_ndim(a, d.ndim, name);
  a.t.data = static_cast<char*>(d.data) + d.byte_offset;
  int64_t compact = 1;  // legacy producers may leave strides NULL: row-major
  for (int i = d.ndim - 1; i >= 0; --i) {
    a.t.shape[i] = d.shape[i];
    a.t.strides[i] = d.strides ? d.strides[i] : compact;
    compact *= d.shape[i];
  }
  // The producer's device is where the data lives: no pointer query in the library.
  a.t.flags = (read_only ? ATTNMERGE_READ_ONLY : 0u) | ATTNMERGE_DEVICE_KNOWN;
}

// The exchange API of a type, looked up once per type (nullptr where it has none).
const DLPackExchangeAPI* exchange_api(PyTypeObject* type) {
  static std::unordered_map<PyTypeObject*, const DLPackExchangeAPI*> cache;
  auto it = cache.find(type);
  if (it != cache.end()) return it->second;
  const DLPackExchangeAPI* api = nullptr;
  PyObject* cap = PyObject_GetAttrString(reinterpret_cast<PyObject*>(type), "__dlpack_c_exchange_api__");
  if (cap == nullptr) {
    PyErr_Clear();
  } else {
    if (PyCapsule_CheckExact(cap)) {
      api = static_cast<const DLPackExchangeAPI*>(PyCapsule_GetPointer(cap, PyCapsule_GetName(cap)));
      if (api == nullptr) PyErr_Clear();
    }
    Py_DECREF(cap);
    if (api && api->header.version.major != 1) api = nullptr;
  }
  cache.emplace(type, api);  // the exchange API lives as long as the process
  return api;
}

// ml_dtypes' bfloat16 and float8_e4m3fn have no typestr of their own ("V2", "V1"): the name of
// the array's dtype tells.
int named_dtype(py::handle obj) {
  PyObject* dtype = PyObject_GetAttrString(obj.ptr(), "dtype");
  if (dtype == nullptr) {
    PyErr_Clear();
    return -1;
  }
  return code_of_dtype(py::reinterpret_steal<py::object>(dtype));
}

// A numpy.ndarray or an instance of a subclass, told by type name (importing NumPy's C API to
// ask would load NumPy for callers that never use it).
bool is_numpy_array(py::handle obj) {
  for (const PyTypeObject* t = Py_TYPE(obj.ptr()); t != nullptr; t = t->tp_base)
    if (std::strcmp(t->tp_name, "numpy.ndarray") == 0) return true;
  return false;
}

// Dict-based interfaces (__cuda_array_interface__, __array_interface__): strides in bytes or None.
void from_interface(Arg& a, py::handle obj, const py::dict& iface, bool cuda, const char* expected, const char* name) {
  const std::string typestr = py::str(iface["typestr"]);
  if (!typestr.empty() && typestr[0] == '>') type_error(name, "expected native byte order, got big-endian " + typestr);
  const std::string kind = typestr.size() > 1 ? typestr.substr(1) : typestr;
  static const std::pair<const char*, int> kinds[] = {{"f4", ATTNMERGE_FLOAT32}, {"f2", ATTNMERGE_FLOAT16},
                                                      {"u1", ATTNMERGE_UINT8},   {"b1", ATTNMERGE_BOOL},
                                                      {"i4", ATTNMERGE_INT32},   {"i8", ATTNMERGE_INT64}};
  a.t.dtype = -1;
  for (const auto& k : kinds)
    if (kind == k.first) a.t.dtype = k.second;
  if (kind == "V2" || kind == "V1") a.t.dtype = named_dtype(obj);
  if (a.t.dtype < 0)
    type_error(name, std::string("expected dtype ") + expected + ", got " +
                         (py::hasattr(obj, "dtype") ? std::string(py::str(obj.attr("dtype"))) : kind));
  const int64_t itemsize = std::stoll(kind.substr(1));  // the typestr's byte count: "f4" -> 4
  const py::tuple data = iface["data"];
  a.t.data = reinterpret_cast<void*>(data[0].cast<uintptr_t>());
  a.t.flags = data[1].cast<bool>() ? ATTNMERGE_READ_ONLY : 0u;
  if (iface.contains("offset") && !iface["offset"].is_none())
    a.t.data = static_cast<char*>(a.t.data) + iface["offset"].cast<int64_t>() * itemsize;
  const py::tuple shape = iface["shape"];
  set_ndim(a, static_cast<int64_t>(shape.size()), name);
  const bool has_strides = iface.contains("strides") && !iface["strides"].is_none();
  int64_t compact = 1;
  for (int i = a.t.ndim - 1; i >= 0; --i) {
    a.t.shape[i] = shape[i].cast<int64_t>();
    if (has_strides) {
      const int64_t bytes = py::tuple(iface["strides"])[i].cast<int64_t>();
      if (bytes % itemsize != 0)
        value_error(name, "expected strides that are whole elements, got " + std::to_string(bytes) + " bytes on axis " +
                              std::to_string(i));
      a.t.strides[i] = bytes / itemsize;
    } else {
      a.t.strides[i] = compact;
    }
    compact *= a.t.shape[i];
  }
  if (cuda) {  // asked of CUDA once, here
    a.t.device = attnmerge_pointer_device(a.t.data);
    a.t.flags |= ATTNMERGE_DEVICE_KNOWN;
  } else {
    a.t.device = ATTNMERGE_HOST;
  }
}

// NumPy arrays are read from the array object itself, through NumPy's C API (which pybind11 loads
// at run time: no build dependency): ~0.1 us an array against ~0.7 for a __dlpack__ round trip
// and ~2.3 for __array_interface__ (which ml_dtypes' types would need, as NumPy will not export
// them through DLPack).
int numpy_dtype(const py::dtype& dt, const char* expected, const char* name) {
  const int code = code_of_dtype(dt);
  if (code >= 0) return code;
  if (dt.byteorder() == '>') type_error(name, "expected native byte order, got big-endian " + std::string(py::str(dt)));
  type_error(name, std::string("expected dtype ") + expected + ", got " + std::string(py::str(dt)));
}

void from_numpy(Arg& a, py::handle obj, const char* expected, const char* name) {
  const auto arr = py::reinterpret_borrow<py::array>(obj);
  const py::dtype dt = arr.dtype();
  a.t.dtype = numpy_dtype(dt, expected, name);
  set_ndim(a, arr.ndim(), name);
  const int64_t itemsize = static_cast<int64_t>(dt.itemsize());
  a.t.data = const_cast<void*>(arr.data());
  for (int i = 0; i < a.t.ndim; ++i) {
    a.t.shape[i] = static_cast<int64_t>(arr.shape(i));
    const int64_t bytes = static_cast<int64_t>(arr.strides(i));
    if (bytes % itemsize != 0)
      value_error(name, "expected strides that are whole elements, got " + std::to_string(bytes) + " bytes on axis " +
                            std::to_string(i));
    a.t.strides[i] = bytes / itemsize;
  }
  a.t.device = ATTNMERGE_HOST;
  a.t.flags = (arr.writeable() ? 0u : ATTNMERGE_READ_ONLY) | ATTNMERGE_DEVICE_KNOWN;
}

// DLPack's stream argument for a consumer stream handle: 1 is the legacy default stream.
py::object dlpack_stream_arg(void* stream) {
  return py::int_(stream == nullptr ? uintptr_t{1} : reinterpret_cast<uintptr_t>(stream));
}

// Describes `obj` (any supported array) in `a`; `stream` is the consumer stream for __dlpack__.
void describe(Arg& a, py::handle obj, void* stream, const char* expected, const char* name) {
  PyObject* o = obj.ptr();
  if (const DLPackExchangeAPI* api = exchange_api(Py_TYPE(o))) {
    a.api = api;
    const auto refused = [&] {  // a tensor its framework cannot export (a meta tensor, say)
      py::error_already_set e;
      const py::object is_meta = py::getattr(obj, "is_meta", py::none());
      if (is_meta.ptr() == Py_True)
        value_error(name, "expected a tensor with data, got a meta tensor (meta tensors are not supported outside "
                          "torch.compile tracing)");
      // The producer's first line: PyTorch appends its C++ backtrace to the message.
      std::string why = py::str(e.value());
      why = why.substr(0, why.find('\n'));
      value_error(name, std::string("expected a tensor with data, got one ") + type_name(obj) +
                            " cannot export through DLPack (" + why + ")");
    };
    if (api->dltensor_from_py_object_no_sync) {
      DLTensor d;
      if (api->dltensor_from_py_object_no_sync(o, &d) != 0) refused();
      return from_dltensor(a, d, false, expected, name);
    }
    if (api->managed_tensor_from_py_object_no_sync(o, &a.versioned) != 0) refused();
    return from_dltensor(a, a.versioned->dl_tensor, a.versioned->flags & kDLReadOnly, expected, name);
  }
  if (is_numpy_array(obj)) return from_numpy(a, obj, expected, name);
  if (py::hasattr(obj, "__dlpack__")) {
    const py::tuple dev = obj.attr("__dlpack_device__")();
    const bool cpu = dev[0].cast<int>() == kDLCPU;
    py::dict kwargs;
    if (!cpu) kwargs["stream"] = dlpack_stream_arg(stream);
    kwargs["max_version"] = py::make_tuple(1, 3);
    // Called through the C API: a refusal comes back as a set Python error, not a C++ exception
    // (tens of microseconds a call).
    const py::object method = obj.attr("__dlpack__");
    const py::tuple no_args;
    PyObject* raw = PyObject_Call(method.ptr(), no_args.ptr(), kwargs.ptr());
    if (raw == nullptr && PyErr_ExceptionMatches(PyExc_TypeError)) {  // a producer older than max_version
      PyErr_Clear();
      PyDict_DelItemString(kwargs.ptr(), "max_version");
      raw = PyObject_Call(method.ptr(), no_args.ptr(), kwargs.ptr());
    }
    if (raw == nullptr) {
      // A producer that cannot export this array may still offer an interface.
      if (!PyErr_ExceptionMatches(PyExc_BufferError) && !PyErr_ExceptionMatches(PyExc_TypeError))
        throw py::error_already_set();
      PyObject *type, *value, *trace;
      PyErr_Fetch(&type, &value, &trace);
      if (!py::hasattr(obj, "__cuda_array_interface__") && !py::hasattr(obj, "__array_interface__")) {
        PyErr_Restore(type, value, trace);
        throw py::error_already_set();
      }
      Py_XDECREF(type);
      Py_XDECREF(value);
      Py_XDECREF(trace);
    } else {
      const py::object cap = py::reinterpret_steal<py::object>(raw);
      PyObject* c = cap.ptr();
      if (PyCapsule_IsValid(c, "dltensor_versioned")) {
        a.versioned = static_cast<DLManagedTensorVersioned*>(PyCapsule_GetPointer(c, "dltensor_versioned"));
        PyCapsule_SetName(c, "used_dltensor_versioned");
        if (a.versioned->version.major != 1) value_error(name, "expected DLPack major version 1");
        return from_dltensor(a, a.versioned->dl_tensor, a.versioned->flags & kDLReadOnly, expected, name);
      }
      if (PyCapsule_IsValid(c, "dltensor")) {
        a.legacy = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(c, "dltensor"));
        PyCapsule_SetName(c, "used_dltensor");
        return from_dltensor(a, a.legacy->dl_tensor, false, expected, name);
      }
      value_error(name, "__dlpack__ returned no DLPack capsule");
    }
  }
  if (py::hasattr(obj, "__cuda_array_interface__"))
    return from_interface(a, obj, obj.attr("__cuda_array_interface__"), true, expected, name);
  if (py::hasattr(obj, "__array_interface__"))
    return from_interface(a, obj, obj.attr("__array_interface__"), false, expected, name);
  type_error(name, "expected an array (DLPack, __cuda_array_interface__ or NumPy), got " + type_name(obj));
}

// An explicit stream: an int handle, or an object with __cuda_stream__, .cuda_stream or .ptr.
void* stream_handle(py::handle s) {
  if (PyLong_Check(s.ptr())) return reinterpret_cast<void*>(s.cast<uintptr_t>());
  if (py::hasattr(s, "__cuda_stream__")) return reinterpret_cast<void*>(py::tuple(s.attr("__cuda_stream__")())[1].cast<uintptr_t>());
  if (py::hasattr(s, "cuda_stream")) return reinterpret_cast<void*>(s.attr("cuda_stream").cast<uintptr_t>());
  if (py::hasattr(s, "ptr")) return reinterpret_cast<void*>(s.attr("ptr").cast<uintptr_t>());
  type_error("stream", "expected None, an int handle or an object with .cuda_stream or .ptr, got " + type_name(s));
}

void check(attnmerge_status status) {
  switch (status) {
    case ATTNMERGE_SUCCESS: return;
    case ATTNMERGE_ERROR_TYPE: throw py::type_error(attnmerge_last_error());
    case ATTNMERGE_ERROR_VALUE: throw py::value_error(attnmerge_last_error());
    default: throw std::runtime_error(attnmerge_last_error());
  }
}

// What an argument may be, for messages about dtypes the library has no code for (kF32 is also
// output_scale's: the C ABI's const float*).
const char* const kO = dtype_names(ATTNMERGE_ROLE_O_IN);
const char* const kOut = dtype_names(ATTNMERGE_ROLE_O_OUT);
const char* const kF32 = dtype_names(ATTNMERGE_ROLE_LSE);
const char* const kMaskDtypes = dtype_names(ATTNMERGE_ROLE_MASK);
const char* const kIndexDtypes = dtype_names(ATTNMERGE_ROLE_INDPTR);

struct Param {
  py::handle obj;
  const char* name;
  const char* expected;
};

// The arguments of one call as descriptors, with the stream resolved: an explicit one as given;
// None as the current stream of a framework that offers one through the DLPack exchange API, else
// the legacy default stream.  A None argument stays a NULL descriptor (the C ABI names it).
template <int N>
struct Call {
  Arg args[N];
  const attnmerge_tensor* t[N] = {};
  void* stream = nullptr;

  // The first `outputs` params are described last: an output the Python layer allocated like an
  // input (a meta tensor's, say) must not take the blame for that input.
  Call(const Param (&params)[N], py::handle stream_obj, int outputs = 0) {
    const bool explicit_stream = !stream_obj.is_none();
    if (explicit_stream) stream = stream_handle(stream_obj);
    for (int k = 0; k < N; ++k) {
      const int i = (k + outputs) % N;
      if (params[i].obj.is_none()) continue;
      describe(args[i], params[i].obj, stream, params[i].expected, params[i].name);
      t[i] = &args[i].t;
    }
    if (explicit_stream) return;
    for (const Arg& a : args)
      if (a.api && a.t.device >= 0) {
        if (a.api->current_work_stream(kDLCUDA, a.t.device, &stream) != 0) throw py::error_already_set();
        return;
      }
  }
};

// output_scale: None, a number, or a one-element float32 array on the op's device (read by the
// kernel, so no host synchronization).  `holder` keeps the array's descriptor alive.
void set_output_scale(attnmerge_options& options, py::handle scale, Arg& holder, void* stream) {
  if (scale.is_none()) return;
  if (PyFloat_Check(scale.ptr()) || PyLong_Check(scale.ptr())) {
    // A scale, as given: the Python layer (attnmerge._merge.output_scale_arg) refuses 0, the C ABI's
    // "no scale", which Python spells None; the C ABI checks the rest.
    options.output_scale = scale.cast<float>();
    return;
  }
  describe(holder, scale, stream, kF32, "output_scale");
  int64_t n = 1;
  for (int i = 0; i < holder.t.ndim; ++i) n *= holder.t.shape[i];
  if (holder.t.dtype != ATTNMERGE_FLOAT32) type_error("output_scale", "expected a float32 array, got another dtype");
  if (n != 1)
    value_error("output_scale", "expected a number or a one-element float32 array, got " + std::to_string(n) + " elements");
  options.output_scale_ptr = static_cast<const float*>(holder.t.data);
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

// Swaps the first two axes of a descriptor: [S, tokens, ...] read as [tokens, S, ...].
void swap_leading_axes(Arg& a) {
  if (a.t.ndim < 2) return;
  std::swap(a.t.shape[0], a.t.shape[1]);
  std::swap(a.t.strides[0], a.t.strides[1]);
}

void merge(py::handle out, py::handle out_lse, py::handle o_a, py::handle lse_a, py::handle o_b, py::handle lse_b,
           uint32_t flags, int64_t a_tokens, py::handle output_scale, py::handle stream) {
  Call<6> c({{out, "out", kOut}, {out_lse, "out_lse", kF32}, {o_a, "o_a", kO}, {lse_a, "lse_a", kF32},
             {o_b, "o_b", kO}, {lse_b, "lse_b", kF32}},
            stream, 2);
  attnmerge_options options = {flags | (a_tokens >= 0 ? ATTNMERGE_A_TOKENS : 0u), a_tokens, 0.0f, nullptr};
  Arg scale;
  set_output_scale(options, output_scale, scale, c.stream);
  call_library([&] { return attnmerge_merge(c.t[0], c.t[1], c.t[2], c.t[3], c.t[4], c.t[5], &options, c.stream); });
}

void merge_inplace(py::handle o, py::handle lse, py::handle o_other, py::handle lse_other, py::handle mask,
                   uint32_t flags, py::handle stream) {
  Call<5> c({{o, "o", kO}, {lse, "lse", kF32}, {o_other, "o_other", kO}, {lse_other, "lse_other", kF32},
             {mask, "mask", kMaskDtypes}},
            stream);
  const attnmerge_options options = {flags, 0, 0.0f, nullptr};
  call_library([&] { return attnmerge_merge_inplace(c.t[0], c.t[1], c.t[2], c.t[3], c.t[4], &options, c.stream); });
}

void merge_states(py::handle out, py::handle out_lse, py::handle o, py::handle lse, uint32_t flags, bool states_first,
                  py::handle output_scale, py::handle stream) {
  Call<4> c({{out, "out", kOut}, {out_lse, "out_lse", kF32}, {o, "o", kO}, {lse, "lse", kF32}}, stream, 2);
  if (states_first) {  // an all-gather's [S, tokens, ...], read through its strides
    swap_leading_axes(c.args[2]);
    swap_leading_axes(c.args[3]);
  }
  attnmerge_options options = {flags, 0, 0.0f, nullptr};
  Arg scale;
  set_output_scale(options, output_scale, scale, c.stream);
  call_library([&] { return attnmerge_merge_states(c.t[0], c.t[1], c.t[2], c.t[3], &options, c.stream); });
}

void merge_varlen(py::handle out, py::handle out_lse, py::handle o, py::handle lse, py::handle indptr, uint32_t flags,
                  py::handle output_scale, py::handle stream) {
  Call<5> c({{out, "out", kOut}, {out_lse, "out_lse", kF32}, {o, "o", kO}, {lse, "lse", kF32},
             {indptr, "indptr", kIndexDtypes}},
            stream, 2);
  attnmerge_options options = {flags, 0, 0.0f, nullptr};
  Arg scale;
  set_output_scale(options, output_scale, scale, c.stream);
  call_library([&] { return attnmerge_merge_varlen(c.t[0], c.t[1], c.t[2], c.t[3], c.t[4], &options, c.stream); });
}

// A field of a raw descriptor that must be a Python int (pybind11's own cast error names no argument).
py::handle raw_int(py::handle v, const char* name, const char* field) {
  if (!PyLong_Check(v.ptr()) || PyBool_Check(v.ptr()))
    type_error(name, std::string("expected an int ") + field + ", got " + std::string(py::repr(v)) + " (" + type_name(v) + ")");
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
  Call<12> c({{grad_o_a, "grad_o_a", kO}, {grad_lse_a, "grad_lse_a", kF32}, {grad_o_b, "grad_o_b", kO},
              {grad_lse_b, "grad_lse_b", kF32}, {grad_out, "grad_out", kO}, {grad_out_lse, "grad_out_lse", kF32},
              {out, "out", kO}, {out_lse, "out_lse", kF32}, {o_a, "o_a", kO}, {lse_a, "lse_a", kF32},
              {o_b, "o_b", kO}, {lse_b, "lse_b", kF32}},
             stream);
  const attnmerge_options options = {flags | (a_tokens >= 0 ? ATTNMERGE_A_TOKENS : 0u), a_tokens, 0.0f, nullptr};
  call_library([&] {
    return attnmerge_merge_backward(c.t[0], c.t[1], c.t[2], c.t[3], c.t[4], c.t[5], c.t[6], c.t[7], c.t[8], c.t[9],
                                    c.t[10], c.t[11], &options, c.stream);
  });
}

void merge_states_backward(py::handle grad_o, py::handle grad_lse, py::handle grad_out, py::handle grad_out_lse,
                           py::handle out, py::handle out_lse, py::handle o, py::handle lse, uint32_t flags,
                           bool states_first, py::handle stream) {
  Call<8> c({{grad_o, "grad_o", kO}, {grad_lse, "grad_lse", kF32}, {grad_out, "grad_out", kO},
             {grad_out_lse, "grad_out_lse", kF32}, {out, "out", kO}, {out_lse, "out_lse", kF32}, {o, "o", kO},
             {lse, "lse", kF32}},
            stream);
  if (states_first)  // [S, tokens, ...] read through its strides, gradients likewise
    for (int i : {0, 1, 6, 7}) swap_leading_axes(c.args[i]);
  const attnmerge_options options = {flags, 0, 0.0f, nullptr};
  call_library([&] {
    return attnmerge_merge_states_backward(c.t[0], c.t[1], c.t[2], c.t[3], c.t[4], c.t[5], c.t[6], c.t[7], &options,
                                           c.stream);
  });
}

void merge_varlen_backward(py::handle grad_o, py::handle grad_lse, py::handle grad_out, py::handle grad_out_lse,
                           py::handle out, py::handle out_lse, py::handle o, py::handle lse, py::handle indptr,
                           uint32_t flags, py::handle stream) {
  Call<9> c({{grad_o, "grad_o", kO}, {grad_lse, "grad_lse", kF32}, {grad_out, "grad_out", kO},
             {grad_out_lse, "grad_out_lse", kF32}, {out, "out", kO}, {out_lse, "out_lse", kF32}, {o, "o", kO},
             {lse, "lse", kF32}, {indptr, "indptr", kIndexDtypes}},
            stream);
  const attnmerge_options options = {flags, 0, 0.0f, nullptr};
  call_library([&] {
    return attnmerge_merge_varlen_backward(c.t[0], c.t[1], c.t[2], c.t[3], c.t[4], c.t[5], c.t[6], c.t[7], c.t[8],
                                           &options, c.stream);
  });
}

// Raw layer: O as (ptr, dtype, stride_token, stride_head), LSE as (ptr, stride_0, stride_1) in the
// LSE's own layout, sizes given once.
void raw_tensor(Arg& a, py::handle desc, bool is_o, int64_t d0, int64_t d1, int64_t head_size, int device,
                bool device_known, const char* name) {
  if (!PyTuple_Check(desc.ptr()) || PyTuple_GET_SIZE(desc.ptr()) != (is_o ? 4 : 3))
    type_error(name, std::string("expected a tuple ") + (is_o ? "(ptr, dtype, stride_token, stride_head)" : "(ptr, stride_0, stride_1)") +
                         ", got " + std::string(py::repr(desc)));
  const py::tuple t = py::reinterpret_borrow<py::tuple>(desc);
  a.t.data = raw_pointer(t[0], name);
  a.t.device = device;
  a.t.flags = device_known ? ATTNMERGE_DEVICE_KNOWN : 0u;  // the caller vouches for `device`
  if (is_o && !PyUnicode_Check(t[1].ptr()))  // a name, not a framework's dtype object
    type_error(name, std::string("expected a dtype name, ") + kOut + ", got " + std::string(py::repr(t[1])) + " (" +
                         type_name(t[1]) + ")");
  a.t.dtype = is_o ? dtype_from_name(t[1].cast<std::string>(), name) : ATTNMERGE_FLOAT32;
  a.t.ndim = is_o ? 3 : 2;
  a.t.shape[0] = d0;
  a.t.shape[1] = d1;
  a.t.shape[2] = head_size;
  a.t.strides[0] = raw_int(t[is_o ? 2 : 1], name, is_o ? "stride_token" : "stride_0").cast<int64_t>();
  a.t.strides[1] = raw_int(t[is_o ? 3 : 2], name, is_o ? "stride_head" : "stride_1").cast<int64_t>();
  a.t.strides[2] = 1;
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
  Arg args[6];
  raw_tensor(args[0], out, true, tokens, heads, head_size, device, device_known, "out");
  if (!out_lse.is_none())
    raw_tensor(args[1], out_lse, false, heads_first ? heads : tokens, heads_first ? tokens : heads, 0, device,
               device_known, "out_lse");
  raw_tensor(args[2], o_a, true, a_rows, heads, head_size, device, device_known, "o_a");
  raw_tensor(args[3], lse_a, false, heads_first ? heads : a_rows, heads_first ? a_rows : heads, 0, device,
             device_known, "lse_a");
  raw_tensor(args[4], o_b, true, tokens, heads, head_size, device, device_known, "o_b");
  raw_tensor(args[5], lse_b, false, heads_first ? heads : tokens, heads_first ? tokens : heads, 0, device,
             device_known, "lse_b");
  const attnmerge_options options = {flags | (a_tokens >= 0 ? ATTNMERGE_A_TOKENS : 0u), a_tokens, 0.0f, nullptr};
  const attnmerge_tensor* lse_out = out_lse.is_none() ? nullptr : &args[1].t;
  call_library([&] {
    return attnmerge_merge(&args[0].t, lse_out, &args[2].t, &args[3].t, &args[4].t, &args[5].t, &options,
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
        py::arg("lse_b"), py::arg("flags"), py::arg("a_tokens"), py::arg("output_scale"), py::arg("stream"));
  m.def("merge_inplace", &merge_inplace, py::arg("o"), py::arg("lse"), py::arg("o_other"), py::arg("lse_other"),
        py::arg("mask"), py::arg("flags"), py::arg("stream"));
  m.def("merge_states", &merge_states, py::arg("out"), py::arg("out_lse"), py::arg("o"), py::arg("lse"),
        py::arg("flags"), py::arg("states_first"), py::arg("output_scale"), py::arg("stream"));
  m.def("merge_varlen", &merge_varlen, py::arg("out"), py::arg("out_lse"), py::arg("o"), py::arg("lse"),
        py::arg("indptr"), py::arg("flags"), py::arg("output_scale"), py::arg("stream"));
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
  m.def("stream_synchronize", [](int device, uintptr_t stream) {
    call_library([&] { return attnmerge_stream_synchronize(device, reinterpret_cast<void*>(stream)); });
  }, py::arg("device"), py::arg("stream"));
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
  m.def("version_string", &attnmerge_version_string);
  m.def("version", &attnmerge_version);
  m.def("cuda_architectures", &attnmerge_cuda_architectures);
  m.def("cuda_build_version", &attnmerge_cuda_build_version);
  m.def("cuda_driver_version", &attnmerge_cuda_driver_version);
  m.def("device_count", &attnmerge_device_count);
  m.def("library_path", &library_path);
  m.def("pointer_device", [](uintptr_t ptr) { return attnmerge_pointer_device(reinterpret_cast<void*>(ptr)); },
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
  m.attr("PDL") = ATTNMERGE_PDL;
}
