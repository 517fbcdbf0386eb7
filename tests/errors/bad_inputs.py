"""The one table of bad inputs: each row one mistake made to one entry point's valid call.

A row says the entry point (`op`), how its valid baseline call is broken (`change`), the exception
(or the C status) expected, and the words the message must contain as whole words: the argument's
name and, where there is one, the expected and the actual value.  tests/errors/test_bad_inputs.py
feeds each row through every layer it names and checks, on each, the error, the message, and that no
byte of any array the call was given changed (every output starts poisoned: 0xFF bytes, a NaN in
every float format).

Layers (`layers`):
    cpu   the Python entry point with NumPy arrays;
    cuda  the same with the device fixture's `cuda` arrays (torch tensors; tests/devices.py): only
          for mistakes a copy to the device keeps (shapes, dtypes, values, options), not for memory
          (strides, overlap, alignment, read-only flags);
    c     the same arrays as C ABI descriptors (tests/c_abi.py), the status ERROR_TYPE for a
          TypeError and ERROR_VALUE for a ValueError.
Entry points: the native API (merge, merge_inplace, merge_states, merge_varlen, merge_share,
merge_states_backward),
the compat layers (vllm, fi.*), and, with changes to their own descriptors, the raw layer
(raw.merge: attnmerge.raw's tuples) and the C ABI (c.*: the ctypes descriptors).

A new bad input is a new row: `Bad(id, op, change, error, *words, ...)`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np
import pytest

import c_abi
import devices
from oracle import np_dtype, random_lse, random_o

T, S, H, D = 8, 4, 3, 16  # tokens, states, heads, head_size of every valid baseline
INDPTR = (0, 3, 3, 7, 10)  # merge_varlen's baseline: 4 rows of the TOTAL states
TOTAL, N_ROWS = INDPTR[-1], len(INDPTR) - 1
POISON = 0xFF  # 0xFF..: NaN in float32, float16, bfloat16 and float8_e4m3fn
FP8 = "float8_e4m3fn"
NATIVE_NAMES = ("o_a", "o_b", "lse_a", "lse_b", "o_other", "lse_other")  # never in a compat layer's messages


def _gpus() -> int:
    return c_abi.load().attnmerge_device_count()


NO_GPU = _gpus() == 0


# --------------------------------------------------------------------------------------------------
# arrays


def dtype_of(name):
    return np_dtype(name) if name != FP8 else np.dtype(__import__("ml_dtypes").float8_e4m3fn)


def poisoned(shape, dtype="float32"):
    """An output whose every byte is 0xFF (NaN)."""
    dt = dtype_of(dtype) if isinstance(dtype, str) else np.dtype(dtype)
    return np.full(int(np.prod(shape)) * dt.itemsize, POISON, np.uint8).view(dt).reshape(shape)


def misaligned(shape, dtype="float32", offset=2, fill=POISON):
    """An array whose data pointer is `offset` bytes past an aligned address."""
    dt = dtype_of(dtype)
    n = int(np.prod(shape)) * dt.itemsize
    store = np.full(n + 64, fill, np.uint8)
    start = (-store.ctypes.data) % 64 + offset
    return store[start:start + n].view(dt).reshape(shape)


def read_only(x):
    x = x.copy()
    x.flags.writeable = False
    return x


class OnHost:
    """An array a row keeps in host memory on every layer (the `cuda` layer puts the others on its
    device): a tensor on another device than the call's (ELSEWHERE: its rows' marks)."""

    def __init__(self, array):
        self.array = array


# A row of a tensor on another device: only where the `cuda` layer's arrays are on a GPU.
ELSEWHERE = (pytest.mark.skipif(devices.CUDA_AS == "cpu",
                                reason="the cuda device holds host tensors (ATTNMERGE_TEST_CUDA_AS=cpu)"),)


class Args(dict):
    """One call's arguments by name (arrays and others), its keyword options, and the other buffers
    whose bytes must not change (`extra`).  For the C ABI's rows the values are descriptors and
    `arrays` holds what they describe; `use` passes an array as an argument."""

    def __init__(self, rng, values, options=None):
        super().__init__(values)
        self.rng = rng
        self.options = dict(options or {})
        self.extra = []
        self.arrays = {}

    def o(self, shape, dtype="float32"):
        return random_o(self.rng, shape, dtype)

    def lse(self, shape):
        return random_lse(self.rng, shape)

    def use(self, name, array):
        self.arrays[name] = array
        self[name] = c_abi.tensor_from(array)


def baseline(op, rng) -> Args:
    """A valid call of `op` (the raw layer's and the C ABI's: of the Python op they stand for)."""
    family = op.split(".", 1)[1] if op.startswith("c.") else op
    o, lse = (lambda *s: random_o(rng, s)), (lambda *s: random_lse(rng, s))
    if family in ("merge", "raw.merge"):
        return Args(rng, dict(o_a=o(T, H, D), lse_a=lse(T, H), o_b=o(T, H, D), lse_b=lse(T, H), out=poisoned((T, H, D)),
                              out_lse=poisoned((T, H))))
    if family == "merge_inplace":
        return Args(rng, dict(o=o(T, H, D), lse=lse(T, H), o_other=o(T, H, D), lse_other=lse(T, H), mask=None))
    if family == "merge_states":
        return Args(rng, dict(o=o(T, S, H, D), lse=lse(T, S, H), out=poisoned((T, H, D)), out_lse=poisoned((T, H))))
    if family == "merge_varlen":
        return Args(rng, dict(o=o(TOTAL, H, D), lse=lse(TOTAL, H), indptr=np.array(INDPTR, np.int32),
                              out=poisoned((N_ROWS, H, D)), out_lse=poisoned((N_ROWS, H))))
    if family == "merge_share":
        return Args(rng, dict(o=o(T, H, D), lse=lse(T, S, H), index=1, out=poisoned((T, H, D)), out_lse=poisoned((T, H))))
    if family == "merge_states_backward":
        return Args(rng, dict(grad_out=o(T, H, D), grad_out_lse=lse(T, H), out=o(T, H, D), out_lse=lse(T, H),
                              o=o(T, S, H, D), lse=lse(T, S, H), grad_o=poisoned((T, S, H, D)), grad_lse=poisoned((T, S, H))))
    if family == "vllm":  # vLLM's LSEs are [heads, tokens]
        return Args(rng, dict(output=poisoned((T, H, D)), prefix_output=o(T, H, D), prefix_lse=lse(H, T),
                              suffix_output=o(T, H, D), suffix_lse=lse(H, T), output_lse=poisoned((H, T))))
    if family == "fi.merge_state":
        return Args(rng, dict(v_a=o(T, H, D), s_a=lse(T, H), v_b=o(T, H, D), s_b=lse(T, H)))
    if family == "fi.merge_state_in_place":
        return Args(rng, dict(v=o(T, H, D), s=lse(T, H), v_other=o(T, H, D), s_other=lse(T, H), mask=None))
    if family == "fi.merge_states":
        return Args(rng, dict(v=o(T, S, H, D), s=lse(T, S, H)))
    if family == "fi.variable_length_merge_states":
        return Args(rng, dict(v=o(TOTAL, H, D), s=lse(TOTAL, H), indptr=np.array(INDPTR, np.int32)))
    if family == "stream_synchronize":
        return Args(rng, {})
    raise ValueError(op)


def raw_descriptors(a: Args) -> Args:
    """attnmerge.raw.merge's keywords over the merge baseline's arrays."""
    def od(x):
        return (x.ctypes.data, x.dtype.name, x.strides[0] // x.itemsize, x.strides[1] // x.itemsize)

    def ld(x):
        return (x.ctypes.data, x.strides[0] // x.itemsize, x.strides[1] // x.itemsize)

    kw = Args(a.rng, dict(tokens=T, heads=H, head_size=D, out=od(a["out"]), out_lse=ld(a["out_lse"]), o_a=od(a["o_a"]),
                          lse_a=ld(a["lse_a"]), o_b=od(a["o_b"]), lse_b=ld(a["lse_b"]), device="cpu"))
    kw.arrays = {k: v for k, v in a.items() if isinstance(v, np.ndarray)}
    return kw


# --------------------------------------------------------------------------------------------------
# the rows


@dataclass(frozen=True)
class Bad:
    id: str
    op: str
    change: object  # (Args) -> None: breaks the baseline call, in place
    error: object  # an exception type (or a tuple of them); a C status for the c.* ops
    words: tuple = ()  # whole words the message must contain
    layers: tuple = ("cpu",)
    absent: tuple = ()  # whole words it must not contain
    starts: str | None = None  # the message must start with this
    exact: str | None = None  # the message must be this
    contains: tuple = ()  # substrings it must contain
    check: object = None  # (message) -> None: any other rule of the message
    c_error: int | None = None  # the C status where it is not the one the Python error implies
    marks: tuple = field(default_factory=tuple)


def names(word, msg: str) -> bool:
    """`word` occurs in msg as a whole word or number ("output" is not in "prefix_output", "8" not in "18")."""
    return re.search(r"(?<![\w.-])" + re.escape(str(word)) + r"(?![\w.])", msg) is not None


ROWS: list[Bad] = []


def bad(id, op, change, error, *words, layers=("cpu",), **kw):
    if op.startswith(("c.", "raw.")):
        layers = (op.split(".")[0],)  # their own descriptors: one layer
    ROWS.append(Bad(id, op, change, error, tuple(str(w) for w in words), tuple(layers), **kw))


ANY = ("cpu", "cuda", "c")  # a shape, dtype or value: every layer
PY = ("cpu", "cuda")  # what only the Python layer sees (non-arrays, options)
HOST = ("cpu", "c")  # memory: strides, overlap, alignment, read-only flags
ERR_T, ERR_V = c_abi.ERROR_TYPE, c_abi.ERROR_VALUE


# change helpers: each returns a change (Args) -> None


def to(name, value):
    """Argument `name` becomes value(a[name], a) if value is callable, else value (a copy of an array)."""
    def change(a):
        if callable(value):
            a[name] = value(a[name], a)
        else:
            a[name] = np.array(value, copy=True) if isinstance(value, np.ndarray) else value
    return change


def astype(*names_, dtype):
    def change(a):
        for n in names_:
            a[n] = a[n].astype(dtype)
    return change


def shaped(name, shape):
    """Argument `name` an array of another shape, of its dtype: random for an input, poisoned for an output."""
    def change(a):
        dtype = a[name].dtype
        a[name] = a.o(shape, dtype.name) if _is_input(name) else poisoned(shape, dtype)
    return change


def _is_input(name):
    return not (name.startswith(("out", "grad_o", "grad_lse")) or name == "output")


def options(**opts):
    def change(a):
        a.options.update(opts)
    return change


def both(*changes):
    def change(a):
        for c in changes:
            c(a)
    return change


def unit_stride_broken(name):
    """The head_size axis (the innermost) of `name` strided by 2 over a buffer that holds it."""
    def change(a):
        x = a[name]
        shape = x.shape[:-1] + (2 * x.shape[-1],)
        buf = a.o(shape, x.dtype.name) if _is_input(name) else poisoned(shape, x.dtype)
        a[name] = buf[..., ::2]
        a.extra.append(buf)
    return change


def zero_strided(name, strides_bytes, base_elems):
    """`name` a writable as_strided view of a poisoned buffer with the given byte strides."""
    def change(a):
        x = a[name]
        buf = poisoned((base_elems,), x.dtype)
        a[name] = np.lib.stride_tricks.as_strided(buf, shape=x.shape, strides=strides_bytes, writeable=True)
        a.extra.append(buf)
    return change


def indptr_of(values, dtype="int64", rows_out=True):
    """merge_varlen's indptr given; its outputs resized to the rows it has (rows_out)."""
    def change(a):
        a["indptr"] = np.array(values, dtype)
        if rows_out and "out" in a:
            rows = max(len(values) - 1, 0)
            a["out"], a["out_lse"] = poisoned((rows, H, D)), poisoned((rows, H))
    return change


