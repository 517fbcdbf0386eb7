"""The public functions: merge, merge_inplace, merge_states, merge_varlen, merge_share and the
backwards of the first three.  Each hands its parameters, in its signature's order, to its
per-call path (attnmerge._call.public_call): the call's record, read once (attnmerge._call.options;
all defaults made in C), then its road (attnmerge._roads: the binding, the torch ops or
attnmerge.jax)."""
from __future__ import annotations

from collections.abc import Mapping

from . import _native, _roads
from ._call import OPS, lse_dtype, lse_only, options, public_call, shape_of, states_axis_of
from ._types import Array, Base, DType, Lse, PairBase, Stream

_MERGE, _INPLACE, _STATES, _VARLEN, _SHARE = (OPS[name] for name in (
    "merge", "merge_inplace", "merge_states", "merge_varlen", "merge_share"))


def merge(o_a: Array, lse_a: Lse, o_b: Array, lse_b: Lse, *, out: Array | None = None,
          out_lse: Array | None = None, return_lse: bool = True, out_dtype: DType | None = None,
          output_scale: float | Array | None = None, base: PairBase = "e", out_base: Base | None = None,
          a_tokens: int | None = None, sink: Array | None = None, group_size: int | None = None,
          group_scales: Array | None = None, scale_ue8m0: bool = False, block_format: str | None = None,
          scale_layout: str = "row_major", scale_rounding: str = "floor", valid: Array | None = None,
          num_tokens: Array | None = None,
          stream: Stream = None, pdl: bool = False, batch_invariant: bool = False,
          _names: Mapping[str, str] | None = None) -> tuple[Array, ...]:
    """Merge two attention states: ``(out, out_lse) = merge((o_a, lse_a), (o_b, lse_b))``.

    Per (token, head) row, with ``m = max(lse_a, lse_b)``, ``w = exp(lse - m)`` and ``W`` their sum:
    ``out = (w_a o_a + w_b o_b) / W`` and ``out_lse = m + log W``, in float32 whatever the storage,
    rounded once.  An LSE of +inf or -inf is an empty part (never read); both empty give ``out = 0``
    and ``out_lse = -inf``; a NaN LSE makes its row NaN.

    Arrays may come from NumPy (the CPU path), PyTorch, CuPy, JAX or Numba, with any strides >= 0
    except that head_size is unit-stride.  CUDA arrays run on the GPU they live on, asynchronously
    on `stream`.  JAX arrays are never written: a call whose results would be allocated like one
    runs attnmerge.jax.merge and returns new JAX arrays.

    Parameters
    ----------
    o_a, o_b : array
        The states' outputs, [tokens, heads, head_size], float32, float16 or bfloat16 (one dtype
        for both), or float64 on the CPU (every O and LSE of the call then float64, merged in
        float64).  With `a_tokens`, o_a needs only a_tokens tokens.
    lse_a, lse_b : array or tuple of 2 arrays
        Their log-sum-exps, float32 [tokens, heads], in base `base`; a [heads, tokens] buffer is
        passed as its transpose (``lse.T``).  Or softmax statistics, a ``(max, sum)`` tuple of
        float32 arrays of that shape (float64 in a float64 call; TensorRT-LLM's Helix, a
        flash-decoding kernel before its log): the LSE is ``max + log(sum)`` (log2 in base 2),
        taken in float32 as it is read, and ``sum = 0`` an empty part whatever the max holds.
    out : array, optional
        Where the merged output goes, [tokens, heads, head_size], float32, float16, bfloat16 or
        float8_e4m3fn; may be o_a or o_b itself.  Allocated like o_b when None.
    out_lse : array, optional
        Where the merged LSE goes, float32 [tokens, heads]; allocated when None and `return_lse`.
    return_lse : bool, default True
        Whether to return the merged LSE when no `out_lse` is given.
    out_dtype : dtype or str, optional
        The dtype of an allocated `out` (default: o_a's; float8_e4m3fn with `group_size`).
    output_scale : float or array, optional
        FP8 outputs store ``value / output_scale``, saturating to +-448: a finite number > 0, or a
        one-element float32 array on the arrays' device, read by the kernel (no host round trip).
    base : {"e", 2} or tuple of them, default "e"
        The LSEs' base: natural log, or 2 (log2-sum-exp2, FlashInfer's); a pair gives (lse_a's,
        lse_b's), converted in float32 as they are read.
    out_base : {"e", 2}, optional
        The merged LSE's base (default: lse_a's).
    a_tokens : int or array, optional
        Only rows of the first a_tokens tokens merge a with b; later rows take b alone (vLLM's
        ``prefill_tokens_with_context``).  Or a one-element int32 or int64 array on the arrays'
        device, read by the kernel (a captured CUDA graph takes a new one at each replay): o_a and
        lse_a then have every token, the rows past the count never read them, and a count above
        the tokens is the tokens, one below 0 is 0.
    sink : array, optional
        Attention sinks (gpt-oss): float32 [heads], each head's sink logit in lse_a's base, one
        more state of output 0 in every row of its head.
    group_size : int, optional
        Per-group FP8 (DeepSeek-V3's 1 x 128 blocks): each group of group_size consecutive elements
        of a row gets ``scale = max(amax, 1e-10) / 448`` and ``out = value / scale`` in FP8.  A
        power of two >= 8 dividing head_size.  The call then also returns the scales.
    group_scales : array, optional
        Where the group scales go, float32 [tokens, heads, head_size // group_size], any strides
        (a block format's: its scales' dtype and layout); allocated like out when None.
    scale_ue8m0 : bool, default False
        Round each group scale up to a power of two (UE8M0, as DeepGEMM takes them).
    block_format : {"mxfp8", "nvfp4"}, optional
        A block-scaled output, as the block-scaled GEMMs read it (docs/semantics.md has the rules,
        the reference quantizers' bit for bit); the call then also returns the scales.  "mxfp8":
        out float8_e4m3fn, one UE8M0 scale (uint8, 2^(s - 127)) per 32 elements of a row.
        "nvfp4": out uint8 [tokens, heads, head_size // 2], two E2M1 values per byte (the even
        element in the low nibble), one float8_e4m3fn scale per 16 elements, `output_scale` the
        global scale g (default 1): value ~ e2m1 * scale * g.  head_size a multiple of the block.
    scale_layout : {"row_major", "swizzled"}, default "row_major"
        The block scales [tokens, heads, head_size // block], or swizzled in the 128 x 4 tiles of
        cuBLASLt and CUTLASS: [ceil(tokens / 128), ceil(heads * head_size / block / 4), 512]
        bytes, their padding zeros.
    scale_rounding : {"floor", "rceil"}, default "floor"
        MXFP8's scale: 2^(floor(log2 amax) - 8) (the OCP MX rule), or amax / 448 rounded up to a
        power of two ("rceil", cuBLAS's: no value saturates).
    valid : array, optional
        Which states hold keys, read on the device (never synchronized with the host): [tokens, 2]
        (a's, b's), uint8 or bool, or int32 or int64 (a count of keys, such as per-rank KV
        lengths); a state whose entry is 0 weighs nothing whatever its O and LSE hold (vLLM's
        empty context-parallel shards).
    num_tokens : array, optional
        The live tokens, read on the device (never synchronized with the host): a one-element
        int32 or int64 array on the arrays' device (NumPy on the CPU), the arrays sized for a
        capacity (a CUDA graph captured once serves every batch up to it).  Rows of tokens at or
        past the count read nothing and write nothing: every output there keeps what it held
        (an allocated one is uninitialised there).  A count above the tokens is taken as the
        tokens, one below 0 as 0.
    stream : int or object, optional
        None: the current stream of the arrays' framework (else the legacy default stream); an
        int cudaStream_t, or an object with ``.cuda_stream`` or ``.ptr``.  Ignored on the CPU.
    pdl : bool, default False
        Programmatic dependent launch (sm_90 and newer): the kernel may start while the previous
        one on the stream finishes, and waits for it before reading.  The same results.
    batch_invariant : bool, default False
        Each row's bits depend on that row's inputs and these options alone, never on the other
        rows of the call, the kernel the plan picks for their number or the GPU's size: a row
        merged alone gives the same bits (the two-way and in-place merges and the share are so
        anyway; the N-way and variable-length merges then keep one kernel and one chunk of states,
        giving up the state-parallel kernel of decode sizes).  The GPU's bits differ from the CPU's.

    Returns
    -------
    out : array
        The merged output.
    out_lse : array or None
        The merged LSE, None when `return_lse` is False and no `out_lse` was given.
    group_scales : array
        Only with `group_size` or `block_format`: the per-group or per-block scales.

    Raises
    ------
    ValueError
        A shape, stride, size, device or option the merge cannot take, naming the argument, what
        it expected and what it got; nothing is written then.
    TypeError
        An argument that is not an array, or of a dtype the merge does not take.

    Examples
    --------
    >>> import numpy as np, attnmerge
    >>> rng = np.random.default_rng(0)
    >>> o_a, o_b = rng.standard_normal((2, 4, 3, 64), dtype=np.float32)
    >>> lse_a, lse_b = rng.standard_normal((2, 4, 3), dtype=np.float32)
    >>> out, out_lse = attnmerge.merge(o_a, lse_a, o_b, lse_b)
    >>> bool(np.allclose(out_lse, np.logaddexp(lse_a, lse_b)))
    True
    >>> held, held_lse = np.full_like(o_a, np.nan), np.full_like(lse_a, np.nan)  # a live count of 2 of 4
    >>> _ = attnmerge.merge(o_a, lse_a, o_b, lse_b, out=held, out_lse=held_lse, num_tokens=np.array([2], np.int32))
    >>> bool(np.allclose(held_lse[:2], out_lse[:2]) and np.isnan(held_lse[2:]).all())
    True
    """
    return _merge_call(o_a, lse_a, o_b, lse_b, out, out_lse, return_lse, out_dtype, output_scale, base, out_base,
                       a_tokens, sink, group_size, group_scales, scale_ue8m0, block_format, scale_layout,
                       scale_rounding, valid, num_tokens, stream, pdl, batch_invariant, _names)


