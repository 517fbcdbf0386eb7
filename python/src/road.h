// attnmerge._C's per-call path of the public functions: a call whose options are all their
// defaults made into its record without Python (the record attnmerge._call.options would make), and
// the road every call takes (attnmerge._roads' decision: torch.ops.attnmerge, attnmerge.jax or the
// binding), asked in C.  An eager decode call spent more time in the Python above the binding
// than in the binding (benchmarks/NOTES.md#routing-check); what any option changes stays in Python.
#ifndef ATTNMERGE_PYTHON_ROAD_H_
#define ATTNMERGE_PYTHON_ROAD_H_

#include <pybind11/pybind11.h>

namespace attnmerge_py {

namespace py = pybind11;

// What the road reads, registered once by attnmerge._roads: the cache of which types are JAX's
// (a dict {type: bool}, shared with Python), is_jax(x) for a type not in it, refuse(op, written,
// opt) (raises), jax(op, inputs, out_lse, opt), native(op, inputs, out, out_lse, opt), and the
// positions of the fields it reads in an Op ("like", "binding") and in an Options record ("sink",
// "sum_a", "sum_b", "out_dtype", "group_size"), each a dict {name: position}.
void use_roads(py::dict jax_types, py::handle is_jax, py::handle refuse, py::handle jax, py::handle native,
               py::dict op_fields, py::dict record_fields);

// The torch road (takes(*arrays) -> bool, run(op, inputs, out, out_lse, opt), transforming() ->
// bool), or none when all three are None; torch_road() what is registered (None: none).
void use_torch(py::handle takes, py::handle run, py::handle transforming);
py::object torch_road();

// run(op, inputs, out, out_lse, opt): the call of `op` on its road (attnmerge._roads.run).
py::object road_function();

// How the per-call path takes a parameter (the module exports the names in this order as
// CALLER_SLOTS): an input (its position in op.inputs), out, out_lse, a record field taken as it is
// (its position in the record), a record field taken where it is exactly an int (merge_share's
// index), an option that must be its default (`defaults`, the parameter's position).
enum class Slot : int { kInput, kOut, kOutLse, kField, kIntField, kDefault };
inline constexpr const char* kSlotNames[] = {"input", "out", "out_lse", "field", "int_field", "default"};
inline constexpr int kSlotKinds = sizeof(kSlotNames) / sizeof(kSlotNames[0]);

// A public function's per-call path: caller(*params) with the function's parameters in its
// signature's order.  `slots` says, per parameter, (kind, position): its Slot and where it goes.  `lses`: the parameters
// that may be softmax statistics (a tuple: the general path).  The call is road(op, inputs, out,
// out_lse, record) with `record` (the default record) and its fields set; any other call's
// (inputs, out, out_lse, record) are general(op, args), the parameters as a tuple (the Python
// reading of every option), and then the same road.
py::object caller(py::handle op, py::tuple slots, py::tuple defaults, py::tuple lses, py::handle record,
                  py::handle general);

}  // namespace attnmerge_py

#endif  // ATTNMERGE_PYTHON_ROAD_H_
