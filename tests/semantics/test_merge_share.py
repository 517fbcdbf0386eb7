"""merge_share: one state's share of an N-way merge, against the oracle, on every device.

merge_share(o, lse, index, *, out=None, out_lse=None, states_axis=1, sink=None, base="e", ...)

o is state `index`'s O [tokens, heads, head_size]; lse holds every state's LSE, float32
[tokens, S, heads] (states_axis=1), [S, tokens, heads] (states_axis=0, an all-gather's) or
[tokens, heads, S] (states_axis=2).  With
m, w_i and W of the N-way merge over the S LSEs (and the sink):

    out = (w_index / W) * o,    out_lse = m + log W

so that the S states' shares summed are merge_states of them: context parallelism's combine by
reduce-scatter (each rank all-gathers the LSEs, scales its own output, and a reduce-scatter sums
the shares).  A state of zero weight gets a share of 0 without its O being read, an all-empty row
O = 0 and LSE = -inf, a NaN LSE a NaN row.  Bad arguments: tests/errors/bad_inputs.py; gradients:
tests/interop/test_torch_autograd.py and test_jax_ffi.py; the GPU kernel's paths:
test_forward_kernel_emulated.py.
"""

from __future__ import annotations

import numpy as np
import pytest

import attnmerge
from oracle import (DTYPES, assert_lse_close, assert_merge_matches, random_lse, random_o, random_stacked, reference_merge_share,
                    reference_merge_stacked, strided_view, to_f64)

S_VALUES = (1, 2, 3, 8, 9, 64, 257)


def share_call(device, o, lse, index, states_axis=1, out_dtype=None, sink=None, **kw):
    """merge_share on the device into NaN-poisoned outputs; (out, out_lse) read back."""
    out, out_lse = device.nan(o.shape, out_dtype or o.dtype), device.nan(o.shape[:2])
    attnmerge.merge_share(device.put(o), device.put(lse), index, out=out, out_lse=out_lse, states_axis=states_axis,
                          sink=None if sink is None else device.put(sink), **kw)
    return device.get(out), device.get(out_lse)


def state(o, i, states_axis):
    """State i's O of stacked states."""
    return np.ascontiguousarray(np.take(o, i, axis=states_axis))


# --------------------------------------------------------------------------------------------------
# the formula


