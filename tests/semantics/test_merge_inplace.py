"""attnmerge.merge_inplace: (O, LSE) <- merge((O, LSE), (O', LSE')), on every device.

merge_inplace(o, lse, o_other, lse_other, *, mask=None, base="e", stream=None) -> (o, lse)

o [tokens, heads, D] (float32, float16 or bfloat16) and lse float32 [tokens, heads] are read and
written in place; mask (uint8 or bool, [tokens]): a token whose mask is 0 is untouched, bit for bit,
and its o_other / lse_other are never read.

Each test takes the `device` fixture (tests/devices.py): NumPy arrays on the CPU, torch tensors on
CUDA.  What only NumPy arrays can express (a read-only flag) is tested on the CPU alone.
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
    lse_view,
    o_view,
    random_pair,
    random_state,
    reference_merge,
    reference_merge_states,
    strided_view,
    to_f64,
)


def bits(x):
    """The raw bytes of a NumPy array, to compare bit for bit (NaN payloads included)."""
    return np.ascontiguousarray(x).view(np.uint8).copy()


def merged(device, o, lse, o2, lse2, **kw):
    """merge_inplace of host arrays on the device; returns (o, lse) read back."""
    do, dl = device.put(o), device.put(lse)
    res, res_lse = attnmerge.merge_inplace(do, dl, device.put(o2), device.put(lse2), **kw)
    assert res is do and res_lse is dl
    return device.get(do), device.get(dl)


@pytest.mark.parametrize("head_size", (1, 3, 72, 100, 128))
@pytest.mark.parametrize("dtype", DTYPES)
def test_merges_the_other_state_into_o_and_lse(rng, device, dtype, head_size):
    o, lse, o2, lse2 = random_pair(rng, tokens=53, heads=6, head_size=head_size, dtype=dtype)
    got = merged(device, o, lse, o2, lse2)
    assert_merge_matches(*got, reference_merge(o, lse, o2, lse2), dtype, "o")


def test_the_other_state_is_left_unchanged(rng, device):
    o, lse, o2, lse2 = random_pair(rng, dtype="float16")
    do2, dl2 = device.put(o2), device.put(lse2)
    attnmerge.merge_inplace(device.put(o), device.put(lse), do2, dl2)
    assert np.array_equal(bits(device.get(do2)), bits(o2)) and np.array_equal(bits(device.get(dl2)), bits(lse2))


def test_the_other_state_may_be_read_only(rng):
    """NumPy's read-only flag on the other state is no obstacle (it is only read)."""
    o, lse, o2, lse2 = random_pair(rng)
    ref = reference_merge(o, lse, o2, lse2)
    o2.setflags(write=False)
    lse2.setflags(write=False)
    attnmerge.merge_inplace(o, lse, o2, lse2)
    assert_merge_matches(o, lse, ref, "float32", "o")


def test_base_2(rng, device):
    o, lse, o2, lse2 = random_pair(rng, dtype="bfloat16")
    got = merged(device, o, lse, o2, lse2, base=2)
    assert_merge_matches(*got, reference_merge(o, lse, o2, lse2, base=2), "bfloat16", "o")


def test_repeated_merges_accumulate(rng, device):
    """Folding four states into one, one in-place merge at a time, is the 4-way merge."""
    parts = [random_state(rng, 20, 3, 64) for _ in range(4)]
    ref = reference_merge_states([p[0] for p in parts], [p[1] for p in parts])
    o, lse = device.put(parts[0][0]), device.put(parts[0][1])
    for p in parts[1:]:
        attnmerge.merge_inplace(o, lse, device.put(p[0]), device.put(p[1]))
    assert_o_close(device.get(o), ref[0], "float32", "o")
    assert_lse_close(device.get(lse), ref[1], "lse")


def test_a_state_merged_with_a_copy_of_itself(rng, device):
    o, lse, _, _ = random_pair(rng)
    got_o, got_lse = merged(device, o, lse, o.copy(), lse.copy())
    assert_o_close(got_o, to_f64(o), "float32", "o")
    assert_lse_close(got_lse, to_f64(lse) + LN2, "lse")


