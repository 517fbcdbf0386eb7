"""torch.ops.attnmerge: the merge family as registered PyTorch operators, so that torch.compile,
torch.export, fake tensors and autograd see it.  Imported only once torch is (attnmerge._torch_hook).

Each public function has a functional overload returning new (out, out_lse) and a mutating one;
arguments are named, shaped and typed as the public function's (the schemas are in _SCHEMAS, `(a!)`
marking what an overload writes):
    merge, merge.out                       two states; a_tokens as in attnmerge.merge
    merge_inplace, merge_inplace.functional  (o, lse) <- merge, masked; the functional one leaves o, lse
    merge_states, merge_states.out         S stacked states, states_axis 1 or 0
    merge_varlen, merge_varlen.out         row r merges states indptr[r] .. indptr[r+1]-1
    merge_share, merge_share.out           state `index`'s share of the merge of S states' LSEs
LSEs are float32 [tokens, heads] in any strides, base "e" (natural log) or "2" (merge and
merge_inplace: also "2,e" or "e,2", a's and b's), out_base None (the inputs') or "e" or "2" for the
merged LSE (not merge_inplace, whose LSE keeps lse's base); output_scale is a
one-element float32 tensor; sink (merge, merge_states, merge_varlen, merge_share) a float32 [heads]
tensor of sink logits.  The kernels (CPU and CUDA) are attnmerge's own and run on torch's current stream (the
capture stream under CUDA graph capture).  Autograd: see _register_autograd.

merge, merge_inplace, merge_states, merge_varlen and merge_share at the end are what the public functions call
while traced (`takes`): they map the public arguments onto the overloads.
"""
import contextlib
import contextvars

import torch

from . import _C, _merge
from ._arrays import dtype_name, name_of
from ._types import NO_GRADIENT_DTYPES

_NS = "attnmerge"

# The schemas: "(a!)" marks a tensor the op writes (so autograd, functionalization and the compilers
# know), and the functional overloads return new tensors that alias no input.
_OPTIONS = 'str base="e", bool pdl=False'
_OUT_OPTIONS = 'str base="e", str? out_base=None, bool pdl=False'  # the ops that write an out_lse
# Per-group FP8 outputs: the out= overloads only (an FP8 output has no gradient), the scales written.
_GROUPS = 'Tensor(c!)? group_scales=None, int group_size=0, bool scale_ue8m0=False'

_SCHEMAS = {
    "merge": "(Tensor o_a, Tensor lse_a, Tensor o_b, Tensor lse_b, Tensor? output_scale=None, Tensor? sink=None, *, "
             f"ScalarType? out_dtype=None, SymInt? a_tokens=None, {_OUT_OPTIONS}) -> (Tensor out, Tensor out_lse)",
    "merge.out": "(Tensor o_a, Tensor lse_a, Tensor o_b, Tensor lse_b, *, Tensor(a!) out, Tensor(b!)? out_lse=None, "
                 f"Tensor? output_scale=None, Tensor? sink=None, SymInt? a_tokens=None, {_GROUPS}, {_OUT_OPTIONS}) "
                 "-> ()",
    "merge_inplace": f"(Tensor(a!) o, Tensor(b!) lse, Tensor o_other, Tensor lse_other, Tensor? mask=None, *, "
                     f"{_OPTIONS}) -> ()",
    "merge_inplace.functional": f"(Tensor o, Tensor lse, Tensor o_other, Tensor lse_other, Tensor? mask=None, *, "
                                f"{_OPTIONS}) -> (Tensor o_merged, Tensor lse_merged)",
    "merge_states": "(Tensor o, Tensor lse, Tensor? output_scale=None, Tensor? sink=None, *, "
                    f"ScalarType? out_dtype=None, int states_axis=1, {_OUT_OPTIONS}) -> (Tensor out, Tensor out_lse)",
    "merge_states.out": "(Tensor o, Tensor lse, *, Tensor(a!) out, Tensor(b!)? out_lse=None, "
                        f"Tensor? output_scale=None, Tensor? sink=None, int states_axis=1, {_GROUPS}, "
                        f"{_OUT_OPTIONS}) -> ()",
    "merge_varlen": "(Tensor o, Tensor lse, Tensor indptr, Tensor? output_scale=None, Tensor? sink=None, *, "
                    f"ScalarType? out_dtype=None, {_OUT_OPTIONS}) -> (Tensor out, Tensor out_lse)",
    "merge_varlen.out": "(Tensor o, Tensor lse, Tensor indptr, *, Tensor(a!) out, Tensor(b!)? out_lse=None, "
                        f"Tensor? output_scale=None, Tensor? sink=None, {_GROUPS}, {_OUT_OPTIONS}) -> ()",
    "merge_share": "(Tensor o, Tensor lse, Tensor? output_scale=None, Tensor? sink=None, *, int index, "
                   f"ScalarType? out_dtype=None, int states_axis=1, {_OUT_OPTIONS}) -> (Tensor out, Tensor out_lse)",
    "merge_share.out": "(Tensor o, Tensor lse, *, int index, Tensor(a!) out, Tensor(b!)? out_lse=None, "
                       f"Tensor? output_scale=None, Tensor? sink=None, int states_axis=1, {_GROUPS}, "
                       f"{_OUT_OPTIONS}) -> ()",
    # The gradients of the functional merges (what their registered autograd calls): inputs
    # whose `needs` flag is False get an empty tensor (not computed).
    "merge_backward": "(Tensor grad_out, Tensor? grad_out_lse, Tensor out, Tensor out_lse, Tensor o_a, Tensor lse_a, "
                      "Tensor o_b, Tensor lse_b, *, bool[4] needs, SymInt? a_tokens=None, str base=\"e\") "
                      "-> (Tensor grad_o_a, Tensor grad_lse_a, Tensor grad_o_b, Tensor grad_lse_b)",
    "merge_states_backward": "(Tensor grad_out, Tensor? grad_out_lse, Tensor out, Tensor out_lse, Tensor o, "
                             "Tensor lse, *, bool[2] needs, int states_axis=1, str base=\"e\") "
                             "-> (Tensor grad_o, Tensor grad_lse)",
    "merge_varlen_backward": "(Tensor grad_out, Tensor? grad_out_lse, Tensor out, Tensor out_lse, Tensor o, "
                             "Tensor lse, Tensor indptr, *, bool[2] needs, str base=\"e\") "
                             "-> (Tensor grad_o, Tensor grad_lse)",
}


