// attnmerge._C.flag_reader (flag_reader.h).
#include "flag_reader.h"

#include <descrobject.h>

namespace attnmerge_py {

namespace {

constexpr const char* kCapsule = "attnmerge.flag_reader";

// What one reader holds: the gate, the type whose instances take the getter, the getter, the
// name for everything else, and the tracing question or null (the objects owned).
struct Reader {
  PyObject* gate;
  PyObject* type;
  PyObject* name;
  getter get;
  void* closure;
  PyObject* tracing;
};

void release(PyObject* capsule) {
  auto* r = static_cast<Reader*>(PyCapsule_GetPointer(capsule, kCapsule));
  Py_DECREF(r->gate);
  Py_DECREF(r->type);
  Py_DECREF(r->name);
  Py_XDECREF(r->tracing);
  delete r;
}

// 1 when f() returned True, 0 for anything else, -1 an error raised.
int asks_true(PyObject* f) {
  PyObject* v = PyObject_CallNoArgs(f);
  if (v == nullptr) return -1;
  const int yes = v == Py_True;
  Py_DECREF(v);
  return yes;
}

// 1 set, 0 not, -1 an error raised (an AttributeError is "not set", as getattr's default).  `obj`
// is an instance of the type or of a subclass, which may define the attribute its own way.
int is_set(const Reader& r, PyObject* obj) {
  PyObject* value;
  if (reinterpret_cast<PyObject*>(Py_TYPE(obj)) == r.type) {
    value = r.get(obj, r.closure);
  } else {
    value = PyObject_GetAttr(obj, r.name);
    if (value == nullptr && PyErr_ExceptionMatches(PyExc_AttributeError)) {
      PyErr_Clear();
      return 0;
    }
  }
  if (value == nullptr) return -1;
  const int set = value == Py_True;
  Py_DECREF(value);
  return set;
}

PyObject* any_set(PyObject* capsule, PyObject* const* args, Py_ssize_t n) {
  const auto* r = static_cast<const Reader*>(PyCapsule_GetPointer(capsule, kCapsule));
  auto* const type = reinterpret_cast<PyTypeObject*>(r->type);
  // An eager call of torch tensors: its first two arrays exactly the type's, nothing else to learn.
  // Otherwise which objects are the type's: no other has the flag, so none is read (a getattr
  // raising AttributeError costs a microsecond: a NumPy call, torch imported, paid it per array).
  if (n < 2 || Py_TYPE(args[0]) != type || Py_TYPE(args[1]) != type) {
    bool instances = false, subclassed = false;
    for (Py_ssize_t i = 0; i < n; ++i) {
      if (Py_TYPE(args[i]) == type) {
        instances = true;
      } else if (args[i] != Py_None && PyObject_TypeCheck(args[i], type)) {
        instances = subclassed = true;
      }
    }
    if (!instances) Py_RETURN_NONE;
    if (r->tracing != nullptr && subclassed) {
      const int tracing = asks_true(r->tracing);
      if (tracing < 0) return nullptr;
      if (tracing) Py_RETURN_TRUE;
    }
  }
  const int open = asks_true(r->gate);
  if (open < 0) return nullptr;
  if (!open) Py_RETURN_FALSE;
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (args[i] == Py_None || !PyObject_TypeCheck(args[i], type)) continue;
    const int set = is_set(*r, args[i]);
    if (set < 0) return nullptr;
    if (set) Py_RETURN_TRUE;
  }
  Py_RETURN_FALSE;
}

PyMethodDef any_set_def = {"flag_reader", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(any_set)),
                           METH_FASTCALL,
                           "reader(*objects) -> bool | None: whether some object has the flag set (None: no "
                           "object is the type's)"};

}  // namespace

py::object flag_reader(py::handle type, py::str name, py::handle gate, py::handle tracing) {
  if (!PyType_Check(type.ptr())) throw py::type_error("flag_reader: type: expected a type, got " +
                                                      std::string(py::str(py::type::handle_of(type))));
  const py::object descriptor = type.attr(name);  // a getset descriptor, got from its class, is itself
  if (Py_TYPE(descriptor.ptr()) != &PyGetSetDescr_Type)
    throw py::type_error("flag_reader: expected " + std::string(py::str(type)) + "." + std::string(name) +
                         " to be a getset descriptor, got " + std::string(py::str(py::type::handle_of(descriptor))));
  const PyGetSetDef* def = reinterpret_cast<PyGetSetDescrObject*>(descriptor.ptr())->d_getset;
  if (def->get == nullptr) throw py::type_error("flag_reader: " + std::string(name) + " has no getter");
  if (!PyCallable_Check(gate.ptr()))
    throw py::type_error("flag_reader: gate: expected a callable, got " + std::string(py::str(py::type::handle_of(gate))));
  if (!tracing.is_none() && !PyCallable_Check(tracing.ptr()))
    throw py::type_error("flag_reader: tracing: expected None or a callable, got " +
                         std::string(py::str(py::type::handle_of(tracing))));
  auto* r = new Reader{gate.inc_ref().ptr(), type.inc_ref().ptr(), name.inc_ref().ptr(), def->get, def->closure,
                       tracing.is_none() ? nullptr : tracing.inc_ref().ptr()};
  const py::capsule holder(r, kCapsule, release);
  return py::reinterpret_steal<py::object>(PyCFunction_NewEx(&any_set_def, holder.ptr(), nullptr));
}

}  // namespace attnmerge_py