def merge_inplace(o: Array, lse: Array, o_other: Array, lse_other: Lse, *, mask: Array | None = None,
                  base: PairBase = "e", valid: Array | None = None,
                  num_tokens: Array | None = None, stream: Stream = None, pdl: bool = False,
                  batch_invariant: bool = False, _names: Mapping[str, str] | None = None) -> tuple[Array, Array]:
    """Merge a state into another in place: ``(o, lse) <- merge((o, lse), (o_other, lse_other))``.

    The semantics of :func:`merge`; the merged LSE replaces lse in lse's base.

    Parameters
    ----------
    o, o_other : array
        [tokens, heads, head_size], float32, float16 or bfloat16 (one dtype); o is written.
    lse, lse_other : array
        float32 [tokens, heads]; lse is written.  lse_other may be softmax statistics, a ``(max,
        sum)`` tuple, as for :func:`merge` (lse may not: the merged LSE replaces it).
    mask : array, optional
        uint8 or bool [tokens]: rows of tokens whose mask is 0 are left untouched.
    base : {"e", 2} or tuple of them, default "e"
        As for :func:`merge`: one base for both, or (lse's, lse_other's).
    valid : array, optional
        [tokens, 2] (o's state, o_other's), as for :func:`merge`.
    num_tokens : array, optional
        The live tokens, as for :func:`merge`: rows past the count keep o and lse as they were.
    stream, pdl, batch_invariant
        As for :func:`merge`.

    Returns
    -------
    o, lse : array
        The arrays given, merged.

    Raises
    ------
    ValueError
        As for :func:`merge`; also a JAX array (immutable) as o or lse.
    TypeError
        As for :func:`merge`.

    Examples
    --------
    >>> import numpy as np, attnmerge
    >>> rng = np.random.default_rng(0)
    >>> o, o_other = rng.standard_normal((2, 4, 3, 64), dtype=np.float32)
    >>> lse, lse_other = rng.standard_normal((2, 4, 3), dtype=np.float32)
    >>> want = np.logaddexp(lse, lse_other)
    >>> _ = attnmerge.merge_inplace(o, lse, o_other, lse_other)
    >>> bool(np.allclose(lse, want))
    True
    """
    return _merge_inplace_call(o, lse, o_other, lse_other, mask, base, valid, num_tokens, stream, pdl,
                               batch_invariant, _names)