# ---- results: shapes, dtypes, devices (the fake implementations, and what the kernels allocate) ---

def _new(like, shape, dtype):
    """(out [tokens, heads, head_size] of dtype, out_lse float32 [tokens, heads]) where `like` lives."""
    return (torch.empty(shape, dtype=dtype, device=like.device),
            torch.empty(shape[:2], dtype=torch.float32, device=like.device))


def _states_axis(states_axis):
    if states_axis not in (0, 1):
        raise ValueError(f"states_axis: expected 0 or 1, got {states_axis!r}")
    return states_axis


_RESULTS = {  # out_dtype None: that of the inputs, as in the public functions
    # (output_scale and sink, the functional overloads' last positional arguments, play no part)
    "merge": lambda o_a, lse_a, o_b, lse_b, *_, out_dtype=None, **__: _new(o_b, tuple(o_b.shape),
                                                                           out_dtype or o_a.dtype),
    "merge_states": lambda o, lse, *_, out_dtype=None, states_axis=1, **__: _new(
        o, _merge.states_shape(o, _states_axis(states_axis), _NAMES.get()), out_dtype or o.dtype),
    "merge_varlen": lambda o, lse, indptr, *_, out_dtype=None, **__: _new(
        o, _merge.varlen_shape(o, indptr, _NAMES.get()), out_dtype or o.dtype),
    "merge_share": lambda o, lse, *_, out_dtype=None, **__: _new(o, _merge.share_shape(o, _NAMES.get()),
                                                                 out_dtype or o.dtype),
    "merge_inplace.functional": lambda o, lse, *_, **__: (torch.empty_like(o), torch.empty_like(lse)),
    "merge_backward": lambda grad_out, grad_out_lse, out, out_lse, o_a, lse_a, o_b, lse_b, *, needs, **_: tuple(
        _grad_like(x, need) for x, need in zip((o_a, lse_a, o_b, lse_b), needs)),
    "merge_states_backward": lambda grad_out, grad_out_lse, out, out_lse, o, lse, *, needs, **_: tuple(
        _grad_like(x, need) for x, need in zip((o, lse), needs)),
    "merge_varlen_backward": lambda grad_out, grad_out_lse, out, out_lse, o, lse, indptr, *, needs, **_: tuple(
        _grad_like(x, need) for x, need in zip((o, lse), needs)),
}


def _grad_like(x, needed):
    """The gradient of input x: its shape and dtype, contiguous; empty where it is not needed."""
    return torch.empty(x.shape if needed else (0,), dtype=x.dtype, device=x.device)


