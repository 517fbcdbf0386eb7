"""The native API: merge, merge_inplace, merge_states, merge_varlen, merge_share."""
from __future__ import annotations

import math
import operator
from collections.abc import Mapping

from . import _C
from ._arrays import dtype_name, empty, family
from ._types import O_IN_DTYPES, Array, Base, DType, PairBase, Stream

# attnmerge._torch_ops and its `takes` once torch is imported (attnmerge._torch_hook sets them).  Each
# function first asks whether the call must go through torch.ops.attnmerge (while torch.compile or
# torch.export traces, or when autograd would record it); every other call keeps the direct path.
_torch_ops = None
_takes = None


def _is_base2(base, name: str, expected: str = "'e' or 2") -> bool:
    """Whether an LSE base is 2: 'e' (natural log) or 2 (log2-sum-exp2); else a ValueError naming `name`."""
    if isinstance(base, str) and base == "e":
        return False
    if not isinstance(base, (bool, str, tuple)) and base == 2:
        return True
    raise ValueError(f"{name}: expected {expected}, got {base!r}")


def lse_bases(base: PairBase, out_base: Base | None = None, *, pair: bool = False,
              names: Mapping[str, str] | None = None) -> tuple[Base, Base, Base]:
    """The LSE bases of a call, checked, as ('e' or 2) for (a, b, out): `base` every input LSE's, or
    for the two-way and in-place merges (pair) a pair (a's, b's); out_base the merged LSE's (None:
    a's).  The one reading of base and out_base: the flags, the frameworks' gradients and the
    JAX attributes all ask it."""
    name = _named(names, "base")
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
    out = a if out_base is None else (2 if _is_base2(out_base, _named(names, "out_base"), "None, 'e' or 2") else "e")
    return a, b, out


def lse_flags(base: PairBase, out_base: Base | None = None, *, pair: bool = False,
              names: Mapping[str, str] | None = None) -> int:
    """C ABI flags for the LSE bases (lse_bases): ATTNMERGE_LSE_BASE2 for a's, and b's and the
    merged LSE's own flags where they differ from a's."""
    a, b, out = lse_bases(base, out_base, pair=pair, names=names)
    flags = _C.LSE_BASE2 if a == 2 else 0
    if b != a:
        flags |= _C.LSE_B_BASE2 if b == 2 else _C.LSE_B_BASE_E
    if out != a:
        flags |= _C.OUT_LSE_BASE2 if out == 2 else _C.OUT_LSE_BASE_E
    return flags


def base_change(from_base: Base, to_base: Base) -> float:
    """The factor that turns an LSE of base `from_base` into one of `to_base` (1 where they agree)."""
    return 1.0 if from_base == to_base else math.log(2.0) if from_base == 2 else 1.0 / math.log(2.0)


def a_tokens_arg(a_tokens: int | None, name: str = "a_tokens") -> int:
    if a_tokens is None:
        return -1
    if not isinstance(a_tokens, int) or isinstance(a_tokens, bool) or a_tokens < 0:
        raise ValueError(f"{name}: expected None or an int >= 0, got {a_tokens!r}")
    return a_tokens


def output_scale_arg(output_scale):
    """output_scale as every layer below takes it: None (no scale), an array (read on the device), or
    a number, which is a scale.  The C ABI spells "no scale" 0 and Python None, so a number 0 is
    refused here, for every path (the binding, the JAX road, torch.ops, attnmerge.jax, the vLLM
    layer); the C ABI checks the rest (a finite scale > 0; outputs other than FP8 take none, or 1)."""
    if isinstance(output_scale, (int, float)) and not isinstance(output_scale, bool) and output_scale == 0:
        raise ValueError(f"output_scale: expected None or a finite scale > 0, got {output_scale!r}")
    return output_scale


def groups_arg(group_size, scale_ue8m0, out, out_dtype, names=None):
    """A call's per-group FP8 arguments as the layers below take them: (out_dtype, group_size, flags),
    out_dtype defaulting to float8_e4m3fn where group_size is given and no out, group_size 0 and
    flags 0 where it is None.  An int >= 1 or None here (the C ABI checks the rest: a power of two
    >= 8 dividing head_size, ...), so that the scales can be allocated; scale_ue8m0 only with it."""
    if group_size is None:
        if scale_ue8m0:
            raise ValueError(f"{_named(names, 'scale_ue8m0')}: expected False without group_size, got "
                             f"{scale_ue8m0!r}")
        return out_dtype, 0, 0
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 1:
        raise ValueError(f"{_named(names, 'group_size')}: expected None or a power of two >= 8, got {group_size!r}")
    if out is None and out_dtype is None:
        out_dtype = "float8_e4m3fn"
    return out_dtype, group_size, _C.GROUP_SCALE_UE8M0 if scale_ue8m0 else 0


