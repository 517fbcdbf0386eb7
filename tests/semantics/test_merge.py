"""attnmerge.merge: every case of DESIGN.md "Semantics" against the oracle, on every device.

merge(o_a, lse_a, o_b, lse_b, *, out=None, out_lse=None, return_lse=True, out_dtype=None, base="e",
      a_tokens=None, stream=None) -> (out, out_lse)

Each test takes the `device` fixture (tests/devices.py): NumPy arrays on the CPU, torch tensors on
CUDA.  What only the CPU path has (a stream that means nothing there) is tested on the CPU alone;
what each array library does with its own arrays is in tests/interop/.
"""

from __future__ import annotations

import numpy as np
import pytest

import attnmerge
from oracle import (
    DTYPES,
    assert_lse_close,
    assert_merge_matches,
    assert_o_close,
    lse_view,
    nan_array,
    o_view,
    random_lse,
    random_pair,
    random_state,
    reference_merge,
    rounded,
    to_f64,
)

HEAD_SIZES = (1, 3, 72, 80, 100, 256, 512)


def merged(device, o_a, lse_a, o_b, lse_b, out_dtype=None, **kw):
    """merge of host arrays on the device into NaN-poisoned given outputs; returns them read back."""
    out = device.nan(o_b.shape, out_dtype or o_b.dtype)
    out_lse = device.nan(lse_b.shape)
    res, res_lse = attnmerge.merge(*(device.put(x) for x in (o_a, lse_a, o_b, lse_b)), out=out, out_lse=out_lse, **kw)
    assert res is out and res_lse is out_lse
    return device.get(out), device.get(out_lse)


def allocated(device, *host, **kw):
    """merge of host arrays on the device into allocated outputs; returns them read back."""
    out, out_lse = attnmerge.merge(*(device.put(x) for x in host), **kw)
    return device.get(out), device.get(out_lse)


# --------------------------------------------------------------------------------------------------
# dtypes


@pytest.mark.parametrize("out_dtype", DTYPES)
@pytest.mark.parametrize("in_dtype", DTYPES)
def test_every_dtype_pair_into_a_given_output(rng, device, in_dtype, out_dtype):
    h = random_pair(rng, dtype=in_dtype)
    out, out_lse = merged(device, *h, out_dtype=out_dtype)
    assert_merge_matches(out, out_lse, reference_merge(*h), out_dtype)


@pytest.mark.parametrize("out_dtype", DTYPES)
@pytest.mark.parametrize("in_dtype", DTYPES)
def test_every_dtype_pair_into_an_allocated_output(rng, device, in_dtype, out_dtype):
    h = random_pair(rng, dtype=in_dtype)
    out, out_lse = attnmerge.merge(*(device.put(x) for x in h), out_dtype=out_dtype)
    assert device.is_mine(out) and device.is_mine(out_lse)
    assert out.dtype == device.dtype(out_dtype) and tuple(out.shape) == h[0].shape
    assert out_lse.dtype == device.dtype("float32") and tuple(out_lse.shape) == h[1].shape
    assert_merge_matches(device.get(out), device.get(out_lse), reference_merge(*h), out_dtype)


@pytest.mark.parametrize("in_dtype", DTYPES)
def test_the_output_dtype_defaults_to_the_input_dtype(rng, device, in_dtype):
    h = random_pair(rng, dtype=in_dtype)
    out, out_lse = attnmerge.merge(*(device.put(x) for x in h))
    assert out.dtype == device.dtype(in_dtype)
    assert_merge_matches(device.get(out), device.get(out_lse), reference_merge(*h), in_dtype)


@pytest.mark.parametrize("out_dtype", DTYPES)
def test_out_dtype_may_be_a_dtype_of_the_arrays_library(rng, device, out_dtype):
    """A NumPy dtype for NumPy arrays, a torch dtype for torch tensors, as well as a name."""
    h = random_pair(rng)
    out, _ = attnmerge.merge(*(device.put(x) for x in h), out_dtype=device.dtype(out_dtype))
    assert out.dtype == device.dtype(out_dtype) and device.is_mine(out)
    assert_o_close(device.get(out), reference_merge(*h)[0], out_dtype)


