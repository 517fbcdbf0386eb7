"""A call of one op as every road takes it: its options normalised once into one record, `Options`,
which the binding and the XLA handlers read field by field (python/src/call_options.h), and from
which the torch ops' arguments and attnmerge.jax's attributes are made.  This module is the one
reading of every option (bases, per-group FP8, output scales, a_tokens, the states' axis,
merge_share's index, the caller's names) and the one description of the ops (`OPS`): a new option
is a field here and its uses, not a parameter of every layer.
"""
from __future__ import annotations

import inspect
import math
import operator
from collections.abc import Mapping
from typing import Any, NamedTuple

from . import _C
from ._arrays import dtype_name
from ._types import O_IN_DTYPES


class Options(NamedTuple):
    """One call's options, normalised (`options` makes it).  The first fields, in _C.OPTION_FIELDS'
    order, are what the binding and the XLA handlers read; the last what Python does around the
    call (allocating results, gradients)."""

    flags: int = 0  # the C ABI's attnmerge_options.flags: bases, PDL, scales, block formats, [heads, tokens] LSEs
    a_tokens: int = -1  # the two-way merge's a_tokens; -1: none
    output_scale: float = 0.0  # FP8 outputs store value / output_scale; 0: none (or `scale`)
    group_size: int = 0  # per-group FP8's group, or the block format's block; 0: none
    index: int = 0  # merge_share's state
    states_axis: int = 1  # the axis of S in o (and lse): 1 is [tokens, S, ...]
    scale: Any = None  # output_scale given as a one-element float32 array, read on the device
    sink: Any = None  # float32 [heads]
    group_scales: Any = None  # given, or allocated like out once group_size is known
    sum_a: Any = None  # the softmax sums of the first LSE argument (which then holds maxima)
    sum_b: Any = None  # of the second (the two-way merge's lse_b, the in-place merge's lse_other)
    valid: Any = None  # which states hold keys: uint8, bool, int32 or int64, 0 where one holds none
    num_tokens: Any = None  # the live tokens: a one-element int32 or int64 array read on the device
    a_tokens_tensor: Any = None  # a_tokens given as such an array (a_tokens then -1)
    names: Mapping[str, str] | None = None  # {argument: the caller's name}, for every message
    stream: Any = None
    bases: tuple = ("e", "e", "e")  # a's (every input's), b's, the merged LSE's: "e" or 2
    out_dtype: str | None = None  # the result's dtype name; None: the input's
    return_lse: bool = True

    @property
    def pdl(self) -> bool:
        return bool(self.flags & _C.PDL)

    @property
    def scale_ue8m0(self) -> bool:
        return bool(self.flags & _C.GROUP_SCALE_UE8M0)

    @property
    def batch_invariant(self) -> bool:
        return bool(self.flags & _C.BATCH_INVARIANT)

    @property
    def block_format(self) -> str | None:
        """The block-scaled format ("mxfp8", "nvfp4"), or None."""
        return "nvfp4" if self.flags & _C.BLOCK_NVFP4 else "mxfp8" if self.flags & _C.BLOCK_MXFP8 else None

    @property
    def scale_layout(self) -> str:
        return "swizzled" if self.flags & _C.SCALE_SWIZZLED else "row_major"

    @property
    def scale_rounding(self) -> str:
        return "rceil" if self.flags & _C.SCALE_RCEIL else "floor"


if Options._fields[:len(_C.OPTION_FIELDS)] != _C.OPTION_FIELDS:  # the binding reads them by position
    raise ImportError(f"attnmerge: the binding reads the options {_C.OPTION_FIELDS}, the package records "
                      f"{Options._fields}: a build of mismatched parts")

_NEW = tuple.__new__  # an Options from its fields at C speed (the per-call path)
_E3 = ("e", "e", "e")
DEFAULT = Options()