# ================================================================================================
# merge


bad("merge-o_a-2d", "merge", to("o_a", lambda x, a: x[:, 0]), ValueError, "o_a", layers=ANY)
bad("merge-o_a-5d", "merge", to("o_a", lambda x, a: x[None, None]), ValueError, "o_a", layers=PY)
for name, shape in [("o_a", (T, H * D)), ("o_b", (T, H, D, 1)), ("out", (T, H, 1, D)), ("lse_a", (T * H,)),
                    ("lse_b", (T, H, 1)), ("out_lse", (T * H,))]:
    bad(f"merge-ndim-{name}-{len(shape)}d", "merge", to(name, lambda x, a, s=shape: x.reshape(s)), ValueError, name,
        len(shape), layers=ANY)
for name, shape in [("o_b", (T, H + 1, D)), ("o_b", (T, H, D + 1)), ("o_b", (T + 1, H, D)), ("o_a", (T, H, D - 1)),
                    ("out", (T, H, 2 * D)), ("out", (T - 1, H, D)), ("lse_a", (T, H + 1)), ("lse_b", (T + 2, H)),
                    ("out_lse", (T, H - 1)), ("lse_a", (H, T)), ("lse_b", (T, H + 1)), ("out", (T, H, D + 1))]:
    bad(f"merge-shape-{name}-{'x'.join(map(str, shape))}", "merge", shaped(name, shape), ValueError, name, *shape,
        layers=ANY)
# the input at odds with the others is named, against them; two that disagree with no other to side
# with are both named (issue 42: o_b's head size wrong named o_a, o_b's heads wrong named lse_b)
for outputs in ("given", "allocated"):
    alloc = () if outputs == "given" else (to("out", None), to("out_lse", None))
    layers = ANY if outputs == "given" else PY
    bad(f"merge-o_b-head_size-at-odds-with-o_a-outputs-{outputs}", "merge", both(shaped("o_b", (T, H, 2 * D)), *alloc),
        ValueError, exact=f"o_a and o_b: expected the same head_size, got {D} (o_a, shape [{T}, {H}, {D}]) and {2 * D} "
                          f"(o_b, shape [{T}, {H}, {2 * D}])", layers=layers)
    bad(f"merge-o_b-heads-at-odds-with-the-others-outputs-{outputs}", "merge",
        both(shaped("o_b", (T, H + 1, D)), *alloc), ValueError,
        exact=f"o_b: expected shape [{T}, {H}, {D}] (the number of heads of o_a, lse_a and lse_b), got "
              f"[{T}, {H + 1}, {D}]",
        layers=layers)
bad("merge-lse_b-heads-at-odds-with-the-others", "merge", shaped("lse_b", (T, H + 1)), ValueError,
    exact=f"lse_b: expected shape [{T}, {H}] (the number of heads of o_a, lse_a and o_b), got [{T}, {H + 1}]",
    layers=ANY)
bad("merge-o_a-tokens-at-odds-with-the-others", "merge", shaped("o_a", (T + 1, H, D)), ValueError,
    exact=f"o_a: expected shape [{T}, {H}, {D}] (the number of tokens of lse_a, o_b and lse_b), got "
          f"[{T + 1}, {H}, {D}]",
    layers=ANY)
bad("merge-sink-heads-at-odds-with-the-others", "merge", options(sink=np.zeros(H + 1, np.float32)), ValueError,
    exact=f"sink: expected shape [{H}] (the number of heads of o_a, lse_a, o_b and lse_b), got [{H + 1}]", layers=ANY)
# o_a and lse_a against o_b and lse_b: as many on each side, and the source (o_b) decides
bad("merge-state-a-tokens-at-odds-with-state-b", "merge",
    both(to("o_a", lambda x, a: x[:5]), to("lse_a", lambda x, a: x[:5])), ValueError,
    exact=f"o_a: expected shape [{T}, {H}, {D}] (the number of tokens of o_b and lse_b), got [5, {H}, {D}]", layers=ANY)

bad("merge-o_a-fewer-tokens-needs-a_tokens", "merge", both(to("o_a", lambda x, a: x[:5]), to("lse_a", lambda x, a: x[:5])),
    ValueError, "o_a", 5, T, layers=ANY)
bad("merge-a_tokens-past-the-tokens-of-a", "merge",
    both(to("o_a", lambda x, a: x[:5]), to("lse_a", lambda x, a: x[:5]), options(a_tokens=6)), ValueError, "a_tokens",
    layers=ANY)
bad("merge-a_tokens-past-the-tokens", "merge", options(a_tokens=T + 1), ValueError, "a_tokens", T + 1, layers=ANY)
bad("merge-a_tokens-negative", "merge", options(a_tokens=-1), ValueError, "a_tokens", "-1", layers=PY)

# dtypes
bad("merge-o_b-float16-o_a-float32", "merge", astype("o_b", dtype=np.float16), TypeError, "o_b", "float16", "float32",
    layers=ANY)
for dt in ("int32", "int8", "bool"):
    bad(f"merge-o-{dt}", "merge", astype("o_a", "o_b", dtype=dt), TypeError, "o_a", dt, layers=PY)
bad("merge-o-float8-as-input", "merge", astype("o_a", "o_b", dtype=dtype_of(FP8)), TypeError, "o_a", layers=ANY)
for name in ("lse_a", "lse_b", "out_lse"):
    bad(f"merge-{name}-float16", "merge", astype(name, dtype="float16"), TypeError, name, "float32", "float16",
        absent=("bfloat16",), layers=PY)
# a call's O and LSE are float64 all or none: the inputs on the fewer side are named (float64's where
# they are as many), or, where the inputs agree, the outputs at odds with them
bad("merge-o-float64-among-float32", "merge", astype("o_a", "o_b", dtype="float64"), TypeError,
    exact="o_a and o_b: expected dtype float32, float16 or bfloat16 (a call's O and LSE are float64 all or none, and "
          "lse_a is float32), got float64", layers=ANY)
for name in ("lse_a", "lse_b", "out_lse"):
    bad(f"merge-{name}-float64-among-float32", "merge", astype(name, dtype="float64"), TypeError, name, "float32",
        "float64", absent=("bfloat16",), layers=ANY)
bad("merge-lse-float32-among-float64", "merge", astype("o_a", "o_b", "out", "out_lse", "lse_a", dtype="float64"),
    TypeError, exact="lse_b: expected dtype float64 (a call's O and LSE are float64 all or none, and lse_a is "
                     "float64), got float32", layers=ANY)
bad("merge-out-float32-from-float64-inputs", "merge",
    astype("o_a", "o_b", "out_lse", "lse_a", "lse_b", dtype="float64"), TypeError,
    exact="out: expected dtype float64 (a call's O and LSE are float64 all or none, and o_a is float64), got float32",
    layers=ANY)
bad("merge-out-int16", "merge", both(to("out", np.zeros((T, H, D), np.int16)), to("out_lse", None)), TypeError, "out",
    "int16", layers=PY)
bad("merge-out-int32", "merge", to("out", np.full((T, H, D), -1, np.int32)), TypeError, "out", layers=ANY)
for dt in ("int8", "complex64"):
    bad(f"merge-out_dtype-{dt}", "merge", both(to("out", None), options(out_dtype=dt)), TypeError, "out_dtype", dt,
        layers=PY)
# float64 is an O dtype (on the CPU path), but a call's O and LSE are float64 all or none: the
# output allocated from out_dtype is refused as such
bad("merge-out_dtype-float64-from-float32-inputs", "merge", both(to("out", None), options(out_dtype="float64")),
    TypeError, "out", "float64", "float32", layers=PY)
bad("merge-out_dtype-differs-from-out", "merge", options(out_dtype="float16"), (TypeError, ValueError), "out", layers=PY)

# not arrays: None in the same words whichever layer finds it ("got NULL" from C)
_NONE_WORDS = "expected an array, got None"
for name in ("o_a", "lse_a", "o_b", "lse_b"):
    for label, obj in (("None", None), ("str", "array"), ("float", 3.0)):
        for outputs in ("given", "allocated"):
            bad(f"merge-{name}-{label}-outputs-{outputs}", "merge",
                both(to(name, obj), *(() if outputs == "given" else (to("out", None), to("out_lse", None)))),
                TypeError, name, layers=PY, exact=f"{name}: {_NONE_WORDS}" if label == "None" else None)
for outputs in ("given", "allocated"):
    bad(f"merge-o_a-nested-list-outputs-{outputs}", "merge",
        both(to("o_a", lambda x, a: x.tolist()), *(() if outputs == "given" else (to("out", None), to("out_lse", None)))),
        TypeError, "o_a", layers=PY)
bad("merge-o_b-memoryview", "merge", both(to("o_b", lambda x, a: memoryview(x)), to("out", None), to("out_lse", None)),
    TypeError, "o_b")
for name in ("out", "out_lse"):
    bad(f"merge-{name}-a-list", "merge", to(name, [1.0, 2.0]), TypeError, name, layers=PY)


def _jax_out(x, a):
    jnp = pytest.importorskip("jax.numpy")
    return jnp.zeros((T, H, D), jnp.float32)


bad("merge-out-a-jax-array", "merge", both(to("out", _jax_out), to("out_lse", None)), ValueError, "out")

# strides, alignment, read-only, overlap
for name in ("o_a", "o_b", "out"):
    bad(f"merge-{name}-head_size-stride-2", "merge", unit_stride_broken(name), ValueError, name, "stride", layers=HOST)
for name in ("o_a", "lse_b", "out", "out_lse"):
    bad(f"merge-{name}-negative-token-stride", "merge", to(name, lambda x, a: x[::-1]), ValueError, name)
bad("merge-out-negative-head-stride", "merge", to("out", lambda x, a: x[:, ::-1]), ValueError, "out")
for name, offset in (("o_a", 1), ("out", 1), ("out", 2)):
    bad(f"merge-{name}-misaligned-by-{offset}", "merge",
        to(name, lambda x, a, o=offset: _misaligned_like(x, a, o)), ValueError, name, layers=HOST)


def _misaligned_like(x, a, offset):
    y = misaligned(x.shape, x.dtype.name, offset)
    y[...] = x
    return y


for name in ("o_a", "lse_b", "out"):
    bad(f"merge-{name}-big-endian", "merge", to(name, lambda x, a: x.astype(x.dtype.newbyteorder(">"))), TypeError, name,
        "big-endian")


def _six_byte_strides(x, a):
    buf = np.zeros(T * H * D * 6 + 8, dtype=np.uint8)
    y = np.ndarray((T, H, D), dtype=np.float32, buffer=buf, strides=(H * D * 6, D * 6, 6))
    y[...] = x
    a.extra.append(buf)
    return y