# --------------------------------------------------------------------------------------------------
# head sizes and layouts


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size", HEAD_SIZES)
def test_any_head_size(rng, device, head_size, dtype):
    h = random_pair(rng, tokens=19, heads=3, head_size=head_size, dtype=dtype)
    out, out_lse = merged(device, *h)
    assert_merge_matches(out, out_lse, reference_merge(*h), dtype)


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
def test_strided_views_are_read_and_written_in_place(rng, device, o_layouts, lse_layouts, dtype, head_size):
    """Any token / head strides on every tensor; only head_size is unit-stride.  Nothing outside
    the views is read (the rest of each buffer is NaN) or written (it stays NaN)."""
    o_a0, lse_a0, o_b0, lse_b0 = random_pair(rng, tokens=23, heads=4, head_size=head_size, dtype=dtype)
    o_a, _ = device.strided(*o_view(o_a0, o_layouts[0]))
    o_b, _ = device.strided(*o_view(o_b0, o_layouts[1]))
    np_out = o_view(nan_array(o_a0.shape, dtype), o_layouts[2])
    lse_a, _ = device.strided(*lse_view(lse_a0, lse_layouts[0]))
    lse_b, _ = device.strided(*lse_view(lse_b0, lse_layouts[1]))
    np_out_lse = lse_view(nan_array(lse_a0.shape), lse_layouts[2])
    out, out_buf = device.strided(*np_out)
    out_lse, out_lse_buf = device.strided(*np_out_lse)

    res, res_lse = attnmerge.merge(o_a, lse_a, o_b, lse_b, out=out, out_lse=out_lse)

    assert res is out and res_lse is out_lse
    got, clean = device.readback(*np_out, out, out_buf)
    got_lse, clean_lse = device.readback(*np_out_lse, out_lse, out_lse_buf)
    assert_merge_matches(got, got_lse, reference_merge(o_a0, lse_a0, o_b0, lse_b0), dtype)
    assert clean, "wrote outside the out view"
    assert clean_lse, "wrote outside the out_lse view"


def test_a_transposed_lse_view_of_a_heads_first_array(rng, device):
    o_a, _, o_b, _ = random_pair(rng, tokens=29, heads=6)
    lse_a_ht = random_lse(rng, (6, 29))  # [heads, tokens]
    lse_b_ht = random_lse(rng, (6, 29))
    out, out_lse = attnmerge.merge(device.put(o_a), device.put(lse_a_ht).T, device.put(o_b), device.put(lse_b_ht).T)
    assert tuple(out_lse.shape) == (29, 6)
    assert_merge_matches(device.get(out), device.get(out_lse), reference_merge(o_a, lse_a_ht.T, o_b, lse_b_ht.T),
                         "float32")


@pytest.mark.parametrize("a_tokens", [None, 50])
@pytest.mark.parametrize("tokens", [64, 67, 203])
@pytest.mark.parametrize("dtype", DTYPES)
def test_lses_laid_out_heads_first_from_64_tokens(rng, device, dtype, tokens, a_tokens):
    """From 64 tokens, LSEs laid out [heads, tokens] make the GPU take rows in tiles of 8 tokens;
    the last tile may be partial (67, 203), and its rows past the last token write nothing."""
    o_a, lse_a, o_b, lse_b = random_pair(rng, tokens=tokens, heads=5, head_size=72, dtype=dtype)
    if a_tokens is not None:
        o_a, lse_a = o_a[:a_tokens].copy(), lse_a[:a_tokens].copy()
    lse_a[3, 2] = np.nan  # a NaN row and an empty part inside a tile
    lse_b[9, 4] = np.inf
    lse_a_d, _ = device.strided(*lse_view(lse_a, "transposed"))
    lse_b_d, _ = device.strided(*lse_view(lse_b, "transposed"))
    np_out_lse = lse_view(nan_array(lse_b.shape), "transposed")
    out_lse, out_lse_buf = device.strided(*np_out_lse)
    out = device.nan(o_b.shape, dtype)
    attnmerge.merge(device.put(o_a), lse_a_d, device.put(o_b), lse_b_d, out=out, out_lse=out_lse, a_tokens=a_tokens)
    got_lse, clean = device.readback(*np_out_lse, out_lse, out_lse_buf)
    assert_merge_matches(device.get(out), got_lse, reference_merge(o_a, lse_a, o_b, lse_b, a_tokens=a_tokens), dtype)
    assert clean, "wrote outside the out_lse view"


