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

from . import _C, _call, _merge, _native
from ._arrays import name_of
from ._call import OPS, SUMS, Options
from ._grad import share_gradient, sink_gradient, stats_gradient, stats_lse
from ._types import NO_GRADIENT_DTYPES

_NS = "attnmerge"

# ---- the schemas, made from the ops' description (attnmerge._call.OPS) ------------------------------
# "(a!)" marks a tensor the op writes (so autograd, functionalization and the compilers know), and
# the functional overloads return new tensors that alias no input.  Each option an op takes is a
# keyword argument, spelled as the public functions take it where a schema can (bases as strings:
# "e", "2", a pair's "2,e"), converted to and from the call's Options record here alone.


def _text(base):
    """A base ('e' or 2) as the schemas spell it."""
    return "2" if base == 2 else "e"


def _base_value(text, name="base", pair=False):
    """A schema's base string ("e", "2"; a pair's "2,e") as the public functions take it."""
    if pair and isinstance(text, str) and "," in text:
        return tuple(_base_value(t, name) for t in text.split(","))
    if text not in ("e", "2"):
        expected = "'e', '2' or a pair of them ('2,e': a's, b's)" if pair else "'e' or '2'"
        raise ValueError(f"{name}: expected {expected}, got {text!r}")
    return 2 if text == "2" else "e"


# (option, its schema entry, its value from an Options record) for the keyword options the ops share;
# an op has those its Op.takes names ("base" and "pdl": every op).
_KEYWORDS = (
    ("index", "int index", lambda o: o.index),
    ("a_tokens", "SymInt? a_tokens=None", lambda o: None if o.a_tokens < 0 else o.a_tokens),
    ("states_axis", "int states_axis=1", lambda o: o.states_axis),
    ("base", 'str base="e"', lambda o: _text(o.bases[0]) if o.bases[0] == o.bases[1] else
     f"{_text(o.bases[0])},{_text(o.bases[1])}"),
    ("out_base", "str? out_base=None", lambda o: None if o.bases[2] == o.bases[0] else _text(o.bases[2])),
    ("pdl", "bool pdl=False", lambda o: o.pdl),
    ("batch_invariant", "bool batch_invariant=False", lambda o: o.batch_invariant),
)
_GROUPS = ("Tensor(c!)? group_scales=None, int group_size=0, bool scale_ue8m0=False, str? block_format=None, "
           'str scale_layout="row_major", str scale_rounding="floor"')  # the out= overloads'


def _keywords(op):
    return [(name, entry, value) for name, entry, value in _KEYWORDS if name in op.takes or name in ("base", "pdl")]


def _state_tensors(op):
    """The optional tensors of op's states after output_scale and sink: the softmax sums of its LSE
    arguments (attnmerge._call.SUMS), the states holding keys and the live tokens, in the schemas'
    order."""
    return SUMS[:len(op.lses)] + ("valid", "num_tokens")


def _schemas(op):
    """An op's overloads: {name: schema}."""
    tensors = ", ".join(f"Tensor {n}" for n in op.inputs)
    keywords = [entry for _, entry, _ in _keywords(op)]
    states = ", ".join(f"Tensor? {n}=None" for n in _state_tensors(op))
    if op.name == "merge_inplace":
        args = (f"Tensor(a!) o, Tensor(b!) lse, Tensor o_other, Tensor lse_other, Tensor? mask=None, {states}, *, " +
                ", ".join(keywords))
        return {op.name: f"({args}) -> ()",
                f"{op.name}.functional": f"({args.replace('(a!)', '').replace('(b!)', '')}) -> "
                                         "(Tensor o_merged, Tensor lse_merged)"}
    index = [k for k in keywords if k.startswith("int index")]
    rest = [k for k in keywords if not k.startswith("int index")]
    at = next(i for i, k in enumerate(rest) if k.startswith("str base"))  # the out= overloads' groups go before
    return {
        # output_scale, sink, the sums and valid positional: autograd takes no keyword-only tensors
        op.name: f"({tensors}, Tensor? output_scale=None, Tensor? sink=None, {states}, *, "
                 f"{', '.join(index + ['ScalarType? out_dtype=None'] + rest)}) -> (Tensor out, Tensor out_lse)",
        f"{op.name}.out": f"({tensors}, *, {', '.join(index)}{', ' if index else ''}Tensor(a!) out, "
                          f"Tensor(b!)? out_lse=None, Tensor? output_scale=None, Tensor? sink=None, {states}, "
                          f"{', '.join(rest[:at] + [_GROUPS] + rest[at:])}) -> ()",
    }