for name in ("o_b", "out"):
    bad(f"merge-{name}-strides-not-whole-elements", "merge", to(name, _six_byte_strides), ValueError, name, "strides", 6)
for name in ("out", "out_lse"):
    bad(f"merge-{name}-read-only", "merge", to(name, lambda x, a: read_only(x)), ValueError, name, layers=HOST)
bad("merge-out-broadcast", "merge", to("out", lambda x, a: np.broadcast_to(poisoned((1, H, D)), (T, H, D))), ValueError,
    "out")
for name, strides, n in (("out", (0, D * 4, 4), H * D), ("out", (H * D * 4, 0, 4), T * H * D), ("out_lse", (0, 4), H),
                         ("out_lse", (H * 4, 0), T * H)):
    bad(f"merge-{name}-zero-stride-{'-'.join(map(str, strides))}", "merge", zero_strided(name, strides, n), ValueError,
        name, layers=HOST)


def _out_lse_inside_out(a):
    buf = poisoned((T * H * D,))
    a["out"], a["out_lse"] = buf.reshape(T, H, D), buf[: T * H].reshape(T, H)
    a.extra.append(buf)


def _out_over_o_a(a):
    buf = np.concatenate([a["o_a"], a.o((1, H, D))])
    a["o_a"], a["out"] = buf[:T], buf[1:]
    a.extra.append(buf)


def _lse_b_inside_out(a):
    buf = poisoned((T * H * D,))
    buf[: T * H] = a.lse((T * H,))  # lse_b lives in the first bytes of out
    a["out"], a["lse_b"], a["out_lse"] = buf.reshape(T, H, D), buf[: T * H].reshape(T, H), None
    a.extra.append(buf)


bad("merge-out_lse-overlaps-out", "merge", _out_lse_inside_out, ValueError, "out_lse", layers=HOST)
bad("merge-out-partially-overlaps-o_a", "merge", _out_over_o_a, ValueError, "out", layers=HOST)
bad("merge-out-overlaps-lse_b", "merge", _lse_b_inside_out, ValueError, "out", layers=HOST)

# options
for b in (10, "10", "two", 2.5, 3):
    bad(f"merge-base-{type(b).__name__}-{b}", "merge", options(base=b), ValueError, "base", layers=PY)


def _meta_o_a(a):
    torch = pytest.importorskip("torch")
    for k in ("o_a", "lse_a", "o_b", "lse_b", "out", "out_lse"):
        a.extra.append(a[k])
        a[k] = torch.from_numpy(a[k])
    a["o_a"] = torch.empty((T, H, D), device="meta")


bad("merge-o_a-torch-meta-device", "merge", _meta_o_a, ValueError, "o_a")

# output_scale: one rule at every layer (a finite number > 0; None, in C 0, is no scale; outputs other
# than FP8 take none, or 1)
bad("merge-output_scale-with-a-float32-out", "merge", options(output_scale=0.5), ValueError, "output_scale", layers=ANY)
bad("merge-output_scale-array-with-a-bfloat16-out", "merge",
    both(to("out", None), to("out_lse", None), options(out_dtype="bfloat16", output_scale=np.array([0.5], np.float32))),
    ValueError, "output_scale", layers=PY)
bad("merge-output_scale-2-with-a-float32-out", "merge", options(output_scale=2.0), ValueError, "output_scale", "float32",
    "2", check=lambda msg: _no_zero_offered(msg), layers=PY)


def _no_zero_offered(msg):
    assert "0" not in msg.split("got")[0], f"the message offers 0, which Python refuses: {msg!r}"


_fp8_out = to("out", poisoned((T, H, D), FP8))
for scale, shown in ((0, "0"), (0.0, "0.0"), (-1.0, "-1"), (float("nan"), "nan"), (float("inf"), "inf")):
    bad(f"merge-output_scale-{shown}-fp8-out", "merge", both(_fp8_out, options(output_scale=scale)), ValueError, shown,
        starts="output_scale: expected ", contains=("a finite scale > 0",), layers=PY)
bad("merge-output_scale-0.0-is-not-none", "merge", both(_fp8_out, options(output_scale=0.0)), ValueError,
    "output_scale", "None", "0.0", layers=PY)

# block-scaled outputs (block_format=): the C ABI refuses the arrays (every layer), the Python layer
# the options it words itself and the calls whose results it allocates.  D = 16 is NVFP4's block,
# half MXFP8's; _nvfp4 and _mxfp8 give the valid arrays of each format (MXFP8's over head_size 64).
_alloc = both(to("out", None), to("out_lse", None))
_wide = both(to("o_a", lambda x, a: a.o((T, H, 64))), to("o_b", lambda x, a: a.o((T, H, 64))))


