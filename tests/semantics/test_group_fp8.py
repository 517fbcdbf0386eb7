"""Per-group FP8 outputs (group_size=, group_scales=, scale_ue8m0=) of merge, merge_states,
merge_varlen and merge_share, on every device.

For the merged values x of a row, each group of group_size consecutive elements gets
scale = max(amax, 1e-10) / 448 (amax: the group's largest |x|, NaN left out; rounded up to a
power of two with scale_ue8m0), stored in group_scales [tokens, heads, head_size // group_size],
and out = x * (1 / scale) in FP8 E4M3, rounded once.  The LSE output is unaffected.  The oracle
(oracle.reference_group_scales) is written from that formula over the float64 merge; each element
is checked against its float64 value over the scale the call stored (one FP8 step), each scale
against the formula's.
"""

from __future__ import annotations

import numpy as np
import pytest

import attnmerge
from oracle import (
    DTYPES,
    GROUP_AMAX_FLOOR,
    FP8_MAX,
    assert_group_fp8_close,
    assert_lse_close,
    random_lse,
    random_o,
    random_stacked,
    random_state,
    reference_merge,
    reference_merge_share,
    reference_merge_stacked,
    reference_merge_varlen,
)

FP8 = "float8_e4m3fn"
GROUPS = [16, 64, 128]


def put(device, *xs):
    return [device.put(x) for x in xs]