def test_inputs_broadcast_with_zero_strides(rng, device):
    """A zero stride is fine on an input (one state shared by every token)."""
    o_a1, lse_a1 = random_state(rng, 1, 4, 64)
    o_b, lse_b = random_state(rng, 17, 4, 64)
    o_a = np.broadcast_to(o_a1, (17, 4, 64))
    lse_a = np.broadcast_to(lse_a1, (17, 4))
    out, out_lse = attnmerge.merge(device.strided(o_a, o_a1)[0], device.strided(lse_a, lse_a1)[0], device.put(o_b),
                                   device.put(lse_b))
    assert_merge_matches(device.get(out), device.get(out_lse), reference_merge(o_a, lse_a, o_b, lse_b), "float32")


def test_a_zero_stride_on_an_output_axis_of_size_one_is_fine(rng, device):
    h = random_pair(rng, tokens=1, heads=1, head_size=16)
    buf = nan_array((16,))
    np_out = np.lib.stride_tricks.as_strided(buf, shape=(1, 1, 16), strides=(0, 0, 4), writeable=True)
    lbuf = nan_array((1,))
    np_out_lse = np.lib.stride_tricks.as_strided(lbuf, shape=(1, 1), strides=(0, 0), writeable=True)
    out, dbuf = device.strided(np_out, buf)
    out_lse, dlbuf = device.strided(np_out_lse, lbuf)
    attnmerge.merge(*(device.put(x) for x in h), out=out, out_lse=out_lse)
    assert_merge_matches(device.get(dbuf).reshape(1, 1, 16), device.get(dlbuf).reshape(1, 1), reference_merge(*h),
                         "float32")


def test_read_only_inputs_are_fine(rng):
    """NumPy's read-only flag on an input is no obstacle (an input is only read)."""
    h = random_pair(rng)
    for x in h:
        x.setflags(write=False)
    out, out_lse = attnmerge.merge(*h)
    assert_merge_matches(out, out_lse, reference_merge(*h), "float32")


def test_inputs_are_left_unchanged(rng, device):
    h = random_pair(rng, dtype="float16")
    d = [device.put(x) for x in h]
    attnmerge.merge(*d, out_dtype="float32")
    for x, c in zip(d, h):
        assert np.array_equal(device.get(x), c)


# --------------------------------------------------------------------------------------------------
# empty parts, NaN


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("empty", [np.inf, -np.inf], ids=["plus_inf", "minus_inf"])
def test_an_empty_part_gives_the_other_state_and_its_nan_output_does_not_leak(rng, device, empty, dtype):
    o_a, lse_a, o_b, lse_b = random_pair(rng, tokens=40, heads=4, head_size=80, dtype=dtype)
    a_empty = np.zeros(lse_a.shape, dtype=bool)
    a_empty[::3, :] = True
    a_empty[5, 2] = True
    b_empty = np.zeros(lse_a.shape, dtype=bool)
    b_empty[1::3, 1:] = True
    lse_a[a_empty] = empty
    lse_b[b_empty] = empty
    o_a[a_empty] = np.nan  # garbage in an empty part must not be read
    o_b[b_empty] = np.nan
    out, out_lse = merged(device, o_a, lse_a, o_b, lse_b)

    assert not np.isnan(to_f64(out)).any() and not np.isnan(out_lse).any()
    assert_merge_matches(out, out_lse, reference_merge(o_a, lse_a, o_b, lse_b), dtype)
    # the surviving state comes through as it was (weight exactly 1)
    assert np.array_equal(to_f64(out[a_empty]), to_f64(o_b[a_empty]))
    assert np.array_equal(out_lse[a_empty], lse_b[a_empty])
    assert np.array_equal(to_f64(out[b_empty]), to_f64(o_a[b_empty]))
    assert np.array_equal(out_lse[b_empty], lse_a[b_empty])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("empty_a,empty_b", [(np.inf, np.inf), (-np.inf, -np.inf), (np.inf, -np.inf)])
