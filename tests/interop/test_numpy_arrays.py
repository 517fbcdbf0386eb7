"""NumPy arrays and what stands for them on the host: NumPy arrays and their subclasses are read
directly (not exported through DLPack), and an object known by its __array_interface__ alone is an
array too, in native byte order only.  The CPU path's semantics: tests/semantics/.
"""

from __future__ import annotations

import numpy as np
import pytest

import attnmerge
from oracle import DTYPES, all_nan, assert_merge_matches, nan_array, random_pair, reference_merge


class Unexported(np.ndarray):
    """A NumPy subclass that refuses DLPack: NumPy arrays are read directly, not exported."""

    def __dlpack__(self, *args, **kwargs):
        raise AssertionError("__dlpack__ called")


@pytest.mark.parametrize("dtype", DTYPES)
def test_numpy_arrays_and_subclasses_are_read_directly(rng, dtype):
    o_a, lse_a, o_b, lse_b = random_pair(rng, dtype=dtype)
    out, out_lse = nan_array(o_a.shape, dtype).view(Unexported), nan_array(lse_a.shape).view(Unexported)
    attnmerge.merge(*(x.view(Unexported) for x in (o_a, lse_a, o_b, lse_b)), out=out, out_lse=out_lse)
    assert_merge_matches(np.asarray(out), np.asarray(out_lse), reference_merge(o_a, lse_a, o_b, lse_b), dtype)


class InterfaceOnly:
    """An array known only by its __array_interface__ (no DLPack, not a NumPy array)."""

    def __init__(self, x):
        self.base, self.__array_interface__ = x, x.__array_interface__


def test_arrays_known_by_array_interface_alone(rng):
    o_a, lse_a, o_b, lse_b = random_pair(rng)
    out, out_lse = nan_array(o_a.shape), nan_array(lse_a.shape)
    attnmerge.merge(*(InterfaceOnly(x) for x in (o_a, lse_a, o_b, lse_b)), out=InterfaceOnly(out),
                    out_lse=InterfaceOnly(out_lse))
    assert_merge_matches(out, out_lse, reference_merge(o_a, lse_a, o_b, lse_b), "float32")


def test_a_big_endian_array_interface_is_refused(rng):
    o_a, lse_a, o_b, lse_b = random_pair(rng)
    swapped = InterfaceOnly(o_b.astype(">f4"))
    out = nan_array(o_a.shape)
    with pytest.raises(TypeError, match=r"o_b: expected native byte order, got big-endian >f4"):
        attnmerge.merge(o_a, lse_a, swapped, lse_b, out=out, out_lse=nan_array(lse_a.shape))
    assert all_nan(out)
