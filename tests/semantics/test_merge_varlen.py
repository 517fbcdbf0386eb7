"""attnmerge.merge_varlen: a variable number of states per row, on every device.

merge_varlen(o, lse, indptr, *, out=None, out_lse=None, return_lse=True, out_dtype=None,
             output_scale=None, base="e", stream=None) -> (out, out_lse)

indptr (int32 or int64, [rows + 1]): row r merges states indptr[r] .. indptr[r+1]-1 of
o [total, heads, D], lse [total, heads]; a row with no states is O = 0, LSE = -inf.
A bad indptr (a negative start, a decrease, an end past total) is refused on the CPU (a row of the
bad-input table, tests/errors/) and clamped on the GPU, which does not read indptr back
(test_a_bad_indptr_on_the_gpu_is_clamped).

Each test takes the `device` fixture (tests/devices.py): NumPy arrays on the CPU, torch tensors on
CUDA.
"""

from __future__ import annotations

import numpy as np
import pytest

import attnmerge
import devices
from oracle import (
    DTYPES,
    assert_merge_matches,
    assert_o_close,
    clamp_indptr,
    nan_array,
    random_state,
    reference_merge_ranges,
    reference_merge_stacked,
    reference_merge_varlen,
    strided_view,
    to_f64,
)

INDEX_DTYPES = ("int32", "int64")


def make_indptr(counts, dtype="int32", start=0):
    return np.concatenate([[start], start + np.cumsum(counts)]).astype(dtype)


def problem(rng, counts, heads=3, head_size=40, dtype="float32", index_dtype="int32", extra=0):
    """States for rows of the given counts (plus `extra` unused states at the end), and indptr."""
    indptr = make_indptr(counts, index_dtype)
    o, lse = random_state(rng, int(indptr[-1]) + extra, heads, head_size, dtype)
    return o, lse, indptr


def call(device, o, lse, indptr, out_dtype=None, **kw):
    """merge_varlen of host arrays on the device into NaN-poisoned given outputs; returns them read back."""
    rows = len(indptr) - 1
    out = device.nan((rows,) + o.shape[1:], out_dtype or o.dtype)
    out_lse = device.nan((rows, o.shape[1]))
    res, res_lse = attnmerge.merge_varlen(device.put(o), device.put(lse), device.put(indptr), out=out, out_lse=out_lse,
                                          **kw)
    assert res is out and res_lse is out_lse
    return device.get(out), device.get(out_lse)


@pytest.mark.parametrize("index_dtype", INDEX_DTYPES)
def test_rows_of_different_lengths(rng, device, index_dtype):
    counts = [1, 2, 3, 8, 0, 5, 64, 1, 0, 0, 17, 256, 4]
    o, lse, indptr = problem(rng, counts, index_dtype=index_dtype)
    out, out_lse = call(device, o, lse, indptr)
    assert_merge_matches(out, out_lse, reference_merge_varlen(o, lse, indptr), "float32")


@pytest.mark.parametrize("index_dtype", INDEX_DTYPES)
def test_rows_with_no_states_are_zero_and_minus_inf(rng, device, index_dtype):
    counts = [0, 3, 0, 0, 2, 0]
    o, lse, indptr = problem(rng, counts, index_dtype=index_dtype)
    out, out_lse = call(device, o, lse, indptr)
    empty = np.array(counts) == 0
    assert np.all(out[empty] == 0.0) and np.all(out_lse[empty] == -np.inf)
    assert_merge_matches(out, out_lse, reference_merge_varlen(o, lse, indptr), "float32")


def test_every_row_empty_with_no_states_at_all(rng, device):
    o, lse = random_state(rng, 0, 2, 16)
    out, out_lse = call(device, o, lse, np.zeros(5, np.int32))
    assert np.all(out == 0.0) and np.all(out_lse == -np.inf)


def test_zero_rows(rng, device):
    o, lse = random_state(rng, 4, 2, 16)
    out, out_lse = attnmerge.merge_varlen(device.put(o), device.put(lse), device.put(np.zeros(1, np.int64)))
    assert tuple(out.shape) == (0, 2, 16) and tuple(out_lse.shape) == (0, 2)


def test_states_outside_indptr_are_not_read(rng, device):
    """indptr need not start at 0 nor end at total: states before and after are never read."""
    o, lse = random_state(rng, 30, 3, 32)
    indptr = np.array([4, 6, 6, 13, 25], np.int64)
    o[:4] = np.nan
    lse[:4] = np.nan
    o[25:] = np.nan
    lse[25:] = np.nan
    out, out_lse = call(device, o, lse, indptr)
    assert not np.isnan(out).any() and not np.isnan(out_lse).any()
    assert_merge_matches(out, out_lse, reference_merge_varlen(o, lse, indptr), "float32")