@pytest.mark.parametrize("ue8m0", [False, True], ids=["float", "ue8m0"])
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("in_dtype", DTYPES)
def test_merge_quantizes_each_group_by_its_own_scale(rng, device, in_dtype, group, ue8m0):
    """Rows of every magnitude (a group's scale follows its own values), a NaN row and an empty one."""
    o_a, lse_a = random_state(rng, 37, 4, 256, in_dtype)
    o_b, lse_b = random_state(rng, 37, 4, 256, in_dtype)
    o_a[:, :, :64] *= np.asarray(1000.0, o_a.dtype)  # groups of other magnitudes in the same row
    o_b[3] *= np.asarray(1e-3, o_b.dtype)
    lse_a[5, 2] = np.nan
    lse_a[6, 1] = lse_b[6, 1] = -np.inf
    out, out_lse, scales = attnmerge.merge(*put(device, o_a, lse_a, o_b, lse_b), group_size=group, scale_ue8m0=ue8m0)
    assert out.dtype == device.dtype(FP8) and tuple(out.shape) == o_a.shape
    assert tuple(scales.shape) == (37, 4, 256 // group) and scales.dtype == device.dtype("float32")
    ref_o, ref_lse = reference_merge(o_a, lse_a, o_b, lse_b)
    assert_group_fp8_close(device.get(out), device.get(scales), ref_o, group, ue8m0)
    assert_lse_close(device.get(out_lse), ref_lse)
    s = device.get(scales)
    assert np.all(s[6, 1] == np.float32(GROUP_AMAX_FLOOR / FP8_MAX if not ue8m0 else 2.0**-42))  # an empty row's
    assert np.all(np.isnan(device.get(out)[5, 2].astype(np.float32)))  # a NaN row stays NaN


@pytest.mark.parametrize("group", [8, 32, 128])
def test_given_outputs_and_column_major_scales(rng, device, group):
    """out and group_scales given, the scales in DeepGEMM's column-major layout ([groups, tokens]
    storage passed as its [tokens, groups] permutation, viewed as [tokens, heads, groups])."""
    t, h, d = 29, 3, 128
    o_a, lse_a = random_state(rng, t, h, d, "bfloat16")
    o_b, lse_b = random_state(rng, t, h, d, "bfloat16")
    buf = np.full((h * d // group, t), np.nan, np.float32)
    out, scales_buf = device.nan((t, h, d), FP8), device.put(buf)
    scales = scales_buf.T.reshape(t, h, d // group) if device.name == "cpu" else scales_buf.t().view(t, h, d // group)
    res, res_lse, res_scales = attnmerge.merge(*put(device, o_a, lse_a, o_b, lse_b), out=out, group_scales=scales,
                                               group_size=group, return_lse=False)
    assert res is out and res_lse is None and res_scales is scales
    assert_group_fp8_close(device.get(out), device.get(scales_buf).T.reshape(t, h, d // group),
                           reference_merge(o_a, lse_a, o_b, lse_b)[0], group)


def test_a_group_of_one_value_stores_it_as_448(device):
    """The group's largest magnitude becomes +-448 exactly, the others in proportion."""
    o = np.zeros((1, 1, 16), np.float32)
    o[0, 0, :8] = [3.0, -1.5, 0.75, 0.0, 3.0 / 448, -3.0, 1.0, 2.0]
    o[0, 0, 8:] = -7.0
    args = put(device, o, np.zeros((1, 1), np.float32), np.full_like(o, np.nan), np.full((1, 1), -np.inf, np.float32))
    out, _, scales = attnmerge.merge(*args, group_size=8)
    v = device.get(out).astype(np.float32).ravel()
    assert np.array_equal(v[:8], [448.0, -224.0, 112.0, 0.0, 1.0, -448.0, 144.0, 288.0]), v
    assert np.array_equal(v[8:], np.full(8, -448.0))
    assert np.allclose(device.get(scales).ravel(), [3.0 / 448, 7.0 / 448], rtol=1e-7)
    _, _, scales = attnmerge.merge(*args, group_size=8, scale_ue8m0=True)
    assert np.array_equal(device.get(scales).ravel(), [2.0**-7, 2.0**-6])  # 3/448 and 7/448 rounded up


@pytest.mark.parametrize("ue8m0", [False, True], ids=["float", "ue8m0"])
@pytest.mark.parametrize("states", [1, 3, 9, 40])
def test_merge_states(rng, device, states, ue8m0):
    """Decode shapes included (few rows, many states: on the GPU the states kernel, whose groups'
    finishing threads meet in shared memory)."""
    o, lse = random_stacked(rng, 5, states, 8, 128, "bfloat16")
    lse[1, :, 2] = -np.inf
    sink = random_lse(rng, (8,))
    out, out_lse, scales = attnmerge.merge_states(*put(device, o, lse), sink=device.put(sink), group_size=64,
                                                  scale_ue8m0=ue8m0)
    ref_o, ref_lse = reference_merge_stacked(o, lse, sink=sink)
    assert_group_fp8_close(device.get(out), device.get(scales), ref_o, 64, ue8m0)
    assert_lse_close(device.get(out_lse), ref_lse)


def test_merge_varlen(rng, device):
    o, lse = random_state(rng, 23, 4, 96, "float16")
    indptr = np.array([0, 3, 3, 10, 23], np.int32)
    out, out_lse, scales = attnmerge.merge_varlen(*put(device, o, lse, indptr), group_size=32)
    assert tuple(scales.shape) == (4, 4, 3)
    ref_o, ref_lse = reference_merge_varlen(o, lse, indptr)
    assert_group_fp8_close(device.get(out), device.get(scales), ref_o, 32)
    assert_lse_close(device.get(out_lse), ref_lse)


def test_merge_share(rng, device):
    o = random_o(rng, (11, 4, 128), "bfloat16")
    lse = random_lse(rng, (11, 6, 4))
    out, out_lse, scales = attnmerge.merge_share(*put(device, o, lse), 2, group_size=128, scale_ue8m0=True)
    ref_o, ref_lse = reference_merge_share(o, lse, 2)
    assert_group_fp8_close(device.get(out), device.get(scales), ref_o, 128, True)
    assert_lse_close(device.get(out_lse), ref_lse)


def _call(device, **kwargs):
    o_a, lse_a = random_state(np.random.default_rng(1), 4, 2, 128, "float32")
    return attnmerge.merge(*put(device, o_a, lse_a, o_a, lse_a), **kwargs)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(group_size=12), ValueError, r"group_size: expected a power of two >= 8, got 12"),
    (dict(group_size=4), ValueError, r"group_size: expected a power of two >= 8, got 4"),
    (dict(group_size=256), ValueError, r"group_size: expected a divisor of head_size \(128\), got 256"),
    (dict(group_size=0), ValueError, r"group_size: expected None or a power of two >= 8, got 0"),
    (dict(group_size=64, out_dtype="bfloat16"), TypeError,
     r"out: expected dtype float8_e4m3 for per-group scales \(group_scales\), got bfloat16"),
    (dict(group_size=64, output_scale=0.5), ValueError,
     r"output_scale: expected none with group_scales \(each group has its own scale\)"),
    (dict(scale_ue8m0=True), ValueError, r"scale_ue8m0: expected False without group_size, got True"),
])
def test_bad_group_arguments_are_refused_before_any_write(device, kwargs, error, match):
    with pytest.raises(error, match=match):
        _call(device, **kwargs)


def test_group_scales_of_the_wrong_shape_or_without_group_size_are_refused(device):
    with pytest.raises(ValueError, match=r"group_scales: expected shape \[4, 2, 2\]"):
        _call(device, group_size=64, group_scales=device.nan((4, 2, 4)))
    with pytest.raises(ValueError, match=r"group_size: expected a power of two >= 8, got 0"):
        _call(device, out_dtype=FP8, group_scales=device.nan((4, 2, 2)))


def test_a_group_wider_than_a_warp_of_the_arrays_vectors_is_refused(rng, device):
    """Misaligned float32 arrays take vectors of one element: a warp's 32 lanes hold a group of 32."""
    o = device.put(random_o(rng, (4 * 2 * 128 + 1,)))[1:].reshape(4, 2, 128)  # 4-byte aligned only
    lse = device.put(random_lse(rng, (4, 2)))
    out, _, scales = attnmerge.merge(o, lse, o, lse, group_size=32)
    assert tuple(scales.shape) == (4, 2, 4)
    with pytest.raises(ValueError, match=r"group_size: expected at most 32 \(a warp's 32 lanes of 1 elements"):
        attnmerge.merge(o, lse, o, lse, group_size=64)