class Op(NamedTuple):
    """What an op is, for every layer above the binding: its arrays in the C ABI's order, the one
    its results are allocated like (and whose type picks the road), its options, and where its LSE
    arguments are (each may come as softmax statistics, a (max, sum) tuple: its sums are the
    record's sum_a and sum_b, in this order)."""

    name: str
    inputs: tuple  # the arrays it reads, named as the C ABI names them
    like: int  # the input the results are allocated like; -1: none (the in-place merge writes its inputs)
    takes: frozenset  # the options (Options' fields, and base's pair form: "pair") it takes
    lses: tuple  # the positions in `inputs` of its LSE arguments: the first's sums are sum_a, the second's sum_b
    binding: Any  # its function in attnmerge._C: (outputs, inputs, the Options record)
    axis_ndim: int = 0  # states_axis_of's ndim for its states_axis: o's 4 (merge_states), a share's lse's 3


_FORWARD = frozenset({"output_scale", "out_base", "sink", "group_size", "out_dtype", "return_lse", "batch_invariant",
                      "valid", "num_tokens"})
OPS = {op.name: op for op in (
    Op("merge", ("o_a", "lse_a", "o_b", "lse_b"), 2, _FORWARD | {"a_tokens", "pair"}, (1, 3), _C.merge),
    Op("merge_inplace", ("o", "lse", "o_other", "lse_other", "mask"), -1,
       frozenset({"pair", "batch_invariant", "valid", "num_tokens"}), (1, 3), _C.merge_inplace),
    Op("merge_states", ("o", "lse"), 0, _FORWARD | {"states_axis"}, (1,), _C.merge_states, 4),
    Op("merge_varlen", ("o", "lse", "indptr"), 0, _FORWARD, (1,), _C.merge_varlen),
    Op("merge_share", ("o", "lse"), 0, _FORWARD | {"states_axis", "index"}, (1,), _C.merge_share, 3),
)}
SUMS = ("sum_a", "sum_b")  # the record's sums of an op's LSE arguments (Op.lses), in order


def named(names, arg):
    """The caller's name of the argument `arg`: a compat layer's (`names`, {native: its own}), else
    `arg`.  Every message names arguments through it, so that a compat layer's caller reads its own
    names (vLLM's prefix_output for o_a)."""
    return arg if names is None else names.get(arg, arg)


def softmax_stats(op: Op, inputs, names=None):
    """(inputs, sum_a, sum_b, names): an op's inputs with each LSE argument given as softmax
    statistics, a (max, sum) tuple of arrays, replaced by its maxima, and the sums apart (None:
    that argument is an LSE), for the record's sum_a and sum_b; the caller's names then call the
    two arrays of a tuple `lse_a[0]` and `lse_a[1]` (the C ABI's lse_a and sum_a)."""
    for i in op.lses:
        if type(inputs[i]) is tuple:
            break
    else:  # LSEs: the per-call case
        return inputs, None, None, names
    inputs, sums, given = list(inputs), [None, None], names
    names = dict(names or {})
    for k, i in enumerate(op.lses):
        if not isinstance(inputs[i], tuple):
            continue
        arg = named(given, op.inputs[i])
        if len(inputs[i]) != 2:
            raise ValueError(f"{arg}: expected an array or a (max, sum) tuple of float32 arrays, got a tuple of "
                             f"{len(inputs[i])}")
        inputs[i], sums[k] = inputs[i]
        names[op.inputs[i]], names[SUMS[k]] = f"{arg}[0]", f"{arg}[1]"
    return tuple(inputs), sums[0], sums[1], names


def lse_only(lse, arg):
    """An LSE argument of a backward: an array, not softmax statistics (the backwards take LSEs)."""
    if isinstance(lse, tuple):
        raise TypeError(f"{arg}: expected an array of LSEs, got a tuple: the backwards take LSEs, not (max, sum) "
                        f"softmax statistics (pass max + log(sum); the frameworks' autograd converts them itself)")
    return lse


def _is_base2(base, name: str, expected: str = "'e' or 2") -> bool:
    """Whether an LSE base is 2: 'e' (natural log) or 2 (log2-sum-exp2); else a ValueError naming `name`."""
    if isinstance(base, str) and base == "e":
        return False
    if not isinstance(base, (bool, str, tuple)) and base == 2:
        return True
    raise ValueError(f"{name}: expected {expected}, got {base!r}")