@pytest.mark.parametrize("index_dtype", INDEX_DTYPES)
def test_uniform_rows_equal_merge_states(rng, device, index_dtype):
    t, s, h, d = 12, 5, 4, 64
    o, lse = random_state(rng, t * s, h, d)
    indptr = np.arange(0, t * s + 1, s).astype(index_dtype)
    out, out_lse = call(device, o, lse, indptr)
    o4, lse3 = o.reshape(t, s, h, d), lse.reshape(t, s, h)
    assert_merge_matches(out, out_lse, reference_merge_stacked(o4, lse3), "float32")
    ms, _ = attnmerge.merge_states(device.put(o4), device.put(lse3))
    assert_o_close(out, to_f64(device.get(ms)), "float32")


# --------------------------------------------------------------------------------------------------
# dtypes, head sizes, views


@pytest.mark.parametrize("index_dtype", INDEX_DTYPES)
@pytest.mark.parametrize("out_dtype", DTYPES)
@pytest.mark.parametrize("in_dtype", DTYPES)
def test_every_dtype_pair(rng, device, in_dtype, out_dtype, index_dtype):
    """Rows of 0 to 256 states, an empty state and a NaN LSE among them."""
    counts = [1, 2, 3, 8, 0, 64, 0, 256, 5, 1]
    o, lse, indptr = problem(rng, counts, heads=4, head_size=72, dtype=in_dtype, index_dtype=index_dtype)
    lse[3] = np.inf
    o[3] = np.nan
    lse[20, 2] = np.nan
    out, out_lse = call(device, o, lse, indptr, out_dtype=out_dtype)
    assert_merge_matches(out, out_lse, reference_merge_varlen(o, lse, indptr), out_dtype)
    assert np.all(to_f64(out[4]) == 0) and np.all(out_lse[6] == -np.inf)


@pytest.mark.parametrize("out_dtype", DTYPES)
def test_allocated_outputs(rng, device, out_dtype):
    o, lse, indptr = problem(rng, [3, 1, 0, 4], dtype="bfloat16", index_dtype="int64")
    out, out_lse = attnmerge.merge_varlen(device.put(o), device.put(lse), device.put(indptr), out_dtype=out_dtype)
    assert device.is_mine(out) and out.dtype == device.dtype(out_dtype) and tuple(out.shape) == (4, 3, 40)
    assert out_lse.dtype == device.dtype("float32") and tuple(out_lse.shape) == (4, 3)
    assert_merge_matches(device.get(out), device.get(out_lse), reference_merge_varlen(o, lse, indptr), out_dtype)


def test_the_output_dtype_defaults_to_the_input_dtype(rng, device):
    o, lse, indptr = problem(rng, [2, 2], dtype="float16")
    out, _ = attnmerge.merge_varlen(device.put(o), device.put(lse), device.put(indptr))
    assert out.dtype == device.dtype("float16")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size", (1, 3, 100, 128))
