"""The reference every test compares against, and the helpers that make inputs.

The oracle is written from the formula of DESIGN.md ("Semantics"), in float64 NumPy, for the states
i of one (token, head) row:

    m = max_i lse_i,  w_i = exp(lse_i - m),  W = sum_i w_i,
    O = sum_i (w_i / W) * O_i,  LSE = m + log W

    - an LSE of +inf marks an empty part and counts as -inf;
    - all parts empty: O = 0 and LSE = -inf (never NaN);
    - a part whose weight is exactly zero is not read (NaN in its O cannot leak);
    - a NaN LSE makes its row NaN (O and LSE).

A state given as softmax statistics (max, sum) has LSE = max + log(sum) (stats_lse), and a state a
validity mask marks empty has LSE -inf (valid_lse): each then merges by the formula above.

It knows nothing of any kernel.  Tolerances (relative L2, of the OUTPUT dtype) are those of DESIGN.md
"Testing": float32 1e-6, float16 1e-3, bfloat16 8e-3.
"""

from __future__ import annotations

import math

import numpy as np

try:  # NumPy has no bfloat16 of its own; ml_dtypes gives one.
    import ml_dtypes

    BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - depends on the machine
    ml_dtypes = None
    BFLOAT16 = None

DTYPES = ("float32", "float16", "bfloat16")

#: relative L2 tolerance against the oracle, by the dtype of the array compared
RTOL = {"float32": 1e-6, "float16": 1e-3, "bfloat16": 8e-3}
#: the smallest normal value of each O dtype: below it a value holds only absolute precision
TINY = {"float32": 2.0**-126, "float16": 2.0**-14, "bfloat16": 2.0**-126}

#: the LSE is float32 whatever the O dtypes: |lse - ref| <= LSE_ATOL * max(1, |ref|)
LSE_ATOL = 1e-5


# --------------------------------------------------------------------------------------------------
# dtypes


def np_dtype(name: str) -> np.dtype:
    """The NumPy dtype of a dtype name ("float32", "float16", "bfloat16")."""
    if name == "bfloat16":
        if BFLOAT16 is None:
            import pytest

            pytest.skip("bfloat16 on NumPy needs ml_dtypes")
        return BFLOAT16
    return np.dtype(name)


def dtype_name(x) -> str:
    """The dtype name of a NumPy array or dtype ("bfloat16" for ml_dtypes' bfloat16)."""
    dt = x.dtype if hasattr(x, "dtype") else x
    return np.dtype(dt).name


def to_f64(x) -> np.ndarray:
    """A float64 copy of a NumPy array of any float dtype (bfloat16 included)."""
    x = np.asarray(x)
    if x.dtype == BFLOAT16 and BFLOAT16 is not None:
        return x.astype(np.float32).astype(np.float64)
    return x.astype(np.float64)


# --------------------------------------------------------------------------------------------------
# the oracle


def natural(lse, base):
    """A float64 copy of an LSE of base `base` ('e' or 2) as a natural one (mixed bases: each LSE is
    an exact log-sum-exp in its own base, so the merge of several is that of their natural ones);
    None (no sink, say) stays None."""
    return None if lse is None else to_f64(lse) * (math.log(2.0) if base in (2, "2") else 1.0)


def rebased(ref, base):
    """An oracle's (O, LSE) whose LSE is natural, with the LSE in base `base`."""
    o, lse = ref
    return o, lse / (math.log(2.0) if base in (2, "2") else 1.0)


def stats_lse(m, total, base="e"):
    """float64 LSE of softmax statistics (max m, sum `total` of exp(score - m), exp2 in base 2),
    from the formula: LSE = m + log(total) (log2 in base 2); a sum of 0 is an empty part (-inf)
    whatever m holds (the max of no scores); elsewhere NaN, +-inf as the formula gives them (then
    the LSE's rules apply: +-inf empty, NaN the row's NaN)."""
    m, total = to_f64(m), to_f64(total)
    log = np.log2 if base in (2, "2") else np.log
    with np.errstate(divide="ignore", invalid="ignore"):
        lse = m + log(np.where(total == 0, 1.0, total))
    return np.where(total == 0, -np.inf, lse)


def valid_lse(lse, valid):
    """float64 LSE of states of which `valid` (broadcast against lse; 0: the state holds no keys)
    says some are empty: -inf there (no weight, whatever the state's LSE and O hold)."""
    return np.where(np.asarray(valid) != 0, to_f64(lse), -np.inf)


def reference_merge(o_a, lse_a, o_b, lse_b, *, base="e", a_tokens=None, sink=None):
    """float64 (O [T, H, D], LSE [T, H]) of the two-way merge, from the formula.

    a_tokens=k: only the first k tokens merge a with b; later rows take b alone (a is treated as an
    empty part there and is never read), so o_a / lse_a need only k tokens.
    LSE arrays are logical [tokens, heads] (pass a transposed view for a heads-first layout).
    sink [H]: one more state per row (sink_state).
    """
    ob = to_f64(o_b)
    lb = to_f64(lse_b)
    tokens, heads, head_size = ob.shape
    k = tokens if a_tokens is None else int(a_tokens)
    oa = np.zeros_like(ob)
    la = np.full((tokens, heads), -np.inf)
    oa[:k] = to_f64(o_a)[:k]
    la[:k] = to_f64(lse_a)[:k]
    if sink is not None:
        so, sl = sink_state(sink, tokens, head_size)
        return reference_merge_states([oa, ob, so], [la, lb, sl], base=base)
    return reference_merge_states([oa, ob], [la, lb], base=base)