_SCHEMAS = {name: schema for op in OPS.values() for name, schema in _schemas(op).items()}
_SCHEMAS.update({
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
})


def _options(op, kwargs, names=None, **given):
    """The call's Options from an overload's keyword arguments (the schemas' spellings), through
    the one reading (attnmerge._call.options)."""
    out_base = kwargs.get("out_base")
    return _call.options(op, base=_base_value(kwargs.get("base", "e"), pair="pair" in op.takes),
                         out_base=None if out_base is None else _base_value(out_base, "out_base"),
                         a_tokens=kwargs.get("a_tokens"), states_axis=kwargs.get("states_axis", 1),
                         index=kwargs.get("index", 0), pdl=kwargs.get("pdl", False), names=names,
                         batch_invariant=kwargs.get("batch_invariant", False), **given)


# ---- results: shapes, dtypes, devices (the fake implementations, and what the kernels allocate) ---

def _new(like, shape, dtype):
    """(out [tokens, heads, head_size] of dtype, out_lse float32 [tokens, heads]) where `like` lives."""
    lse = torch.float64 if dtype == torch.float64 else torch.float32  # a float64 call is float64 whole
    return (torch.empty(shape, dtype=dtype, device=like.device), torch.empty(shape[:2], dtype=lse, device=like.device))


def _result(op):
    """The fake implementation (and the allocation) of op's functional overload: (out, out_lse)
    where its `like` input lives, shaped as the public function shapes them (_call.result_shape);
    out_dtype None: that of the inputs."""
    def results(*tensors, out_dtype=None, states_axis=1, **_):
        like = tensors[op.like]
        axis = _call.states_axis_of(states_axis, 3 if op.name == "merge_share" else 4, _NAMES.get())
        opt = Options(states_axis=axis, names=_NAMES.get())
        return _new(like, _call.result_shape(op, tensors[:len(op.inputs)], opt), out_dtype or tensors[0].dtype)
    return results


def _grad_like(x, needed):
    """The gradient of input x: its shape and dtype, contiguous; empty where it is not needed."""
    return torch.empty(x.shape if needed else (0,), dtype=x.dtype, device=x.device)


def _fake_nothing(*args, **kwargs):  # the mutating overloads return nothing
    return None


_RESULTS = {name: _result(op) for name, op in OPS.items() if name != "merge_inplace"}
_RESULTS.update({
    "merge_inplace.functional": lambda o, lse, *_, **__: (torch.empty_like(o), torch.empty_like(lse)),
    "merge_backward": lambda grad_out, grad_out_lse, out, out_lse, o_a, lse_a, o_b, lse_b, *, needs, **_: tuple(
        _grad_like(x, need) for x, need in zip((o_a, lse_a, o_b, lse_b), needs)),
    "merge_states_backward": lambda grad_out, grad_out_lse, out, out_lse, o, lse, *, needs, **_: tuple(
        _grad_like(x, need) for x, need in zip((o, lse), needs)),
    "merge_varlen_backward": lambda grad_out, grad_out_lse, out, out_lse, o, lse, indptr, *, needs, **_: tuple(
        _grad_like(x, need) for x, need in zip((o, lse), needs)),
})


# ---- kernels (CPU and CUDA: the library picks the device from the pointers) ------------------------

# The caller's names of the arguments of the public call being run (a compat layer's: the
# Options' `names`).  The dispatcher carries no such argument to the kernels, so the torch road sets
# it around the op (_names_for_kernels) and the kernels read it; None: the ops' own names.
_NAMES = contextvars.ContextVar("attnmerge_names", default=None)


def _bases(options, pair=False):
    """(a's, b's, out's) bases of an op's options (the schemas' spellings)."""
    out_base = options.get("out_base")
    return _call.lse_bases(_base_value(options.get("base", "e"), pair=pair),
                           None if out_base is None else _base_value(out_base, "out_base"), pair=pair)


def _out_kernel(op):
    """The out= overload's kernel: the call's Options from its keyword arguments, then the native road."""
    def kernel(*tensors, out, out_lse=None, output_scale=None, sink=None, group_scales=None, group_size=0,
               scale_ue8m0=False, block_format=None, scale_layout="row_major", scale_rounding="floor", sum_a=None,
               sum_b=None, valid=None, num_tokens=None, **kwargs):
        opt = _options(op, kwargs, _NAMES.get(), out=out, output_scale=output_scale, sink=sink,
                       group_scales=group_scales, group_size=group_size or None, scale_ue8m0=scale_ue8m0,
                       block_format=block_format, scale_layout=scale_layout, scale_rounding=scale_rounding,
                       sum_a=sum_a, sum_b=sum_b, valid=valid, num_tokens=num_tokens)
        _native.run(op, tensors, out, out_lse, opt)
    return kernel


