"""attnmerge.merge_states on the CPU (NumPy arrays): the N-way merge in one pass, against the oracle.

merge_states(o, lse, *, out=None, out_lse=None, return_lse=True, out_dtype=None, output_scale=None,
             base="e", states_axis=1, stream=None) -> (out, out_lse)

states_axis=1: o [tokens, S, heads, D], lse [tokens, S, heads] (FlashInfer's layout);
states_axis=0: o [S, tokens, heads, D], lse [S, tokens, heads] (what an all-gather produces).
Any strides (views, not copies); only D is unit-stride.  out [tokens, heads, D], out_lse [tokens, heads].
S = 0 gives O = 0 and LSE = -inf.
"""

from __future__ import annotations

import numpy as np
import pytest

import attnmerge
from oracle import (
    DTYPES,
    LN2,
    assert_lse_close,
    assert_merge_matches,
    assert_o_close,
    nan_array,
    np_dtype,
    outside_view_is_nan,
    random_stacked,
    reference_merge_stacked,
    strided_view,
    to_f64,
)

S_VALUES = (0, 1, 2, 3, 8, 64, 256)
AXES = (0, 1)


def to_axis(x, states_axis):
    """The same stacked states as a view in the other layout (no copy)."""
    return np.moveaxis(x, 0, 1) if states_axis == 1 else x


def stacked(rng, tokens, s, heads, head_size, dtype="float32", states_axis=1, lse_scale=3.0):
    return random_stacked(rng, tokens, s, heads, head_size, dtype, states_axis, lse_scale)


def call(o, lse, states_axis, out_dtype=None, **kw):
    """merge_states into NaN-poisoned given outputs; returns (out, out_lse)."""
    t = o.shape[1 - states_axis]
    h, d = o.shape[2], o.shape[3]
    out = nan_array((t, h, d), out_dtype or o.dtype)
    out_lse = nan_array((t, h))
    res, res_lse = attnmerge.merge_states(o, lse, out=out, out_lse=out_lse, states_axis=states_axis, **kw)
    assert res is out and res_lse is out_lse
    return out, out_lse


# --------------------------------------------------------------------------------------------------
# S and layouts


@pytest.mark.parametrize("states_axis", AXES)
@pytest.mark.parametrize("s", S_VALUES)
def test_any_number_of_states_in_either_layout(rng, s, states_axis):
    o, lse = stacked(rng, 11, s, 3, 40, states_axis=states_axis)
    out, out_lse = call(o, lse, states_axis)
    assert_merge_matches(out, out_lse, reference_merge_stacked(o, lse, states_axis=states_axis), "float32")


@pytest.mark.parametrize("states_axis", AXES)
@pytest.mark.parametrize("s", S_VALUES)
def test_allocated_outputs(rng, s, states_axis):
    o, lse = stacked(rng, 6, s, 2, 24, dtype="float16", states_axis=states_axis)
    out, out_lse = attnmerge.merge_states(o, lse, states_axis=states_axis)
    assert isinstance(out, np.ndarray) and out.shape == (6, 2, 24) and out.dtype == np.float16
    assert isinstance(out_lse, np.ndarray) and out_lse.shape == (6, 2) and out_lse.dtype == np.float32
    assert_merge_matches(out, out_lse, reference_merge_stacked(o, lse, states_axis=states_axis), "float16")


@pytest.mark.parametrize("states_axis", AXES)
def test_no_states_gives_zero_and_minus_inf(rng, states_axis):
    o, lse = stacked(rng, 9, 0, 4, 16, states_axis=states_axis)
    out, out_lse = call(o, lse, states_axis)
    assert np.all(out == 0.0) and np.all(out_lse == -np.inf)


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_state_is_passed_through(rng, dtype):
    o, lse = stacked(rng, 13, 1, 3, 48, dtype=dtype)
    out, out_lse = call(o, lse, 1)
    assert np.array_equal(to_f64(out), to_f64(o[:, 0])), "a single state must come through as it is"
    assert np.array_equal(out_lse, lse[:, 0])


def test_the_two_layouts_agree(rng):
    """The all-gather layout [S, T, H, D] and its view as [T, S, H, D] give the same bits."""
    o0, lse0 = stacked(rng, 17, 8, 4, 64, states_axis=0)
    a, a_lse = call(o0, lse0, 0)
    b, b_lse = call(np.moveaxis(o0, 0, 1), np.moveaxis(lse0, 0, 1), 1)
    assert np.array_equal(a, b) and np.array_equal(a_lse, b_lse)


