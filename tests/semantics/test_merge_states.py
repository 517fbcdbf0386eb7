"""attnmerge.merge_states: the N-way merge in one pass, against the oracle, on every device.

merge_states(o, lse, *, out=None, out_lse=None, return_lse=True, out_dtype=None, output_scale=None,
             base="e", states_axis=1, stream=None) -> (out, out_lse)

states_axis=1: o [tokens, S, heads, D], lse [tokens, S, heads] (FlashInfer's layout);
states_axis=0: o [S, tokens, heads, D], lse [S, tokens, heads] (what an all-gather produces);
states_axis=2: o [tokens, heads, S, D], lse [tokens, heads, S] (an all-to-all's receive buffer, heads first).
Any strides (views, not copies); only D is unit-stride.  out [tokens, heads, D], out_lse [tokens, heads].
S = 0 gives O = 0 and LSE = -inf.

Each test takes the `device` fixture (tests/devices.py): NumPy arrays on the CPU, torch tensors on
CUDA.  What only NumPy arrays can express (zero strides, read-only flags) is tested on the CPU alone.
"""

from __future__ import annotations

import numpy as np
import pytest

import attnmerge
import devices
from oracle import (
    DTYPES,
    LN2,
    assert_lse_close,
    assert_merge_matches,
    assert_o_close,
    nan_array,
    random_stacked,
    reference_merge_stacked,
    strided_view,
    to_f64,
)

S_VALUES = (0, 1, 2, 3, 8, 64, 256)
AXES = (0, 1, 2)


def to_axis(x, states_axis):
    """Stacked states stored [S, ...] as a view with S at states_axis (no copy)."""
    return np.moveaxis(x, 0, states_axis)


def stacked(rng, tokens, s, heads, head_size, dtype="float32", states_axis=1, lse_scale=3.0):
    return random_stacked(rng, tokens, s, heads, head_size, dtype, states_axis, lse_scale)


def call(device, o, lse, states_axis, out_dtype=None, **kw):
    """merge_states of host arrays o, lse on the device, into NaN-poisoned given outputs; returns
    (out, out_lse) read back."""
    t, h, d = (n for i, n in enumerate(o.shape) if i != states_axis)
    out = device.nan((t, h, d), out_dtype or o.dtype)
    out_lse = device.nan((t, h))
    res, res_lse = attnmerge.merge_states(device.put(o), device.put(lse), out=out, out_lse=out_lse,
                                          states_axis=states_axis, **kw)
    assert res is out and res_lse is out_lse
    return device.get(out), device.get(out_lse)


# --------------------------------------------------------------------------------------------------
# S and layouts


@pytest.mark.parametrize("states_axis", AXES)
@pytest.mark.parametrize("s", S_VALUES)
def test_any_number_of_states_in_either_layout(rng, device, s, states_axis):
    o, lse = stacked(rng, 11, s, 3, 40, states_axis=states_axis)
    out, out_lse = call(device, o, lse, states_axis)
    assert_merge_matches(out, out_lse, reference_merge_stacked(o, lse, states_axis=states_axis), "float32")