def _nvfp4(scales=(T, H, D // 16), scales_dtype=FP8, out=(T, H, D // 2), out_dtype="uint8", **kw):
    return both(to("out", poisoned(out, out_dtype)), to("group_scales", None),
                options(block_format="nvfp4", group_scales=poisoned(scales, scales_dtype), **kw))


def _mxfp8(scales=(T, H, 2), scales_dtype="uint8", **kw):
    return both(_wide, to("out", poisoned((T, H, 64), FP8)),
                options(block_format="mxfp8", group_scales=poisoned(scales, scales_dtype), **kw))


bad("merge-mxfp8-a-head_size-its-block-does-not-divide", "merge",
    both(to("out", poisoned((T, H, D), FP8)), options(block_format="mxfp8", group_scales=poisoned((T, H, 1), "uint8"))),
    ValueError, "o_b", "MXFP8", "32", "16", layers=ANY)
bad("merge-mxfp8-allocated-a-head_size-its-block-does-not-divide", "merge",
    both(_alloc, options(block_format="mxfp8")), ValueError, "o_b", "MXFP8", "32", "16", layers=PY)
bad("merge-nvfp4-a-head_size-its-block-does-not-divide", "merge",
    both(to("o_a", lambda x, a: a.o((T, H, 24))), to("o_b", lambda x, a: a.o((T, H, 24))), _nvfp4(out=(T, H, 12))),
    ValueError, "o_b", "NVFP4", "16", "24", layers=ANY)
for scale, shown in ((-1.0, "-1"), (float("nan"), "nan"), (float("inf"), "inf")):
    bad(f"merge-nvfp4-global-scale-{shown}", "merge", _nvfp4(output_scale=scale),
        ValueError, shown, starts="output_scale: expected ", contains=("a finite scale > 0",), layers=ANY)
bad("merge-mxfp8-takes-no-output_scale", "merge", _mxfp8(output_scale=2.0), ValueError, "output_scale",
    "group_scales", layers=ANY)
bad("merge-nvfp4-row-major-scales-of-another-shape", "merge", _nvfp4(scales=(T, H, 2)), ValueError, "group_scales",
    "1", "2", layers=ANY)
bad("merge-swizzled-scales-too-small", "merge", _nvfp4(scales=(1, 1, 256), scale_layout="swizzled"),
    ValueError, "group_scales", "512", "256", layers=ANY)
bad("merge-swizzled-scales-too-few-tiles", "merge", _mxfp8(scales=(1, 1, 512), scale_layout="swizzled"),
    ValueError, "group_scales", "2", layers=ANY)
bad("merge-swizzled-scales-misaligned", "merge",
    both(_mxfp8(scale_layout="swizzled"), options(group_scales=misaligned((1, 2, 512), "uint8", offset=4))),
    ValueError, "group_scales", contains=("16 bytes",), layers=HOST)
bad("merge-nvfp4-scales-of-float32", "merge", _nvfp4(scales_dtype="float32"), TypeError, "group_scales",
    "float8_e4m3", "float32", layers=ANY)
bad("merge-mxfp8-scales-of-float8", "merge", _mxfp8(scales_dtype=FP8), TypeError, "group_scales", "uint8", layers=ANY)
bad("merge-nvfp4-out-of-float32", "merge", _nvfp4(out=(T, H, D), out_dtype="float32"), TypeError, "out", "uint8",
    "float32", layers=ANY)
bad("merge-nvfp4-out-of-the-full-head_size", "merge", _nvfp4(out=(T, H, D)), ValueError, "out", D // 2, D,
    layers=ANY)
bad("merge-mxfp8-out-of-bfloat16", "merge", both(_mxfp8(), to("out", poisoned((T, H, 64), "bfloat16"))), TypeError,
    "out", "float8_e4m3", "bfloat16", layers=ANY)
bad("merge-allocated-nvfp4-out-of-float32", "merge", options(block_format="nvfp4"), TypeError, "out", "uint8",
    "float32", layers=PY)
bad("merge-block_format-unknown", "merge", both(_alloc, options(block_format="fp4")), ValueError, "block_format",
    "'fp4'", layers=PY)
bad("merge-block_format-with-group_size", "merge", both(_alloc, options(block_format="nvfp4", group_size=16)),
    ValueError, "group_size", "16", layers=PY)
bad("merge-scale_rounding-rceil-with-nvfp4", "merge",
    both(_alloc, options(block_format="nvfp4", scale_rounding="rceil")), ValueError, "scale_rounding", "'rceil'",
    layers=PY)
bad("merge-scale_layout-without-block_format", "merge", both(_alloc, options(scale_layout="swizzled")), ValueError,
    "scale_layout", "'swizzled'", layers=PY)
for op in ("merge_states", "merge_varlen", "merge_share"):
    bad(f"{op}-mxfp8-a-head_size-its-block-does-not-divide", op, both(_alloc, options(block_format="mxfp8")), ValueError,
        "MXFP8", "32", "16", layers=PY)

# a framework that fails to export an array: its error, named by the argument (chained as the cause)


class _Exports:
    """An array-like whose framework fails: its __dlpack__, or its __dlpack_device__, raises."""

    def __init__(self, fails):
        self.fails = fails

    def __dlpack_device__(self):
        if self.fails == "__dlpack_device__":
            raise RuntimeError("the device is gone")
        return (1, 0)

    def __dlpack__(self, **kw):
        raise RuntimeError("cannot export\nC++ backtrace")


class _Interface:
    """An array-like whose __array_interface__ lacks what NumPy's protocol requires."""

    __array_interface__ = {"shape": (T, H, D)}  # no typestr, no data


for name, x, how, exc, shown in (("o_a", _Exports("__dlpack__"), "__dlpack__", "RuntimeError", "cannot export"),
                                 ("lse_b", _Exports("__dlpack_device__"), "__dlpack_device__", "RuntimeError",
                                  "the device is gone"),
                                 ("o_b", _Interface(), "__array_interface__", "KeyError", "typestr")):
    bad(f"merge-{name}-{how.strip('_')}-raises", "merge", to(name, x), ValueError,
        contains=(f"{name}: expected an array readable through {how}, got a {type(x).__name__} for which {how} raised "
                  f"{exc}", shown), absent=("backtrace",))

# ================================================================================================
# merge_inplace (nothing written: o and lse bit-identical)

for name in ("o", "lse"):
    bad(f"inplace-{name}-read-only", "merge_inplace", to(name, lambda x, a: read_only(x)), ValueError, name, layers=HOST)
bad("inplace-o-read-only-with-a-mask", "merge_inplace",
    both(astype("o", "o_other", dtype=np_dtype("bfloat16")), to("o", lambda x, a: read_only(x)),
         to("mask", np.ones(T, bool))), ValueError, "o", layers=HOST)
bad("inplace-lse-zero-stride", "merge_inplace", zero_strided("lse", (0, 4), H), ValueError, "lse", layers=HOST)
for length in (T - 1, T + 1, 0):
    bad(f"inplace-mask-length-{length}", "merge_inplace", to("mask", np.ones(length, np.uint8)), ValueError, "mask", T,
        length, layers=ANY)
for dt in ("float32", "int32", "int64", "float16"):
    bad(f"inplace-mask-{dt}", "merge_inplace", to("mask", np.ones(T, dt)), TypeError, "mask", dt, layers=PY)
bad("inplace-mask-2d", "merge_inplace", to("mask", np.ones((T, 1), np.uint8)), ValueError, "mask", layers=ANY)
bad("inplace-mask-a-string", "merge_inplace", to("mask", "yes"), TypeError, "mask", layers=PY)
for name, shape in (("o_other", (T, H, D + 1)), ("o_other", (T - 1, H, D)), ("lse_other", (T, H + 1)), ("lse", (H, T)),
                    ("o", (T, H, D, 1)), ("lse_other", (T + 1, H))):
    bad(f"inplace-shape-{name}-{'x'.join(map(str, shape))}", "merge_inplace", shaped(name, shape), ValueError,
        name, layers=ANY)
bad("inplace-o_other-heads-at-odds-with-the-others", "merge_inplace", shaped("o_other", (T, H + 1, D)), ValueError,
    exact=f"o_other: expected shape [{T}, {H}, {D}] (the number of heads of o, lse and lse_other), got "
          f"[{T}, {H + 1}, {D}]",
    layers=ANY)
bad("inplace-o_other-float16-o-float32", "merge_inplace", astype("o_other", dtype=np.float16), TypeError, "o_other",
    "float16", "float32", layers=ANY)
bad("inplace-o_other-bfloat16-o-float32", "merge_inplace", astype("o_other", dtype=np_dtype("bfloat16")), TypeError,
    "o_other", layers=ANY)
for name in ("lse", "lse_other"):
    bad(f"inplace-{name}-float64", "merge_inplace", astype(name, dtype=np.float64), TypeError, name, "float32", "float64",
        layers=PY)
bad("inplace-base-10", "merge_inplace", options(base=10), ValueError, "base", layers=PY)
bad("inplace-o-a-nested-list", "merge_inplace", to("o", lambda x, a: x.tolist()), TypeError, "o", layers=PY)


def _o_other_over_o(a):
    buf = np.concatenate([a.o((1, H, D)), a["o"]])
    a["o"], a["o_other"] = buf[1:], buf[:T]
    a.extra.append(buf)


def _mask_inside_o(a):
    a["mask"] = a["o"].reshape(-1).view(np.uint8)[:T]  # the mask's bytes are o's first elements


bad("inplace-o_other-partially-overlaps-o", "merge_inplace", _o_other_over_o, ValueError, "o_other", layers=HOST)
bad("inplace-mask-overlaps-o", "merge_inplace", _mask_inside_o, ValueError, "mask", layers=HOST)

# ================================================================================================
# merge_states

bad("states-lse-fewer-states", "merge_states", to("lse", lambda x, a: x[:, :3]), ValueError, "lse", 3, S, layers=ANY)
bad("states-lse-more-states", "merge_states", shaped("lse", (T, S + 1, H)), ValueError, "lse", layers=ANY)


def _all_gather_fewer_lse_states(a):
    a["o"], a["lse"] = a.o((S, T, H, D)), a.lse((2, T, H))
    a.options["states_axis"] = 0


bad("states-lse-fewer-states-all-gather-layout", "merge_states", _all_gather_fewer_lse_states, ValueError, "lse", 2, S,
    layers=PY)
bad("states-o-3d", "merge_states", to("o", lambda x, a: x[:, 0]), ValueError, "o", 4, 3, layers=ANY)
bad("states-lse-2d", "merge_states", to("lse", lambda x, a: x[:, 0]), ValueError, "lse", layers=ANY)
for name, shape in (("lse", (T + 1, S, H)), ("lse", (T, S, H + 1)), ("out", (T, H, D + 1)), ("out", (T - 1, H, D)),
                    ("out_lse", (T, H + 2)), ("out", (T, H + 1, D))):
    bad(f"states-shape-{name}-{'x'.join(map(str, shape))}", "merge_states", shaped(name, shape), ValueError, name, *shape,
        layers=ANY)
for axis in (3, -1, -5, "tokens", True):
    bad(f"states-states_axis-{axis}", "merge_states", options(states_axis=axis), (ValueError, TypeError), "states_axis",
        layers=PY)
bad("states-lse-float16", "merge_states", astype("lse", dtype=np.float16), TypeError, "lse", "float32", "float16",
    layers=ANY)
bad("states-o-int32", "merge_states", astype("o", dtype=np.int32), TypeError, "o", "int32", layers=PY)
bad("states-o-float8", "merge_states", both(astype("o", dtype=dtype_of(FP8)), to("out", None), to("out_lse", None)),
    TypeError, "o", layers=PY)
for name in ("out", "out_lse"):
    bad(f"states-{name}-read-only", "merge_states", to(name, lambda x, a: read_only(x)), ValueError, name, layers=HOST)
bad("states-o-head_size-stride-2", "merge_states", unit_stride_broken("o"), ValueError, "o", "stride", layers=HOST)
bad("states-lse-None", "merge_states", to("lse", None), TypeError, "lse", layers=PY)
bad("states-out-overlaps-o", "merge_states", to("out", lambda x, a: a["o"][:, 0]), ValueError, "out", layers=HOST)
bad("states-out_lse-overlaps-lse", "merge_states", to("out_lse", lambda x, a: a["lse"][:, 1]), ValueError, "out_lse",
    layers=HOST)
bad("states-output_scale-with-a-float32-out", "merge_states", options(output_scale=2.0), ValueError, "output_scale",
    layers=ANY)
bad("states-output_scale-array-of-two", "merge_states",
    both(to("out", poisoned((T, H, D), FP8)), options(output_scale=np.array([1.0, 2.0], np.float32))), ValueError,
    "output_scale", layers=PY)
bad("states-output_scale-array-float64", "merge_states",
    both(to("out", poisoned((T, H, D), FP8)), options(output_scale=np.array([1.0]))), (TypeError, ValueError),
    "output_scale", "float64", layers=PY)

# ================================================================================================
# merge_varlen (on the CPU a bad indptr is refused; on the GPU it is clamped: tests/semantics/)

for dt in ("float32", "float64", "int16", "uint32", "bool"):
    bad(f"varlen-indptr-{dt}", "merge_varlen", astype("indptr", dtype=dt), TypeError, "indptr", dt, layers=PY)
bad("varlen-indptr-2d", "merge_varlen", to("indptr", lambda x, a: x.reshape(1, -1)), ValueError, "indptr", layers=ANY)
bad("varlen-indptr-empty", "merge_varlen", indptr_of([], "int32"), ValueError, "indptr", layers=ANY)
bad("varlen-indptr-empty-outputs-allocated", "merge_varlen",
    both(indptr_of([], "int32"), to("out", None), to("out_lse", None)), ValueError, "indptr", layers=PY)
for values in ([0, 3, 2, 7, 10], [-1, 3, 3, 7, 10], [0, 3, 3, 7, 11], [0, 3, 3, 12, 10], [0, 2**62, 10]):
    bad(f"varlen-indptr-{'_'.join(map(str, values))}", "merge_varlen", indptr_of(values), ValueError, "indptr",
        layers=HOST)
for case, values in {"negative_first": [-1, 2, 4], "negative_inside": [0, -2, 4], "decreasing": [0, 3, 2, 5],
                     "past_total": [0, 3, 11], "first_past_total": [11, 11, 11]}.items():
    for dt in ("int32", "int64"):
        bad(f"varlen-indptr-{case}-{dt}", "merge_varlen", indptr_of(values, dt), ValueError, "indptr", layers=HOST)
for values, dt in (([0, 3, TOTAL + 1], "int32"), ([-1, 3, TOTAL], "int64"), ([0, 5, 2, TOTAL], "int64")):
    bad(f"varlen-indptr-{'_'.join(map(str, values))}-{dt}", "merge_varlen", indptr_of(values, dt), ValueError, "indptr",
        layers=HOST)
bad("varlen-indptr-decreasing-outputs-allocated", "merge_varlen",
    both(indptr_of([0, 5, 4]), to("out", None), to("out_lse", None)), ValueError, "indptr")
bad("varlen-out-rows-differ-from-indptr", "merge_varlen", shaped("out", (5, H, D)), ValueError, "out", 4, 5, layers=ANY)
for name, shape in (("o", (TOTAL, H, D, 1)), ("o", (TOTAL, H * D)), ("lse", (TOTAL - 1, H)), ("lse", (TOTAL, H + 1))):
    bad(f"varlen-shape-{name}-{'x'.join(map(str, shape))}", "merge_varlen", shaped(name, shape), ValueError, name,
        layers=ANY)
bad("varlen-out-read-only", "merge_varlen", to("out", lambda x, a: read_only(x)), ValueError, "out", layers=HOST)
bad("varlen-indptr-a-string", "merge_varlen", to("indptr", "0,3,3,7,10"), TypeError, "indptr", layers=PY)
bad("varlen-indptr-a-list", "merge_varlen", to("indptr", list(INDPTR)), TypeError, "indptr", layers=PY)


def _indptr_inside_out(a):
    a["indptr"] = a["out"].reshape(-1)[: len(INDPTR)].view(np.int32)
    a["indptr"][:] = INDPTR


bad("varlen-out-overlaps-indptr", "merge_varlen", _indptr_inside_out, ValueError, "indptr", layers=HOST)
bad("varlen-output_scale-with-a-float32-out", "merge_varlen", options(output_scale=np.array([2.0], np.float32)),
    ValueError, "output_scale", layers=PY)

# ================================================================================================
bad("varlen-o-and-lse-heads-disagree", "merge_varlen", shaped("lse", (TOTAL, H + 1)), ValueError,
    exact=f"o and lse: expected the same number of heads, got {H} (o, shape [{TOTAL}, {H}, {D}]) and {H + 1} (lse, "
          f"shape [{TOTAL}, {H + 1}])", layers=ANY)
bad("varlen-lse-heads-at-odds-with-o-and-the-sink", "merge_varlen",
    both(shaped("lse", (TOTAL, H + 1)), options(sink=np.zeros(H, np.float32))), ValueError,
    exact=f"lse: expected shape [{TOTAL}, {H}] (the number of heads of o and sink), got [{TOTAL}, {H + 1}]", layers=ANY)

# merge_share (o: state index's O [T, H, D]; lse: every state's LSE [T, S, H]; index an int)

for index in (S, S + 5, -1):
    bad(f"share-index-{index}", "merge_share", to("index", index), ValueError, "index", S, layers=ANY,
        contains=(f"got {index}",))
for index, kind in ((1.0, "float"), (True, "bool"), ("1", "str"), (None, "NoneType")):
    bad(f"share-index-{kind}", "merge_share", to("index", index), TypeError, "index", "int", kind, layers=PY)
bad("share-o-4d", "merge_share", shaped("o", (T, S, H, D)), ValueError, "o", 3, 4, layers=ANY)
bad("share-lse-2d", "merge_share", to("lse", lambda x, a: x[:, 0]), ValueError, "lse", 3, 2, layers=ANY)
for name, shape in (("lse", (T + 1, S, H)), ("lse", (T, S, H + 1)), ("out", (T, H, D + 1)), ("out_lse", (T - 1, H))):
    bad(f"share-shape-{name}-{'x'.join(map(str, shape))}", "merge_share", shaped(name, shape), ValueError, name, *shape,
        layers=ANY)
bad("share-lse-float16", "merge_share", astype("lse", dtype=np.float16), TypeError, "lse", "float32", "float16",
    layers=ANY)
bad("share-o-float8", "merge_share", astype("o", dtype=dtype_of(FP8)), TypeError, "o", layers=HOST)
for axis in (3, -4, True):
    bad(f"share-states_axis-{axis}", "merge_share", options(states_axis=axis), ValueError, "states_axis", layers=PY)
bad("share-out_lse-overlaps-lse", "merge_share", to("out_lse", lambda x, a: a["lse"][:, 1]), ValueError, "out_lse",
    layers=HOST)


def _out_a_token_past_o(a):
    """out overlaps o without being it (o itself is allowed: in place)."""
    buf = np.concatenate([a["o"], poisoned((1, H, D))])
    a["o"], a["out"] = buf[:T], buf[1:]
    a.extra.append(buf)


bad("share-out-partially-overlaps-o", "merge_share", _out_a_token_past_o, ValueError, "out", layers=HOST)
bad("share-output_scale-with-a-float32-out", "merge_share", options(output_scale=2.0), ValueError, "output_scale",
    layers=ANY)

# ================================================================================================
# sinks (merge_states, merge_varlen and merge_share take one: float32 [heads]; every other op refuses one)


def sink(shape=(H,), dtype=np.float32):
    """A sink of `shape` and `dtype` given (random, as every input)."""
    def change(a):
        a.options["sink"] = a.lse(shape).astype(dtype)
    return change


for op, prefix in (("merge", "merge"), ("merge_states", "states"), ("merge_varlen", "varlen"), ("merge_share", "share")):
    bad(f"{prefix}-sink-one-head-too-many", op, sink((H + 1,)), ValueError, "sink", H, H + 1, layers=ANY)
    bad(f"{prefix}-sink-2d", op, sink((1, H)), ValueError, "sink", 1, 2, layers=ANY)
    bad(f"{prefix}-sink-float16", op, sink(dtype=np.float16), TypeError, "sink", "float32", "float16", layers=ANY)
    bad(f"{prefix}-sink-overlaps-out_lse", op, lambda a: a.options.update(sink=a["out_lse"][0]), ValueError, "out_lse",
        layers=HOST)


def _sink_option(a):
    given = a.lse((H,))
    a.extra.append(given)
    a.options["opts"] = c_abi.options(sink=c_abi.tensor_from(given))


for op in ("merge_inplace", "merge_states_backward"):
    bad(f"c-{op}-sink-refused", f"c.{op}", _sink_option, ERR_V, "sink", "none", starts="sink: expected none")


# ================================================================================================
# softmax statistics: an LSE argument given as a (max, sum) tuple, the sum the C ABI's options.sum_a
# (the op's first LSE argument) or options.sum_b (the second); named lse_a[1] and so on in Python


def stats(name, change_sum=None, sum_dtype=np.float32):
    """LSE argument `name` given as softmax statistics (its values the maxima), the sum random and
    positive, then passed through change_sum(sum, args)."""
    def change(a):
        m = a[name]
        total = np.abs(a.lse(m.shape)).astype(sum_dtype) + 1
        a[name] = (m, total if change_sum is None else change_sum(total, a))
    return change


# Each row twice: in Python (the tuple's sum named lse_a[1], ...) and through the C ABI (sum_a, sum_b).
for op, name, py, c in (("merge", "lse_a", "lse_a[1]", "sum_a"), ("merge", "lse_b", "lse_b[1]", "sum_b"),
                        ("merge_states", "lse", "lse[1]", "sum_a"), ("merge_varlen", "lse", "lse[1]", "sum_a"),
                        ("merge_share", "lse", "lse[1]", "sum_a"), ("merge_inplace", "lse_other", "lse_other[1]",
                                                                     "sum_b")):
    for layers, word in ((PY, py), (("c",), c)):
        prefix = f"{op}-{name}-stats{'-c-abi' if layers == ('c',) else ''}"
        bad(f"{prefix}-sum-one-head-too-many", op,
            stats(name, lambda x, a: np.concatenate([x, x[..., :1]], axis=-1)), ValueError, word, layers=layers)
        bad(f"{prefix}-sum-a-dimension-short", op, stats(name, lambda x, a: x[..., 0]), ValueError, word,
            layers=layers)
        bad(f"{prefix}-sum-float16", op, stats(name, sum_dtype=np.float16), TypeError, word, "float32", "float16",
            layers=layers)
    bad(f"{op}-{name}-stats-sum-elsewhere", op, stats(name, lambda x, a: OnHost(x)), ValueError, py, "device",
        layers=("cuda",), marks=ELSEWHERE)
# A call's O and LSE are float64 all or none, the sums with them: a float64 sum beside float32 maxima.
for layers, word in ((("cpu",), "lse[1]"), (("c",), "sum_a")):
    bad(f"merge_states-lse-stats-sum-float64-beside-float32{'-c-abi' if layers == ('c',) else ''}", "merge_states",
        stats("lse", sum_dtype=np.float64), TypeError, word, "float32", "float64", layers=layers)
bad("merge-lse_a-a-tuple-of-three", "merge", to("lse_a", lambda x, a: (x, x, x)), ValueError, "lse_a", "tuple",
    layers=PY)
bad("merge_inplace-lse-stats-refused", "merge_inplace", stats("lse"), ValueError, "lse[1]", "none", layers=PY,
    contains=("writes its merged LSE over lse",))
bad("merge_inplace-lse-stats-refused-c-abi", "merge_inplace", stats("lse"), ValueError, "sum_a", "none", layers=("c",),
    contains=("writes its merged LSE over lse",))
bad("merge-out_lse-over-the-maxima-of-lse_b", "merge", both(stats("lse_b"), lambda a: a.update(out_lse=a["lse_b"][0])),
    ValueError, "out_lse", "lse_b", contains=("softmax maxima",), layers=HOST)
for layers, word in ((("cpu",), "lse_b[1]"), (("c",), "sum_b")):
    bad(f"merge-out_lse-over-the-sums-of-lse_b{'-c-abi' if layers == ('c',) else ''}", "merge",
        both(stats("lse_b"), lambda a: a.update(out_lse=a["lse_b"][1])), ValueError, "out_lse", word, layers=layers)
bad("states-backward-lse-stats-refused", "merge_states_backward", stats("lse"), TypeError, "lse", "tuple",
    contains=("the backwards take LSEs",), layers=PY)


def _sum_option(field):
    def change(a):
        given = np.abs(a.lse((T, S, H))) + 1
        a.extra.append(given)
        a.options["opts"] = c_abi.options(**{field: c_abi.tensor_from(given)})
    return change


bad("c-merge_states_backward-sum_a-refused", "c.merge_states_backward", _sum_option("sum_a"), ERR_V, "sum_a", "none",
    starts="sum_a: expected none", contains=("the backwards take LSEs",))
bad("c-merge_states-sum_b-refused", "c.merge_states", _sum_option("sum_b"), ERR_V, "sum_b", "none",
    starts="sum_b: expected none")

# ================================================================================================
# valid: which states hold keys ([tokens, S]; the two-way and in-place merges' [tokens, 2]; the
# variable-length merge's [total]), uint8, bool, int32 or int64


def valid(shape, dtype=np.uint8):
    def change(a):
        a.options["valid"] = np.ones(shape, dtype)
    return change


for op, good in (("merge", (T, 2)), ("merge_inplace", (T, 2)), ("merge_states", (T, S)), ("merge_share", (T, S)),
                 ("merge_varlen", (TOTAL,))):
    prefix = f"{op}-valid"
    wrong = good[:-1] + (good[-1] + 1,)
    bad(f"{prefix}-{'x'.join(map(str, wrong))}", op, valid(wrong), ValueError, "valid", *wrong, layers=ANY)
    bad(f"{prefix}-one-dimension-more", op, valid(good + (1,)), ValueError, "valid", len(good), len(good) + 1,
        layers=ANY)
    bad(f"{prefix}-float32", op, valid(good, np.float32), TypeError, "valid", "float32", layers=ANY,
        contains=("int32",))
    bad(f"{prefix}-elsewhere", op, lambda a, g=good: a.options.update(valid=OnHost(np.ones(g, np.uint8))), ValueError,
        "valid", "device", layers=("cuda",), marks=ELSEWHERE)
bad("merge_states-valid-an-all-gather-s-order", "merge_states", valid((S, T)), ValueError, "valid", S, T, layers=ANY)


def _valid_option(a):
    given = np.ones((T, S), np.uint8)
    a.extra.append(given)
    a.options["opts"] = c_abi.options(valid=c_abi.tensor_from(given))


bad("c-merge_states_backward-valid-refused", "c.merge_states_backward", _valid_option, ERR_V, "valid", "none",
    starts="valid: expected none")

# ================================================================================================
# num_tokens: the live tokens (rows of the variable-length merge), one int32 or int64 on the call's device


def num_tokens(value, dtype=np.int32):
    def change(a):
        a.options["num_tokens"] = np.asarray(value, dtype)
    return change


for op in ("merge", "merge_inplace", "merge_states", "merge_share", "merge_varlen"):
    prefix = f"{op}-num_tokens"
    bad(f"{prefix}-two-elements", op, num_tokens([3, 4]), ValueError, "num_tokens", 1, 2, layers=ANY)
    bad(f"{prefix}-no-element", op, num_tokens(np.zeros(0)), ValueError, "num_tokens", 1, 0, layers=ANY)
    bad(f"{prefix}-float32", op, num_tokens([3], np.float32), TypeError, "num_tokens", "float32", layers=ANY,
        contains=("int32", "int64"))
    bad(f"{prefix}-uint8", op, num_tokens([3], np.uint8), TypeError, "num_tokens", "uint8", layers=ANY)
    bad(f"{prefix}-elsewhere", op, lambda a: a.options.update(num_tokens=OnHost(np.array([3], np.int32))),
        ValueError, "num_tokens", "device", layers=("cuda",), marks=ELSEWHERE)
bad("merge-num_tokens-an-int", "merge", lambda a: a.options.update(num_tokens=3), TypeError, "num_tokens", "int32",
    "3", layers=PY)


def _num_tokens_option(a):
    given = np.array([3], np.int32)
    a.extra.append(given)
    a.options["opts"] = c_abi.options(num_tokens=c_abi.tensor_from(given))


bad("c-merge_states_backward-num_tokens-refused", "c.merge_states_backward", _num_tokens_option, ERR_V, "num_tokens",
    "none", starts="num_tokens: expected none")


# ================================================================================================
# merge_states_backward (the gradients grad_o, grad_lse are its outputs)

bad("states-backward-grad_out-heads-at-odds-with-the-others", "merge_states_backward",
    shaped("grad_out", (T, H + 1, D)), ValueError,
    exact=f"grad_out: expected shape [{T}, {H}, {D}] (the number of heads of grad_out_lse, out, out_lse, o and lse), "
          f"got [{T}, {H + 1}, {D}]", layers=ANY)
bad("states-backward-grad_out-fewer-tokens", "merge_states_backward", to("grad_out", lambda x, a: x[:T - 1]), ValueError,
    starts=f"grad_out: expected shape [{T}, {H}, {D}]", layers=ANY)
bad("states-backward-out_lse-one-head", "merge_states_backward", to("out_lse", lambda x, a: x[:, :1]), ValueError,
    starts=f"out_lse: expected shape [{T}, {H}]", layers=ANY)
bad("states-backward-grad_out-float16", "merge_states_backward", astype("grad_out", dtype=np.float16), TypeError,
    starts="grad_out: expected the dtype of out (float32)", layers=ANY)
bad("states-backward-grad_o-float16", "merge_states_backward", to("grad_o", poisoned((T, S, H, D), np.float16)), TypeError,
    starts="grad_o: expected the dtype of o (float32)", layers=ANY)
bad("states-backward-grad_o-is-o", "merge_states_backward", to("grad_o", lambda x, a: a["o"]), ValueError,
    contains=("grad_o: expected memory disjoint from o",), layers=HOST)
bad("states-backward-grad_o-read-only", "merge_states_backward", to("grad_o", lambda x, a: read_only(x)), ValueError,
    starts="grad_o: expected a writable tensor", layers=HOST)
bad("states-backward-out-fp8", "merge_states_backward", both(astype("out", dtype=dtype_of(FP8)), to("grad_out_lse", None)),
    TypeError, starts="out: expected dtype float32, float16, bfloat16 or float64, got float8_e4m3", layers=PY)

# ================================================================================================
# vLLM's merge_attn_states: vLLM's names, LSEs [heads, tokens]

bad("vllm-prefix_output-float64", "vllm", astype("prefix_output", dtype=np.float64), TypeError, "prefix_output", "float64",
    layers=PY)
bad("vllm-prefix_output-float16", "vllm", astype("prefix_output", dtype=np.float16), TypeError, "prefix_output", layers=PY)
bad("vllm-suffix_output-fewer-heads", "vllm", to("suffix_output", lambda x, a: x[:, :2]), ValueError, "suffix_output", 2,
    layers=PY)
bad("vllm-prefix_lse-tokens-heads-layout", "vllm", to("prefix_lse", lambda x, a: np.ascontiguousarray(x.T)), ValueError,
    "prefix_lse", layers=PY)
bad("vllm-suffix_lse-tokens-heads-layout", "vllm", to("suffix_lse", lambda x, a: a.lse((T, H))), ValueError, "suffix_lse",
    layers=PY)
bad("vllm-suffix_lse-float16", "vllm", astype("suffix_lse", dtype=np.float16), TypeError, "suffix_lse", "float32",
    layers=PY)
bad("vllm-output-half-the-head_size", "vllm", shaped("output", (T, H, D // 2)), ValueError, "output", D // 2, D,
    layers=PY)
bad("vllm-output_lse-tokens-heads-layout", "vllm", shaped("output_lse", (T, H)), ValueError, "output_lse", layers=PY)
bad("vllm-output-read-only", "vllm", to("output", lambda x, a: read_only(x)), ValueError, "output")
bad("vllm-output-None", "vllm", to("output", None), TypeError, "output", layers=PY)
bad("vllm-prefix_output-a-nested-list", "vllm", to("prefix_output", lambda x, a: x.tolist()), TypeError, "prefix_output",
    layers=PY)
bad("vllm-prefill_tokens_with_context-past-the-end", "vllm", options(prefill_tokens_with_context=T + 1), ValueError,
    "prefill_tokens_with_context", T + 1, layers=PY)
bad("vllm-prefill_tokens_with_context-negative", "vllm", options(prefill_tokens_with_context=-1), ValueError,
    "prefill_tokens_with_context", layers=PY)
bad("vllm-output_scale-with-a-float32-output", "vllm", options(output_scale=np.array([2.0], np.float32)), ValueError,
    "output_scale", layers=PY)
bad("vllm-output_scale-two-elements", "vllm",
    both(to("output", poisoned((T, H, D), FP8)), options(output_scale=np.array([2.0, 2.0], np.float32))), ValueError,
    "output_scale", layers=PY)


def _output_over_suffix(a):
    buf = np.concatenate([a["suffix_output"], a.o((1, H, D))])
    a["output"], a["suffix_output"] = buf[1:], buf[:T]
    a.extra.append(buf)


bad("vllm-output-partially-overlaps-suffix_output", "vllm", _output_over_suffix, ValueError, "output")

# ================================================================================================
# FlashInfer's functions: FlashInfer's names, base 2, LSE [tokens, heads]

_fi = dict(absent=NATIVE_NAMES)
bad("fi-merge_state-v_b-float16-v_a-float32", "fi.merge_state", astype("v_b", dtype=np.float16), TypeError, "v_b",
    "float16", "float32", exact="v_b: expected the dtype of v_a (float32), got float16", layers=PY, **_fi)
bad("fi-merge_state-v_b-not-an-array", "fi.merge_state", to("v_b", object()), TypeError,
    exact="v_b: expected an array, got object", layers=PY)
bad("fi-merge_state-v_a-not-an-array", "fi.merge_state", to("v_a", object()), TypeError, "v_a", layers=PY)
bad("fi-merge_state-v_a-float64", "fi.merge_state", astype("v_a", dtype=np.float64), TypeError,
    exact="v_a: expected dtype float32, float16 or bfloat16 (a call's O and LSE are float64 all or none, and v_b is "
          "float32), got float64")
bad("fi-merge_state-v_b-float64", "fi.merge_state", astype("v_b", dtype=np.float64), TypeError,
    exact="v_b: expected dtype float32, float16 or bfloat16 (a call's O and LSE are float64 all or none, and v_a is "
          "float32), got float64")
bad("fi-merge_state-s_b-fewer-tokens", "fi.merge_state", to("s_b", lambda x, a: x[:-1]), ValueError,
    exact=f"s_b: expected shape [{T}, {H}] (the number of tokens of v_a, s_a and v_b), got [{T - 1}, {H}]", layers=PY)
bad("fi-merge_state-v_b-fewer-tokens", "fi.merge_state", to("v_b", lambda x, a: x[:-1]), ValueError, "s_b", layers=PY)
for name, shape in (("s_a", (T, H + 1)), ("s_b", (H, T)), ("v_b", (T, H, D + 2)), ("v_a", (T, H * D))):
    bad(f"fi-merge_state-shape-{name}-{'x'.join(map(str, shape))}", "fi.merge_state", shaped(name, shape),
        ValueError, name, layers=PY, **_fi)
bad("fi-merge_state-s_a-float16", "fi.merge_state", astype("s_a", dtype=np.float16), TypeError, "s_a", "float16",
    layers=PY, **_fi)
for name in ("v", "s"):
    bad(f"fi-in-place-{name}-read-only", "fi.merge_state_in_place", to(name, lambda x, a: read_only(x)), ValueError, name,
        **_fi)
bad("fi-in-place-mask-length", "fi.merge_state_in_place", to("mask", np.ones(T + 3, bool)), ValueError, "mask", T, T + 3,
    layers=PY, **_fi)
bad("fi-in-place-mask-shorter", "fi.merge_state_in_place", to("mask", np.ones(T - 1, bool)), ValueError, "mask",
    layers=PY)
for dt in ("float32", "int64"):
    bad(f"fi-in-place-mask-{dt}", "fi.merge_state_in_place", to("mask", np.ones(T, dt)), TypeError, "mask", dt, layers=PY,
        **_fi)
for name, shape in (("v_other", (T, H, D + 1)), ("s_other", (T + 1, H))):
    bad(f"fi-in-place-shape-{name}-{'x'.join(map(str, shape))}", "fi.merge_state_in_place", shaped(name, shape),
        ValueError, name, layers=PY, **_fi)
bad("fi-in-place-s_other-float64", "fi.merge_state_in_place", astype("s_other", dtype=np.float64), TypeError, "s_other",
    "float64", layers=PY, **_fi)
bad("fi-in-place-v_other-negative-stride", "fi.merge_state_in_place", to("v_other", lambda x, a: x[:, ::-1]), ValueError,
    "v_other")
bad("fi-merge_states-v-3d", "fi.merge_states", to("v", lambda x, a: x[:, 0]), ValueError, "v", 4, 3, layers=PY, **_fi)
bad("fi-merge_states-v-3d-message", "fi.merge_states", to("v", lambda x, a: x[:, 0]), ValueError,
    exact=f"v: expected 4 dimensions, got 3 (shape [{T}, {H}, {D}])", layers=PY)
bad("fi-merge_states-s-fewer-states", "fi.merge_states", to("s", lambda x, a: x[:, :2]), ValueError, S, 2, layers=PY,
    check=lambda msg: _v_or_s(msg), **_fi)
bad("fi-merge_states-s-more-states", "fi.merge_states", shaped("s", (T, S + 1, H)), ValueError, "s", layers=PY)
bad("fi-merge_states-s-float64", "fi.merge_states", astype("s", dtype=np.float64), TypeError, "s", "float64", layers=PY,
    **_fi)


def _v_or_s(msg):
    assert names("s", msg) or names("v", msg), msg


for dt in ("float32", "int16"):
    bad(f"fi-variable_length-indptr-{dt}", "fi.variable_length_merge_states", astype("indptr", dtype=dt), TypeError,
        "indptr", dt, layers=PY, **_fi)
for values in ([0, 4, 2], [-2, 2, 6], [0, 2, 11], [0, 2, TOTAL + 5], [0, 3, 2]):
    bad(f"fi-variable_length-indptr-{'_'.join(map(str, values))}", "fi.variable_length_merge_states",
        indptr_of(values, "int32"), ValueError, "indptr", **_fi)
bad("fi-variable_length-indptr-past-the-end-message", "fi.variable_length_merge_states", indptr_of([0, 2, TOTAL + 1], "int32"),
    ValueError, exact=f"indptr: expected non-decreasing offsets from 0 or more up to the {TOTAL} states of v, got "
                      f"indptr[2] = {TOTAL + 1} (past the end)")
bad("fi-variable_length-v-4d", "fi.variable_length_merge_states", shaped("v", (TOTAL, 2, H, D)), ValueError, "v",
    layers=PY, **_fi)
bad("fi-variable_length-v-2d-message", "fi.variable_length_merge_states", to("v", lambda x, a: x[0]), ValueError,
    exact=f"v: expected 3 dimensions, got 2 (shape [{H}, {D}])", layers=PY)
bad("fi-variable_length-s-fewer-states", "fi.variable_length_merge_states", to("s", lambda x, a: x[:-1]), ValueError, "s",
    layers=PY)

# ================================================================================================
# attnmerge.raw.merge: its own descriptors (ptr, dtype, stride_token, stride_head), (ptr, stride_token, stride_head)


def raw(name, f):
    """The raw descriptor `name` becomes f(descriptor, a)."""
    def change(a):
        a[name] = f(a[name], a)
    return change


bad("raw-o_b-dtype-name-float64", "raw.merge", raw("o_b", lambda d, a: (d[0], "float64") + d[2:]), TypeError, "o_b",
    "float64")
bad("raw-o_b-dtype-float16-o_a-float32", "raw.merge", raw("o_b", lambda d, a: (d[0], "float16") + d[2:]), TypeError, "o_b",
    "float16", "float32")
bad("raw-lse_a-negative-stride", "raw.merge", raw("lse_a", lambda d, a: (d[0], -2, 1)), ValueError, "lse_a", "-2")
bad("raw-out-zero-token-stride", "raw.merge", raw("out", lambda d, a: (d[0], "float32", 0, D)), ValueError, "out")
bad("raw-out_lse-zero-head-stride", "raw.merge", raw("out_lse", lambda d, a: (d[0], H, 0)), ValueError, "out_lse")
bad("raw-out_lse-zero-token-stride", "raw.merge", raw("out_lse", lambda d, a: (d[0], 0, 1)), ValueError, "out_lse")
bad("raw-tokens-negative", "raw.merge", raw("tokens", lambda d, a: -1), ValueError, "tokens", "-1")
bad("raw-heads-negative", "raw.merge", raw("heads", lambda d, a: -1), ValueError, "heads")
bad("raw-head_size-zero", "raw.merge", raw("head_size", lambda d, a: 0), ValueError, "head_size", "o_b")
bad("raw-o_a-misaligned-by-1", "raw.merge", raw("o_a", lambda d, a: (d[0] + 1,) + d[1:]), ValueError, "o_a")


def _out_in_a_misaligned_store(d, a):
    store = poisoned((T * H * D + 1,))
    a.extra.append(store)
    return (store.ctypes.data + 2,) + d[1:]


bad("raw-out-misaligned-by-2", "raw.merge", raw("out", _out_in_a_misaligned_store), ValueError, "out")
bad("raw-lse_b-null", "raw.merge", raw("lse_b", lambda d, a: (0,) + d[1:]), (TypeError, ValueError), "lse_b")
bad("raw-o_a-null", "raw.merge", raw("o_a", lambda d, a: (0,) + d[1:]), ValueError, "o_a")
bad("raw-device-tpu", "raw.merge", raw("device", lambda d, a: "tpu"), ValueError, "device", "tpu")
bad("raw-device-cuda", "raw.merge", raw("device", lambda d, a: "cuda"), ValueError, "device")
bad("raw-base-10", "raw.merge", options(base=10), ValueError, "base", "10")
bad("raw-a_tokens-past-the-tokens", "raw.merge", options(a_tokens=T + 1), ValueError, "a_tokens", T + 1)
bad("raw-o_a-descriptor-of-2", "raw.merge", raw("o_a", lambda d, a: d[:2]), (TypeError, ValueError), "o_a")
bad("raw-lse_a-descriptor-of-2", "raw.merge", raw("lse_a", lambda d, a: d[:2]), TypeError, "lse_a")
bad("raw-o_b-negative-pointer", "raw.merge", raw("o_b", lambda d, a: (-64,) + d[1:]), ValueError, "o_b", "ptr", "-64")
bad("raw-lse_b-stride-a-float", "raw.merge", raw("lse_b", lambda d, a: d[:2] + (1.0,)), TypeError, "lse_b", "stride_1",
    "1.0")
bad("raw-out-span-beyond-2^63-bytes", "raw.merge", raw("out", lambda d, a: (d[0], "float32", 2**62, D)), ValueError, "out")
bad("raw-out-negative-token-stride", "raw.merge",
    raw("out", lambda d, a: (d[0] + (T - 1) * H * D * 4, "float32", -H * D, D)), ValueError, "out")
bad("raw-host-memory-on-device-0", "raw.merge", raw("device", lambda d, a: 0), ValueError if not NO_GPU else RuntimeError,
    "out")


def _dtype_object(framework):
    def f(d, a):
        dt = pytest.importorskip("torch").float32 if framework == "torch" else np.dtype("float32")
        return (d[0], dt) + d[2:]
    return f


for fw in ("numpy", "torch"):
    bad(f"raw-o_a-dtype-a-{fw}-dtype-object", "raw.merge", raw("o_a", _dtype_object(fw)), TypeError,
        contains=("o_a", "float32", "float16", "bfloat16", "float8_e4m3fn"),
        check=lambda msg, fw=fw: _names_the_object(msg, fw))


def _names_the_object(msg, fw):
    dt = pytest.importorskip("torch").float32 if fw == "torch" else np.dtype("float32")
    assert repr(dt) in msg, msg
    assert "C++" not in msg, msg


# ================================================================================================
# the C ABI: its own descriptors (tests/c_abi.py), changed one field at a time


def field_(name, **fields):
    """Descriptor `name` with the given fields set (shape and strides as lists from index 0)."""
    def change(a):
        for k, v in fields.items():
            if k in ("shape", "strides"):
                for i, x in enumerate(v):
                    getattr(a[name], k)[i] = x
            else:
                setattr(a[name], k, v)
    return change


def null(name):
    def change(a):
        a[name] = None
    return change


def opts(**kw):
    def change(a):
        a.options["opts"] = c_abi.options(**kw)
    return change


def _scale_ptr(values, offset=0, **kw):
    def change(a):
        scale = np.array(values, np.float32)
        a.extra.append(scale)
        a.options["opts"] = c_abi.options(output_scale_ptr=scale.ctypes.data + offset, **kw)
    return change


def _c_scales(shape, dtype):
    """Block scales (poisoned) kept for the options _c_flags makes."""
    def change(a):
        a.arrays["group_scales"] = poisoned(shape, dtype)
    return change


def _c_flags(flags, **kw):
    """Options of these flags with the scales _c_scales gave."""
    def change(a):
        a.options["opts"] = c_abi.options(flags=flags, group_scales=c_abi.tensor_from(a.arrays["group_scales"]), **kw)
    return change


def out_of(dtype):
    def change(a):
        a.use("out", poisoned((T, H, D), dtype))
    return change


bad("c-merge-out-NULL-descriptor", "c.merge", null("out"), ERR_T, "out")
bad("c-merge-lse_b-NULL-descriptor", "c.merge", null("lse_b"), ERR_T, "lse_b")
bad("c-merge-o_a-NULL-data", "c.merge", field_("o_a", data=None), ERR_V, "o_a")
bad("c-merge-out_lse-NULL-data", "c.merge", field_("out_lse", data=None), ERR_V, "out_lse")


def _in_a_store(name, count, offset, make):
    def change(a):
        store = make(a, count)
        a.extra.append(store)
        a[name].data = store.ctypes.data + offset
    return change


bad("c-merge-o_b-float32-offset-by-2-bytes", "c.merge", _in_a_store("o_b", T * H * D + 1, 2, lambda a, n: a.o((n,))), ERR_V,
    "o_b")
bad("c-merge-lse_a-offset-by-1-byte", "c.merge", _in_a_store("lse_a", T * H + 1, 1, lambda a, n: a.lse((n,))), ERR_V,
    "lse_a")
bad("c-merge-out-zero-token-stride", "c.merge", field_("out", strides=[0, D, 1]), ERR_V, "out")
bad("c-merge-out-heads-overlap-tokens", "c.merge", field_("out", strides=[D, D, 1]), ERR_V, "out")


def _out_negative_head_stride(a):
    a["out"].data += (H - 1) * D * 4  # head h at -h * D from the last head: inside the buffer
    a["out"].strides[1] = -D


bad("c-merge-out-negative-stride", "c.merge", _out_negative_head_stride, ERR_V, "out")
bad("c-merge-o_b-non-unit-innermost", "c.merge",
    lambda a: a.use("o_b", np.repeat(a.arrays["o_b"], 2, axis=2)[:, :, ::2]), ERR_V, "o_b")
bad("c-merge-o_a-dtype-code-99", "c.merge", field_("o_a", dtype=99), ERR_T, "o_a")
bad("c-merge-lse_a-dtype-code-minus-1", "c.merge", field_("lse_a", dtype=-1), ERR_T, "lse_a")
bad("c-merge-out-dtype-int64", "c.merge", field_("out", dtype=c_abi.INT64), ERR_T, "out")
bad("c-merge-out-ndim-5", "c.merge", field_("out", ndim=5), ERR_V, "out")
bad("c-merge-o_b-ndim-0", "c.merge", field_("o_b", ndim=0), ERR_V, "o_b")
bad("c-merge-lse_b-ndim-3", "c.merge", field_("lse_b", ndim=3), ERR_V, "lse_b")
bad("c-merge-o_a-negative-shape", "c.merge", field_("o_a", shape=[T, -H, D]), ERR_V, "o_a")


def _head_size_2_24(a):
    # every O claims head_size 2^24 over a small buffer: refused before any memory is touched
    for k in ("out", "o_a", "o_b"):
        a[k].shape[:] = [1, 1, 2**24, 0]
    for k in ("out_lse", "lse_a", "lse_b"):
        a[k].shape[:] = [1, 1, 0, 0]


def _span_2_73_bytes(a):
    # shape [2^20, 2^10, 128] with a token stride of 2^53 elements: 2^73 bytes
    a["o_a"].shape[:3] = [2**20, 2**10, 128]
    a["o_a"].strides[:3] = [2**53, 128, 1]


def _all_on(device):
    def change(a):
        for t in a.values():
            if t is not None:
                t.device = device
    return change


def _float64_on(device):
    """Every array float64 (host memory), every descriptor saying it lives on `device` (vouched for:
    the library asks CUDA nothing, so the refusal needs no GPU)."""
    def change(a):
        for k, x in list(a.arrays.items()):
            a.use(k, x.astype(np.float64) if x.dtype == np.float32 else x)
            a[k].device, a[k].flags = device, c_abi.DEVICE_KNOWN
    return change


bad("c-merge-float64-on-a-gpu", "c.merge", _float64_on(0), ERR_T,
    exact="o_a: expected dtype float32, float16 or bfloat16 on CUDA device 0 (float64 runs on the CPU path only: host "
          "arrays), got float64")
bad("c-merge-head_size-above-the-maximum", "c.merge", _head_size_2_24, ERR_V, "o_b")
bad("c-merge-span-beyond-2^63-bytes", "c.merge", _span_2_73_bytes, ERR_V, "o_a")
bad("c-merge-stride-times-size-overflows-int64", "c.merge", field_("lse_b", strides=[2**62, 2**62]), ERR_V, "lse_b")
bad("c-merge-all-on-device-0-host-memory", "c.merge", _all_on(0), c_abi.ERROR_NO_DEVICE if NO_GPU else ERR_V, "out")
bad("c-merge-lse_a-on-device-0-others-host", "c.merge", field_("lse_a", device=0), ERR_V, "lse_a")
bad("c-merge-o_b-device-minus-2", "c.merge", field_("o_b", device=-2), ERR_V, "o_b")
bad("c-merge-out-read-only-flag", "c.merge", field_("out", flags=c_abi.READ_ONLY), ERR_V, "out")
bad("c-merge-out_lse-read-only-flag", "c.merge", field_("out_lse", flags=c_abi.READ_ONLY), ERR_V, "out_lse")
bad("c-merge-out_lse-overlaps-out", "c.merge", lambda a: setattr(a["out_lse"], "data", a["out"].data), ERR_V, "out_lse")


def _c_out_over_o_b(a):
    buf = np.concatenate([a.arrays["o_b"], a.o((1, H, D))])
    a.use("o_b", buf[:T])
    a.use("out", buf[1:])
    a.extra.append(buf)


def _c_lse_a_inside_out(a):
    a["lse_a"].data = a["out"].data  # lse_a lives in the first bytes of out
    a.arrays["out"].reshape(-1)[: T * H] = a.lse((T * H,))
    a["out_lse"] = None


bad("c-merge-out-partially-overlaps-o_b", "c.merge", _c_out_over_o_b, ERR_V, "out")
bad("c-merge-o_b-dtype-differs-from-o_a", "c.merge", field_("o_b", dtype=c_abi.FLOAT16, strides=[H * D, D, 1]), ERR_T, "o_b")
bad("c-merge-unknown-option-flags", "c.merge", opts(flags=0x100), ERR_V, "options.flags")
bad("c-merge-both-bases-of-lse_b", "c.merge", opts(flags=c_abi.LSE_B_BASE2 | c_abi.LSE_B_BASE_E), ERR_V,
    "options.flags")
bad("c-merge-both-bases-of-out_lse", "c.merge", opts(flags=c_abi.OUT_LSE_BASE2 | c_abi.OUT_LSE_BASE_E), ERR_V,
    "options.flags")
bad("c-merge-output_scale-with-float32-out", "c.merge", opts(output_scale=0.5), ERR_V, "output_scale")
bad("c-merge-output_scale_ptr-with-bfloat16-out", "c.merge", both(out_of("bfloat16"), _scale_ptr([2.0])), ERR_V,
    "output_scale")
bad("c-merge-output_scale-nan-fp8-out", "c.merge", both(out_of(FP8), opts(output_scale=float("nan"))), ERR_V,
    "output_scale")
bad("c-merge-output_scale-inf-fp8-out", "c.merge", both(out_of(FP8), opts(output_scale=float("inf"))), ERR_V,
    "output_scale")
bad("c-merge-output_scale-value-and-pointer", "c.merge", both(out_of(FP8), _scale_ptr([2.0], output_scale=2.0)), ERR_V,
    "output_scale")
bad("c-merge-output_scale_ptr-misaligned", "c.merge", both(out_of(FP8), _scale_ptr([2.0, 2.0], offset=1)), ERR_V,
    "output_scale")
_c_nvfp4 = both(_c_scales((T, H, D // 16), FP8), lambda a: a.use("out", poisoned((T, H, D // 2), "uint8")))
bad("c-merge-both-block-formats", "c.merge", both(out_of(FP8), _c_scales((T, H, 1), "float32"), _c_flags(c_abi.BLOCK_MXFP8 | c_abi.BLOCK_NVFP4)), ERR_V,
    "options.flags", "ATTNMERGE_BLOCK_MXFP8", "ATTNMERGE_BLOCK_NVFP4")
bad("c-merge-block-format-without-scales", "c.merge", both(out_of(FP8), opts(flags=c_abi.BLOCK_MXFP8)), ERR_V,
    "group_scales", "MXFP8")
bad("c-merge-rceil-with-nvfp4", "c.merge", both(_c_nvfp4, _c_flags(c_abi.BLOCK_NVFP4 | c_abi.SCALE_RCEIL)), ERR_V,
    "options.flags", "ATTNMERGE_SCALE_RCEIL")
bad("c-merge-swizzled-without-a-block-format", "c.merge", opts(flags=c_abi.SCALE_SWIZZLED), ERR_V, "options.flags",
    "ATTNMERGE_SCALE_SWIZZLED")
bad("c-merge-ue8m0-with-nvfp4", "c.merge", both(_c_nvfp4, _c_flags(c_abi.BLOCK_NVFP4 | c_abi.GROUP_SCALE_UE8M0)), ERR_V,
    "options.flags", "ATTNMERGE_GROUP_SCALE_UE8M0", "NVFP4")
bad("c-merge-nvfp4-group_size-32", "c.merge", both(_c_nvfp4, _c_flags(c_abi.BLOCK_NVFP4, group_size=32)), ERR_V,
    "group_size", "16", "NVFP4", "32")
bad("c-merge-a_tokens-negative", "c.merge", opts(flags=c_abi.A_TOKENS, a_tokens=-1), ERR_V, "a_tokens")
bad("c-merge-a_tokens-past-o_a", "c.merge", both(opts(flags=c_abi.A_TOKENS, a_tokens=T), field_("o_a", shape=[T - 1])),
    ERR_V, "o_a")
# every LSE [tokens, heads] read [heads, tokens]: as many inputs against the O as for them, and the
# source (o_b) decides: the first LSE is named
bad("c-merge-lse-heads-first-without-transpose", "c.merge", opts(flags=c_abi.LSE_HEADS_FIRST), ERR_V, "lse_a",
    exact=f"lse_a: expected shape [{H}, {T}] (the number of tokens of o_a and o_b), got [{T}, {H}]")
bad("c-merge-out-overlaps-lse_a", "c.merge", _c_lse_a_inside_out, ERR_V, "out")
bad("c-merge-out_lse-overlaps-o_a", "c.merge", lambda a: setattr(a["out_lse"], "data", a["o_a"].data), ERR_V, "out_lse")

# in place: a mask is passed


def _with_mask(a):
    a.use("mask", np.ones(T, np.uint8))


def _mask_walks_back(a):
    a["mask"].data += T - 1  # walking back from the last byte stays inside the mask
    a["mask"].strides[0] = -1


bad("c-inplace-lse-NULL-descriptor", "c.merge_inplace", null("lse"), ERR_T, "lse")
bad("c-inplace-o_other-NULL-descriptor", "c.merge_inplace", null("o_other"), ERR_T, "o_other")
bad("c-inplace-a_tokens-flag-not-allowed", "c.merge_inplace", opts(flags=c_abi.A_TOKENS, a_tokens=1), ERR_V,
    "options.flags")
bad("c-inplace-out-lse-base-not-allowed", "c.merge_inplace", opts(flags=c_abi.OUT_LSE_BASE2), ERR_V, "options.flags")
bad("c-inplace-mask-int32", "c.merge_inplace", both(_with_mask, field_("mask", dtype=c_abi.INT32)), ERR_T, "mask")
bad("c-inplace-mask-NULL-data", "c.merge_inplace", both(_with_mask, field_("mask", data=None)), ERR_V, "mask")
bad("c-inplace-mask-negative-stride", "c.merge_inplace", both(_with_mask, _mask_walks_back), ERR_V, "mask")
bad("c-inplace-o-read-only-flag", "c.merge_inplace", field_("o", flags=c_abi.READ_ONLY), ERR_V, "o")

# N-way


def _more_than_int32_states(a):
    # S = 2^31 read through zero strides: refused before any memory is read
    a["o"].shape[1], a["o"].strides[1] = 2**31, 0
    a["lse"].shape[1], a["lse"].strides[1] = 2**31, 0


bad("c-states-o-NULL-descriptor", "c.merge_states", null("o"), ERR_T, "o")
bad("c-states-more-than-int32-states", "c.merge_states", _more_than_int32_states, ERR_V, "o")
bad("c-states-heads-first-flag-not-allowed", "c.merge_states", opts(flags=c_abi.LSE_HEADS_FIRST), ERR_V, "options.flags")
bad("c-states-lse-b-base-not-allowed", "c.merge_states", opts(flags=c_abi.LSE_B_BASE_E), ERR_V, "options.flags")
bad("c-states-lse-ndim-2", "c.merge_states", field_("lse", ndim=2), ERR_V, "lse")
bad("c-states-out_lse-overlaps-lse", "c.merge_states", lambda a: setattr(a["out_lse"], "data", a["lse"].data), ERR_V,
    "out_lse")

# a state's share
bad("c-share-lse-NULL-descriptor", "c.merge_share", null("lse"), ERR_T, "lse")
bad("c-share-heads-first-flag-not-allowed", "c.merge_share", opts(flags=c_abi.LSE_HEADS_FIRST), ERR_V, "options.flags")

# variable length


def _c_indptr(values, dtype=np.int64):
    def change(a):
        rows = max(len(values) - 1, 0)
        a.use("indptr", np.array(values, dtype))
        a.use("out", poisoned((rows, H, D)))
        a.use("out_lse", poisoned((rows, H)))
    return change


def _no_entries(a):
    a["indptr"].shape[0] = 0
    a["out"].shape[0] = a["out_lse"].shape[0] = 0


bad("c-varlen-indptr-past-the-end", "c.merge_varlen", _c_indptr([0, 4, TOTAL + 1]), ERR_V, "indptr")
bad("c-varlen-indptr-int32-below-zero", "c.merge_varlen", _c_indptr([-5, 4, TOTAL], np.int32), ERR_V, "indptr")
bad("c-varlen-indptr-no-entries", "c.merge_varlen", both(_c_indptr([0]), _no_entries), ERR_V, "indptr")
bad("c-varlen-indptr-NULL-descriptor", "c.merge_varlen", null("indptr"), ERR_T, "indptr")
bad("c-varlen-indptr-uint8", "c.merge_varlen", field_("indptr", dtype=c_abi.UINT8), ERR_T, "indptr")
bad("c-varlen-indptr-on-device-1", "c.merge_varlen", field_("indptr", device=1), ERR_V, "indptr")

# the backward


bad("c-states-backward-output_scale", "c.merge_states_backward", opts(output_scale=2.0), ERR_V,
    starts="output_scale: expected none")
bad("c-states-backward-heads-first-flag-not-allowed", "c.merge_states_backward",
    both(null("grad_lse"), null("grad_out_lse"), opts(flags=c_abi.LSE_HEADS_FIRST)), ERR_V,
    starts="options.flags: expected flags within")

# the helpers
bad("c-stream_synchronize-device-0-without-gpu", "c.stream_synchronize", lambda a: a.options.update(device=0), ERR_V,
    "device", marks=(pytest.mark.skipif(not NO_GPU, reason="a GPU is present"),))
bad("c-stream_synchronize-negative-device", "c.stream_synchronize", lambda a: a.options.update(device=-1), ERR_V, "device")

# ================================================================================================
# a_tokens as a one-element int32 or int64 array (the two-way merge's, read on the device)


def a_tokens_array(value, dtype=np.int32):
    def change(a):
        a.options["a_tokens"] = np.asarray(value, dtype)
    return change


bad("merge-a_tokens-array-two-elements", "merge", a_tokens_array([3, 4]), ValueError, "a_tokens", 1, 2, layers=ANY)
bad("merge-a_tokens-array-float32", "merge", a_tokens_array([3], np.float32), TypeError, "a_tokens", "float32",
    layers=ANY, contains=("int32", "int64"))
bad("merge-a_tokens-array-elsewhere", "merge",
    lambda a: a.options.update(a_tokens=OnHost(np.array([3], np.int32))), ValueError, "a_tokens", "device",
    layers=("cuda",), marks=ELSEWHERE)


def _both_a_tokens(a):
    given = np.array([3], np.int32)
    a.extra.append(given)
    a.options["opts"] = c_abi.options(flags=c_abi.A_TOKENS, a_tokens=3, a_tokens_tensor=c_abi.tensor_from(given))


bad("c-merge-a_tokens-int-and-tensor", "c.merge", _both_a_tokens, ERR_V, "a_tokens", "both",
    starts="a_tokens: expected options.a_tokens")


def _a_tokens_tensor_refused(a):
    given = np.array([3], np.int32)
    a.extra.append(given)
    a.options["opts"] = c_abi.options(a_tokens_tensor=c_abi.tensor_from(given))


bad("c-merge_states-a_tokens-tensor-refused", "c.merge_states", _a_tokens_tensor_refused, ERR_V, "a_tokens", "none",
    starts="a_tokens: expected none")