def _merge_inplace(o, lse, o_other, lse_other, mask=None, sum_a=None, sum_b=None, valid=None, num_tokens=None,
                   **kwargs):
    _native.run(OPS["merge_inplace"], (o, lse, o_other, lse_other, mask), None, None,
                _options(OPS["merge_inplace"], kwargs, _NAMES.get(), sum_a=sum_a, sum_b=sum_b, valid=valid,
                         num_tokens=num_tokens))


def _merge_inplace_functional(o, lse, o_other, lse_other, mask=None, sum_a=None, sum_b=None, valid=None,
                              num_tokens=None, **kwargs):
    o, lse = o.clone(), lse.clone()  # the same strides as _RESULTS' empty_like: rows past the count keep o's
    _merge_inplace(o, lse, o_other, lse_other, mask, sum_a, sum_b, valid, num_tokens, **kwargs)
    return o, lse


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
                                 states_axis=states_axis)
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


_KERNELS = {"merge_inplace": _merge_inplace, "merge_inplace.functional": _merge_inplace_functional,
            "merge_backward": _merge_backward, "merge_states_backward": _merge_states_backward,
            "merge_varlen_backward": _merge_varlen_backward}
for _op in OPS.values():
    if _op.name != "merge_inplace":
        _KERNELS[f"{_op.name}.out"] = _out_kernel(_op)
        _KERNELS[_op.name] = _functional(_RESULTS[_op.name], _KERNELS[f"{_op.name}.out"], len(_op.inputs),
                                         ("output_scale", "sink") + _state_tensors(_op))


# ---- autograd -------------------------------------------------------------------------------------

def _register_autograd(lib):
    """The one place autograd attaches to the ops.  The functional merges (merge, merge_states,
    merge_varlen, merge_share) differentiate with respect to every O and LSE input and the sink
    through the backward ops, from the saved inputs and results (no recomputation).  The out= and
    in-place overloads, the in-place merge's functional form and the backward ops themselves refuse
    inputs that require grad by name, as PyTorch's own out= ops do: never a silently missing
    gradient.  Under torch.func's transforms the same formulas run as an autograd.Function
    (_FUNCTIONS), the form those transforms take."""
    for name in _SCHEMAS:
        if name in _AUTOGRAD:
            setup, backward = _AUTOGRAD[name]
            torch.library.register_autograd(f"{_NS}::{name}", backward, setup_context=setup, lib=lib)
        else:
            lib.impl(name, _refuse_grad(name), "Autograd", with_keyset=True)


_DIFFERENTIATING = (torch._C._functorch.TransformType.Grad, torch._C._functorch.TransformType.Jvp)


class _KeywordOnly:
    """An overload's keyword-only arguments, carried through autograd.Function.apply (which takes
    positional arguments) as one non-tensor argument."""

    def __init__(self, kwargs):
        self.kwargs = kwargs


def _function(name, setup, backward):
    """The functional overload `name` as an autograd.Function with a setup_context, its gradient
    the registered one (`setup`, `backward`): what torch.func's grad, vjp and jacrev take (they
    refuse the one torch.library generates), vmapped through the ops' own vmap rules."""
    op = _overload(name)

    def forward(*args):
        *args, keyword_only = args
        return op(*args, **keyword_only.kwargs)

    def setup_context(ctx, inputs, output):
        *args, keyword_only = inputs
        setup(ctx, tuple(args), keyword_only.kwargs, output)

    def backward_with_options(ctx, *grads):
        # Under a second differentiating transform the backward ops' results would be taken for
        # constants (a zero second derivative): refused, as autograd's double backward is.
        stack = torch._C._functorch.get_interpreter_stack() or ()
        if sum(i.key() in _DIFFERENTIATING for i in stack) > 1:
            raise NotImplementedError(f"{_NS}::{name}: no gradient of its gradient (attnmerge's backward ops are "
                                      f"not differentiable): take one torch.func.grad, vjp or jacrev of it")
        with torch.no_grad():  # the backward ops record nothing: no transform above differentiates them
            return (*backward(ctx, *grads), None)  # the keyword-only arguments: no gradient

    return type(f"attnmerge_{name}", (torch.autograd.Function,), {
        "forward": staticmethod(forward), "setup_context": staticmethod(setup_context),
        "backward": staticmethod(backward_with_options), "generate_vmap_rule": True})


