// attnmerge._C.road and attnmerge._C.caller (road.h).
#include "road.h"

#include <algorithm>
#include <string>
#include <vector>

namespace attnmerge_py {

namespace {

// What use_roads and use_torch registered: references held for the module's life.
struct Roads {
  PyObject *jax_types = nullptr, *is_jax = nullptr, *refuse = nullptr, *jax = nullptr, *native = nullptr;
  PyObject *takes = nullptr, *torch_run = nullptr, *transforming = nullptr;
  Py_ssize_t like = -1, binding = -1, sink = -1, sum_a = -1, sum_b = -1, out_dtype = -1, group_size = -1;
  Py_ssize_t op_size = 0, record_size = 0;  // the least sizes an Op and a record may have (past those fields)
};
Roads g;

PyObject* fail(PyObject* type, const std::string& message) {
  PyErr_SetString(type, message.c_str());
  return nullptr;
}

// 1 true, 0 false, -1 an error raised: what `bool(f(*args))` says.
int truth_of(PyObject* result) {
  if (result == nullptr) return -1;
  const int t = PyObject_IsTrue(result);
  Py_DECREF(result);
  return t;
}

// Whether x is a JAX array or tracer: the shared cache by type, else _roads.is_jax (which fills it).
int is_jax(PyObject* x) {
  PyObject* known = PyDict_GetItemWithError(g.jax_types, reinterpret_cast<PyObject*>(Py_TYPE(x)));
  if (known != nullptr) return known == Py_True;
  if (PyErr_Occurred()) return -1;
  return truth_of(PyObject_CallOneArg(g.is_jax, x));
}

int any_jax(PyObject* a, PyObject* b) {
  const int first = is_jax(a);
  return first != 0 ? first : is_jax(b);
}

// _roads' refusal of JAX arrays handed over to be written: false, its exception raised (it always
// raises; a refusal that returned is the package's bug, reported as such).
bool refuse(PyObject* op, PyObject* a, PyObject* b, PyObject* opt) {
  PyObject* written = PyTuple_Pack(2, a, b);
  if (written == nullptr) return false;
  PyObject* args[] = {op, written, opt};
  PyObject* r = PyObject_Vectorcall(g.refuse, args, 3, nullptr);
  Py_DECREF(written);
  if (r == nullptr) return false;
  Py_DECREF(r);
  PyErr_SetString(PyExc_RuntimeError, "attnmerge._roads: the refusal of JAX outputs returned");
  return false;
}

// Whether a and b, handed over to be written, may be: true, or false with the error raised (a
// JAX array is refused; asking may fail).
bool writable(PyObject* op, PyObject* a, PyObject* b, PyObject* opt) {
  const int jax = any_jax(a, b);
  return jax == 0 || (jax > 0 && refuse(op, a, b, opt));
}

// Whether the type of x is known not to be JAX's (without asking): the per-call case.
bool known_not_jax(PyObject* x) {
  return PyDict_GetItem(g.jax_types, reinterpret_cast<PyObject*>(Py_TYPE(x))) == Py_False;
}

// The torch road as registered when a call began, referenced until it ends.
struct Held {
  PyObject *takes = g.takes, *transforming = g.transforming, *run = g.torch_run;
  Held() {
    Py_XINCREF(takes);
    Py_XINCREF(transforming);
    Py_XINCREF(run);
  }
  ~Held() {
    Py_XDECREF(takes);
    Py_XDECREF(transforming);
    Py_XDECREF(run);
  }
  Held(const Held&) = delete;
  Held& operator=(const Held&) = delete;
};

PyObject* run_road(PyObject* op, PyObject* inputs, PyObject* out, PyObject* out_lse, PyObject* opt) {
  if (g.native == nullptr) return fail(PyExc_RuntimeError, "attnmerge._C.road: no roads registered (attnmerge._roads)");
  if (!PyTuple_Check(op) || PyTuple_GET_SIZE(op) < g.op_size)
    return fail(PyExc_TypeError, "op: expected an attnmerge._call.Op");
  if (!PyTuple_Check(inputs) || PyTuple_GET_SIZE(inputs) < 2 || PyTuple_GET_SIZE(inputs) > 8)
    return fail(PyExc_TypeError, "inputs: expected a tuple of 2 to 8 arrays");
  if (!PyTuple_Check(opt) || PyTuple_GET_SIZE(opt) < g.record_size)
    return fail(PyExc_TypeError, "opt: expected an attnmerge._call.Options record");
  const Py_ssize_t n = PyTuple_GET_SIZE(inputs);
  PyObject* const* in = &PyTuple_GET_ITEM(inputs, 0);
  if (g.takes != nullptr) {  // torch.ops.attnmerge while traced or recorded by autograd
    const Held torch_road;  // held through the calls: a callback may register another road
    PyObject* arrays[13];
    for (Py_ssize_t i = 0; i < n; ++i) arrays[i] = in[i];
    arrays[n] = PyTuple_GET_ITEM(opt, g.sink);
    arrays[n + 1] = PyTuple_GET_ITEM(opt, g.sum_a);
    arrays[n + 2] = PyTuple_GET_ITEM(opt, g.sum_b);
    arrays[n + 3] = out;
    arrays[n + 4] = out_lse;
    PyObject* answer = PyObject_Vectorcall(torch_road.takes, arrays, n + 5, nullptr);
    // None: no torch tensor among the arrays, so none a torch.func transform holds either.
    const bool torch_arrays = answer != Py_None;
    int take = truth_of(answer);
    if (take == 0 && torch_arrays) take = truth_of(PyObject_CallNoArgs(torch_road.transforming));
    if (take < 0) return nullptr;
    if (take) {
      PyObject* args[] = {op, inputs, out, out_lse, opt};
      return PyObject_Vectorcall(torch_road.run, args, 5, nullptr);
    }
  }
  const Py_ssize_t like = PyLong_AsSsize_t(PyTuple_GET_ITEM(op, g.like));
  if (like == -1 && PyErr_Occurred()) return nullptr;
  const int grouped = PyObject_IsTrue(PyTuple_GET_ITEM(opt, g.group_size));
  if (grouped < 0) return nullptr;
  if (like < 0) {  // the in-place merge writes its first state
    if (!writable(op, in[0], in[1], opt)) return nullptr;
  } else if (out == Py_None || out_lse == Py_None || PyTuple_GET_ITEM(opt, g.out_dtype) != Py_None || grouped) {
    // results to allocate
    if ((out != Py_None || out_lse != Py_None) && !writable(op, out, out_lse, opt)) return nullptr;
    if (like >= n) return fail(PyExc_TypeError, "op: its `like` input is past its inputs");
    if (out == Py_None) {
      const int jax = is_jax(in[like]);
      if (jax < 0) return nullptr;
      if (jax) {
        PyObject* args[] = {op, inputs, out_lse, opt};
        return PyObject_Vectorcall(g.jax, args, 4, nullptr);
      }
    }
  } else if (!known_not_jax(out) || !known_not_jax(out_lse)) {
    if (!writable(op, out, out_lse, opt)) return nullptr;
  } else {  // the per-call case: every result given, straight to the binding
    PyObject* args[12] = {out, out_lse};
    for (Py_ssize_t i = 0; i < n; ++i) args[2 + i] = in[i];
    args[2 + n] = opt;
    PyObject* r = PyObject_Vectorcall(PyTuple_GET_ITEM(op, g.binding), args, n + 3, nullptr);
    if (r == nullptr) return nullptr;
    Py_DECREF(r);
    return PyTuple_Pack(2, out, out_lse);
  }
  PyObject* args[] = {op, inputs, out, out_lse, opt};
  return PyObject_Vectorcall(g.native, args, 5, nullptr);
}

PyObject* road(PyObject*, PyObject* const* args, Py_ssize_t n) {
  if (n != 5) return fail(PyExc_TypeError, "road: expected (op, inputs, out, out_lse, opt), got " +
                                               std::to_string(n) + " arguments");
  return run_road(args[0], args[1], args[2], args[3], args[4]);
}

PyMethodDef road_def = {"road", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(road)), METH_FASTCALL,
                        "road(op: object, inputs: tuple, out: object, out_lse: object, opt: object) -> tuple\n\n"
                        "One call of `op` on its road (attnmerge._roads.run)."};

// ---- a public function's per-call path --------------------------------------------------------

constexpr const char* kCapsule = "attnmerge.caller";

struct Caller {
  PyObject *op, *defaults, *record, *general;  // owned
  std::vector<std::pair<Slot, Py_ssize_t>> slots;
  std::vector<Py_ssize_t> lses;
  Py_ssize_t inputs = 0;
};

void release(PyObject* capsule) {
  auto* c = static_cast<Caller*>(PyCapsule_GetPointer(capsule, kCapsule));
  Py_DECREF(c->op);
  Py_DECREF(c->defaults);
  Py_DECREF(c->record);
  Py_DECREF(c->general);
  delete c;
}

// A new record of the default's type and fields (a tuple subclass, allocated as tuple.__new__ does).
PyObject* copy_record(PyObject* record) {
  PyTypeObject* type = Py_TYPE(record);
  const Py_ssize_t size = PyTuple_GET_SIZE(record);
  PyObject* r = type->tp_alloc(type, size);
  if (r == nullptr) return nullptr;
  for (Py_ssize_t i = 0; i < size; ++i) {
    PyObject* item = PyTuple_GET_ITEM(record, i);
    Py_INCREF(item);
    PyTuple_SET_ITEM(r, i, item);
  }
  return r;
}

void set_field(PyObject* record, Py_ssize_t i, PyObject* value) {
  PyObject* old = PyTuple_GET_ITEM(record, i);
  Py_INCREF(value);
  PyTuple_SET_ITEM(record, i, value);
  Py_DECREF(old);
}

PyObject* call(PyObject* capsule, PyObject* const* args, Py_ssize_t nargs) {
  const auto* c = static_cast<const Caller*>(PyCapsule_GetPointer(capsule, kCapsule));
  const Py_ssize_t n = static_cast<Py_ssize_t>(c->slots.size());
  if (nargs != n)
    return fail(PyExc_TypeError, "caller: expected " + std::to_string(n) + " parameters, got " + std::to_string(nargs));
  bool per_call = true;
  for (const Py_ssize_t i : c->lses) per_call = per_call && !PyTuple_Check(args[i]);
  for (Py_ssize_t i = 0; i < n && per_call; ++i) {
    const Slot kind = c->slots[i].first;
    if (kind == Slot::kDefault) per_call = args[i] == PyTuple_GET_ITEM(c->defaults, i);
    if (kind == Slot::kIntField) per_call = PyLong_CheckExact(args[i]);
  }
  if (!per_call) {
    PyObject* params = PyTuple_New(n);
    if (params == nullptr) return nullptr;
    for (Py_ssize_t i = 0; i < n; ++i) {
      Py_INCREF(args[i]);
      PyTuple_SET_ITEM(params, i, args[i]);
    }
    PyObject* general_args[] = {c->op, params};
    PyObject* read = PyObject_Vectorcall(c->general, general_args, 2, nullptr);
    Py_DECREF(params);
    if (read == nullptr) return nullptr;
    if (!PyTuple_Check(read) || PyTuple_GET_SIZE(read) != 4) {
      Py_DECREF(read);
      return fail(PyExc_TypeError, "caller: general: expected (inputs, out, out_lse, opt)");
    }
    PyObject* const* a = &PyTuple_GET_ITEM(read, 0);
    PyObject* r = run_road(c->op, a[0], a[1], a[2], a[3]);
    Py_DECREF(read);
    return r;
  }
  PyObject* inputs = PyTuple_New(c->inputs);
  PyObject* record = inputs == nullptr ? nullptr : copy_record(c->record);
  if (record == nullptr) {
    Py_XDECREF(inputs);
    return nullptr;
  }
  PyObject *out = Py_None, *out_lse = Py_None;
  for (Py_ssize_t i = 0; i < n; ++i) {
    const auto [kind, at] = c->slots[i];
    switch (kind) {
      case Slot::kInput:
        Py_INCREF(args[i]);
        PyTuple_SET_ITEM(inputs, at, args[i]);
        break;
      case Slot::kOut: out = args[i]; break;
      case Slot::kOutLse: out_lse = args[i]; break;
      case Slot::kField:
      case Slot::kIntField: set_field(record, at, args[i]); break;
      case Slot::kDefault: break;
    }
  }
  PyObject* r = run_road(c->op, inputs, out, out_lse, record);
  Py_DECREF(inputs);
  Py_DECREF(record);
  return r;
}

PyMethodDef call_def = {"caller", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(call)), METH_FASTCALL,
                        "caller(*params): a public function's call, its parameters in its signature's order"};

