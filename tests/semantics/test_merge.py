"""attnmerge.merge on the CPU (NumPy arrays): every case of DESIGN.md "Semantics" against the oracle.

merge(o_a, lse_a, o_b, lse_b, *, out=None, out_lse=None, return_lse=True, out_dtype=None, base="e",
      a_tokens=None, stream=None) -> (out, out_lse)
"""

from __future__ import annotations

import numpy as np
import pytest

import attnmerge
from oracle import (
    DTYPES,
    all_nan,
    assert_lse_close,
    assert_merge_matches,
    assert_o_close,
    dtype_name,
    lse_view,
    nan_array,
    np_dtype,
    o_view,
    outside_view_is_nan,
    random_lse,
    random_state,
    reference_merge,
    rounded,
    to_f64,
)

HEAD_SIZES = (1, 3, 72, 80, 100, 256, 512)


def inputs(rng, tokens=37, heads=5, head_size=72, dtype="float32", lse_scale=3.0):
    o_a, lse_a = random_state(rng, tokens, heads, head_size, dtype, lse_scale)
    o_b, lse_b = random_state(rng, tokens, heads, head_size, dtype, lse_scale)
    return o_a, lse_a, o_b, lse_b


# --------------------------------------------------------------------------------------------------
# dtypes


@pytest.mark.parametrize("out_dtype", DTYPES)
@pytest.mark.parametrize("in_dtype", DTYPES)
def test_every_dtype_pair_into_a_given_output(rng, in_dtype, out_dtype):
    o_a, lse_a, o_b, lse_b = inputs(rng, dtype=in_dtype)
    out = nan_array(o_a.shape, out_dtype)
    out_lse = nan_array(lse_a.shape)
    res, res_lse = attnmerge.merge(o_a, lse_a, o_b, lse_b, out=out, out_lse=out_lse)
    assert res is out and res_lse is out_lse
    assert_merge_matches(out, out_lse, reference_merge(o_a, lse_a, o_b, lse_b), out_dtype)


@pytest.mark.parametrize("out_dtype", DTYPES)
@pytest.mark.parametrize("in_dtype", DTYPES)
def test_every_dtype_pair_into_an_allocated_output(rng, in_dtype, out_dtype):
    o_a, lse_a, o_b, lse_b = inputs(rng, dtype=in_dtype)
    out, out_lse = attnmerge.merge(o_a, lse_a, o_b, lse_b, out_dtype=out_dtype)
    assert isinstance(out, np.ndarray) and isinstance(out_lse, np.ndarray)
    assert out.dtype == np_dtype(out_dtype) and out.shape == o_a.shape
    assert out_lse.dtype == np.float32 and out_lse.shape == lse_a.shape
    assert_merge_matches(out, out_lse, reference_merge(o_a, lse_a, o_b, lse_b), out_dtype)


@pytest.mark.parametrize("in_dtype", DTYPES)
def test_the_output_dtype_defaults_to_the_input_dtype(rng, in_dtype):
    o_a, lse_a, o_b, lse_b = inputs(rng, dtype=in_dtype)
    out, out_lse = attnmerge.merge(o_a, lse_a, o_b, lse_b)
    assert out.dtype == o_a.dtype
    assert_merge_matches(out, out_lse, reference_merge(o_a, lse_a, o_b, lse_b), in_dtype)


@pytest.mark.parametrize("out_dtype", DTYPES)
def test_out_dtype_may_be_a_numpy_dtype(rng, out_dtype):
    o_a, lse_a, o_b, lse_b = inputs(rng)
    out, _ = attnmerge.merge(o_a, lse_a, o_b, lse_b, out_dtype=np_dtype(out_dtype))
    assert out.dtype == np_dtype(out_dtype)
    assert_o_close(out, reference_merge(o_a, lse_a, o_b, lse_b)[0], out_dtype)