def lse_bases(base, out_base=None, *, pair: bool = False, names=None) -> tuple:
    """The LSE bases of a call, checked, as ('e' or 2) for (a, b, out): `base` every input LSE's, or
    for the two-way and in-place merges (pair) a pair (a's, b's); out_base the merged LSE's (None:
    a's)."""
    name = named(names, "base")
    expected = "'e', 2 or a pair of them (a's base, b's)" if pair else "'e' or 2"
    if pair and isinstance(base, tuple):
        try:
            if len(base) != 2:
                raise ValueError
            a, b = (2 if _is_base2(x, name) else "e" for x in base)
        except ValueError:
            raise ValueError(f"{name}: expected {expected}, got {base!r}") from None
    else:
        a = b = 2 if _is_base2(base, name, expected) else "e"
    out = a if out_base is None else (2 if _is_base2(out_base, named(names, "out_base"), "None, 'e' or 2") else "e")
    return a, b, out


def base_flags(bases) -> int:
    """C ABI flags for the bases (a, b, out): ATTNMERGE_LSE_BASE2 for a's, and b's and the merged
    LSE's own flags where they differ from a's."""
    a, b, out = bases
    flags = _C.LSE_BASE2 if a == 2 else 0
    if b != a:
        flags |= _C.LSE_B_BASE2 if b == 2 else _C.LSE_B_BASE_E
    if out != a:
        flags |= _C.OUT_LSE_BASE2 if out == 2 else _C.OUT_LSE_BASE_E
    return flags


def base_change(from_base, to_base) -> float:
    """The factor that turns an LSE of base `from_base` into one of `to_base` (1 where they agree)."""
    return 1.0 if from_base == to_base else math.log(2.0) if from_base == 2 else 1.0 / math.log(2.0)


def _numpy_bool(value):
    """Whether value is NumPy's bool scalar: numpy.bool (NumPy 2) or numpy.bool_ (NumPy 1)."""
    return type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_")


def _flag(value, arg, names):
    """A boolean option: True or False (numpy's too), nothing else (a "yes" is no flag)."""
    if value is True or value is False or _numpy_bool(value):
        return bool(value)
    raise TypeError(f"{named(names, arg)}: expected True or False, got {value!r}")


def _count(value, arg, names, least=0, expected=None):
    """An int option >= least (any integer type, not a bool); `expected` words the refusal."""
    if not isinstance(value, bool):
        try:
            value = operator.index(value)
        except TypeError:
            pass
        else:
            if value >= least:
                return value
    raise ValueError(f"{named(names, arg)}: expected {expected or f'None or an int >= {least}'}, got {value!r}")


def output_scale_of(output_scale, names=None):
    """(number, array): output_scale as the layers below take it.  None is no scale (0, the C ABI's
    spelling of none), a number a scale (0 refused here, so that no layer mistakes it for none; the
    C ABI checks the rest: finite, > 0, FP8 outputs only or 1), anything else a one-element float32
    array read on the device."""
    if output_scale is None:
        return 0.0, None
    if isinstance(output_scale, (int, float)) and not isinstance(output_scale, bool):
        if output_scale == 0:
            raise ValueError(f"{named(names, 'output_scale')}: expected None or a finite scale > 0, got "
                             f"{output_scale!r}")
        return float(output_scale), None
    if isinstance(output_scale, bool):
        raise TypeError(f"{named(names, 'output_scale')}: expected None, a number or a one-element float32 array, "
                        f"got {output_scale!r}")
    return 0.0, output_scale


def states_axis_of(states_axis, ndim, names=None):
    """The states' axis of an array of `ndim` dimensions (o's 4, or a share's lse's 3) as a
    position from 0: any axis but o's last (head_size), negative from the end."""
    if type(states_axis) is int and states_axis == 1:  # the C ABI's own layout: the per-call case
        return 1
    last = ndim - 1 if ndim == 4 else ndim  # o's head_size is no states axis; a share's lse has none
    axis = None
    if not isinstance(states_axis, bool) and not _numpy_bool(states_axis):
        try:
            axis = operator.index(states_axis)  # any integer, NumPy's too
        except TypeError:
            pass
    if axis is not None and -ndim <= axis < ndim and axis % ndim < last:
        return axis % ndim
    axes = ", ".join(str(i) for i in range(last))
    raise ValueError(f"{named(names, 'states_axis')}: expected one of {axes} (or from the end, "
                     f"{-ndim} to {last - ndim - 1}), got {states_axis!r}")