Py_ssize_t position(const py::dict& fields, const char* name, const char* of) {
  if (!fields.contains(name)) throw py::value_error(std::string("use_roads: ") + of + " has no field " + name);
  return fields[name].cast<Py_ssize_t>();
}

void hold(PyObject*& slot, py::handle value) {
  PyObject* old = slot;
  slot = value.is_none() ? nullptr : value.inc_ref().ptr();
  Py_XDECREF(old);
}

}  // namespace

void use_roads(py::dict jax_types, py::handle is_jax, py::handle refuse, py::handle jax, py::handle native,
               py::dict op_fields, py::dict record_fields) {
  for (const py::handle f : {is_jax, refuse, jax, native})
    if (!PyCallable_Check(f.ptr())) throw py::type_error("use_roads: expected callables");
  g.like = position(op_fields, "like", "Op");
  g.binding = position(op_fields, "binding", "Op");
  g.sink = position(record_fields, "sink", "Options");
  g.sum_a = position(record_fields, "sum_a", "Options");
  g.sum_b = position(record_fields, "sum_b", "Options");
  g.out_dtype = position(record_fields, "out_dtype", "Options");
  g.group_size = position(record_fields, "group_size", "Options");
  g.op_size = std::max(g.like, g.binding) + 1;
  g.record_size = std::max({g.sink, g.sum_a, g.sum_b, g.out_dtype, g.group_size}) + 1;
  hold(g.jax_types, jax_types);
  hold(g.is_jax, is_jax);
  hold(g.refuse, refuse);
  hold(g.jax, jax);
  hold(g.native, native);
}