# ---- vmap (torch.func.vmap, and jacrev's vmap over the backward) ---------------------------------
# A batch of calls is one call over the batch flattened into the tokens, where every per-example
# argument is token-major (O and LSE inputs, their gradients) and the others (sink, output_scale,
# a_tokens, indptr) are the same for every example; otherwise one call per example.


def _batch_first(x, bdim, size):
    """x with its batch axis first: moved there, or broadcast where x has none."""
    return x.movedim(bdim, 0) if bdim is not None else x.expand(size, *x.shape)


def _per_example(op, info, in_dims, args, kwargs):
    """op once per example, its results stacked (every result batched along 0)."""
    results = []
    for b in range(info.batch_size):
        one = [x if d is None or x is None else x.select(d, b) for x, d in zip(args, in_dims)]
        results.append(op(*one, **kwargs))
    if isinstance(results[0], torch.Tensor):
        return torch.stack(results), 0
    return tuple(torch.stack(r) for r in zip(*results)), (0,) * len(results[0])


def _live_position(op):
    """The position of an overload's positional num_tokens, or None where it has none."""
    names = [a.name for a in op._schema.arguments if not a.kwarg_only]
    return names.index("num_tokens") if "num_tokens" in names else None


def _vmap_rule(name, tokens_major, states=None):
    """The vmap rule of overload `name`: `tokens_major` the positional arguments laid out [tokens,
    ...] per example (flattened with the batch), every other tensor argument to be unbatched for one
    call; `states` (o's and lse's positions) where the op reads S at states_axis (moved to 1)."""
    op = _overload(name)

    # A live count applies to each example's tokens, not to the batch's flattened together.
    live = _live_position(op)

    def rule(info, in_dims, *args, **kwargs):
        size = info.batch_size
        others = [i for i, x in enumerate(args) if isinstance(x, torch.Tensor) and i not in tokens_major]
        counted = live is not None and live < len(args) and args[live] is not None
        if any(in_dims[i] is not None for i in others) or kwargs.get("a_tokens") is not None or counted:
            return _per_example(op, info, in_dims, args, kwargs)
        args = list(args)
        axis = _call.states_axis_of(kwargs.get("states_axis", 1), 3 if name == "merge_share" else 4) if states else 1
        tokens = None
        for i in tokens_major:
            x = args[i] if i < len(args) else None  # the dispatcher may drop trailing Nones
            if x is None:
                continue
            x = _batch_first(x, in_dims[i], size)
            if states and i in states and axis != 1:
                x = x.movedim(axis + 1, 2)  # S where the C ABI reads it, after the batch and tokens
            tokens = x.shape[1]
            args[i] = x.reshape(size * x.shape[1], *x.shape[2:])
        if states:
            kwargs = dict(kwargs, states_axis=1)
        results = op(*args, **kwargs)

        def unflatten(r, i):
            if r.numel() == 0 and r.dim() == 1:  # a gradient not asked for
                return r, None
            r = r.reshape(size, tokens, *r.shape[1:])
            if states and i in states and axis != 1:
                r = r.movedim(2, axis + 1)
            return r, 0

        if isinstance(results, torch.Tensor):
            return unflatten(results, None)
        pairs = [unflatten(r, states[j] if states and name.endswith("_backward") else None)
                 for j, r in enumerate(results)]
        return tuple(r for r, _ in pairs), tuple(d for _, d in pairs)

    return rule


# (overload, its token-major positional arguments, the positions of o and lse where S is read at
# states_axis); varlen's rows are not its states' tokens: one call per example.
_VMAP = (
    ("merge", (0, 1, 2, 3, 6, 7, 8), None),  # the sums and valid (6, 7, 8) token-major too
    ("merge_inplace.functional", (0, 1, 2, 3, 4, 5, 6, 7), None),
    ("merge_states", (0, 1, 4, 5), (0, 1, 4)),  # sum_a (4) laid out as lse; valid (5) [tokens, S]
    ("merge_share", (0, 1, 4, 5), (1, 4)),
    ("merge_varlen", (), None),
    ("merge_backward", (0, 1, 2, 3, 4, 5, 6, 7), None),
    ("merge_states_backward", (0, 1, 2, 3, 4, 5), (4, 5)),
    ("merge_varlen_backward", (), None),
)


