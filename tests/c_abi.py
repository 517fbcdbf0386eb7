"""A ctypes binding of libattnmerge's C ABI (cpp/include/attnmerge/attnmerge.h), for tests that call
the library as a C program would: hand-built descriptors, NULL pointers, codes no Python layer can
produce.  Not a public API.

    lib = c_abi.load()                        # the libattnmerge that `attnmerge` loaded
    t = c_abi.tensor_from(np_array)           # a descriptor over a NumPy array (strides in elements)
    status = lib.attnmerge_merge(byref(out), None, byref(o_a), ...)
"""

from __future__ import annotations

import ctypes
from ctypes import POINTER, Structure, c_char_p, c_float, c_int, c_int32, c_int64, c_uint32, c_void_p

import numpy as np

# attnmerge_status
SUCCESS, ERROR_VALUE, ERROR_TYPE, ERROR_NO_DEVICE, ERROR_CUDA, ERROR_TIMEOUT = 0, 1, 2, 3, 4, 5
STATUSES = (SUCCESS, ERROR_VALUE, ERROR_TYPE, ERROR_NO_DEVICE, ERROR_CUDA, ERROR_TIMEOUT)

# attnmerge_dtype (the library's table, dtypes(), says what each is; test_abi_exports holds these to it)
FLOAT32, FLOAT16, BFLOAT16, FLOAT8_E4M3, UINT8, BOOL, INT32, INT64, FLOAT64 = range(9)
# attnmerge_dtype_info.roles
ROLE_O_IN, ROLE_O_OUT, ROLE_LSE, ROLE_MASK, ROLE_INDPTR, ROLE_SCALE = 1, 2, 4, 8, 16, 32

HOST = -1
MAX_NDIM = 4
READ_ONLY, DEVICE_KNOWN = 1, 2  # attnmerge_tensor.flags

# attnmerge_options.flags
LSE_BASE2, LSE_HEADS_FIRST, A_TOKENS, PDL = 1, 2, 4, 8
LSE_B_BASE2, LSE_B_BASE_E, OUT_LSE_BASE2, OUT_LSE_BASE_E = 16, 32, 64, 128  # mixed bases
GROUP_SCALE_UE8M0 = 256
BLOCK_MXFP8, BLOCK_NVFP4, SCALE_RCEIL, SCALE_SWIZZLED = 1024, 2048, 4096, 8192  # block-scaled outputs


class Tensor(Structure):
    """attnmerge_tensor."""

    _fields_ = [
        ("data", c_void_p),
        ("shape", c_int64 * MAX_NDIM),
        ("strides", c_int64 * MAX_NDIM),
        ("ndim", c_int32),
        ("dtype", c_int32),
        ("device", c_int32),
        ("flags", c_uint32),
    ]

    def __repr__(self):
        n = max(0, min(self.ndim, MAX_NDIM))
        return (f"Tensor(data={self.data and hex(self.data)}, shape={list(self.shape)[:n]}, "
                f"strides={list(self.strides)[:n]}, ndim={self.ndim}, dtype={self.dtype}, device={self.device}, "
                f"flags={self.flags})")


class ArgName(Structure):
    """attnmerge_arg_name."""

    _fields_ = [("arg", c_char_p), ("name", c_char_p)]


class Options(Structure):
    """attnmerge_options: the baseline layout (0.2.0's), which struct_size 0 also names."""

    _fields_ = [
        ("flags", c_uint32),
        ("a_tokens", c_int64),
        ("output_scale", c_float),
        ("output_scale_ptr", POINTER(c_float)),
        ("struct_size", c_uint32),
        ("arg_names", POINTER(ArgName)),
        ("num_arg_names", c_int32),
        ("sink", POINTER(Tensor)),
        ("group_scales", POINTER(Tensor)),
        ("group_size", c_int32),
        ("sum_a", POINTER(Tensor)),
        ("sum_b", POINTER(Tensor)),
        ("valid", POINTER(Tensor)),
        ("num_tokens", POINTER(Tensor)),
        ("a_tokens_tensor", POINTER(Tensor)),
    ]


class LaunchInfo(Structure):
    """attnmerge_launch_info."""

    _fields_ = [
        ("kernel", c_int32),
        ("launches", c_int32),
        ("state_groups", c_int32),
        ("index_bits", c_int32),
        ("vec", c_int32),
        ("pdl", c_int32),
        ("grid", c_uint32 * 3),
        ("block", c_uint32 * 3),
    ]