void use_torch(py::handle takes, py::handle run, py::handle transforming) {
  const bool none = takes.is_none() && run.is_none() && transforming.is_none();
  if (!none && !(PyCallable_Check(takes.ptr()) && PyCallable_Check(run.ptr()) && PyCallable_Check(transforming.ptr())))
    throw py::type_error("use_torch: expected three callables, or three None");
  hold(g.takes, takes);
  hold(g.torch_run, run);
  hold(g.transforming, transforming);
}

py::object torch_road() {
  if (g.takes == nullptr) return py::none();
  return py::make_tuple(py::handle(g.takes), py::handle(g.torch_run), py::handle(g.transforming));
}

py::object road_function() {
  return py::reinterpret_steal<py::object>(PyCFunction_NewEx(&road_def, nullptr, nullptr));
}

py::object caller(py::handle op, py::tuple slots, py::tuple defaults, py::tuple lses, py::handle record,
                  py::handle general) {
  if (!PyTuple_Check(record.ptr())) throw py::type_error("caller: record: expected an attnmerge._call.Options");
  if (!PyCallable_Check(general.ptr())) throw py::type_error("caller: general: expected a callable");
  if (defaults.size() != slots.size()) throw py::value_error("caller: expected a default per parameter");
  auto* c = new Caller{op.inc_ref().ptr(), defaults.inc_ref().ptr(), record.inc_ref().ptr(), general.inc_ref().ptr(),
                       {}, {}, 0};
  const py::capsule holder(c, kCapsule, release);
  const Py_ssize_t fields = PyTuple_GET_SIZE(record.ptr());
  for (const py::handle s : slots) {
    const auto pair = s.cast<std::pair<int, Py_ssize_t>>();
    const Slot kind = static_cast<Slot>(pair.first);
    if (pair.first < 0 || pair.first >= kSlotKinds)
      throw py::value_error("caller: a slot's kind is a position in CALLER_SLOTS");
    if ((kind == Slot::kField || kind == Slot::kIntField) && (pair.second < 0 || pair.second >= fields))
      throw py::value_error("caller: a record field past the record");
    if (kind == Slot::kInput) c->inputs = std::max(c->inputs, pair.second + 1);
    c->slots.emplace_back(kind, pair.second);
  }
  std::vector<int> filled(static_cast<size_t>(c->inputs), 0);
  for (const auto& [kind, at] : c->slots)
    if (kind == Slot::kInput) ++filled[static_cast<size_t>(at)];
  for (const int f : filled)
    if (f != 1) throw py::value_error("caller: expected each input once");
  for (const py::handle i : lses) c->lses.push_back(i.cast<Py_ssize_t>());
  for (const Py_ssize_t i : c->lses)
    if (i < 0 || i >= static_cast<Py_ssize_t>(c->slots.size())) throw py::value_error("caller: an LSE past the parameters");
  return py::reinterpret_steal<py::object>(PyCFunction_NewEx(&call_def, holder.ptr(), nullptr));
}

}  // namespace attnmerge_py