def merge_states(o: Array, lse: Lse, *, out: Array | None = None, out_lse: Array | None = None,
                 return_lse: bool = True, out_dtype: DType | None = None, output_scale: float | Array | None = None,
                 base: Base = "e", out_base: Base | None = None, states_axis: int = 1, sink: Array | None = None,
                 group_size: int | None = None, group_scales: Array | None = None, scale_ue8m0: bool = False,
                 block_format: str | None = None, scale_layout: str = "row_major", scale_rounding: str = "floor",
                 valid: Array | None = None, num_tokens: Array | None = None, stream: Stream = None, pdl: bool = False,
                 batch_invariant: bool = False, _names: Mapping[str, str] | None = None) -> tuple[Array, ...]:
    """Merge S stacked states in one pass, each input read once.

    Per row: ``m = max_i lse_i``, ``w_i = exp(lse_i - m)``, ``W = sum_i w_i``, ``out = sum_i (w_i /
    W) o_i``, ``out_lse = m + log W``.  S = 0 gives ``out = 0`` and ``out_lse = -inf`` (the sink, with
    one).  The states' axis may be anywhere but head_size's, read through the strides: no copy.

    Parameters
    ----------
    o : array
        The states' outputs, float32, float16 or bfloat16: [tokens, S, heads, head_size]
        (states_axis=1, FlashInfer's), [S, tokens, heads, head_size] (0: an all-gather's) or
        [tokens, heads, S, head_size] (2).
    lse : array or tuple of 2 arrays
        Their LSEs, float32, laid out as o without head_size ([tokens, S, heads] for states_axis=1),
        or softmax statistics, a ``(max, sum)`` tuple of such arrays, as for :func:`merge`.
    states_axis : int, default 1
        The axis of S in o and lse: 0, 1 or 2 (or -4 to -2).
    out, out_lse, return_lse, out_dtype, output_scale, base, out_base
        As for :func:`merge` (one base for every state).
    group_size, group_scales, scale_ue8m0, block_format, scale_layout, scale_rounding, stream, pdl,
    batch_invariant
        As for :func:`merge`.
    sink : array, optional
        float32 [heads]: each head's sink logit, one more state of output 0 in every row of its
        head (the merged LSE counts it; a row with no states gets ``out = 0``, ``out_lse = sink``).
    valid : array, optional
        Which states hold keys, [tokens, S] whatever `states_axis` (vLLM's per-rank KV lengths
        [tokens, cp] as they are), as for :func:`merge`.
    num_tokens : array, optional
        The live tokens, as for :func:`merge`.

    Returns
    -------
    out, out_lse[, group_scales] : array
        As for :func:`merge`, out [tokens, heads, head_size].

    Raises
    ------
    ValueError, TypeError
        As for :func:`merge`.

    Examples
    --------
    >>> import numpy as np, attnmerge
    >>> rng = np.random.default_rng(0)
    >>> o = rng.standard_normal((4, 5, 3, 64), dtype=np.float32)  # 5 states
    >>> lse = rng.standard_normal((4, 5, 3), dtype=np.float32)
    >>> out, out_lse = attnmerge.merge_states(o, lse)
    >>> bool(np.allclose(out_lse, np.logaddexp.reduce(lse, axis=1)))
    True
    """
    return _merge_states_call(o, lse, out, out_lse, return_lse, out_dtype, output_scale, base, out_base, states_axis,
                              sink, group_size, group_scales, scale_ue8m0, block_format, scale_layout, scale_rounding,
                              valid, num_tokens, stream, pdl, batch_invariant, _names)


