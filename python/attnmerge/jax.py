"""attnmerge for JAX: the merges as XLA FFI custom calls (``jax.ffi``), traceable and usable under
``jax.jit`` and ``jax.vmap``, on the GPU (on the stream XLA gives the call) and on the CPU.

    import jax, attnmerge.jax
    out, out_lse = jax.jit(attnmerge.jax.merge)(o_a, lse_a, o_b, lse_b)
    f = jax.jit(lambda *s: attnmerge.jax.merge(*s, base=2, out_dtype=jnp.float32))

Importing this module registers the FFI targets ``attnmerge_merge``, ``attnmerge_merge_states``,
``attnmerge_merge_varlen`` and ``attnmerge_merge_share`` (and the backwards of the first three) for
the CUDA and CPU platforms.

This is the one road of JAX arrays: ``attnmerge.merge``, ``merge_states``, ``merge_varlen`` and
``merge_share`` call
these functions for a call whose results would be allocated like a JAX array, and attnmerge never
writes a JAX array (they are immutable).

Options (``base``, ``out_base``, ``out_dtype``, ``a_tokens``, ``states_axis``, merge_share's ``index``, a
float ``output_scale``, ``group_size``, ``scale_ue8m0``, ``block_format``, ``scale_layout``,
``scale_rounding``) are static: Python values, fixed when the
function is traced, so a jitted function passes them itself (as above, or with
``functools.partial``), and needs no ``static_argnames``.  A traced option is refused
with a TypeError.  ``output_scale`` may also be a float32 JAX array of one element (read on the
device, traced like any input).

Gradients: merge, merge_states, merge_varlen and merge_share are differentiable (``jax.grad``,
``jax.vjp``) with respect to every O and LSE input and the sink, through ``custom_vjp``: over
attnmerge's fused backward (its own FFI calls, from the saved inputs and results), and for
merge_share in jax.numpy (elementwise work over its one O); an empty part gets zero gradients.
An FP8 or scaled output (per-group FP8 too) has no gradient: asking for one raises
NotImplementedError.

Shapes are checked when the call is traced (a ValueError naming the argument); everything else
(dtypes, values) by libattnmerge when the call runs, whose message, naming the argument, comes back
in the error XLA raises.  Under ``jax.vmap`` merge and merge_states are one call over the flattened
batch, and so is merge_share; merge with ``a_tokens``, any of them with an array
``output_scale`` or a ``sink``, and merge_varlen run once per batch element.
"""
from __future__ import annotations

import ctypes
import functools
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import _C
from ._build import XLA_HOW, XLA_LIB
from ._call import (OPS, Options, base_change, base_flags, index_of, options, scales_of, softmax_stats,
                    states_axis_of)
from ._grad import share_gradient, sink_gradient, stats_gradient, stats_lse
from ._types import NO_GRADIENT_DTYPES, Base, PairBase

__all__ = ["merge", "merge_states", "merge_varlen", "merge_share"]

_FFI_OPS = ("merge", "merge_states", "merge_varlen", "merge_share", "merge_backward", "merge_states_backward",
            "merge_varlen_backward")
_MERGE, _STATES, _VARLEN, _SHARE = (OPS[name] for name in ("merge", "merge_states", "merge_varlen", "merge_share"))
# The options the XLA handlers read as attributes (python/src/call_options.h), with their types.
_SCALARS = _C.OPTION_FIELDS[:_C.OPTION_FIELDS.index("scale")]
_ATTRIBUTE_TYPES = {name: np.float64 if name == "output_scale" else np.int64 for name in _SCALARS}


def _register():
    if not os.path.exists(XLA_LIB):
        raise ImportError(f"attnmerge.jax: this attnmerge was built without the JAX extension ({XLA_LIB} "
                          f"is missing); to get it, {XLA_HOW}")
    lib = ctypes.CDLL(XLA_LIB)
    for op in _FFI_OPS:
        for platform, suffix in (("CUDA", "cuda"), ("cpu", "host")):
            handler = getattr(lib, f"attnmerge_xla_{op}_{suffix}")
            jax.ffi.register_ffi_target(f"attnmerge_{op}", jax.ffi.pycapsule(handler), platform=platform)
    return lib


_lib = _register()


def _static(name, value):
    """`value` of the option `name`, refused when traced."""
    if isinstance(value, jax.core.Tracer):
        raise TypeError(f"{name}: expected a Python value (a static option, fixed when the function is traced), got "
                        f"a traced value: pass it from inside the jitted function or with functools.partial")
    return value


def _options(op, output_scale=None, sink=None, sum_a=None, sum_b=None, valid=None, num_tokens=None, **static):
    """The call's Options (attnmerge._call.options, the one reading), its static options refused
    when traced; output_scale may be an array (traced like any input), or a static number."""
    if output_scale is not None and isinstance(output_scale, (int, float, np.number, jax.core.Tracer)) and \
            not isinstance(output_scale, jax.Array):
        output_scale = _static("output_scale", output_scale)
    if isinstance(output_scale, np.number):
        output_scale = float(output_scale)
    return options(op, output_scale=output_scale, sink=sink, sum_a=sum_a, sum_b=sum_b, valid=valid,
                   num_tokens=num_tokens, **{k: _static(k, v) for k, v in static.items()})