def test_odd_head_sizes(rng, device, head_size, dtype):
    """Into given outputs, and into allocated ones over 300 rows of 0 to 8 states."""
    o, lse, indptr = problem(rng, [1, 2, 3, 8, 0, 4], head_size=head_size, dtype=dtype)
    out, out_lse = call(device, o, lse, indptr)
    assert_merge_matches(out, out_lse, reference_merge_varlen(o, lse, indptr), dtype)
    o, lse, indptr = problem(rng, rng.integers(0, 9, size=300), head_size=head_size, dtype=dtype, index_dtype="int64")
    out, out_lse = attnmerge.merge_varlen(device.put(o), device.put(lse), device.put(indptr))
    assert device.is_mine(out) and tuple(out.shape) == (300, 3, head_size)
    assert_merge_matches(device.get(out), device.get(out_lse), reference_merge_varlen(o, lse, indptr), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_views(rng, device, dtype):
    """Heads-outermost unaligned states, a strided indptr, every other output row padded; nothing
    outside the output views is written."""
    o0, lse0, indptr0 = problem(rng, [2, 0, 5, 1, 3], heads=4, head_size=40, dtype=dtype)
    o, _ = device.strided(*strided_view(o0, order=(1, 0, 2), offset=1, pad=2))  # heads outermost, unaligned
    lse, _ = device.strided(*strided_view(lse0, order=(1, 0)))
    ibuf = np.full(2 * len(indptr0), -7, np.int32)
    np_indptr = ibuf[::2]  # a strided indptr
    np_indptr[...] = indptr0
    indptr, _ = device.strided(np_indptr, ibuf)
    np_out = strided_view(nan_array((5, 4, 40), dtype), steps={0: 2}, pad=3)
    np_out_lse = strided_view(nan_array((5, 4)), order=(1, 0))
    out, out_buf = device.strided(*np_out)
    out_lse, out_lse_buf = device.strided(*np_out_lse)
    attnmerge.merge_varlen(o, lse, indptr, out=out, out_lse=out_lse)
    got, clean = device.readback(*np_out, out, out_buf)
    got_lse, clean_lse = device.readback(*np_out_lse, out_lse, out_lse_buf)
    assert_merge_matches(got, got_lse, reference_merge_varlen(o0, lse0, indptr0), dtype)
    assert clean and clean_lse, "wrote outside the output views"


# --------------------------------------------------------------------------------------------------
# semantics


@pytest.mark.parametrize("dtype", DTYPES)
def test_empty_parts_and_nan_rows(rng, device, dtype):
    counts = [3, 3, 3, 3, 1, 2]
    o, lse, indptr = problem(rng, counts, dtype=dtype)
    lse[0] = np.inf  # row 0: one empty part, NaN in its O
    o[0] = np.nan
    lse[3:6] = -np.inf  # row 1: every part empty: 0, -inf
    lse[4] = np.inf
    o[3:6] = np.nan
    lse[7, 1] = np.nan  # row 2, head 1: NaN
    lse[12] = np.inf  # row 4: its only part empty
    o[12] = np.nan
    out, out_lse = call(device, o, lse, indptr)
    assert np.all(to_f64(out[1]) == 0) and np.all(out_lse[1] == -np.inf)
    assert np.all(to_f64(out[4]) == 0) and np.all(out_lse[4] == -np.inf)
    assert np.isnan(out_lse).sum() == 1 and np.isnan(out_lse[2, 1])
    assert_merge_matches(out, out_lse, reference_merge_varlen(o, lse, indptr), dtype)


def test_base_2_and_return_lse_false(rng, device):
    o, lse, indptr = problem(rng, [4, 0, 2, 9], index_dtype="int64")
    args = [device.put(x) for x in (o, lse, indptr)]
    out, out_lse = attnmerge.merge_varlen(*args, base=2)
    assert_merge_matches(device.get(out), device.get(out_lse), reference_merge_varlen(o, lse, indptr, base=2), "float32")
    out, out_lse = attnmerge.merge_varlen(*args, return_lse=False)
    assert out_lse is None
    assert_o_close(device.get(out), reference_merge_varlen(o, lse, indptr)[0], "float32")


def test_a_large_merge_with_a_mean_of_four_states(rng, device):
    counts = rng.integers(0, 9, size=1500)
    o, lse, indptr = problem(rng, counts, heads=8, head_size=128, index_dtype="int64")
    out, out_lse = attnmerge.merge_varlen(device.put(o), device.put(lse), device.put(indptr), out_dtype="bfloat16")
    assert_merge_matches(device.get(out), device.get(out_lse), reference_merge_varlen(o, lse, indptr), "bfloat16")


# --------------------------------------------------------------------------------------------------
# a bad indptr on the GPU: clamped, never read back

BAD_INDPTR = {
    "negative_first": [-3, 2, 5, 10],
    "decreasing": [0, 5, 2, 10],
    "past_total": [0, 3, 100, 7],
    "all_past_total": [50, 60, 70],
    "very_negative": [-(2**31), 4, -(2**31), 10],
    "huge": [0, 2**31 - 1, 5, 2**31 - 1],
}


@pytest.mark.parametrize("device", devices.CUDA_ONLY, indirect=True)
@pytest.mark.parametrize("index_dtype", INDEX_DTYPES)
@pytest.mark.parametrize("case", list(BAD_INDPTR))
def test_a_bad_indptr_on_the_gpu_is_clamped(rng, device, case, index_dtype):
    """No error and no out-of-bounds access: row r takes states
    [clamp(indptr[r], 0, total), clamp(indptr[r+1], that, total)); crossed bounds give an empty row.
    The states are a view into a NaN-filled buffer, so a read outside them would show as NaN, and the
    output is a view into a NaN-filled buffer, so a write outside it would too."""
    device.gpu_only()
    total, h, d = 10, 3, 64
    o0, lse0 = random_state(rng, total, h, d)
    o_buf, lse_buf = nan_array((total + 40, h, d)), nan_array((total + 40, h))
    o_buf[20 : 20 + total], lse_buf[20 : 20 + total] = o0, lse0
    o, _ = device.strided(o_buf[20 : 20 + total], o_buf)
    lse, _ = device.strided(lse_buf[20 : 20 + total], lse_buf)
    indptr = np.array(BAD_INDPTR[case], np.int64).astype(index_dtype)
    rows = len(indptr) - 1
    out_host, out_lse_host = nan_array((rows + 8, h, d)), nan_array((rows + 8, h))
    out, out_buf = device.strided(out_host[4 : 4 + rows], out_host)
    out_lse, out_lse_buf = device.strided(out_lse_host[4 : 4 + rows], out_lse_host)
    attnmerge.merge_varlen(o, lse, device.put(indptr), out=out, out_lse=out_lse)
    got, clean = device.readback(out_host[4 : 4 + rows], out_host, out, out_buf)
    got_lse, clean_lse = device.readback(out_lse_host[4 : 4 + rows], out_lse_host, out_lse, out_lse_buf)
    ref = reference_merge_ranges(o0, lse0, clamp_indptr(indptr, total))
    assert_merge_matches(got, got_lse, ref, "float32")
    assert clean and clean_lse, "wrote outside the output views"
    # the device is still healthy
    assert float(device.torch.ones(4, device="cuda").sum()) == 4.0