def merge_varlen(o: Array, lse: Lse, indptr: Array, *, out: Array | None = None, out_lse: Array | None = None,
                 return_lse: bool = True, out_dtype: DType | None = None, output_scale: float | Array | None = None,
                 base: Base = "e", out_base: Base | None = None, sink: Array | None = None,
                 group_size: int | None = None, group_scales: Array | None = None, scale_ue8m0: bool = False,
                 block_format: str | None = None, scale_layout: str = "row_major", scale_rounding: str = "floor",
                 valid: Array | None = None, num_tokens: Array | None = None, stream: Stream = None, pdl: bool = False,
                 batch_invariant: bool = False, _names: Mapping[str, str] | None = None) -> tuple[Array, ...]:
    """Merge a variable number of states per row: row r merges states ``indptr[r] .. indptr[r+1]-1``.

    A row with no states gets ``out = 0`` and ``out_lse = -inf`` (the sink, with one).  On the CPU a
    bad indptr raises ValueError; on the GPU it is never read back to the host, and each row takes
    states ``[clamp(indptr[r], 0, total), clamp(indptr[r+1], that, total))``: no access out of
    bounds, and a row whose bounds cross is empty.

    Parameters
    ----------
    o : array
        [total, heads, head_size], float32, float16 or bfloat16.
    lse : array or tuple of 2 arrays
        float32 [total, heads], or softmax statistics, a ``(max, sum)`` tuple, as for :func:`merge`.
    indptr : array
        int32 or int64 [rows + 1].
    out, out_lse, return_lse, out_dtype, output_scale, base, out_base, sink
        As for :func:`merge_states`; out [rows, heads, head_size].
    valid : array, optional
        [total]: which states of o hold keys, as for :func:`merge`.
    num_tokens : array, optional
        The live rows, as for :func:`merge`'s tokens: rows at or past the count read nothing of
        indptr and write nothing.
    group_size, group_scales, scale_ue8m0, block_format, scale_layout, scale_rounding, stream, pdl,
    batch_invariant
        As for :func:`merge`.

    Returns
    -------
    out, out_lse[, group_scales] : array
        As for :func:`merge`.

    Raises
    ------
    ValueError, TypeError
        As for :func:`merge`; also a bad indptr on the CPU.

    Examples
    --------
    >>> import numpy as np, attnmerge
    >>> rng = np.random.default_rng(0)
    >>> o = rng.standard_normal((6, 3, 64), dtype=np.float32)
    >>> lse = rng.standard_normal((6, 3), dtype=np.float32)
    >>> indptr = np.array([0, 1, 6], np.int32)  # row 0 one state, row 1 five
    >>> out, out_lse = attnmerge.merge_varlen(o, lse, indptr)
    >>> bool(np.allclose(out_lse[1], np.logaddexp.reduce(lse[1:], axis=0)))
    True
    """
    return _merge_varlen_call(o, lse, indptr, out, out_lse, return_lse, out_dtype, output_scale, base, out_base, sink,
                              group_size, group_scales, scale_ue8m0, block_format, scale_layout, scale_rounding,
                              valid, num_tokens, stream, pdl, batch_invariant, _names)