def _inplace_vmap_rule(info, in_dims, o, lse, o_other, lse_other, mask=None, *states, **kwargs):
    """The in-place merge under vmap: each example merged into its own slice of o and lse (views,
    so the writes land in the batch); o and lse must be batched wherever anything is, as torch's
    own in-place ops require."""
    if in_dims[0] is None or in_dims[1] is None:
        raise ValueError("o, lse: expected batched tensors under vmap where o_other, lse_other or mask are "
                         "(the merge writes into o and lse)")
    op = _overload("merge_inplace")
    args = (o, lse, o_other, lse_other, mask, *states)
    for b in range(info.batch_size):
        op(*(x if d is None or x is None else x.select(d, b) for x, d in zip(args, in_dims)), **kwargs)
    return None, None


def _register_vmap(lib):
    for name, tokens_major, states in _VMAP:
        torch.library.register_vmap(f"{_NS}::{name}", _vmap_rule(name, tokens_major, states), lib=lib)
    torch.library.register_vmap(f"{_NS}::merge_inplace", _inplace_vmap_rule, lib=lib)


def _no_fp8_gradient(name, inputs, scale, out):
    """A gradient through a scaled or FP8 output is not defined here: refused when one is asked for."""
    if name_of(out.dtype) in NO_GRADIENT_DTYPES or scale is not None:
        if any(isinstance(x, torch.Tensor) and x.requires_grad for x in inputs):
            raise NotImplementedError(f"{_NS}::{name}: no gradient through an FP8 output or an output_scale; call it "
                                      f"under torch.no_grad() or on detached tensors")


def _setup(name, n_tensors):
    """Saves the op's `n_tensors` tensor inputs, its results and, after them, its sink, softmax sums
    and valid states (None where not given; output_scale, the sink, the sums, valid and num_tokens
    follow the tensor inputs)."""
    extras = len(_state_tensors(OPS[name]))  # the sink, the sums, valid (num_tokens: no gradient with one)

    def setup_context(ctx, inputs, keyword_only_inputs, output):
        out, out_lse = output
        scale = inputs[n_tensors] if len(inputs) > n_tensors else None
        given = tuple(inputs[n_tensors + 1:n_tensors + 1 + extras])
        given += (None,) * (extras - len(given))
        _no_fp8_gradient(name, (*inputs[:n_tensors], *given), scale, out)
        live = inputs[n_tensors + 1 + extras] if len(inputs) > n_tensors + 1 + extras else None
        if live is not None and any(isinstance(x, torch.Tensor) and x.requires_grad
                                    for x in (*inputs[:n_tensors], *given)):
            raise NotImplementedError(f"{_NS}::{name}: no gradient with num_tokens (the rows past the count hold "
                                      f"no result); call it under torch.no_grad() or on detached tensors")
        ctx.save_for_backward(*inputs[:n_tensors], out, out_lse, *given)
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


def _in_inputs_base(ctx, out_lse, grad_out_lse, pair=False):
    """(a's base, b's base, out_lse, its incoming gradient), the last two in a's base where out_base
    differs: the backward ops take one base, and a gradient through lse' = c lse is c dlse'."""
    a, b, out = _bases(ctx.options, pair)
    grad_out_lse = _incoming_lse(grad_out_lse)
    c = _call.base_change(a, out)
    if c != 1.0:
        out_lse = out_lse / c
        grad_out_lse = None if grad_out_lse is None else grad_out_lse * c
    return a, b, out_lse, grad_out_lse


def _valid_column(valid, column, lse):
    """A two-way merge's valid [tokens, 2] as a bool mask over the rows of one state's lse [rows,
    heads] (rows past the valid's tokens, never read, kept); None: every state holds keys."""
    if valid is None:
        return None
    v = (valid[:, column] != 0)[:, None]
    rows = lse.shape[0]
    if rows <= v.shape[0]:
        return v[:rows]
    return torch.cat([v, v.new_ones((rows - v.shape[0], 1))])


def _valid_states(valid, states_axis):
    """valid [tokens, S] as a bool mask over lse [tokens, S, heads] with S at `states_axis`."""
    return None if valid is None else (valid != 0)[:, :, None].movedim(1, states_axis)


def _needs(ctx, index):
    """Whether autograd asks for the gradient of input `index` (the dispatcher may drop trailing
    inputs that are None: those ask for none)."""
    return index < len(ctx.needs_input_grad) and ctx.needs_input_grad[index]


def _stats_grad(ctx, index, grad_lse, total, base):
    """The gradient of the softmax sums at input `index` where autograd asks for it, from that of
    their LSE (`grad_lse`, as the backward op gave it in the sums' base), else None."""
    if total is None or not _needs(ctx, index):
        return None
    return stats_gradient(torch, grad_lse, total, base)