def test_the_layouts_are_read_as_views_not_copies(rng):
    """A [T, S, H, D] view of an all-gather buffer (states_axis=1) and the reverse: both read in place."""
    o1, lse1 = stacked(rng, 10, 5, 3, 32, states_axis=1)
    ref = reference_merge_stacked(o1, lse1, states_axis=1)
    o_sf = np.ascontiguousarray(np.moveaxis(o1, 1, 0))  # [S, T, H, D] storage
    lse_sf = np.ascontiguousarray(np.moveaxis(lse1, 1, 0))
    assert not np.moveaxis(o_sf, 0, 1).flags.c_contiguous
    out, out_lse = call(np.moveaxis(o_sf, 0, 1), np.moveaxis(lse_sf, 0, 1), 1)
    assert_merge_matches(out, out_lse, ref, "float32")
    out, out_lse = call(np.moveaxis(o1, 1, 0), np.moveaxis(lse1, 1, 0), 0)  # [S, T, ...] view of [T, S, ...]
    assert_merge_matches(out, out_lse, ref, "float32")


# --------------------------------------------------------------------------------------------------
# dtypes and head sizes


@pytest.mark.parametrize("states_axis", AXES)
@pytest.mark.parametrize("out_dtype", DTYPES)
@pytest.mark.parametrize("in_dtype", DTYPES)
def test_every_dtype_pair_into_a_given_output(rng, in_dtype, out_dtype, states_axis):
    o, lse = stacked(rng, 21, 5, 4, 72, dtype=in_dtype, states_axis=states_axis)
    out, out_lse = call(o, lse, states_axis, out_dtype=out_dtype)
    assert_merge_matches(out, out_lse, reference_merge_stacked(o, lse, states_axis=states_axis), out_dtype)


@pytest.mark.parametrize("out_dtype", DTYPES)
@pytest.mark.parametrize("in_dtype", DTYPES)
def test_every_dtype_pair_into_an_allocated_output(rng, in_dtype, out_dtype):
    o, lse = stacked(rng, 21, 3, 4, 72, dtype=in_dtype)
    out, out_lse = attnmerge.merge_states(o, lse, out_dtype=out_dtype)
    assert out.dtype == np_dtype(out_dtype) and out_lse.dtype == np.float32
    assert_merge_matches(out, out_lse, reference_merge_stacked(o, lse), out_dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size", (1, 3, 100, 128))
@pytest.mark.parametrize("s", (2, 3, 8))
def test_odd_head_sizes(rng, head_size, dtype, s):
    o, lse = stacked(rng, 15, s, 3, head_size, dtype=dtype)
    out, out_lse = call(o, lse, 1)
    assert_merge_matches(out, out_lse, reference_merge_stacked(o, lse), dtype)


# --------------------------------------------------------------------------------------------------
# strided views

# (states_axis, o view, lse view, out view, out_lse view); each view a strided_view(...) keyword set
# of the logical array.  o: axes (0, 1, 2, 3); lse: (0, 1, 2); out: (T, H, D); out_lse: (T, H).
VIEW_CASES = {
    "padded_D": (1, dict(pad=5), dict(pad=3), dict(pad=7), dict(pad=1)),
    "offset_unaligned": (0, dict(offset=1, pad=2), dict(offset=1), dict(offset=1), dict(offset=3)),
    "heads_outermost": (1, dict(order=(2, 0, 1, 3)), dict(order=(2, 1, 0)), dict(order=(1, 0, 2)), dict(order=(1, 0))),
    "token_step": (0, dict(steps={1: 2}), dict(steps={1: 3}), dict(steps={0: 2}), dict(steps={0: 2})),
    "state_step": (1, dict(steps={1: 3}, pad=1), dict(steps={1: 2}), dict(steps={1: 3}), dict(steps={1: 2})),
    "head_step": (0, dict(steps={2: 3}), dict(order=(2, 0, 1)), dict(steps={1: 2}, offset=1), dict()),
    "states_innermost_lse": (1, dict(order=(0, 2, 1, 3)), dict(order=(0, 2, 1)), dict(), dict(order=(1, 0))),
}


@pytest.mark.parametrize("head_size", (3, 72, 128))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(VIEW_CASES))
def test_strided_views_are_read_and_written_in_place(rng, case, dtype, head_size):
    """Any strides on every array; nothing outside the views is read (NaN there) or written."""
    states_axis, ov, lv, outv, outlv = VIEW_CASES[case]
    o0, lse0 = stacked(rng, 19, 6, 4, head_size, dtype=dtype, states_axis=states_axis)
    o, _ = strided_view(o0, **ov)
    lse, _ = strided_view(lse0, **lv)
    out, out_buf = strided_view(nan_array((19, 4, head_size), dtype), **outv)
    out_lse, out_lse_buf = strided_view(nan_array((19, 4)), **outlv)
    res, res_lse = attnmerge.merge_states(o, lse, out=out, out_lse=out_lse, states_axis=states_axis)
    assert res is out and res_lse is out_lse
    assert_merge_matches(out, out_lse, reference_merge_stacked(o0, lse0, states_axis=states_axis), dtype)
    assert outside_view_is_nan(out, out_buf), "wrote outside the out view"
    assert outside_view_is_nan(out_lse, out_lse_buf), "wrote outside the out_lse view"


