"""Which road a call takes, decided once per call: torch.ops.attnmerge while torch.compile or
torch.export traces it or autograd would record it; attnmerge.jax where its results would be
allocated like a JAX array (JAX arrays are immutable: never written); else the native road (the
binding).  torch registers its road once torch.ops.attnmerge exists (attnmerge._torch_hook)."""
from __future__ import annotations

from . import _native
from ._arrays import family
from ._call import Op, Options, named

# (takes, run, transforming) of the torch road once registered: takes(*arrays) says whether a call
# of those arrays (None allowed) goes through torch.ops.attnmerge (traced, or recorded by
# autograd), transforming() whether a torch.func transform (vmap, grad, ...) is active, whose
# wrapped tensors only the ops can take; run(op, inputs, out, out_lse, opt) runs the call.
_torch = None


def use_torch(takes, run, transforming):
    """Registers the torch road (attnmerge._torch_hook, once torch.ops.attnmerge is registered)."""
    global _torch
    _torch = (takes, run, transforming)


_IS_JAX: dict[type, bool] = {}  # type -> whether it is JAX's (an array or a tracer), looked up every call


def is_jax(x):
    """Whether x is a JAX array or tracer, by its type."""
    try:
        return _IS_JAX[type(x)]
    except KeyError:
        jax = family(x) == "jax"
        if len(_IS_JAX) < 256:
            _IS_JAX[type(x)] = jax
        return jax


def _any_jax(a, b):
    """is_jax(a) or is_jax(b), in one call where both types were seen before (the per-call case)."""
    try:
        return _IS_JAX[type(a)] or _IS_JAX[type(b)]
    except KeyError:
        return is_jax(a) or is_jax(b)


def run(op: Op, inputs, out, out_lse, opt: Options):
    """One call of `op` on its road: the public functions' (and the compat layers') one way down."""
    torch = _torch
    if torch is not None and (torch[0](*inputs, opt.sink, out, out_lse) or torch[2]()):
        return torch[1](op, inputs, out, out_lse, opt)
    if op.like < 0:  # the in-place merge writes its first state
        if _any_jax(inputs[0], inputs[1]):
            _refuse_jax_outputs(op, inputs[:2], opt)
    elif out is None or out_lse is None or opt.out_dtype is not None or opt.group_size:  # results to allocate
        if (out is not None or out_lse is not None) and _any_jax(out, out_lse):
            _refuse_jax_outputs(op, (out, out_lse), opt)
        if out is None and is_jax(inputs[op.like]):
            return _jax(op, inputs, out_lse, opt)
    elif _IS_JAX.get(type(out)) is not False or _IS_JAX.get(type(out_lse)) is not False:  # types seen: no call
        if _any_jax(out, out_lse):
            _refuse_jax_outputs(op, (out, out_lse), opt)
    else:  # the per-call case: every result given, straight to the binding
        op.binding(out, out_lse, *inputs, opt)
        return (out, out_lse)
    return _native.run(op, inputs, out, out_lse, opt)


def _refuse_jax_outputs(op, written, opt):
    if op.like < 0:
        refuse_jax(named(opt.names, "o" if is_jax(written[0]) else "lse"), "merge",
                   "o, lse = attnmerge.merge(o, lse, o_other, lse_other); a mask is a jnp.where")
    out_name, lse_name = named(opt.names, "out"), named(opt.names, "out_lse")
    refuse_jax(out_name if is_jax(written[0]) else lse_name, op.name, f"leave {out_name}=None and {lse_name}=None")


def refuse_jax(arg, op, hint):
    """A JAX array handed over to be written: refused, pointing to attnmerge.jax's functional form."""
    raise ValueError(f"{arg}: expected a writable array, got a JAX array (immutable); JAX arrays are merged by "
                     f"attnmerge.jax.{op}, which returns new ones ({hint})")


def _jax(op, inputs, out_lse, opt: Options):
    """attnmerge.jax's road: new JAX arrays on XLA's buffers and stream, so nothing may be handed
    over to be written (out_lse, group_scales) and no stream chosen."""
    for name, given in (("out_lse", out_lse), ("group_scales", opt.group_scales)):
        if given is not None:
            arg = named(opt.names, name)
            raise ValueError(f"{arg}: expected None, got {type(given).__qualname__}: results allocated like a JAX "
                             f"array come from attnmerge.jax.{op.name}, which returns new ones (leave {arg}=None)")
    if opt.stream is not None:
        raise ValueError(f"stream: expected None for JAX arrays (attnmerge.jax runs on the stream XLA gives the "
                         f"call), got {opt.stream!r}")
    try:
        from . import jax as attnmerge_jax
    except ImportError as e:
        raise ImportError(f"attnmerge.{op.name} on JAX arrays runs attnmerge.jax, which is not available: {e}") from e
    results = attnmerge_jax.run(op, inputs, opt)
    return (results[0], results[1] if opt.return_lse else None, *results[2:])