# The optional arrays of a forward after its operands, in the FFI call's order (the output scale's
# buffer sits between the sink and the sums): each read where its has_* attribute says.
_EXTRAS = ("sink", "sum_a", "sum_b", "valid", "num_tokens")


def _given(opt: Options):
    """(has, arrays): which of _EXTRAS the call gives, and those arrays, in order."""
    has = tuple(getattr(opt, name) is not None for name in _EXTRAS)
    return has, tuple(getattr(opt, name) for name, given in zip(_EXTRAS, has) if given)


def _unpack(has, arrays):
    """{name: array or None} of _EXTRAS from the arrays `has` says are given."""
    it = iter(arrays)
    return {name: next(it) if given else None for name, given in zip(_EXTRAS, has)}


def _shape(x):
    return list(jnp.shape(x))


def _expect(name, x, shape, what):
    if _shape(x) != list(shape):
        raise ValueError(f"{name}: expected shape {list(shape)} ({what}), got {_shape(x)}")


def _expect_ndim(name, x, ndim, what):
    if jnp.ndim(x) != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions ({what}), got {jnp.ndim(x)} (shape {_shape(x)})")


def _expect_sink(sink, heads):
    if sink is not None:
        _expect("sink", sink, (heads,), "heads of o")


def _expect_extras(opt: Options, lses, valid_shape):
    """The softmax sums of the call's LSE arguments `lses` ((name, array) of each, None where the
    op has no such argument) shaped as those, and valid as `valid_shape`."""
    for (name, lse), total in zip(lses, (opt.sum_a, opt.sum_b)):
        if total is not None:
            _expect(f"{name}[1]", total, _shape(lse), f"the shape of {name}[0]")
    if opt.valid is not None and valid_shape is not None:
        _expect("valid", opt.valid, valid_shape, "which states hold keys")


def _attributes(opt: Options):
    """The call's attributes: the options the handlers read, by name (call_options.h)."""
    return {name: _ATTRIBUTE_TYPES[name](getattr(opt, name)) for name in _SCALARS}


def _key(opt: Options) -> Options:
    """The static part of a call's options (its arrays and names dropped): a cache key of the
    differentiable functions, hashable."""
    return opt._replace(scale=None, sink=None, group_scales=None, sum_a=None, sum_b=None, valid=None,
                        num_tokens=None, a_tokens_tensor=None, names=None, stream=None)


def _ffi(op, outs, operands, key: Options, extras, *, scale=None, vectorized=True):
    """The FFI call of `op`: `operands`, then the sink, the output scale's array, the softmax sums
    and valid (`extras`, _unpack's: each an array, or an unread one: has_sink, scale_in_buffer,
    has_sum_a, has_sum_b, has_valid), the options as attributes.  `outs`: (out, out_lse)'s shapes;
    with a group size the group scales (attnmerge._native.scales_of: per-group FP8's or a block
    format's) are a third result (every call has that result: one of no elements, unwritten,
    without groups)."""
    group = key.group_size
    # One call over a flattened batch: every operand is broadcast to the batch (the handler folds
    # leading dimensions into tokens), which per-example a_tokens, indptr, scale or sink would break
    # (the sums and valid are per token, folded alike), and so would swizzled scales (tiles of 128
    # rows, not of a batch element's), and a live count (of each element's tokens).
    sink = extras["sink"]
    method = "broadcast_all" if vectorized and key.a_tokens < 0 and scale is None and sink is None and \
        extras["num_tokens"] is None and not key.flags & _C.SCALE_SWIZZLED else "sequential"
    rows, heads, head_size = outs[0].shape
    if key.flags & _C.BLOCK_NVFP4:
        head_size *= 2  # out's bytes
    shape, dtype = scales_of(rows, heads, head_size, key) if group else ((0,), "float32")
    scales = jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))
    call = jax.ffi.ffi_call(f"attnmerge_{op}", (*outs, scales), vmap_method=method)
    unread = jnp.full((1,), -jnp.inf, jnp.float32)
    scale_buffer = jnp.ones((1,), jnp.float32) if scale is None else jnp.reshape(jnp.asarray(scale, jnp.float32), (1,))
    buffers = [unread if sink is None else sink, scale_buffer]
    buffers += [unread if extras[name] is None else extras[name] for name in ("sum_a", "sum_b")]
    buffers.append(jnp.ones((1,), jnp.uint8) if extras["valid"] is None else extras["valid"])
    buffers.append(jnp.zeros((1,), jnp.int32) if extras["num_tokens"] is None else extras["num_tokens"])
    has = {f"has_{name}": extras[name] is not None for name in ("sink", "sum_a", "sum_b", "valid", "num_tokens")}
    results = call(*operands, *buffers, **_attributes(key), scale_in_buffer=scale is not None, **has)
    return tuple(results) if group else tuple(results[:2])