def test_a_zero_stride_state_axis_broadcasts_one_state(rng):
    """A zero stride on the states axis of an input: S copies of one state; the O is that state's
    and the LSE grows by ln S."""
    o1, lse1 = stacked(rng, 7, 1, 2, 32)
    o = np.broadcast_to(o1, (7, 4, 2, 32))
    lse = np.broadcast_to(lse1, (7, 4, 2))
    out, out_lse = call(o, lse, 1)
    assert_o_close(out, to_f64(o1[:, 0]), "float32")
    assert_lse_close(out_lse, to_f64(lse1[:, 0]) + np.log(4.0))


# --------------------------------------------------------------------------------------------------
# empty parts, NaN


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("s", (2, 3, 8, 64))
def test_empty_parts_do_not_leak_and_all_empty_rows_are_zero(rng, s, dtype):
    t, h, d = 24, 3, 40
    o, lse = stacked(rng, t, s, h, d, dtype=dtype)
    empty = rng.random((t, s, h)) < 0.4
    lse[empty] = np.where(rng.random(int(empty.sum())) < 0.5, np.inf, -np.inf)
    o[empty] = np.nan  # garbage in an empty part must not be read
    lse[:4] = np.inf  # tokens 0..3: every part empty (+inf and -inf mixed)
    lse[2:4, ::2] = -np.inf
    o[:4] = np.nan
    out, out_lse = call(o, lse, 1)
    assert not np.isnan(to_f64(out)).any() and not np.isnan(out_lse).any()
    assert np.all(to_f64(out[:4]) == 0.0) and np.all(out_lse[:4] == -np.inf)
    assert_merge_matches(out, out_lse, reference_merge_stacked(o, lse), dtype)


