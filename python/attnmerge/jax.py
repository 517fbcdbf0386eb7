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

Options (``base``, ``out_base``, ``out_dtype``, ``a_tokens``, ``states_axis``, merge_share's ``index``, a float
``output_scale``, ``group_size``, ``scale_ue8m0``) are static:
Python values, fixed when the function is traced, so a jitted function passes them itself (as
above, or with ``functools.partial``), and needs no ``static_argnames``.  A traced option is refused
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

from . import _XLA_HOW, _XLA_LIB
from ._merge import (
    base_change,
    groups_arg,
    index_arg,
    lse_bases,
    lse_flags,
    output_scale_arg,
    share_gradient,
    sink_gradient,
)
from ._types import NO_GRADIENT_DTYPES, Base, PairBase

__all__ = ["merge", "merge_states", "merge_varlen", "merge_share"]

_OPS = ("merge", "merge_states", "merge_varlen", "merge_share", "merge_backward", "merge_states_backward",
        "merge_varlen_backward")


def _register():
    if not os.path.exists(_XLA_LIB):
        raise ImportError(f"attnmerge.jax: this attnmerge was built without the JAX extension ({_XLA_LIB} "
                          f"is missing); to get it, {_XLA_HOW}")
    lib = ctypes.CDLL(_XLA_LIB)
    for op in _OPS:
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


def _shape(x):
    return list(jnp.shape(x))


def _expect(name, x, shape, what):
    if _shape(x) != list(shape):
        raise ValueError(f"{name}: expected shape {list(shape)} ({what}), got {_shape(x)}")


def _expect_ndim(name, x, ndim, what):
    if jnp.ndim(x) != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions ({what}), got {jnp.ndim(x)} (shape {_shape(x)})")


def _scale_is_array(output_scale):
    """An output_scale given as an array (an operand, read on the device) rather than a number."""
    return output_scale is not None and not isinstance(output_scale, (int, float, np.number))