@pytest.mark.parametrize("how", ["merge_inplace", "merge into o_a and lse_a"])
def test_rows_wider_than_a_gpu_block(rng, device, how):
    """head_size 4096 in float32: 2 x 512 GPU threads a row.  Were the merged LSE written while other
    threads of its row still read the old one (it is also an input here), those threads would weight
    their O wrongly.  (300 tokens on the GPU, 30 on the CPU, where the float64 oracle of 300 takes seconds.)"""
    o, lse, o2, lse2 = random_pair(rng, tokens=300 if device.on_gpu else 30, heads=8, head_size=4096)
    do, dl = device.put(o), device.put(lse)
    if how == "merge_inplace":
        attnmerge.merge_inplace(do, dl, device.put(o2), device.put(lse2))
    else:
        attnmerge.merge(do, dl, device.put(o2), device.put(lse2), out=do, out_lse=dl)
    assert_merge_matches(device.get(do), device.get(dl), reference_merge(o, lse, o2, lse2), "float32", "o")


# --------------------------------------------------------------------------------------------------
# the mask


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask_dtype", ["uint8", "bool"])
def test_rows_with_mask_zero_are_untouched_and_their_other_state_is_not_read(rng, device, mask_dtype, dtype):
    o, lse, o2, lse2 = random_pair(rng, tokens=77, heads=4, head_size=128, dtype=dtype)
    mask = (rng.random(77) < 0.5).astype(mask_dtype)
    mask[0], mask[1] = 0, 1
    off = mask == 0
    o2[off] = np.nan  # never read where the mask is 0
    lse2[off] = np.nan
    ref = reference_merge(o, lse, o2, lse2)
    got_o, got_lse = merged(device, o, lse, o2, lse2, mask=device.put(mask))
    assert np.array_equal(bits(got_o[off]), bits(o[off])), "a masked-out row of o changed"
    assert np.array_equal(bits(got_lse[off]), bits(lse[off])), "a masked-out row of lse changed"
    assert_o_close(got_o[~off], ref[0][~off], dtype, "o")
    assert_lse_close(got_lse[~off], ref[1][~off], "lse")


def test_any_nonzero_uint8_mask_value_merges(rng, device):
    o, lse, o2, lse2 = random_pair(rng, tokens=6)
    ref = reference_merge(o, lse, o2, lse2)
    mask = np.array([0, 1, 2, 255, 0, 128], np.uint8)
    got_o, got_lse = merged(device, o, lse, o2, lse2, mask=device.put(mask))
    on = mask != 0
    assert np.array_equal(got_o[~on], o[~on])
    assert_o_close(got_o[on], ref[0][on], "float32", "o")
    assert_lse_close(got_lse[on], ref[1][on], "lse")


@pytest.mark.parametrize("value", [0, 1])
def test_a_uniform_mask(rng, device, value):
    o, lse, o2, lse2 = random_pair(rng, tokens=9)
    ref = reference_merge(o, lse, o2, lse2)
    got_o, got_lse = merged(device, o, lse, o2, lse2, mask=device.put(np.full(9, value, np.uint8)))
    if value:
        assert_merge_matches(got_o, got_lse, ref, "float32", "o")
    else:
        assert np.array_equal(got_o, o) and np.array_equal(got_lse, lse)


def test_a_strided_mask(rng, device):
    o, lse, o2, lse2 = random_pair(rng, tokens=10)
    ref = reference_merge(o, lse, o2, lse2)
    buf = np.zeros(30, np.uint8)
    mask = buf[::3]
    mask[1::2] = 1
    got_o, _ = merged(device, o, lse, o2, lse2, mask=device.strided(mask, buf)[0])
    on = mask != 0
    assert np.array_equal(got_o[~on], o[~on])
    assert_o_close(got_o[on], ref[0][on], "float32", "o")


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_mask_keeping_every_row_gives_the_plain_merges_bits(rng, device, dtype):
    """The masked in-place merge with every row kept (on the GPU: the mask read, O and then the LSEs
    in two launches) gives the plain merge's bits: the same row math on every path, and the oracle's
    values."""
    o, lse, o2, lse2 = random_pair(rng, tokens=37, heads=5, head_size=128, dtype=dtype)
    do, dl, do2, dl2 = (device.put(x) for x in (o, lse, o2, lse2))
    out, out_lse = attnmerge.merge(do, dl, do2, dl2)
    attnmerge.merge_inplace(do, dl, do2, dl2, mask=device.put(np.ones(37, bool)))
    out, out_lse = device.get(out), device.get(out_lse)
    assert np.array_equal(bits(out), bits(device.get(do))) and np.array_equal(bits(out_lse), bits(device.get(dl)))
    assert_merge_matches(out, out_lse, reference_merge(o, lse, o2, lse2), dtype)


# --------------------------------------------------------------------------------------------------
# views, empty parts, NaN


