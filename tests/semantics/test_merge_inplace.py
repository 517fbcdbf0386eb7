"""attnmerge.merge_inplace on the CPU (NumPy arrays): (O, LSE) <- merge((O, LSE), (O', LSE')).

merge_inplace(o, lse, o_other, lse_other, *, mask=None, base="e", stream=None) -> (o, lse)

o [tokens, heads, D] (float32, float16 or bfloat16) and lse float32 [tokens, heads] are read and
written in place; mask (uint8 or bool, [tokens]): a token whose mask is 0 is untouched, bit for bit,
and its o_other / lse_other are never read.
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
    outside_view_is_nan,
    random_state,
    reference_merge,
    to_f64,
)


def states(rng, tokens=37, heads=5, head_size=72, dtype="float32"):
    o, lse = random_state(rng, tokens, heads, head_size, dtype)
    o2, lse2 = random_state(rng, tokens, heads, head_size, dtype)
    return o, lse, o2, lse2


def bits(x):
    """The raw bytes of an array, to compare bit for bit (NaN payloads included)."""
    return np.ascontiguousarray(x).view(np.uint8).copy()


@pytest.mark.parametrize("head_size", (1, 3, 72, 100, 128))
@pytest.mark.parametrize("dtype", DTYPES)
def test_merges_the_other_state_into_o_and_lse(rng, dtype, head_size):
    o, lse, o2, lse2 = states(rng, head_size=head_size, dtype=dtype)
    ref = reference_merge(o, lse, o2, lse2)
    res, res_lse = attnmerge.merge_inplace(o, lse, o2, lse2)
    assert res is o and res_lse is lse
    assert_merge_matches(o, lse, ref, dtype, "o")


def test_the_other_state_is_left_unchanged(rng):
    o, lse, o2, lse2 = states(rng, dtype="float16")
    before = bits(o2), bits(lse2)
    attnmerge.merge_inplace(o, lse, o2, lse2)
    assert np.array_equal(bits(o2), before[0]) and np.array_equal(bits(lse2), before[1])


def test_the_other_state_may_be_read_only(rng):
    o, lse, o2, lse2 = states(rng)
    ref = reference_merge(o, lse, o2, lse2)
    o2.setflags(write=False)
    lse2.setflags(write=False)
    attnmerge.merge_inplace(o, lse, o2, lse2)
    assert_merge_matches(o, lse, ref, "float32", "o")


def test_base_2(rng):
    o, lse, o2, lse2 = states(rng, dtype="bfloat16")
    ref = reference_merge(o, lse, o2, lse2, base=2)
    attnmerge.merge_inplace(o, lse, o2, lse2, base=2)
    assert_merge_matches(o, lse, ref, "bfloat16", "o")


def test_repeated_merges_accumulate(rng):
    """Folding four states into one, one in-place merge at a time, is the 4-way merge."""
    parts = [random_state(rng, 20, 3, 64) for _ in range(4)]
    from oracle import reference_merge_states

    ref = reference_merge_states([p[0] for p in parts], [p[1] for p in parts])
    o, lse = parts[0][0].copy(), parts[0][1].copy()
    for p in parts[1:]:
        attnmerge.merge_inplace(o, lse, *p)
    assert_o_close(o, ref[0], "float32", "o")
    assert_lse_close(lse, ref[1], "lse")


def test_a_state_merged_with_a_copy_of_itself(rng):
    o, lse, _, _ = states(rng)
    o0, lse0 = o.copy(), lse.copy()
    attnmerge.merge_inplace(o, lse, o0.copy(), lse0.copy())
    assert_o_close(o, to_f64(o0), "float32", "o")
    assert_lse_close(lse, to_f64(lse0) + LN2, "lse")


# --------------------------------------------------------------------------------------------------
# the mask


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask_dtype", ["uint8", "bool"])
def test_rows_with_mask_zero_are_untouched_and_their_other_state_is_not_read(rng, mask_dtype, dtype):
    o, lse, o2, lse2 = states(rng, tokens=41, dtype=dtype)
    mask = (rng.random(41) < 0.5).astype(mask_dtype)
    mask[0], mask[1] = 0, 1
    off = mask == 0
    o2[off] = np.nan  # never read where the mask is 0
    lse2[off] = np.nan
    ref = reference_merge(o, lse, o2, lse2)
    o_before, lse_before = o.copy(), lse.copy()
    attnmerge.merge_inplace(o, lse, o2, lse2, mask=mask)
    assert np.array_equal(bits(o[off]), bits(o_before[off])), "a masked-out row of o changed"
    assert np.array_equal(bits(lse[off]), bits(lse_before[off])), "a masked-out row of lse changed"
    assert_o_close(o[~off], ref[0][~off], dtype, "o")
    assert_lse_close(lse[~off], ref[1][~off], "lse")


def test_any_nonzero_uint8_mask_value_merges(rng):
    o, lse, o2, lse2 = states(rng, tokens=6)
    ref = reference_merge(o, lse, o2, lse2)
    o_before = o.copy()
    mask = np.array([0, 1, 2, 255, 0, 128], np.uint8)
    attnmerge.merge_inplace(o, lse, o2, lse2, mask=mask)
    on = mask != 0
    assert np.array_equal(o[~on], o_before[~on])
    assert_o_close(o[on], ref[0][on], "float32", "o")
    assert_lse_close(lse[on], ref[1][on], "lse")


@pytest.mark.parametrize("value", [0, 1])
def test_a_uniform_mask(rng, value):
    o, lse, o2, lse2 = states(rng, tokens=9)
    ref = reference_merge(o, lse, o2, lse2)
    o_before, lse_before = o.copy(), lse.copy()
    attnmerge.merge_inplace(o, lse, o2, lse2, mask=np.full(9, value, np.uint8))
    if value:
        assert_merge_matches(o, lse, ref, "float32", "o")
    else:
        assert np.array_equal(o, o_before) and np.array_equal(lse, lse_before)


def test_a_strided_mask(rng):
    o, lse, o2, lse2 = states(rng, tokens=10)
    ref = reference_merge(o, lse, o2, lse2)
    o_before = o.copy()
    buf = np.zeros(30, np.uint8)
    mask = buf[::3]
    mask[1::2] = 1
    attnmerge.merge_inplace(o, lse, o2, lse2, mask=mask)
    on = mask != 0
    assert np.array_equal(o[~on], o_before[~on])
    assert_o_close(o[on], ref[0][on], "float32", "o")


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
def test_strided_views_are_merged_in_place(rng, layouts, dtype):
    o0, lse0, o20, lse20 = states(rng, tokens=23, heads=4, head_size=40, dtype=dtype)
    ref = reference_merge(o0, lse0, o20, lse20)
    o, o_buf = o_view(o0, layouts[0])
    o2, _ = o_view(o20, layouts[1])
    lse, lse_buf = lse_view(lse0, layouts[2])
    lse2, _ = lse_view(lse20, layouts[3])
    res, res_lse = attnmerge.merge_inplace(o, lse, o2, lse2, mask=np.ones(23, bool))
    assert res is o and res_lse is lse
    assert_merge_matches(o, lse, ref, dtype, "o")
    assert outside_view_is_nan(o, o_buf) and outside_view_is_nan(lse, lse_buf), "wrote outside the views"


@pytest.mark.parametrize("dtype", DTYPES)
def test_empty_parts_and_nan_rows(rng, dtype):
    o, lse, o2, lse2 = states(rng, tokens=30, heads=3, head_size=24, dtype=dtype)
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
    o_other_rows = o2[0:4].copy(), lse2[0:4].copy()
    o_keep = o[4:8].copy(), lse[4:8].copy()
    attnmerge.merge_inplace(o, lse, o2, lse2)
    assert_merge_matches(o, lse, ref, dtype, "o")
    assert np.array_equal(to_f64(o[0:4]), to_f64(o_other_rows[0])) and np.array_equal(lse[0:4], o_other_rows[1])
    assert np.array_equal(to_f64(o[4:8]), to_f64(o_keep[0])) and np.array_equal(lse[4:8], o_keep[1])
    assert np.all(to_f64(o[8:10]) == 0) and np.all(lse[8:10] == -np.inf)
    assert np.isnan(lse).sum() == 2 and np.isnan(to_f64(o)).sum() == 2 * 24


def test_zero_tokens(rng):
    o, lse, o2, lse2 = states(rng, tokens=0)
    res, res_lse = attnmerge.merge_inplace(o, lse, o2, lse2, mask=np.zeros(0, np.uint8))
    assert res is o and res_lse is lse


def test_torch_cpu_tensors(rng):
    torch = pytest.importorskip("torch")
    o, lse, o2, lse2 = states(rng, tokens=17, heads=4, head_size=64)
    ref = reference_merge(o, lse, o2, lse2)
    to, tl = torch.from_numpy(o.copy()), torch.from_numpy(lse.copy())
    mask = torch.ones(17, dtype=torch.bool)
    mask[3] = False
    res, res_lse = attnmerge.merge_inplace(to, tl, torch.from_numpy(o2), torch.from_numpy(lse2), mask=mask)
    assert res is to and res_lse is tl
    on = mask.numpy()
    assert np.array_equal(to.numpy()[3], o[3]) and np.array_equal(tl.numpy()[3], lse[3])
    assert_o_close(to.numpy()[on], ref[0][on], "float32", "o")
    assert_lse_close(tl.numpy()[on], ref[1][on], "lse")