# --------------------------------------------------------------------------------------------------
# head sizes and layouts


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size", HEAD_SIZES)
def test_any_head_size(rng, head_size, dtype):
    o_a, lse_a, o_b, lse_b = inputs(rng, tokens=19, heads=3, head_size=head_size, dtype=dtype)
    out = nan_array(o_a.shape, dtype)
    out_lse = nan_array(lse_a.shape)
    attnmerge.merge(o_a, lse_a, o_b, lse_b, out=out, out_lse=out_lse)
    assert_merge_matches(out, out_lse, reference_merge(o_a, lse_a, o_b, lse_b), dtype)


# (layout of o_a, o_b, out; layout of lse_a, lse_b, out_lse)
LAYOUT_CASES = [
    (("padded", "padded", "padded"), ("contiguous", "contiguous", "contiguous")),
    (("offset", "contiguous", "offset"), ("transposed", "transposed", "transposed")),
    (("heads_first", "token_step", "contiguous"), ("padded", "token_step", "transposed")),
    (("contiguous", "heads_first", "heads_first"), ("token_step", "contiguous", "padded")),
    (("head_step", "offset", "token_step"), ("transposed", "padded", "token_step")),
    (("token_step", "head_step", "head_step"), ("contiguous", "transposed", "contiguous")),
]


@pytest.mark.parametrize("head_size", (3, 72, 128))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("o_layouts,lse_layouts", LAYOUT_CASES, ids=lambda c: "-".join(c))
def test_strided_views_are_read_and_written_in_place(rng, o_layouts, lse_layouts, dtype, head_size):
    """Any token / head strides on every tensor; only head_size is unit-stride.  Nothing outside
    the views is read (the rest of each buffer is NaN) or written (it stays NaN)."""
    o_a0, lse_a0, o_b0, lse_b0 = inputs(rng, tokens=23, heads=4, head_size=head_size, dtype=dtype)
    o_a, _ = o_view(o_a0, o_layouts[0])
    o_b, _ = o_view(o_b0, o_layouts[1])
    out, out_buf = o_view(nan_array(o_a0.shape, dtype), o_layouts[2])
    lse_a, _ = lse_view(lse_a0, lse_layouts[0])
    lse_b, _ = lse_view(lse_b0, lse_layouts[1])
    out_lse, out_lse_buf = lse_view(nan_array(lse_a0.shape), lse_layouts[2])

    res, res_lse = attnmerge.merge(o_a, lse_a, o_b, lse_b, out=out, out_lse=out_lse)

    assert res is out and res_lse is out_lse
    assert_merge_matches(out, out_lse, reference_merge(o_a0, lse_a0, o_b0, lse_b0), dtype)
    assert outside_view_is_nan(out, out_buf), "wrote outside the out view"
    assert outside_view_is_nan(out_lse, out_lse_buf), "wrote outside the out_lse view"


def test_a_transposed_lse_view_of_a_heads_first_array(rng):
    o_a, _, o_b, _ = inputs(rng, tokens=29, heads=6)
    lse_a_ht = random_lse(rng, (6, 29))  # [heads, tokens]
    lse_b_ht = random_lse(rng, (6, 29))
    out, out_lse = attnmerge.merge(o_a, lse_a_ht.T, o_b, lse_b_ht.T)
    assert out_lse.shape == (29, 6)
    assert_merge_matches(out, out_lse, reference_merge(o_a, lse_a_ht.T, o_b, lse_b_ht.T), "float32")


def test_inputs_broadcast_with_zero_strides(rng):
    """A zero stride is fine on an input (one state shared by every token)."""
    o_a1, lse_a1 = random_state(rng, 1, 4, 64)
    o_b, lse_b = random_state(rng, 17, 4, 64)
    o_a = np.broadcast_to(o_a1, (17, 4, 64))
    lse_a = np.broadcast_to(lse_a1, (17, 4))
    out, out_lse = attnmerge.merge(o_a, lse_a, o_b, lse_b)
    assert_merge_matches(out, out_lse, reference_merge(o_a, lse_a, o_b, lse_b), "float32")