# The block-scaled formats: (C ABI flag, block, the dtype of an FP8 out) by name.
BLOCK_FORMATS = {"mxfp8": (_C.BLOCK_MXFP8, 32, "float8_e4m3fn"), "nvfp4": (_C.BLOCK_NVFP4, 16, None)}
_LAYOUTS = {"row_major": 0, "swizzled": _C.SCALE_SWIZZLED}
_ROUNDINGS = {"floor": 0, "rceil": _C.SCALE_RCEIL}


def _choice(value, arg, choices, names):
    if isinstance(value, str) and value in choices:
        return choices[value]
    raise ValueError(f"{named(names, arg)}: expected {' or '.join(repr(c) for c in choices)}, got {value!r}")


def block_flags(block_format, scale_layout, scale_rounding, group_size, scale_ue8m0, names):
    """(C ABI flags, block) of a block-scaled format's options, checked; (0, 0) without one (where
    the layout and rounding must be their defaults)."""
    if block_format is None:
        for arg, value, default in (("scale_layout", scale_layout, "row_major"),
                                    ("scale_rounding", scale_rounding, "floor")):
            if value != default:
                raise ValueError(f"{named(names, arg)}: expected {default!r} without block_format, got {value!r}")
        return 0, 0
    flag, block, _ = _choice(block_format, "block_format", BLOCK_FORMATS, names)
    for arg, value, default in (("group_size", group_size, None), ("scale_ue8m0", scale_ue8m0, False)):
        if value is not default and value != default:
            raise ValueError(f"{named(names, arg)}: expected {default} with block_format (its block is "
                             f"{block}, its scales its own), got {value!r}")
    flags = flag | _choice(scale_layout, "scale_layout", _LAYOUTS, names)
    rounding = _choice(scale_rounding, "scale_rounding", _ROUNDINGS, names)
    if rounding and flag != _C.BLOCK_MXFP8:
        raise ValueError(f"{named(names, 'scale_rounding')}: expected 'floor' (the default) for {block_format} "
                         f"(MXFP8's scales alone are rounded), got {scale_rounding!r}")
    return flags | rounding, block