def _merge_grad(ctx, grad_out, grad_out_lse):
    o_a, lse_a, o_b, lse_b, out, out_lse, sink, sum_a, sum_b, valid = ctx.saved_tensors
    asked = list(ctx.needs_input_grad[:4])
    needs = [asked[0], asked[1] or _needs(ctx, 6), asked[2], asked[3] or _needs(ctx, 7)]
    a, b, out_lse, grad_out_lse = _in_inputs_base(ctx, out_lse, grad_out_lse, pair=True)
    # The LSEs as the forward read them (softmax statistics, valid states), each in its own base.
    lse_a = stats_lse(torch, lse_a, sum_a, _valid_column(valid, 0, lse_a), a)
    lse_b = stats_lse(torch, lse_b, sum_b, _valid_column(valid, 1, lse_b), b)
    c_b = _call.base_change(b, a)  # lse_b in a's base, as the forward merged it
    grads = list(torch.ops.attnmerge.merge_backward(_incoming(grad_out, out), grad_out_lse, out, out_lse, o_a, lse_a,
                                                    o_b, lse_b * c_b if c_b != 1.0 else lse_b, needs=needs,
                                                    a_tokens=ctx.options.get("a_tokens"), base=_text(a)))
    if c_b != 1.0 and needs[3]:
        grads[3] = grads[3] * c_b
    # The states' gradients follow from out and out_lse, which count the sink (in a's base).
    return (*_grads_or_none(grads, asked), None,  # output_scale: none
            _sink_grad_of(ctx, 5, sink, out, out_lse, grad_out, grad_out_lse, a),
            _stats_grad(ctx, 6, grads[1], sum_a, a), _stats_grad(ctx, 7, grads[3], sum_b, b), None)  # valid: none


def _sink_grad_of(ctx, sink_index, sink, out, out_lse, grad_out, grad_out_lse, base):
    """The sink's gradient where autograd asks for it, else None (out_lse and its gradient in the
    inputs' base)."""
    if sink is None or not ctx.needs_input_grad[sink_index]:
        return None
    f32 = out_lse.dtype  # float32, or float64 for a float64 call
    return sink_gradient(torch, sink.to(f32), out.to(f32), out_lse, _incoming(grad_out, out).to(f32), grad_out_lse,
                         base).to(sink.dtype)


def _merge_states_grad(ctx, grad_out, grad_out_lse):
    o, lse, out, out_lse, sink, total, valid = ctx.saved_tensors
    asked = list(ctx.needs_input_grad[:2])
    needs = [asked[0], asked[1] or _needs(ctx, 4)]
    base, _, out_lse, grad_out_lse = _in_inputs_base(ctx, out_lse, grad_out_lse)
    axis = ctx.options.get("states_axis", 1)
    lse = stats_lse(torch, lse, total, _valid_states(valid, axis), base)  # as the forward read it
    grads = torch.ops.attnmerge.merge_states_backward(_incoming(grad_out, out), grad_out_lse, out, out_lse, o, lse,
                                                      needs=needs, states_axis=axis, base=_text(base))
    # The states' gradients follow from out and out_lse, which count the sink.
    return (*_grads_or_none(grads, asked), None,
            _sink_grad_of(ctx, 3, sink, out, out_lse, grad_out, grad_out_lse, base),
            _stats_grad(ctx, 4, grads[1], total, base), None)


def _merge_varlen_grad(ctx, grad_out, grad_out_lse):
    o, lse, indptr, out, out_lse, sink, total, valid = ctx.saved_tensors
    asked = list(ctx.needs_input_grad[:2])
    needs = [asked[0], asked[1] or _needs(ctx, 5)]
    base, _, out_lse, grad_out_lse = _in_inputs_base(ctx, out_lse, grad_out_lse)
    lse = stats_lse(torch, lse, total, None if valid is None else (valid != 0)[:, None], base)
    grads = torch.ops.attnmerge.merge_varlen_backward(_incoming(grad_out, out), grad_out_lse, out, out_lse, o, lse,
                                                      indptr, needs=needs, base=_text(base))
    return (*_grads_or_none(grads, asked), None, None,  # indptr, output_scale: none
            _sink_grad_of(ctx, 4, sink, out, out_lse, grad_out, grad_out_lse, base),
            _stats_grad(ctx, 5, grads[1], total, base), None)