def test_a_zero_stride_on_an_output_axis_of_size_one_is_fine(rng):
    o_a, lse_a, o_b, lse_b = inputs(rng, tokens=1, heads=1, head_size=16)
    buf = nan_array((16,))
    out = np.lib.stride_tricks.as_strided(buf, shape=(1, 1, 16), strides=(0, 0, 4), writeable=True)
    lbuf = nan_array((1,))
    out_lse = np.lib.stride_tricks.as_strided(lbuf, shape=(1, 1), strides=(0, 0), writeable=True)
    attnmerge.merge(o_a, lse_a, o_b, lse_b, out=out, out_lse=out_lse)
    assert_merge_matches(out, out_lse, reference_merge(o_a, lse_a, o_b, lse_b), "float32")


def test_read_only_inputs_are_fine(rng):
    o_a, lse_a, o_b, lse_b = inputs(rng)
    for x in (o_a, lse_a, o_b, lse_b):
        x.setflags(write=False)
    out, out_lse = attnmerge.merge(o_a, lse_a, o_b, lse_b)
    assert_merge_matches(out, out_lse, reference_merge(o_a, lse_a, o_b, lse_b), "float32")


class Unexported(np.ndarray):
    """A NumPy subclass that refuses DLPack: NumPy arrays are read directly, not exported."""

    def __dlpack__(self, *args, **kwargs):
        raise AssertionError("__dlpack__ called")


@pytest.mark.parametrize("dtype", DTYPES)
def test_numpy_arrays_and_subclasses_are_read_directly(rng, dtype):
    o_a, lse_a, o_b, lse_b = inputs(rng, dtype=dtype)
    out, out_lse = nan_array(o_a.shape, dtype).view(Unexported), nan_array(lse_a.shape).view(Unexported)
    attnmerge.merge(*(x.view(Unexported) for x in (o_a, lse_a, o_b, lse_b)), out=out, out_lse=out_lse)
    assert_merge_matches(np.asarray(out), np.asarray(out_lse), reference_merge(o_a, lse_a, o_b, lse_b), dtype)


class InterfaceOnly:
    """An array known only by its __array_interface__ (no DLPack, not a NumPy array)."""

    def __init__(self, x):
        self.base, self.__array_interface__ = x, x.__array_interface__


def test_arrays_known_by_array_interface_alone(rng):
    o_a, lse_a, o_b, lse_b = inputs(rng)
    out, out_lse = nan_array(o_a.shape), nan_array(lse_a.shape)
    attnmerge.merge(*(InterfaceOnly(x) for x in (o_a, lse_a, o_b, lse_b)), out=InterfaceOnly(out),
                    out_lse=InterfaceOnly(out_lse))
    assert_merge_matches(out, out_lse, reference_merge(o_a, lse_a, o_b, lse_b), "float32")


def test_a_big_endian_array_interface_is_refused(rng):
    o_a, lse_a, o_b, lse_b = inputs(rng)
    swapped = InterfaceOnly(o_b.astype(">f4"))
    out = nan_array(o_a.shape)
    with pytest.raises(TypeError, match=r"o_b: expected native byte order, got big-endian >f4"):
        attnmerge.merge(o_a, lse_a, swapped, lse_b, out=out, out_lse=nan_array(lse_a.shape))
    assert all_nan(out)


def test_inputs_are_left_unchanged(rng):
    o_a, lse_a, o_b, lse_b = inputs(rng, dtype="float16")
    copies = [x.copy() for x in (o_a, lse_a, o_b, lse_b)]
    attnmerge.merge(o_a, lse_a, o_b, lse_b, out_dtype="float32")
    for x, c in zip((o_a, lse_a, o_b, lse_b), copies):
        assert np.array_equal(x, c)