def _fake_nothing(*args, **kwargs):  # the mutating overloads return nothing
    return None


# ---- kernels (CPU and CUDA: the library picks the device from the pointers) ------------------------

# The caller's names of the arguments of the public call being run (a compat layer's: _merge's
# `_names`).  The dispatcher carries no such argument to the kernels, so the public call sets it
# around the op (_names_for_kernels) and the kernels read it; None: the ops' own names.
_NAMES = contextvars.ContextVar("attnmerge_names", default=None)


def _base_value(text, name="base", pair=False):
    """A schema's base string ("e", "2"; a pair's "2,e") as the public functions take it."""
    if pair and isinstance(text, str) and "," in text:
        return tuple(_base_value(t, name) for t in text.split(","))
    if text not in ("e", "2"):
        expected = "'e', '2' or a pair of them ('2,e': a's, b's)" if pair else "'e' or '2'"
        raise ValueError(f"{name}: expected {expected}, got {text!r}")
    return 2 if text == "2" else "e"


def _bases(options, pair=False):
    """(a's, b's, out's) bases of an op's options (_merge.lse_bases)."""
    out_base = options.get("out_base")
    return _merge.lse_bases(_base_value(options.get("base", "e"), pair=pair),
                            None if out_base is None else _base_value(out_base, "out_base"), pair=pair)


def _flags(base, pdl, out_base=None, pair=False):
    a, b, out = _bases({"base": base, "out_base": out_base}, pair)
    return _merge.lse_flags((a, b), out, pair=True) | (_C.PDL if pdl else 0)


def _group_flags(scale_ue8m0):
    return _C.GROUP_SCALE_UE8M0 if scale_ue8m0 else 0


def _merge_out(o_a, lse_a, o_b, lse_b, *, out, out_lse=None, output_scale=None, sink=None, a_tokens=None,
               group_scales=None, group_size=0, scale_ue8m0=False, base="e", out_base=None, pdl=False):
    names = _NAMES.get()
    _C.merge(out, out_lse, o_a, lse_a, o_b, lse_b, _flags(base, pdl, out_base, pair=True) | _group_flags(scale_ue8m0),
             _merge.a_tokens_arg(a_tokens, _merge._named(names, "a_tokens")), output_scale, None, names, group_scales,
             group_size, sink)


def _merge_inplace(o, lse, o_other, lse_other, mask=None, *, base="e", pdl=False):
    _C.merge_inplace(o, lse, o_other, lse_other, mask, _flags(base, pdl, pair=True), None, _NAMES.get())


def _merge_inplace_functional(o, lse, o_other, lse_other, mask=None, *, base="e", pdl=False):
    o, lse = o.clone(), lse.clone()  # the same strides as _RESULTS' empty_like
    _merge_inplace(o, lse, o_other, lse_other, mask, base=base, pdl=pdl)
    return o, lse


def _merge_states_out(o, lse, *, out, out_lse=None, output_scale=None, sink=None, states_axis=1, group_scales=None,
                      group_size=0, scale_ue8m0=False, base="e", out_base=None, pdl=False):
    _C.merge_states(out, out_lse, o, lse, _flags(base, pdl, out_base) | _group_flags(scale_ue8m0),
                    _states_axis(states_axis) == 0, output_scale, sink, None, _NAMES.get(), group_scales, group_size)


def _merge_varlen_out(o, lse, indptr, *, out, out_lse=None, output_scale=None, sink=None, group_scales=None,
                      group_size=0, scale_ue8m0=False, base="e", out_base=None, pdl=False):
    _C.merge_varlen(out, out_lse, o, lse, indptr, _flags(base, pdl, out_base) | _group_flags(scale_ue8m0),
                    output_scale, sink, None, _NAMES.get(), group_scales, group_size)


def _merge_share_out(o, lse, *, index, out, out_lse=None, output_scale=None, sink=None, states_axis=1,
                     group_scales=None, group_size=0, scale_ue8m0=False, base="e", out_base=None, pdl=False):
    names = _NAMES.get()
    _C.merge_share(out, out_lse, o, lse, _merge.index_arg(index, names),
                   _flags(base, pdl, out_base) | _group_flags(scale_ue8m0), _states_axis(states_axis) == 0,
                   output_scale, sink, None, names, group_scales, group_size)