@pytest.mark.parametrize("states_axis", AXES)
@pytest.mark.parametrize("s", S_VALUES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_allocated_outputs(rng, device, dtype, s, states_axis):
    """Outputs allocated like the inputs: the caller's library and device, o's dtype, float32 LSE."""
    o, lse = stacked(rng, 19, s, 4, 64, dtype=dtype, states_axis=states_axis)
    out, out_lse = attnmerge.merge_states(device.put(o), device.put(lse), states_axis=states_axis)
    assert device.is_mine(out) and device.is_mine(out_lse)
    assert tuple(out.shape) == (19, 4, 64) and out.dtype == device.dtype(dtype)
    assert tuple(out_lse.shape) == (19, 4) and out_lse.dtype == device.dtype("float32")
    assert_merge_matches(device.get(out), device.get(out_lse),
                         reference_merge_stacked(o, lse, states_axis=states_axis), dtype)


@pytest.mark.parametrize("states_axis", AXES)
def test_no_states_gives_zero_and_minus_inf(rng, device, states_axis):
    o, lse = stacked(rng, 9, 0, 4, 16, states_axis=states_axis)
    out, out_lse = call(device, o, lse, states_axis)
    assert np.all(out == 0.0) and np.all(out_lse == -np.inf)


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_state_is_passed_through(rng, device, dtype):
    o, lse = stacked(rng, 13, 1, 3, 48, dtype=dtype)
    out, out_lse = call(device, o, lse, 1)
    assert np.array_equal(to_f64(out), to_f64(o[:, 0])), "a single state must come through as it is"
    assert np.array_equal(out_lse, lse[:, 0])


def test_the_two_layouts_agree(rng, device):
    """The all-gather layout [S, T, H, D] and its view as [T, S, H, D] give the same bits."""
    o0, lse0 = stacked(rng, 17, 8, 4, 64, states_axis=0)
    a, a_lse = call(device, o0, lse0, 0)
    b, b_lse = call(device, np.moveaxis(o0, 0, 1), np.moveaxis(lse0, 0, 1), 1)
    assert np.array_equal(a, b) and np.array_equal(a_lse, b_lse)


def test_the_layouts_are_read_as_views_not_copies(rng, device):
    """A [T, S, H, D] view of an all-gather buffer (states_axis=1) and the reverse: both read in place."""
    o1, lse1 = stacked(rng, 10, 5, 3, 32, states_axis=1)
    ref = reference_merge_stacked(o1, lse1, states_axis=1)
    o_sf = device.put(np.ascontiguousarray(np.moveaxis(o1, 1, 0)))  # [S, T, H, D] storage
    lse_sf = device.put(np.ascontiguousarray(np.moveaxis(lse1, 1, 0)))
    for o, lse, states_axis in ((o_sf.swapaxes(0, 1), lse_sf.swapaxes(0, 1), 1),
                                (device.put(o1).swapaxes(0, 1), device.put(lse1).swapaxes(0, 1), 0)):
        out, out_lse = device.nan((10, 3, 32)), device.nan((10, 3))
        attnmerge.merge_states(o, lse, out=out, out_lse=out_lse, states_axis=states_axis)
        assert_merge_matches(device.get(out), device.get(out_lse), ref, "float32")


def test_the_all_gather_layout(rng, device):
    """What an all-gather produces: a flat [P * T, H, D] buffer viewed as [P, T, H, D], merged with
    states_axis=0; the same buffer viewed as [T, P, H, D] (a transpose) with states_axis=1, and a
    contiguous copy of the states: the same bits."""
    p, t, h, d = 8, 33, 8, 128
    o, lse = stacked(rng, t, p, h, d, "bfloat16", states_axis=0)
    flat_o = device.put(o.reshape(p * t, h, d))
    flat_lse = device.put(lse.reshape(p * t, h))
    ref = reference_merge_stacked(o, lse, states_axis=0)
    out, out_lse = attnmerge.merge_states(flat_o.reshape(p, t, h, d), flat_lse.reshape(p, t, h), states_axis=0)
    out, out_lse = device.get(out), device.get(out_lse)
    assert_merge_matches(out, out_lse, ref, "bfloat16")
    out2, out2_lse = attnmerge.merge_states(flat_o.reshape(p, t, h, d).swapaxes(0, 1),
                                            flat_lse.reshape(p, t, h).swapaxes(0, 1))
    assert np.array_equal(device.get(out2), out) and np.array_equal(device.get(out2_lse), out_lse)
    out3, _ = attnmerge.merge_states(device.put(o), flat_lse.reshape(p, t, h), states_axis=0)
    assert np.array_equal(device.get(out3), out)


# --------------------------------------------------------------------------------------------------
# dtypes and head sizes


@pytest.mark.parametrize("states_axis", AXES)
@pytest.mark.parametrize("s", (1, 2, 3, 5, 8, 64, 256))
@pytest.mark.parametrize("out_dtype", DTYPES)
@pytest.mark.parametrize("in_dtype", DTYPES)
def test_every_dtype_pair_into_a_given_output(rng, device, in_dtype, out_dtype, s, states_axis):
    o, lse = stacked(rng, 21, s, 4, 72, dtype=in_dtype, states_axis=states_axis)
    out, out_lse = call(device, o, lse, states_axis, out_dtype=out_dtype)
    assert_merge_matches(out, out_lse, reference_merge_stacked(o, lse, states_axis=states_axis), out_dtype)


@pytest.mark.parametrize("out_dtype", DTYPES)
@pytest.mark.parametrize("in_dtype", DTYPES)
def test_every_dtype_pair_into_an_allocated_output(rng, device, in_dtype, out_dtype):
    o, lse = stacked(rng, 21, 3, 4, 72, dtype=in_dtype)
    out, out_lse = attnmerge.merge_states(device.put(o), device.put(lse), out_dtype=out_dtype)
    assert out.dtype == device.dtype(out_dtype) and out_lse.dtype == device.dtype("float32")
    assert_merge_matches(device.get(out), device.get(out_lse), reference_merge_stacked(o, lse), out_dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size", (1, 3, 100, 128, 256))
@pytest.mark.parametrize("s", (2, 3, 8, 64))
def test_odd_head_sizes(rng, device, head_size, dtype, s):
    o, lse = stacked(rng, 41, s, 3, head_size, dtype=dtype)
    out, out_lse = call(device, o, lse, 1)
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
def test_strided_views_are_read_and_written_in_place(rng, device, case, dtype, head_size):
    """Any strides on every array; nothing outside the views is read (NaN there) or written."""
    states_axis, ov, lv, outv, outlv = VIEW_CASES[case]
    o0, lse0 = stacked(rng, 19, 6, 4, head_size, dtype=dtype, states_axis=states_axis)
    o, _ = device.strided(*strided_view(o0, **ov))
    lse, _ = device.strided(*strided_view(lse0, **lv))
    np_out = strided_view(nan_array((19, 4, head_size), dtype), **outv)
    np_out_lse = strided_view(nan_array((19, 4)), **outlv)
    out, out_buf = device.strided(*np_out)
    out_lse, out_lse_buf = device.strided(*np_out_lse)
    res, res_lse = attnmerge.merge_states(o, lse, out=out, out_lse=out_lse, states_axis=states_axis)
    assert res is out and res_lse is out_lse
    got, clean = device.readback(*np_out, out, out_buf)
    got_lse, clean_lse = device.readback(*np_out_lse, out_lse, out_lse_buf)
    assert_merge_matches(got, got_lse, reference_merge_stacked(o0, lse0, states_axis=states_axis), dtype)
    assert clean, "wrote outside the out view"
    assert clean_lse, "wrote outside the out_lse view"


def test_a_zero_stride_state_axis_broadcasts_one_state(rng):
    """A zero stride on the states axis of an input (NumPy's broadcast_to): S copies of one state;
    the O is that state's and the LSE grows by ln S."""
    o1, lse1 = stacked(rng, 7, 1, 2, 32)
    o = np.broadcast_to(o1, (7, 4, 2, 32))
    lse = np.broadcast_to(lse1, (7, 4, 2))
    out, out_lse = nan_array((7, 2, 32)), nan_array((7, 2))
    attnmerge.merge_states(o, lse, out=out, out_lse=out_lse)
    assert_o_close(out, to_f64(o1[:, 0]), "float32")
    assert_lse_close(out_lse, to_f64(lse1[:, 0]) + np.log(4.0))


# --------------------------------------------------------------------------------------------------
# empty parts, NaN


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("s", (2, 3, 8, 64))
def test_empty_parts_do_not_leak_and_all_empty_rows_are_zero(rng, device, s, dtype):
    t, h, d = 24, 3, 40
    o, lse = stacked(rng, t, s, h, d, dtype=dtype)
    empty = rng.random((t, s, h)) < 0.4
    lse[empty] = np.where(rng.random(int(empty.sum())) < 0.5, np.inf, -np.inf)
    o[empty] = np.nan  # garbage in an empty part must not be read
    lse[:4] = np.inf  # tokens 0..3: every part empty (+inf and -inf mixed)
    lse[2:4, ::2] = -np.inf
    o[:4] = np.nan
    out, out_lse = call(device, o, lse, 1)
    assert not np.isnan(to_f64(out)).any() and not np.isnan(out_lse).any()
    assert np.all(to_f64(out[:4]) == 0.0) and np.all(out_lse[:4] == -np.inf)
    assert_merge_matches(out, out_lse, reference_merge_stacked(o, lse), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("s", (1, 2, 3, 8, 64, 256))
def test_empty_nan_and_underflowing_parts_in_one_call(rng, device, s, dtype):
    """Empty parts (+inf and -inf, NaN in their O), rows of only empty parts, NaN rows (NaN beats
    empty), and parts whose weight underflows to 0 (not read), side by side in one call."""
    t, h, d = 64, 4, 80
    o, lse = stacked(rng, t, s, h, d, dtype)
    empty = rng.random((t, s, h)) < 0.4
    lse[empty] = np.where(rng.random(int(empty.sum())) < 0.5, np.inf, -np.inf)
    o[empty] = np.nan
    lse[:4] = np.inf  # every part empty: 0, -inf
    lse[2:4, ::2] = -np.inf
    o[:4] = np.nan
    lse[10, s - 1, 1] = np.nan  # NaN rows
    lse[11, 0, :] = np.nan
    lse[12, :, 2] = -np.inf
    lse[12, s // 2, 2] = np.nan  # NaN beats empty
    if s >= 2:  # a part of weight 0 after underflow: not read
        lse[20:24, 1] = lse[20:24, 0] - 1000.0
        o[20:24, 1] = np.nan
    out, out_lse = attnmerge.merge_states(device.put(o), device.put(lse))
    out, out_lse = device.get(out), device.get(out_lse)
    assert_merge_matches(out, out_lse, reference_merge_stacked(o, lse), dtype)
    assert np.all(to_f64(out[:4]) == 0) and np.all(out_lse[:4] == -np.inf)


@pytest.mark.parametrize("states_axis", AXES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_nan_lse_makes_its_row_nan(rng, device, dtype, states_axis):
    s, t, h, d = 5, 16, 3, 24
    o, lse = stacked(rng, t, s, h, d, dtype=dtype, states_axis=0)
    lse[2, 3, 1] = np.nan
    lse[0, 7, :] = np.nan
    lse[:, 9, 2] = np.inf  # NaN beats empty
    lse[4, 9, 2] = np.nan
    nan_rows = np.isnan(lse).any(axis=0)
    o, lse = to_axis(o, states_axis), to_axis(lse, states_axis)
    out = device.put(np.ones((t, h, d), np.float32).astype(o.dtype))
    out_lse = device.put(np.full((t, h), 7.0, np.float32))  # not pre-poisoned: the NaN must be written
    attnmerge.merge_states(device.put(o), device.put(lse), out=out, out_lse=out_lse, states_axis=states_axis)
    out, out_lse = device.get(out), device.get(out_lse)
    assert np.all(np.isnan(to_f64(out[nan_rows]))) and np.all(np.isnan(out_lse[nan_rows]))
    assert not np.isnan(to_f64(out[~nan_rows])).any()
    assert_merge_matches(out, out_lse, reference_merge_stacked(o, lse, states_axis=states_axis), dtype)


def test_parts_whose_weight_underflows_are_not_read(rng, device):
    o, lse = stacked(rng, 8, 4, 2, 16)
    lse[:, 1:] = lse[:, :1] - 1000.0  # weight exactly 0 in float32
    o[:, 1:] = np.nan
    out, out_lse = call(device, o, lse, 1)
    assert np.array_equal(out, o[:, 0])
    assert_lse_close(out_lse, lse[:, 0])


def test_widely_spread_lse(rng, device):
    o, lse = stacked(rng, 32, 16, 4, 64, lse_scale=40.0)
    out, out_lse = call(device, o, lse, 1)
    assert_merge_matches(out, out_lse, reference_merge_stacked(o, lse), "float32")


def test_equal_lse_averages(rng, device):
    o, lse = stacked(rng, 9, 8, 3, 32)
    lse[...] = lse[:, :1]
    out, out_lse = call(device, o, lse, 1)
    assert_o_close(out, to_f64(o).mean(axis=1), "float32")
    assert_lse_close(out_lse, to_f64(lse[:, 0]) + 3 * LN2)


# --------------------------------------------------------------------------------------------------
# options and sizes


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("s", (0, 3, 8))
def test_base_2(rng, device, s, dtype):
    o, lse = stacked(rng, 30, s, 4, 64, dtype, states_axis=0)
    out, out_lse = call(device, o, lse, 0, base=2)
    assert_merge_matches(out, out_lse, reference_merge_stacked(o, lse, states_axis=0, base=2), dtype)


@pytest.mark.parametrize("states_axis", AXES)
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_return_lse_false(rng, device, dtype, states_axis):
    o, lse = stacked(rng, 12, 4, 3, 40, dtype, states_axis=states_axis)
    out, out_lse = attnmerge.merge_states(device.put(o), device.put(lse), return_lse=False, states_axis=states_axis)
    assert out_lse is None
    assert_o_close(device.get(out), reference_merge_stacked(o, lse, states_axis=states_axis)[0], dtype)


def test_a_given_out_lse_is_written_even_with_return_lse_false(rng, device):
    o, lse = stacked(rng, 12, 4, 3, 40)
    out_lse = device.nan((12, 3))
    out, res_lse = attnmerge.merge_states(device.put(o), device.put(lse), out_lse=out_lse, return_lse=False)
    assert res_lse is out_lse
    assert_merge_matches(device.get(out), device.get(out_lse), reference_merge_stacked(o, lse), "float32")


@pytest.mark.parametrize("states_axis", AXES)
@pytest.mark.parametrize("s", (0, 1, 4))
def test_zero_tokens(rng, device, s, states_axis):
    o, lse = stacked(rng, 0, s, 4, 64, dtype="float16", states_axis=states_axis)
    out, out_lse = attnmerge.merge_states(device.put(o), device.put(lse), states_axis=states_axis)
    assert tuple(out.shape) == (0, 4, 64) and tuple(out_lse.shape) == (0, 4)


def test_inputs_are_left_unchanged_and_may_be_read_only(rng):
    """NumPy's read-only flag on an input is no obstacle (an input is only read)."""
    o, lse = stacked(rng, 10, 6, 2, 32, dtype="bfloat16")
    copies = (o.copy(), lse.copy())
    o.setflags(write=False)
    lse.setflags(write=False)
    out, out_lse = attnmerge.merge_states(o, lse, out_dtype="float32")
    assert_merge_matches(out, out_lse, reference_merge_stacked(o, lse), "float32")
    assert np.array_equal(o.view(np.uint16), copies[0].view(np.uint16)) and np.array_equal(lse, copies[1])


@pytest.mark.parametrize("out_dtype", ["float32", "bfloat16"])
def test_a_large_merge_is_deterministic(rng, device, out_dtype):
    """1024 tokens x 8 states x 16 heads x 128: enough for several CPU threads, and many GPU blocks."""
    o, lse = stacked(rng, 1024, 8, 16, 128, states_axis=0)
    lse[0, 100:140] = np.inf
    lse[:, 200:210] = -np.inf
    lse[5, 900, 3] = np.nan
    do, dlse = device.put(o), device.put(lse)
    out, out_lse = attnmerge.merge_states(do, dlse, states_axis=0, out_dtype=out_dtype)
    out, out_lse = device.get(out), device.get(out_lse)
    assert_merge_matches(out, out_lse, reference_merge_stacked(o, lse, states_axis=0), out_dtype)
    again, again_lse = attnmerge.merge_states(do, dlse, states_axis=0, out_dtype=out_dtype)
    assert np.array_equal(to_f64(device.get(again)), to_f64(out), equal_nan=True), "not deterministic"
    assert np.array_equal(device.get(again_lse), out_lse, equal_nan=True), "not deterministic"


@pytest.mark.parametrize("device", devices.CUDA_ONLY, indirect=True)
def test_a_large_merge_of_the_benchmarks_shape(rng, device):
    """8192 tokens x 8 states x 32 heads x 128, bfloat16: the benchmark's shape (GPU-sized)."""
    device.gpu_only()
    o, lse = stacked(rng, 8192, 8, 32, 128, "bfloat16", states_axis=0)
    out, out_lse = attnmerge.merge_states(device.put(o), device.put(lse), states_axis=0)
    assert_merge_matches(device.get(out), device.get(out_lse), reference_merge_stacked(o, lse, states_axis=0),
                         "bfloat16")


def test_256_states_with_most_empty(rng, device):
    o, lse = stacked(rng, 6, 256, 2, 64)
    empty = rng.random(lse.shape) < 0.9
    lse[empty] = -np.inf
    o[empty] = np.nan
    lse[0] = np.inf
    o[0] = np.nan
    out, out_lse = call(device, o, lse, 1)
    assert_merge_matches(out, out_lse, reference_merge_stacked(o, lse), "float32")