def _merge_share_grad(ctx, grad_out, grad_out_lse):
    """merge_share's gradients in torch ops (_grad.share_gradient): elementwise work over the one
    O, dO and the LSEs, with no backward kernel of its own (a few passes where one would do)."""
    o, lse, out, out_lse, sink, total, valid = ctx.saved_tensors
    base, _, out_lse, grad_out_lse = _in_inputs_base(ctx, out_lse, grad_out_lse)
    axis = ctx.options.get("states_axis", 1)
    grad_o = grad_lse = grad_sum = None
    if any(ctx.needs_input_grad[:2]) or (total is not None and _needs(ctx, 4)):
        f32 = lse.dtype  # float32, or float64 for a float64 call
        lse = stats_lse(torch, lse, total, _valid_states(valid, axis), base)  # as the forward read it
        grad_o, grad_lse = share_gradient(torch, o.to(f32), lse, ctx.options["index"], out_lse,
                                          _incoming(grad_out, out).to(f32), grad_out_lse, base, axis)
        grad_sum = _stats_grad(ctx, 4, grad_lse, total, base)
        grad_o = grad_o.to(o.dtype) if ctx.needs_input_grad[0] else None
        grad_lse = grad_lse if ctx.needs_input_grad[1] else None
    return (grad_o, grad_lse, None, _sink_grad_of(ctx, 3, sink, out, out_lse, grad_out, grad_out_lse, base),
            grad_sum, None)


def _no_live_grad(grad):
    """A functional merge's gradients, and none for num_tokens (its last input)."""
    return lambda ctx, *grads: (*grad(ctx, *grads), None)


