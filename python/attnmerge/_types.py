"""Names for the types of the public API's arguments, for annotations, and the dtypes they may be:
libattnmerge's one table of dtypes (attnmerge_dtype_info_of, read through the binding), which every
Python module asks instead of restating it."""
from __future__ import annotations

from typing import Any, Literal, NamedTuple, Union

from . import _C

# An array of any library attnmerge reads: one with __dlpack__ (PyTorch, CuPy, JAX, ...),
# __cuda_array_interface__ (Numba, ...) or NumPy's interface.  Checked by libattnmerge, not here.
Array = Any
# The stream of a GPU call: None (the arrays' framework's current stream), a cudaStream_t as an
# int, or an object with .cuda_stream or .ptr.
Stream = Any
# A dtype: a name ("bfloat16") or any framework's dtype object.
DType = Any
# The LSE's base: "e" (natural log) or 2 (log2-sum-exp2, FlashInfer's).
Base = Union[Literal["e"], Literal[2]]
# The two-way and in-place merges' LSE bases: one for both states, or (a's, b's).
PairBase = Union[Base, tuple[Base, Base]]
# An LSE argument: an array of LSEs, or softmax statistics, a (max, sum) tuple of arrays.
Lse = Union[Array, tuple[Array, Array]]


class DTypeInfo(NamedTuple):
    code: int  # attnmerge_dtype
    c_name: str  # as libattnmerge's messages spell it ("float8_e4m3")
    name: str  # as NumPy, ml_dtypes, PyTorch and JAX spell it ("float8_e4m3fn"): the Python API's
    size: int  # bytes an element
    roles: int  # the _C.ROLE_* arguments it may be


DTYPES = tuple(DTypeInfo(*row) for row in _C.DTYPES)


def dtypes_of(role: int) -> tuple[str, ...]:
    """The names of the dtypes an argument of `role` (_C.ROLE_*) may have, in code order."""
    return tuple(d.name for d in DTYPES if d.roles & role)


O_IN_DTYPES = dtypes_of(_C.ROLE_O_IN)  # what a merge reads, and every O of a backward
O_OUT_DTYPES = dtypes_of(_C.ROLE_O_OUT)  # what a merge writes
NO_GRADIENT_DTYPES = tuple(n for n in O_OUT_DTYPES if n not in O_IN_DTYPES)  # outputs with no backward (FP8)
ALIASES = {d.c_name: d.name for d in DTYPES if d.c_name != d.name}  # the C ABI's other spellings
