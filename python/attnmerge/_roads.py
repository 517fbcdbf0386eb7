"""Which road a call takes, decided once per call: torch.ops.attnmerge while torch.compile or
torch.export traces it or autograd would record it; attnmerge.jax where its results would be
allocated like a JAX array (JAX arrays are immutable: never written); else the native road (the
binding).  The decision is asked in C (attnmerge._C.road, python/src/road.cpp: an eager call's
host time), from what this module registers: the cache of JAX types, the refusals and the roads
other than the binding.  torch registers its road once torch.ops.attnmerge exists
(attnmerge._torch_hook)."""
from __future__ import annotations

from . import _C, _native
from ._arrays import family
from ._call import Op, Options, named


def use_torch(takes, run, transforming):
    """Registers the torch road (attnmerge._torch_hook, once torch.ops.attnmerge is registered):
    takes(*arrays) says whether a call of those arrays (None allowed) goes through
    torch.ops.attnmerge (traced, or recorded by autograd), None where none of them is a torch
    tensor; transforming() whether a torch.func transform (vmap, grad, ...) is active, whose
    wrapped tensors only the ops can take (asked where takes answered False); run(op,
    inputs, out, out_lse, opt) runs the call.  Three None: no torch road."""
    _C.use_torch(takes, run, transforming)


def torch_road():
    """The registered torch road, (takes, run, transforming), or None."""
    return _C.torch_road()


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


# run(op, inputs, out, out_lse, opt): one call of `op` on its road, the public functions' (and the
# compat layers') one way down.  Every result given, none JAX's and no torch road taken: the
# binding; results to allocate: attnmerge.jax where they would be allocated like a JAX array, else
# _native.run; a JAX array handed over to be written: refused (_refuse_jax_outputs).
run = _C.road


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


_C.use_roads(_IS_JAX, is_jax, _refuse_jax_outputs, _jax, _native.run, {f: i for i, f in enumerate(Op._fields)},
             {f: i for i, f in enumerate(Options._fields)})