def options(op: Op, out=None, return_lse=True, out_dtype=None, output_scale=None, base="e", out_base=None,
            a_tokens=None, sink=None, group_size=None, group_scales=None, scale_ue8m0=False, states_axis=1,
            index=0, stream=None, pdl=False, names=None, batch_invariant=False, flags=0, block_format=None,
            scale_layout="row_major", scale_rounding="floor", sum_a=None, sum_b=None, valid=None,
            num_tokens=None) -> Options:
    """The one reading of a call's options: every public function, the torch ops' kernels and
    attnmerge.jax make their Options here.  Checks what Python must know before the C ABI does (the
    types of options, bases, what allocation needs); the C ABI checks every value against the
    arrays.  `flags`: C ABI flags a layer adds of its own (the vLLM layer's [heads, tokens] LSEs).
    The public functions pass every option positionally, in this order (the per-call path); sum_a
    and sum_b (softmax_stats' sums), valid and num_tokens by keyword.  num_tokens: a one-element
    int32 or int64 array on the arrays' device, the live tokens (an int is refused: a count known
    on the host is a slice of the arrays)."""
    if base == "e" and out_base is None:
        bases = _E3
    else:
        bases = lse_bases(base, out_base, pair="pair" in op.takes, names=names)
        flags |= base_flags(bases)
    if pdl is not False:
        flags |= _C.PDL if _flag(pdl, "pdl", names) else 0
    if batch_invariant is not False:
        flags |= _C.BATCH_INVARIANT if _flag(batch_invariant, "batch_invariant", names) else 0
    group = 0
    if block_format is not None or scale_layout != "row_major" or scale_rounding != "floor":
        block, group = block_flags(block_format, scale_layout, scale_rounding, group_size, scale_ue8m0, names)
        flags |= block
        fp8 = BLOCK_FORMATS[block_format][2]
        if fp8 is None and out_dtype is not None:
            raise ValueError(f"{named(names, 'out_dtype')}: expected None for {block_format} (out is uint8, two "
                             f"values per byte), got {out_dtype!r}")
        if out is None and out_dtype is None and fp8 is not None:
            out_dtype = fp8
    elif group_size is not None:
        group = _count(group_size, "group_size", names, least=1, expected="None or a power of two >= 8")
        if out is None and out_dtype is None:
            out_dtype = "float8_e4m3fn"
        flags |= _C.GROUP_SCALE_UE8M0 if _flag(scale_ue8m0, "scale_ue8m0", names) else 0
    elif scale_ue8m0 is not False:
        raise ValueError(f"{named(names, 'scale_ue8m0')}: expected False without group_size, got {scale_ue8m0!r}")
    number, scale = (0.0, None) if output_scale is None else output_scale_of(output_scale, names)
    a_tokens_tensor = None
    if a_tokens is not None and getattr(a_tokens, "ndim", 0) >= 1:  # an array: read on the device
        a_tokens_tensor, a_tokens = a_tokens, None
    elif a_tokens is not None:
        a_tokens = _count(a_tokens, "a_tokens", names,
                          expected="None, an int >= 0 or a one-element int32 or int64 array")
    if out_dtype is not None:
        out_dtype = dtype_name(out_dtype, named(names, "out_dtype"))
    if return_lse is not True:
        return_lse = _flag(return_lse, "return_lse", names)
    if num_tokens is not None and (isinstance(num_tokens, (bool, int)) or type(num_tokens).__module__ == "builtins"):
        raise TypeError(f"{named(names, 'num_tokens')}: expected None or a one-element int32 or int64 array on the "
                        f"arrays' device, got {num_tokens!r} (a count known on the host is a slice of the arrays)")
    return _NEW(Options, (flags, -1 if a_tokens is None else a_tokens, number, group, index, states_axis, scale,
                          sink, group_scales, sum_a, sum_b, valid, num_tokens, a_tokens_tensor, names, stream, bases,
                          out_dtype, return_lse))


def read_call(op: Op, params):
    """(inputs, out, out_lse, Options) of a public call of `op`, its parameters {name: value} by
    its signature's names: softmax statistics split off (softmax_stats), then every option read
    (states_axis_of, index_of, options).  The public functions' per-call path (`public_call`)
    comes here for any call whose options are not all their defaults."""
    names = params.pop("_names")
    inputs, sum_a, sum_b, stats_names = softmax_stats(op, tuple(params.pop(arg) for arg in op.inputs), names)
    out, out_lse = params.pop("out", None), params.pop("out_lse", None)
    if "states_axis" in params:
        params["states_axis"] = states_axis_of(params["states_axis"], op.axis_ndim, names)
    if "index" in params:
        params["index"] = index_of(params["index"], names)
    return inputs, out, out_lse, options(op, out, names=stats_names, sum_a=sum_a, sum_b=sum_b, **params)


# How attnmerge._C.caller takes each parameter of a public function (road.h's Slot, numbered by
# the binding): an input, out, out_lse, a record field as it is, a record field where it is an
# int, or an option that must be its default for the per-call path.
_INPUT, _OUT, _OUT_LSE, _FIELD, _INT_FIELD, _DEFAULT = (
    _C.CALLER_SLOTS.index(kind) for kind in ("input", "out", "out_lse", "field", "int_field", "default"))
_FIELDS = {"stream": (_FIELD, "stream"), "_names": (_FIELD, "names"), "index": (_INT_FIELD, "index")}