def merge_share(o: Array, lse: Lse, index: int, *, out: Array | None = None, out_lse: Array | None = None,
                return_lse: bool = True, out_dtype: DType | None = None, output_scale: float | Array | None = None,
                base: Base = "e", out_base: Base | None = None, states_axis: int = 1, sink: Array | None = None,
                group_size: int | None = None, group_scales: Array | None = None, scale_ue8m0: bool = False,
                block_format: str | None = None, scale_layout: str = "row_major", scale_rounding: str = "floor",
                valid: Array | None = None, num_tokens: Array | None = None, stream: Stream = None, pdl: bool = False,
                batch_invariant: bool = False, _names: Mapping[str, str] | None = None) -> tuple[Array, ...]:
    """One state's share of an N-way merge, for context parallelism's combine by reduce-scatter.

    ``out = (w_index / W) o`` and ``out_lse`` the merged LSE, so that the S states' shares summed
    are :func:`merge_states` of them: each rank all-gathers the LSEs (not the outputs), scales its
    own output, and a reduce-scatter (or all-reduce) sums the shares.  A state of zero weight gets a
    share of 0 (its O is not read), an all-empty row ``out = 0`` and ``out_lse = -inf``.

    Parameters
    ----------
    o : array
        State `index`'s output [tokens, heads, head_size] (the others' are not needed).
    lse : array or tuple of 2 arrays
        Every state's LSE, float32 [tokens, S, heads] (states_axis=1), [S, tokens, heads] (0: an
        all-gather's) or [tokens, heads, S] (2); or softmax statistics, a ``(max, sum)`` tuple of
        such arrays, as for :func:`merge`.
    index : int
        The state whose share this is, 0 <= index < S.
    states_axis : int, default 1
        The axis of S in lse: 0, 1 or 2 (or -3 to -1).
    out, out_lse, return_lse, out_dtype, output_scale, base, out_base, sink, valid, num_tokens
        As for :func:`merge_states` (out may be o itself; every rank's share takes the same sink
        and valid states).
    group_size, group_scales, scale_ue8m0, block_format, scale_layout, scale_rounding, stream, pdl,
    batch_invariant
        As for :func:`merge` (each share quantized on its own).

    Returns
    -------
    out, out_lse[, group_scales] : array
        As for :func:`merge`.

    Raises
    ------
    ValueError, TypeError
        As for :func:`merge`; also an index out of range.

    Examples
    --------
    >>> import numpy as np, attnmerge
    >>> rng = np.random.default_rng(0)
    >>> o = rng.standard_normal((4, 5, 3, 64), dtype=np.float32)
    >>> lse = rng.standard_normal((4, 5, 3), dtype=np.float32)
    >>> shares = [attnmerge.merge_share(o[:, i], lse, i)[0] for i in range(5)]
    >>> bool(np.allclose(sum(shares), attnmerge.merge_states(o, lse)[0], atol=1e-5))
    True
    """
    return _merge_share_call(o, lse, index, out, out_lse, return_lse, out_dtype, output_scale, base, out_base,
                             states_axis, sink, group_size, group_scales, scale_ue8m0, block_format, scale_layout,
                             scale_rounding, valid, num_tokens, stream, pdl, batch_invariant, _names)