def reference_merge_states(os, lses, *, base="e"):
    """float64 merge of S states: os[i] is [T, H, D], lses[i] is [T, H]."""
    o = np.stack([to_f64(x) for x in os])  # [S, T, H, D]
    lse = np.stack([to_f64(x) for x in lses])  # [S, T, H]
    if base == "e":
        exp, log = np.exp, np.log
    elif base in (2, "2"):
        exp, log = np.exp2, np.log2
    else:
        raise ValueError(f"base {base!r}")

    lse = np.where(lse == np.inf, -np.inf, lse)  # +inf: an empty part
    nan_row = np.isnan(lse).any(axis=0)  # [T, H]
    with np.errstate(invalid="ignore"):
        m = np.max(np.where(np.isnan(lse), -np.inf, lse), axis=0)
    empty_row = (m == -np.inf) & ~nan_row
    m_safe = np.where(np.isfinite(m), m, 0.0)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        w = exp(np.where(np.isnan(lse), -np.inf, lse) - m_safe)  # [S, T, H]; -inf -> 0
        W = w.sum(axis=0)
        # a part of weight exactly zero is not read: its O may hold NaN or garbage
        contrib = np.where(w[..., None] > 0, w[..., None] * np.where(w[..., None] > 0, o, 0.0), 0.0)
        out = contrib.sum(axis=0) / np.where(W > 0, W, 1.0)[..., None]
        out_lse = m_safe + log(np.where(W > 0, W, 1.0))
    out[empty_row] = 0.0
    out_lse[empty_row] = -np.inf
    out[nan_row] = np.nan
    out_lse[nan_row] = np.nan
    return out, out_lse


# --------------------------------------------------------------------------------------------------
# inputs


def random_o(rng, shape, dtype="float32") -> np.ndarray:
    """Random O of a dtype name, standard normal, with no zeros (after rounding)."""
    x = rng.standard_normal(shape)
    x = np.where(np.abs(x) < 1e-2, 0.5, x)
    return x.astype(np.float32).astype(np_dtype(dtype))


def random_lse(rng, shape, scale=3.0) -> np.ndarray:
    """Random float32 LSE, scale * standard normal, with no zeros."""
    x = scale * rng.standard_normal(shape)
    x = np.where(x == 0, 0.25, x)
    return x.astype(np.float32)


def random_state(rng, tokens, heads, head_size, dtype="float32", lse_scale=3.0):
    """(o [T, H, D] of dtype, lse [T, H] float32), contiguous."""
    return random_o(rng, (tokens, heads, head_size), dtype), random_lse(rng, (tokens, heads), lse_scale)


def random_pair(rng, tokens=37, heads=5, head_size=72, dtype="float32", lse_scale=3.0):
    """(o_a, lse_a, o_b, lse_b): two random states of one shape (random_state)."""
    return (*random_state(rng, tokens, heads, head_size, dtype, lse_scale),
            *random_state(rng, tokens, heads, head_size, dtype, lse_scale))


def nan_array(shape, dtype="float32") -> np.ndarray:
    """An output buffer poisoned with NaN."""
    return np.full(shape, np.nan, dtype=np.float32).astype(np_dtype(dtype) if isinstance(dtype, str) else dtype)


def poison(x: np.ndarray) -> np.ndarray:
    """Fill an existing (writable) array with NaN, in place; returns it."""
    x[...] = np.nan
    return x


def all_nan(x) -> bool:
    return bool(np.all(np.isnan(to_f64(x))))


# Strided views.  Each builder copies `x` into a fresh buffer of another layout and returns a view
# with the same logical shape and values; `fill` is what the rest of the buffer holds (NaN: any read
# outside the view poisons the result; any write outside it is caught by `outside_view_is_nan`).

O_LAYOUTS = ("contiguous", "padded", "offset", "heads_first", "token_step", "head_step")
LSE_LAYOUTS = ("contiguous", "transposed", "padded", "token_step")


def o_view(x: np.ndarray, layout: str, fill=np.nan):
    """A [T, H, D] view of `layout` holding the values of x; returns (view, buffer)."""
    t, h, d = x.shape
    if layout == "contiguous":
        buf = x.copy()
        return buf, buf
    if layout == "padded":  # a slice of a larger last axis: head_size stride 1, head stride D + 5
        buf = np.full((t, h, d + 5), fill, dtype=np.float32).astype(x.dtype)
        view = buf[:, :, :d]
    elif layout == "offset":  # not 16-byte aligned: starts one element in, odd row pitch
        buf = np.full((t, h, d + 3), fill, dtype=np.float32).astype(x.dtype)
        view = buf[:, :, 1 : d + 1]
    elif layout == "heads_first":  # stored [H, T, D], viewed as [T, H, D]
        buf = np.full((h, t, d), fill, dtype=np.float32).astype(x.dtype)
        view = buf.transpose(1, 0, 2)
    elif layout == "token_step":  # every other token of a larger buffer
        buf = np.full((2 * t, h, d), fill, dtype=np.float32).astype(x.dtype)
        view = buf[::2]
    elif layout == "head_step":  # every third head of a larger buffer
        buf = np.full((t, 3 * h, d), fill, dtype=np.float32).astype(x.dtype)
        view = buf[:, ::3]
    else:
        raise ValueError(layout)
    view[...] = x
    return view, buf