def _merge_backward(grad_out, grad_out_lse, out, out_lse, o_a, lse_a, o_b, lse_b, *, needs, a_tokens=None, base="e"):
    grads = _RESULTS["merge_backward"](grad_out, grad_out_lse, out, out_lse, o_a, lse_a, o_b, lse_b, needs=needs)
    # With a_tokens the library writes a's gradients for its first a_tokens tokens: a's later
    # tokens were never read, their gradient is zero.
    k = o_a.shape[0] if a_tokens is None else min(int(a_tokens), o_a.shape[0])
    for g, need in zip(grads[:2], needs[:2]):
        if need and k < o_a.shape[0]:
            g[k:].zero_()
    given = [g[:k] if i < 2 else g for i, g in enumerate(grads)]
    _merge.merge_backward(grad_out, grad_out_lse, out, out_lse, o_a, lse_a, o_b, lse_b,
                          **{name: g if need else None for name, g, need in
                             zip(("grad_o_a", "grad_lse_a", "grad_o_b", "grad_lse_b"), given, needs)},
                          needs_grad=tuple(needs), base=2 if base == "2" else "e", a_tokens=a_tokens)
    return grads


def _merge_states_backward(grad_out, grad_out_lse, out, out_lse, o, lse, *, needs, states_axis=1, base="e"):
    grads = _RESULTS["merge_states_backward"](grad_out, grad_out_lse, out, out_lse, o, lse, needs=needs)
    _merge.merge_states_backward(grad_out, grad_out_lse, out, out_lse, o, lse,
                                 grad_o=grads[0] if needs[0] else None, grad_lse=grads[1] if needs[1] else None,
                                 needs_grad=tuple(needs), base=2 if base == "2" else "e",
                                 states_axis=_states_axis(states_axis))
    return grads


def _merge_varlen_backward(grad_out, grad_out_lse, out, out_lse, o, lse, indptr, *, needs, base="e"):
    grads = _RESULTS["merge_varlen_backward"](grad_out, grad_out_lse, out, out_lse, o, lse, indptr, needs=needs)
    _merge.merge_varlen_backward(grad_out, grad_out_lse, out, out_lse, o, lse, indptr,
                                 grad_o=grads[0] if needs[0] else None, grad_lse=grads[1] if needs[1] else None,
                                 needs_grad=tuple(needs), base=2 if base == "2" else "e")
    return grads


def _functional(results, out_kernel, n_tensors, extras=("output_scale",)):
    """The functional kernel: the results allocated as the fake implementation says, then filled.
    Its positional arguments: the op's `n_tensors` inputs, then the optional tensors `extras`
    (positional, so that autograd can be registered: it takes no keyword-only tensors; the
    dispatcher may drop the trailing ones that are None)."""
    def kernel(*args, out_dtype=None, **options):
        tensors = args[:n_tensors]
        for i, name in enumerate(extras):
            given = options.pop(name, None)
            options[name] = args[n_tensors + i] if len(args) > n_tensors + i else given
        out, out_lse = results(*tensors, out_dtype=out_dtype, **options)
        out_kernel(*tensors, out=out, out_lse=out_lse, **options)
        return out, out_lse

    return kernel


_KERNELS = {
    "merge": _functional(_RESULTS["merge"], _merge_out, 4, ("output_scale", "sink")), "merge.out": _merge_out,
    "merge_inplace": _merge_inplace, "merge_inplace.functional": _merge_inplace_functional,
    "merge_states": _functional(_RESULTS["merge_states"], _merge_states_out, 2, ("output_scale", "sink")),
    "merge_states.out": _merge_states_out,
    "merge_varlen": _functional(_RESULTS["merge_varlen"], _merge_varlen_out, 3, ("output_scale", "sink")),
    "merge_varlen.out": _merge_varlen_out,
    "merge_share": _functional(_RESULTS["merge_share"], _merge_share_out, 2, ("output_scale", "sink")),
    "merge_share.out": _merge_share_out,
    "merge_backward": _merge_backward, "merge_states_backward": _merge_states_backward,
    "merge_varlen_backward": _merge_varlen_backward,
}


# ---- autograd -------------------------------------------------------------------------------------

def _register_autograd(lib):
    """The one place autograd attaches to the ops.  The functional merges (merge, merge_states,
    merge_varlen) differentiate with respect to every O and LSE input through the backward ops,
    from the saved inputs and results (no recomputation).  The out= and in-place overloads, the
    in-place merge's functional form and the backward ops themselves refuse inputs that require
    grad by name, as PyTorch's own out= ops do: never a silently missing gradient."""
    for name in _SCHEMAS:
        if name in _AUTOGRAD:
            setup, backward = _AUTOGRAD[name]
            torch.library.register_autograd(f"{_NS}::{name}", backward, setup_context=setup, lib=lib)
        else:
            lib.impl(name, _refuse_grad(name), "Autograd", with_keyset=True)