def _results(tokens, heads, head_size, dtype):
    lse = jnp.float64 if dtype == jnp.float64 else jnp.float32  # a float64 call is float64 whole (CPU, x64)
    return (jax.ShapeDtypeStruct((tokens, heads, head_size), dtype), jax.ShapeDtypeStruct((tokens, heads), lse))


def _out_dtype(opt: Options, like):
    return like.dtype if opt.out_dtype is None else jnp.dtype(opt.out_dtype)


# ---- the ops ----------------------------------------------------------------------------------------


def merge(o_a: jax.Array, lse_a: Any, o_b: jax.Array, lse_b: Any, *, base: PairBase = "e",
          out_base: Base | None = None, out_dtype: Any = None, a_tokens: int | None = None,
          output_scale: float | jax.Array | None = None, sink: jax.Array | None = None,
          group_size: int | None = None, scale_ue8m0: bool = False, block_format: str | None = None,
          scale_layout: str = "row_major", scale_rounding: str = "floor", valid: jax.Array | None = None,
          num_tokens: jax.Array | None = None,
          batch_invariant: bool = False) -> tuple[jax.Array, ...]:
    """Merge two attention states: ``(out, out_lse) = merge((o_a, lse_a), (o_b, lse_b))``, as an XLA call.

    The semantics and options of :func:`attnmerge.merge`, on JAX arrays, under ``jax.jit``,
    ``jax.vmap`` and ``jax.grad``; the options other than the arrays are static.

    Parameters
    ----------
    o_a, o_b : jax.Array
        [tokens, heads, head_size], float32, float16 or bfloat16 (one dtype); with a_tokens, o_a
        needs only a_tokens tokens.
    lse_a, lse_b : jax.Array or tuple of 2 jax.Array
        float32 [tokens, heads], or softmax statistics, a ``(max, sum)`` tuple of such arrays
        (the LSE is ``max + log(sum)``, ``sum = 0`` an empty part); both differentiable.
    base, out_base, a_tokens, group_size, scale_ue8m0, block_format, scale_layout, scale_rounding, batch_invariant
        As for :func:`attnmerge.merge` (NVFP4's out uint8 [tokens, heads, head_size // 2]).
    valid : jax.Array, optional
        [tokens, 2], uint8, bool, int32 or int64: 0 where a state (a's, b's) holds no key, as for
        :func:`attnmerge.merge`.
    num_tokens : jax.Array, optional
        The live tokens (rows of the variable-length merge): a one-element int32 or int64 array,
        read on the device, as for :func:`attnmerge.merge`; out and out_lse are new arrays, so
        their rows past the count are unspecified.  No gradient with one.
    out_dtype : dtype, optional
        The dtype of out (default o_b's): float32, float16, bfloat16 or float8_e4m3fn.
    output_scale : float or jax.Array, optional
        A static number, or a float32 array of one element (read on the device).
    sink : jax.Array, optional
        float32 [heads], in lse_a's base; differentiable.

    Returns
    -------
    out, out_lse[, group_scales] : jax.Array
        out [tokens, heads, head_size], out_lse float32 [tokens, heads] in base out_base, and with
        group_size the group scales [tokens, heads, head_size // group_size] (with block_format
        its scales, in scale_layout).

    Raises
    ------
    ValueError
        A shape at odds with the others, when traced; a value libattnmerge refuses, when run.
    TypeError
        A traced static option.
    NotImplementedError
        A gradient through an FP8, scaled or per-group output.

    Examples
    --------
    >>> import jax, jax.numpy as jnp, attnmerge.jax
    >>> k = jax.random.split(jax.random.PRNGKey(0), 4)
    >>> o_a, o_b = (jax.random.normal(x, (4, 3, 64)) for x in k[:2])
    >>> lse_a, lse_b = (jax.random.normal(x, (4, 3)) for x in k[2:])
    >>> out, out_lse = jax.jit(attnmerge.jax.merge)(o_a, lse_a, o_b, lse_b)
    >>> bool(jnp.allclose(out_lse, jnp.logaddexp(lse_a, lse_b)))
    True
    """
    inputs, sum_a, sum_b, _ = softmax_stats(_MERGE, (o_a, lse_a, o_b, lse_b))
    opt = _options(_MERGE, output_scale=output_scale, sink=sink, sum_a=sum_a, sum_b=sum_b, valid=valid,
                   num_tokens=num_tokens, base=base,
                   out_base=out_base, out_dtype=out_dtype, a_tokens=a_tokens, group_size=group_size,
                   scale_ue8m0=scale_ue8m0, block_format=block_format, scale_layout=scale_layout,
                   scale_rounding=scale_rounding, batch_invariant=batch_invariant)
    return run(_MERGE, inputs, opt)


