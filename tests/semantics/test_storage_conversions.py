"""The CPU path's storage conversions, exhaustively, through the public API.

A two-way merge with a_tokens=0 gives every row state b alone with weight exactly 1, so its output
is b's O read into float32 and rounded once to the output dtype: reading every float16 and bfloat16
bit pattern must give NumPy's (ml_dtypes') float32 value, and rounding float32 values of every
binade and rounding case to float16 and bfloat16 must match NumPy's (ml_dtypes') round to nearest
even, overflow to infinity and NaN kept NaN.  (The sum starts at +0, so -0 comes out as +0.)
"""

from __future__ import annotations

import numpy as np
import pytest

import attnmerge
from oracle import nan_array, np_dtype


def _b_alone(o_b, out_dtype):
    """o_b [n] of any input dtype -> out [n] of out_dtype, through merge with a_tokens=0."""
    n = o_b.shape[0]
    o = o_b.reshape(n, 1, 1)
    lse = np.zeros((n, 1), dtype=np.float32)
    out = nan_array((n, 1, 1), out_dtype)
    attnmerge.merge(o[:0], lse[:0], o, lse, out=out, a_tokens=0, return_lse=False)
    return out.reshape(n)


def _same(got, want):
    with np.errstate(invalid="ignore"):  # NaN patterns cast
        got, want = got.astype(np.float64), want.astype(np.float64)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    bad = np.flatnonzero(got[~nan] != want[~nan])
    assert bad.size == 0, f"{bad.size} mismatches, first: got {got[~nan][bad[0]]!r}, want {want[~nan][bad[0]]!r}"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_every_16_bit_pattern_is_read_exactly(dtype):
    x = np.arange(1 << 16, dtype=np.uint16).view(np_dtype(dtype))
    _same(_b_alone(x, "float32"), x.astype(np.float32))


def _float32_cases():
    """Every exponent with edge, tie and random mantissas, both signs, and the specials."""
    rng = np.random.default_rng(16)
    exps = np.arange(1, 255, dtype=np.uint32)
    mants = np.concatenate([np.array([0, 1, 0x0FFF, 0x1000, 0x1001, 0x2000, 0x3000, 0x5FFF, 0x6000, 0x7FFF, 0x8000,
                                      0x8001, 0x18000, 0x7FE000, 0x7FF000, 0x7FFFFF], dtype=np.uint32),
                            rng.integers(0, 1 << 23, 48, dtype=np.uint32)])
    bits = (exps[:, None] << np.uint32(23) | mants[None, :]).ravel()
    bits = np.concatenate([bits, bits | np.uint32(0x80000000),
                           np.array([0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0xFFC00000], dtype=np.uint32)])
    return bits.view(np.float32)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_float32_is_rounded_as_numpy_rounds(dtype):
    x = _float32_cases()
    with np.errstate(over="ignore", invalid="ignore"):
        want = x.astype(np_dtype(dtype))
    _same(_b_alone(x, dtype), want)


def test_the_float16_subnormal_and_overflow_boundaries():
    """Halfway cases around 2^-24 (the smallest subnormal), 2^-14 (the smallest normal) and
    65520 (the first value that rounds to infinity)."""
    edges = np.array([2.0**-25, np.nextafter(2.0**-25, 1), 3 * 2.0**-25, 2.0**-14 - 2.0**-25, 2.0**-14 - 2.0**-26,
                      65504.0, 65519.99, 65520.0, 65536.0, 1e9, 2.0**-26, 5.96e-8], dtype=np.float32)
    x = np.concatenate([edges, -edges])
    with np.errstate(over="ignore"):
        want = x.astype(np.float16)
    _same(_b_alone(x, "float16"), want)