def _no_fp8_gradient(name, inputs, scale, out):
    """A gradient through a scaled or FP8 output is not defined here: refused when one is asked for."""
    if name_of(out.dtype) in NO_GRADIENT_DTYPES or scale is not None:
        if any(isinstance(x, torch.Tensor) and x.requires_grad for x in inputs):
            raise NotImplementedError(f"{_NS}::{name}: no gradient through an FP8 output or an output_scale; call it "
                                      f"under torch.no_grad() or on detached tensors")


def _setup(name, n_tensors):
    """Saves the op's `n_tensors` tensor inputs, its results and, after them, its sink (None where
    it has none; output_scale and sink follow the tensor inputs)."""
    def setup_context(ctx, inputs, keyword_only_inputs, output):
        out, out_lse = output
        scale = inputs[n_tensors] if len(inputs) > n_tensors else None
        sink = inputs[n_tensors + 1] if len(inputs) > n_tensors + 1 else None
        _no_fp8_gradient(name, (*inputs[:n_tensors], sink), scale, out)
        ctx.save_for_backward(*inputs[:n_tensors], out, out_lse, sink)
        ctx.options = keyword_only_inputs
    return setup_context


def _grads_or_none(grads, needs):
    return tuple(g if need else None for g, need in zip(grads, needs))


def _incoming(grad_out, out):
    """The incoming gradient of out as the library takes it: zeros where out was unused, and dense
    where autograd hands an expanded one (stride 0 on head_size, from a sum)."""
    return torch.zeros_like(out) if grad_out is None else grad_out.contiguous()


def _incoming_lse(grad_out_lse):
    return None if grad_out_lse is None else grad_out_lse.contiguous()


def _text(base):
    """A base ('e' or 2) as the schemas spell it."""
    return "2" if base == 2 else "e"


def _in_inputs_base(ctx, out_lse, grad_out_lse, pair=False):
    """(a's base, b's base, out_lse, its incoming gradient), the last two in a's base where out_base
    differs: the backward ops take one base, and a gradient through lse' = c lse is c dlse'."""
    a, b, out = _bases(ctx.options, pair)
    grad_out_lse = _incoming_lse(grad_out_lse)
    c = _merge.base_change(a, out)
    if c != 1.0:
        out_lse = out_lse / c
        grad_out_lse = None if grad_out_lse is None else grad_out_lse * c
    return a, b, out_lse, grad_out_lse


def _merge_grad(ctx, grad_out, grad_out_lse):
    o_a, lse_a, o_b, lse_b, out, out_lse, sink = ctx.saved_tensors
    needs = list(ctx.needs_input_grad[:4])
    a, b, out_lse, grad_out_lse = _in_inputs_base(ctx, out_lse, grad_out_lse, pair=True)
    c_b = _merge.base_change(b, a)  # lse_b in a's base, as the forward merged it
    grads = list(torch.ops.attnmerge.merge_backward(_incoming(grad_out, out), grad_out_lse, out, out_lse, o_a, lse_a,
                                                    o_b, lse_b * c_b if c_b != 1.0 else lse_b, needs=needs,
                                                    a_tokens=ctx.options.get("a_tokens"), base=_text(a)))
    if c_b != 1.0 and needs[3]:
        grads[3] = grads[3] * c_b
    # The states' gradients follow from out and out_lse, which count the sink (in a's base).
    return (*_grads_or_none(grads, needs), None,  # output_scale: none
            _sink_grad_of(ctx, 5, sink, out, out_lse, grad_out, grad_out_lse, a))


def _sink_grad_of(ctx, sink_index, sink, out, out_lse, grad_out, grad_out_lse, base):
    """The sink's gradient where autograd asks for it, else None (out_lse and its gradient in the
    inputs' base)."""
    if sink is None or not ctx.needs_input_grad[sink_index]:
        return None
    return _merge.sink_gradient(torch, sink.float(), out.float(), out_lse, _incoming(grad_out, out).float(),
                                grad_out_lse, base).to(sink.dtype)