# Each public function's per-call path, built from its signature (attnmerge._call.public_call).
_merge_call, _merge_inplace_call, _merge_states_call, _merge_varlen_call, _merge_share_call = (
    public_call(op, function) for op, function in ((_MERGE, merge), (_INPLACE, merge_inplace),
                                                   (_STATES, merge_states), (_VARLEN, merge_varlen),
                                                   (_SHARE, merge_share)))


# ---- the backward: the gradients of a merge's inputs from those of its outputs ----------------


def merge_backward(grad_out: Array, grad_out_lse: Array | None, out: Array | None, out_lse: Array, o_a: Array,
                   lse_a: Array, o_b: Array, lse_b: Array, *, grad_o_a: Array | None = None,
                   grad_lse_a: Array | None = None, grad_o_b: Array | None = None, grad_lse_b: Array | None = None,
                   needs_grad: tuple[bool, bool, bool, bool] = (True, True, True, True), base: Base = "e",
                   a_tokens: int | None = None, stream: Stream = None, pdl: bool = False) -> tuple[Array | None, ...]:
    """The gradients of :func:`merge`'s inputs, in one pass over the data.

    Per row, with ``p_i = b^(lse_i - LSE)`` (b = e, or 2 with base=2, the forward's base):
    ``dO_i = p_i grad_out`` and ``dlse_i = p_i (grad_out_lse + ln(b) <grad_out, O_i - out>)``, the dot
    over head_size in float32.  An empty part, and every part of an all-empty row, gets zero
    gradients, never NaN.  The frameworks' autograd (torch ops, attnmerge.jax) calls this; call it
    yourself where you differentiate by hand.

    Parameters
    ----------
    grad_out : array
        The gradient of out, [tokens, heads, head_size], out's dtype.
    grad_out_lse : array or None
        The gradient of out_lse, float32 [tokens, heads]; None: zero (the LSE was not used).
    out : array or None
        What merge() returned (saved, not recomputed; an FP8 output has no gradient).  None: <dO, O>
        is taken as ``sum_j p_j <dO, O_j>`` (the same in exact arithmetic, one vector less per row).
    out_lse : array
        merge()'s merged LSE, float32 [tokens, heads] (needed even where the forward did not return it).
    o_a, lse_a, o_b, lse_b : array
        The forward's inputs, as merge() took them.
    grad_o_a, grad_lse_a, grad_o_b, grad_lse_b : array, optional
        Where the gradients go (any strides, not overlapping any input); each None one is allocated
        like its input unless its `needs_grad` flag is False.
    needs_grad : tuple of 4 bool, default all True
        Which of (o_a, lse_a, o_b, lse_b) to differentiate; the others are neither computed nor
        returned (None).  Without the LSE gradients no O is read at all.
    base, a_tokens, stream, pdl
        As merge() took them.  With a_tokens, grad_o_a and grad_lse_a cover a's first a_tokens tokens.

    Returns
    -------
    grad_o_a, grad_lse_a, grad_o_b, grad_lse_b : array or None

    Raises
    ------
    ValueError, TypeError
        As for :func:`merge`.

    Examples
    --------
    >>> import numpy as np, attnmerge
    >>> rng = np.random.default_rng(0)
    >>> o_a, o_b = rng.standard_normal((2, 4, 3, 64), dtype=np.float32)
    >>> lse_a, lse_b = rng.standard_normal((2, 4, 3), dtype=np.float32)
    >>> out, out_lse = attnmerge.merge(o_a, lse_a, o_b, lse_b)
    >>> g = attnmerge.merge_backward(np.ones_like(out), None, out, out_lse, o_a, lse_a, o_b, lse_b)
    >>> bool(np.allclose(g[0] + g[2], 1.0))  # the weights of a row sum to 1
    True
    """
    lse_a, lse_b = lse_only(lse_a, "lse_a"), lse_only(lse_b, "lse_b")
    opt = options(_MERGE, base=base, a_tokens=a_tokens, stream=stream, pdl=pdl)
    if opt.a_tokens_tensor is not None:
        raise TypeError("a_tokens: expected None or an int (the backward takes a_tokens from the host), got an array")
    needs = _native.needs_of(needs_grad, 4)
    shape = shape_of(o_b, "o_b")
    a_shape = shape if a_tokens is None else (opt.a_tokens,) + tuple(shape[1:])
    dtype = _native.o_dtype(o_a, "o_a")
    grads = tuple(_native.gradient_buffer(given, need, o_b, s, d, arg, "merge", "o_b", _roads.is_jax)
                  for given, need, s, d, arg in zip(
                      (grad_o_a, grad_lse_a, grad_o_b, grad_lse_b), needs,
                      (a_shape, a_shape[:2], shape, shape[:2]), (dtype, lse_dtype(dtype), dtype, lse_dtype(dtype)),
                      ("grad_o_a", "grad_lse_a", "grad_o_b", "grad_lse_b")))
    _native.run_backward("merge", grads, (grad_out, grad_out_lse, out, out_lse, o_a, lse_a, o_b, lse_b), opt)
    return grads