LAYOUTS = [
    ("padded", "contiguous", "transposed", "contiguous"),
    ("offset", "heads_first", "padded", "token_step"),
    ("heads_first", "token_step", "token_step", "transposed"),
    ("head_step", "padded", "contiguous", "padded"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layouts", LAYOUTS, ids="-".join)
def test_strided_views_are_merged_in_place(rng, device, layouts, dtype):
    o0, lse0, o20, lse20 = random_pair(rng, tokens=23, heads=4, head_size=40, dtype=dtype)
    ref = reference_merge(o0, lse0, o20, lse20)
    np_o, np_lse = o_view(o0, layouts[0]), lse_view(lse0, layouts[2])
    o, o_buf = device.strided(*np_o)
    lse, lse_buf = device.strided(*np_lse)
    o2, _ = device.strided(*o_view(o20, layouts[1]))
    lse2, _ = device.strided(*lse_view(lse20, layouts[3]))
    res, res_lse = attnmerge.merge_inplace(o, lse, o2, lse2, mask=device.put(np.ones(23, bool)))
    assert res is o and res_lse is lse
    got_o, clean_o = device.readback(*np_o, o, o_buf)
    got_lse, clean_lse = device.readback(*np_lse, lse, lse_buf)
    assert_merge_matches(got_o, got_lse, ref, dtype, "o")
    assert clean_o and clean_lse, "wrote outside the views"


@pytest.mark.parametrize("dtype", DTYPES)
def test_empty_parts_and_nan_rows(rng, device, dtype):
    o, lse, o2, lse2 = random_pair(rng, tokens=30, heads=3, head_size=24, dtype=dtype)
    lse[0:4] = np.inf  # o empty: takes the other state
    o[0:4] = np.nan
    lse2[4:8] = -np.inf  # other empty: o unchanged
    o2[4:8] = np.nan
    lse[8:10] = np.inf  # both empty: 0, -inf
    lse2[8:10] = -np.inf
    o[8:10] = np.nan
    o2[8:10] = np.nan
    lse[12, 1] = np.nan  # NaN rows
    lse2[13, 2] = np.nan
    ref = reference_merge(o, lse, o2, lse2)
    got_o, got_lse = merged(device, o, lse, o2, lse2)
    assert_merge_matches(got_o, got_lse, ref, dtype, "o")
    assert np.array_equal(to_f64(got_o[0:4]), to_f64(o2[0:4])) and np.array_equal(got_lse[0:4], lse2[0:4])
    assert np.array_equal(to_f64(got_o[4:8]), to_f64(o[4:8])) and np.array_equal(got_lse[4:8], lse[4:8])
    assert np.all(to_f64(got_o[8:10]) == 0) and np.all(got_lse[8:10] == -np.inf)
    assert np.isnan(got_lse).sum() == 2 and np.isnan(to_f64(got_o)).sum() == 2 * 24


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_views_with_empty_parts_and_nan_rows(rng, device, dtype):
    """Empty parts on either side, all-empty rows and NaN rows, in strided views (heads outermost and
    unaligned, every other token, padded LSEs); nothing outside the views is written."""
    o0, lse0, o20, lse20 = random_pair(rng, tokens=40, heads=4, head_size=72, dtype=dtype)
    lse0[0:4] = np.inf
    o0[0:4] = np.nan
    lse20[4:8] = -np.inf
    o20[4:8] = np.nan
    lse0[8:10] = -np.inf
    lse20[8:10] = np.inf
    o0[8:10] = np.nan
    o20[8:10] = np.nan
    lse0[12, 1] = np.nan
    lse20[13, 3] = np.nan
    ref = reference_merge(o0, lse0, o20, lse20)
    np_o = strided_view(o0, order=(1, 0, 2), offset=1, pad=2)
    np_l = strided_view(lse0, order=(1, 0))
    o, o_buf = device.strided(*np_o)
    lse, lse_buf = device.strided(*np_l)
    o2, _ = device.strided(*strided_view(o20, steps={0: 2}))
    lse2, _ = device.strided(*strided_view(lse20, pad=3))
    attnmerge.merge_inplace(o, lse, o2, lse2)
    got_o, clean_o = device.readback(*np_o, o, o_buf)
    got_l, clean_l = device.readback(*np_l, lse, lse_buf)
    assert_merge_matches(got_o, got_l, ref, dtype, "o")
    assert clean_o and clean_l, "wrote outside the views"


def test_zero_tokens(rng, device):
    o, lse, o2, lse2 = random_pair(rng, tokens=0)
    do, dl = device.put(o), device.put(lse)
    res, res_lse = attnmerge.merge_inplace(do, dl, device.put(o2), device.put(lse2),
                                           mask=device.put(np.zeros(0, np.uint8)))
    assert res is do and res_lse is dl