def _merge_states_grad(ctx, grad_out, grad_out_lse):
    o, lse, out, out_lse, sink = ctx.saved_tensors
    needs = list(ctx.needs_input_grad[:2])
    base, _, out_lse, grad_out_lse = _in_inputs_base(ctx, out_lse, grad_out_lse)
    grads = torch.ops.attnmerge.merge_states_backward(_incoming(grad_out, out), grad_out_lse, out, out_lse, o, lse,
                                                      needs=needs, states_axis=ctx.options.get("states_axis", 1),
                                                      base=_text(base))
    # The states' gradients follow from out and out_lse, which count the sink.
    return (*_grads_or_none(grads, needs), None,
            _sink_grad_of(ctx, 3, sink, out, out_lse, grad_out, grad_out_lse, base))


def _merge_varlen_grad(ctx, grad_out, grad_out_lse):
    o, lse, indptr, out, out_lse, sink = ctx.saved_tensors
    needs = list(ctx.needs_input_grad[:2])
    base, _, out_lse, grad_out_lse = _in_inputs_base(ctx, out_lse, grad_out_lse)
    grads = torch.ops.attnmerge.merge_varlen_backward(_incoming(grad_out, out), grad_out_lse, out, out_lse, o, lse,
                                                      indptr, needs=needs, base=_text(base))
    return (*_grads_or_none(grads, needs), None, None,  # indptr, output_scale: none
            _sink_grad_of(ctx, 4, sink, out, out_lse, grad_out, grad_out_lse, base))


def _merge_share_grad(ctx, grad_out, grad_out_lse):
    """merge_share's gradients in torch ops (_merge.share_gradient): elementwise work over the one
    O, dO and the LSEs, with no backward kernel of its own (a few passes where one would do)."""
    o, lse, out, out_lse, sink = ctx.saved_tensors
    base, _, out_lse, grad_out_lse = _in_inputs_base(ctx, out_lse, grad_out_lse)
    grad_o = grad_lse = None
    if any(ctx.needs_input_grad[:2]):
        f32 = torch.float32
        grad_o, grad_lse = _merge.share_gradient(torch, o.to(f32), lse, ctx.options["index"], out_lse,
                                                 _incoming(grad_out, out).to(f32), grad_out_lse, base,
                                                 ctx.options.get("states_axis", 1))
        grad_o = grad_o.to(o.dtype) if ctx.needs_input_grad[0] else None
        grad_lse = grad_lse if ctx.needs_input_grad[1] else None
    return grad_o, grad_lse, None, _sink_grad_of(ctx, 3, sink, out, out_lse, grad_out, grad_out_lse, base)


_AUTOGRAD = {
    "merge": (_setup("merge", 4), _merge_grad),
    "merge_states": (_setup("merge_states", 2), _merge_states_grad),
    "merge_varlen": (_setup("merge_varlen", 3), _merge_varlen_grad),
    "merge_share": (_setup("merge_share", 2), _merge_share_grad),
}


