"""Names for the types of the public API's arguments, for annotations."""
from __future__ import annotations

from typing import Any, Literal, Union

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