@pytest.mark.parametrize("states_axis", AXES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_nan_lse_makes_its_row_nan(rng, dtype, states_axis):
    s, t, h, d = 5, 16, 3, 24
    o, lse = stacked(rng, t, s, h, d, dtype=dtype, states_axis=0)
    lse[2, 3, 1] = np.nan
    lse[0, 7, :] = np.nan
    lse[:, 9, 2] = np.inf  # NaN beats empty
    lse[4, 9, 2] = np.nan
    nan_rows = np.isnan(lse).any(axis=0)
    o, lse = to_axis(o, states_axis), to_axis(lse, states_axis)
    out = nan_array((t, h, d), dtype)
    out[...] = 1.0
    out_lse = np.full((t, h), 7.0, np.float32)  # not pre-poisoned: the NaN must be written
    attnmerge.merge_states(o, lse, out=out, out_lse=out_lse, states_axis=states_axis)
    assert np.all(np.isnan(to_f64(out[nan_rows]))) and np.all(np.isnan(out_lse[nan_rows]))
    assert not np.isnan(to_f64(out[~nan_rows])).any()
    assert_merge_matches(out, out_lse, reference_merge_stacked(o, lse, states_axis=states_axis), dtype)


def test_parts_whose_weight_underflows_are_not_read(rng):
    o, lse = stacked(rng, 8, 4, 2, 16)
    lse[:, 1:] = lse[:, :1] - 1000.0  # weight exactly 0 in float32
    o[:, 1:] = np.nan
    out, out_lse = call(o, lse, 1)
    assert np.array_equal(out, o[:, 0])
    assert_lse_close(out_lse, lse[:, 0])


def test_widely_spread_lse(rng):
    o, lse = stacked(rng, 32, 16, 4, 64, lse_scale=40.0)
    out, out_lse = call(o, lse, 1)
    assert_merge_matches(out, out_lse, reference_merge_stacked(o, lse), "float32")


def test_equal_lse_averages(rng):
    o, lse = stacked(rng, 9, 8, 3, 32)
    lse[...] = lse[:, :1]
    out, out_lse = call(o, lse, 1)
    assert_o_close(out, to_f64(o).mean(axis=1), "float32")
    assert_lse_close(out_lse, to_f64(lse[:, 0]) + 3 * LN2)


# --------------------------------------------------------------------------------------------------
# options and sizes


@pytest.mark.parametrize("s", (0, 3, 8))
def test_base_2(rng, s):
    o, lse = stacked(rng, 12, s, 3, 40, states_axis=0)
    out, out_lse = call(o, lse, 0, base=2)
    assert_merge_matches(out, out_lse, reference_merge_stacked(o, lse, states_axis=0, base=2), "float32")


def test_return_lse_false(rng):
    o, lse = stacked(rng, 12, 4, 3, 40)
    out, out_lse = attnmerge.merge_states(o, lse, return_lse=False)
    assert out_lse is None
    assert_o_close(out, reference_merge_stacked(o, lse)[0], "float32")


def test_a_given_out_lse_is_written_even_with_return_lse_false(rng):
    o, lse = stacked(rng, 12, 4, 3, 40)
    out_lse = nan_array((12, 3))
    out, res_lse = attnmerge.merge_states(o, lse, out_lse=out_lse, return_lse=False)
    assert res_lse is out_lse
    assert_merge_matches(out, out_lse, reference_merge_stacked(o, lse), "float32")


@pytest.mark.parametrize("states_axis", AXES)
@pytest.mark.parametrize("s", (0, 1, 4))
def test_zero_tokens(rng, s, states_axis):
    o, lse = stacked(rng, 0, s, 4, 64, states_axis=states_axis)
    out, out_lse = attnmerge.merge_states(o, lse, states_axis=states_axis)
    assert out.shape == (0, 4, 64) and out_lse.shape == (0, 4)


def test_inputs_are_left_unchanged_and_may_be_read_only(rng):
    o, lse = stacked(rng, 10, 6, 2, 32, dtype="bfloat16")
    copies = (o.copy(), lse.copy())
    o.setflags(write=False)
    lse.setflags(write=False)
    out, out_lse = attnmerge.merge_states(o, lse, out_dtype="float32")
    assert_merge_matches(out, out_lse, reference_merge_stacked(o, lse), "float32")
    assert np.array_equal(o.view(np.uint16), copies[0].view(np.uint16)) and np.array_equal(lse, copies[1])


@pytest.mark.parametrize("out_dtype", ["float32", "bfloat16"])
def test_a_large_merge_is_deterministic(rng, out_dtype):
    """1024 tokens x 8 states x 16 heads x 128: enough for several CPU threads."""
    o, lse = stacked(rng, 1024, 8, 16, 128, states_axis=0)
    lse[0, 100:140] = np.inf
    lse[:, 200:210] = -np.inf
    lse[5, 900, 3] = np.nan
    out, out_lse = attnmerge.merge_states(o, lse, states_axis=0, out_dtype=out_dtype)
    assert_merge_matches(out, out_lse, reference_merge_stacked(o, lse, states_axis=0), out_dtype)
    again, again_lse = attnmerge.merge_states(o, lse, states_axis=0, out_dtype=out_dtype)
    assert np.array_equal(to_f64(again), to_f64(out), equal_nan=True), "not deterministic"
    assert np.array_equal(again_lse, out_lse, equal_nan=True), "not deterministic"


def test_256_states_with_most_empty(rng):
    o, lse = stacked(rng, 6, 256, 2, 64)
    empty = rng.random(lse.shape) < 0.9
    lse[empty] = -np.inf
    o[empty] = np.nan
    lse[0] = np.inf
    o[0] = np.nan
    out, out_lse = call(o, lse, 1)
    assert_merge_matches(out, out_lse, reference_merge_stacked(o, lse), "float32")


def test_torch_cpu_tensors_in_the_all_gather_layout(rng):
    torch = pytest.importorskip("torch")
    o, lse = stacked(rng, 13, 4, 3, 64, states_axis=0)
    out, out_lse = attnmerge.merge_states(torch.from_numpy(o), torch.from_numpy(lse), states_axis=0)
    assert isinstance(out, torch.Tensor) and isinstance(out_lse, torch.Tensor)
    assert out.shape == (13, 3, 64) and out_lse.shape == (13, 3)
    assert_merge_matches(out.numpy(), out_lse.numpy(), reference_merge_stacked(o, lse, states_axis=0), "float32")


def test_torch_cpu_bfloat16_views(rng):
    torch = pytest.importorskip("torch")
    o, lse = stacked(rng, 13, 3, 4, 72, states_axis=1)
    ot = torch.from_numpy(np.ascontiguousarray(np.moveaxis(o, 1, 0))).to(torch.bfloat16)  # [S, T, H, D]
    o_bf = ot.float().numpy()
    out = torch.full((13, 4, 80), float("nan"), dtype=torch.bfloat16)[:, :, 8:]
    out_lse = torch.full((4, 13), float("nan"))
    attnmerge.merge_states(ot.transpose(0, 1), torch.from_numpy(lse), out=out, out_lse=out_lse.T)
    ref = reference_merge_stacked(o_bf, np.moveaxis(lse, 1, 0), states_axis=0)
    assert_merge_matches(out.float().numpy(), out_lse.T.numpy(), ref, "bfloat16")