def _refuse_grad(name):
    op = _overload(name)
    arg_names = [a.name for a in op._schema.arguments]
    mutated = [a.name for a in op._schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    differentiable = not mutated

    def autograd_kernel(keyset, *args, **kwargs):
        if torch.is_grad_enabled():
            values = dict(zip(arg_names, args), **kwargs)
            wanting = [k for k, v in values.items() if isinstance(v, torch.Tensor) and v.requires_grad]
            if wanting:
                why = ("attnmerge has no gradient of it (the in-place merge and the backward ops are not "
                       "differentiable)" if differentiable
                       else "it writes its results into given tensors, which autograd cannot differentiate")
                raise NotImplementedError(
                    f"{_NS}::{name}: {', '.join(wanting)} requires grad, but {why}; call it under torch.no_grad() "
                    f"or on detached tensors")
        with torch._C._AutoDispatchBelowAutograd():
            result = op.redispatch(keyset & torch._C._after_autograd_keyset, *args, **kwargs)
        if mutated:
            values = dict(zip(arg_names, args), **kwargs)
            for k in mutated:  # so autograd catches a saved tensor that the op overwrote
                if values.get(k) is not None:
                    torch.autograd.graph.increment_version(values[k])
        return result

    return autograd_kernel


# ---- registration ---------------------------------------------------------------------------------

def _overload(name):
    packet, _, overload = name.partition(".")
    return getattr(getattr(getattr(torch.ops, _NS), packet), overload or "default")


def _register():
    lib = torch.library.Library(_NS, "DEF")
    for name, schema in _SCHEMAS.items():
        lib.define(name + schema, tags=(torch.Tag.pt2_compliant_tag,))
    for name, kernel in _KERNELS.items():
        lib.impl(name, kernel, "CPU")
        lib.impl(name, kernel, "CUDA")
    for name in _SCHEMAS:
        torch.library.register_fake(f"{_NS}::{name}", _RESULTS.get(name, _fake_nothing), lib=lib)
    _register_autograd(lib)
    return lib


_LIB = _register()  # kept alive: the registrations last as long as the Library object


# ---- what the public functions call while tracing -------------------------------------------------

_compiling = torch.compiler.is_compiling
# Dynamo folds this to True while it traces and it is a bare `return False` in eager mode, where
# is_compiling() first asks torch.jit.is_scripting() (most of takes()' cost: benchmarks/NOTES.md).
_dynamo_compiling = getattr(torch.compiler, "is_dynamo_compiling", _compiling)
_Tensor = torch.Tensor


def _flag_reader(name, gate):
    """`reader(*arrays)`: whether gate() is True and any array (None allowed) has `name` set;
    torch.Tensor's own read through its C getter (_C.flag_reader, less than a Python attribute read
    each), where torch defines it as attnmerge expects (a getset descriptor)."""
    try:
        return _C.flag_reader(_Tensor, name, gate)
    except TypeError:
        return lambda *arrays: gate() is True and any(getattr(x, name, False) is True for x in arrays)


# Whether autograd records a call of these inputs: the grad mode first, as inference runs under
# no_grad or inference_mode.
_autograd_records = _flag_reader("requires_grad", torch.is_grad_enabled)


def _python_takes(a, b, c, d):
    if (type(a) is _Tensor and type(b) is _Tensor and not _dynamo_compiling()) or not _compiling():
        return _autograd_records(a, b, c, d)
    return True


def _c_takes():
    """_python_takes as one C call (_C.flag_reader with torch.compiler.is_compiling as `tracing`:
    asked only for arrays other than exact torch.Tensor), registered with Dynamo with a Python
    stand-in that answers True while it traces (as is_dynamo_compiling() folds to there; Dynamo
    cannot trace a C function); None where torch.Tensor's flag or this torch does not allow it."""
    substitute = getattr(torch.compiler, "substitute_in_graph", None)
    if substitute is None:
        return None
    try:
        check = _C.flag_reader(_Tensor, "requires_grad", torch.is_grad_enabled, _compiling)

        @substitute(check, skip_signature_check=True)
        def _takes_while_tracing(a, b, c, d):
            return True
    except (TypeError, ValueError, RuntimeError, AttributeError):
        return None
    return check


# takes(a, b, c, d): whether a public call goes through torch.ops.attnmerge: while torch.compile or
# torch.export traces it, and when autograd would record it (any of the arrays a..d, None allowed,
# requires grad): the op then differentiates it, or refuses it by name.  Eager torch tensors, the
# per-call case, first and cheapest; other arrays ask torch.compiler.is_compiling() (torch.export's
# non-strict tracing passes FakeTensors, a subclass).  One C call where this torch allows it.
takes = _c_takes() or _python_takes


def _no_stream(stream):
    if stream is not None:
        raise ValueError(f"stream: expected None when traced by torch.compile or torch.export (the op runs on "
                         f"torch's current stream; use torch.cuda.stream(...) to choose it), got {stream!r}")


def _base(base, names=None, pair=False):
    """The public functions' base as the schemas' str ("e", "2", a pair's "2,e"), checked."""
    a, b, _ = _merge.lse_bases(base, pair=pair, names=names)
    return _text(a) if a == b else f"{_text(a)},{_text(b)}"


def _out_base(out_base, names=None):
    return None if out_base is None else _text(_merge.lse_bases("e", out_base, names=names)[2])


def _scale(output_scale, like):
    """A number becomes the one-element float32 tensor the ops take."""
    if output_scale is None or isinstance(output_scale, torch.Tensor):
        return output_scale
    return torch.full((1,), float(_merge.output_scale_arg(output_scale)), dtype=torch.float32, device=like.device)


def _out_dtype(out_dtype):
    if out_dtype is None or isinstance(out_dtype, torch.dtype):
        return out_dtype
    return getattr(torch, dtype_name(out_dtype, "out_dtype"))


def _call(functional, out_variant, like, in_dtype_of, shape_of, arg_names, names, groups, out, out_lse, return_lse,
          out_dtype, *args, **options):
    """The functional overload when no output is given (the one autograd can attach to), else the
    out= overload, any missing output allocated as the eager path allocates it; `names` (the
    caller's, or None) reach the kernels.  `groups`: the public call's (group_size, group_scales,
    scale_ue8m0), which take the out= overload (no gradient through FP8), the scales allocated as
    the eager path allocates them and returned after out_lse."""
    group_size, group_scales, scale_ue8m0 = groups if groups is not None else (None, None, False)
    out_dtype, group, _ = _merge.groups_arg(group_size, scale_ue8m0, out, out_dtype, names)
    with _names_for_kernels(names):
        if out is None and out_lse is None and group_size is None and group_scales is None:
            res, res_lse = functional(*args, out_dtype=_out_dtype(out_dtype), **options)
            return res, (res_lse if return_lse else None)
        shape = shape_of() if out is None or (out_lse is None and return_lse) else None
        out, out_lse = _merge._outputs(like, in_dtype_of, shape, out, out_lse, return_lse, out_dtype, *arg_names,
                                       names)
        if group:
            group_scales = _merge.group_scales_like(out, group_scales, group, names)
        if group_scales is not None:  # given, or allocated for a group_size
            options.update(group_scales=group_scales, group_size=group, scale_ue8m0=bool(scale_ue8m0))
        out_variant(*args, out=out, out_lse=out_lse, **options)
        return _merge._results(out, out_lse, group_scales, group_size)


def _names_for_kernels(names):
    """`names` set for the kernels of the ops run inside (_NAMES); nothing while torch.compile
    traces, which runs no kernel."""
    if names is None or _compiling():
        return contextlib.nullcontext()
    return _Named(names)


class _Named:
    def __init__(self, names):
        self.names = names

    def __enter__(self):
        self.token = _NAMES.set(self.names)

    def __exit__(self, *exc):
        _NAMES.reset(self.token)


def merge(o_a, lse_a, o_b, lse_b, out, out_lse, return_lse, out_dtype, output_scale, base, out_base, a_tokens,
          stream, pdl, names=None, groups=None, sink=None):
    _no_stream(stream)
    return _call(torch.ops.attnmerge.merge.default, torch.ops.attnmerge.merge.out, o_b, o_a, lambda: tuple(o_b.shape),
                 ("o_b", "o_a"), names, groups, out, out_lse, return_lse, out_dtype, o_a, lse_a, o_b, lse_b,
                 output_scale=_scale(output_scale, o_b), sink=sink, a_tokens=a_tokens,
                 base=_base(base, names, pair=True), out_base=_out_base(out_base, names), pdl=pdl)


def merge_inplace(o, lse, o_other, lse_other, mask, base, stream, pdl, names=None):
    _no_stream(stream)
    with _names_for_kernels(names):
        torch.ops.attnmerge.merge_inplace.default(o, lse, o_other, lse_other, mask, base=_base(base, names, pair=True),
                                                  pdl=pdl)
    return o, lse


def merge_states(o, lse, out, out_lse, return_lse, out_dtype, output_scale, base, out_base, states_axis, sink, stream,
                 pdl, names=None, groups=None):
    _no_stream(stream)
    return _call(torch.ops.attnmerge.merge_states.default, torch.ops.attnmerge.merge_states.out, o, o,
                 lambda: _merge.states_shape(o, states_axis, names), ("o", "o"), names, groups, out, out_lse,
                 return_lse, out_dtype, o, lse, output_scale=_scale(output_scale, o), sink=sink,
                 states_axis=states_axis, base=_base(base, names), out_base=_out_base(out_base, names), pdl=pdl)


def merge_varlen(o, lse, indptr, out, out_lse, return_lse, out_dtype, output_scale, base, out_base, sink, stream, pdl,
                 names=None, groups=None):
    _no_stream(stream)
    return _call(torch.ops.attnmerge.merge_varlen.default, torch.ops.attnmerge.merge_varlen.out, o, o,
                 lambda: _merge.varlen_shape(o, indptr, names), ("o", "o"), names, groups, out, out_lse, return_lse,
                 out_dtype, o, lse, indptr, output_scale=_scale(output_scale, o), sink=sink, base=_base(base, names),
                 out_base=_out_base(out_base, names), pdl=pdl)


def merge_share(o, lse, index, out, out_lse, return_lse, out_dtype, output_scale, base, out_base, states_axis, sink,
                stream, pdl, names=None, groups=None):
    _no_stream(stream)
    return _call(torch.ops.attnmerge.merge_share.default, torch.ops.attnmerge.merge_share.out, o, o,
                 lambda: _merge.share_shape(o, names), ("o", "o"), names, groups, out, out_lse, return_lse, out_dtype,
                 o, lse, index=index, output_scale=_scale(output_scale, o), sink=sink, states_axis=states_axis,
                 base=_base(base, names), out_base=_out_base(out_base, names), pdl=pdl)