@pytest.mark.parametrize("base", ("e", 2))
@pytest.mark.parametrize("states_axis", (0, 1, 2))
@pytest.mark.parametrize("s", S_VALUES)
def test_each_share_is_the_formula(rng, device, s, states_axis, base):
    o, lse = random_stacked(rng, 9, s, 4, 40, states_axis=states_axis)
    for index in sorted({0, s // 2, s - 1}):
        out, out_lse = share_call(device, state(o, index, states_axis), lse, index, states_axis, base=base)
        ref = reference_merge_share(state(o, index, states_axis), lse, index, states_axis=states_axis, base=base)
        assert_merge_matches(out, out_lse, ref, "float32")


@pytest.mark.parametrize("states_axis", (0, 1, 2))
@pytest.mark.parametrize("s", (2, 5, 16))
def test_the_shares_sum_to_the_merge(rng, device, s, states_axis):
    """What the op is for: every rank's share, summed (a reduce-scatter), is merge_states of the
    states, and every share's LSE is the merged LSE."""
    o, lse = random_stacked(rng, 7, s, 3, 64, states_axis=states_axis)
    total = np.zeros((7, 3, 64))
    merged_o, merged_lse = reference_merge_stacked(o, lse, states_axis=states_axis)
    for index in range(s):
        out, out_lse = share_call(device, state(o, index, states_axis), lse, index, states_axis)
        total += to_f64(out)
        assert_lse_close(out_lse, merged_lse)
    assert_merge_matches(total.astype(np.float32), None, (merged_o, merged_lse), "float32")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("s", (4, 16, 128))
def test_dtypes_and_decode_shapes(rng, device, s, dtype):
    """Decode context parallelism's shapes: few tokens, 32 heads of 128, up to 128 ranks."""
    o, lse = random_o(rng, (16, 32, 128), dtype), random_lse(rng, (16, s, 32))
    out, out_lse = share_call(device, o, lse, s - 1)
    assert_merge_matches(out, out_lse, reference_merge_share(o, lse, s - 1), dtype)


def test_float32_state_into_bfloat16(rng, device):
    o, lse = random_o(rng, (8, 4, 128), "float32"), random_lse(rng, (8, 6, 4))
    out, out_lse = share_call(device, o, lse, 2, out_dtype="bfloat16")
    assert_merge_matches(out, out_lse, reference_merge_share(o, lse, 2), "bfloat16")


@pytest.mark.parametrize("head_size", (1, 3, 8, 72, 256, 1000))
def test_head_sizes(rng, device, head_size):
    o, lse = random_o(rng, (5, 3, head_size), "bfloat16"), random_lse(rng, (5, 4, 3))
    out, out_lse = share_call(device, o, lse, 1)
    assert_merge_matches(out, out_lse, reference_merge_share(o, lse, 1), "bfloat16")


# --------------------------------------------------------------------------------------------------
# edges


def test_an_empty_state_gets_a_share_of_zero_unread(rng, device):
    """index's LSE -inf (or +inf, FlashAttention-2's empty part): out = 0 whatever o holds (NaN
    here); the merged LSE is the others'."""
    o = np.full((4, 3, 32), np.nan, np.float32)
    lse = random_lse(rng, (4, 5, 3))
    lse[:, 2, :2], lse[:, 2, 2] = -np.inf, np.inf
    out, out_lse = share_call(device, o, lse, 2)
    assert (out == 0).all()
    assert_merge_matches(out, out_lse, reference_merge_share(o, lse, 2), "float32")


def test_an_all_empty_row(rng, device):
    """Every state empty: O = 0, LSE = -inf, never NaN."""
    o = random_o(rng, (3, 2, 16))
    lse = np.full((3, 4, 2), -np.inf, np.float32)
    lse[:, 1] = np.inf
    out, out_lse = share_call(device, o, lse, 1)
    assert (out == 0).all() and (out_lse == -np.inf).all()


def test_a_nan_lse_of_another_state_makes_the_row_nan(rng, device):
    """A NaN in any state's LSE surfaces in the row, though that state's O is not read."""
    o, lse = random_o(rng, (4, 3, 32)), random_lse(rng, (4, 6, 3))
    lse[1, 4, 2] = np.nan
    out, out_lse = share_call(device, o, lse, 0)
    assert np.isnan(out[1, 2]).all() and np.isnan(out_lse[1, 2])
    keep = np.ones((4, 3), bool)
    keep[1, 2] = False
    assert not np.isnan(out[keep]).any() and not np.isnan(out_lse[keep]).any()
    assert_merge_matches(out, out_lse, reference_merge_share(o, lse, 0), "float32")


def test_in_place(rng, device):
    """out may be o itself: each element is read before it is written."""
    o, lse = random_o(rng, (6, 4, 64)), random_lse(rng, (6, 3, 4))
    x = device.put(o)
    out, out_lse = attnmerge.merge_share(x, device.put(lse), 1, out=x)
    assert out is x
    assert_merge_matches(device.get(x), device.get(out_lse), reference_merge_share(o, lse, 1), "float32")


def test_strided_inputs_and_outputs(rng, device):
    """o with padded rows, lse an all-gather's [S, tokens, heads] inside a NaN-filled buffer with
    every other head, out with a padded head_size: each read and written through its strides."""
    o, lse = random_o(rng, (5, 3, 24)), random_lse(rng, (4, 5, 3))
    ov, ob = strided_view(o, pad=8)
    lv, lb = strided_view(lse, steps={2: 2})
    dov, _ = device.strided(ov, ob)
    dlv, _ = device.strided(lv, lb)
    outv, outb = strided_view(np.full((5, 3, 24), np.nan, np.float32), order=(1, 0, 2), pad=4)
    dout, doutb = device.strided(outv, outb)
    attnmerge.merge_share(dov, dlv, 3, out=dout, out_lse=None, return_lse=False, states_axis=0)
    got, outside_nan = device.readback(outv, outb, dout, doutb)
    assert outside_nan
    ref_o, _ = reference_merge_share(o, lse, 3, states_axis=0)
    assert_merge_matches(got, None, (ref_o, None), "float32")


def test_allocated_outputs(rng, device):
    """Without out=, the results are allocated where o lives, of o's dtype or out_dtype."""
    o, lse = random_o(rng, (4, 2, 16), "float16"), random_lse(rng, (4, 3, 2))
    out, out_lse = attnmerge.merge_share(device.put(o), device.put(lse), 0)
    assert device.is_mine(out) and device.is_mine(out_lse)
    assert_merge_matches(device.get(out), device.get(out_lse), reference_merge_share(o, lse, 0), "float16")


# --------------------------------------------------------------------------------------------------
# with sinks


@pytest.mark.parametrize("s", (1, 4, 64))
def test_shares_with_a_sink_sum_to_the_merge_with_it(rng, device, s):
    """Every rank's share takes the same sink: the shares sum to merge_states with the sink."""
    o, lse = random_stacked(rng, 6, s, 4, 32, states_axis=0)
    sink = random_lse(rng, (4,))
    total = np.zeros((6, 4, 32))
    for index in range(s):
        out, out_lse = share_call(device, o[index], lse, index, 0, sink=sink)
        assert_merge_matches(out, out_lse, reference_merge_share(o[index], lse, index, states_axis=0, sink=sink),
                             "float32")
        total += to_f64(out)
    ref = reference_merge_stacked(o, lse, states_axis=0, sink=sink)
    assert_merge_matches(total.astype(np.float32), out_lse, ref, "float32")  # out_lse: the last share's