class DtypeInfo(Structure):
    """attnmerge_dtype_info."""

    _fields_ = [
        ("name", c_char_p),
        ("array_name", c_char_p),
        ("size", c_uint32),
        ("roles", c_uint32),
    ]


# attnmerge_launch_info.kernel
KERNEL_NONE, KERNEL_ROWS, KERNEL_ROWS_PLAIN, KERNEL_ROWS_INPLACE, KERNEL_STATES, KERNEL_BACKWARD = 0, 1, 2, 3, 4, 5
KERNEL_EXCHANGE = 6

# the exchange: attnmerge_exchange_reuse, attnmerge_slice, ATTNMERGE_EXCHANGE_MAX_WORLD
WAIT_READERS, ALTERNATE = 0, 1
SLICE_TOKENS, SLICE_HEADS = 0, 1
MAX_WORLD = 72


class Exchange(Structure):
    """attnmerge_exchange."""

    _fields_ = [
        ("struct_size", c_uint32),
        ("rank", c_int32),
        ("world_size", c_int32),
        ("reuse", c_int32),
        ("timeout_ns", c_int64),
        ("o", POINTER(c_void_p)),
        ("lse", POINTER(c_void_p)),
        ("pads", POINTER(c_void_p)),
        ("o_layout", Tensor),
        ("lse_layout", Tensor),
        ("sum", POINTER(c_void_p)),
    ]


TensorP = POINTER(Tensor)
OptionsP = POINTER(Options)
ExchangeP = POINTER(Exchange)

_SIGNATURES = {
    "attnmerge_merge": (c_int, [TensorP, TensorP, TensorP, TensorP, TensorP, TensorP, OptionsP, c_void_p]),
    "attnmerge_merge_inplace": (c_int, [TensorP, TensorP, TensorP, TensorP, TensorP, OptionsP, c_void_p]),
    "attnmerge_merge_states": (c_int, [TensorP, TensorP, TensorP, TensorP, OptionsP, c_void_p]),
    "attnmerge_merge_varlen": (c_int, [TensorP, TensorP, TensorP, TensorP, TensorP, OptionsP, c_void_p]),
    "attnmerge_merge_share": (c_int, [TensorP, TensorP, TensorP, TensorP, c_int64, OptionsP, c_void_p]),
    "attnmerge_merge_backward": (c_int, [TensorP] * 12 + [OptionsP, c_void_p]),
    "attnmerge_merge_states_backward": (c_int, [TensorP] * 8 + [OptionsP, c_void_p]),
    "attnmerge_merge_varlen_backward": (c_int, [TensorP] * 9 + [OptionsP, c_void_p]),
    "attnmerge_exchange_pad_bytes": (c_int64, [c_int32]),
    "attnmerge_exchange_publish": (c_int, [ExchangeP, c_int64, c_void_p]),
    "attnmerge_merge_exchange": (c_int, [TensorP, TensorP, ExchangeP, c_int32, c_int64, c_int64, OptionsP, c_void_p]),
    "attnmerge_exchange_status": (c_int, [ExchangeP, c_void_p]),
    "attnmerge_last_error": (c_char_p, []),
    "attnmerge_last_launch": (None, [POINTER(LaunchInfo)]),
    "attnmerge_status_string": (c_char_p, [c_int]),
    "attnmerge_version": (c_int, []),
    "attnmerge_version_string": (c_char_p, []),
    "attnmerge_cuda_architectures": (c_char_p, []),
    "attnmerge_cuda_ptx_architectures": (c_char_p, []),
    "attnmerge_cuda_architectures_choice": (c_char_p, []),
    "attnmerge_cuda_build_version": (c_int, []),
    "attnmerge_cuda_driver_version": (c_int, []),
    "attnmerge_device_count": (c_int, []),
    "attnmerge_pointer_device": (c_int, [c_void_p]),
    "attnmerge_dtype_info_of": (POINTER(DtypeInfo), [c_int32]),
    "attnmerge_stream_synchronize": (c_int, [c_int32, c_void_p]),
}
FUNCTIONS = tuple(_SIGNATURES)

_lib = None


def library_path() -> str:
    import attnmerge

    return attnmerge.library_path()