def _states_grads(o, grad_o, grad_lse, needs_grad, ndim, op):
    """(grad_o, grad_lse) of an N-way or variable-length merge whose states' O `o` has `ndim`
    dimensions (its LSE: all but the last): each as given, allocated like o, or None where
    needs_grad (o, lse) says not."""
    needs = _native.needs_of(needs_grad, 2)
    shape = shape_of(o, "o")
    if len(shape) != ndim:
        raise ValueError(f"o: expected {ndim} dimensions, got {len(shape)} (shape {list(shape)})")
    dtype = _native.o_dtype(o, "o")
    return (_native.gradient_buffer(grad_o, needs[0], o, shape, dtype, "grad_o", op, "o", _roads.is_jax),
            _native.gradient_buffer(grad_lse, needs[1], o, shape[:-1], lse_dtype(dtype), "grad_lse", op, "o",
                                    _roads.is_jax))


def merge_states_backward(grad_out: Array, grad_out_lse: Array | None, out: Array | None, out_lse: Array, o: Array,
                          lse: Array, *, grad_o: Array | None = None, grad_lse: Array | None = None,
                          needs_grad: tuple[bool, bool] = (True, True), base: Base = "e", states_axis: int = 1,
                          stream: Stream = None, pdl: bool = False) -> tuple[Array | None, Array | None]:
    """The gradients of :func:`merge_states`' inputs, in one pass over the data.

    The formula, empty parts and arguments as for :func:`merge_backward`.

    Parameters
    ----------
    grad_out, grad_out_lse, out, out_lse
        As for :func:`merge_backward`: [tokens, heads, head_size] and [tokens, heads].
    o, lse, states_axis, base
        As merge_states() took them.
    grad_o, grad_lse : array, optional
        Where the gradients go, shaped as o and lse (any strides); allocated like them when None
        unless `needs_grad` (o, lse) says not.
    needs_grad : tuple of 2 bool, default (True, True)
    stream, pdl
        As for :func:`merge`.

    Returns
    -------
    grad_o, grad_lse : array or None

    Raises
    ------
    ValueError, TypeError
        As for :func:`merge`.

    Examples
    --------
    >>> import numpy as np, attnmerge
    >>> rng = np.random.default_rng(0)
    >>> o = rng.standard_normal((4, 5, 3, 64), dtype=np.float32)
    >>> lse = rng.standard_normal((4, 5, 3), dtype=np.float32)
    >>> out, out_lse = attnmerge.merge_states(o, lse)
    >>> grad_o, grad_lse = attnmerge.merge_states_backward(np.ones_like(out), None, out, out_lse, o, lse)
    >>> bool(np.allclose(grad_o.sum(axis=1), 1.0))
    True
    """
    axis = states_axis_of(states_axis, 4)
    lse = lse_only(lse, "lse")
    opt = options(_STATES, base=base, states_axis=axis, stream=stream, pdl=pdl)
    grads = _states_grads(o, grad_o, grad_lse, needs_grad, 4, "merge_states")
    _native.run_backward("merge_states", grads, (grad_out, grad_out_lse, out, out_lse, o, lse), opt)
    return grads