def _call(op, outs, operands, *, bases, output_scale, a_tokens=None, vectorized=True, sink=None, index=None,
          groups=(0, 0)):
    """The FFI call of `op` with the options as attributes (`bases`: _bases' key); the sink (an
    array, or None: an operand that has_sink says is not read) and output_scale (a number or, for an
    array, an operand) after the operands; merge_share's index an attribute of its own.
    `outs`: (out, out_lse)'s shapes; `groups`: (group_size, its flags), where group_size > 0 adds
    the group scales [rows, heads, head_size // group_size] to the results (every call has that
    result: one of no elements, unwritten, without groups)."""
    group, group_flags = groups
    flags = lse_flags(bases[:2], bases[2], pair=True) | group_flags
    scale_in_buffer = _scale_is_array(output_scale)
    if scale_in_buffer:
        scale = jnp.reshape(jnp.asarray(output_scale, dtype=jnp.float32), (1,))
        number = 0.0
    else:
        scale = jnp.ones((1,), jnp.float32)  # unread
        number = 0.0 if output_scale is None else float(output_scale_arg(output_scale))  # 0.0: the C ABI's none
    a = -1 if a_tokens is None else int(_static("a_tokens", a_tokens))
    # One call over a flattened batch: every operand is broadcast to the batch (the handler folds
    # leading dimensions into tokens), which per-example a_tokens, indptr, scale or sink would break.
    method = "broadcast_all" if vectorized and a < 0 and not scale_in_buffer and sink is None else "sequential"
    rows, heads, head_size = outs[0].shape
    scales = jax.ShapeDtypeStruct((rows, heads, head_size // group) if group else (0,), jnp.float32)
    call = jax.ffi.ffi_call(f"attnmerge_{op}", (*outs, scales), vmap_method=method)
    unread = jnp.full((1,), -jnp.inf, jnp.float32)
    indexed = {} if index is None else {"index": np.int64(index)}
    results = call(*operands, unread if sink is None else sink, scale, flags=np.int64(flags), a_tokens=np.int64(a),
                   output_scale=np.float32(number), scale_in_buffer=scale_in_buffer, group_size=np.int64(group),
                   has_sink=sink is not None, **indexed)
    return tuple(results) if group else tuple(results[:2])


def _out_dtype(out_dtype, like):
    return like.dtype if _static("out_dtype", out_dtype) is None else jnp.dtype(out_dtype)


def _groups(group_size, scale_ue8m0, out_dtype):
    """(out_dtype, (group_size, flags)): a call's per-group FP8 options, static; out_dtype defaults
    to float8_e4m3fn with a group_size, which is 0 without one."""
    out_dtype, group, flags = groups_arg(_static("group_size", group_size), _static("scale_ue8m0", scale_ue8m0),
                                         None, out_dtype)
    return out_dtype, (group, flags)


def _results(tokens, heads, head_size, dtype):
    return (jax.ShapeDtypeStruct((tokens, heads, head_size), dtype), jax.ShapeDtypeStruct((tokens, heads), jnp.float32))


def merge(o_a: jax.Array, lse_a: jax.Array, o_b: jax.Array, lse_b: jax.Array, *, base: PairBase = "e",
          out_base: Base | None = None, out_dtype: Any = None, a_tokens: int | None = None,
          output_scale: float | jax.Array | None = None, sink: jax.Array | None = None,
          group_size: int | None = None, scale_ue8m0: bool = False) -> tuple[jax.Array, ...]:
    """Merge two attention states: (out, out_lse) = merge((o_a, lse_a), (o_b, lse_b)).

    o_a, o_b: [tokens, heads, head_size] float32, float16 or bfloat16 (one dtype).
    lse_a, lse_b: float32 [tokens, heads], natural log (base="e") or base 2 (base=2), or each its
        own (base=(a's, b's)); out_base: the merged LSE's base (None: lse_a's).
    out_dtype: the dtype of out (default that of o_b): float32, float16, bfloat16 or float8_e4m3fn.
    a_tokens: only the first a_tokens tokens merge a with b (o_a, lse_a then need only a_tokens
        tokens); the others take b alone (vLLM's prefill_tokens_with_context).
    output_scale: FP8 outputs store value / output_scale: a float or a float32 array of one element.
    sink: None, or float32 [heads], as in merge_states (in lse_a's base; differentiable).
    group_size, scale_ue8m0: per-group FP8 (static): each group of group_size consecutive elements
        of a row gets scale = max(amax, 1e-10) / 448 (rounded up to a power of two with
        scale_ue8m0) and out = value * (1 / scale) in float8_e4m3fn (out_dtype's default then);
        attnmerge.merge says more.  Not with output_scale.
    Returns (out [tokens, heads, head_size], out_lse float32 [tokens, heads], in base out_base),
    and with group_size the group scales, float32 [tokens, heads, head_size // group_size].
    """
    _expect_ndim("o_b", o_b, 3, "tokens, heads, head_size")
    tokens, heads, head_size = _shape(o_b)
    a = tokens if a_tokens is None else int(_static("a_tokens", a_tokens))
    _expect("lse_b", lse_b, (tokens, heads), "tokens, heads of o_b")
    _expect_ndim("o_a", o_a, 3, "tokens, heads, head_size")
    if _shape(o_a)[0] < a or _shape(o_a)[1:] != [heads, head_size]:
        raise ValueError(f"o_a: expected shape [{a} or more, {heads}, {head_size}] (tokens, heads, head_size of o_b), "
                         f"got {_shape(o_a)}")
    _expect("lse_a", lse_a, _shape(o_a)[:2], "tokens, heads of o_a")
    _expect_sink(sink, heads)
    out_dtype, groups = _groups(group_size, scale_ue8m0, out_dtype)
    dtype = _out_dtype(out_dtype, o_b)
    bases = _bases(base, out_base, pair=True)
    return _merged("merge", (tokens, heads, head_size), dtype, (o_a, lse_a, o_b, lse_b), bases, output_scale, groups,
                   lambda: _merge_fn(bases, dtype, a_tokens, sink is not None), sink=sink, a_tokens=a_tokens)


def merge_states(o: jax.Array, lse: jax.Array, *, base: Base = "e", out_base: Base | None = None, out_dtype: Any = None,
                 output_scale: float | jax.Array | None = None, states_axis: int = 1,
                 sink: jax.Array | None = None, group_size: int | None = None,
                 scale_ue8m0: bool = False) -> tuple[jax.Array, ...]:
    """Merge S states in one pass, each input read once.

    o: [tokens, S, heads, head_size] float32, float16 or bfloat16; lse: float32 [tokens, S, heads]
    (FlashInfer's layout); with states_axis=0, [S, tokens, heads, head_size] and [S, tokens, heads]
    (an all-gather's).  Base, out_base, out_dtype, output_scale, group_size and scale_ue8m0 as in
    merge.
    sink: None, or float32 [heads]: attention sinks, each head's sink logit in the LSE's base, one
    more state of output 0 in every row of its head (differentiable; attnmerge.merge_states says
    more).
    Returns (out [tokens, heads, head_size], out_lse float32 [tokens, heads]), and the group scales
    with group_size; S = 0 gives O = 0 and LSE = -inf (the sink, with one).
    """
    axis = _static("states_axis", states_axis)
    if axis not in (0, 1):
        raise ValueError(f"states_axis: expected 0 or 1, got {axis!r}")
    _expect_ndim("o", o, 4, "tokens, S, heads, head_size" if axis == 1 else "S, tokens, heads, head_size")
    _expect("lse", lse, _shape(o)[:3], "the first three of o")
    if axis == 0:  # XLA lays the transpose out for the call
        o, lse = jnp.swapaxes(o, 0, 1), jnp.swapaxes(lse, 0, 1)
    tokens, _, heads, head_size = _shape(o)
    _expect_sink(sink, heads)
    out_dtype, groups = _groups(group_size, scale_ue8m0, out_dtype)
    dtype = _out_dtype(out_dtype, o)
    bases = _bases(base, out_base)
    return _merged("merge_states", (tokens, heads, head_size), dtype, (o, lse), bases, output_scale, groups,
                   lambda: _merge_states_fn(bases, dtype, sink is not None), sink=sink)


def merge_varlen(o: jax.Array, lse: jax.Array, indptr: jax.Array, *, base: Base = "e", out_base: Base | None = None,
                 out_dtype: Any = None,
                 output_scale: float | jax.Array | None = None, sink: jax.Array | None = None,
                 group_size: int | None = None, scale_ue8m0: bool = False) -> tuple[jax.Array, ...]:
    """Row r merges states indptr[r] .. indptr[r + 1] - 1 of a flat list.

    o: [total, heads, head_size] float32, float16 or bfloat16; lse: float32 [total, heads];
    indptr: int32 or int64 [rows + 1].  A row with no states gets O = 0, LSE = -inf (the sink, with
    one); on the GPU bad bounds are clamped into [0, total] (attnmerge.merge_varlen says how).
    Base, out_base, out_dtype, output_scale, group_size and scale_ue8m0 as in merge, sink as in
    merge_states.
    Returns (out [rows, heads, head_size], out_lse float32 [rows, heads]), and the group scales
    [rows, heads, head_size // group_size] with group_size.
    """
    _expect_ndim("o", o, 3, "total, heads, head_size")
    _expect("lse", lse, _shape(o)[:2], "total, heads of o")
    _expect_ndim("indptr", indptr, 1, "rows + 1")
    rows = _shape(indptr)[0] - 1
    if rows < 0:
        raise ValueError("indptr: expected rows + 1 >= 1 elements, got 0")
    out_dtype, groups = _groups(group_size, scale_ue8m0, out_dtype)
    dtype = _out_dtype(out_dtype, o)
    _, heads, head_size = _shape(o)
    _expect_sink(sink, heads)
    bases = _bases(base, out_base)
    return _merged("merge_varlen", (rows, heads, head_size), dtype, (o, lse, indptr), bases, output_scale, groups,
                   lambda: _merge_varlen_fn(bases, dtype, sink is not None), sink=sink, vectorized=False)


def merge_share(o: jax.Array, lse: jax.Array, index: int, *, base: Base = "e", out_base: Base | None = None,
                out_dtype: Any = None,
                output_scale: float | jax.Array | None = None, states_axis: int = 1,
                sink: jax.Array | None = None, group_size: int | None = None,
                scale_ue8m0: bool = False) -> tuple[jax.Array, ...]:
    """The share of state `index` in the merge of S states: out = (w_index / W) * o and out_lse the
    merged LSE, so that the states' shares summed are merge_states of them (context parallelism's
    combine by reduce-scatter: attnmerge.merge_share says more).

    o: state `index`'s O [tokens, heads, head_size] float32, float16 or bfloat16; lse: every
    state's LSE, float32 [tokens, S, heads], or [S, tokens, heads] with states_axis=0 (an
    all-gather's); index: a Python int, 0 <= index < S (static).  Base, out_base, out_dtype,
    output_scale, sink, group_size and scale_ue8m0 as in merge_states (each share quantized on its
    own).
    Returns (out [tokens, heads, head_size], out_lse float32 [tokens, heads]), and the group scales
    with group_size.
    """
    axis = _static("states_axis", states_axis)
    if axis not in (0, 1):
        raise ValueError(f"states_axis: expected 0 or 1, got {axis!r}")
    index = index_arg(_static("index", index))
    _expect_ndim("o", o, 3, "tokens, heads, head_size")
    tokens, heads, head_size = _shape(o)
    _expect_ndim("lse", lse, 3, "tokens, S, heads" if axis == 1 else "S, tokens, heads")
    states = _shape(lse)[axis]
    _expect("lse", lse, (tokens, states, heads) if axis == 1 else (states, tokens, heads),
            "tokens and heads of o" if axis == 1 else "heads and tokens of o")
    if axis == 0:  # XLA lays the transpose out for the call
        lse = jnp.swapaxes(lse, 0, 1)
    if not 0 <= index < states:
        raise ValueError(f"index: expected 0 <= index < {states} (the states of lse), got {index}")
    _expect_sink(sink, heads)
    out_dtype, groups = _groups(group_size, scale_ue8m0, out_dtype)
    dtype = _out_dtype(out_dtype, o)
    bases = _bases(base, out_base)
    return _merged("merge_share", (tokens, heads, head_size), dtype, (o, lse), bases, output_scale, groups,
                   lambda: _merge_share_fn(bases, dtype, index, sink is not None), sink=sink, index=index)


def _expect_sink(sink, heads):
    if sink is not None:
        _expect("sink", sink, (heads,), "heads of o")


# ---- gradients ------------------------------------------------------------------------------------

def _bases(base, out_base, pair=False):
    """The bases of a call, (a's, b's, the merged LSE's), each "e" or 2: a cache key, checked (a
    ValueError naming `base` or `out_base`)."""
    return lse_bases(_static("base", base), _static("out_base", out_base), pair=pair)


def _in_inputs_base(bases, out_lse, grad_out_lse):
    """out_lse and its cotangent in the inputs' base (a's) where the merged LSE's differs: the
    backward calls take one base, and a gradient through lse' = c lse is c dlse'."""
    c = base_change(bases[0], bases[2])
    return (out_lse, grad_out_lse) if c == 1.0 else (out_lse / c, grad_out_lse * c)


def _merged(op, shape, dtype, operands, bases, output_scale, groups, differentiable, sink=None, **options):
    """The merge `op` of `operands` (and the sink, where one is given: an argument after them)
    into (out of `shape` [rows, heads, head_size] and `dtype`, out_lse, and the group scales where
    `groups` (_groups') has a group size): differentiable() (a custom_vjp over the backward) unless
    the output is FP8, scaled or in groups; such a call runs under a custom_vjp whose backward
    refuses by name (JAX would otherwise name only its ffi_call), with an array output_scale among
    its arguments."""
    sinks = () if sink is None else (sink,)
    if output_scale is None and not groups[0] and dtype.name not in NO_GRADIENT_DTYPES:
        return differentiable()(*operands, *sinks)
    outs = _results(*shape, dtype)
    n, k = len(operands), len(operands) + len(sinks)
    scale_array = _scale_is_array(output_scale)

    def call(*x):
        return _call(op, outs, x[:n], bases=bases, output_scale=x[k] if scale_array else output_scale,
                     sink=x[n] if sinks else None, groups=groups, **options)

    f = jax.custom_vjp(call)

    def refuse(*_):
        raise NotImplementedError(f"attnmerge.jax.{op}: no gradient through an FP8 output, an output_scale or "
                                  f"group scales")

    f.defvjp(lambda *x: (call(*x), None), refuse)
    return f(*operands, *sinks, *((output_scale,) if scale_array else ()))


def _backward(op, grads, operands, *, base, a_tokens=None, vectorized=True):
    """The FFI call of `op`'s backward: `grads` the gradients' shapes and dtypes."""
    a = -1 if a_tokens is None else int(a_tokens)
    method = "broadcast_all" if vectorized and a < 0 else "sequential"
    call = jax.ffi.ffi_call(f"attnmerge_{op}_backward", grads, vmap_method=method)
    return call(*operands, base2=lse_flags(base) != 0, a_tokens=np.int64(a))


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
        return backward(inputs, out, out_lse, grad_out.astype(out.dtype), grad_out_lse.astype(jnp.float32))

    f.defvjp(fwd, bwd)
    return f


@functools.lru_cache(maxsize=None)
def _merge_fn(bases, dtype, a_tokens, has_sink):
    base, base_b, _ = bases
    c_b = base_change(base_b, base)  # lse_b into a's base, as the forward merges it

    def forward(o_a, lse_a, o_b, lse_b, *sink):
        tokens, heads, head_size = _shape(o_b)
        return _call("merge", _results(tokens, heads, head_size, dtype), (o_a, lse_a, o_b, lse_b), bases=bases,
                     output_scale=None, a_tokens=a_tokens, sink=sink[0] if has_sink else None)

    def backward(inputs, out, out_lse, grad_out, grad_out_lse):
        o_a, lse_a, o_b, lse_b, *sink = inputs
        out_lse, grad_out_lse = _in_inputs_base(bases, out_lse, grad_out_lse)
        if c_b != 1.0:
            lse_b = lse_b * c_b
        k = _shape(o_a)[0] if a_tokens is None else int(a_tokens)  # a's later tokens are never read
        heads, head_size = _shape(o_b)[1:]
        grads = (jax.ShapeDtypeStruct((k, heads, head_size), o_a.dtype), jax.ShapeDtypeStruct((k, heads), jnp.float32),
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
        # The states' gradients follow from out and out_lse, which count the sink (in a's base).
        return (g_oa, g_la, g_ob, g_lb, *(_sink_gradient(s, out, out_lse, grad_out, grad_out_lse, base) for s in sink))

    return _with_vjp(forward, backward)


def _sink_gradient(sink, out, out_lse, grad_out, grad_out_lse, base):
    f32 = jnp.float32
    return sink_gradient(jnp, sink.astype(f32), out.astype(f32), out_lse, grad_out.astype(f32), grad_out_lse,
                         base).astype(sink.dtype)


@functools.lru_cache(maxsize=None)
def _merge_states_fn(bases, dtype, has_sink):
    base = bases[0]

    def forward(o, lse, *sink):
        tokens, _, heads, head_size = _shape(o)
        return _call("merge_states", _results(tokens, heads, head_size, dtype), (o, lse), bases=bases,
                     output_scale=None, sink=sink[0] if has_sink else None)

    def backward(inputs, out, out_lse, grad_out, grad_out_lse):
        o, lse, *sink = inputs
        out_lse, grad_out_lse = _in_inputs_base(bases, out_lse, grad_out_lse)
        grads = _backward("merge_states", (_like(o), _like(lse)), (grad_out, grad_out_lse, out, out_lse, o, lse),
                          base=base)
        # The states' gradients follow from out and out_lse, which count the sink.
        return (*grads, *(_sink_gradient(s, out, out_lse, grad_out, grad_out_lse, base) for s in sink))

    return _with_vjp(forward, backward)


@functools.lru_cache(maxsize=None)
def _merge_varlen_fn(bases, dtype, has_sink):
    base = bases[0]

    def forward(o, lse, indptr, *sink):
        _, heads, head_size = _shape(o)
        return _call("merge_varlen", _results(_shape(indptr)[0] - 1, heads, head_size, dtype), (o, lse, indptr),
                     bases=bases, output_scale=None, vectorized=False, sink=sink[0] if has_sink else None)

    def backward(inputs, out, out_lse, grad_out, grad_out_lse):
        o, lse, indptr, *sink = inputs
        out_lse, grad_out_lse = _in_inputs_base(bases, out_lse, grad_out_lse)
        g_o, g_l = _backward("merge_varlen", (_like(o), _like(lse)),
                             (grad_out, grad_out_lse, out, out_lse, o, lse, indptr), base=base, vectorized=False)
        return (g_o, g_l, None,  # indptr: integers, no gradient
                *(_sink_gradient(s, out, out_lse, grad_out, grad_out_lse, base) for s in sink))

    return _with_vjp(forward, backward)


@functools.lru_cache(maxsize=None)
def _merge_share_fn(bases, dtype, index, has_sink):
    base = bases[0]

    def forward(o, lse, *sink):
        return _call("merge_share", _results(*_shape(o), dtype), (o, lse), bases=bases, output_scale=None,
                     sink=sink[0] if has_sink else None, index=index)

    def backward(inputs, out, out_lse, grad_out, grad_out_lse):
        o, lse, *sink = inputs
        out_lse, grad_out_lse = _in_inputs_base(bases, out_lse, grad_out_lse)
        f32 = jnp.float32
        g_o, g_l = share_gradient(jnp, o.astype(f32), lse, index, out_lse, grad_out.astype(f32), grad_out_lse, base, 1)
        return (g_o.astype(o.dtype), g_l,
                *(_sink_gradient(s, out, out_lse, grad_out, grad_out_lse, base) for s in sink))

    return _with_vjp(forward, backward)