_AUTOGRAD = {
    "merge": (_setup("merge", 4), _no_live_grad(_merge_grad)),
    "merge_states": (_setup("merge_states", 2), _no_live_grad(_merge_states_grad)),
    "merge_varlen": (_setup("merge_varlen", 3), _no_live_grad(_merge_varlen_grad)),
    "merge_share": (_setup("merge_share", 2), _no_live_grad(_merge_share_grad)),
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
    _register_vmap(lib)
    return lib


_LIB = _register()  # kept alive: the registrations last as long as the Library object
_FUNCTIONS = {name: _function(name, *rules) for name, rules in _AUTOGRAD.items()}  # for torch.func


# ---- what the public functions call while tracing -------------------------------------------------

_compiling = torch.compiler.is_compiling
# Dynamo folds this to True while it traces and it is a bare `return False` in eager mode, where
# is_compiling() first asks torch.jit.is_scripting() (most of takes()' cost: benchmarks/NOTES.md#routing-check).
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


def _python_takes(*arrays):
    if _dynamo_compiling():  # as _c_takes' stand-in answers while Dynamo traces
        return True
    tensors = [x for x in arrays if isinstance(x, _Tensor)]
    if not tensors:
        return None  # no torch tensor: nothing to record or trace, and none a transform holds
    eager = len(arrays) >= 2 and type(arrays[0]) is _Tensor and type(arrays[1]) is _Tensor
    if not eager and any(type(x) is not _Tensor for x in tensors) and _compiling():
        return True
    return _autograd_records(*tensors)


def _c_takes():
    """_python_takes as one C call (_C.flag_reader with torch.compiler.is_compiling as `tracing`:
    asked where an array is a torch.Tensor subclass's and the first two are not exact tensors),
    registered with Dynamo with a Python stand-in that answers True while it traces (as
    is_dynamo_compiling() folds to there; Dynamo cannot trace a C function); None where
    torch.Tensor's flag or this torch does not allow it."""
    substitute = getattr(torch.compiler, "substitute_in_graph", None)
    if substitute is None:
        return None
    try:
        check = _C.flag_reader(_Tensor, "requires_grad", torch.is_grad_enabled, _compiling)

        @substitute(check, skip_signature_check=True)
        def _takes_while_tracing(*arrays):
            return True
    except (TypeError, ValueError, RuntimeError, AttributeError):
        return None
    return check


def _traceable_roads():
    """Dynamo cannot trace a C function: while it traces, the public functions' per-call paths and
    the road (attnmerge._C.caller's and attnmerge._C.road) are their Python readings, then the ops
    (the road a traced call takes).  Without substitute_in_graph (torch before 2.5) Dynamo breaks
    the graph at them and runs them eagerly."""
    substitute = getattr(torch.compiler, "substitute_in_graph", None)
    if substitute is None:
        return
    for call, op, read in _call.CALLERS:
        substitute(call, skip_signature_check=True)(lambda *args, op=op, read=read: run(op, *read(op, args)))
    substitute(_C.road, skip_signature_check=True)(lambda op, inputs, out, out_lse, opt:
                                                   run(op, inputs, out, out_lse, opt))


# takes(*arrays): whether a public call goes through torch.ops.attnmerge: while torch.compile or
# torch.export traces it, and when autograd would record it (any of the arrays, None allowed,
# requires grad): the op then differentiates it, or refuses it by name; None where no array is a
# torch tensor (NumPy's, CuPy's, JAX's: nothing is asked of them, and the road then does not ask
# `transforming` either).  Exact torch tensors, the per-call case, first and cheapest; a subclass
# asks torch.compiler.is_compiling() (torch.export's non-strict tracing passes FakeTensors).  One
# C call where this torch allows it.
takes = _c_takes() or _python_takes
# Whether a torch.func transform is active (its wrapped tensors export no data: only the ops, with
# their vmap rules and autograd, take them).
transforming = torch._C._are_functorch_transforms_active


def _no_stream(stream):
    if stream is not None:
        raise ValueError(f"stream: expected None when traced by torch.compile or torch.export (the op runs on "
                         f"torch's current stream; use torch.cuda.stream(...) to choose it), got {stream!r}")


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


def _heads_first(inputs, out_lse, opt):
    """A call whose LSEs (and their softmax sums) are laid out [heads, tokens] (the vLLM layer's
    flag) as the ops take them: [tokens, heads] views, through the strides."""
    lse = (1, 3) if len(inputs) >= 4 else (1,)
    inputs = tuple(x.T if i in lse else x for i, x in enumerate(inputs))
    sums = {k: getattr(opt, k).T for k in SUMS if getattr(opt, k) is not None}
    return (inputs, None if out_lse is None else out_lse.T,
            opt._replace(flags=opt.flags & ~_C.LSE_HEADS_FIRST, **sums))


def run(op, inputs, out, out_lse, opt: Options):
    """The torch road of a public call (attnmerge._roads): its functional overload when no output is
    given (the one autograd attaches to), else the out= overload, any missing output allocated as
    the native road allocates it; the caller's names reach the kernels."""
    _no_stream(opt.stream)
    if opt.a_tokens_tensor is not None:
        raise ValueError("a_tokens: expected None or an int where torch.compile, torch.export, torch.func or "
                         "autograd takes the call (torch.ops.attnmerge takes a_tokens as an int), got a tensor")
    if opt.flags & _C.LSE_HEADS_FIRST:
        inputs, out_lse, opt = _heads_first(inputs, out_lse, opt)
    kwargs = {name: value(opt) for name, _, value in _keywords(op)}
    packet = getattr(torch.ops.attnmerge, op.name)
    states = tuple(getattr(opt, name) for name in _state_tensors(op))  # the sums, valid
    with _names_for_kernels(opt.names):
        if op.name == "merge_inplace":
            packet.default(*inputs, *states, **kwargs)
            return inputs[0], inputs[1]
        like = inputs[op.like]
        scale = opt.scale if opt.scale is not None or not opt.output_scale else torch.full(
            (1,), opt.output_scale, dtype=torch.float32, device=like.device)
        if out is None and out_lse is None and not opt.group_size and opt.group_scales is None:
            out_dtype = None if opt.out_dtype is None else getattr(torch, opt.out_dtype)
            if transforming() and not _compiling():  # torch.func: the op as an autograd.Function
                res, res_lse = _FUNCTIONS[op.name].apply(*inputs, scale, opt.sink, *states,
                                                          _KeywordOnly(dict(kwargs, out_dtype=out_dtype)))
            else:
                res, res_lse = packet.default(*inputs, scale, opt.sink, *states, out_dtype=out_dtype, **kwargs)
            return res, (res_lse if opt.return_lse else None)
        out, out_lse, opt = _native.allocate(op, inputs, out, out_lse, opt)
        fmt = opt.block_format
        groups = {} if opt.group_scales is None else dict(
            group_scales=opt.group_scales, group_size=0 if fmt else opt.group_size, scale_ue8m0=opt.scale_ue8m0,
            **({} if fmt is None else dict(block_format=fmt, scale_layout=opt.scale_layout,
                                           scale_rounding=opt.scale_rounding)))
        packet.out(*inputs, out=out, out_lse=out_lse, output_scale=scale, sink=opt.sink,
                   **dict(zip(_state_tensors(op), states)), **groups, **kwargs)
        return _native.results(out, out_lse, opt)


_traceable_roads()