def lse_view(x: np.ndarray, layout: str, fill=np.nan):
    """A [T, H] float32 view of `layout` holding the values of x; returns (view, buffer)."""
    t, h = x.shape
    if layout == "contiguous":
        buf = x.copy()
        return buf, buf
    if layout == "transposed":  # stored [H, T] (vLLM), viewed as [T, H]
        buf = np.full((h, t), fill, dtype=np.float32)
        view = buf.T
    elif layout == "padded":
        buf = np.full((t, h + 3), fill, dtype=np.float32)
        view = buf[:, :h]
    elif layout == "token_step":
        buf = np.full((3 * t, h), fill, dtype=np.float32)
        view = buf[::3]
    else:
        raise ValueError(layout)
    view[...] = x
    return view, buf


def outside_view_is_nan(view: np.ndarray, buf: np.ndarray) -> bool:
    """True when every element of buf outside the view is still NaN."""
    if view is buf:
        return True
    mask = np.ones(buf.shape, dtype=bool)
    # mark the view's elements through a view of the mask with the same strides/offset
    offset = view.__array_interface__["data"][0] - buf.__array_interface__["data"][0]
    mview = np.lib.stride_tricks.as_strided(
        mask.reshape(-1)[offset // view.itemsize :],
        shape=view.shape,
        strides=tuple(s // view.itemsize * mask.itemsize for s in view.strides),
    )
    mview[...] = False
    return bool(np.all(np.isnan(to_f64(buf)[mask])))


# --------------------------------------------------------------------------------------------------
# comparison


def rel_l2(actual, expected) -> float:
    a = to_f64(actual)
    e = to_f64(expected)
    num = float(np.linalg.norm((a - e).ravel()))
    den = float(np.linalg.norm(e.ravel()))
    if den == 0.0:
        return num
    return num / den


def assert_o_close(actual, expected, dtype, what="out"):
    """O against the oracle: the same NaN and inf pattern, rel-L2 of the rest within RTOL[dtype].
    Below the dtype's normal range a value holds only absolute precision (float16 rounds 1e-10 to
    0), so the L2 norm the error is relative to is at least that of the smallest normal values (and
    where the oracle is all zeros, the error is absolute).

    dtype: the dtype name of `actual` (the output dtype).
    """
    a = to_f64(np.asarray(actual))
    e = np.asarray(expected, dtype=np.float64)
    assert a.shape == e.shape, f"{what}: shape {a.shape} != expected {e.shape}"
    nan_a, nan_e = np.isnan(a), np.isnan(e)
    assert np.array_equal(nan_a, nan_e), (
        f"{what}: NaN at {np.argwhere(nan_a != nan_e)[:5].tolist()} differs from the reference "
        f"({int(nan_a.sum())} NaN, expected {int(nan_e.sum())})"
    )
    ok = ~nan_e
    inf_e = np.isinf(e) & ok
    assert np.array_equal(a[inf_e], e[inf_e]) and not np.isinf(a[ok & ~inf_e]).any(), f"{what}: inf differs"
    fin = ok & ~inf_e
    num, den = float(np.linalg.norm(a[fin] - e[fin])), float(np.linalg.norm(e[fin]))
    err = num / max(den, TINY[dtype] * np.sqrt(fin.sum())) if den else num
    assert err <= RTOL[dtype], f"{what}: rel L2 error {err:.3g} > {RTOL[dtype]:g} ({dtype})"


def assert_lse_close(actual, expected, what="out_lse"):
    """LSE against the oracle: NaN and +-inf exactly, finite |d| <= 1e-5 * max(1, |ref|)."""
    a = to_f64(np.asarray(actual))
    e = np.asarray(expected, dtype=np.float64)
    assert a.shape == e.shape, f"{what}: shape {a.shape} != expected {e.shape}"
    nan_a, nan_e = np.isnan(a), np.isnan(e)
    assert np.array_equal(nan_a, nan_e), (
        f"{what}: NaN at {np.argwhere(nan_a != nan_e)[:5].tolist()} differs from the reference"
    )
    fin = np.isfinite(e)
    inf = np.isinf(e)
    assert np.array_equal(a[inf], e[inf]), f"{what}: +-inf differs: got {a[inf][:5]}, expected {e[inf][:5]}"
    assert np.all(np.isfinite(a[fin])), f"{what}: non-finite where the reference is finite"
    d = np.abs(a[fin] - e[fin])
    lim = LSE_ATOL * np.maximum(1.0, np.abs(e[fin]))
    if d.size:
        i = int(np.argmax(d / lim))
        assert np.all(d <= lim), f"{what}: |error| {d[i]:.3g} > {lim[i]:.3g} at reference {e[fin][i]:.6g}"


def assert_merge_matches(out, out_lse, ref, out_dtype, what="out"):
    ref_o, ref_lse = ref
    assert_o_close(out, ref_o, out_dtype, what)
    if out_lse is not None:
        assert_lse_close(out_lse, ref_lse, what + "_lse")


def rounded(x, dtype) -> np.ndarray:
    """float64 values of x after rounding once to the dtype name `dtype`."""
    return to_f64(np.asarray(x, dtype=np.float64).astype(np.float32).astype(np_dtype(dtype)))


LN2 = math.log(2.0)


# --------------------------------------------------------------------------------------------------
# the merge family (issue 3): stacked states, variable length, FP8 outputs


def sink_state(sink, tokens, head_size):
    """Attention sinks as the formula reads them: one more state of every row, whose O is 0 and
    whose LSE is its head's sink: (O [T, H, D] of zeros, LSE [T, H])."""
    sink = to_f64(sink)
    return np.zeros((tokens, sink.shape[0], head_size)), np.broadcast_to(sink, (tokens, sink.shape[0]))


def reference_merge_stacked(o, lse, *, states_axis=1, base="e", sink=None):
    """float64 N-way merge of stacked states, from the formula (any S, S = 0 included).

    states_axis=1: o [T, S, H, D], lse [T, S, H] (FlashInfer's layout);
    states_axis=0: o [S, T, H, D], lse [S, T, H] (what an all-gather produces);
    states_axis=2: o [T, H, S, D], lse [T, H, S] (an all-to-all's, heads first).
    S = 0 gives O = 0 and LSE = -inf on every row.  sink [H]: one more state per row (sink_state).
    """
    if states_axis not in (0, 1, 2):
        raise ValueError(f"states_axis {states_axis!r}")
    o = np.moveaxis(to_f64(o), states_axis, 0)
    lse = np.moveaxis(to_f64(lse), states_axis, 0)
    s, t, h, d = o.shape
    os, lses = list(o), list(lse)
    if sink is not None:
        so, sl = sink_state(sink, t, d)
        os, lses = os + [so], lses + [sl]
    if not os:
        return np.zeros((t, h, d)), np.full((t, h), -np.inf)
    return reference_merge_states(os, lses, base=base)


def reference_merge_share(o, lse, index, *, states_axis=1, base="e", sink=None):
    """float64 share of state `index` in the merge of the states whose LSEs are lse, from the
    formula: out = (w_index / W) O_index and out_lse = m + log W, with m and W over every state
    (and the sink).  o [T, H, D]: state index's O; lse [T, S, H] (states_axis=1), [S, T, H] (0) or
    [T, H, S] (2).  A share of zero weight is 0 whatever o holds (an empty state, or every state of
    the row); +inf counts as -inf; a NaN LSE (or sink) makes the row NaN."""
    o = to_f64(o)
    lse = np.moveaxis(to_f64(lse), states_axis, 0)
    t, h, _ = o.shape
    if sink is not None:
        lse = np.concatenate([lse, sink_state(sink, t, 1)[1][None]])
    b = math.e if base == "e" else 2.0
    eff = np.where(lse == np.inf, -np.inf, lse)
    nan = np.isnan(eff).any(axis=0)
    with np.errstate(invalid="ignore"):
        m = np.where(nan, 0.0, np.nanmax(np.where(np.isnan(eff), -np.inf, eff), axis=0))
        w = np.power(b, eff - np.where(np.isfinite(m), m, 0.0))
    w = np.where(np.isnan(w), 0.0, w)
    total = w.sum(axis=0)
    p = np.where(total > 0, w[index] / np.where(total > 0, total, 1.0), 0.0)
    out = np.where(p[..., None] > 0, p[..., None] * o, 0.0)
    with np.errstate(divide="ignore"):
        out_lse = np.where(total > 0, m + np.log(np.where(total > 0, total, 1.0)) / math.log(b), -np.inf)
    out[nan] = np.nan
    out_lse[nan] = np.nan
    return out, out_lse


def reference_merge_varlen(o, lse, indptr, *, base="e", sink=None):
    """float64 variable-length merge: row r merges states indptr[r] .. indptr[r+1]-1 of o [N, H, D],
    lse [N, H]; a row with no states is O = 0, LSE = -inf.  indptr must be valid here (the GPU's
    clamping of a bad indptr is modelled by `clamp_indptr`).  sink [H]: one more state per row."""
    o = to_f64(o)
    lse = to_f64(lse)
    indptr = np.asarray(indptr, dtype=np.int64)
    rows = indptr.shape[0] - 1
    _, h, d = o.shape
    out = np.zeros((rows, h, d))
    out_lse = np.full((rows, h), -np.inf)
    for r in range(rows):
        lo, hi = int(indptr[r]), int(indptr[r + 1])
        assert 0 <= lo <= hi <= o.shape[0], f"invalid indptr at row {r}: [{lo}, {hi})"
        os, lses = list(o[lo:hi, None]), list(lse[lo:hi, None])
        if sink is not None:
            so, sl = sink_state(sink, 1, d)
            os, lses = os + [so], lses + [sl]
        if os:
            ro, rl = reference_merge_states(os, lses, base=base)
            out[r], out_lse[r] = ro[0], rl[0]
    return out, out_lse


def clamp_indptr(indptr, total):
    """The (begin, end) pairs the GPU uses for a possibly bad indptr, as an int64 [rows, 2] array:
    begin = clamp(indptr[r], 0, total), end = clamp(indptr[r+1], begin, total); a row whose bounds
    cross (indptr[r+1] < indptr[r] after clamping) is therefore empty."""
    p = np.asarray(indptr, dtype=np.int64)
    begin = np.clip(p[:-1], 0, total)
    end = np.clip(np.maximum(p[1:], begin), 0, total)
    return np.stack([begin, end], axis=1)


def reference_merge_ranges(o, lse, ranges, *, base="e"):
    """float64 merge of explicit [begin, end) state ranges per row (see clamp_indptr)."""
    o = to_f64(o)
    lse = to_f64(lse)
    rows = len(ranges)
    _, h, d = o.shape
    out = np.zeros((rows, h, d))
    out_lse = np.full((rows, h), -np.inf)
    for r, (lo, hi) in enumerate(ranges):
        if hi > lo:
            ro, rl = reference_merge_states(list(o[lo:hi, None]), list(lse[lo:hi, None]), base=base)
            out[r], out_lse[r] = ro[0], rl[0]
    return out, out_lse


try:
    FLOAT8_E4M3FN = np.dtype(ml_dtypes.float8_e4m3fn) if ml_dtypes is not None else None
except AttributeError:  # pragma: no cover - an ml_dtypes without float8
    FLOAT8_E4M3FN = None

FP8_MAX = 448.0


def fp8_dtype() -> np.dtype:
    if FLOAT8_E4M3FN is None:
        import pytest

        pytest.skip("float8_e4m3fn on NumPy needs ml_dtypes")
    return FLOAT8_E4M3FN


def fp8_reference(x, scale=1.0) -> np.ndarray:
    """What an FP8 e4m3fn output must hold for the float64 value x: x / scale, saturated to +-448,
    rounded once to nearest-even; NaN stays NaN.  Returned as a float8_e4m3fn array."""
    v = np.asarray(x, dtype=np.float64) / float(scale)
    with np.errstate(invalid="ignore"):
        v = np.where(np.isnan(v), np.nan, np.clip(v, -FP8_MAX, FP8_MAX))
    return v.astype(fp8_dtype())


def _fp8_ordinal(x) -> np.ndarray:
    """The position of each float8_e4m3fn value on the number line, as int (-0 and +0 both 0)."""
    b = np.asarray(x).view(np.uint8).astype(np.int64)
    mag = b & 0x7F
    return np.where(b & 0x80, -mag, mag)


def assert_fp8_close(actual, expected_f64, scale=1.0, what="out", ulps=1):
    """An FP8 e4m3fn output against the oracle: same NaN pattern, and within `ulps` FP8 steps of
    the float64 reference rounded once (the kernel rounds a float32 value, the oracle a float64
    one: they may land on different sides of a tie)."""
    a = np.asarray(actual)
    assert a.dtype == fp8_dtype(), f"{what}: dtype {a.dtype}, expected float8_e4m3fn"
    e = fp8_reference(expected_f64, scale)
    assert a.shape == e.shape, f"{what}: shape {a.shape} != expected {e.shape}"
    nan_a = np.isnan(a.astype(np.float32))
    nan_e = np.isnan(e.astype(np.float32))
    assert np.array_equal(nan_a, nan_e), (
        f"{what}: NaN at {np.argwhere(nan_a != nan_e)[:5].tolist()} differs from the reference "
        f"({int(nan_a.sum())} NaN, expected {int(nan_e.sum())})"
    )
    ok = ~nan_e
    d = np.abs(_fp8_ordinal(a) - _fp8_ordinal(e))[ok]
    if d.size:
        i = int(np.argmax(d))
        assert d[i] <= ulps, (
            f"{what}: {int(d[i])} FP8 steps off at {np.argwhere(ok)[i].tolist()}: got "
            f"{float(a[ok][i])}, expected {float(e[ok][i])} (float64 {float(np.asarray(expected_f64)[ok][i] / scale)})"
        )


#: per-group FP8: the floor of a group's largest magnitude
GROUP_AMAX_FLOOR = 1e-10


def reference_group_scales(x, group_size, ue8m0=False) -> np.ndarray:
    """The per-group FP8 scales of float64 values x [..., D], from the formula: for each group of
    group_size consecutive elements of the last axis, amax = max |x| over its non-NaN elements (0
    where all are NaN), scale = max(amax, 1e-10) / 448, rounded up to a power of two where ue8m0.
    Returns float64 [..., D // group_size]."""
    x = np.asarray(x, dtype=np.float64)
    g = x.reshape(x.shape[:-1] + (x.shape[-1] // group_size, group_size))
    amax = np.max(np.where(np.isnan(g), 0.0, np.abs(g)), axis=-1)
    scale = np.maximum(amax, GROUP_AMAX_FLOOR) / FP8_MAX
    return np.exp2(np.ceil(np.log2(scale))) if ue8m0 else scale


def assert_group_fp8_close(out, scales, expected_f64, group_size, ue8m0=False, what="out"):
    """A per-group FP8 output and its scales against the oracle: each scale within float32 rounding
    of the formula's (the kernel takes the amax of float32 values; with ue8m0 exactly the power of
    two), and each element within one FP8 step of its float64 value divided by the scale stored (so
    that the two checks stay apart: a scale a rounding off does not move every element)."""
    scales = np.asarray(scales, dtype=np.float64)
    want = reference_group_scales(expected_f64, group_size, ue8m0)
    assert scales.shape == want.shape, f"{what} scales: shape {scales.shape} != expected {want.shape}"
    if ue8m0:
        assert np.array_equal(scales, want), f"{what} scales: {scales[scales != want][:5]} != {want[scales != want][:5]}"
    else:
        bad = np.abs(scales - want) > 4e-6 * want
        assert not bad.any(), f"{what} scales at {np.argwhere(bad)[:5].tolist()}: {scales[bad][:5]} != {want[bad][:5]}"
    per_element = np.repeat(scales, group_size, axis=-1)
    assert_fp8_close(out, np.asarray(expected_f64, dtype=np.float64) / per_element, 1.0, what)


def random_stacked(rng, tokens, s, heads, head_size, dtype="float32", states_axis=1, lse_scale=3.0):
    """(o, lse) of S stacked states, contiguous in the layout of states_axis (S at that axis of
    [tokens, heads, head_size] and [tokens, heads])."""
    o_shape, lse_shape = [tokens, heads, head_size], [tokens, heads]
    o_shape.insert(states_axis, s)
    lse_shape.insert(states_axis, s)
    return random_o(rng, tuple(o_shape), dtype), random_lse(rng, tuple(lse_shape), lse_scale)


def strided_view(x: np.ndarray, order=None, pad=0, offset=0, steps=None, fill=np.nan):
    """A view of a fresh buffer holding x, of any logical rank; returns (view, buffer).

    order: the storage order of x's axes, outermost first (default: as x); the innermost stored axis
    is padded by `pad` elements after and `offset` before the view (so the view need not be
    aligned); steps: {logical axis: step}, an axis stored every step-th slot (a step on the innermost
    stored axis makes it non-unit-stride: fine for an LSE, not for the head_size axis of an O).
    The rest of the buffer holds `fill` (NaN: a read outside the view poisons the result, a write
    outside it is caught by `outside_view_is_nan`).
    """
    nd = x.ndim
    order = tuple(range(nd)) if order is None else tuple(order)
    steps = dict(steps or {})
    assert sorted(order) == list(range(nd))
    shape = [x.shape[a] * steps.get(a, 1) for a in order]
    shape[-1] += pad + offset
    buf = np.full(shape, fill, dtype=np.float32).astype(x.dtype)
    sl = [slice(0, None, steps.get(a, 1)) for a in order]
    last = order[-1]
    sl[-1] = slice(offset, offset + x.shape[last] * steps.get(last, 1), steps.get(last, 1))
    view = buf[tuple(sl)].transpose(np.argsort(order))
    assert view.shape == x.shape
    view[...] = x
    return view, buf


# --------------------------------------------------------------------------------------------------
# the backward (issue 16): gradients of the merges


def reference_merge_states_backward(o, lse, out, out_lse, grad_out, grad_out_lse=None, *, base="e"):
    """float64 gradients of the N-way merge from the formula of DESIGN.md ("Frameworks"):
    p_i = b^(lse_i - LSE), dO_i = p_i dO, dlse_i = p_i (dLSE + ln(b) <dO, O_i - O>).

    o [S, T, H, D] and lse [S, T, H]: the states; out [T, H, D] and out_lse [T, H]: the forward's
    results as they were saved (the backward is a function of them, not of a recomputation);
    grad_out [T, H, D], grad_out_lse [T, H] or None (zero).  An empty part (lse -inf or +inf) and a
    part of weight exactly zero get zero gradients whatever their O or dO hold; a NaN anywhere
    else gives NaN where the formula does.  Returns (grad_o [S, T, H, D], grad_lse [S, T, H]).
    """
    o, lse, out, out_lse, grad_out = (to_f64(x) for x in (o, lse, out, out_lse, grad_out))
    dlse = np.zeros(out_lse.shape) if grad_out_lse is None else to_f64(grad_out_lse)
    if base == "e":
        power, ln_b = np.exp, 1.0
    elif base in (2, "2"):
        power, ln_b = np.exp2, LN2
    else:
        raise ValueError(f"base {base!r}")
    lse = np.where(lse == np.inf, -np.inf, lse)
    with np.errstate(invalid="ignore", over="ignore"):
        p = np.where(lse == -np.inf, 0.0, power(lse - out_lse[None]))  # [S, T, H]
        zero = (p == 0.0)[..., None]
        grad_o = np.where(zero, 0.0, p[..., None] * grad_out[None])
        dot = np.sum(grad_out[None] * (np.where(zero, 0.0, o) - out[None]), axis=-1)
        grad_lse = np.where(p == 0.0, 0.0, p * (dlse[None] + ln_b * dot))
    return grad_o, grad_lse


# --------------------------------------------------------------------------------------------------
# block-scaled formats (block_format=): the rules of the OCP MX and NVIDIA NVFP4 formats as their
# reference quantizers state them, each step a float32 operation rounded once (what makes a
# quantizer's bits), over float32 values x [..., D] in blocks of D's consecutive elements.

MX_BLOCK, NVFP4_BLOCK = 32, 16
FP4_MAX = 6.0
#: NVFP4's least block scale: E4M3's smallest normal, 2^-6
NVFP4_SCALE_FLOOR = 2.0**-6
#: the E2M1 values of the codes 0 .. 7 (bit 3 the sign)
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _f32(x):
    return np.asarray(x, dtype=np.float32)


def _blocks(x, block):
    x = _f32(x)
    return x.reshape(x.shape[:-1] + (x.shape[-1] // block, block))


def _block_amax(g):
    """Each block's largest magnitude, NaN where it holds a NaN (the references' amax)."""
    with np.errstate(invalid="ignore"):
        return np.max(np.abs(g), axis=-1)


def mx_scale_bytes(x, rounding="floor") -> np.ndarray:
    """MXFP8's UE8M0 scale bytes of x's blocks of 32 (uint8, the scale 2^(byte - 127)): 'floor',
    the OCP MX rule, 2^(floor(log2 amax) - 8) from 2^-127 up (8: E4M3's largest power of two);
    'rceil', amax * (1 / 448) (a float32 product) rounded up to a power of two, a float32
    subnormal above 2^-127 only past half of it (cuBLAS's and TransformerEngine's).  A block holding
    a NaN or an infinity: 255 (NaN)."""
    amax = _block_amax(_blocks(x, MX_BLOCK))
    if rounding == "floor":
        e = (amax.view(np.uint32) >> 23).astype(np.int64)
        byte = np.maximum(e - 8, 0)
        return np.where(np.isfinite(amax), byte, 255).astype(np.uint8)
    with np.errstate(invalid="ignore", over="ignore"):
        d = amax * np.float32(1.0 / FP8_MAX)
    bits = d.view(np.uint32).astype(np.int64)
    e, m = bits >> 23, bits & 0x7FFFFF
    up = np.where(e == 0, m > 0x400000, m != 0)
    return np.where(np.isfinite(d), e + up, 255).astype(np.uint8)


def mx_reference(x, rounding="floor"):
    """(E4M3 values, UE8M0 scale bytes) of MXFP8: each value x * 2^(127 - byte), exact, rounded to
    E4M3 saturating (NaN where the scale is)."""
    byte = mx_scale_bytes(x, rounding)
    recip = np.where(byte == 255, np.float32(np.nan), np.exp2(127.0 - byte.astype(np.float64))).astype(np.float32)
    g = _blocks(x, MX_BLOCK)
    with np.errstate(invalid="ignore", over="ignore"):
        v = (g * recip[..., None]).astype(np.float64)
        v = np.where(np.isnan(v), np.nan, np.clip(v, -FP8_MAX, FP8_MAX))
    return v.reshape(np.shape(x)).astype(fp8_dtype()), byte


def e2m1_codes(q) -> np.ndarray:
    """The E2M1 codes of float32 values q: |q| clamped to 6 and rounded to the nearest of
    E2M1_VALUES, ties to the even code, the sign bit kept (-0 too); NaN: 0x3."""
    q = _f32(q)
    a = np.minimum(np.abs(q).astype(np.float64), FP4_MAX)
    mid = (E2M1_VALUES[1:] + E2M1_VALUES[:-1]) / 2  # ties go to the even code: below for odd ones
    code = np.zeros(a.shape, np.int64)
    for c, t in enumerate(mid):
        code += np.where((c % 2 == 0) & (a > t) | (c % 2 == 1) & (a >= t), 1, 0)
    code |= (q.view(np.uint32) >> 28).astype(np.int64) & 0x8
    return np.where(np.isnan(q), 0x3, code).astype(np.uint8)


def nvfp4_reference(x, global_scale=1.0):
    """(packed uint8 [..., D // 2], E4M3 scales [..., D // 16]) of NVFP4 with the global scale g:
    a block's scale amax / 6 / g (each a float32 division), clamped to [2^-6, 448] (NaN kept) and
    rounded to E4M3; its values x * ((1 / g) / scale) as E2M1 codes, the even element in the low
    nibble."""
    g = np.float32(global_scale)
    blocks = _blocks(x, NVFP4_BLOCK)
    amax = _block_amax(blocks)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        s = amax / np.float32(FP4_MAX) / g
        s = np.where(np.isnan(s), s, np.clip(s, np.float32(NVFP4_SCALE_FLOOR), np.float32(FP8_MAX)))
        scale = s.astype(np.float32).astype(fp8_dtype())
        mult = (np.float32(1.0) / g) / scale.astype(np.float32)
        q = (blocks * mult[..., None]).reshape(np.shape(x))
    codes = e2m1_codes(q)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), scale


def swizzle(scales) -> np.ndarray:
    """Scales [rows, heads, blocks] (or [rows, columns]) in the 128 x 4 tiles of cuBLASLt's and
    CUTLASS's block-scaled layout: [ceil(rows / 128), ceil(columns / 4), 512] of the scales' dtype,
    (row, col) at byte (row % 32) * 16 + (row // 32 % 4) * 4 + col % 4 of tile (row // 128, col //
    4), the padding zeros."""
    s = np.asarray(scales)
    s = s.reshape(s.shape[0], -1)
    rows, cols = s.shape
    rt, ct = -(-rows // 128), -(-cols // 4)
    padded = np.zeros((rt * 128, ct * 4), dtype=s.dtype)
    padded[:rows, :cols] = s
    tiles = padded.reshape(rt, 4, 32, ct, 4).transpose(0, 3, 2, 1, 4)  # [rt, ct, row % 32, row // 32 % 4, col % 4]
    return np.ascontiguousarray(tiles).reshape(rt, ct, 512)


def e2m1_values(packed, scales, global_scale=1.0, block=NVFP4_BLOCK) -> np.ndarray:
    """NVFP4 bytes [..., D // 2] and their scales [..., D // 16] decoded to float64 values."""
    p = np.asarray(packed).astype(np.int64)
    codes = np.stack([p & 0xF, p >> 4], axis=-1).reshape(p.shape[:-1] + (p.shape[-1] * 2,))
    v = np.where(codes & 8, -1.0, 1.0) * E2M1_VALUES[codes & 7]
    s = np.repeat(np.asarray(scales).astype(np.float64), block, axis=-1)
    return v * s * float(global_scale)


def as_bytes(x) -> np.ndarray:
    """An array's bytes (uint8 of the same shape): FP8 values and scales as their bits."""
    x = np.asarray(x)
    return x.view(np.uint8) if x.dtype != np.uint8 else x


#: how far (relative) a merge's float32 value may sit from its float64 one: a scale or an E2M1
#: code other than the reference's only where the float64 value is this near the rounding's edge
BLOCK_EDGE = 2.0**-16
#: the E2M1 magnitudes' midpoints, where the rounding to a code changes
E2M1_EDGES = (E2M1_VALUES[1:] + E2M1_VALUES[:-1]) / 2


def _near(a, edge):
    with np.errstate(invalid="ignore"):
        return np.abs(a - edge) <= BLOCK_EDGE * np.abs(edge)


def _near_power_of_two(a):
    with np.errstate(divide="ignore", invalid="ignore"):
        return (a > 0) & _near(a, np.exp2(np.round(np.log2(np.where(a > 0, a, 1.0)))))


def assert_block_close(fmt, rounding, g, out, scales, ref, layout="row_major"):
    """A block-scaled output of a merge against its float64 merge `ref`: each scale the rule's of
    ref's blocks (rounded to float32) but where ref's amax lies at the rule's edge (MXFP8: a power of
    two; NVFP4: between two E4M3 values), there one step off at most; each NVFP4 code the rule's of
    its value over the scale stored but at an E2M1 edge, and each MXFP8 value within one E4M3 step;
    NaN blocks NaN-scaled (NVFP4's codes 0x3); swizzled tiles' padding zeros."""
    ref = np.asarray(ref, np.float64)
    out, scales = as_bytes(out), as_bytes(scales)
    if ref.size == 0:
        return
    block = 32 if fmt == "mxfp8" else 16
    if layout == "swizzled":
        rows = ref.shape[0]
        per = ref.shape[-1] // block
        cols = ref.shape[1] * per
        flat = scales.reshape(scales.shape[0], scales.shape[1], 32, 4, 4).transpose(0, 3, 2, 1, 4)
        flat = flat.reshape(scales.shape[0] * 128, scales.shape[1] * 4)
        padding = flat.copy()
        padding[:rows, :cols] = 0
        assert not padding.any(), ("the tiles' padding is not zeros", np.argwhere(padding)[:5])
        scales = flat[:rows, :cols].reshape(ref.shape[:2] + (per,))
    x = ref.astype(np.float32)
    nan_block = np.isnan(x.reshape(scales.shape + (-1,))).any(-1)
    ok = ~nan_block
    with np.errstate(invalid="ignore"):
        amax = np.max(np.abs(ref.reshape(scales.shape + (-1,))), axis=-1)  # float64
    if fmt == "mxfp8":
        want = mx_scale_bytes(x, rounding).astype(np.int64)
        got = scales.astype(np.int64)
        assert np.array_equal(got == 255, nan_block), "NaN scales"
        edge = _near_power_of_two(amax if rounding == "floor" else amax / FP8_MAX)
        off = ok & (got != want)
        assert np.all(~off | edge & (np.abs(got - want) == 1)), \
            ("scales off the rule's", np.argwhere(off & ~edge)[:5], got[off & ~edge][:5], want[off & ~edge][:5])
        per_element = np.repeat(np.exp2(got.astype(np.float64) - 127), 32, axis=-1)
        assert_fp8_close(out.view(fp8_dtype()), np.where(np.repeat(nan_block, 32, -1), np.nan, ref) / per_element)
        return
    gs = np.float32(1.0 if g is None else g)
    s8 = scales.view(fp8_dtype()).astype(np.float64)
    _, want_s = nvfp4_reference(x, gs)
    w8 = want_s.astype(np.float64)
    assert np.array_equal(np.isnan(s8), nan_block), "NaN scales"
    off = ok & (s8 != w8)
    edge = _near(amax / 6 / float(gs), (s8 + w8) / 2) & (np.abs(s8 - w8) <= 2.0**-3 * np.minimum(s8, w8))
    assert np.all(~off | edge), ("scales off the rule's", np.argwhere(off & ~edge)[:5], s8[off & ~edge][:5],
                                 w8[off & ~edge][:5])
    codes = np.stack([out & 0xF, out >> 4], -1).reshape(ref.shape).astype(np.int64)
    nan_el = np.repeat(nan_block, 16, -1)
    assert np.all(codes[nan_el] & 7 == 3), "NaN blocks' codes"
    # each value over the scale stored, as the rule computes it (float32), and in float64
    stored = np.repeat(np.where(ok, s8, 1.0), 16, -1)
    with np.errstate(invalid="ignore", over="ignore"):
        q = np.where(nan_el, 0, x) * ((np.float32(1) / gs) / stored.astype(np.float32))
        q64 = np.abs(np.where(nan_el, 0, ref) / float(gs) / stored)
    want_codes = e2m1_codes(q.astype(np.float32)).astype(np.int64)
    at_edge = np.any([_near(q64, e) for e in E2M1_EDGES], axis=0) | (q64 <= BLOCK_EDGE)
    wrong = ~nan_el & (codes != want_codes) & ~at_edge
    assert not wrong.any(), ("E2M1 codes off the rule's", np.argwhere(wrong)[:5], codes[wrong][:5],
                             want_codes[wrong][:5], q64[wrong][:5])
