"""Which array library an argument belongs to: where new outputs are allocated, and which stream
`stream=None` means.  Nothing here checks arguments; libattnmerge does."""
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


_NAME_OF_DTYPE: dict[object, str] = {}  # dtype object -> its name (NumPy's dtype.name is a Python property: ~2 us)


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

    if name in ("float32", "float16"):
        dtype = np.dtype(name)
    else:
        try:
            import ml_dtypes
        except ImportError:
            raise TypeError(f"{name} NumPy arrays need the ml_dtypes package (pip install ml_dtypes)") from None
        dtype = np.dtype(getattr(ml_dtypes, name))
    _NUMPY_DTYPES[name] = dtype
    return dtype


class _DeviceBuffer:
    """A bare __cuda_array_interface__ over a buffer the caller's library allocated (JAX arrays are
    immutable to DLPack consumers, so their fresh outputs are written through this)."""

    def __init__(self, ptr, shape, name):
        self.dtype = name
        typestr = _numpy_dtype(name).str  # "<f4", "<V2" for ml_dtypes' bfloat16: the name tells the binding
        self.__cuda_array_interface__ = {"shape": tuple(shape), "typestr": typestr, "data": (ptr, False),
                                         "strides": None, "version": 3}


def empty(like, shape, name, like_name):
    """A new array of `shape` and dtype `name` in the library and on the device of `like` (the
    argument `like_name`).  Returns (array, writable view to hand to the library)."""
    kind = family(like)
    if kind == "torch":
        import torch

        x = torch.empty(shape, dtype=getattr(torch, name), device=like.device)
        return x, x
    if kind == "cupy":
        import cupy

        with like.device:
            x = cupy.empty(shape, dtype=_numpy_dtype(name))
        return x, x
    if kind == "jax":
        import jax.numpy as jnp

        x = jnp.empty(shape, dtype=getattr(jnp, name), device=like.device)
        x.block_until_ready()  # the buffer must exist before the merge writes it
        return x, _DeviceBuffer(x.unsafe_buffer_pointer(), shape, name)
    if kind == "numba":
        from numba import cuda

        from . import _C

        with cuda.gpus[_C.pointer_device(like.__cuda_array_interface__["data"][0])]:
            x = cuda.device_array(shape, dtype=_numpy_dtype(name))
        return x, x
    if kind == "numpy":
        import numpy as np

        x = np.empty(shape, dtype=_numpy_dtype(name))
        return x, x
    raise TypeError(f"{like_name}: expected an array of NumPy, PyTorch, CuPy, JAX or Numba to allocate outputs like, "
                    f"got {type(like).__qualname__} (pass out= and out_lse=)")


def default_stream(like):
    """The stream `stream=None` means for arrays like `like`, as a handle; None lets the binding ask
    the array's DLPack exchange API (PyTorch >= 2.10), which costs no Python call."""
    if type(like) in _ASKS_THE_EXCHANGE_API:  # the per-call case, answered with one lookup
        return None
    kind = family(like)
    if kind == "torch":
        if _has_exchange_api(type(like)):
            _ASKS_THE_EXCHANGE_API.add(type(like))
            return None
        if not like.is_cuda:
            return None
        import torch

        return torch.cuda.current_stream(like.device).cuda_stream
    if kind == "cupy":
        import cupy

        return cupy.cuda.get_current_stream().ptr
    if kind == "numba":
        # __cuda_array_interface__ v3: the stream the producer works on (1: legacy default, 2: per-thread).
        stream = like.__cuda_array_interface__.get("stream")
        return 0 if stream in (None, 1) else stream
    return 0


_EXCHANGE_API: dict[type, bool] = {}
_ASKS_THE_EXCHANGE_API: set[type] = set()  # torch tensor types with the exchange API: stream=None is theirs to resolve


def _has_exchange_api(cls):
    has = _EXCHANGE_API.get(cls)
    if has is None:
        has = _EXCHANGE_API[cls] = hasattr(cls, "__dlpack_c_exchange_api__")
    return has