def merge_states(o: jax.Array, lse: Any, *, base: Base = "e", out_base: Base | None = None, out_dtype: Any = None,
                 output_scale: float | jax.Array | None = None, states_axis: int = 1,
                 sink: jax.Array | None = None, group_size: int | None = None,
                 scale_ue8m0: bool = False, block_format: str | None = None, scale_layout: str = "row_major",
                 scale_rounding: str = "floor", valid: jax.Array | None = None, num_tokens: jax.Array | None = None,
                 batch_invariant: bool = False) -> tuple[jax.Array, ...]:
    """Merge S stacked states in one pass, as an XLA call.

    The semantics and options of :func:`attnmerge.merge_states` on JAX arrays (static options).

    Parameters
    ----------
    o : jax.Array
        float32, float16 or bfloat16, with S at `states_axis`: [tokens, S, heads, head_size] (1),
        [S, tokens, heads, head_size] (0: an all-gather's) or [tokens, heads, S, head_size] (2).
    lse : jax.Array or tuple of 2 jax.Array
        float32, laid out as o without head_size, or a ``(max, sum)`` tuple of such arrays.
    states_axis : int, default 1
        The axis of S: 0, 1 or 2 (or -4 to -2).
    base, out_base, out_dtype, output_scale, sink, group_size, scale_ue8m0, block_format, scale_layout,
    scale_rounding, batch_invariant
        As for :func:`merge`.
    valid : jax.Array, optional
        [tokens, S] whatever `states_axis`: 0 where a state holds no key.
    num_tokens : jax.Array, optional
        The live tokens (rows of the variable-length merge): a one-element int32 or int64 array,
        read on the device, as for :func:`attnmerge.merge`; out and out_lse are new arrays, so
        their rows past the count are unspecified.  No gradient with one.

    Returns
    -------
    out, out_lse[, group_scales] : jax.Array
        As for :func:`merge`; S = 0 gives out = 0 and out_lse = -inf (the sink, with one).

    Raises
    ------
    ValueError, TypeError, NotImplementedError
        As for :func:`merge`.

    Examples
    --------
    >>> import jax, jax.numpy as jnp, attnmerge.jax
    >>> o = jax.random.normal(jax.random.PRNGKey(0), (4, 5, 3, 64))
    >>> lse = jax.random.normal(jax.random.PRNGKey(1), (4, 5, 3))
    >>> out, out_lse = attnmerge.jax.merge_states(o, lse)
    >>> bool(jnp.allclose(out_lse, jax.nn.logsumexp(lse, axis=1), atol=1e-6))
    True
    """
    axis = _static("states_axis", states_axis)
    inputs, sum_a, _, _ = softmax_stats(_STATES, (o, lse))
    opt = _options(_STATES, output_scale=output_scale, sink=sink, sum_a=sum_a, valid=valid,
                   num_tokens=num_tokens, base=base,
                   out_base=out_base, out_dtype=out_dtype, states_axis=states_axis_of(axis, 4), group_size=group_size,
                   scale_ue8m0=scale_ue8m0, block_format=block_format, scale_layout=scale_layout,
                   scale_rounding=scale_rounding, batch_invariant=batch_invariant)
    return run(_STATES, inputs, opt)


def merge_varlen(o: jax.Array, lse: Any, indptr: jax.Array, *, base: Base = "e", out_base: Base | None = None,
                 out_dtype: Any = None, output_scale: float | jax.Array | None = None, sink: jax.Array | None = None,
                 group_size: int | None = None, scale_ue8m0: bool = False, block_format: str | None = None,
                 scale_layout: str = "row_major", scale_rounding: str = "floor", valid: jax.Array | None = None,
                 num_tokens: jax.Array | None = None,
                 batch_invariant: bool = False) -> tuple[jax.Array, ...]:
    """Merge a variable number of states per row, as an XLA call: row r merges ``indptr[r] .. indptr[r+1]-1``.

    The semantics and options of :func:`attnmerge.merge_varlen` on JAX arrays (static options).

    Parameters
    ----------
    o : jax.Array
        [total, heads, head_size] float32, float16 or bfloat16.
    lse : jax.Array or tuple of 2 jax.Array
        float32 [total, heads], or a ``(max, sum)`` tuple of such arrays.
    indptr : jax.Array
        int32 or int64 [rows + 1].
    base, out_base, out_dtype, output_scale, sink, group_size, scale_ue8m0, block_format, scale_layout,
    scale_rounding, batch_invariant
        As for :func:`merge`.
    valid : jax.Array, optional
        [total]: 0 where a state of o holds no key.
    num_tokens : jax.Array, optional
        The live tokens (rows of the variable-length merge): a one-element int32 or int64 array,
        read on the device, as for :func:`attnmerge.merge`; out and out_lse are new arrays, so
        their rows past the count are unspecified.  No gradient with one.

    Returns
    -------
    out, out_lse[, group_scales] : jax.Array
        out [rows, heads, head_size], out_lse [rows, heads]; a row with no states gets out = 0 and
        out_lse = -inf (the sink, with one).

    Raises
    ------
    ValueError, TypeError, NotImplementedError
        As for :func:`merge`.

    Examples
    --------
    >>> import jax, jax.numpy as jnp, attnmerge.jax
    >>> o = jax.random.normal(jax.random.PRNGKey(0), (6, 3, 64))
    >>> lse = jax.random.normal(jax.random.PRNGKey(1), (6, 3))
    >>> out, out_lse = attnmerge.jax.merge_varlen(o, lse, jnp.array([0, 1, 6], jnp.int32))
    >>> bool(jnp.allclose(out_lse[1], jax.nn.logsumexp(lse[1:], axis=0), atol=1e-6))
    True
    """
    inputs, sum_a, _, _ = softmax_stats(_VARLEN, (o, lse, indptr))
    opt = _options(_VARLEN, output_scale=output_scale, sink=sink, sum_a=sum_a, valid=valid,
                   num_tokens=num_tokens, base=base,
                   out_base=out_base, out_dtype=out_dtype, group_size=group_size, scale_ue8m0=scale_ue8m0,
                   block_format=block_format, scale_layout=scale_layout, scale_rounding=scale_rounding,
                   batch_invariant=batch_invariant)
    return run(_VARLEN, inputs, opt)


