"""The native road of a call: missing results allocated in the caller's array library (like the
op's `like` input, or like `out`), then the binding, which reads the arrays and the options record
and calls libattnmerge.  The torch ops' kernels end here too; JAX arrays never reach it."""
from __future__ import annotations

from . import _C
from ._arrays import dtype_name, empty
from ._call import Op, Options, lse_dtype, named, result_dtype, result_shape, scales_of, shape_of
from ._types import O_IN_DTYPES

_LIKE_NAMES = {"merge": ("o_b", "o_a"), "merge_states": ("o", "o"), "merge_varlen": ("o", "o"),
               "merge_share": ("o", "o")}  # (the input results are allocated like, the one whose dtype they take)


def results(out, out_lse, opt: Options):
    """A merge's results: (out, out_lse), and the group scales where group_size was given."""
    return (out, out_lse) if not opt.group_size else (out, out_lse, opt.group_scales)


def allocate(op: Op, inputs, out, out_lse, opt: Options):
    """(out, out_lse, opt): given outputs as they are, missing ones allocated like the op's `like`
    input (or like out, where it is given), and the group scales in opt where group_size asks for
    them (scales_of) like out.  NVFP4's out is uint8 [rows, heads, head_size // 2]."""
    names = opt.names
    like_name, src_name = _LIKE_NAMES[op.name]
    if out is not None and opt.out_dtype is not None:
        out_name, dtype_arg = named(names, "out"), named(names, "out_dtype")
        got = dtype_name(getattr(out, "dtype", None), out_name)
        if opt.out_dtype != got:
            raise ValueError(f"{dtype_arg}: expected None or the dtype of {out_name} ({got}), got {opt.out_dtype}")
    like = inputs[op.like] if out is None else out  # a missing out_lse goes where out is
    like_name = like_name if out is None else "out"
    nvfp4 = opt.flags & _C.BLOCK_NVFP4
    if out is None or (out_lse is None and opt.return_lse):
        shape = result_shape(op, inputs, opt)
        _fits(shape, named(names, like_name if out is None else "out"))
        dtype = "float32" if nvfp4 else result_dtype(opt, inputs[0], src_name)
        if out is None:
            out = empty(like, shape[:2] + (shape[2] // 2,), "uint8", named(names, like_name)) if nvfp4 else \
                empty(like, shape, dtype, named(names, like_name))
        if out_lse is None and opt.return_lse:
            out_lse = empty(like, shape[:2], lse_dtype(dtype), named(names, like_name))
    if opt.group_size and opt.group_scales is None:
        rows, heads, last = shape_of(out, "out", names)
        shape, dtype = scales_of(rows, heads, last * 2 if nvfp4 else last, opt)
        opt = opt._replace(group_scales=empty(out, shape, dtype, named(names, "out")))
    return out, out_lse, opt


# The most bytes a result may have: past any device's or host's memory (2^48 bytes, 256 TiB), a size
# read off an input can only be a mistake (a broadcast view, a wrong axis); refused before any
# allocation rather than left to the allocator's own failure.
_MOST_BYTES = 1 << 48


def _fits(shape, source):
    elements = 1
    for n in shape:
        elements *= n
    if elements * 8 > _MOST_BYTES:  # 8: the widest element a result has (float64's room)
        raise ValueError(f"{source}: expected sizes whose results fit in memory, got a result of shape "
                         f"{list(shape)} ({elements} elements)")


def run(op: Op, inputs, out, out_lse, opt: Options):
    """The call on the binding: (out, out_lse[, group scales]); the in-place merge's (o, lse)."""
    if op.like < 0:  # the in-place merge
        op.binding(*inputs, opt)
        return inputs[0], inputs[1]
    if out is None or out_lse is None or opt.out_dtype is not None or opt.group_size:
        out, out_lse, opt = allocate(op, inputs, out, out_lse, opt)
    op.binding(out, out_lse, *inputs, opt)
    return (out, out_lse) if not opt.group_size else (out, out_lse, opt.group_scales)


# ---- the backward: gradients allocated like their inputs, then the binding --------------------

def needs_of(needs_grad, count):
    needs = tuple(bool(n) for n in needs_grad)
    if len(needs) != count:
        raise ValueError(f"needs_grad: expected {count} flags, got {len(needs)}")
    return needs


def gradient_buffer(given, needed, like, shape, dtype, arg, op, like_name, is_jax):
    """One gradient: as given, allocated in the library of `like` (the input `like_name`) with
    `shape` and `dtype`, or None when not needed.  JAX arrays are neither written nor allocated
    like: JAX differentiates attnmerge.jax's merges itself."""
    if given is not None and not is_jax(given):
        return given
    if given is None and not needed:
        return None
    if given is not None or is_jax(like):
        raise ValueError(f"{arg if given is not None else like_name}: expected an array attnmerge may write or "
                         f"allocate like, got a JAX array (immutable); the gradients of attnmerge.jax.{op} come "
                         f"from jax.grad or jax.vjp (its custom_vjp runs this backward)")
    return empty(like, shape, dtype, arg)


def o_dtype(x, arg):
    return dtype_name(getattr(x, "dtype", None), arg, O_IN_DTYPES)


_BACKWARDS = {"merge": _C.merge_backward, "merge_states": _C.merge_states_backward,
              "merge_varlen": _C.merge_varlen_backward}


def run_backward(op: str, grads, arrays, opt: Options):
    """The backward of `op` on the binding: the gradients (None: not computed), the incoming
    gradients, the forward's results and inputs, as the C ABI takes them."""
    _BACKWARDS[op](*grads, *arrays, opt)