def test_all_parts_empty_gives_zero_and_minus_inf_never_nan(rng, device, empty_a, empty_b, dtype):
    o_a, lse_a, o_b, lse_b = random_pair(rng, tokens=12, heads=3, head_size=40, dtype=dtype)
    rows = np.zeros(lse_a.shape, dtype=bool)
    rows[::2] = True
    lse_a[rows] = empty_a
    lse_b[rows] = empty_b
    o_a[rows] = np.nan
    o_b[rows] = np.nan
    out, out_lse = merged(device, o_a, lse_a, o_b, lse_b)

    assert np.all(to_f64(out[rows]) == 0.0)
    assert np.all(out_lse[rows] == -np.inf)
    assert_merge_matches(out, out_lse, reference_merge(o_a, lse_a, o_b, lse_b), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_nan_lse_makes_its_row_nan(rng, device, dtype):
    o_a, lse_a, o_b, lse_b = random_pair(rng, tokens=30, heads=4, head_size=24, dtype=dtype)
    lse_a[3, 1] = np.nan
    lse_b[7, :] = np.nan
    lse_a[11, 2] = np.nan
    lse_b[11, 2] = np.inf  # NaN beats empty
    lse_a[13, 0] = -np.inf
    lse_b[13, 0] = np.nan  # and the other way round
    nan_rows = np.isnan(lse_a) | np.isnan(lse_b)
    out = device.put(np.ones(o_a.shape, np.float32).astype(o_a.dtype))
    out_lse = device.put(np.full(lse_a.shape, 7.0, np.float32))  # not pre-poisoned: the NaN must be written
    attnmerge.merge(*(device.put(x) for x in (o_a, lse_a, o_b, lse_b)), out=out, out_lse=out_lse)
    out, out_lse = device.get(out), device.get(out_lse)

    assert np.all(np.isnan(to_f64(out[nan_rows])))
    assert np.all(np.isnan(out_lse[nan_rows]))
    assert not np.isnan(to_f64(out[~nan_rows])).any()
    assert_merge_matches(out, out_lse, reference_merge(o_a, lse_a, o_b, lse_b), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_part_whose_weight_underflows_to_zero_is_not_read(rng, device, dtype):
    """lse 1000 below the other: exp(-1000) is exactly 0 in float32, so its NaN O is never read."""
    o_a, lse_a, o_b, lse_b = random_pair(rng, tokens=16, heads=2, head_size=32, dtype=dtype)
    lse_a[::2] = lse_b[::2] - 1000.0
    o_a[::2] = np.nan
    lse_b[1::2] = lse_a[1::2] - 1000.0
    o_b[1::2] = np.nan
    out, out_lse = allocated(device, o_a, lse_a, o_b, lse_b)

    assert not np.isnan(to_f64(out)).any()
    assert np.array_equal(to_f64(out[::2]), to_f64(o_b[::2]))
    assert np.array_equal(to_f64(out[1::2]), to_f64(o_a[1::2]))
    assert_lse_close(out_lse[::2], lse_b[::2])
    assert_lse_close(out_lse[1::2], lse_a[1::2])


@pytest.mark.parametrize("dtype", DTYPES)
def test_widely_spread_finite_lse(rng, device, dtype):
    """LSE differences of tens (tiny but non-zero weights) are merged, not dropped or overflowed."""
    o_a, lse_a, o_b, lse_b = random_pair(rng, tokens=64, heads=4, head_size=64, dtype=dtype, lse_scale=30.0)
    lse_a[0] = 80.0
    lse_b[0] = -80.0  # weight exp(-160): underflows in float32
    out, out_lse = allocated(device, o_a, lse_a, o_b, lse_b)
    assert_merge_matches(out, out_lse, reference_merge(o_a, lse_a, o_b, lse_b), dtype)


def test_equal_lse_averages(rng, device):
    o_a, lse_a, o_b, _ = random_pair(rng)
    out, out_lse = allocated(device, o_a, lse_a, o_b, lse_a.copy())
    assert_o_close(out, (to_f64(o_a) + to_f64(o_b)) / 2, "float32")
    assert_lse_close(out_lse, to_f64(lse_a) + np.log(2.0))


# --------------------------------------------------------------------------------------------------
# sizes


@pytest.mark.parametrize("given", [False, True], ids=["allocated", "given"])
def test_zero_tokens(rng, device, given):
    h = random_pair(rng, tokens=0, heads=4, head_size=64)
    kw = dict(out=device.nan((0, 4, 64)), out_lse=device.nan((0, 4))) if given else {}
    out, out_lse = attnmerge.merge(*(device.put(x) for x in h), **kw)
    assert tuple(out.shape) == (0, 4, 64) and tuple(out_lse.shape) == (0, 4)


def test_one_token_one_head(rng, device):
    """One element.  Its two O of one sign: a single element of opposite signs can cancel, and then
    its float32 rounding is relative to the inputs, not to the result the tolerance is relative to."""
    o_a, lse_a, o_b, lse_b = h = random_pair(rng, tokens=1, heads=1, head_size=1)
    o_b[...] = np.copysign(o_b, o_a)
    out, out_lse = allocated(device, *h)
    assert_merge_matches(out, out_lse, reference_merge(*h), "float32")


@pytest.mark.parametrize("in_dtype,out_dtype", [("float32", "float32"), ("float32", "bfloat16"),
                                                ("bfloat16", "bfloat16")])
def test_a_large_input_split_over_threads(rng, device, in_dtype, out_dtype):
    """4096 tokens x 32 heads x 128: large enough for the CPU path to use several threads, and for
    many GPU blocks; the same bits twice."""
    h = random_pair(rng, tokens=4096, heads=32, head_size=128, dtype=in_dtype)
    h[1][100:200] = np.inf
    h[3][150:250] = -np.inf
    h[3][4000, 3] = np.nan
    d = [device.put(x) for x in h]
    out, out_lse = attnmerge.merge(*d, out_dtype=out_dtype)
    out, out_lse = device.get(out), device.get(out_lse)
    assert_merge_matches(out, out_lse, reference_merge(*h), out_dtype)
    again, again_lse = attnmerge.merge(*d, out_dtype=out_dtype)
    assert np.array_equal(to_f64(device.get(again)), to_f64(out), equal_nan=True), "not deterministic"
    assert np.array_equal(device.get(again_lse), out_lse, equal_nan=True), "not deterministic"


# --------------------------------------------------------------------------------------------------
# options


def test_return_lse_false_gives_no_lse(rng, device):
    h = random_pair(rng)
    out, out_lse = attnmerge.merge(*(device.put(x) for x in h), return_lse=False)
    assert out_lse is None
    assert_o_close(device.get(out), reference_merge(*h)[0], "float32")


def test_return_lse_false_into_a_given_output(rng, device):
    h = random_pair(rng, dtype="float16")
    out = device.nan(h[0].shape, "float16")
    res, res_lse = attnmerge.merge(*(device.put(x) for x in h), out=out, return_lse=False)
    assert res is out and res_lse is None
    assert_o_close(device.get(out), reference_merge(*h)[0], "float16")


def test_a_given_out_lse_is_written_even_with_return_lse_false(rng, device):
    h = random_pair(rng)
    out_lse = device.nan(h[1].shape)
    out, res_lse = attnmerge.merge(*(device.put(x) for x in h), out_lse=out_lse, return_lse=False)
    assert res_lse is out_lse
    assert_merge_matches(device.get(out), device.get(out_lse), reference_merge(*h), "float32")


def test_given_out_with_allocated_out_lse(rng, device):
    h = random_pair(rng)
    out = device.nan(h[0].shape, "bfloat16")
    res, out_lse = attnmerge.merge(*(device.put(x) for x in h), out=out)
    assert res is out
    assert device.is_mine(out_lse) and out_lse.dtype == device.dtype("float32") and tuple(out_lse.shape) == h[1].shape
    assert_merge_matches(device.get(out), device.get(out_lse), reference_merge(*h), "bfloat16")


@pytest.mark.parametrize("dtype", DTYPES)
def test_base_2(rng, device, dtype):
    """base=2: LSEs are log2-sum-exp2 and the merged LSE is in base 2 too."""
    o_a, lse_a, o_b, lse_b = random_pair(rng, dtype=dtype)
    lse_a[0] = np.inf
    lse_b[1] = -np.inf
    lse_a[2, 0] = np.nan
    out, out_lse = allocated(device, o_a, lse_a, o_b, lse_b, base=2)
    assert_merge_matches(out, out_lse, reference_merge(o_a, lse_a, o_b, lse_b, base=2), dtype)
    # not the natural-log answer
    out_e, _ = allocated(device, o_a, lse_a, o_b, lse_b)
    assert not np.allclose(to_f64(out_e[3:]), to_f64(out[3:]))


def test_base_e_is_the_default(rng, device):
    h = random_pair(rng)
    out, out_lse = allocated(device, *h, base="e")
    out2, out_lse2 = allocated(device, *h)
    assert np.array_equal(out, out2) and np.array_equal(out_lse, out_lse2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("a_tokens", [0, 1, 13, 31, 32])
def test_a_tokens_merges_only_the_first_tokens(rng, device, a_tokens, dtype):
    """Rows past a_tokens take b alone, as it is; a's rows there are never read."""
    o_a, lse_a, o_b, lse_b = random_pair(rng, tokens=32, heads=3, head_size=48, dtype=dtype)
    o_a[a_tokens:] = np.nan
    lse_a[a_tokens:] = np.nan
    lse_b[-1, 0] = np.inf  # b empty past a_tokens: O = 0, LSE = -inf
    out, out_lse = merged(device, o_a, lse_a, o_b, lse_b, a_tokens=a_tokens)

    assert_merge_matches(out, out_lse, reference_merge(o_a, lse_a, o_b, lse_b, a_tokens=a_tokens), dtype)
    if a_tokens < 32:
        tail = slice(a_tokens, 31)
        assert np.array_equal(to_f64(out[tail]), to_f64(o_b[tail]))
        assert np.array_equal(out_lse[tail], lse_b[tail])
        assert np.all(to_f64(out[-1, 0]) == 0.0) and out_lse[-1, 0] == -np.inf


@pytest.mark.parametrize("a_tokens", [0, 5, 20])
def test_a_needs_only_a_tokens_tokens(rng, device, a_tokens):
    o_a, lse_a = random_state(rng, a_tokens, 3, 40)
    o_b, lse_b = random_state(rng, 20, 3, 40)
    out, out_lse = allocated(device, o_a, lse_a, o_b, lse_b, a_tokens=a_tokens, out_dtype="float16")
    assert out.shape == o_b.shape
    assert_merge_matches(out, out_lse, reference_merge(o_a, lse_a, o_b, lse_b, a_tokens=a_tokens), "float16")


def test_a_tokens_past_a_into_a_narrower_output_dtype(rng, device):
    h = random_pair(rng, tokens=10, heads=2, head_size=8)
    out, _ = allocated(device, *h, a_tokens=4, out_dtype="bfloat16")
    assert np.array_equal(to_f64(out[4:]), rounded(h[2][4:], "bfloat16"))


def test_stream_is_ignored_on_the_cpu(rng):
    h = random_pair(rng)
    out, out_lse = attnmerge.merge(*h, stream=0)
    assert_merge_matches(out, out_lse, reference_merge(*h), "float32")


# --------------------------------------------------------------------------------------------------
# in place


@pytest.mark.parametrize("target", ["o_a", "o_b"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_out_may_be_an_input_itself(rng, device, target, dtype):
    o_a, lse_a, o_b, lse_b = random_pair(rng, dtype=dtype)
    lse_a[0] = np.inf
    lse_b[1] = np.inf
    ref = reference_merge(o_a, lse_a, o_b, lse_b)
    d = dict(zip(("o_a", "lse_a", "o_b", "lse_b"), (device.put(x) for x in (o_a, lse_a, o_b, lse_b))))
    out, out_lse = d[target], d["lse" + target[1:]]
    res, res_lse = attnmerge.merge(d["o_a"], d["lse_a"], d["o_b"], d["lse_b"], out=out, out_lse=out_lse)
    assert res is out and res_lse is out_lse
    assert_merge_matches(device.get(out), device.get(out_lse), ref, dtype)


def test_in_place_on_a_strided_view(rng, device):
    o_a0, lse_a0, o_b, lse_b = random_pair(rng, head_size=100, dtype="bfloat16")
    np_o, np_lse = o_view(o_a0, "padded"), lse_view(lse_a0, "transposed")
    o_a, o_buf = device.strided(*np_o)
    lse_a, lse_buf = device.strided(*np_lse)
    ref = reference_merge(o_a0, lse_a0, o_b, lse_b)
    attnmerge.merge(o_a, lse_a, device.put(o_b), device.put(lse_b), out=o_a, out_lse=lse_a)
    assert_merge_matches(device.readback(*np_o, o_a, o_buf)[0], device.readback(*np_lse, lse_a, lse_buf)[0], ref,
                         "bfloat16")
