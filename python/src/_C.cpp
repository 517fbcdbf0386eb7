// attnmerge._C: turns Python arrays of any framework into attnmerge_tensor descriptors and C ABI
// status codes into exceptions.  It checks nothing the C ABI checks; it only fails where an object
// cannot be described at all (not an array, an unsupported dtype or device, too many dimensions).
#include <dlfcn.h>
#include <pybind11/pybind11.h>

#include <cstring>
#include <string>
#include <unordered_map>

#include "attnmerge/attnmerge.h"

namespace py = pybind11;

namespace {

// ---- DLPack, as the DLPack specification lays it out (ABI v1) -------------------------------
enum DLDeviceType : int32_t { kDLCPU = 1, kDLCUDA = 2, kDLCUDAHost = 3, kDLCUDAManaged = 13 };
enum DLTypeCode : uint8_t { kDLFloat = 2, kDLBfloat = 4 };
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

int dtype_from_dl(DLDataType dt, bool lse, const char* name) {
  if (lse) {
    if (dt.code == kDLFloat && dt.bits == 32 && dt.lanes == 1) return ATTNMERGE_FLOAT32;
    type_error(name, "expected dtype float32, got " + dl_dtype_name(dt));
  }
  if (dt.lanes == 1) {
    if (dt.code == kDLFloat && dt.bits == 32) return ATTNMERGE_FLOAT32;
    if (dt.code == kDLFloat && dt.bits == 16) return ATTNMERGE_FLOAT16;
    if (dt.code == kDLBfloat && dt.bits == 16) return ATTNMERGE_BFLOAT16;
  }
  type_error(name, "expected dtype float32, float16 or bfloat16, got " + dl_dtype_name(dt));
}

int dtype_from_name(const std::string& s, const char* name) {
  if (s == "float32") return ATTNMERGE_FLOAT32;
  if (s == "float16") return ATTNMERGE_FLOAT16;
  if (s == "bfloat16") return ATTNMERGE_BFLOAT16;
  type_error(name, "expected dtype float32, float16 or bfloat16, got " + s);
}

void set_ndim(Arg& a, int64_t ndim, const char* name) {
  if (ndim > ATTNMERGE_MAX_NDIM)
    value_error(name, "expected at most " + std::to_string(ATTNMERGE_MAX_NDIM) + " dimensions, got " + std::to_string(ndim));
  a.t.ndim = static_cast<int32_t>(ndim);
}

void from_dltensor(Arg& a, const DLTensor& d, bool read_only, bool lse, const char* name) {
  switch (d.device.device_type) {
    case kDLCPU:
    case kDLCUDAHost: a.t.device = ATTNMERGE_HOST; break;
    case kDLCUDA:
    case kDLCUDAManaged: a.t.device = d.device.device_id; break;
    default: value_error(name, "expected a CPU or CUDA array, got DLPack device type " + std::to_string(d.device.device_type));
  }
  a.t.dtype = dtype_from_dl(d.dtype, lse, name);
  set_ndim(a, d.ndim, name);
  a.t.data = static_cast<char*>(d.data) + d.byte_offset;
  int64_t compact = 1;  // legacy producers may leave strides NULL: row-major
  for (int i = d.ndim - 1; i >= 0; --i) {
    a.t.shape[i] = d.shape[i];
    a.t.strides[i] = d.strides ? d.strides[i] : compact;
    compact *= d.shape[i];
  }
  a.t.flags = read_only ? ATTNMERGE_READ_ONLY : 0u;
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

// Dict-based interfaces (__cuda_array_interface__, __array_interface__): strides in bytes or None.
void from_interface(Arg& a, py::handle obj, const py::dict& iface, bool cuda, bool lse, const char* name) {
  const std::string typestr = py::str(iface["typestr"]);
  const std::string kind = typestr.size() > 1 ? typestr.substr(1) : typestr;
  if (kind == "f4") a.t.dtype = ATTNMERGE_FLOAT32;
  else if (kind == "f2") a.t.dtype = ATTNMERGE_FLOAT16;
  else if (kind == "V2" && py::hasattr(obj, "dtype") && std::string(py::str(obj.attr("dtype"))) == "bfloat16")
    a.t.dtype = ATTNMERGE_BFLOAT16;  // ml_dtypes' bfloat16 has no typestr of its own
  else
    type_error(name, std::string(lse ? "expected dtype float32" : "expected dtype float32, float16 or bfloat16") + ", got " +
                         std::string(py::str(py::hasattr(obj, "dtype") ? py::object(obj.attr("dtype")) : py::object(iface["typestr"]))));
  const py::tuple data = iface["data"];
  a.t.data = reinterpret_cast<void*>(data[0].cast<uintptr_t>());
  a.t.flags = data[1].cast<bool>() ? ATTNMERGE_READ_ONLY : 0u;
  if (iface.contains("offset") && !iface["offset"].is_none())
    a.t.data = static_cast<char*>(a.t.data) + iface["offset"].cast<int64_t>() * (a.t.dtype == ATTNMERGE_FLOAT32 ? 4 : 2);
  const py::tuple shape = iface["shape"];
  set_ndim(a, static_cast<int64_t>(shape.size()), name);
  const int64_t itemsize = a.t.dtype == ATTNMERGE_FLOAT32 ? 4 : 2;
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
  if (lse && a.t.dtype != ATTNMERGE_FLOAT32) type_error(name, "expected dtype float32, got " + kind);
  a.t.device = cuda ? attnmerge_pointer_device(a.t.data) : ATTNMERGE_HOST;
}

// DLPack's stream argument for a consumer stream handle: 1 is the legacy default stream.
py::object dlpack_stream_arg(void* stream) {
  return py::int_(stream == nullptr ? uintptr_t{1} : reinterpret_cast<uintptr_t>(stream));
}

// Describes `obj` (any supported array) in `a`; `stream` is the consumer stream for __dlpack__.
void describe(Arg& a, py::handle obj, void* stream, bool lse, const char* name) {
  PyObject* o = obj.ptr();
  if (const DLPackExchangeAPI* api = exchange_api(Py_TYPE(o))) {
    a.api = api;
    if (api->dltensor_from_py_object_no_sync) {
      DLTensor d;
      if (api->dltensor_from_py_object_no_sync(o, &d) != 0) throw py::error_already_set();
      return from_dltensor(a, d, false, lse, name);
    }
    if (api->managed_tensor_from_py_object_no_sync(o, &a.versioned) != 0) throw py::error_already_set();
    return from_dltensor(a, a.versioned->dl_tensor, a.versioned->flags & kDLReadOnly, lse, name);
  }
  if (py::hasattr(obj, "__dlpack__")) {
    try {
      const py::tuple dev = obj.attr("__dlpack_device__")();
      const bool cpu = dev[0].cast<int>() == kDLCPU;
      py::object cap;
      try {
        cap = cpu ? obj.attr("__dlpack__")(py::arg("max_version") = py::make_tuple(1, 3))
                  : obj.attr("__dlpack__")(py::arg("stream") = dlpack_stream_arg(stream),
                                           py::arg("max_version") = py::make_tuple(1, 3));
      } catch (py::error_already_set& e) {
        if (!e.matches(PyExc_TypeError)) throw;  // a producer older than max_version
        cap = cpu ? obj.attr("__dlpack__")() : obj.attr("__dlpack__")(py::arg("stream") = dlpack_stream_arg(stream));
      }
      PyObject* c = cap.ptr();
      if (PyCapsule_IsValid(c, "dltensor_versioned")) {
        a.versioned = static_cast<DLManagedTensorVersioned*>(PyCapsule_GetPointer(c, "dltensor_versioned"));
        PyCapsule_SetName(c, "used_dltensor_versioned");
        if (a.versioned->version.major != 1) value_error(name, "expected DLPack major version 1");
        return from_dltensor(a, a.versioned->dl_tensor, a.versioned->flags & kDLReadOnly, lse, name);
      }
      if (PyCapsule_IsValid(c, "dltensor")) {
        a.legacy = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(c, "dltensor"));
        PyCapsule_SetName(c, "used_dltensor");
        return from_dltensor(a, a.legacy->dl_tensor, false, lse, name);
      }
      value_error(name, "__dlpack__ returned no DLPack capsule");
    } catch (py::error_already_set& e) {
      // A producer that cannot export this array (NumPy's bfloat16, say) may still offer an interface.
      if (!e.matches(PyExc_BufferError) && !e.matches(PyExc_TypeError)) throw;
      if (!py::hasattr(obj, "__cuda_array_interface__") && !py::hasattr(obj, "__array_interface__")) throw;
      a.versioned = nullptr;
      a.legacy = nullptr;
    }
  }
  if (py::hasattr(obj, "__cuda_array_interface__"))
    return from_interface(a, obj, obj.attr("__cuda_array_interface__"), true, lse, name);
  if (py::hasattr(obj, "__array_interface__"))
    return from_interface(a, obj, obj.attr("__array_interface__"), false, lse, name);
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

// Builds the descriptors of the merge's arguments; resolves stream None to the current stream of
// a framework that offers one through the exchange API, else the legacy default stream.
py::object merge(py::handle out, py::handle out_lse, py::handle o_a, py::handle lse_a, py::handle o_b,
                 py::handle lse_b, uint32_t flags, int64_t a_tokens, py::handle stream) {
  const bool explicit_stream = !stream.is_none();
  void* s = explicit_stream ? stream_handle(stream) : nullptr;
  Arg args[6];
  const py::handle objs[6] = {out, out_lse, o_a, lse_a, o_b, lse_b};
  const char* names[6] = {"out", "out_lse", "o_a", "lse_a", "o_b", "lse_b"};
  const attnmerge_tensor* t[6] = {};  // None stays NULL: the C ABI names what is missing
  for (int i = 0; i < 6; ++i) {
    if (objs[i].is_none()) continue;
    describe(args[i], objs[i], s, i % 2 == 1, names[i]);
    t[i] = &args[i].t;
  }
  if (!explicit_stream) {
    for (const Arg& a : args) {
      if (a.api && a.t.device >= 0) {
        if (a.api->current_work_stream(kDLCUDA, a.t.device, &s) != 0) throw py::error_already_set();
        break;
      }
    }
  }
  const attnmerge_options options = {flags, a_tokens};
  attnmerge_status status;
  {
    py::gil_scoped_release release;
    status = attnmerge_merge(t[0], t[1], t[2], t[3], t[4], t[5], &options, s);
  }
  check(status);
  return py::none();
}

// Raw layer: O as (ptr, dtype, stride_token, stride_head), LSE as (ptr, stride_0, stride_1) in the
// LSE's own layout, sizes given once.
void raw_tensor(Arg& a, py::handle desc, bool is_o, int64_t d0, int64_t d1, int64_t head_size, int device,
                const char* name) {
  if (!PyTuple_Check(desc.ptr()) || PyTuple_GET_SIZE(desc.ptr()) != (is_o ? 4 : 3))
    type_error(name, std::string("expected a tuple ") + (is_o ? "(ptr, dtype, stride_token, stride_head)" : "(ptr, stride_0, stride_1)") +
                         ", got " + std::string(py::repr(desc)));
  const py::tuple t = py::reinterpret_borrow<py::tuple>(desc);
  a.t.data = reinterpret_cast<void*>(t[0].cast<uintptr_t>());
  a.t.device = device;
  a.t.dtype = is_o ? dtype_from_name(t[1].cast<std::string>(), name) : ATTNMERGE_FLOAT32;
  a.t.ndim = is_o ? 3 : 2;
  a.t.shape[0] = d0;
  a.t.shape[1] = d1;
  a.t.shape[2] = head_size;
  a.t.strides[0] = t[is_o ? 2 : 1].cast<int64_t>();
  a.t.strides[1] = t[is_o ? 3 : 2].cast<int64_t>();
  a.t.strides[2] = 1;
}

void merge_raw(int64_t tokens, int64_t heads, int64_t head_size, py::handle out, py::handle out_lse, py::handle o_a,
               py::handle lse_a, py::handle o_b, py::handle lse_b, uint32_t flags, int64_t a_tokens, int device,
               uintptr_t stream) {
  const int64_t sizes[3] = {tokens, heads, head_size};
  const char* size_names[3] = {"tokens", "heads", "head_size"};
  for (int i = 0; i < 3; ++i)  // no shape can be built from a negative size
    if (sizes[i] < 0) value_error(size_names[i], "expected a size >= 0, got " + std::to_string(sizes[i]));
  const bool heads_first = flags & ATTNMERGE_LSE_HEADS_FIRST;
  const int64_t a_rows = a_tokens < 0 ? tokens : std::min(a_tokens, tokens);
  Arg args[6];
  raw_tensor(args[0], out, true, tokens, heads, head_size, device, "out");
  if (!out_lse.is_none())
    raw_tensor(args[1], out_lse, false, heads_first ? heads : tokens, heads_first ? tokens : heads, 0, device, "out_lse");
  raw_tensor(args[2], o_a, true, a_rows, heads, head_size, device, "o_a");
  raw_tensor(args[3], lse_a, false, heads_first ? heads : a_rows, heads_first ? a_rows : heads, 0, device, "lse_a");
  raw_tensor(args[4], o_b, true, tokens, heads, head_size, device, "o_b");
  raw_tensor(args[5], lse_b, false, heads_first ? heads : tokens, heads_first ? tokens : heads, 0, device, "lse_b");
  const attnmerge_options options = {flags, a_tokens};
  attnmerge_status status;
  {
    py::gil_scoped_release release;
    status = attnmerge_merge(&args[0].t, out_lse.is_none() ? nullptr : &args[1].t, &args[2].t, &args[3].t, &args[4].t,
                             &args[5].t, &options, reinterpret_cast<void*>(stream));
  }
  check(status);
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
        py::arg("lse_b"), py::arg("flags"), py::arg("a_tokens"), py::arg("stream"));
  m.def("merge_raw", &merge_raw, py::arg("tokens"), py::arg("heads"), py::arg("head_size"), py::arg("out"),
        py::arg("out_lse"), py::arg("o_a"), py::arg("lse_a"), py::arg("o_b"), py::arg("lse_b"), py::arg("flags"),
        py::arg("a_tokens"), py::arg("device"), py::arg("stream"));
  m.def("stream_synchronize", [](int device, uintptr_t stream) {
    attnmerge_status status;
    {
      py::gil_scoped_release release;
      status = attnmerge_stream_synchronize(device, reinterpret_cast<void*>(stream));
    }
    check(status);
  });
  m.def("version_string", &attnmerge_version_string);
  m.def("version", &attnmerge_version);
  m.def("cuda_architectures", &attnmerge_cuda_architectures);
  m.def("cuda_build_version", &attnmerge_cuda_build_version);
  m.def("cuda_driver_version", &attnmerge_cuda_driver_version);
  m.def("device_count", &attnmerge_device_count);
  m.def("library_path", &library_path);
  m.def("pointer_device", [](uintptr_t ptr) { return attnmerge_pointer_device(reinterpret_cast<void*>(ptr)); });
  m.attr("LSE_BASE2") = ATTNMERGE_LSE_BASE2;
  m.attr("LSE_HEADS_FIRST") = ATTNMERGE_LSE_HEADS_FIRST;
}
