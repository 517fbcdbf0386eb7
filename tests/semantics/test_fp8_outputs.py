"""FP8 e4m3 output on the CPU: merge, merge_states, merge_varlen and vLLM's merge_attn_states.

out_dtype="float8_e4m3fn" (or an out array of dtype ml_dtypes.float8_e4m3fn / torch.float8_e4m3fn):
stored = value / output_scale (None means 1; a Python float, or a one-element float32 array on the
op's device), rounded once to nearest-even, saturating to +-448; NaN stays NaN.  The LSE output is
float32 and unaffected by the scale.

The oracle's float64 value is rounded with ml_dtypes; the kernel rounds its float32 value, so the
two may fall on different sides of a tie: one FP8 step of difference is allowed.
"""

from __future__ import annotations

import numpy as np
import pytest

import attnmerge
from attnmerge.compat.vllm import merge_attn_states
from oracle import (
    DTYPES,
    assert_fp8_close,
    assert_lse_close,
    fp8_dtype,
    fp8_reference,
    nan_array,
    random_lse,
    random_o,
    random_stacked,
    random_state,
    reference_merge,
    reference_merge_stacked,
    reference_merge_varlen,
)

SCALES = [None, 1.0, 0.25, 3.0, "array"]


def scale_arg(scale):
    """(the output_scale argument, its value as a float)."""
    if scale is None:
        return None, 1.0
    if scale == "array":
        return np.array([0.375], np.float32), 0.375
    return scale, float(scale)


def fp8_nan(shape):
    return nan_array(shape, fp8_dtype())


# --------------------------------------------------------------------------------------------------
# merge


@pytest.mark.parametrize("scale", SCALES, ids=str)
@pytest.mark.parametrize("in_dtype", DTYPES)
def test_merge_into_an_allocated_fp8_output(rng, in_dtype, scale):
    o_a, lse_a = random_state(rng, 29, 4, 72, in_dtype)
    o_b, lse_b = random_state(rng, 29, 4, 72, in_dtype)
    arg, s = scale_arg(scale)
    out, out_lse = attnmerge.merge(o_a, lse_a, o_b, lse_b, out_dtype="float8_e4m3fn", output_scale=arg)
    assert out.dtype == fp8_dtype() and out.shape == o_a.shape and out_lse.dtype == np.float32
    ref_o, ref_lse = reference_merge(o_a, lse_a, o_b, lse_b)
    assert_fp8_close(out, ref_o, s)
    assert_lse_close(out_lse, ref_lse)


@pytest.mark.parametrize("scale", SCALES, ids=str)
def test_merge_into_a_given_fp8_output(rng, scale):
    o_a, lse_a = random_state(rng, 31, 3, 100, "bfloat16")
    o_b, lse_b = random_state(rng, 31, 3, 100, "bfloat16")
    out, out_lse = fp8_nan((31, 3, 100)), nan_array((31, 3))
    arg, s = scale_arg(scale)
    res, res_lse = attnmerge.merge(o_a, lse_a, o_b, lse_b, out=out, out_lse=out_lse, output_scale=arg)
    assert res is out and res_lse is out_lse
    ref_o, ref_lse = reference_merge(o_a, lse_a, o_b, lse_b)
    assert_fp8_close(out, ref_o, s)
    assert_lse_close(out_lse, ref_lse)


@pytest.mark.parametrize("scale", [1.0, 0.01])
def test_large_values_saturate_to_448(rng, scale):
    o_a, lse_a = random_state(rng, 20, 4, 64)
    o_b, lse_b = random_state(rng, 20, 4, 64)
    o_a *= 2000.0
    o_b *= 2000.0
    out, _ = attnmerge.merge(o_a, lse_a, o_b, lse_b, out_dtype="float8_e4m3fn", output_scale=scale)
    ref_o = reference_merge(o_a, lse_a, o_b, lse_b)[0]
    assert_fp8_close(out, ref_o, scale)
    v = out.astype(np.float32)
    assert not np.isnan(v).any(), "a finite value past the FP8 range became NaN instead of saturating"
    assert np.any(v == 448.0) and np.any(v == -448.0) and np.abs(v).max() == 448.0


