"""Which array library an argument belongs to, and where new outputs are allocated.  Nothing here
checks arguments (libattnmerge does), and `stream=None` is resolved by the binding, which reads the
arrays (python/src/array_view.h)."""
from __future__ import annotations

from ._types import ALIASES, O_OUT_DTYPES


_FAMILIES = {"torch": "torch", "cupy": "cupy", "numpy": "numpy", "jax": "jax", "jaxlib": "jax", "numba": "numba",
             "numba_cuda": "numba"}
_FAMILY_OF_TYPE: dict[type, str] = {}  # type -> family, for the types of the frameworks above (looked up every call)


def family(x):
    """'torch', 'cupy', 'jax', 'numba', 'numpy' or None, from the array's type alone."""
    kind = _FAMILY_OF_TYPE.get(type(x))
    if kind is not None:
        return kind
    kind = _FAMILIES.get(type(x).__module__.partition(".")[0])
    if kind is not None:
        _FAMILY_OF_TYPE[type(x)] = kind
        return kind
    if hasattr(x, "__array_interface__"):
        return "numpy"
    return None


_NAME_OF_DTYPE: dict[object, str] = {}  # dtype object -> its name (NumPy's dtype.name is a slow property)


def name_of(dtype):
    """The name of any framework's dtype object, as the array libraries spell it (not checked)."""
    if type(dtype).__module__ == "torch":  # torch.dtype: str() is cheap; no cache, which torch.compile cannot trace
        name = str(dtype).rpartition(".")[2]
        return ALIASES.get(name, name)
    try:
        return _NAME_OF_DTYPE[dtype]
    except (KeyError, TypeError):  # not seen yet, or not hashable
        pass
    name = getattr(dtype, "name", None) or str(dtype).rpartition(".")[2]
    if isinstance(dtype, type):  # NumPy scalar types such as numpy.float16
        name = getattr(dtype, "__name__", name)
    name = ALIASES.get(name, name)
    try:
        if name in O_OUT_DTYPES:
            _NAME_OF_DTYPE[dtype] = name
    except TypeError:
        pass
    return name


def dtype_name(dtype, arg, names=O_OUT_DTYPES):
    """One of `names` (by default those of an output O, _types.O_OUT_DTYPES) from a string or any
    framework's dtype."""
    name = ALIASES.get(dtype, dtype) if isinstance(dtype, str) else name_of(dtype)
    if name not in names:
        raise TypeError(f"{arg}: expected dtype {', '.join(names[:-1])} or {names[-1]}, got {dtype!r}")
    return name


_NUMPY_DTYPES: dict[str, object] = {}  # name -> NumPy dtype, once found


def _numpy_dtype(name):
    dtype = _NUMPY_DTYPES.get(name)
    if dtype is not None:
        return dtype
    import numpy as np

    try:
        dtype = np.dtype(name)  # NumPy's own (float64, float32, float16, ...)
    except TypeError:  # bfloat16, float8_e4m3fn: ml_dtypes'
        try:
            import ml_dtypes
        except ImportError:
            raise TypeError(f"{name} NumPy arrays need the ml_dtypes package (pip install ml_dtypes)") from None
        dtype = np.dtype(getattr(ml_dtypes, name))
    _NUMPY_DTYPES[name] = dtype
    return dtype


def empty(like, shape, name, like_name):
    """A new array of `shape` and dtype `name` in the library and on the device of `like` (the
    argument `like_name`).  JAX arrays, immutable, are never allocated here: attnmerge.jax makes
    its results itself."""
    kind = family(like)
    if kind == "torch":
        import torch

        # The sizes as arguments, not a tuple: torch parses them 0.4 us faster (NOTES#routing-check).
        return torch.empty(*shape, dtype=getattr(torch, name), device=like.device)
    if kind == "cupy":
        import cupy

        with like.device:
            return cupy.empty(shape, dtype=_numpy_dtype(name))
    if kind == "numba":
        from numba import cuda

        from . import _C

        with cuda.gpus[_C.pointer_device(like.__cuda_array_interface__["data"][0])]:
            return cuda.device_array(shape, dtype=_numpy_dtype(name))
    if kind == "numpy":
        import numpy as np

        return np.empty(shape, dtype=_numpy_dtype(name))
    raise TypeError(f"{like_name}: expected an array of NumPy, PyTorch, CuPy, JAX or Numba to allocate outputs like, "
                    f"got {type(like).__qualname__} (pass out= and out_lse=)")
