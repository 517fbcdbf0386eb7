"""The bad-input matrix (issue 6, item 1), CPU side: every public entry point against every kind of
mistake, each case its own test id.

Entry points: the native API (attnmerge.merge, merge_inplace, merge_states, merge_varlen), the
compat layers (attnmerge.compat.vllm, attnmerge.compat.flashinfer), the raw layer (attnmerge.raw)
and the C ABI through ctypes (tests/c_abi.py).  Each case must
  - raise ValueError / TypeError (Python) or return the documented non-zero status (C),
  - with a message that names the offending argument (attnmerge_last_error() for C), and
  - change no byte of any array it was given: every output starts poisoned (0xFF bytes, a NaN in
    every float format), and every buffer's bytes are compared before and after.
Cases that would crash the process on a library bug run in a child process (two did: element counts
that wrapped past 2^64, and a span of exactly 2^63 bytes).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field

import numpy as np
import pytest

import attnmerge
import c_abi
from attnmerge import raw
from attnmerge.compat import flashinfer, vllm

T, H, D = 5, 3, 8  # tokens, heads, head_size of the valid baseline
POISON = 0xFF  # 0xFF..: NaN in float32, float16, bfloat16 and float8_e4m3fn


def _gpus() -> int:
    return c_abi.load().attnmerge_device_count()


NO_GPU = _gpus() == 0


# ---- arrays ----------------------------------------------------------------------------------


def _np_dtype(name):
    if name in ("bfloat16", "float8_e4m3fn"):
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, name))
    return np.dtype(name)


_rng = np.random.default_rng(6)


def rand(shape, dtype="float32"):
    """Random input values (never zero, so a stray write of zeros is visible)."""
    return (_rng.random(shape, dtype=np.float32) + 0.5).astype(_np_dtype(dtype))


def lse(shape):
    return (_rng.standard_normal(shape).astype(np.float32) * 3).astype(np.float32)


def poisoned(shape, dtype="float32"):
    """An output buffer whose every byte is 0xFF."""
    dt = _np_dtype(dtype)
    return np.full(int(np.prod(shape)) * dt.itemsize, POISON, np.uint8).view(dt).reshape(shape)


def misaligned(shape, dtype="float32", offset=2):
    """A poisoned array whose data pointer is `offset` bytes past an aligned address."""
    dt = _np_dtype(dtype)
    n = int(np.prod(shape)) * dt.itemsize
    store = np.full(n + 64, POISON, np.uint8)
    start = (-store.ctypes.data) % 64 + offset
    return store[start:start + n].view(dt).reshape(shape)


def read_only(x):
    x = x.copy()
    x.flags.writeable = False
    return x


def pair(dtype="float32", t=T, h=H, d=D):
    return dict(o_a=rand((t, h, d), dtype), lse_a=lse((t, h)), o_b=rand((t, h, d), dtype), lse_b=lse((t, h)))


def outs(dtype="float32", t=T, h=H, d=D):
    return dict(out=poisoned((t, h, d), dtype), out_lse=poisoned((t, h)))


def snapshot(arrays):
    return [np.array(a, copy=True).tobytes() for a in arrays]


# ---- the matrix --------------------------------------------------------------------------------


@dataclass
class Case:
    id: str
    build: object  # () -> (call, arrays): call() runs the entry point (returns the status for C)
    expect: object  # an exception type (Python) or a C status code
    names: tuple  # words the message must contain (as whole words)
    marks: tuple = field(default_factory=tuple)


CASES: list[Case] = []


def case(id, expect, *names, marks=()):
    def register(build):
        CASES.append(Case(id, build, expect, names, tuple(marks)))
        return build

    return register


def names_in(word: str, msg: str) -> bool:
    """`word` occurs in msg as a whole word ('out' is not in 'out_lse', 'output' not in 'prefix_output')."""
    return re.search(r"(?<![\w.])" + re.escape(word) + r"(?![\w])", msg) is not None


# ================================================================================================
# native API: attnmerge.merge


def _merge(args, **kw):
    def call():
        return attnmerge.merge(args["o_a"], args["lse_a"], args["o_b"], args["lse_b"], out=args.get("out"),
                               out_lse=args.get("out_lse"), **kw)

    return call, [v for v in args.values() if isinstance(v, np.ndarray)]


@case("native-merge-o_a-2d", ValueError, "o_a")
def _():
    a = {**pair(), **outs()}
    a["o_a"] = a["o_a"][:, 0]
    return _merge(a)


@case("native-merge-o_a-5d", ValueError, "o_a")
def _():
    a = {**pair(), **outs()}
    a["o_a"] = a["o_a"][None, None]
    return _merge(a)


@case("native-merge-lse_b-wrong-shape", ValueError, "lse_b")
def _():
    a = {**pair(), **outs()}
    a["lse_b"] = lse((T, H + 1))
    return _merge(a)


@case("native-merge-out-wrong-shape", ValueError, "out")
def _():
    a = {**pair(), **outs()}
    a["out"] = poisoned((T, H, D + 1))
    return _merge(a)


@case("native-merge-o_b-dtype-differs-from-o_a", TypeError, "o_b")
def _():
    a = {**pair(), **outs()}
    a["o_b"] = a["o_b"].astype(np.float16)
    return _merge(a)


@case("native-merge-o_a-float64", TypeError, "o_a")
def _():
    a = {**pair(), **outs()}
    a["o_a"], a["o_b"] = a["o_a"].astype(np.float64), a["o_b"].astype(np.float64)
    return _merge(a)


@case("native-merge-o-float8-as-input", TypeError, "o_a")
def _():
    a = {**pair(), **outs()}
    a["o_a"], a["o_b"] = a["o_a"].astype(_np_dtype("float8_e4m3fn")), a["o_b"].astype(_np_dtype("float8_e4m3fn"))
    return _merge(a)


@case("native-merge-lse_a-float16", TypeError, "lse_a")
def _():
    a = {**pair(), **outs()}
    a["lse_a"] = a["lse_a"].astype(np.float16)
    return _merge(a)


@case("native-merge-out-int32", TypeError, "out")
def _():
    a = {**pair(), **outs()}
    a["out"] = np.full((T, H, D), -1, np.int32)
    return _merge(a)


@case("native-merge-out-zero-stride-writable", ValueError, "out")
def _():
    a = {**pair(), **outs()}
    base = poisoned((H, D))
    a["out"] = np.lib.stride_tricks.as_strided(base, (T, H, D), (0, D * 4, 4), writeable=True)
    return _merge(a)


@case("native-merge-o_a-negative-stride", ValueError, "o_a")
def _():
    a = {**pair(), **outs()}
    a["o_a"] = a["o_a"][::-1]
    return _merge(a)


@case("native-merge-out-negative-stride", ValueError, "out")
def _():
    a = {**pair(), **outs()}
    a["out"] = a["out"][:, ::-1]
    return _merge(a)


@case("native-merge-o_b-non-unit-innermost", ValueError, "o_b")
def _():
    a = {**pair(), **outs()}
    a["o_b"] = rand((T, H, 2 * D))[:, :, ::2]
    return _merge(a)


@case("native-merge-out_lse-overlaps-out", ValueError, "out_lse")
def _():
    a = pair()
    buf = poisoned((T * H * D,))
    a["out"], a["out_lse"] = buf.reshape(T, H, D), buf[: T * H].reshape(T, H)
    call, _ = _merge(a)
    return call, [buf, a["o_a"], a["lse_a"], a["o_b"], a["lse_b"]]


@case("native-merge-out-partially-overlaps-o_a", ValueError, "out")
def _():
    a = {**pair(), **outs()}
    buf = rand((T + 1, H, D))
    a["o_a"], a["out"] = buf[:T], buf[1:]
    call, _ = _merge(a)
    return call, [buf, a["lse_a"], a["o_b"], a["lse_b"], a["out_lse"]]


@case("native-merge-out-misaligned", ValueError, "out")
def _():
    a = {**pair(), **outs()}
    a["out"] = misaligned((T, H, D))
    return _merge(a)


@case("native-merge-out-read-only", ValueError, "out")
def _():
    a = {**pair(), **outs()}
    a["out"] = read_only(a["out"])
    return _merge(a)


@case("native-merge-out_lse-read-only", ValueError, "out_lse")
def _():
    a = {**pair(), **outs()}
    a["out_lse"] = read_only(a["out_lse"])
    return _merge(a)


@case("native-merge-o_a-nested-list", TypeError, "o_a")
def _():
    a = {**pair(), **outs()}
    a["o_a"] = a["o_a"].tolist()
    return _merge(a)


@case("native-merge-lse_b-string", TypeError, "lse_b")
def _():
    a = {**pair(), **outs()}
    a["lse_b"] = "lse"
    return _merge(a)


@case("native-merge-o_b-memoryview", TypeError, "o_b")
def _():
    a = pair()
    a["o_b"] = memoryview(a["o_b"])
    return _merge(a)


@case("native-merge-output_scale-with-float32-out", ValueError, "output_scale")
def _():
    return _merge({**pair(), **outs()}, output_scale=2.0)


@case("native-merge-output_scale-negative-fp8", ValueError, "output_scale")
def _():
    return _merge({**pair(), **outs("float8_e4m3fn")}, output_scale=-1.0)


@case("native-merge-a_tokens-past-the-tokens", ValueError, "a_tokens")
def _():
    return _merge({**pair(), **outs()}, a_tokens=T + 1)


@case("native-merge-base-3", ValueError, "base")
def _():
    return _merge({**pair(), **outs()}, base=3)


@case("native-merge-o_a-torch-meta-device", ValueError, "o_a")
def _():
    torch = pytest.importorskip("torch")
    a = {**pair(), **outs()}
    t = {k: torch.from_numpy(v) for k, v in a.items()}
    t["o_a"] = torch.empty((T, H, D), device="meta")

    def call():
        attnmerge.merge(t["o_a"], t["lse_a"], t["o_b"], t["lse_b"], out=t["out"], out_lse=t["out_lse"])

    return call, [a["out"], a["out_lse"]]


@case("native-merge-out-overlaps-lse_b", ValueError, "out")
def _():
    a = pair()
    buf = poisoned((T * H * D,))
    buf[: T * H] = lse(T * H)  # lse_b lives in the first bytes of out
    a["out"], a["lse_b"] = buf.reshape(T, H, D), buf[: T * H].reshape(T, H)
    a["out_lse"] = None
    call, _ = _merge(a)
    return call, [buf, a["o_a"], a["lse_a"], a["o_b"]]


# ---- attnmerge.merge_inplace


def _inplace(o, lse_, o_other, lse_other, mask=None, extra=()):
    def call():
        return attnmerge.merge_inplace(o, lse_, o_other, lse_other, mask=mask)

    return call, [x for x in (o, lse_, o_other, lse_other, mask, *extra) if isinstance(x, np.ndarray)]


def _state(t=T, dtype="float32"):
    return poisoned((t, H, D), dtype), poisoned((t, H))


@case("native-inplace-o-read-only", ValueError, "o")
def _():
    o, l = _state()
    return _inplace(read_only(o), l, rand((T, H, D)), lse((T, H)))


@case("native-inplace-lse-read-only", ValueError, "lse")
def _():
    o, l = _state()
    return _inplace(o, read_only(l), rand((T, H, D)), lse((T, H)))


@case("native-inplace-lse-zero-stride", ValueError, "lse")
def _():
    o, _ = _state()
    base = poisoned((H,))
    l = np.lib.stride_tricks.as_strided(base, (T, H), (0, 4), writeable=True)
    return _inplace(o, l, rand((T, H, D)), lse((T, H)), extra=[base])


@case("native-inplace-lse_other-wrong-shape", ValueError, "lse_other")
def _():
    o, l = _state()
    return _inplace(o, l, rand((T, H, D)), lse((T + 1, H)))


@case("native-inplace-o_other-bfloat16-vs-float32", TypeError, "o_other")
def _():
    o, l = _state()
    return _inplace(o, l, rand((T, H, D), "bfloat16"), lse((T, H)))


@case("native-inplace-mask-wrong-length", ValueError, "mask")
def _():
    o, l = _state()
    return _inplace(o, l, rand((T, H, D)), lse((T, H)), mask=np.ones(T + 1, np.uint8))


@case("native-inplace-mask-float32", TypeError, "mask")
def _():
    o, l = _state()
    return _inplace(o, l, rand((T, H, D)), lse((T, H)), mask=np.ones(T, np.float32))


@case("native-inplace-mask-2d", ValueError, "mask")
def _():
    o, l = _state()
    return _inplace(o, l, rand((T, H, D)), lse((T, H)), mask=np.ones((T, 1), np.uint8))


@case("native-inplace-o_other-partially-overlaps-o", ValueError, "o_other")
def _():
    buf = poisoned((T + 1, H, D))
    _, l = _state()
    return _inplace(buf[1:], l, buf[:T], lse((T, H)), extra=[buf])


@case("native-inplace-mask-overlaps-o", ValueError, "mask")
def _():
    o, l = _state()
    o[...] = rand((T, H, D))
    l[...] = lse((T, H))
    mask = o.reshape(-1).view(np.uint8)[:T]  # the mask's bytes are o's first element
    return _inplace(o, l, rand((T, H, D)), lse((T, H)), mask=mask)


# ---- attnmerge.merge_states


def _states(o, l, out=None, out_lse=None, extra=(), **kw):
    def call():
        return attnmerge.merge_states(o, l, out=out, out_lse=out_lse, **kw)

    return call, [x for x in (o, l, out, out_lse, *extra) if isinstance(x, np.ndarray)]


S = 3


@case("native-states-o-3d", ValueError, "o")
def _():
    return _states(rand((T, H, D)), lse((T, S, H)))


@case("native-states-lse-states-mismatch", ValueError, "lse")
def _():
    return _states(rand((T, S, H, D)), lse((T, S + 1, H)), *outs().values())


@case("native-states-lse-float16", TypeError, "lse")
def _():
    return _states(rand((T, S, H, D)), lse((T, S, H)).astype(np.float16), *outs().values())


@case("native-states-out-wrong-shape", ValueError, "out")
def _():
    return _states(rand((T, S, H, D)), lse((T, S, H)), poisoned((T, H + 1, D)), poisoned((T, H)))


@case("native-states-out-overlaps-o", ValueError, "out")
def _():
    o = rand((T, S, H, D))
    return _states(o, lse((T, S, H)), o[:, 0], poisoned((T, H)))


@case("native-states-out_lse-overlaps-lse", ValueError, "out_lse")
def _():
    l = lse((T, S, H))
    return _states(rand((T, S, H, D)), l, poisoned((T, H, D)), l[:, 1])


@case("native-states-out-read-only", ValueError, "out")
def _():
    return _states(rand((T, S, H, D)), lse((T, S, H)), read_only(poisoned((T, H, D))), poisoned((T, H)))


@case("native-states-states_axis-2", ValueError, "states_axis")
def _():
    return _states(rand((T, S, H, D)), lse((T, S, H)), *outs().values(), states_axis=2)


@case("native-states-o-non-unit-innermost", ValueError, "o")
def _():
    return _states(rand((T, S, H, 2 * D))[..., ::2], lse((T, S, H)), *outs().values())


# ---- attnmerge.merge_varlen

TOTAL = 7


def _varlen(indptr, o=None, l=None, out=None, out_lse=None, extra=()):
    o = rand((TOTAL, H, D)) if o is None else o
    l = lse((TOTAL, H)) if l is None else l

    def call():
        return attnmerge.merge_varlen(o, l, indptr, out=out, out_lse=out_lse)

    return call, [x for x in (o, l, indptr, out, out_lse, *extra) if isinstance(x, np.ndarray)]


def _rows_out(rows):
    return poisoned((rows, H, D)), poisoned((rows, H))


@case("native-varlen-indptr-past-the-end", ValueError, "indptr")
def _():
    return _varlen(np.array([0, 3, TOTAL + 1], np.int32), None, None, *_rows_out(2))


@case("native-varlen-indptr-negative", ValueError, "indptr")
def _():
    return _varlen(np.array([-1, 3, TOTAL], np.int64), None, None, *_rows_out(2))


@case("native-varlen-indptr-decreasing", ValueError, "indptr")
def _():
    return _varlen(np.array([0, 5, 2, TOTAL], np.int64), None, None, *_rows_out(3))


@case("native-varlen-indptr-huge-int64", ValueError, "indptr")
def _():
    return _varlen(np.array([0, 2**62, TOTAL], np.int64), None, None, *_rows_out(2))


@case("native-varlen-indptr-float32", TypeError, "indptr")
def _():
    return _varlen(np.array([0, 3, TOTAL], np.float32), None, None, *_rows_out(2))


@case("native-varlen-indptr-2d", ValueError, "indptr")
def _():
    return _varlen(np.array([[0, 3, TOTAL]], np.int32), None, None, *_rows_out(2))


@case("native-varlen-indptr-a-list", TypeError, "indptr")
def _():
    return _varlen([0, 3, TOTAL], None, None, *_rows_out(2))


@case("native-varlen-out-wrong-rows", ValueError, "out")
def _():
    return _varlen(np.array([0, 3, TOTAL], np.int32), None, None, *_rows_out(3))


@case("native-varlen-out-overlaps-indptr", ValueError, "indptr")
def _():
    out, out_lse = _rows_out(2)
    indptr = out.reshape(-1)[:3].view(np.int32)
    indptr[:] = [0, 3, TOTAL]
    return _varlen(indptr, None, None, out, out_lse)


# ================================================================================================
# compat: vLLM


def _vllm(output, output_lse, po, pl, so, sl, **kw):
    def call():
        vllm.merge_attn_states(output, po, pl, so, sl, output_lse, **kw)

    return call, [x for x in (output, output_lse, po, pl, so, sl) if isinstance(x, np.ndarray)]


def _vllm_args(dtype="float32"):
    # LSEs [heads, tokens]
    return [poisoned((T, H, D), dtype), poisoned((H, T)), rand((T, H, D)), lse((H, T)), rand((T, H, D)), lse((H, T))]


@case("vllm-prefix_output-float16-vs-float32", TypeError, "prefix_output")
def _():
    a = _vllm_args()
    a[2] = a[2].astype(np.float16)
    return _vllm(*a)


@case("vllm-suffix_lse-tokens-heads-layout", ValueError, "suffix_lse")
def _():
    a = _vllm_args()
    a[5] = lse((T, H))
    return _vllm(*a)


@case("vllm-output-read-only", ValueError, "output")
def _():
    a = _vllm_args()
    a[0] = read_only(a[0])
    return _vllm(*a)


@case("vllm-output_lse-wrong-shape", ValueError, "output_lse")
def _():
    a = _vllm_args()
    a[1] = poisoned((T, H))
    return _vllm(*a)


@case("vllm-output-not-an-array", TypeError, "output")
def _():
    a = _vllm_args()
    a[0] = None
    return _vllm(*a)


@case("vllm-prefill_tokens_with_context-negative", ValueError, "prefill_tokens_with_context")
def _():
    return _vllm(*_vllm_args(), prefill_tokens_with_context=-1)


@case("vllm-output_scale-with-float32-output", ValueError, "output_scale")
def _():
    return _vllm(*_vllm_args(), output_scale=np.array([2.0], np.float32))


@case("vllm-output_scale-two-elements", ValueError, "output_scale")
def _():
    return _vllm(*_vllm_args("float8_e4m3fn"), output_scale=np.array([2.0, 2.0], np.float32))


@case("vllm-output-partially-overlaps-suffix_output", ValueError, "output")
def _():
    buf = rand((T + 1, H, D))
    a = _vllm_args()
    a[0], a[4] = buf[1:], buf[:T]
    call, arrays = _vllm(*a)
    return call, arrays + [buf]


# ---- compat: FlashInfer


def _fi(fn, *args, **kw):
    def call():
        return fn(*args, **kw)

    return call, [x for x in (*args, *kw.values()) if isinstance(x, np.ndarray)]


@case("flashinfer-merge_state-v_b-wrong-tokens", ValueError, "s_b")
def _():
    return _fi(flashinfer.merge_state, rand((T, H, D)), lse((T, H)), rand((T - 1, H, D)), lse((T, H)))


@case("flashinfer-merge_state-s_a-float16", TypeError, "s_a")
def _():
    return _fi(flashinfer.merge_state, rand((T, H, D)), lse((T, H)).astype(np.float16), rand((T, H, D)), lse((T, H)))


@case("flashinfer-merge_state-v_a-not-an-array", TypeError, "v_a")
def _():
    return _fi(flashinfer.merge_state, object(), lse((T, H)), rand((T, H, D)), lse((T, H)))


@case("flashinfer-merge_state_in_place-v-read-only", ValueError, "v")
def _():
    return _fi(flashinfer.merge_state_in_place, read_only(poisoned((T, H, D))), poisoned((T, H)), rand((T, H, D)),
               lse((T, H)))


@case("flashinfer-merge_state_in_place-mask-wrong-length", ValueError, "mask")
def _():
    return _fi(flashinfer.merge_state_in_place, poisoned((T, H, D)), poisoned((T, H)), rand((T, H, D)), lse((T, H)),
               mask=np.ones(T - 1, np.bool_))


@case("flashinfer-merge_state_in_place-v_other-negative-stride", ValueError, "v_other")
def _():
    return _fi(flashinfer.merge_state_in_place, poisoned((T, H, D)), poisoned((T, H)), rand((T, H, D))[:, ::-1],
               lse((T, H)))


@case("flashinfer-merge_states-v-3d", ValueError, "v")
def _():
    return _fi(flashinfer.merge_states, rand((T, H, D)), lse((T, S, H)))


@case("flashinfer-merge_states-s-states-mismatch", ValueError, "s")
def _():
    return _fi(flashinfer.merge_states, rand((T, S, H, D)), lse((T, S - 1, H)))


@case("flashinfer-variable_length-indptr-past-the-end", ValueError, "indptr")
def _():
    return _fi(flashinfer.variable_length_merge_states, rand((TOTAL, H, D)), lse((TOTAL, H)),
               np.array([0, 2, TOTAL + 5], np.int32))


@case("flashinfer-variable_length-s-wrong-total", ValueError, "s")
def _():
    return _fi(flashinfer.variable_length_merge_states, rand((TOTAL, H, D)), lse((TOTAL - 1, H)),
               np.array([0, 2, TOTAL], np.int64))


# ================================================================================================
# raw layer


def _raw_args(out_ptr=None, dtype="float32"):
    a = pair()
    out = poisoned((T, H, D), dtype)
    out_lse = poisoned((T, H))
    arrays = [out, out_lse, *a.values()]
    kw = dict(tokens=T, heads=H, head_size=D,
              out=(out.ctypes.data if out_ptr is None else out_ptr, dtype, H * D, D),
              out_lse=(out_lse.ctypes.data, H, 1),
              o_a=(a["o_a"].ctypes.data, "float32", H * D, D), lse_a=(a["lse_a"].ctypes.data, H, 1),
              o_b=(a["o_b"].ctypes.data, "float32", H * D, D), lse_b=(a["lse_b"].ctypes.data, H, 1),
              device="cpu")
    return kw, arrays


def _raw(kw, arrays):
    return (lambda: raw.merge(**kw)), arrays


@case("raw-out-float32-offset-by-2-bytes", ValueError, "out")
def _():
    store = poisoned((T * H * D + 1,))
    kw, arrays = _raw_args(out_ptr=store.ctypes.data + 2)
    return _raw(kw, arrays + [store])


@case("raw-o_a-null-pointer", ValueError, "o_a")
def _():
    kw, arrays = _raw_args()
    kw["o_a"] = (0, "float32", H * D, D)
    return _raw(kw, arrays)


@case("raw-out-negative-token-stride", ValueError, "out")
def _():
    kw, arrays = _raw_args()
    kw["out"] = (kw["out"][0] + (T - 1) * H * D * 4, "float32", -H * D, D)
    return _raw(kw, arrays)


@case("raw-out_lse-zero-stride", ValueError, "out_lse")
def _():
    kw, arrays = _raw_args()
    kw["out_lse"] = (kw["out_lse"][0], 0, 1)
    return _raw(kw, arrays)


@case("raw-o_b-dtype-name-float64", TypeError, "o_b")
def _():
    kw, arrays = _raw_args()
    kw["o_b"] = (kw["o_b"][0], "float64", H * D, D)
    return _raw(kw, arrays)


@case("raw-lse_a-malformed-tuple", TypeError, "lse_a")
def _():
    kw, arrays = _raw_args()
    kw["lse_a"] = (kw["lse_a"][0], H)
    return _raw(kw, arrays)


@case("raw-device-string", ValueError, "device")
def _():
    kw, arrays = _raw_args()
    kw["device"] = "cuda"
    return _raw(kw, arrays)


@case("raw-negative-heads", ValueError, "heads")
def _():
    kw, arrays = _raw_args()
    kw["heads"] = -1
    return _raw(kw, arrays)


@case("raw-head_size-zero", ValueError, "o_b")
def _():
    kw, arrays = _raw_args()
    kw["head_size"] = 0
    return _raw(kw, arrays)


@case("raw-span-beyond-2^63-bytes", ValueError, "out")
def _():
    kw, arrays = _raw_args()
    kw["out"] = (kw["out"][0], "float32", 2**62, D)  # (T - 1) * 2^62 elements of 4 bytes
    return _raw(kw, arrays)


@case("raw-host-memory-on-device-0", ValueError if not NO_GPU else RuntimeError, "out")
def _():
    kw, arrays = _raw_args()
    kw["device"] = 0
    return _raw(kw, arrays)


# ================================================================================================
# C ABI through ctypes


class Abi:
    """One valid two-way merge over NumPy buffers, as ctypes descriptors to break one at a time."""

    def __init__(self, dtype="float32", out_dtype=None):
        a = pair(dtype)
        self.arrays = dict(out=poisoned((T, H, D), out_dtype or dtype), out_lse=poisoned((T, H)), **a)
        self.t = {k: c_abi.tensor_from(v) for k, v in self.arrays.items()}
        self.opts = None

    def use(self, name, array):
        """Pass `array` (which may share memory with others) as argument `name`."""
        self.arrays[name] = array
        self.t[name] = c_abi.tensor_from(array)

    def merge(self):
        t = self.t
        return (lambda: c_abi.merge(t["out"], t["out_lse"], t["o_a"], t["lse_a"], t["o_b"], t["lse_b"], self.opts),
                list(self.arrays.values()))


def _abi(mutate, **kw):
    m = Abi(**kw)
    mutate(m)
    return m.merge()


def _set(name, **fields):
    def mutate(m):
        for k, v in fields.items():
            if k in ("shape", "strides"):
                for i, x in enumerate(v):
                    getattr(m.t[name], k)[i] = x
            else:
                setattr(m.t[name], k, v)

    return mutate


@case("c-merge-out-NULL-descriptor", c_abi.ERROR_TYPE, "out")
def _():
    return _abi(lambda m: m.t.__setitem__("out", None))


@case("c-merge-lse_b-NULL-descriptor", c_abi.ERROR_TYPE, "lse_b")
def _():
    return _abi(lambda m: m.t.__setitem__("lse_b", None))


@case("c-merge-o_a-NULL-data-nonempty", c_abi.ERROR_VALUE, "o_a")
def _():
    return _abi(_set("o_a", data=None))


@case("c-merge-out_lse-NULL-data-nonempty", c_abi.ERROR_VALUE, "out_lse")
def _():
    return _abi(_set("out_lse", data=None))


@case("c-merge-o_b-float32-offset-by-2-bytes", c_abi.ERROR_VALUE, "o_b")
def _():
    m = Abi()
    store = rand((T * H * D + 1,))
    m.t["o_b"].data = store.ctypes.data + 2
    call, arrays = m.merge()
    return call, arrays + [store]


@case("c-merge-lse_a-offset-by-1-byte", c_abi.ERROR_VALUE, "lse_a")
def _():
    m = Abi()
    store = lse((T * H + 1,))
    m.t["lse_a"].data = store.ctypes.data + 1
    call, arrays = m.merge()
    return call, arrays + [store]


@case("c-merge-out-zero-token-stride", c_abi.ERROR_VALUE, "out")
def _():
    return _abi(_set("out", strides=[0, D, 1]))


@case("c-merge-out-heads-overlap-tokens", c_abi.ERROR_VALUE, "out")
def _():
    return _abi(_set("out", strides=[D, D, 1]))  # token t+1 is head 1 of token t


@case("c-merge-out-negative-stride", c_abi.ERROR_VALUE, "out")
def _():
    m = Abi()
    m.t["out"].data += (H - 1) * D * 4  # head h at -h * D from the last head: inside the buffer
    m.t["out"].strides[1] = -D
    return m.merge()


@case("c-merge-o_b-non-unit-innermost", c_abi.ERROR_VALUE, "o_b")
def _():
    m = Abi()
    m.use("o_b", rand((T, H, 2 * D))[:, :, ::2])  # strides [2HD, 2D, 2] over a buffer that holds them
    return m.merge()


@case("c-merge-o_a-dtype-code-99", c_abi.ERROR_TYPE, "o_a")
def _():
    return _abi(_set("o_a", dtype=99))


@case("c-merge-lse_a-dtype-code-minus-1", c_abi.ERROR_TYPE, "lse_a")
def _():
    return _abi(_set("lse_a", dtype=-1))


@case("c-merge-out-dtype-int64", c_abi.ERROR_TYPE, "out")
def _():
    return _abi(_set("out", dtype=c_abi.INT64))


@case("c-merge-out-ndim-5", c_abi.ERROR_VALUE, "out")
def _():
    return _abi(_set("out", ndim=5))


@case("c-merge-o_b-ndim-0", c_abi.ERROR_VALUE, "o_b")
def _():
    return _abi(_set("o_b", ndim=0))


@case("c-merge-lse_b-ndim-3", c_abi.ERROR_VALUE, "lse_b")
def _():
    return _abi(_set("lse_b", ndim=3))


@case("c-merge-o_a-negative-shape", c_abi.ERROR_VALUE, "o_a")
def _():
    return _abi(_set("o_a", shape=[T, -H, D]))


@case("c-merge-head_size-above-the-maximum", c_abi.ERROR_VALUE, "o_b")
def _():
    # every O claims head_size 2^24 over a small buffer: refused before any memory is touched
    def mutate(m):
        for k in ("out", "o_a", "o_b"):
            m.t[k].shape[:] = [1, 1, 2**24, 0]
        for k in ("out_lse", "lse_a", "lse_b"):
            m.t[k].shape[:] = [1, 1, 0, 0]

    return _abi(mutate)


@case("c-merge-span-beyond-2^63-bytes", c_abi.ERROR_VALUE, "o_a")
def _():
    # shape [2^20, 2^10, 128] with a token stride of 2^53 elements: 2^73 bytes
    def mutate(m):
        m.t["o_a"].shape[:3] = [2**20, 2**10, 128]
        m.t["o_a"].strides[:3] = [2**53, 128, 1]

    return _abi(mutate)


@case("c-merge-stride-times-size-overflows-int64", c_abi.ERROR_VALUE, "lse_b")
def _():
    return _abi(_set("lse_b", strides=[2**62, 2**62]))


@case("c-merge-all-on-device-0-host-memory", c_abi.ERROR_NO_DEVICE if NO_GPU else c_abi.ERROR_VALUE, "out")
def _():
    def mutate(m):
        for t in m.t.values():
            t.device = 0

    return _abi(mutate)


@case("c-merge-lse_a-on-device-0-others-host", c_abi.ERROR_VALUE, "lse_a")
def _():
    return _abi(_set("lse_a", device=0))


@case("c-merge-o_b-device-minus-2", c_abi.ERROR_VALUE, "o_b")
def _():
    return _abi(_set("o_b", device=-2))


@case("c-merge-out-read-only-flag", c_abi.ERROR_VALUE, "out")
def _():
    return _abi(_set("out", flags=c_abi.READ_ONLY))


@case("c-merge-out_lse-read-only-flag", c_abi.ERROR_VALUE, "out_lse")
def _():
    return _abi(_set("out_lse", flags=c_abi.READ_ONLY))


@case("c-merge-out_lse-overlaps-out", c_abi.ERROR_VALUE, "out_lse")
def _():
    return _abi(lambda m: setattr(m.t["out_lse"], "data", m.t["out"].data))


@case("c-merge-out-partially-overlaps-o_b", c_abi.ERROR_VALUE, "out")
def _():
    m = Abi()
    buf = rand((T + 1, H, D))
    m.use("o_b", buf[:T])
    m.use("out", buf[1:])
    return m.merge()


@case("c-merge-o_b-dtype-differs-from-o_a", c_abi.ERROR_TYPE, "o_b")
def _():
    return _abi(_set("o_b", dtype=c_abi.FLOAT16, strides=[H * D, D, 1]))


@case("c-merge-unknown-option-flags", c_abi.ERROR_VALUE, "options.flags")
def _():
    return _abi(lambda m: setattr(m, "opts", c_abi.options(flags=0x80)))


@case("c-merge-output_scale-with-float32-out", c_abi.ERROR_VALUE, "output_scale")
def _():
    return _abi(lambda m: setattr(m, "opts", c_abi.options(output_scale=0.5)))


@case("c-merge-output_scale_ptr-with-bfloat16-out", c_abi.ERROR_VALUE, "output_scale")
def _():
    scale = np.array([2.0], np.float32)

    def mutate(m):
        m.opts = c_abi.options(output_scale_ptr=scale.ctypes.data)
        m.scale = scale

    return _abi(mutate, dtype="bfloat16")


@case("c-merge-output_scale-nan-fp8-out", c_abi.ERROR_VALUE, "output_scale")
def _():
    return _abi(lambda m: setattr(m, "opts", c_abi.options(output_scale=float("nan"))), out_dtype="float8_e4m3fn")


@case("c-merge-output_scale-inf-fp8-out", c_abi.ERROR_VALUE, "output_scale")
def _():
    return _abi(lambda m: setattr(m, "opts", c_abi.options(output_scale=float("inf"))), out_dtype="float8_e4m3fn")


@case("c-merge-output_scale-value-and-pointer", c_abi.ERROR_VALUE, "output_scale")
def _():
    scale = np.array([2.0], np.float32)

    def mutate(m):
        m.opts = c_abi.options(output_scale=2.0, output_scale_ptr=scale.ctypes.data)
        m.scale = scale

    return _abi(mutate, out_dtype="float8_e4m3fn")


@case("c-merge-output_scale_ptr-misaligned", c_abi.ERROR_VALUE, "output_scale")
def _():
    scale = np.array([2.0, 2.0], np.float32)

    def mutate(m):
        m.opts = c_abi.options(output_scale_ptr=scale.ctypes.data + 1)
        m.scale = scale

    return _abi(mutate, out_dtype="float8_e4m3fn")


@case("c-merge-a_tokens-negative", c_abi.ERROR_VALUE, "a_tokens")
def _():
    return _abi(lambda m: setattr(m, "opts", c_abi.options(flags=c_abi.A_TOKENS, a_tokens=-1)))


@case("c-merge-a_tokens-past-o_a", c_abi.ERROR_VALUE, "o_a")
def _():
    def mutate(m):
        m.opts = c_abi.options(flags=c_abi.A_TOKENS, a_tokens=T)
        m.t["o_a"].shape[0] = T - 1  # a must cover a_tokens tokens

    return _abi(mutate)


@case("c-merge-lse-heads-first-without-transpose", c_abi.ERROR_VALUE, "lse_b")
def _():
    return _abi(lambda m: setattr(m, "opts", c_abi.options(flags=c_abi.LSE_HEADS_FIRST)))


@case("c-merge-out-overlaps-lse_a", c_abi.ERROR_VALUE, "out")
def _():
    m = Abi()
    m.t["lse_a"].data = m.t["out"].data  # lse_a lives in the first bytes of out
    m.arrays["out"].reshape(-1)[: T * H] = lse(T * H)
    m.t["out_lse"] = None
    return m.merge()


@case("c-merge-out_lse-overlaps-o_a", c_abi.ERROR_VALUE, "out_lse")
def _():
    m = Abi()
    m.t["out_lse"].data = m.t["o_a"].data  # out_lse is o_a's first T * H floats
    return m.merge()


# ---- C ABI: in-place, N-way, varlen and the helpers


def _abi_inplace(mutate=None):
    o, l = poisoned((T, H, D)), poisoned((T, H))
    o[...] = rand((T, H, D))
    l[...] = lse((T, H))
    oo, lo, mask = rand((T, H, D)), lse((T, H)), np.ones(T, np.uint8)
    t = dict(o=c_abi.tensor_from(o), lse=c_abi.tensor_from(l), o_other=c_abi.tensor_from(oo),
             lse_other=c_abi.tensor_from(lo), mask=c_abi.tensor_from(mask))
    box = {"opts": None}
    if mutate:
        mutate(t, box)
    return (lambda: c_abi.merge_inplace(t["o"], t["lse"], t["o_other"], t["lse_other"], t["mask"], box["opts"]),
            [o, l, oo, lo, mask])


@case("c-inplace-lse-NULL-descriptor", c_abi.ERROR_TYPE, "lse")
def _():
    return _abi_inplace(lambda t, b: t.__setitem__("lse", None))


@case("c-inplace-o_other-NULL-descriptor", c_abi.ERROR_TYPE, "o_other")
def _():
    return _abi_inplace(lambda t, b: t.__setitem__("o_other", None))


@case("c-inplace-a_tokens-flag-not-allowed", c_abi.ERROR_VALUE, "options.flags")
def _():
    return _abi_inplace(lambda t, b: b.__setitem__("opts", c_abi.options(flags=c_abi.A_TOKENS, a_tokens=1)))


@case("c-inplace-mask-int32", c_abi.ERROR_TYPE, "mask")
def _():
    return _abi_inplace(lambda t, b: setattr(t["mask"], "dtype", c_abi.INT32))


@case("c-inplace-mask-NULL-data", c_abi.ERROR_VALUE, "mask")
def _():
    return _abi_inplace(lambda t, b: setattr(t["mask"], "data", None))


@case("c-inplace-mask-negative-stride", c_abi.ERROR_VALUE, "mask")
def _():
    def mutate(t, b):
        t["mask"].data += T - 1  # walking back from the last byte stays inside the mask
        t["mask"].strides[0] = -1

    return _abi_inplace(mutate)


@case("c-inplace-o-read-only-flag", c_abi.ERROR_VALUE, "o")
def _():
    return _abi_inplace(lambda t, b: setattr(t["o"], "flags", c_abi.READ_ONLY))


def _abi_states(mutate=None, s=S):
    o, l = rand((T, s, H, D)), lse((T, s, H))
    out, out_lse = poisoned((T, H, D)), poisoned((T, H))
    t = dict(out=c_abi.tensor_from(out), out_lse=c_abi.tensor_from(out_lse), o=c_abi.tensor_from(o),
             lse=c_abi.tensor_from(l))
    box = {"opts": None}
    if mutate:
        mutate(t, box)
    return lambda: c_abi.merge_states(t["out"], t["out_lse"], t["o"], t["lse"], box["opts"]), [out, out_lse, o, l]


@case("c-states-o-NULL-descriptor", c_abi.ERROR_TYPE, "o")
def _():
    return _abi_states(lambda t, b: t.__setitem__("o", None))


@case("c-states-more-than-int32-states", c_abi.ERROR_VALUE, "o")
def _():
    # S = 2^31 read through zero strides: refused before any memory is read
    def mutate(t, b):
        t["o"].shape[1], t["o"].strides[1] = 2**31, 0
        t["lse"].shape[1], t["lse"].strides[1] = 2**31, 0

    return _abi_states(mutate, s=1)


@case("c-states-heads-first-flag-not-allowed", c_abi.ERROR_VALUE, "options.flags")
def _():
    return _abi_states(lambda t, b: b.__setitem__("opts", c_abi.options(flags=c_abi.LSE_HEADS_FIRST)))


@case("c-states-lse-ndim-2", c_abi.ERROR_VALUE, "lse")
def _():
    return _abi_states(lambda t, b: setattr(t["lse"], "ndim", 2))


@case("c-states-out_lse-overlaps-lse", c_abi.ERROR_VALUE, "out_lse")
def _():
    return _abi_states(lambda t, b: setattr(t["out_lse"], "data", t["lse"].data))


def _abi_varlen(indptr, mutate=None, dtype=c_abi.INT64):
    rows = len(indptr) - 1
    o, l = rand((TOTAL, H, D)), lse((TOTAL, H))
    ip = np.array(indptr, np.int64 if dtype == c_abi.INT64 else np.int32)
    out, out_lse = poisoned((rows, H, D)), poisoned((rows, H))
    t = dict(out=c_abi.tensor_from(out), out_lse=c_abi.tensor_from(out_lse), o=c_abi.tensor_from(o),
             lse=c_abi.tensor_from(l), indptr=c_abi.tensor_from(ip))
    if mutate:
        mutate(t)
    return (lambda: c_abi.merge_varlen(t["out"], t["out_lse"], t["o"], t["lse"], t["indptr"]),
            [out, out_lse, o, l, ip])


@case("c-varlen-indptr-past-the-end", c_abi.ERROR_VALUE, "indptr")
def _():
    return _abi_varlen([0, 4, TOTAL + 1])


@case("c-varlen-indptr-int32-below-zero", c_abi.ERROR_VALUE, "indptr")
def _():
    return _abi_varlen([-5, 4, TOTAL], dtype=c_abi.INT32)


@case("c-varlen-indptr-no-entries", c_abi.ERROR_VALUE, "indptr")
def _():
    def mutate(t):
        t["indptr"].shape[0] = 0
        t["out"].shape[0] = t["out_lse"].shape[0] = 0

    return _abi_varlen([0], mutate)


@case("c-varlen-indptr-NULL-descriptor", c_abi.ERROR_TYPE, "indptr")
def _():
    return _abi_varlen([0, 4, TOTAL], lambda t: t.__setitem__("indptr", None))


@case("c-varlen-indptr-uint8", c_abi.ERROR_TYPE, "indptr")
def _():
    return _abi_varlen([0, 4, TOTAL], lambda t: setattr(t["indptr"], "dtype", c_abi.UINT8))


@case("c-varlen-indptr-on-device-1", c_abi.ERROR_VALUE, "indptr")
def _():
    return _abi_varlen([0, 4, TOTAL], lambda t: setattr(t["indptr"], "device", 1))


@case("c-stream_synchronize-device-0-without-gpu", c_abi.ERROR_VALUE, "device",
      marks=[pytest.mark.skipif(not NO_GPU, reason="a GPU is present")])
def _():
    return (lambda: c_abi.load().attnmerge_stream_synchronize(0, None)), []


@case("c-stream_synchronize-negative-device", c_abi.ERROR_VALUE, "device")
def _():
    return (lambda: c_abi.load().attnmerge_stream_synchronize(-1, None)), []


# ================================================================================================
# sizes past 64 bits: run in a child process, since the library bugs they hit crash the process:
# an element count that wraps to 0 mod 2^64 (View::numel() says "empty", every check is skipped, the
# merge still walks tokens * heads rows), and a 1-byte tensor spanning exactly 2^63 bytes (the
# overflow check computes `last + 1` in int64 and wraps before it multiplies).

_CHILD = textwrap.dedent("""
    import sys
    import numpy as np
    import c_abi
    op = sys.argv[1]
    buf = np.full(1 << 12, np.nan, np.float32)
    lse = np.zeros(4, np.float32)
    idx = np.zeros(4, np.int64)
    B, L, I = buf.ctypes.data, lse.ctypes.data, idx.ctypes.data
    F = c_abi.FLOAT32
    if op == "merge":  # the issue's example: [2^40, 2^20, 128], 2^67 elements
        O = lambda: c_abi.tensor(B, [2**40, 2**20, 128], [2**27, 2**7, 1], F)
        S = lambda: c_abi.tensor(L, [2**40, 2**20], [0, 0], F)
        s = c_abi.merge(O(), None, O(), S(), O(), S())
    elif op == "raw":
        import attnmerge.raw
        try:
            attnmerge.raw.merge(tokens=2**40, heads=2**20, head_size=128, out=(B, "float32", 2**27, 2**7),
                                o_a=(B, "float32", 2**27, 2**7), lse_a=(L, 0, 0), o_b=(B, "float32", 2**27, 2**7),
                                lse_b=(L, 0, 0), device="cpu")
            s = 0
        except ValueError as e:
            print("ValueError", e)
            sys.exit(0)
    elif op == "states":  # o [2^32, 1, 2^16, 2^16]
        out = c_abi.tensor(B, [2**32, 2**16, 2**16], [2**32, 2**16, 1], F)
        o = c_abi.tensor(B, [2**32, 1, 2**16, 2**16], [2**32, 2**32, 2**16, 1], F)
        l = c_abi.tensor(L, [2**32, 1, 2**16], [0, 0, 0], F)
        s = c_abi.merge_states(out, None, o, l)
    elif op in ("mask-c", "mask-python"):  # a uint8 mask [2] with stride 2^63 - 1: 2^63 bytes
        o, l = np.ones((2, 2, 8), np.float32), np.zeros((2, 2), np.float32)
        oo, lo, m = o.copy(), l.copy(), np.ones(2, np.uint8)
        if op == "mask-python":
            import attnmerge
            try:
                attnmerge.merge_inplace(o, l, oo, lo, mask=np.lib.stride_tricks.as_strided(m, (2,), (2**63 - 1,)))
                s = 0
            except ValueError as e:
                print("ValueError", e)
                sys.exit(0)
        else:
            mask = c_abi.tensor(m.ctypes.data, [2], [2**63 - 1], c_abi.UINT8)
            s = c_abi.merge_inplace(*map(c_abi.tensor_from, (o, l, oo, lo)), mask)
    elif op == "varlen":  # out [2^24, 2^24, 2^16]; indptr all zero through a zero stride
        out = c_abi.tensor(B, [2**24, 2**24, 2**16], [2**40, 2**16, 1], F)
        o = c_abi.tensor(B, [2**24, 2**24, 2**16], [2**40, 2**16, 1], F)
        l = c_abi.tensor(L, [2**24, 2**24], [0, 0], F)
        ip = c_abi.tensor(I, [2**24 + 1], [0], c_abi.INT64)
        s = c_abi.merge_varlen(out, None, o, l, ip)
    print("status", s, c_abi.last_error())
    sys.exit(0 if s == c_abi.ERROR_VALUE and c_abi.last_error() else 3)