def test_exact_values_and_ties_round_to_nearest_even():
    """One state per row passes through: its value / scale is stored, ties rounded to even.
    (Every value here is exact in float32, so kernel and oracle agree bit for bit.)"""
    vals = np.array([1.0, 1.0625, 1.1875, 3.25, 17.0, 0.00390625, -2.375, 300.0, 464.0, -1e6, 0.0009765625], np.float32)
    want = np.array([1.0, 1.0, 1.25, 3.25, 16.0, 0.00390625, -2.5, 288.0, 448.0, -448.0, 0.0], np.float64)
    o = vals.reshape(1, 1, -1)
    lse = np.zeros((1, 1), np.float32)
    empty = np.full((1, 1), -np.inf, np.float32)
    out, _ = attnmerge.merge(o, lse, np.full_like(o, np.nan), empty, out_dtype="float8_e4m3fn")
    assert np.array_equal(out.astype(np.float64).ravel(), want), out.astype(np.float64).ravel()
    assert np.array_equal(fp8_reference(vals).astype(np.float64), want)
    out, _ = attnmerge.merge(o, lse, np.full_like(o, np.nan), empty, out_dtype="float8_e4m3fn", output_scale=0.5)
    assert np.array_equal(out.view(np.uint8).ravel(), fp8_reference(vals, 0.5).view(np.uint8).ravel())


def test_nan_stays_nan_and_empty_rows_are_zero(rng):
    o_a, lse_a = random_state(rng, 10, 2, 32, "float16")
    o_b, lse_b = random_state(rng, 10, 2, 32, "float16")
    lse_a[2, 1] = np.nan
    lse_a[4] = np.inf
    lse_b[4] = -np.inf
    o_a[4] = np.nan
    o_b[4] = np.nan
    out, out_lse = attnmerge.merge(o_a, lse_a, o_b, lse_b, out_dtype="float8_e4m3fn", output_scale=2.0)
    v = out.astype(np.float32)
    assert np.all(np.isnan(v[2, 1])) and np.isnan(v).sum() == 32
    assert np.all(v[4] == 0.0) and np.all(out_lse[4] == -np.inf)
    ref_o, ref_lse = reference_merge(o_a, lse_a, o_b, lse_b)
    assert_fp8_close(out, ref_o, 2.0)
    assert_lse_close(out_lse, ref_lse)


def test_the_lse_does_not_depend_on_the_scale(rng):
    o_a, lse_a = random_state(rng, 10, 2, 32)
    o_b, lse_b = random_state(rng, 10, 2, 32)
    _, l1 = attnmerge.merge(o_a, lse_a, o_b, lse_b, out_dtype="float8_e4m3fn", output_scale=0.125)
    _, l2 = attnmerge.merge(o_a, lse_a, o_b, lse_b, out_dtype="float32")
    assert np.array_equal(l1, l2)


def test_the_scale_array_is_read_at_call_time(rng):
    o_a, lse_a = random_state(rng, 8, 2, 32)
    o_b, lse_b = random_state(rng, 8, 2, 32)
    scale = np.array([1.0], np.float32)
    ref_o = reference_merge(o_a, lse_a, o_b, lse_b)[0]
    for s in (1.0, 0.0625, 5.0):
        scale[0] = s
        out, _ = attnmerge.merge(o_a, lse_a, o_b, lse_b, out_dtype="float8_e4m3fn", output_scale=scale)
        assert_fp8_close(out, ref_o, s)


# --------------------------------------------------------------------------------------------------
# merge_states, merge_varlen


@pytest.mark.parametrize("scale", SCALES, ids=str)
@pytest.mark.parametrize("states_axis", [0, 1])
@pytest.mark.parametrize("s", [0, 1, 3, 8, 64])
def test_merge_states_fp8(rng, s, states_axis, scale):
    o, lse = random_stacked(rng, 13, s, 3, 40, "float16", states_axis)
    arg, sv = scale_arg(scale)
    out, out_lse = fp8_nan((13, 3, 40)), nan_array((13, 3))
    attnmerge.merge_states(o, lse, out=out, out_lse=out_lse, states_axis=states_axis, output_scale=arg)
    ref_o, ref_lse = reference_merge_stacked(o, lse, states_axis=states_axis)
    assert_fp8_close(out, ref_o, sv)
    assert_lse_close(out_lse, ref_lse)


