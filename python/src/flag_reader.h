// attnmerge._C.flag_reader: whether any of several objects has a boolean attribute set, read for
// one type through the C getter of that attribute's descriptor.  The Python layer asks it on every
// eager call with autograd on (torch.Tensor's requires_grad of the inputs), where one Python
// attribute read per array was most of the routing's host cost.
#ifndef ATTNMERGE_PYTHON_FLAG_READER_H_
#define ATTNMERGE_PYTHON_FLAG_READER_H_

#include <pybind11/pybind11.h>

namespace attnmerge_py {

namespace py = pybind11;

// A callable `reader(*objects) -> bool | None`: None when no object is an instance of `type` (or
// of a subclass): nothing is asked then.  Else True when gate() is True and some instance has
// `name` set (is True), as `getattr(obj, name, False) is True` would say; objects of other types
// are not read.  Instances of exactly `type` are read through the getter of type's `name` (a
// getset descriptor, else a TypeError); a subclass's by the attribute protocol.  gate is asked
// first: one call less from Python.  `tracing` (None or a callable): unless the first two objects
// are both exactly `type` (an eager call's inputs), where some object is an instance of a
// subclass of `type` (torch.export's FakeTensor), tracing() is asked before the gate, and its
// True answers True (the whole routing check of an eager call in one C call, no Python frame).
py::object flag_reader(py::handle type, py::str name, py::handle gate, py::handle tracing);

}  // namespace attnmerge_py

#endif  // ATTNMERGE_PYTHON_FLAG_READER_H_