def merge_share(o: jax.Array, lse: Any, index: int, *, base: Base = "e", out_base: Base | None = None,
                out_dtype: Any = None, output_scale: float | jax.Array | None = None, states_axis: int = 1,
                sink: jax.Array | None = None, group_size: int | None = None,
                scale_ue8m0: bool = False, block_format: str | None = None, scale_layout: str = "row_major",
                scale_rounding: str = "floor", valid: jax.Array | None = None, num_tokens: jax.Array | None = None,
                batch_invariant: bool = False) -> tuple[jax.Array, ...]:
    """State `index`'s share of the merge of S states, as an XLA call (context parallelism's combine).

    The semantics and options of :func:`attnmerge.merge_share` on JAX arrays (static options).

    Parameters
    ----------
    o : jax.Array
        State `index`'s O [tokens, heads, head_size], float32, float16 or bfloat16.
    lse : jax.Array or tuple of 2 jax.Array
        Every state's LSE, float32, S at `states_axis`: [tokens, S, heads] (1), [S, tokens, heads]
        (0) or [tokens, heads, S] (2); or a ``(max, sum)`` tuple of such arrays.
    index : int
        0 <= index < S, static.
    states_axis : int, default 1
        The axis of S in lse: 0, 1 or 2 (or -3 to -1).
    base, out_base, out_dtype, output_scale, sink, group_size, scale_ue8m0, block_format, scale_layout,
    scale_rounding, valid, batch_invariant
        As for :func:`merge_states` (each share quantized on its own).

    Returns
    -------
    out, out_lse[, group_scales] : jax.Array
        As for :func:`merge`.

    Raises
    ------
    ValueError, TypeError, NotImplementedError
        As for :func:`merge`; also an index out of range.

    Examples
    --------
    >>> import jax, jax.numpy as jnp, attnmerge.jax
    >>> o = jax.random.normal(jax.random.PRNGKey(0), (4, 5, 3, 64))
    >>> lse = jax.random.normal(jax.random.PRNGKey(1), (4, 5, 3))
    >>> total = sum(attnmerge.jax.merge_share(o[:, i], lse, i)[0] for i in range(5))
    >>> bool(jnp.allclose(total, attnmerge.jax.merge_states(o, lse)[0], atol=1e-5))
    True
    """
    axis = _static("states_axis", states_axis)
    inputs, sum_a, _, _ = softmax_stats(_SHARE, (o, lse))
    opt = _options(_SHARE, output_scale=output_scale, sink=sink, sum_a=sum_a, valid=valid,
                   num_tokens=num_tokens, base=base,
                   out_base=out_base, out_dtype=out_dtype, states_axis=states_axis_of(axis, 3),
                   index=index_of(_static("index", index)), group_size=group_size, scale_ue8m0=scale_ue8m0,
                   block_format=block_format, scale_layout=scale_layout, scale_rounding=scale_rounding,
                   batch_invariant=batch_invariant)
    return run(_SHARE, inputs, opt)


def run(op, inputs, opt: Options):
    """The call of `op` (attnmerge._call.OPS) on JAX arrays with its Options: attnmerge.jax's
    functions, and the native functions' road for calls whose results would be JAX arrays."""
    if opt.a_tokens_tensor is not None:
        raise ValueError("a_tokens: expected None or an int for JAX arrays (attnmerge.jax takes a_tokens as a "
                         "static int), got an array")
    return _RUNS[op.name](inputs, opt)


def _run_merge(inputs, opt):
    o_a, lse_a, o_b, lse_b = inputs
    _expect_ndim("o_b", o_b, 3, "tokens, heads, head_size")
    tokens, heads, head_size = _shape(o_b)
    a = tokens if opt.a_tokens < 0 else opt.a_tokens
    _expect("lse_b", lse_b, (tokens, heads), "tokens, heads of o_b")
    _expect_ndim("o_a", o_a, 3, "tokens, heads, head_size")
    if _shape(o_a)[0] < a or _shape(o_a)[1:] != [heads, head_size]:
        raise ValueError(f"o_a: expected shape [{a} or more, {heads}, {head_size}] (tokens, heads, head_size of o_b), "
                         f"got {_shape(o_a)}")
    _expect("lse_a", lse_a, _shape(o_a)[:2], "tokens, heads of o_a")
    _expect_sink(opt.sink, heads)
    _expect_extras(opt, (("lse_a", lse_a), ("lse_b", lse_b)), (tokens, 2))
    dtype = _out_dtype(opt, o_b)
    key = _key(opt)
    return _merged("merge", (tokens, heads, head_size), dtype, inputs, opt,
                   lambda has: _merge_fn(key, dtype, has))


