"""attnmerge.merge_varlen on the CPU (NumPy arrays): a variable number of states per row.

merge_varlen(o, lse, indptr, *, out=None, out_lse=None, return_lse=True, out_dtype=None,
             output_scale=None, base="e", stream=None) -> (out, out_lse)

indptr (int32 or int64, [rows + 1]): row r merges states indptr[r] .. indptr[r+1]-1 of
o [total, heads, D], lse [total, heads]; a row with no states is O = 0, LSE = -inf.
On the CPU a bad indptr (a negative start, a decrease, an end past total) raises ValueError naming
"indptr", and nothing is written.
"""

from __future__ import annotations

import numpy as np
import pytest

import attnmerge
from oracle import (
    DTYPES,
    all_nan,
    assert_merge_matches,
    assert_o_close,
    nan_array,
    np_dtype,
    outside_view_is_nan,
    random_state,
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


def call(o, lse, indptr, out_dtype=None, **kw):
    rows = len(indptr) - 1
    out = nan_array((rows,) + o.shape[1:], out_dtype or o.dtype)
    out_lse = nan_array((rows, o.shape[1]))
    res, res_lse = attnmerge.merge_varlen(o, lse, indptr, out=out, out_lse=out_lse, **kw)
    assert res is out and res_lse is out_lse
    return out, out_lse


@pytest.mark.parametrize("index_dtype", INDEX_DTYPES)
def test_rows_of_different_lengths(rng, index_dtype):
    counts = [1, 2, 3, 8, 0, 5, 64, 1, 0, 0, 17, 256, 4]
    o, lse, indptr = problem(rng, counts, index_dtype=index_dtype)
    out, out_lse = call(o, lse, indptr)
    assert_merge_matches(out, out_lse, reference_merge_varlen(o, lse, indptr), "float32")


@pytest.mark.parametrize("index_dtype", INDEX_DTYPES)
def test_rows_with_no_states_are_zero_and_minus_inf(rng, index_dtype):
    counts = [0, 3, 0, 0, 2, 0]
    o, lse, indptr = problem(rng, counts, index_dtype=index_dtype)
    out, out_lse = call(o, lse, indptr)
    empty = np.array(counts) == 0
    assert np.all(out[empty] == 0.0) and np.all(out_lse[empty] == -np.inf)
    assert_merge_matches(out, out_lse, reference_merge_varlen(o, lse, indptr), "float32")


def test_every_row_empty_with_no_states_at_all(rng):
    o, lse = random_state(rng, 0, 2, 16)
    out, out_lse = call(o, lse, np.zeros(5, np.int32))
    assert np.all(out == 0.0) and np.all(out_lse == -np.inf)


def test_zero_rows(rng):
    o, lse = random_state(rng, 4, 2, 16)
    out, out_lse = attnmerge.merge_varlen(o, lse, np.zeros(1, np.int64))
    assert out.shape == (0, 2, 16) and out_lse.shape == (0, 2)


def test_states_outside_indptr_are_not_read(rng):
    """indptr need not start at 0 nor end at total: states before and after are never read."""
    o, lse = random_state(rng, 30, 3, 32)
    indptr = np.array([4, 6, 6, 13, 25], np.int64)
    o[:4] = np.nan
    lse[:4] = np.nan
    o[25:] = np.nan
    lse[25:] = np.nan
    out, out_lse = call(o, lse, indptr)
    assert not np.isnan(out).any() and not np.isnan(out_lse).any()
    assert_merge_matches(out, out_lse, reference_merge_varlen(o, lse, indptr), "float32")


@pytest.mark.parametrize("index_dtype", INDEX_DTYPES)
def test_uniform_rows_equal_merge_states(rng, index_dtype):
    t, s, h, d = 12, 5, 4, 64
    o, lse = random_state(rng, t * s, h, d)
    indptr = np.arange(0, t * s + 1, s).astype(index_dtype)
    out, out_lse = call(o, lse, indptr)
    o4, lse3 = o.reshape(t, s, h, d), lse.reshape(t, s, h)
    assert_merge_matches(out, out_lse, reference_merge_stacked(o4, lse3), "float32")
    ms, ms_lse = attnmerge.merge_states(o4, lse3)
    assert_o_close(out, to_f64(ms), "float32")


# --------------------------------------------------------------------------------------------------
# dtypes, head sizes, views


@pytest.mark.parametrize("out_dtype", DTYPES)
@pytest.mark.parametrize("in_dtype", DTYPES)
def test_every_dtype_pair(rng, in_dtype, out_dtype):
    o, lse, indptr = problem(rng, [3, 1, 0, 4, 2, 7], heads=4, head_size=72, dtype=in_dtype)
    out, out_lse = call(o, lse, indptr, out_dtype=out_dtype)
    assert_merge_matches(out, out_lse, reference_merge_varlen(o, lse, indptr), out_dtype)


@pytest.mark.parametrize("out_dtype", DTYPES)
def test_allocated_outputs(rng, out_dtype):
    o, lse, indptr = problem(rng, [3, 1, 0, 4], dtype="bfloat16", index_dtype="int64")
    out, out_lse = attnmerge.merge_varlen(o, lse, indptr, out_dtype=out_dtype)
    assert isinstance(out, np.ndarray) and out.dtype == np_dtype(out_dtype) and out.shape == (4, 3, 40)
    assert out_lse.dtype == np.float32 and out_lse.shape == (4, 3)
    assert_merge_matches(out, out_lse, reference_merge_varlen(o, lse, indptr), out_dtype)


def test_the_output_dtype_defaults_to_the_input_dtype(rng):
    o, lse, indptr = problem(rng, [2, 2], dtype="float16")
    out, _ = attnmerge.merge_varlen(o, lse, indptr)
    assert out.dtype == np.float16


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size", (1, 3, 100, 128))
def test_odd_head_sizes(rng, head_size, dtype):
    o, lse, indptr = problem(rng, [1, 2, 3, 8, 0, 4], head_size=head_size, dtype=dtype)
    out, out_lse = call(o, lse, indptr)
    assert_merge_matches(out, out_lse, reference_merge_varlen(o, lse, indptr), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_views(rng, dtype):
    o0, lse0, indptr0 = problem(rng, [2, 0, 5, 1, 3], heads=4, head_size=40, dtype=dtype)
    o, _ = strided_view(o0, order=(1, 0, 2), offset=1, pad=2)  # heads outermost, unaligned
    lse, _ = strided_view(lse0, order=(1, 0))
    ibuf = np.full(2 * len(indptr0), -7, np.int32)
    indptr = ibuf[::2]  # a strided indptr
    indptr[...] = indptr0
    out, out_buf = strided_view(nan_array((5, 4, 40), dtype), steps={0: 2}, pad=3)
    out_lse, out_lse_buf = strided_view(nan_array((5, 4)), order=(1, 0))
    attnmerge.merge_varlen(o, lse, indptr, out=out, out_lse=out_lse)
    assert_merge_matches(out, out_lse, reference_merge_varlen(o0, lse0, indptr0), dtype)
    assert outside_view_is_nan(out, out_buf) and outside_view_is_nan(out_lse, out_lse_buf)


# --------------------------------------------------------------------------------------------------
# semantics


@pytest.mark.parametrize("dtype", DTYPES)
def test_empty_parts_and_nan_rows(rng, dtype):
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
    out, out_lse = call(o, lse, indptr)
    assert np.all(to_f64(out[1]) == 0) and np.all(out_lse[1] == -np.inf)
    assert np.all(to_f64(out[4]) == 0) and np.all(out_lse[4] == -np.inf)
    assert np.isnan(out_lse).sum() == 1 and np.isnan(out_lse[2, 1])
    assert_merge_matches(out, out_lse, reference_merge_varlen(o, lse, indptr), dtype)


def test_base_2_and_return_lse_false(rng):
    o, lse, indptr = problem(rng, [4, 0, 2, 9], index_dtype="int64")
    out, out_lse = attnmerge.merge_varlen(o, lse, indptr, base=2)
    assert_merge_matches(out, out_lse, reference_merge_varlen(o, lse, indptr, base=2), "float32")
    out, out_lse = attnmerge.merge_varlen(o, lse, indptr, return_lse=False)
    assert out_lse is None
    assert_o_close(out, reference_merge_varlen(o, lse, indptr)[0], "float32")


def test_a_large_merge_with_a_mean_of_four_states(rng):
    counts = rng.integers(0, 9, size=1500)
    o, lse, indptr = problem(rng, counts, heads=8, head_size=128, index_dtype="int64")
    out, out_lse = attnmerge.merge_varlen(o, lse, indptr, out_dtype="bfloat16")
    assert_merge_matches(out, out_lse, reference_merge_varlen(o, lse, indptr), "bfloat16")


def test_torch_cpu_tensors(rng):
    torch = pytest.importorskip("torch")
    o, lse, indptr = problem(rng, [2, 0, 3], index_dtype="int64")
    out, out_lse = attnmerge.merge_varlen(torch.from_numpy(o), torch.from_numpy(lse), torch.from_numpy(indptr))
    assert isinstance(out, torch.Tensor) and out.shape == (3, 3, 40)
    assert_merge_matches(out.numpy(), out_lse.numpy(), reference_merge_varlen(o, lse, indptr), "float32")


# --------------------------------------------------------------------------------------------------
# a bad indptr on the CPU: ValueError naming indptr, nothing written

BAD_INDPTR = {
    "negative_first": [-1, 2, 4],
    "negative_inside": [0, -2, 4],
    "decreasing": [0, 3, 2, 5],
    "past_total": [0, 3, 11],
    "first_past_total": [11, 11, 11],
}


@pytest.mark.parametrize("index_dtype", INDEX_DTYPES)
@pytest.mark.parametrize("case", list(BAD_INDPTR))
def test_a_bad_indptr_raises_and_writes_nothing(rng, case, index_dtype):
    o, lse = random_state(rng, 10, 2, 16)
    indptr = np.array(BAD_INDPTR[case], index_dtype)
    rows = len(indptr) - 1
    out, out_lse = nan_array((rows, 2, 16)), nan_array((rows, 2))
    with pytest.raises(ValueError) as info:
        attnmerge.merge_varlen(o, lse, indptr, out=out, out_lse=out_lse)
    assert "indptr" in str(info.value), str(info.value)
    assert all_nan(out) and all_nan(out_lse), "an output was written before the error"


def test_a_bad_indptr_raises_with_allocated_outputs(rng):
    o, lse = random_state(rng, 10, 2, 16)
    with pytest.raises(ValueError, match="indptr"):
        attnmerge.merge_varlen(o, lse, np.array([0, 5, 4], np.int64))
