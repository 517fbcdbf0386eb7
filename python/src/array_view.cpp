// The array reader of attnmerge._C (array_view.h): five ways in, one attnmerge_tensor out, and the
// resolution of `stream=None`.
#include "array_view.h"

#include "third_party/dlpack/dlpack.h"

#include <pybind11/numpy.h>

#include <cstring>
#include <string>
#include <unordered_map>
#include <vector>

namespace attnmerge_py {

const char* ArgName::str() const { return names_ ? names_->of(name_) : name_; }

CallerNames::CallerNames(py::handle table) {
  if (table.is_none()) {
    entries_[count_++] = {"NULL", "None"};
    return;
  }
  if (!PyDict_Check(table.ptr())) type_error("names", "expected None or a dict, got " + type_name(table));
  const Py_ssize_t size = PyDict_Size(table.ptr());
  if (size > kMaxNames)
    value_error("names", "expected at most " + std::to_string(kMaxNames) + " entries, got " + std::to_string(size));
  PyObject *key, *value;
  for (Py_ssize_t pos = 0; PyDict_Next(table.ptr(), &pos, &key, &value); ++count_) {
    // The UTF-8 each str keeps itself: held below, it outlives any change to the caller's dict.
    const char* arg = PyUnicode_Check(key) ? PyUnicode_AsUTF8(key) : nullptr;
    const char* name = arg && PyUnicode_Check(value) ? PyUnicode_AsUTF8(value) : nullptr;
    if (name == nullptr) {
      PyErr_Clear();
      type_error("names", "expected a dict of str to str, got " + std::string(py::repr(key)) + ": " +
                              std::string(py::repr(value)));
    }
    held_[2 * count_] = py::reinterpret_borrow<py::object>(key);
    held_[2 * count_ + 1] = py::reinterpret_borrow<py::object>(value);
    entries_[count_] = {arg, name};
  }
  entries_[count_++] = {"NULL", "None"};
}

const char* CallerNames::of(const char* name) const {
  for (int i = 0; i < count_; ++i)
    if (std::strcmp(entries_[i].arg, name) == 0) return entries_[i].name;
  return name;
}

void CallerNames::pass_to(attnmerge_options& options) const {
  options.struct_size = sizeof(attnmerge_options);  // the layout that has arg_names
  options.arg_names = entries_;
  options.num_arg_names = count_;
}

void type_error(const ArgName& name, const std::string& what) {
  throw py::type_error(std::string(name.str()) + ": " + what);
}
void value_error(const ArgName& name, const std::string& what) {
  throw py::value_error(std::string(name.str()) + ": " + what);
}

std::string type_name(py::handle obj) { return py::str(py::type::handle_of(obj).attr("__qualname__")); }

int code_of_name(const std::string& s) {
  for (int32_t code = 0; const attnmerge_dtype_info* d = attnmerge_dtype_info_of(code); ++code)
    if (s == d->array_name) return code;
  return -1;
}

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

int dtype_from_name(const std::string& s, const ArgName& name) {
  for (int32_t code = 0; const attnmerge_dtype_info* d = attnmerge_dtype_info_of(code); ++code)
    if ((s == d->array_name || s == d->name) && (d->roles & ATTNMERGE_ROLE_O_OUT)) return code;
  type_error(name, std::string("expected dtype ") + dtype_names(ATTNMERGE_ROLE_O_OUT) + ", got " + s);
}

namespace {

// "int32", "float64", "bool", "float8_e4m3fn", ... as the frameworks spell a DLPack dtype, the
// names of the library's table among them.
std::string dl_dtype_name(DLDataType dt) {
  static const char* const kinds[] = {"int", "uint", "float", "opaque", "bfloat", "complex", "bool"};
  std::string s;
  if (dt.code == kDLFloat8_e4m3fn && dt.bits == 8) {
    s = "float8_e4m3fn";
  } else if (dt.code < 7) {
    s = std::string(kinds[dt.code]) + (dt.code == kDLBool ? "" : std::to_string(dt.bits));
  } else {
    s = "DLPack type code " + std::to_string(dt.code) + " of " + std::to_string(dt.bits);
  }
  if (dt.lanes != 1) s += "x" + std::to_string(dt.lanes);
  return s;
}

// The library's code for a DLPack dtype, found by name in the library's table (code_of_name) once
// per dtype; dtypes it has no code for fail here, naming what the argument expects (`expected`),
// and every other check is the C ABI's.  Under the GIL.
int dtype_from_dl(DLDataType dt, const char* expected, const ArgName& name) {
  static std::unordered_map<uint32_t, int> codes;
  const uint32_t key = uint32_t{dt.code} << 24 | uint32_t{dt.bits} << 16 | dt.lanes;
  auto it = codes.find(key);
  if (it == codes.end()) it = codes.emplace(key, code_of_name(dl_dtype_name(dt))).first;
  if (it->second >= 0) return it->second;
  type_error(name, std::string("expected dtype ") + expected + ", got " + dl_dtype_name(dt));
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

void set_ndim(attnmerge_tensor& t, int64_t ndim, const ArgName& name) {
  if (ndim > ATTNMERGE_MAX_NDIM)
    value_error(name,
                "expected at most " + std::to_string(ATTNMERGE_MAX_NDIM) + " dimensions, got " + std::to_string(ndim));
  t.ndim = static_cast<int32_t>(ndim);
}

void from_dltensor(attnmerge_tensor& t, const DLTensor& d, bool read_only, const char* expected, const ArgName& name) {
  switch (d.device.device_type) {
    case kDLCPU:
    case kDLCUDAHost: t.device = ATTNMERGE_HOST; break;
    case kDLCUDA:
    case kDLCUDAManaged: t.device = d.device.device_id; break;
    default:
      value_error(name, "expected a CPU or CUDA array, got DLPack device type " + std::to_string(d.device.device_type));
  }
  t.dtype = dtype_from_dl(d.dtype, expected, name);
  set_ndim(t, d.ndim, name);
  t.data = static_cast<char*>(d.data) + d.byte_offset;
  int64_t compact = 1;  // legacy producers may leave strides NULL: row-major
  for (int i = d.ndim - 1; i >= 0; --i) {
    t.shape[i] = d.shape[i];
    t.strides[i] = d.strides ? d.strides[i] : compact;
    compact *= d.shape[i];
  }
  // The producer's device is where the data lives: no pointer query in the library.
  t.flags = (read_only ? ATTNMERGE_READ_ONLY : 0u) | ATTNMERGE_DEVICE_KNOWN;
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
    if (api && api->header.version.major != DLPACK_MAJOR_VERSION) api = nullptr;
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

// The name of a typestr's kind ("f8": "float64", "b1": "bool"), as NumPy spells it.
std::string typestr_name(const std::string& kind) {
  if (kind == "b1") return "bool";
  static const std::pair<char, const char*> words[] = {{'f', "float"}, {'i', "int"}, {'u', "uint"}};
  const bool bytes = kind.size() >= 2 && kind.find_first_not_of("0123456789", 1) == std::string::npos;
  for (const auto& w : words)
    if (bytes && kind[0] == w.first) return w.second + std::to_string(8 * std::stoll(kind.substr(1)));
  return kind;
}

// Dict-based interfaces (__cuda_array_interface__, __array_interface__): strides in bytes or None.
void from_interface(attnmerge_tensor& t, py::handle obj, const py::dict& iface, bool cuda, const char* expected,
                    const ArgName& name) {
  const std::string typestr = py::str(iface["typestr"]);
  if (!typestr.empty() && typestr[0] == '>') type_error(name, "expected native byte order, got big-endian " + typestr);
  const std::string kind = typestr.size() > 1 ? typestr.substr(1) : typestr;
  t.dtype = kind == "V2" || kind == "V1" ? named_dtype(obj) : code_of_name(typestr_name(kind));
  if (t.dtype < 0)
    type_error(name, std::string("expected dtype ") + expected + ", got " +
                         (py::hasattr(obj, "dtype") ? std::string(py::str(obj.attr("dtype"))) : kind));
  const int64_t itemsize = std::stoll(kind.substr(1));  // the typestr's byte count: "f4" -> 4
  const py::tuple data = iface["data"];
  t.data = reinterpret_cast<void*>(data[0].cast<uintptr_t>());
  t.flags = data[1].cast<bool>() ? ATTNMERGE_READ_ONLY : 0u;
  if (iface.contains("offset") && !iface["offset"].is_none())
    t.data = static_cast<char*>(t.data) + iface["offset"].cast<int64_t>() * itemsize;
  const py::tuple shape = iface["shape"];
  set_ndim(t, static_cast<int64_t>(shape.size()), name);
  const bool has_strides = iface.contains("strides") && !iface["strides"].is_none();
  int64_t compact = 1;
  for (int i = t.ndim - 1; i >= 0; --i) {
    t.shape[i] = shape[i].cast<int64_t>();
    if (has_strides) {
      const int64_t bytes = py::tuple(iface["strides"])[i].cast<int64_t>();
      if (bytes % itemsize != 0)
        value_error(name, "expected strides that are whole elements, got " + std::to_string(bytes) + " bytes on axis " +
                              std::to_string(i));
      t.strides[i] = bytes / itemsize;
    } else {
      t.strides[i] = compact;
    }
    compact *= t.shape[i];
  }
  if (cuda) {  // asked of CUDA once, here
    t.device = attnmerge_pointer_device(t.data);
    t.flags |= ATTNMERGE_DEVICE_KNOWN;
  } else {
    t.device = ATTNMERGE_HOST;
  }
}

// NumPy arrays are read from the array object itself, through NumPy's C API (which pybind11 loads
// at run time: no build dependency), which costs less than a __dlpack__ round trip or
// __array_interface__ (which ml_dtypes' types would need, as NumPy will not export them through
// DLPack).
int numpy_dtype(const py::dtype& dt, const char* expected, const ArgName& name) {
  const int code = code_of_dtype(dt);
  if (code >= 0) return code;
  if (dt.byteorder() == '>') type_error(name, "expected native byte order, got big-endian " + std::string(py::str(dt)));
  type_error(name, std::string("expected dtype ") + expected + ", got " + std::string(py::str(dt)));
}

void from_numpy(attnmerge_tensor& t, py::handle obj, const char* expected, const ArgName& name) {
  const auto arr = py::reinterpret_borrow<py::array>(obj);
  const py::dtype dt = arr.dtype();
  t.dtype = numpy_dtype(dt, expected, name);
  set_ndim(t, arr.ndim(), name);
  const int64_t itemsize = static_cast<int64_t>(dt.itemsize());
  t.data = const_cast<void*>(arr.data());
  for (int i = 0; i < t.ndim; ++i) {
    t.shape[i] = static_cast<int64_t>(arr.shape(i));
    const int64_t bytes = static_cast<int64_t>(arr.strides(i));
    if (bytes % itemsize != 0)
      value_error(name, "expected strides that are whole elements, got " + std::to_string(bytes) + " bytes on axis " +
                            std::to_string(i));
    t.strides[i] = bytes / itemsize;
  }
  t.device = ATTNMERGE_HOST;
  t.flags = (arr.writeable() ? 0u : ATTNMERGE_READ_ONLY) | ATTNMERGE_DEVICE_KNOWN;
}

// The frameworks the reader treats apart: those whose current stream is asked of the framework
// itself (no exchange API), and JAX, whose arrays are immutable.
enum class Framework { kOther, kTorch, kCuPy, kNumba, kJax };

// The framework of a type, from the top-level package of its module, looked up once per type (at
// most 64 types, each held so that its address stays its own).  Under the GIL.
Framework framework_of(PyTypeObject* type) {
  static std::unordered_map<PyTypeObject*, Framework> cache;
  const auto it = cache.find(type);
  if (it != cache.end()) return it->second;
  Framework f = Framework::kOther;
  PyObject* module = PyObject_GetAttrString(reinterpret_cast<PyObject*>(type), "__module__");
  if (module == nullptr) {
    PyErr_Clear();
  } else {
    if (PyUnicode_Check(module)) {
      const char* m = PyUnicode_AsUTF8(module);
      const std::string top = m ? std::string(m).substr(0, std::string(m).find('.')) : std::string();
      if (top == "torch") f = Framework::kTorch;
      if (top == "cupy") f = Framework::kCuPy;
      if (top == "numba" || top == "numba_cuda") f = Framework::kNumba;
      if (top == "jax" || top == "jaxlib") f = Framework::kJax;
    }
    if (PyErr_Occurred()) PyErr_Clear();
    Py_DECREF(module);
  }
  if (cache.size() < 64) {
    cache.emplace(type, f);
    Py_INCREF(reinterpret_cast<PyObject*>(type));
  }
  return f;
}

// JAX arrays are immutable, though JAX exports them with no read-only flag: read-only for the C
// ABI, which then refuses them as outputs.
void mark_immutable(attnmerge_tensor& t, py::handle obj) {
  if (framework_of(Py_TYPE(obj.ptr())) == Framework::kJax) t.flags |= ATTNMERGE_READ_ONLY;
}

// The Python error that `obj`'s framework raised while it was read through `how` ("__dlpack__",
// "__cuda_array_interface__", ...), raised again naming the argument: a ValueError (a TypeError
// for a TypeError) with the framework's first line (PyTorch appends its C++ backtrace), the
// original chained as its cause.
[[noreturn]] void framework_refused(const ArgName& name, py::handle obj, const char* how) {
  py::error_already_set e;
  std::string why = py::str(e.value());
  why = why.substr(0, why.find('\n'));
  const std::string text = std::string(name.str()) + ": expected an array readable through " + how + ", got a " +
                           type_name(obj) + " for which " + how + " raised " +
                           std::string(py::str(e.type().attr("__name__"))) + (why.empty() ? "" : ": " + why);
  py::raise_from(e, e.matches(PyExc_TypeError) ? PyExc_TypeError : PyExc_ValueError, text.c_str());
  throw py::error_already_set();
}

// The same for an exception of pybind11's (a cast of the interface's entries that failed).
[[noreturn]] void interface_unreadable(const ArgName& name, py::handle obj, const char* how, const char* why) {
  value_error(name, std::string("expected an array readable through ") + how + ", got a " + type_name(obj) +
                        " whose " + how + " holds what it cannot (" + why + ")");
}

// DLPack's stream argument for a consumer stream handle: 1 is the legacy default stream.
py::object dlpack_stream_arg(void* stream) {
  return py::int_(stream == nullptr ? uintptr_t{1} : reinterpret_cast<uintptr_t>(stream));
}

}  // namespace

ArrayView::~ArrayView() {
  if (versioned_ && versioned_->deleter) versioned_->deleter(versioned_);
  if (legacy_ && legacy_->deleter) legacy_->deleter(legacy_);
}

void ArrayView::move_axis(int from, int to) {
  if (from < 0 || to < 0 || from >= t.ndim || to >= t.ndim) return;
  const int step = from < to ? 1 : -1;
  for (int i = from; i != to; i += step) {
    std::swap(t.shape[i], t.shape[i + step]);
    std::swap(t.strides[i], t.strides[i + step]);
  }
}

void ArrayView::read(py::handle obj, void* consumer_stream, const ArgName& name, const char* expected) {
  stream = consumer_stream;
  PyObject* o = obj.ptr();
  if (const DLPackExchangeAPI* api = exchange_api(Py_TYPE(o))) {
    api_ = api;
    const auto refused = [&] {  // a tensor its framework cannot export (a meta tensor, say)
      PyObject *type, *value, *trace;
      PyErr_Fetch(&type, &value, &trace);  // kept aside while is_meta is asked
      const py::object is_meta = py::getattr(obj, "is_meta", py::none());
      if (is_meta.ptr() == Py_True) {
        Py_XDECREF(type), Py_XDECREF(value), Py_XDECREF(trace);
        value_error(name,
                    "expected a tensor with data, got a meta tensor (meta tensors are not supported outside "
                    "torch.compile tracing)");
      }
      PyErr_Restore(type, value, trace);
      framework_refused(name, obj, "DLPack");
    };
    if (api->dltensor_from_py_object_no_sync) {
      DLTensor d;
      if (api->dltensor_from_py_object_no_sync(o, &d) != 0) refused();
      return from_dltensor(t, d, false, expected, name);
    }
    if (api->managed_tensor_from_py_object_no_sync(o, &versioned_) != 0) refused();
    return from_dltensor(t, versioned_->dl_tensor, versioned_->flags & DLPACK_FLAG_BITMASK_READ_ONLY, expected, name);
  }
  if (is_numpy_array(obj)) return from_numpy(t, obj, expected, name);
  if (py::hasattr(obj, "__dlpack__")) {
    bool cpu = false;
    try {
      const py::tuple dev = obj.attr("__dlpack_device__")();
      cpu = dev[0].cast<int>() == kDLCPU;
    } catch (py::error_already_set& e) {
      e.restore();
      framework_refused(name, obj, "__dlpack_device__");
    } catch (const py::cast_error& e) {
      interface_unreadable(name, obj, "__dlpack_device__", e.what());
    }
    py::dict kwargs;
    if (!cpu) kwargs["stream"] = dlpack_stream_arg(stream);
    kwargs["max_version"] = py::make_tuple(1, 3);
    // Called through the C API: a refusal comes back as a set Python error, not a C++ exception
    // (which would cost far more per call).
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
        framework_refused(name, obj, "__dlpack__");
      PyObject *type, *value, *trace;
      PyErr_Fetch(&type, &value, &trace);
      if (!py::hasattr(obj, "__cuda_array_interface__") && !py::hasattr(obj, "__array_interface__")) {
        PyErr_Restore(type, value, trace);
        framework_refused(name, obj, "__dlpack__");
      }
      Py_XDECREF(type);
      Py_XDECREF(value);
      Py_XDECREF(trace);
    } else {
      const py::object cap = py::reinterpret_steal<py::object>(raw);
      PyObject* c = cap.ptr();
      if (PyCapsule_IsValid(c, "dltensor_versioned")) {
        versioned_ = static_cast<DLManagedTensorVersioned*>(PyCapsule_GetPointer(c, "dltensor_versioned"));
        PyCapsule_SetName(c, "used_dltensor_versioned");
        if (versioned_->version.major != DLPACK_MAJOR_VERSION)
          value_error(name, "expected DLPack major version " + std::to_string(DLPACK_MAJOR_VERSION));
        from_dltensor(t, versioned_->dl_tensor, versioned_->flags & DLPACK_FLAG_BITMASK_READ_ONLY, expected, name);
        return mark_immutable(t, obj);
      }
      if (PyCapsule_IsValid(c, "dltensor")) {
        legacy_ = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(c, "dltensor"));
        PyCapsule_SetName(c, "used_dltensor");
        from_dltensor(t, legacy_->dl_tensor, false, expected, name);
        return mark_immutable(t, obj);
      }
      value_error(name, "__dlpack__ returned no DLPack capsule");
    }
  }
  const bool cuda = py::hasattr(obj, "__cuda_array_interface__");
  if (cuda || py::hasattr(obj, "__array_interface__")) {
    const char* const how = cuda ? "__cuda_array_interface__" : "__array_interface__";
    try {
      from_interface(t, obj, obj.attr(how), cuda, expected, name);
    } catch (py::error_already_set& e) {
      e.restore();
      framework_refused(name, obj, how);
    } catch (const py::cast_error& e) {
      interface_unreadable(name, obj, how, e.what());
    }
    return mark_immutable(t, obj);
  }
  type_error(name, "expected an array (DLPack, __cuda_array_interface__ or NumPy), got " + type_name(obj));
}

// ---- streams ----------------------------------------------------------------------------------

namespace {

// An explicit stream: an int handle, or an object with __cuda_stream__, .cuda_stream or .ptr.
void* stream_handle(py::handle s) {
  if (PyLong_Check(s.ptr())) return reinterpret_cast<void*>(s.cast<uintptr_t>());
  if (py::hasattr(s, "__cuda_stream__"))
    return reinterpret_cast<void*>(py::tuple(s.attr("__cuda_stream__")())[1].cast<uintptr_t>());
  if (py::hasattr(s, "cuda_stream")) return reinterpret_cast<void*>(s.attr("cuda_stream").cast<uintptr_t>());
  if (py::hasattr(s, "ptr")) return reinterpret_cast<void*>(s.attr("ptr").cast<uintptr_t>());
  type_error("stream", "expected None, an int handle or an object with .cuda_stream or .ptr, got " + type_name(s));
}

// A function of a framework's module: the one in sys.modules (the framework of an array at hand is
// imported), not kept, so that it is always the module's current attribute.
py::object module_attr(const char* module, const char* attr) {
  PyObject* m = PyImport_GetModule(py::str(module).ptr());
  if (m == nullptr) {
    if (PyErr_Occurred()) throw py::error_already_set();
    return py::module_::import(module).attr(attr);
  }
  return py::reinterpret_steal<py::object>(m).attr(attr);
}

// The current stream `like`'s framework would use, asked of the framework itself.
void* framework_stream(py::handle like) {
  switch (framework_of(Py_TYPE(like.ptr()))) {
    case Framework::kTorch:
      if (!py::bool_(like.attr("is_cuda"))) return nullptr;
      return stream_handle(module_attr("torch.cuda", "current_stream")(like.attr("device")));
    case Framework::kCuPy: return stream_handle(module_attr("cupy.cuda", "get_current_stream")());
    case Framework::kNumba: {
      // __cuda_array_interface__ v3: the stream the producer works on (1: legacy default, 2: per-thread).
      const py::object s = like.attr("__cuda_array_interface__").attr("get")("stream");
      if (s.is_none() || s.equal(py::int_(1))) return nullptr;
      return stream_handle(s);
    }
    default: return nullptr;
  }
}

}  // namespace

StreamRequest::StreamRequest(py::handle stream, py::handle like) {
  if (!stream.is_none()) {
    handle_ = stream_handle(stream);
  } else if (!like.is_none()) {
    ask_exchange_api_ = exchange_api(Py_TYPE(like.ptr())) != nullptr;
    if (!ask_exchange_api_) handle_ = framework_stream(like);
  }
}

void* StreamRequest::resolve(const ArrayView& like) const {
  if (!ask_exchange_api_ || like.api_ == nullptr || like.t.device < 0) return handle_;
  void* stream = nullptr;
  if (like.api_->current_work_stream(kDLCUDA, like.t.device, &stream) != 0) throw py::error_already_set();
  return stream;
}

}  // namespace attnmerge_py