def merge_varlen_backward(grad_out: Array, grad_out_lse: Array | None, out: Array | None, out_lse: Array, o: Array,
                          lse: Array, indptr: Array, *, grad_o: Array | None = None, grad_lse: Array | None = None,
                          needs_grad: tuple[bool, bool] = (True, True), base: Base = "e", stream: Stream = None,
                          pdl: bool = False) -> tuple[Array | None, Array | None]:
    """The gradients of :func:`merge_varlen`'s inputs, in one pass over the data.

    The formula, empty parts and arguments as for :func:`merge_backward`.  Every state's gradient
    is written: states no row takes (before indptr[0], from indptr[rows] on) get zeros.

    Parameters
    ----------
    grad_out, grad_out_lse, out, out_lse
        As for :func:`merge_backward`: [rows, heads, head_size] and [rows, heads].
    o, lse, indptr, base
        As merge_varlen() took them.
    grad_o, grad_lse : array, optional
        Where the gradients go, shaped as o and lse; allocated like them when None unless
        `needs_grad` (o, lse) says not.
    needs_grad : tuple of 2 bool, default (True, True)
    stream, pdl
        As for :func:`merge`.

    Returns
    -------
    grad_o, grad_lse : array or None

    Raises
    ------
    ValueError, TypeError
        As for :func:`merge_varlen`.

    Examples
    --------
    >>> import numpy as np, attnmerge
    >>> rng = np.random.default_rng(0)
    >>> o = rng.standard_normal((6, 3, 64), dtype=np.float32)
    >>> lse = rng.standard_normal((6, 3), dtype=np.float32)
    >>> indptr = np.array([0, 1, 6], np.int32)
    >>> out, out_lse = attnmerge.merge_varlen(o, lse, indptr)
    >>> grad_o, _ = attnmerge.merge_varlen_backward(np.ones_like(out), None, out, out_lse, o, lse, indptr)
    >>> bool(np.allclose(grad_o[1:].sum(axis=0), 1.0))
    True
    """
    lse = lse_only(lse, "lse")
    opt = options(_VARLEN, base=base, stream=stream, pdl=pdl)
    grads = _states_grads(o, grad_o, grad_lse, needs_grad, 3, "merge_varlen")
    _native.run_backward("merge_varlen", grads, (grad_out, grad_out_lse, out, out_lse, o, lse, indptr), opt)
    return grads
