"""FP8 e4m3 outputs of merge, merge_states, merge_varlen and vLLM's merge_attn_states, on every device.

out_dtype="float8_e4m3fn" (or an out array of dtype ml_dtypes.float8_e4m3fn / torch.float8_e4m3fn):
stored = value / output_scale (None means 1; a Python float, or a one-element float32 array on the
op's device), rounded once to nearest-even, saturating to +-448; NaN stays NaN.  The LSE output is
float32 and unaffected by the scale.

The oracle's float64 value is rounded with ml_dtypes; the kernel rounds its float32 value, so the
two may fall on different sides of a tie: one FP8 step of difference is allowed.  Each test takes the
`device` fixture (tests/devices.py): NumPy arrays on the CPU, torch tensors on CUDA.
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
    fp8_reference,
    random_lse,
    random_o,
    random_stacked,
    random_state,
    reference_merge,
    reference_merge_stacked,
    reference_merge_varlen,
)

SCALES = [None, 1.0, 0.25, 3.0, "array"]
FP8 = "float8_e4m3fn"


def scale_arg(device, scale):
    """(the output_scale argument on the device, its value as a float)."""
    if scale is None:
        return None, 1.0
    if scale == "array":
        return device.put(np.array([0.375], np.float32)), 0.375
    return scale, float(scale)


def as_float(x) -> np.ndarray:
    return np.asarray(x).astype(np.float32)


# --------------------------------------------------------------------------------------------------
# merge


@pytest.mark.parametrize("scale", SCALES, ids=str)
@pytest.mark.parametrize("in_dtype", DTYPES)
def test_merge_into_an_allocated_fp8_output(rng, device, in_dtype, scale):
    """Saturating rows and a NaN row among them."""
    o_a, lse_a = random_state(rng, 65, 8, 128, in_dtype)
    o_b, lse_b = random_state(rng, 65, 8, 128, in_dtype)
    o_a[:3] *= 3000  # saturates
    lse_a[5, 2] = np.nan
    arg, s = scale_arg(device, scale)
    out, out_lse = attnmerge.merge(*(device.put(x) for x in (o_a, lse_a, o_b, lse_b)), out_dtype=FP8, output_scale=arg)
    assert out.dtype == device.dtype(FP8) and tuple(out.shape) == o_a.shape and out_lse.dtype == device.dtype("float32")
    ref_o, ref_lse = reference_merge(o_a, lse_a, o_b, lse_b)
    assert_fp8_close(device.get(out), ref_o, s)
    assert_lse_close(device.get(out_lse), ref_lse)


@pytest.mark.parametrize("scale", SCALES, ids=str)
def test_merge_into_a_given_fp8_output(rng, device, scale):
    o_a, lse_a = random_state(rng, 31, 3, 100, "bfloat16")
    o_b, lse_b = random_state(rng, 31, 3, 100, "bfloat16")
    out, out_lse = device.nan((31, 3, 100), FP8), device.nan((31, 3))
    arg, s = scale_arg(device, scale)
    res, res_lse = attnmerge.merge(*(device.put(x) for x in (o_a, lse_a, o_b, lse_b)), out=out, out_lse=out_lse,
                                   output_scale=arg)
    assert res is out and res_lse is out_lse
    ref_o, ref_lse = reference_merge(o_a, lse_a, o_b, lse_b)
    assert_fp8_close(device.get(out), ref_o, s)
    assert_lse_close(device.get(out_lse), ref_lse)


@pytest.mark.parametrize("scale", [1.0, 0.01])
def test_large_values_saturate_to_448(rng, device, scale):
    o_a, lse_a = random_state(rng, 20, 4, 64)
    o_b, lse_b = random_state(rng, 20, 4, 64)
    o_a *= 2000.0
    o_b *= 2000.0
    out, _ = attnmerge.merge(*(device.put(x) for x in (o_a, lse_a, o_b, lse_b)), out_dtype=FP8, output_scale=scale)
    out = device.get(out)
    assert_fp8_close(out, reference_merge(o_a, lse_a, o_b, lse_b)[0], scale)
    v = as_float(out)
    assert not np.isnan(v).any(), "a finite value past the FP8 range became NaN instead of saturating"
    assert np.any(v == 448.0) and np.any(v == -448.0) and np.abs(v).max() == 448.0


def test_exact_values_and_ties_round_to_nearest_even(device):
    """One state per row passes through: its value / scale is stored, ties rounded to even.
    (Every value here is exact in float32, so kernel and oracle agree bit for bit.)"""
    vals = np.array([1.0, 1.0625, 1.1875, 3.25, 17.0, 0.00390625, -2.375, 300.0, 464.0, -1e6, 0.0009765625], np.float32)
    want = np.array([1.0, 1.0, 1.25, 3.25, 16.0, 0.00390625, -2.5, 288.0, 448.0, -448.0, 0.0], np.float64)
    o = vals.reshape(1, 1, -1)
    args = [device.put(x) for x in (o, np.zeros((1, 1), np.float32), np.full_like(o, np.nan),
                                    np.full((1, 1), -np.inf, np.float32))]
    out, _ = attnmerge.merge(*args, out_dtype=FP8)
    out = device.get(out)
    assert np.array_equal(out.astype(np.float64).ravel(), want), out.astype(np.float64).ravel()
    assert np.array_equal(fp8_reference(vals).astype(np.float64), want)
    out, _ = attnmerge.merge(*args, out_dtype=FP8, output_scale=0.5)
    assert np.array_equal(device.get(out).view(np.uint8).ravel(), fp8_reference(vals, 0.5).view(np.uint8).ravel())


def test_nan_stays_nan_and_empty_rows_are_zero(rng, device):
    o_a, lse_a = random_state(rng, 10, 2, 32, "float16")
    o_b, lse_b = random_state(rng, 10, 2, 32, "float16")
    lse_a[2, 1] = np.nan
    lse_a[4] = np.inf
    lse_b[4] = -np.inf
    o_a[4] = np.nan
    o_b[4] = np.nan
    out, out_lse = attnmerge.merge(*(device.put(x) for x in (o_a, lse_a, o_b, lse_b)), out_dtype=FP8, output_scale=2.0)
    out, out_lse = device.get(out), device.get(out_lse)
    v = as_float(out)
    assert np.all(np.isnan(v[2, 1])) and np.isnan(v).sum() == 32
    assert np.all(v[4] == 0.0) and np.all(out_lse[4] == -np.inf)
    ref_o, ref_lse = reference_merge(o_a, lse_a, o_b, lse_b)
    assert_fp8_close(out, ref_o, 2.0)
    assert_lse_close(out_lse, ref_lse)


def test_the_lse_does_not_depend_on_the_scale(rng, device):
    args = [device.put(x) for x in (*random_state(rng, 10, 2, 32), *random_state(rng, 10, 2, 32))]
    _, l1 = attnmerge.merge(*args, out_dtype=FP8, output_scale=0.125)
    _, l2 = attnmerge.merge(*args, out_dtype="float32")
    assert np.array_equal(device.get(l1), device.get(l2))


def test_a_non_fp8_output_takes_a_scale_of_1_which_changes_nothing(rng, device):
    """A scale other than 1 with an output that is not FP8 is refused (the bad-input table); 1 is
    accepted and changes nothing."""
    args = [device.put(x) for x in (*random_state(rng, 8, 3, 16), *random_state(rng, 8, 3, 16))]
    out = device.nan((8, 3, 16))
    attnmerge.merge(*args, out=out, output_scale=1.0)
    want, _ = attnmerge.merge(*args)
    assert np.array_equal(device.get(out), device.get(want))


def test_the_scale_array_is_read_at_call_time(rng, device):
    o_a, lse_a = random_state(rng, 8, 2, 32)
    o_b, lse_b = random_state(rng, 8, 2, 32)
    args = [device.put(x) for x in (o_a, lse_a, o_b, lse_b)]
    scale = device.put(np.array([1.0], np.float32))
    ref_o = reference_merge(o_a, lse_a, o_b, lse_b)[0]
    for s in (1.0, 0.0625, 5.0):
        scale[0] = s
        out, _ = attnmerge.merge(*args, out_dtype=FP8, output_scale=scale)
        assert_fp8_close(device.get(out), ref_o, s)


# --------------------------------------------------------------------------------------------------
# merge_states, merge_varlen


@pytest.mark.parametrize("scale", SCALES, ids=str)
@pytest.mark.parametrize("states_axis", [0, 1])
@pytest.mark.parametrize("s", [0, 1, 3, 8, 64])
def test_merge_states_fp8(rng, device, s, states_axis, scale):
    o, lse = random_stacked(rng, 37, s, 4, 100, "bfloat16", states_axis)
    arg, sv = scale_arg(device, scale)
    out, out_lse = device.nan((37, 4, 100), FP8), device.nan((37, 4))
    attnmerge.merge_states(device.put(o), device.put(lse), out=out, out_lse=out_lse, states_axis=states_axis,
                           output_scale=arg)
    ref_o, ref_lse = reference_merge_stacked(o, lse, states_axis=states_axis)
    assert_fp8_close(device.get(out), ref_o, sv)
    assert_lse_close(device.get(out_lse), ref_lse)


@pytest.mark.parametrize("in_dtype", DTYPES)
def test_merge_states_allocated_fp8(rng, device, in_dtype):
    o, lse = random_stacked(rng, 13, 4, 3, 100, in_dtype)
    out, out_lse = attnmerge.merge_states(device.put(o), device.put(lse), out_dtype=FP8, output_scale=0.5)
    assert out.dtype == device.dtype(FP8) and tuple(out.shape) == (13, 3, 100)
    ref_o, ref_lse = reference_merge_stacked(o, lse)
    assert_fp8_close(device.get(out), ref_o, 0.5)
    assert_lse_close(device.get(out_lse), ref_lse)


@pytest.mark.parametrize("scale", SCALES, ids=str)
@pytest.mark.parametrize("index_dtype", ["int32", "int64"])
def test_merge_varlen_fp8(rng, device, index_dtype, scale):
    counts = [3, 0, 1, 8, 2]
    indptr = np.concatenate([[0], np.cumsum(counts)]).astype(index_dtype)
    o, lse = random_state(rng, int(indptr[-1]), 4, 64, "bfloat16")
    arg, sv = scale_arg(device, scale)
    out, out_lse = attnmerge.merge_varlen(device.put(o), device.put(lse), device.put(indptr), out_dtype=FP8,
                                          output_scale=arg)
    assert out.dtype == device.dtype(FP8) and tuple(out.shape) == (5, 4, 64)
    out = device.get(out)
    ref_o, ref_lse = reference_merge_varlen(o, lse, indptr)
    assert_fp8_close(out, ref_o, sv)
    assert_lse_close(device.get(out_lse), ref_lse)
    assert np.all(as_float(out[1]) == 0.0)


# --------------------------------------------------------------------------------------------------
# vLLM's merge_attn_states with output_scale


def vllm_inputs(rng, t, h, d, dtype):
    return dict(
        prefix_output=random_o(rng, (t, h, d), dtype), prefix_lse=random_lse(rng, (h, t)),
        suffix_output=random_o(rng, (t, h, d), dtype), suffix_lse=random_lse(rng, (h, t)),
    )


@pytest.mark.parametrize("in_dtype", DTYPES)
@pytest.mark.parametrize("k", [None, 9, 40])
def test_vllm_output_scale(rng, device, in_dtype, k):
    t, h, d = 77, 8, 128
    x = vllm_inputs(rng, t, h, d, in_dtype)
    output, output_lse = device.nan((t, h, d), FP8), device.nan((h, t))
    merge_attn_states(output, **{k_: device.put(v) for k_, v in x.items()}, output_lse=output_lse,
                      prefill_tokens_with_context=k, output_scale=device.put(np.array([0.75], np.float32)))
    ref_o, ref_lse = reference_merge(
        x["prefix_output"], x["prefix_lse"].T, x["suffix_output"], x["suffix_lse"].T, a_tokens=k
    )
    assert_fp8_close(device.get(output), ref_o, 0.75, "output")
    assert_lse_close(device.get(output_lse).T, ref_lse, "output_lse")


def test_vllm_output_scale_without_output_lse(rng, device):
    t, h, d = 5, 2, 64
    x = vllm_inputs(rng, t, h, d, "float16")
    output = device.nan((t, h, d), FP8)
    merge_attn_states(output, **{k: device.put(v) for k, v in x.items()}, output_lse=None,
                      output_scale=device.put(np.array([2.0], np.float32)))
    ref_o, _ = reference_merge(x["prefix_output"], x["prefix_lse"].T, x["suffix_output"], x["suffix_lse"].T)
    assert_fp8_close(device.get(output), ref_o, 2.0, "output")