""")


def _child(op):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(__file__)), os.environ.get("PYTHONPATH", "")]),
               ATTNMERGE_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", _CHILD, op], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, f"child exited with {r.returncode}: {r.stdout[-500:]} {r.stderr[-500:]}"
    assert re.search(r"\b(out|o|mask)\b", r.stdout), f"the message names no argument: {r.stdout!r}"


@pytest.mark.parametrize("op", [
    pytest.param(op) for op in ("merge", "raw", "states", "varlen")])
def test_element_count_wrapping_past_2_64_is_refused(op):
    _child(op)


@pytest.mark.parametrize("op", [
    pytest.param(op) for op in ("mask-c", "mask-python")])
def test_span_of_exactly_2_63_bytes_is_refused(op):
    _child(op)


def test_the_matrix_is_large_enough():
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids)), "duplicate case ids"
    assert len(ids) >= 40
    families = {i.split("-")[0] for i in ids}
    assert {"native", "vllm", "flashinfer", "raw", "c"} <= families


# ---- the runner: after every case above has registered


@pytest.mark.parametrize("c", [pytest.param(c, id=c.id, marks=c.marks) for c in CASES])
def test_bad_input(c: Case):
    call, arrays = c.build()
    before = snapshot(arrays)
    if isinstance(c.expect, int):
        status = call()
        msg = c_abi.last_error()
        assert status == c.expect, f"status {status}, expected {c.expect}; message {msg!r}"
    else:
        with pytest.raises(c.expect) as info:
            call()
        msg = str(info.value)
    assert msg, "an error without a message"
    for word in c.names:
        assert names_in(word, msg), f"{word!r} is not named in the message {msg!r}"
    for i, (b, a) in enumerate(zip(before, snapshot(arrays))):
        assert a == b, f"array #{i} changed although the call failed ({msg!r})"