# --------------------------------------------------------------------------------------------------
# empty parts, NaN


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("empty", [np.inf, -np.inf], ids=["plus_inf", "minus_inf"])
def test_an_empty_part_gives_the_other_state_and_its_nan_output_does_not_leak(rng, empty, dtype):
    o_a, lse_a, o_b, lse_b = inputs(rng, tokens=40, heads=4, head_size=80, dtype=dtype)
    a_empty = np.zeros(lse_a.shape, dtype=bool)
    a_empty[::3, :] = True
    a_empty[5, 2] = True
    b_empty = np.zeros(lse_a.shape, dtype=bool)
    b_empty[1::3, 1:] = True
    lse_a[a_empty] = empty
    lse_b[b_empty] = empty
    o_a[a_empty] = np.nan  # garbage in an empty part must not be read
    o_b[b_empty] = np.nan
    out = nan_array(o_a.shape, dtype)
    out_lse = nan_array(lse_a.shape)
    attnmerge.merge(o_a, lse_a, o_b, lse_b, out=out, out_lse=out_lse)

    assert not np.isnan(to_f64(out)).any() and not np.isnan(out_lse).any()
    assert_merge_matches(out, out_lse, reference_merge(o_a, lse_a, o_b, lse_b), dtype)
    # the surviving state comes through as it was (weight exactly 1)
    assert np.array_equal(to_f64(out[a_empty]), to_f64(o_b[a_empty]))
    assert np.array_equal(out_lse[a_empty], lse_b[a_empty])
    assert np.array_equal(to_f64(out[b_empty]), to_f64(o_a[b_empty]))
    assert np.array_equal(out_lse[b_empty], lse_a[b_empty])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("empty_a,empty_b", [(np.inf, np.inf), (-np.inf, -np.inf), (np.inf, -np.inf)])