_AXES = {0: "S, tokens, heads", 1: "tokens, S, heads", 2: "tokens, heads, S"}


def _run_states(inputs, opt):
    o, lse = inputs
    axis = opt.states_axis
    _expect_ndim("o", o, 4, _AXES[axis] + ", head_size")
    _expect("lse", lse, _shape(o)[:3], "the first three of o")
    _expect_extras(opt, (("lse", lse),), None)
    if axis != 1:  # XLA lays the states' axis out where the handler reads it
        o, lse, opt = jnp.moveaxis(o, axis, 1), jnp.moveaxis(lse, axis, 1), opt._replace(states_axis=1)
        if opt.sum_a is not None:
            opt = opt._replace(sum_a=jnp.moveaxis(opt.sum_a, axis, 1))
    tokens, states, heads, head_size = _shape(o)
    _expect_sink(opt.sink, heads)
    _expect_extras(opt._replace(sum_a=None), (), (tokens, states))
    dtype = _out_dtype(opt, o)
    key = _key(opt)
    return _merged("merge_states", (tokens, heads, head_size), dtype, (o, lse), opt,
                   lambda has: _merge_states_fn(key, dtype, has))


def _run_varlen(inputs, opt):
    o, lse, indptr = inputs
    _expect_ndim("o", o, 3, "total, heads, head_size")
    _expect("lse", lse, _shape(o)[:2], "total, heads of o")
    _expect_ndim("indptr", indptr, 1, "rows + 1")
    rows = _shape(indptr)[0] - 1
    if rows < 0:
        raise ValueError("indptr: expected rows + 1 >= 1 elements, got 0")
    total, heads, head_size = _shape(o)
    _expect_sink(opt.sink, heads)
    _expect_extras(opt, (("lse", lse),), (total,))
    dtype = _out_dtype(opt, o)
    key = _key(opt)
    return _merged("merge_varlen", (rows, heads, head_size), dtype, inputs, opt,
                   lambda has: _merge_varlen_fn(key, dtype, has), vectorized=False)


def _run_share(inputs, opt):
    o, lse = inputs
    axis = opt.states_axis
    _expect_ndim("o", o, 3, "tokens, heads, head_size")
    tokens, heads, head_size = _shape(o)
    _expect_ndim("lse", lse, 3, _AXES[axis])
    states = _shape(lse)[axis]
    want = [tokens, heads]
    want.insert(axis, states)
    _expect("lse", lse, want, "tokens and heads of o, S at states_axis")
    _expect_extras(opt, (("lse", lse),), (tokens, states))
    if axis != 1:  # XLA lays the states' axis out where the handler reads it
        lse, opt = jnp.moveaxis(lse, axis, 1), opt._replace(states_axis=1)
        if opt.sum_a is not None:
            opt = opt._replace(sum_a=jnp.moveaxis(opt.sum_a, axis, 1))
    if not 0 <= opt.index < states:
        raise ValueError(f"index: expected 0 <= index < {states} (the states of lse), got {opt.index}")
    _expect_sink(opt.sink, heads)
    dtype = _out_dtype(opt, o)
    key = _key(opt)
    return _merged("merge_share", (tokens, heads, head_size), dtype, (o, lse), opt,
                   lambda has: _merge_share_fn(key, dtype, has))


_RUNS = {"merge": _run_merge, "merge_states": _run_states, "merge_varlen": _run_varlen, "merge_share": _run_share}


# ---- gradients ------------------------------------------------------------------------------------

def _in_inputs_base(bases, out_lse, grad_out_lse):
    """out_lse and its cotangent in the inputs' base (a's) where the merged LSE's differs: the
    backward calls take one base, and a gradient through lse' = c lse is c dlse'."""
    c = base_change(bases[0], bases[2])
    return (out_lse, grad_out_lse) if c == 1.0 else (out_lse / c, grad_out_lse * c)