def load():
    """The libattnmerge the `attnmerge` package loaded, with every function's signature declared."""
    global _lib
    if _lib is None:
        lib = ctypes.CDLL(library_path())
        for name, (restype, argtypes) in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.restype = restype
            fn.argtypes = argtypes
        _lib = lib
    return _lib


def last_error() -> str:
    return load().attnmerge_last_error().decode("utf-8", "replace")


def last_launch() -> LaunchInfo:
    info = LaunchInfo()
    load().attnmerge_last_launch(ctypes.byref(info))
    return info


_DTYPES: dict = {}


def dtypes() -> dict:
    """{code: (name, array_name, size, roles)} from the library's table (attnmerge_dtype_info_of)."""
    if not _DTYPES:
        code = 0
        while info := load().attnmerge_dtype_info_of(code):
            d = info.contents
            _DTYPES[code] = (d.name.decode(), d.array_name.decode(), d.size, d.roles)
            code += 1
    return _DTYPES


def dtype_sizes() -> dict:
    """{code: bytes per element}."""
    return {code: d[2] for code, d in dtypes().items()}


def dtype_code(dtype) -> int:
    """The attnmerge_dtype of a NumPy dtype (ml_dtypes' bfloat16 and float8_e4m3fn included): the one
    whose array name is NumPy's name of it."""
    name = np.dtype(dtype).name
    for code, d in dtypes().items():
        if d[1] == name:
            return code
    raise TypeError(f"no attnmerge dtype for {dtype}")


def tensor(data, shape, strides, dtype, *, device=HOST, flags=0, ndim=None) -> Tensor:
    """A descriptor from its fields; data an int address (or None), strides in elements."""
    t = Tensor()
    t.data = data or None
    shape, strides = list(shape), list(strides)
    for i, (s, st) in enumerate(zip(shape[:MAX_NDIM], strides[:MAX_NDIM])):
        t.shape[i] = s
        t.strides[i] = st
    t.ndim = len(shape) if ndim is None else ndim
    t.dtype = dtype
    t.device = device
    t.flags = flags
    return t