def test_all_parts_empty_gives_zero_and_minus_inf_never_nan(rng, empty_a, empty_b, dtype):
    o_a, lse_a, o_b, lse_b = inputs(rng, tokens=12, heads=3, head_size=40, dtype=dtype)
    rows = np.zeros(lse_a.shape, dtype=bool)
    rows[::2] = True
    lse_a[rows] = empty_a
    lse_b[rows] = empty_b
    o_a[rows] = np.nan
    o_b[rows] = np.nan
    out = nan_array(o_a.shape, dtype)
    out_lse = nan_array(lse_a.shape)
    attnmerge.merge(o_a, lse_a, o_b, lse_b, out=out, out_lse=out_lse)

    assert np.all(to_f64(out[rows]) == 0.0)
    assert np.all(out_lse[rows] == -np.inf)
    assert_merge_matches(out, out_lse, reference_merge(o_a, lse_a, o_b, lse_b), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_nan_lse_makes_its_row_nan(rng, dtype):
    o_a, lse_a, o_b, lse_b = inputs(rng, tokens=30, heads=4, head_size=24, dtype=dtype)
    lse_a[3, 1] = np.nan
    lse_b[7, :] = np.nan
    lse_a[11, 2] = np.nan
    lse_b[11, 2] = np.inf  # NaN beats empty
    lse_a[13, 0] = -np.inf
    lse_b[13, 0] = np.nan  # and the other way round
    nan_rows = np.isnan(lse_a) | np.isnan(lse_b)
    out = nan_array(o_a.shape, dtype)
    out_lse = np.zeros(lse_a.shape, dtype=np.float32) + 7.0  # not pre-poisoned: the NaN must be written
    out[...] = 1.0
    attnmerge.merge(o_a, lse_a, o_b, lse_b, out=out, out_lse=out_lse)

    assert np.all(np.isnan(to_f64(out[nan_rows])))
    assert np.all(np.isnan(out_lse[nan_rows]))
    assert not np.isnan(to_f64(out[~nan_rows])).any()
    assert_merge_matches(out, out_lse, reference_merge(o_a, lse_a, o_b, lse_b), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_part_whose_weight_underflows_to_zero_is_not_read(rng, dtype):
    """lse 1000 below the other: exp(-1000) is exactly 0 in float32, so its NaN O is never read."""
    o_a, lse_a, o_b, lse_b = inputs(rng, tokens=16, heads=2, head_size=32, dtype=dtype)
    lse_a[::2] = lse_b[::2] - 1000.0
    o_a[::2] = np.nan
    lse_b[1::2] = lse_a[1::2] - 1000.0
    o_b[1::2] = np.nan
    out, out_lse = attnmerge.merge(o_a, lse_a, o_b, lse_b)

    assert not np.isnan(to_f64(out)).any()
    assert np.array_equal(to_f64(out[::2]), to_f64(o_b[::2]))
    assert np.array_equal(to_f64(out[1::2]), to_f64(o_a[1::2]))
    assert_lse_close(out_lse[::2], lse_b[::2])
    assert_lse_close(out_lse[1::2], lse_a[1::2])


@pytest.mark.parametrize("dtype", DTYPES)
def test_widely_spread_finite_lse(rng, dtype):
    """LSE differences of tens (tiny but non-zero weights) are merged, not dropped or overflowed."""
    o_a, lse_a, o_b, lse_b = inputs(rng, tokens=64, heads=4, head_size=64, dtype=dtype, lse_scale=30.0)
    lse_a[0] = 80.0
    lse_b[0] = -80.0  # weight exp(-160): underflows in float32
    out, out_lse = attnmerge.merge(o_a, lse_a, o_b, lse_b)
    assert_merge_matches(out, out_lse, reference_merge(o_a, lse_a, o_b, lse_b), dtype)


def test_equal_lse_averages(rng):
    o_a, lse_a, o_b, _ = inputs(rng)
    out, out_lse = attnmerge.merge(o_a, lse_a, o_b, lse_a.copy())
    assert_o_close(out, (to_f64(o_a) + to_f64(o_b)) / 2, "float32")
    assert_lse_close(out_lse, to_f64(lse_a) + np.log(2.0))


# --------------------------------------------------------------------------------------------------
# sizes


@pytest.mark.parametrize("given", [False, True], ids=["allocated", "given"])
def test_zero_tokens(rng, given):
    o_a, lse_a, o_b, lse_b = inputs(rng, tokens=0, heads=4, head_size=64)
    kw = {}
    if given:
        kw = dict(out=nan_array((0, 4, 64)), out_lse=nan_array((0, 4)))
    out, out_lse = attnmerge.merge(o_a, lse_a, o_b, lse_b, **kw)
    assert out.shape == (0, 4, 64) and out_lse.shape == (0, 4)


def test_one_token_one_head(rng):
    o_a, lse_a, o_b, lse_b = inputs(rng, tokens=1, heads=1, head_size=1)
    out, out_lse = attnmerge.merge(o_a, lse_a, o_b, lse_b)
    assert_merge_matches(out, out_lse, reference_merge(o_a, lse_a, o_b, lse_b), "float32")


@pytest.mark.parametrize("out_dtype", ["float32", "bfloat16"])
def test_a_large_input_split_over_threads(rng, out_dtype):
    """4096 tokens x 32 heads x 128 is large enough for the CPU path to use several threads."""
    o_a, lse_a, o_b, lse_b = inputs(rng, tokens=4096, heads=32, head_size=128)
    lse_a[100:200] = np.inf
    lse_b[150:250] = -np.inf
    lse_b[4000, 3] = np.nan
    out, out_lse = attnmerge.merge(o_a, lse_a, o_b, lse_b, out_dtype=out_dtype)
    assert_merge_matches(out, out_lse, reference_merge(o_a, lse_a, o_b, lse_b), out_dtype)
    again, again_lse = attnmerge.merge(o_a, lse_a, o_b, lse_b, out_dtype=out_dtype)
    assert np.array_equal(to_f64(again), to_f64(out), equal_nan=True), "not deterministic"
    assert np.array_equal(again_lse, out_lse, equal_nan=True), "not deterministic"


# --------------------------------------------------------------------------------------------------
# options


def test_return_lse_false_gives_no_lse(rng):
    o_a, lse_a, o_b, lse_b = inputs(rng)
    out, out_lse = attnmerge.merge(o_a, lse_a, o_b, lse_b, return_lse=False)
    assert out_lse is None
    assert_o_close(out, reference_merge(o_a, lse_a, o_b, lse_b)[0], "float32")


def test_return_lse_false_into_a_given_output(rng):
    o_a, lse_a, o_b, lse_b = inputs(rng, dtype="float16")
    out = nan_array(o_a.shape, "float16")
    res, res_lse = attnmerge.merge(o_a, lse_a, o_b, lse_b, out=out, return_lse=False)
    assert res is out and res_lse is None
    assert_o_close(out, reference_merge(o_a, lse_a, o_b, lse_b)[0], "float16")


def test_a_given_out_lse_is_written_even_with_return_lse_false(rng):
    o_a, lse_a, o_b, lse_b = inputs(rng)
    out_lse = nan_array(lse_a.shape)
    out, res_lse = attnmerge.merge(o_a, lse_a, o_b, lse_b, out_lse=out_lse, return_lse=False)
    assert res_lse is out_lse
    assert_merge_matches(out, out_lse, reference_merge(o_a, lse_a, o_b, lse_b), "float32")


def test_given_out_with_allocated_out_lse(rng):
    o_a, lse_a, o_b, lse_b = inputs(rng)
    out = nan_array(o_a.shape, "bfloat16")
    res, out_lse = attnmerge.merge(o_a, lse_a, o_b, lse_b, out=out)
    assert res is out
    assert isinstance(out_lse, np.ndarray) and out_lse.dtype == np.float32 and out_lse.shape == lse_a.shape
    assert_merge_matches(out, out_lse, reference_merge(o_a, lse_a, o_b, lse_b), "bfloat16")


@pytest.mark.parametrize("dtype", DTYPES)
def test_base_2(rng, dtype):
    """base=2: LSEs are log2-sum-exp2 and the merged LSE is in base 2 too."""
    o_a, lse_a, o_b, lse_b = inputs(rng, dtype=dtype)
    lse_a[0] = np.inf
    lse_b[1] = -np.inf
    lse_a[2, 0] = np.nan
    out, out_lse = attnmerge.merge(o_a, lse_a, o_b, lse_b, base=2)
    assert_merge_matches(out, out_lse, reference_merge(o_a, lse_a, o_b, lse_b, base=2), dtype)
    # not the natural-log answer
    out_e, _ = attnmerge.merge(o_a, lse_a, o_b, lse_b)
    assert not np.allclose(to_f64(out_e[3:]), to_f64(out[3:]))


def test_base_e_is_the_default(rng):
    o_a, lse_a, o_b, lse_b = inputs(rng)
    out, out_lse = attnmerge.merge(o_a, lse_a, o_b, lse_b, base="e")
    out2, out_lse2 = attnmerge.merge(o_a, lse_a, o_b, lse_b)
    assert np.array_equal(out, out2) and np.array_equal(out_lse, out_lse2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("a_tokens", [0, 1, 13, 31, 32])
def test_a_tokens_merges_only_the_first_tokens(rng, a_tokens, dtype):
    """Rows past a_tokens take b alone, as it is; a's rows there are never read."""
    o_a, lse_a, o_b, lse_b = inputs(rng, tokens=32, heads=3, head_size=48, dtype=dtype)
    o_a[a_tokens:] = np.nan
    lse_a[a_tokens:] = np.nan
    lse_b[-1, 0] = np.inf  # b empty past a_tokens: O = 0, LSE = -inf
    out = nan_array(o_a.shape, dtype)
    out_lse = nan_array(lse_a.shape)
    attnmerge.merge(o_a, lse_a, o_b, lse_b, out=out, out_lse=out_lse, a_tokens=a_tokens)

    assert_merge_matches(out, out_lse, reference_merge(o_a, lse_a, o_b, lse_b, a_tokens=a_tokens), dtype)
    if a_tokens < 32:
        tail = slice(a_tokens, 31)
        assert np.array_equal(to_f64(out[tail]), to_f64(o_b[tail]))
        assert np.array_equal(out_lse[tail], lse_b[tail])
        assert np.all(to_f64(out[-1, 0]) == 0.0) and out_lse[-1, 0] == -np.inf


@pytest.mark.parametrize("a_tokens", [0, 5, 20])
def test_a_needs_only_a_tokens_tokens(rng, a_tokens):
    o_a, lse_a = random_state(rng, a_tokens, 3, 40)
    o_b, lse_b = random_state(rng, 20, 3, 40)
    out, out_lse = attnmerge.merge(o_a, lse_a, o_b, lse_b, a_tokens=a_tokens, out_dtype="float16")
    assert out.shape == o_b.shape
    assert_merge_matches(out, out_lse, reference_merge(o_a, lse_a, o_b, lse_b, a_tokens=a_tokens), "float16")


def test_a_tokens_past_a_into_a_narrower_output_dtype(rng):
    o_a, lse_a, o_b, lse_b = inputs(rng, tokens=10, heads=2, head_size=8)
    out, out_lse = attnmerge.merge(o_a, lse_a, o_b, lse_b, a_tokens=4, out_dtype="bfloat16")
    assert np.array_equal(to_f64(out[4:]), rounded(o_b[4:], "bfloat16"))


def test_stream_is_ignored_on_the_cpu(rng):
    o_a, lse_a, o_b, lse_b = inputs(rng)
    out, out_lse = attnmerge.merge(o_a, lse_a, o_b, lse_b, stream=0)
    assert_merge_matches(out, out_lse, reference_merge(o_a, lse_a, o_b, lse_b), "float32")


# --------------------------------------------------------------------------------------------------
# in place


@pytest.mark.parametrize("target", ["o_a", "o_b"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_out_may_be_an_input_itself(rng, target, dtype):
    o_a, lse_a, o_b, lse_b = inputs(rng, dtype=dtype)
    lse_a[0] = np.inf
    lse_b[1] = np.inf
    ref = reference_merge(o_a, lse_a, o_b, lse_b)
    out = o_a if target == "o_a" else o_b
    out_lse = lse_a if target == "o_a" else lse_b
    res, res_lse = attnmerge.merge(o_a, lse_a, o_b, lse_b, out=out, out_lse=out_lse)
    assert res is out and res_lse is out_lse
    assert_merge_matches(out, out_lse, ref, dtype)


def test_in_place_on_a_strided_view(rng):
    o_a0, lse_a0, o_b, lse_b = inputs(rng, head_size=100, dtype="bfloat16")
    o_a, _ = o_view(o_a0, "padded")
    lse_a, _ = lse_view(lse_a0, "transposed")
    ref = reference_merge(o_a0, lse_a0, o_b, lse_b)
    attnmerge.merge(o_a, lse_a, o_b, lse_b, out=o_a, out_lse=lse_a)
    assert_merge_matches(o_a, lse_a, ref, "bfloat16")


# --------------------------------------------------------------------------------------------------
# the package


def test_version_and_build_info():
    info = attnmerge.build_info()
    for key in ("version", "cuda_build_version", "cuda_architectures", "driver_version", "device_count"):
        assert key in info, key
    assert info["version"] == attnmerge.__version__
    assert isinstance(attnmerge.__version__, str) and attnmerge.__version__.count(".") >= 2
    assert isinstance(info["device_count"], int) and info["device_count"] >= 0
    assert info["cuda_architectures"]


def test_poisoned_output_is_all_nan_before_the_call():
    # guards the error tests' "nothing is written" check
    assert all_nan(nan_array((3, 2, 4), "bfloat16")) and all_nan(nan_array((3, 2), "float32"))
    assert dtype_name(nan_array((1,), "bfloat16")) == "bfloat16"