def _merged(op, shape, dtype, operands, opt: Options, differentiable, vectorized=True):
    """The merge `op` of `operands` (and the sink, softmax sums and valid where given: arguments
    after them, _given's) into (out of `shape` [rows, heads, head_size] and `dtype`, out_lse, and
    the group scales where the call has a group size): differentiable(has) (a custom_vjp over the
    backward) unless the output is FP8, scaled or in groups; such a call runs under a custom_vjp
    whose backward refuses by name (JAX would otherwise name only its ffi_call), with an array
    output_scale among its arguments."""
    has, extras = _given(opt)
    if opt.scale is None and not opt.output_scale and not opt.group_size and dtype.name not in NO_GRADIENT_DTYPES \
            and opt.num_tokens is None:
        return differentiable(has)(*operands, *extras)
    outs = _results(*shape, dtype)
    if opt.flags & _C.BLOCK_NVFP4:  # two values per byte
        outs = (jax.ShapeDtypeStruct(shape[:2] + (shape[2] // 2,), jnp.uint8), _results(*shape, jnp.float32)[1])
    n, k = len(operands), len(operands) + len(extras)
    key = _key(opt)
    scale_array = opt.scale is not None

    def call(*x):
        return _ffi(op, outs, x[:n], key, _unpack(has, x[n:k]), scale=x[k] if scale_array else None,
                    vectorized=vectorized)

    f = jax.custom_vjp(call)

    def refuse(*_):
        raise NotImplementedError(f"attnmerge.jax.{op}: no gradient through an FP8 output, an output_scale, "
                                  f"group scales, a block-scaled format or num_tokens (the rows past the count "
                                  f"hold no result)")

    f.defvjp(lambda *x: (call(*x), None), refuse)
    return f(*operands, *extras, *((opt.scale,) if scale_array else ()))


def _backward(op, grads, operands, *, base, a_tokens=-1, vectorized=True):
    """The FFI call of `op`'s backward: `grads` the gradients' shapes and dtypes; one base."""
    method = "broadcast_all" if vectorized and a_tokens < 0 else "sequential"
    call = jax.ffi.ffi_call(f"attnmerge_{op}_backward", grads, vmap_method=method)
    return call(*operands, **_attributes(Options(flags=base_flags((base, base, base)), a_tokens=a_tokens)))


def _like(x):
    return jax.ShapeDtypeStruct(jnp.shape(x), x.dtype)


def _with_vjp(forward, backward):
    """forward(*inputs) -> (out, out_lse) with backward(inputs, out, out_lse, grad_out, grad_out_lse)
    -> the inputs' gradients, the inputs and results saved."""
    f = jax.custom_vjp(forward)

    def fwd(*inputs):
        out, out_lse = forward(*inputs)
        return (out, out_lse), (inputs, out, out_lse)

    def bwd(saved, cotangents):
        inputs, out, out_lse = saved
        grad_out, grad_out_lse = cotangents
        return backward(inputs, out, out_lse, grad_out.astype(out.dtype), grad_out_lse.astype(out_lse.dtype))

    f.defvjp(fwd, bwd)
    return f


def _sink_gradient(sink, out, out_lse, grad_out, grad_out_lse, base):
    f32 = out_lse.dtype  # float32, or float64 for a float64 call
    return sink_gradient(jnp, sink.astype(f32), out.astype(f32), out_lse, grad_out.astype(f32), grad_out_lse,
                         base).astype(sink.dtype)


def _extras_gradients(ex, grad_lses, bases, out, out_lse, grad_out, grad_out_lse):
    """The gradients of a forward's given extras (_unpack's `ex`), in _EXTRAS' order: the sink's,
    each softmax sum's from its LSE's gradient (`grad_lses`, in `bases`: the first LSE argument's,
    the second's), none for valid (integers)."""
    grads = []
    if ex["sink"] is not None:  # out and out_lse count the sink, in the inputs' base
        grads.append(_sink_gradient(ex["sink"], out, out_lse, grad_out, grad_out_lse, bases[0]))
    for name, grad_lse, base in zip(("sum_a", "sum_b"), grad_lses, bases):
        if ex[name] is not None:
            grads.append(stats_gradient(jnp, grad_lse, ex[name], base))
    if ex["valid"] is not None:
        grads.append(None)
    return tuple(grads)


def _valid_states(valid, states_axis):
    """valid [tokens, S] as a bool mask over lse [tokens, S, heads] with S at `states_axis`."""
    return None if valid is None else jnp.moveaxis((valid != 0)[:, :, None], 1, states_axis)


def _valid_column(valid, column, rows):
    """A two-way merge's valid [tokens, 2] as a bool mask over one state's lse of `rows` rows
    (rows past valid's tokens, never read, kept)."""
    if valid is None:
        return None
    v = (valid[:, column] != 0)[:, None]
    if rows <= v.shape[0]:
        return v[:rows]
    return jnp.concatenate([v, jnp.ones((rows - v.shape[0], 1), bool)])


@functools.lru_cache(maxsize=None)
def _merge_fn(key: Options, dtype, has):
    base, base_b, _ = key.bases
    c_b = base_change(base_b, base)  # lse_b into a's base, as the forward merges it
    a_tokens = key.a_tokens

    def forward(o_a, lse_a, o_b, lse_b, *extras):
        tokens, heads, head_size = _shape(o_b)
        return _ffi("merge", _results(tokens, heads, head_size, dtype), (o_a, lse_a, o_b, lse_b), key,
                    _unpack(has, extras))

    def backward(inputs, out, out_lse, grad_out, grad_out_lse):
        o_a, lse_a, o_b, lse_b, *extras = inputs
        ex = _unpack(has, extras)
        out_lse, grad_out_lse = _in_inputs_base(key.bases, out_lse, grad_out_lse)
        # The LSEs as the forward read them (softmax statistics, valid states), each in its own base.
        lse_a = stats_lse(jnp, lse_a, ex["sum_a"], _valid_column(ex["valid"], 0, _shape(lse_a)[0]), base)
        lse_b = stats_lse(jnp, lse_b, ex["sum_b"], _valid_column(ex["valid"], 1, _shape(lse_b)[0]), base_b)
        if c_b != 1.0:
            lse_b = lse_b * c_b
        k = _shape(o_a)[0] if a_tokens < 0 else a_tokens  # a's later tokens are never read
        heads, head_size = _shape(o_b)[1:]
        grads = (jax.ShapeDtypeStruct((k, heads, head_size), o_a.dtype), jax.ShapeDtypeStruct((k, heads), lse_a.dtype),
                 _like(o_b), _like(lse_b))
        g_oa, g_la, g_ob, g_lb = _backward("merge", grads,
                                           (grad_out, grad_out_lse, out, out_lse, o_a, lse_a, o_b, lse_b), base=base,
                                           a_tokens=a_tokens)
        if c_b != 1.0:
            g_lb = g_lb * c_b
        pad = _shape(o_a)[0] - k
        if pad:
            g_oa = jnp.concatenate([g_oa, jnp.zeros((pad, heads, head_size), g_oa.dtype)])
            g_la = jnp.concatenate([g_la, jnp.zeros((pad, heads), g_la.dtype)])
        return (g_oa, g_la, g_ob, g_lb,
                *_extras_gradients(ex, (g_la, g_lb), (base, base_b), out, out_lse, grad_out, grad_out_lse))

    return _with_vjp(forward, backward)


@functools.lru_cache(maxsize=None)
def _merge_states_fn(key: Options, dtype, has):
    base = key.bases[0]

    def forward(o, lse, *extras):
        tokens, _, heads, head_size = _shape(o)
        return _ffi("merge_states", _results(tokens, heads, head_size, dtype), (o, lse), key, _unpack(has, extras))

    def backward(inputs, out, out_lse, grad_out, grad_out_lse):
        o, lse, *extras = inputs
        ex = _unpack(has, extras)
        out_lse, grad_out_lse = _in_inputs_base(key.bases, out_lse, grad_out_lse)
        lse = stats_lse(jnp, lse, ex["sum_a"], _valid_states(ex["valid"], 1), base)  # as the forward read it
        g_o, g_l = _backward("merge_states", (_like(o), _like(lse)), (grad_out, grad_out_lse, out, out_lse, o, lse),
                             base=base)
        # The states' gradients follow from out and out_lse, which count the sink.
        return (g_o, g_l, *_extras_gradients(ex, (g_l, None), (base, base), out, out_lse, grad_out, grad_out_lse))

    return _with_vjp(forward, backward)


@functools.lru_cache(maxsize=None)
def _merge_varlen_fn(key: Options, dtype, has):
    base = key.bases[0]

    def forward(o, lse, indptr, *extras):
        _, heads, head_size = _shape(o)
        return _ffi("merge_varlen", _results(_shape(indptr)[0] - 1, heads, head_size, dtype), (o, lse, indptr), key,
                    _unpack(has, extras), vectorized=False)

    def backward(inputs, out, out_lse, grad_out, grad_out_lse):
        o, lse, indptr, *extras = inputs
        ex = _unpack(has, extras)
        out_lse, grad_out_lse = _in_inputs_base(key.bases, out_lse, grad_out_lse)
        valid = None if ex["valid"] is None else (ex["valid"] != 0)[:, None]
        lse = stats_lse(jnp, lse, ex["sum_a"], valid, base)
        g_o, g_l = _backward("merge_varlen", (_like(o), _like(lse)),
                             (grad_out, grad_out_lse, out, out_lse, o, lse, indptr), base=base, vectorized=False)
        return (g_o, g_l, None,  # indptr: integers, no gradient
                *_extras_gradients(ex, (g_l, None), (base, base), out, out_lse, grad_out, grad_out_lse))

    return _with_vjp(forward, backward)


@functools.lru_cache(maxsize=None)
def _merge_share_fn(key: Options, dtype, has):
    base, index = key.bases[0], key.index

    def forward(o, lse, *extras):
        return _ffi("merge_share", _results(*_shape(o), dtype), (o, lse), key, _unpack(has, extras))

    def backward(inputs, out, out_lse, grad_out, grad_out_lse):
        o, lse, *extras = inputs
        ex = _unpack(has, extras)
        out_lse, grad_out_lse = _in_inputs_base(key.bases, out_lse, grad_out_lse)
        lse = stats_lse(jnp, lse, ex["sum_a"], _valid_states(ex["valid"], 1), base)  # as the forward read it
        f32 = lse.dtype  # float32, or float64 for a float64 call
        g_o, g_l = share_gradient(jnp, o.astype(f32), lse, index, out_lse, grad_out.astype(f32), grad_out_lse, base, 1)
        return (g_o.astype(o.dtype), g_l,
                *_extras_gradients(ex, (g_l, None), (base, base), out, out_lse, grad_out, grad_out_lse))

    return _with_vjp(forward, backward)