def tensor_from(x: np.ndarray, *, device=HOST, flags=None, dtype=None) -> Tensor:
    """A descriptor over NumPy array x (strides in elements); read-only unless x is writable."""
    itemsize = x.dtype.itemsize
    assert all(s % itemsize == 0 for s in x.strides), "strides must be whole elements"
    if flags is None:
        flags = 0 if x.flags.writeable else READ_ONLY
    return tensor(x.ctypes.data, x.shape, [s // itemsize for s in x.strides],
                  dtype_code(x.dtype) if dtype is None else dtype, device=device, flags=flags)


def ref(t):
    """A pointer argument: None stays NULL, a pointer stays itself, a Tensor / Options becomes byref()."""
    return t if t is None or isinstance(t, ctypes._Pointer) else ctypes.byref(t)


def options(flags=0, a_tokens=0, output_scale=0.0, output_scale_ptr=None, arg_names=None, sink=None,
            group_scales=None, group_size=0, sum_a=None, sum_b=None, valid=None, num_tokens=None,
            a_tokens_tensor=None) -> Options:
    """Options, struct_size this layout's size (as a C caller fills it; 0 names the same layout);
    arg_names: {arg: name} or (arg, name) pairs (None for a NULL string), sink, group_scales, sum_a,
    sum_b, valid, num_tokens and a_tokens_tensor: Tensors."""
    o = Options()
    o.struct_size = ctypes.sizeof(Options)
    o.flags = flags
    o.a_tokens = a_tokens
    o.output_scale = output_scale
    if output_scale_ptr is not None:
        o.output_scale_ptr = ctypes.cast(ctypes.c_void_p(output_scale_ptr), POINTER(c_float))
    if arg_names is not None:
        pairs = list(arg_names.items() if isinstance(arg_names, dict) else arg_names)
        encode = lambda s: None if s is None else s.encode()  # noqa: E731
        o._entries = (ArgName * len(pairs))(*(ArgName(encode(a), encode(n)) for a, n in pairs))  # alive with o
        o.arg_names = ctypes.cast(o._entries, POINTER(ArgName))
        o.num_arg_names = len(pairs)
    for name, given in (("sink", sink), ("group_scales", group_scales), ("sum_a", sum_a), ("sum_b", sum_b),
                        ("valid", valid), ("num_tokens", num_tokens), ("a_tokens_tensor", a_tokens_tensor)):
        if given is not None:
            setattr(o, f"_{name}", given)  # alive with o
            setattr(o, name, ctypes.pointer(given))
    o.group_size = group_size
    return o


def merge(out, out_lse, o_a, lse_a, o_b, lse_b, opts=None, stream=None) -> int:
    return load().attnmerge_merge(ref(out), ref(out_lse), ref(o_a), ref(lse_a), ref(o_b), ref(lse_b), ref(opts), stream)


def merge_inplace(o, lse, o_other, lse_other, mask=None, opts=None, stream=None) -> int:
    return load().attnmerge_merge_inplace(ref(o), ref(lse), ref(o_other), ref(lse_other), ref(mask), ref(opts), stream)


def merge_states(out, out_lse, o, lse, opts=None, stream=None) -> int:
    return load().attnmerge_merge_states(ref(out), ref(out_lse), ref(o), ref(lse), ref(opts), stream)


def merge_varlen(out, out_lse, o, lse, indptr, opts=None, stream=None) -> int:
    return load().attnmerge_merge_varlen(ref(out), ref(out_lse), ref(o), ref(lse), ref(indptr), ref(opts), stream)


def merge_share(out, out_lse, o, lse, index, opts=None, stream=None) -> int:
    return load().attnmerge_merge_share(ref(out), ref(out_lse), ref(o), ref(lse), index, ref(opts), stream)


def merge_backward(grad_o_a, grad_lse_a, grad_o_b, grad_lse_b, grad_out, grad_out_lse, out, out_lse, o_a, lse_a, o_b,
                   lse_b, opts=None, stream=None) -> int:
    args = (grad_o_a, grad_lse_a, grad_o_b, grad_lse_b, grad_out, grad_out_lse, out, out_lse, o_a, lse_a, o_b, lse_b)
    return load().attnmerge_merge_backward(*(ref(a) for a in args), ref(opts), stream)


def merge_states_backward(grad_o, grad_lse, grad_out, grad_out_lse, out, out_lse, o, lse, opts=None, stream=None) -> int:
    args = (grad_o, grad_lse, grad_out, grad_out_lse, out, out_lse, o, lse)
    return load().attnmerge_merge_states_backward(*(ref(a) for a in args), ref(opts), stream)


def merge_varlen_backward(grad_o, grad_lse, grad_out, grad_out_lse, out, out_lse, o, lse, indptr, opts=None,
                          stream=None) -> int:
    args = (grad_o, grad_lse, grad_out, grad_out_lse, out, out_lse, o, lse, indptr)
    return load().attnmerge_merge_varlen_backward(*(ref(a) for a in args), ref(opts), stream)


def exchange(rank, o, lse, pads, o_layout, lse_layout, *, timeout_ns=10**9, reuse=WAIT_READERS, struct_size=None,
             sum=None):
    """An Exchange of rank `rank`: o, lse, pads and sum (None: NULL, LSEs) one address each (int) per
    rank, o_layout and lse_layout Tensors (their data unread)."""
    x = Exchange()
    x.struct_size = ctypes.sizeof(Exchange) if struct_size is None else struct_size
    x.rank = rank
    x.world_size = len(pads)
    x.reuse = reuse
    x.timeout_ns = timeout_ns
    for field, entries in (("o", o), ("lse", lse), ("pads", pads), ("sum", sum)):
        if entries is None:
            continue
        array = (c_void_p * max(1, len(entries)))(*entries)
        setattr(x, "_" + field, array)  # alive with x
        setattr(x, field, ctypes.cast(array, POINTER(c_void_p)))
    x.o_layout = o_layout
    x.lse_layout = lse_layout
    return x


def exchange_publish(x, epoch=0, stream=None) -> int:
    return load().attnmerge_exchange_publish(ref(x), epoch, stream)


def merge_exchange(out, out_lse, x, slice=SLICE_HEADS, slice_begin=0, epoch=0, opts=None, stream=None) -> int:
    return load().attnmerge_merge_exchange(ref(out), ref(out_lse), ref(x), slice, slice_begin, epoch, ref(opts), stream)


def exchange_status(x, stream=None) -> int:
    return load().attnmerge_exchange_status(ref(x), stream)