@pytest.mark.parametrize("in_dtype", DTYPES)
def test_merge_states_allocated_fp8(rng, in_dtype):
    o, lse = random_stacked(rng, 13, 4, 3, 100, in_dtype)
    out, out_lse = attnmerge.merge_states(o, lse, out_dtype="float8_e4m3fn", output_scale=0.5)
    assert out.dtype == fp8_dtype() and out.shape == (13, 3, 100)
    ref_o, ref_lse = reference_merge_stacked(o, lse)
    assert_fp8_close(out, ref_o, 0.5)
    assert_lse_close(out_lse, ref_lse)


@pytest.mark.parametrize("scale", SCALES, ids=str)
@pytest.mark.parametrize("index_dtype", ["int32", "int64"])
def test_merge_varlen_fp8(rng, index_dtype, scale):
    counts = [3, 0, 1, 8, 2]
    indptr = np.concatenate([[0], np.cumsum(counts)]).astype(index_dtype)
    o, lse = random_state(rng, int(indptr[-1]), 4, 64, "bfloat16")
    arg, sv = scale_arg(scale)
    out, out_lse = attnmerge.merge_varlen(o, lse, indptr, out_dtype="float8_e4m3fn", output_scale=arg)
    assert out.dtype == fp8_dtype() and out.shape == (5, 4, 64)
    ref_o, ref_lse = reference_merge_varlen(o, lse, indptr)
    assert_fp8_close(out, ref_o, sv)
    assert_lse_close(out_lse, ref_lse)
    assert np.all(out[1].astype(np.float32) == 0.0)


# --------------------------------------------------------------------------------------------------
# vLLM's merge_attn_states with output_scale


@pytest.mark.parametrize("in_dtype", DTYPES)
@pytest.mark.parametrize("k", [None, 9])
def test_vllm_output_scale(rng, in_dtype, k):
    t, h, d = 21, 4, 128
    x = dict(
        prefix_output=random_o(rng, (t, h, d), in_dtype), prefix_lse=random_lse(rng, (h, t)),
        suffix_output=random_o(rng, (t, h, d), in_dtype), suffix_lse=random_lse(rng, (h, t)),
    )
    output = fp8_nan((t, h, d))
    output_lse = nan_array((h, t))
    scale = np.array([0.75], np.float32)
    merge_attn_states(output, **x, output_lse=output_lse, prefill_tokens_with_context=k, output_scale=scale)
    ref_o, ref_lse = reference_merge(
        x["prefix_output"], x["prefix_lse"].T, x["suffix_output"], x["suffix_lse"].T, a_tokens=k
    )
    assert_fp8_close(output, ref_o, 0.75, "output")
    assert_lse_close(output_lse.T, ref_lse, "output_lse")


def test_vllm_output_scale_without_output_lse(rng):
    t, h, d = 5, 2, 64
    x = dict(
        prefix_output=random_o(rng, (t, h, d), "float16"), prefix_lse=random_lse(rng, (h, t)),
        suffix_output=random_o(rng, (t, h, d), "float16"), suffix_lse=random_lse(rng, (h, t)),
    )
    output = fp8_nan((t, h, d))
    merge_attn_states(output, **x, output_lse=None, output_scale=np.array([2.0], np.float32))
    ref_o, _ = reference_merge(x["prefix_output"], x["prefix_lse"].T, x["suffix_output"], x["suffix_lse"].T)
    assert_fp8_close(output, ref_o, 2.0, "output")


# --------------------------------------------------------------------------------------------------
# torch CPU tensors


def _torch_fp8_to_numpy(t):
    torch = pytest.importorskip("torch")
    return t.view(torch.uint8).numpy().view(fp8_dtype())


def test_torch_float8_output_and_scale_tensor(rng):
    torch = pytest.importorskip("torch")
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("this torch has no float8_e4m3fn")
    o_a, lse_a = random_state(rng, 12, 3, 64)
    o_b, lse_b = random_state(rng, 12, 3, 64)
    t = [torch.from_numpy(x) for x in (o_a, lse_a, o_b, lse_b)]
    out, out_lse = attnmerge.merge(*t, out_dtype=torch.float8_e4m3fn, output_scale=torch.tensor([0.5]))
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float8_e4m3fn
    ref_o, ref_lse = reference_merge(o_a, lse_a, o_b, lse_b)
    assert_fp8_close(_torch_fp8_to_numpy(out), ref_o, 0.5)
    given = torch.full((12, 3, 64), float("nan")).to(torch.float8_e4m3fn)
    attnmerge.merge(*t, out=given)
    assert_fp8_close(_torch_fp8_to_numpy(given), ref_o, 1.0)