def public_call(op: Op, function):
    """`function`'s per-call path, `call(*params)` with its parameters in its signature's order:
    a call whose options are all their defaults (outputs, stream and names aside; merge_share's
    index an int) has the record options() would read, DEFAULT with those fields (made in C, no
    Python frame); any other is read by read_call.  Then the call's road (attnmerge._C.road)."""
    slots, defaults = [], []
    params = tuple(inspect.signature(function).parameters.values())
    for p in params:
        if p.name in op.inputs:
            slot = (_INPUT, op.inputs.index(p.name))
        elif p.name in ("out", "out_lse"):
            slot = (_OUT if p.name == "out" else _OUT_LSE, 0)
        elif p.name in _FIELDS:
            kind, field = _FIELDS[p.name]
            slot = (kind, Options._fields.index(field))
        elif p.default is inspect.Parameter.empty:
            raise TypeError(f"{function.__name__}: its option {p.name} has no default")
        else:
            slot = (_DEFAULT, 0)
        slots.append(slot)
        defaults.append(None if p.default is inspect.Parameter.empty else p.default)
    arg_names = tuple(p.name for p in params)
    lses = tuple(arg_names.index(op.inputs[i]) for i in op.lses)

    def read(op, args):
        return read_call(op, dict(zip(arg_names, args)))

    call = _C.caller(op, tuple(slots), tuple(defaults), lses, DEFAULT, read)
    CALLERS.append((call, op, read))
    return call


# Every public function's per-call path, (call, op, read): what a tracer that cannot enter C
# (torch.compile's Dynamo) runs instead, in Python (attnmerge._torch_ops).
CALLERS: list = []


def index_of(index, names=None):
    """merge_share's index as an int (any integer, NumPy's too; not a bool): the C ABI checks its range."""
    if not isinstance(index, bool):
        try:
            return operator.index(index)
        except TypeError:
            pass
    raise TypeError(f"{named(names, 'index')}: expected an int, got {index!r} ({type(index).__qualname__})")


def result_dtype(opt: Options, in_dtype_of, src_name):
    """The dtype name of a merge's O result: opt.out_dtype, else that of `in_dtype_of` (the input
    `src_name`)."""
    if opt.out_dtype is not None:
        return opt.out_dtype
    dtype = getattr(in_dtype_of, "dtype", None)
    if dtype is None:
        raise TypeError(f"{named(opt.names, src_name)}: expected an array, got {kind_of(in_dtype_of)}")
    return dtype_name(dtype, named(opt.names, src_name), O_IN_DTYPES)


def kind_of(x):
    """What a non-array is called in a message: None as None (the binding and the C ABI say so too)."""
    return "None" if x is None else type(x).__qualname__


def lse_dtype(o_dtype):
    """The LSE dtype that goes with an O dtype: float64 with float64 (a float64 call is float64 whole),
    else float32."""
    return "float64" if o_dtype == "float64" else "float32"


def shape_of(x, arg, names=None):
    shape = getattr(x, "shape", None)
    if shape is None:
        raise TypeError(f"{named(names, arg)}: expected an array, got {kind_of(x)}")
    return tuple(shape)


def result_shape(op: Op, inputs, opt: Options):
    """The [rows, heads, head_size] of an op's O result, from its inputs' shapes."""
    names = opt.names
    if op.name == "merge":
        return shape_of(inputs[2], "o_b", names)
    o = shape_of(inputs[0], "o", names)
    want = 4 if op.name == "merge_states" else 3
    if len(o) != want:
        raise ValueError(f"{named(names, 'o')}: expected {want} dimensions, got {len(o)} (shape {list(o)})")
    if op.name == "merge_states":
        rest = [n for i, n in enumerate(o) if i != opt.states_axis]
        return (rest[0], rest[1], rest[2])
    if op.name == "merge_varlen":
        n = shape_of(inputs[2], "indptr", names)
        if len(n) != 1 or n[0] < 1:
            raise ValueError(f"{named(names, 'indptr')}: expected shape [rows + 1] with rows >= 0, got {list(n)}")
        return (n[0] - 1, o[1], o[2])
    return o


def scales_of(rows, heads, head_size, opt: Options):
    """(shape, dtype name) of a call's group scales: float32 [rows, heads, head_size // group] for
    per-group FP8; a block format's bytes (MXFP8's UE8M0 as uint8, NVFP4's float8_e4m3fn) in that
    shape, or swizzled in the 128 x 4 tiles [ceil(rows / 128), ceil(heads * blocks / 4), 512]."""
    fmt, per_head = opt.block_format, head_size // opt.group_size
    dtype = "float32" if fmt is None else "uint8" if fmt == "mxfp8" else "float8_e4m3fn"
    if opt.flags & _C.SCALE_SWIZZLED:
        return (-(-rows // 128), -(-heads * per_head // 4), 512), dtype
    return (rows, heads, per_head), dtype