def group_scales_like(out, group_scales, group_size, names=None):
    """The per-group scales as given, or allocated like out: float32 [tokens, heads, head_size //
    group_size] (a group_size that does not divide head_size is the C ABI's to refuse)."""
    if group_scales is not None:
        return group_scales
    shape = _shape(out, "out", names)
    return empty(out, tuple(shape[:2]) + (shape[2] // group_size,), "float32", _named(names, "out"))


def _results(out, out_lse, group_scales, group_size):
    """A merge's results: (out, out_lse), and the group scales where group_size was given."""
    return (out, out_lse) if group_size is None else (out, out_lse, group_scales)


def _jax_results(results, return_lse):
    """attnmerge.jax's results as the native functions return them: out_lse None unless return_lse."""
    return (results[0], results[1] if return_lse else None, *results[2:])


def _named(names, arg):
    """The caller's name of the argument `arg`: a compat layer's (`names`, {native: its own}), else
    `arg`.  Every message names arguments through it, so that a compat layer's caller reads its own
    names (vLLM's prefix_output for o_a)."""
    return arg if names is None else names.get(arg, arg)


def _shape(x, arg, names=None):
    shape = getattr(x, "shape", None)
    if shape is None:
        raise TypeError(f"{_named(names, arg)}: expected an array, got {type(x).__qualname__}")
    return tuple(shape)


_IS_JAX: dict[type, bool] = {}  # type -> whether it is JAX's (an array or a tracer), looked up every call


def _is_jax(x):
    """Whether x is a JAX array or tracer, by its type.  JAX arrays are immutable: never written,
    and results allocated like one come from attnmerge.jax (_jax_road)."""
    try:
        return _IS_JAX[type(x)]
    except KeyError:
        jax = family(x) == "jax"
        if len(_IS_JAX) < 256:
            _IS_JAX[type(x)] = jax
        return jax


def _any_jax(a, b):
    """_is_jax(a) or _is_jax(b), in one call where both types were seen before (the per-call case)."""
    try:
        return _IS_JAX[type(a)] or _IS_JAX[type(b)]
    except KeyError:
        return _is_jax(a) or _is_jax(b)


def _refuse_jax(arg, op, hint):
    """A JAX array handed over to be written: refused, pointing to attnmerge.jax's functional form."""
    raise ValueError(f"{arg}: expected a writable array, got a JAX array (immutable); JAX arrays are merged by "
                     f"attnmerge.jax.{op}, which returns new ones ({hint})")


def _refuse_jax_outputs(out, out_lse, op, names):
    out_name, lse_name = _named(names, "out"), _named(names, "out_lse")
    _refuse_jax(out_name if _is_jax(out) else lse_name, op, f"leave {out_name}=None and {lse_name}=None")


def _jax_road(op, out_lse, stream, names, group_scales=None):
    """attnmerge.jax's `op`: the road of a call whose results would be allocated like a JAX array.
    Its results are new JAX arrays on XLA's buffers and stream, so nothing may be handed over to be
    written (out_lse, group_scales) and no stream chosen."""
    for name, given in (("out_lse", out_lse), ("group_scales", group_scales)):
        if given is not None:
            arg = _named(names, name)
            raise ValueError(f"{arg}: expected None, got {type(given).__qualname__}: results allocated like a JAX "
                             f"array come from attnmerge.jax.{op}, which returns new ones (leave {arg}=None)")
    if stream is not None:
        raise ValueError(f"stream: expected None for JAX arrays (attnmerge.jax runs on the stream XLA gives the "
                         f"call), got {stream!r}")
    try:
        from . import jax as attnmerge_jax
    except ImportError as e:
        raise ImportError(f"attnmerge.{op} on JAX arrays runs attnmerge.jax, which is not available: {e}") from e
    return getattr(attnmerge_jax, op)


def states_shape(o, states_axis, names=None):
    """The [tokens, heads, head_size] of merge_states' result for stacked states o."""
    s = _shape(o, "o", names)
    if len(s) != 4:
        raise ValueError(f"{_named(names, 'o')}: expected 4 dimensions, got {len(s)} (shape {list(s)})")
    return (s[1 - states_axis], s[2], s[3])


def varlen_shape(o, indptr, names=None):
    """The [rows, heads, head_size] of merge_varlen's result for o [total, heads, head_size]."""
    s, n = _shape(o, "o", names), _shape(indptr, "indptr", names)
    if len(s) != 3:
        raise ValueError(f"{_named(names, 'o')}: expected 3 dimensions, got {len(s)} (shape {list(s)})")
    if len(n) != 1 or n[0] < 1:
        raise ValueError(f"{_named(names, 'indptr')}: expected shape [rows + 1] with rows >= 0, got {list(n)}")
    return (n[0] - 1, s[1], s[2])


def _result_dtype(out_dtype, in_dtype_of, src_name, names):
    """The dtype name of a merge's O result: out_dtype, else that of `in_dtype_of` (the input
    `src_name`)."""
    if out_dtype is not None:
        return dtype_name(out_dtype, _named(names, "out_dtype"))
    src_name = src_name if names is None else names.get(src_name, src_name)  # not _named: every allocating call
    dtype = getattr(in_dtype_of, "dtype", None)
    if dtype is None:
        raise TypeError(f"{src_name}: expected an array, got {type(in_dtype_of).__qualname__}")
    return dtype_name(dtype, src_name, O_IN_DTYPES)


def _outputs(like, in_dtype_of, shape, out, out_lse, return_lse, out_dtype, like_name="o_b", src_name="o_a",
             names=None):
    """(out, out_lse): given outputs as they are, missing ones allocated in the library of `like`
    (the argument `like_name`) with `shape` ([tokens, heads, head_size]) and the dtype of
    `in_dtype_of` (`src_name`) or out_dtype."""
    if out is not None and out_lse is not None and out_dtype is None:
        return out, out_lse  # nothing to allocate (the public functions do not call for it)
    if out is not None and out_dtype is not None:
        out_name, dtype_arg = _named(names, "out"), _named(names, "out_dtype")
        want, got = dtype_name(out_dtype, dtype_arg), dtype_name(getattr(out, "dtype", None), out_name)
        if want != got:
            raise ValueError(f"{dtype_arg}: expected None or the dtype of {out_name} ({got}), got {want}")
    if out is not None:  # a missing out_lse goes where out is, not where an odd input may be
        like, like_name = out, "out"
    if names is not None:
        like_name = names.get(like_name, like_name)
    if out is None:
        out = empty(like, shape, _result_dtype(out_dtype, in_dtype_of, src_name, names), like_name)
    if out_lse is None and return_lse:
        out_lse = empty(like, shape[:2], "float32", like_name)
    return out, out_lse


def merge(o_a: Array, lse_a: Array, o_b: Array, lse_b: Array, *, out: Array | None = None,
          out_lse: Array | None = None, return_lse: bool = True, out_dtype: DType | None = None,
          output_scale: float | Array | None = None, base: PairBase = "e", out_base: Base | None = None,
          a_tokens: int | None = None, sink: Array | None = None, group_size: int | None = None,
          group_scales: Array | None = None, scale_ue8m0: bool = False, stream: Stream = None, pdl: bool = False,
          _names: Mapping[str, str] | None = None) -> tuple[Array, ...]:
    """Merge two attention states: (out, out_lse) = merge((o_a, lse_a), (o_b, lse_b)).

    o_a, o_b: [tokens, heads, head_size], float32, float16 or bfloat16 (one dtype for both).
    lse_a, lse_b: float32 [tokens, heads], natural log (base="e") or base 2 (base=2), or each its
        own (base=(a's, b's): FlashInfer's base-2 state with FlashAttention's natural one, say);
        any strides, so a [heads, tokens] buffer is passed as its transpose (`lse.T`).
    out: [tokens, heads, head_size] in any of the three dtypes or float8_e4m3fn; allocated in the
        caller's array library when None, with dtype `out_dtype` (default: that of o_a).
    out_lse: float32 [tokens, heads], in base out_base (None: lse_a's); allocated when None and
        return_lse.  Mixed bases are converted in float32 (b's LSE into a's base before the merge,
        the merged LSE after it): one rounding each, no launch of their own.
    output_scale: FP8 outputs store value / output_scale (saturating to +-448): None (no scale), a
        finite number > 0, or a one-element float32 array on the arrays' device, read by the kernel
        (no host round trip).  Other outputs take none (1 is accepted: it changes nothing).
    a_tokens: only the first a_tokens tokens merge a with b; later rows take b alone and a needs
        only a_tokens tokens (vLLM's prefill_tokens_with_context).
    sink: attention sinks (gpt-oss), as for merge_states(): None, or float32 [heads], each head's
        sink logit in lse_a's base, one more state of output 0 in every row of its head (cascade
        attention's shared prefix and unique suffix, with the sink added once, here).
    group_size, group_scales, scale_ue8m0: per-group FP8 (DeepSeek-V3's 1 x 128 blocks, vLLM's
        per_token_group_quant_fp8): each group of group_size consecutive elements of a row gets
        scale = max(amax, 1e-10) / 448 (amax: the group's largest |value|, NaN left out; rounded
        up to a power of two with scale_ue8m0), written to group_scales (float32 [tokens, heads,
        head_size // group_size], any strides; allocated like out when None), and out =
        value * (1 / scale) in FP8 E4M3 (out_dtype defaults to float8_e4m3fn).  group_size: a
        power of two >= 8 dividing head_size, at most 32 x the vector the O arrays' alignment
        allows (128 for aligned float32 inputs, 256 for 16-bit ones).  With group_size the call
        returns (out, out_lse, group_scales).  Not with output_scale.
    stream: None (the current stream of the arrays' framework, else the legacy default stream), an
        int cudaStream_t, or an object with .cuda_stream or .ptr.  Ignored for host arrays.
    pdl: programmatic dependent launch (sm_90 and newer, else ignored): the kernel is scheduled
        while the previous kernel on the stream finishes and waits for it before reading; the
        same results, less latency between dependent kernels.

    Every array may have any strides >= 0, except that head_size is unit-stride.  Host arrays run
    on the CPU; CUDA arrays on the GPU they live on, asynchronously on `stream`.  Returns (out,
    out_lse); out_lse is None when return_lse is False and no out_lse was given.

    JAX arrays are immutable, so they are never written: given as out or out_lse they are refused,
    and a call whose results would be allocated like one (out=None and o_b a JAX array or tracer) is
    attnmerge.jax.merge's, which returns new JAX arrays on the stream XLA gives it (out_lse and
    stream then stay None; pdl does not apply; errors found when the call runs come back as XLA's).
    The same in the functions below.

    _names (attnmerge's own layers): {argument: the caller's name for it}, which every message then
    uses (attnmerge.compat passes vLLM's, FlashInfer's and SGLang's names).  The same in the functions below.
    """
    if _takes is not None and (_takes(o_a, lse_a, o_b, lse_b) or (sink is not None and _takes(sink, None, None, None))):
        return _torch_ops.merge(o_a, lse_a, o_b, lse_b, out, out_lse, return_lse, out_dtype, output_scale, base,
                                out_base, a_tokens, stream, pdl, _names, (group_size, group_scales, scale_ue8m0), sink)
    flags = (0 if base == "e" and out_base is None else lse_flags(base, out_base, pair=True, names=_names)) | (
        _C.PDL if pdl else 0)
    group = 0
    if group_size is not None or scale_ue8m0:
        out_dtype, group, group_flags = groups_arg(group_size, scale_ue8m0, out, out_dtype, _names)
        flags |= group_flags
    a_tok = -1 if a_tokens is None else a_tokens_arg(a_tokens, _named(_names, "a_tokens"))
    if _any_jax(out, out_lse):
        _refuse_jax_outputs(out, out_lse, "merge", _names)
    if out is None and _is_jax(o_b):
        return _jax_results(_jax_road("merge", out_lse, stream, _names, group_scales)(
            o_a, lse_a, o_b, lse_b, base=base, out_base=out_base,
            out_dtype=_result_dtype(out_dtype, o_a, "o_a", _names), a_tokens=a_tokens,
            output_scale=output_scale_arg(output_scale), sink=sink, group_size=group_size, scale_ue8m0=scale_ue8m0),
            return_lse)
    if out is None or out_lse is None or out_dtype is not None:  # else nothing to allocate or check
        shape = _shape(o_b, "o_b", _names) if out is None or (out_lse is None and return_lse) else None
        out, out_lse = _outputs(o_b, o_a, shape, out, out_lse, return_lse, out_dtype, names=_names)
    if output_scale is not None:
        output_scale = output_scale_arg(output_scale)
    if group:
        group_scales = group_scales_like(out, group_scales, group, _names)
    _C.merge(out, out_lse, o_a, lse_a, o_b, lse_b, flags, a_tok, output_scale, stream, _names, group_scales, group,
             sink)
    return _results(out, out_lse, group_scales, group_size)


def merge_inplace(o: Array, lse: Array, o_other: Array, lse_other: Array, *, mask: Array | None = None,
                  base: PairBase = "e", stream: Stream = None, pdl: bool = False,
                  _names: Mapping[str, str] | None = None) -> tuple[Array, Array]:
    """(o, lse) <- merge((o, lse), (o_other, lse_other)), in place.

    o, o_other: [tokens, heads, head_size], float32, float16 or bfloat16 (one dtype).
    lse, lse_other: float32 [tokens, heads] in base e (or base=2), or each its own (base=(lse's,
        lse_other's)); the merged LSE replaces lse in lse's base.
    mask: None, or uint8 / bool [tokens]: rows of tokens whose mask is 0 are left untouched.
    stream, pdl: as for merge().  Returns (o, lse).
    """
    if _takes is not None and _takes(o, lse, o_other, lse_other):
        return _torch_ops.merge_inplace(o, lse, o_other, lse_other, mask, base, stream, pdl, _names)
    if _any_jax(o, lse):
        _refuse_jax(_named(_names, "o" if _is_jax(o) else "lse"), "merge",
                    "o, lse = attnmerge.merge(o, lse, o_other, lse_other); a mask is a jnp.where")
    flags = lse_flags(base, pair=True, names=_names) | (_C.PDL if pdl else 0)
    _C.merge_inplace(o, lse, o_other, lse_other, mask, flags, stream, _names)
    return o, lse


def merge_states(o: Array, lse: Array, *, out: Array | None = None, out_lse: Array | None = None,
                 return_lse: bool = True, out_dtype: DType | None = None, output_scale: float | Array | None = None,
                 base: Base = "e", out_base: Base | None = None, states_axis: int = 1, sink: Array | None = None,
                 group_size: int | None = None, group_scales: Array | None = None, scale_ue8m0: bool = False,
                 stream: Stream = None, pdl: bool = False,
                 _names: Mapping[str, str] | None = None) -> tuple[Array, ...]:
    """Merge S states in one pass, each input read once.

    states_axis=1: o [tokens, S, heads, head_size], lse float32 [tokens, S, heads] (FlashInfer's).
    states_axis=0: o [S, tokens, heads, head_size], lse [S, tokens, heads] (what an all-gather of
        per-rank states produces), read through its strides: no copy.
    sink: attention sinks (gpt-oss): None, or float32 [heads], each head's sink logit in the LSE's
        base, merged into every row of its head as one more state whose output is 0 (the merged
        LSE counts it; a row with no states gets O = 0 and LSE = sink).  Add it in one merge only.
    out [tokens, heads, head_size], out_lse [tokens, heads], out_base, group_size, group_scales,
    scale_ue8m0, stream, pdl: as for merge() (out_lse in the states' base unless out_base says).
    S = 0 gives O = 0 and LSE = -inf (the sink, with one).  Returns (out, out_lse), and the group
    scales with group_size.
    """
    if states_axis not in (0, 1) or isinstance(states_axis, bool):
        raise ValueError(f"states_axis: expected 0 or 1, got {states_axis!r}")
    if _takes is not None and _takes(o, lse, sink, None):
        return _torch_ops.merge_states(o, lse, out, out_lse, return_lse, out_dtype, output_scale, base, out_base,
                                       states_axis, sink, stream, pdl, _names, (group_size, group_scales, scale_ue8m0))
    flags = lse_flags(base, out_base, names=_names) | (_C.PDL if pdl else 0)
    out_dtype, group, group_flags = groups_arg(group_size, scale_ue8m0, out, out_dtype, _names)
    flags |= group_flags
    if _any_jax(out, out_lse):
        _refuse_jax_outputs(out, out_lse, "merge_states", _names)
    if out is None and _is_jax(o):
        return _jax_results(_jax_road("merge_states", out_lse, stream, _names, group_scales)(
            o, lse, base=base, out_base=out_base, out_dtype=_result_dtype(out_dtype, o, "o", _names),
            output_scale=output_scale_arg(output_scale), states_axis=states_axis, sink=sink, group_size=group_size,
            scale_ue8m0=scale_ue8m0), return_lse)
    if out is None or out_lse is None or out_dtype is not None:  # else nothing to allocate or check
        shape = states_shape(o, states_axis, _names) if out is None or (out_lse is None and return_lse) else None
        out, out_lse = _outputs(o, o, shape, out, out_lse, return_lse, out_dtype, "o", "o", _names)
    if output_scale is not None:
        output_scale = output_scale_arg(output_scale)
    if group:
        group_scales = group_scales_like(out, group_scales, group, _names)
    _C.merge_states(out, out_lse, o, lse, flags, states_axis == 0, output_scale, sink, stream, _names, group_scales,
                    group)
    return _results(out, out_lse, group_scales, group_size)


def merge_varlen(o: Array, lse: Array, indptr: Array, *, out: Array | None = None, out_lse: Array | None = None,
                 return_lse: bool = True, out_dtype: DType | None = None, output_scale: float | Array | None = None,
                 base: Base = "e", out_base: Base | None = None, sink: Array | None = None,
                 group_size: int | None = None, group_scales: Array | None = None, scale_ue8m0: bool = False,
                 stream: Stream = None, pdl: bool = False,
                 _names: Mapping[str, str] | None = None) -> tuple[Array, ...]:
    """Row r of the result merges states indptr[r] .. indptr[r+1]-1 of o.

    o: [total, heads, head_size], lse: float32 [total, heads]; indptr: int32 or int64 [rows + 1];
    sink: None or float32 [heads], as for merge_states().
    out [rows, heads, head_size], out_lse [rows, heads], out_base, group_size, group_scales (float32
    [rows, heads, head_size // group_size]), scale_ue8m0, stream, pdl: as for merge().  A row with no
    states gets O = 0 and LSE = -inf (the sink, with one).  On the CPU a bad indptr raises
    ValueError; on the GPU it is never read back to the host, and each row takes states
    [clamp(indptr[r], 0, total), clamp(indptr[r+1], that, total)): no out-of-bounds access, and a
    row whose bounds cross is empty.
    Returns (out, out_lse).
    """
    if _takes is not None and _takes(o, lse, sink, None):
        return _torch_ops.merge_varlen(o, lse, indptr, out, out_lse, return_lse, out_dtype, output_scale, base,
                                       out_base, sink, stream, pdl, _names, (group_size, group_scales, scale_ue8m0))
    flags = lse_flags(base, out_base, names=_names) | (_C.PDL if pdl else 0)
    out_dtype, group, group_flags = groups_arg(group_size, scale_ue8m0, out, out_dtype, _names)
    flags |= group_flags
    if _any_jax(out, out_lse):
        _refuse_jax_outputs(out, out_lse, "merge_varlen", _names)
    if out is None and _is_jax(o):
        return _jax_results(_jax_road("merge_varlen", out_lse, stream, _names, group_scales)(
            o, lse, indptr, base=base, out_base=out_base, out_dtype=_result_dtype(out_dtype, o, "o", _names),
            output_scale=output_scale_arg(output_scale), sink=sink, group_size=group_size, scale_ue8m0=scale_ue8m0),
            return_lse)
    if out is None or out_lse is None or out_dtype is not None:  # else nothing to allocate or check
        shape = varlen_shape(o, indptr, _names) if out is None or (out_lse is None and return_lse) else None
        out, out_lse = _outputs(o, o, shape, out, out_lse, return_lse, out_dtype, "o", "o", _names)
    if output_scale is not None:
        output_scale = output_scale_arg(output_scale)
    if group:
        group_scales = group_scales_like(out, group_scales, group, _names)
    _C.merge_varlen(out, out_lse, o, lse, indptr, flags, output_scale, sink, stream, _names, group_scales, group)
    return _results(out, out_lse, group_scales, group_size)


def index_arg(index, names=None):
    """merge_share's index as an int (any integer, NumPy's too; not a bool): the C ABI checks its range."""
    if not isinstance(index, bool):
        try:
            return operator.index(index)
        except TypeError:
            pass
    raise TypeError(f"{_named(names, 'index')}: expected an int, got {index!r} ({type(index).__qualname__})")


def share_shape(o, names=None):
    """The [tokens, heads, head_size] of merge_share's result: that of o."""
    s = _shape(o, "o", names)
    if len(s) != 3:
        raise ValueError(f"{_named(names, 'o')}: expected 3 dimensions, got {len(s)} (shape {list(s)})")
    return s


def merge_share(o: Array, lse: Array, index: int, *, out: Array | None = None, out_lse: Array | None = None,
                return_lse: bool = True, out_dtype: DType | None = None, output_scale: float | Array | None = None,
                base: Base = "e", out_base: Base | None = None, states_axis: int = 1, sink: Array | None = None,
                group_size: int | None = None, group_scales: Array | None = None, scale_ue8m0: bool = False,
                stream: Stream = None, pdl: bool = False,
                _names: Mapping[str, str] | None = None) -> tuple[Array, ...]:
    """The share of state `index` in the merge of S states, for context parallelism's combine by
    reduce-scatter: out = (w_index / W) * o and out_lse = the merged LSE, so that the S states'
    shares summed are merge_states of them.  Each rank all-gathers the LSEs (not the outputs),
    scales its own output, and a reduce-scatter (or all-reduce) sums the shares.

    o: state `index`'s O [tokens, heads, head_size] (the other states' O are not needed).
    lse: every state's LSE, float32 [tokens, S, heads] (states_axis=1) or [S, tokens, heads]
        (states_axis=0: an all-gather's, read through its strides); index: 0 <= index < S.
    sink: None or float32 [heads], as for merge_states(); every rank's share takes the same sink.
    out [tokens, heads, head_size] (may be o itself), out_lse [tokens, heads], out_dtype,
    output_scale, out_base, group_size, group_scales, scale_ue8m0, stream, pdl: as for merge() (each
    share quantized on its own: summed shares are not the merge's FP8 groups).  A state of zero
    weight gets a share of 0 (its O is not read), an all-empty row O = 0 and LSE = -inf, a NaN LSE
    a NaN row.  Returns (out, out_lse), and the group scales with group_size.
    """
    if states_axis not in (0, 1) or isinstance(states_axis, bool):
        raise ValueError(f"states_axis: expected 0 or 1, got {states_axis!r}")
    index = index_arg(index, _names)
    if _takes is not None and _takes(o, lse, sink, None):
        return _torch_ops.merge_share(o, lse, index, out, out_lse, return_lse, out_dtype, output_scale, base,
                                      out_base, states_axis, sink, stream, pdl, _names,
                                      (group_size, group_scales, scale_ue8m0))
    flags = lse_flags(base, out_base, names=_names) | (_C.PDL if pdl else 0)
    out_dtype, group, group_flags = groups_arg(group_size, scale_ue8m0, out, out_dtype, _names)
    flags |= group_flags
    if _any_jax(out, out_lse):
        _refuse_jax_outputs(out, out_lse, "merge_share", _names)
    if out is None and _is_jax(o):
        return _jax_results(_jax_road("merge_share", out_lse, stream, _names, group_scales)(
            o, lse, index, base=base, out_base=out_base, out_dtype=_result_dtype(out_dtype, o, "o", _names),
            output_scale=output_scale_arg(output_scale), states_axis=states_axis, sink=sink, group_size=group_size,
            scale_ue8m0=scale_ue8m0), return_lse)
    if out is None or out_lse is None or out_dtype is not None:  # else nothing to allocate or check
        shape = share_shape(o, _names) if out is None or (out_lse is None and return_lse) else None
        out, out_lse = _outputs(o, o, shape, out, out_lse, return_lse, out_dtype, "o", "o", _names)
    if output_scale is not None:
        output_scale = output_scale_arg(output_scale)
    if group:
        group_scales = group_scales_like(out, group_scales, group, _names)
    _C.merge_share(out, out_lse, o, lse, index, flags, states_axis == 0, output_scale, sink, stream, _names,
                   group_scales, group)
    return _results(out, out_lse, group_scales, group_size)


# --------------------------------------------------------------------------------------------------
# The backward: the gradients of a merge's inputs from those of its outputs (issue 16).


def sink_gradient(xp, sink, out, out_lse, grad_out, grad_out_lse, base):
    """The gradient of a merge's sinks [heads], in the array namespace `xp` (torch or jax.numpy: the
    frameworks that differentiate the merges), every array float32 (the caller's to convert).  The
    sink is a state whose O is 0, so per row b^(sink - LSE) (dLSE - ln(b) <dO, O>), summed over the
    rows of each head; zero where the sink is empty (+-inf) or of no weight, whatever dO holds.
    out [rows, heads, head_size], out_lse [rows, heads]: the forward's results; grad_out_lse may be
    None (0); base "e", 2 or "2".  The states' gradients need nothing of the sink: out and out_lse
    count it."""
    ln_b = math.log(2.0) if base in (2, "2") else 1.0
    p = xp.exp((sink - out_lse) * ln_b)
    p = xp.where(xp.isinf(sink), xp.zeros_like(p), p)
    row = -ln_b * (grad_out * out).sum(-1)
    if grad_out_lse is not None:
        row = row + grad_out_lse
    return xp.where(p != 0, p * row, xp.zeros_like(p)).sum(0)


def share_gradient(xp, o, lse, index, out_lse, grad_out, grad_out_lse, base, states_axis):
    """The gradients (of o, of lse) of merge_share, in the array namespace `xp` (torch or jax.numpy),
    every array float32 (the caller's to convert).  With p_i = b^(lse_i - LSE) and g = ln(b) p_index
    <dO, o> a row: do = p_index dO, dlse_i = p_i (dLSE - g), plus g for i = index; zero for a state
    of no weight (an empty one, or any of an all-empty row), whatever dO and its O hold.  o and lse
    as the forward took them (lse [tokens, S, heads], or [S, tokens, heads] with states_axis 0),
    out_lse [tokens, heads]: the forward's merged LSE; grad_out_lse may be None (0); base "e", 2 or
    "2".  A sink's gradient is sink_gradient's, of the forward's out and out_lse."""
    ln_b = math.log(2.0) if base in (2, "2") else 1.0
    along = (lambda x: x[:, None]) if states_axis == 1 else (lambda x: x[None])  # [tokens, heads] -> lse's rank
    p = xp.exp((lse - along(out_lse)) * ln_b)
    p = xp.where(xp.isinf(lse), xp.zeros_like(p), p)
    p_own = p[:, index] if states_axis == 1 else p[index]
    g = xp.where(p_own != 0, ln_b * p_own * (grad_out * o).sum(-1), xp.zeros_like(p_own))
    row = -g if grad_out_lse is None else grad_out_lse - g
    grad_lse = xp.where(p != 0, p * along(row), xp.zeros_like(p))
    cut = (lambda a, b: grad_lse[:, a:b]) if states_axis == 1 else (lambda a, b: grad_lse[a:b])
    grad_lse = xp.concatenate([cut(0, index), cut(index, index + 1) + along(g), cut(index + 1, None)], axis=states_axis)
    grad_o = xp.where(p_own[..., None] != 0, p_own[..., None] * grad_out, xp.zeros_like(grad_out))
    return grad_o, grad_lse


def _needs(needs_grad, count):
    needs = tuple(bool(n) for n in needs_grad)
    if len(needs) != count:
        raise ValueError(f"needs_grad: expected {count} flags, got {len(needs)}")
    return needs


def _grad_buffer(given, needed, like, shape, name, arg, op, like_name):
    """One gradient: as given, allocated in the library of `like` (the input `like_name`) with
    `shape` and dtype `name`, or None when not needed.  JAX arrays are neither written nor
    allocated like: JAX differentiates attnmerge.jax's merges itself."""
    if given is not None and not _is_jax(given):
        return given
    if given is None and not needed:
        return None
    if given is not None or _is_jax(like):
        raise ValueError(f"{arg if given is not None else like_name}: expected an array attnmerge may write or "
                         f"allocate like, got a JAX array (immutable); the gradients of attnmerge.jax.{op} come "
                         f"from jax.grad or jax.vjp (its custom_vjp runs this backward)")
    return empty(like, shape, name, arg)


def _states_grads(o, grad_o, grad_lse, needs_grad, ndim, op):
    """(grad_o, grad_lse) of an N-way or variable-length merge whose states' O `o` has `ndim`
    dimensions (its LSE: all but the last): each as given, allocated like o, or None where
    needs_grad (o, lse) says not."""
    needs = _needs(needs_grad, 2)
    shape = _shape(o, "o")
    if len(shape) != ndim:
        raise ValueError(f"o: expected {ndim} dimensions, got {len(shape)} (shape {list(shape)})")
    name = dtype_name(getattr(o, "dtype", None), "o", O_IN_DTYPES)
    return (_grad_buffer(grad_o, needs[0], o, shape, name, "grad_o", op, "o"),
            _grad_buffer(grad_lse, needs[1], o, shape[:-1], "float32", "grad_lse", op, "o"))


def merge_backward(grad_out, grad_out_lse, out, out_lse, o_a, lse_a, o_b, lse_b, *, grad_o_a=None, grad_lse_a=None,
                   grad_o_b=None, grad_lse_b=None, needs_grad=(True, True, True, True), base="e", a_tokens=None,
                   stream=None, pdl=False):
    """Gradients of merge(): (grad_o_a, grad_lse_a, grad_o_b, grad_lse_b), one pass over the data.

    For a row with p_i = b^(lse_i - LSE) (b = e, or 2 with base=2, the forward's base):
    dO_i = p_i * grad_out and dlse_i = p_i * (grad_out_lse + ln(b) * <grad_out, O_i - out>), the dot
    over head_size in float32.  An empty part (lse_i = -inf or +inf), and every part of an
    all-empty row, gets zero gradients, never NaN.

    grad_out: [tokens, heads, head_size], the dtype of out; grad_out_lse: float32 [tokens, heads], or
        None (the forward's LSE unused: zero).
    out, out_lse: what merge() returned (saved, not recomputed): out float32, float16 or bfloat16
        (an FP8 output has no gradient), out_lse float32 [tokens, heads], needed even where the
        caller of the forward did not ask for it (return_lse=False).  out may be None: <dO, O>
        is then sum_j p_j <dO, O_j> (the same in exact arithmetic, one vector a row less to read).
    o_a, lse_a, o_b, lse_b, a_tokens: the forward's inputs and option, as merge() took them.
    grad_o_*, grad_lse_*: where the gradients go (any strides; they may not overlap any input);
        each None one is allocated like its input (grad_o_* the dtype of o_a, grad_lse_* float32
        [tokens, heads]) unless its needs_grad flag, in the order (o_a, lse_a, o_b, lse_b), is
        False: then it is neither computed nor returned (None).  Without the LSE gradients no O is
        read at all.  With a_tokens, grad_o_a and grad_lse_a cover the first a_tokens tokens of a
        ([a_tokens, heads, ...]): its later tokens were never read, their gradient is zero.
    stream, pdl: as for merge().
    """
    flags = lse_flags(base) | (_C.PDL if pdl else 0)
    a_tok = a_tokens_arg(a_tokens)
    needs = _needs(needs_grad, 4)
    shape = _shape(o_b, "o_b")
    a_shape = shape if a_tokens is None else (a_tok,) + tuple(shape[1:])
    name = dtype_name(getattr(o_a, "dtype", None), "o_a", O_IN_DTYPES)
    grads = (_grad_buffer(grad_o_a, needs[0], o_b, a_shape, name, "grad_o_a", "merge", "o_b"),
             _grad_buffer(grad_lse_a, needs[1], o_b, a_shape[:2], "float32", "grad_lse_a", "merge", "o_b"),
             _grad_buffer(grad_o_b, needs[2], o_b, shape, name, "grad_o_b", "merge", "o_b"),
             _grad_buffer(grad_lse_b, needs[3], o_b, shape[:2], "float32", "grad_lse_b", "merge", "o_b"))
    _C.merge_backward(*grads, grad_out, grad_out_lse, out, out_lse, o_a, lse_a, o_b, lse_b, flags, a_tok, stream)
    return grads


def merge_states_backward(grad_out, grad_out_lse, out, out_lse, o, lse, *, grad_o=None, grad_lse=None,
                          needs_grad=(True, True), base="e", states_axis=1, stream=None, pdl=False):
    """Gradients of merge_states(): (grad_o, grad_lse), one pass over the data.

    The formula, empty parts, grad_out, grad_out_lse (None: zero), out, out_lse and the dtypes as
    for merge_backward().  o, lse, states_axis: as merge_states() took them; grad_o and grad_lse
    have the shapes of o and lse ([tokens, S, ...], or [S, tokens, ...] with states_axis=0), any
    strides, allocated like them when None unless needs_grad (o, lse) says not.
    """
    if states_axis not in (0, 1) or isinstance(states_axis, bool):
        raise ValueError(f"states_axis: expected 0 or 1, got {states_axis!r}")
    flags = lse_flags(base) | (_C.PDL if pdl else 0)
    grads = _states_grads(o, grad_o, grad_lse, needs_grad, 4, "merge_states")
    _C.merge_states_backward(*grads, grad_out, grad_out_lse, out, out_lse, o, lse, flags, states_axis == 0, stream)
    return grads


def merge_varlen_backward(grad_out, grad_out_lse, out, out_lse, o, lse, indptr, *, grad_o=None, grad_lse=None,
                          needs_grad=(True, True), base="e", stream=None, pdl=False):
    """Gradients of merge_varlen(): (grad_o, grad_lse), one pass over the data.

    The formula, empty parts, grad_out [rows, heads, head_size], grad_out_lse (None: zero), out,
    out_lse and the dtypes as for merge_backward().  o [total, heads, head_size], lse, indptr: as
    merge_varlen() took them; grad_o and grad_lse have the shapes of o and lse, allocated like them
    when None unless needs_grad (o, lse) says not.  Every state's gradient is written: states no
    row takes (before indptr[0], from indptr[rows] on) get zeros.
    """
    flags = lse_flags(base) | (_C.PDL if pdl else 0)
    grads = _states_grads(o, grad_o, grad_lse, needs_grad, 3, "merge_varlen")
    _C.merge_varlen_backward(*grads, grad_out, grad_out_lse, out, out_lse, o, lse, indptr, flags, stream)
    return grads
