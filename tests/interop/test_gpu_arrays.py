"""GPU arrays of every library: PyTorch, CuPy, JAX and Numba arrays are read, written and allocated
in the caller's library (every dtype pair, head size and strided view each library can express), and
the semantic cases each library's arrays go through on the GPU.  What differs between libraries, not
the semantics: those are tests/semantics/ on the device fixture.

Every test here carries the `gpu` marker (skipped without a CUDA GPU) and skips when its library is
missing or sees no GPU (the adapters: gpu_frameworks.py).  Inputs are made with NumPy (seeded), moved
to the device, and the results compared with the float64 oracle.
"""

from __future__ import annotations


import numpy as np
import pytest

import attnmerge
from gpu_frameworks import FRAMEWORKS, Jax, Numba, Torch
from oracle import (
    random_pair,
    DTYPES,
    assert_merge_matches,
    assert_o_close,
    lse_view,
    nan_array,
    o_view,
    reference_merge,
    to_f64,
)

pytestmark = pytest.mark.gpu


@pytest.fixture(params=list(FRAMEWORKS))
def fw(request):
    return FRAMEWORKS[request.param]()


@pytest.fixture
def torch():
    return Torch().torch


# --------------------------------------------------------------------------------------------------
# every library, every dtype pair


@pytest.mark.parametrize("out_dtype", DTYPES)
@pytest.mark.parametrize("in_dtype", DTYPES)
def test_every_dtype_pair_allocated_in_the_callers_library(rng, fw, in_dtype, out_dtype):
    h = random_pair(rng, dtype=in_dtype)
    d = [fw.put(x) for x in h]
    out, out_lse = attnmerge.merge(*d, out_dtype=out_dtype)
    assert fw.is_mine(out) and fw.is_mine(out_lse), (type(out), type(out_lse))
    assert tuple(out.shape) == h[0].shape and tuple(out_lse.shape) == h[1].shape
    assert_merge_matches(fw.get(out), fw.get(out_lse), reference_merge(*h), out_dtype)


@pytest.mark.parametrize("out_dtype", DTYPES)
@pytest.mark.parametrize("in_dtype", DTYPES)
def test_every_dtype_pair_into_a_given_output(rng, fw, in_dtype, out_dtype):
    if not fw.mutable:
        pytest.skip(f"{fw.name} arrays cannot be outputs")
    h = random_pair(rng, dtype=in_dtype)
    d = [fw.put(x) for x in h]
    out = fw.put(nan_array(h[0].shape, out_dtype))
    out_lse = fw.put(nan_array(h[1].shape))
    res, res_lse = attnmerge.merge(*d, out=out, out_lse=out_lse)
    assert res is out and res_lse is out_lse
    assert_merge_matches(fw.get(out), fw.get(out_lse), reference_merge(*h), out_dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size", (1, 3, 72, 80, 100, 256, 512))
def test_any_head_size(rng, fw, head_size, dtype):
    h = random_pair(rng, tokens=67, heads=7, head_size=head_size, dtype=dtype)
    out, out_lse = attnmerge.merge(*[fw.put(x) for x in h])
    assert_merge_matches(fw.get(out), fw.get(out_lse), reference_merge(*h), dtype)


LAYOUT_CASES = [
    (("padded", "padded", "padded"), ("contiguous", "contiguous", "contiguous")),
    (("offset", "contiguous", "offset"), ("transposed", "transposed", "transposed")),
    (("heads_first", "token_step", "contiguous"), ("padded", "token_step", "transposed")),
    (("head_step", "offset", "token_step"), ("transposed", "padded", "token_step")),
]


@pytest.mark.parametrize("head_size", (3, 72, 128))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("o_layouts,lse_layouts", LAYOUT_CASES, ids=lambda c: "-".join(c))
@pytest.mark.parametrize("lib", ["torch", "cupy"])
def test_strided_views(rng, lib, o_layouts, lse_layouts, dtype, head_size):
    fw = FRAMEWORKS[lib]()
    o_a0, lse_a0, o_b0, lse_b0 = random_pair(rng, tokens=45, heads=6, head_size=head_size, dtype=dtype)
    o_a = fw.strided(*o_view(o_a0, o_layouts[0]))
    o_b = fw.strided(*o_view(o_b0, o_layouts[1]))
    out = fw.strided(*o_view(nan_array(o_a0.shape, dtype), o_layouts[2]))
    lse_a = fw.strided(*lse_view(lse_a0, lse_layouts[0]))
    lse_b = fw.strided(*lse_view(lse_b0, lse_layouts[1]))
    out_lse = fw.strided(*lse_view(nan_array(lse_a0.shape), lse_layouts[2]))
    attnmerge.merge(o_a, lse_a, o_b, lse_b, out=out, out_lse=out_lse)
    assert_merge_matches(fw.get(out), fw.get(out_lse), reference_merge(o_a0, lse_a0, o_b0, lse_b0), dtype)


def test_numba_padded_head_size_view(rng):
    fw = Numba()
    o_a0, lse_a0, o_b0, lse_b0 = random_pair(rng, tokens=20, heads=4, head_size=100, dtype="float16")
    o_a = fw.strided(*o_view(o_a0, "padded"))
    out = fw.strided(*o_view(nan_array(o_a0.shape, "float16"), "offset"))
    out_lse = fw.put(nan_array(lse_a0.shape))
    attnmerge.merge(o_a, fw.put(lse_a0), fw.put(o_b0), fw.put(lse_b0), out=out, out_lse=out_lse)
    assert_merge_matches(fw.get(out), fw.get(out_lse), reference_merge(o_a0, lse_a0, o_b0, lse_b0), "float16")


# --------------------------------------------------------------------------------------------------
# semantics on the GPU


@pytest.mark.parametrize("dtype", DTYPES)
def test_empty_all_empty_nan_and_underflow_rows(rng, fw, dtype):
    o_a, lse_a, o_b, lse_b = random_pair(rng, tokens=64, heads=4, head_size=80, dtype=dtype)
    lse_a[0:8] = np.inf  # empty a (+inf), NaN in its O
    o_a[0:8] = np.nan
    lse_b[8:16] = -np.inf  # empty b (-inf)
    o_b[8:16] = np.nan
    lse_a[16:20] = np.inf  # both empty: 0, -inf
    lse_b[16:20] = -np.inf
    o_a[16:20] = np.nan
    o_b[16:20] = np.nan
    lse_a[20, 1] = np.nan  # NaN rows
    lse_b[21, 3] = np.nan
    lse_a[24:28] = lse_b[24:28] - 1000.0  # a underflows to weight 0: its NaN is not read
    o_a[24:28] = np.nan
    d = [fw.put(x) for x in (o_a, lse_a, o_b, lse_b)]
    out, out_lse = attnmerge.merge(*d)
    out, out_lse = fw.get(out), fw.get(out_lse)
    assert_merge_matches(out, out_lse, reference_merge(o_a, lse_a, o_b, lse_b), dtype)
    assert np.all(to_f64(out[16:20]) == 0) and np.all(out_lse[16:20] == -np.inf)
    assert np.isnan(to_f64(out)).sum() == 2 * 80 and np.isnan(out_lse).sum() == 2


@pytest.mark.parametrize("dtype", DTYPES)
def test_base_2(rng, fw, dtype):
    h = random_pair(rng, dtype=dtype)
    out, out_lse = attnmerge.merge(*[fw.put(x) for x in h], base=2)
    assert_merge_matches(fw.get(out), fw.get(out_lse), reference_merge(*h, base=2), dtype)


@pytest.mark.parametrize("a_tokens", [0, 1, 20, 37])
def test_a_tokens(rng, fw, a_tokens):
    o_a, lse_a, o_b, lse_b = random_pair(rng, dtype="float16")
    o_a, lse_a = o_a[:a_tokens].copy(), lse_a[:a_tokens].copy()
    lse_b[-1] = np.inf
    out, out_lse = attnmerge.merge(*[fw.put(x) for x in (o_a, lse_a, o_b, lse_b)], a_tokens=a_tokens)
    ref = reference_merge(o_a, lse_a, o_b, lse_b, a_tokens=a_tokens)
    assert_merge_matches(fw.get(out), fw.get(out_lse), ref, "float16")


def test_zero_tokens(rng, fw):
    h = random_pair(rng, tokens=0)
    out, out_lse = attnmerge.merge(*[fw.put(x) for x in h])
    assert tuple(out.shape) == (0, 5, 72) and tuple(out_lse.shape) == (0, 5)


def test_zero_tokens_of_torch_made_empty_tensors(torch):
    """Zero-size CUDA tensors made by torch itself (ordinary strides, possibly a null data pointer)."""
    o = torch.empty(0, 4, 64, device="cuda", dtype=torch.float16)
    lse = torch.empty(0, 4, device="cuda")
    out, out_lse = attnmerge.merge(o, lse, o, lse)
    assert out.shape == (0, 4, 64) and out.is_cuda and out_lse.shape == (0, 4)
    attnmerge.merge(o, lse, o, lse, out=torch.empty_like(o), out_lse=torch.empty_like(lse))


def test_return_lse_false(rng, fw):
    h = random_pair(rng)
    out, out_lse = attnmerge.merge(*[fw.put(x) for x in h], return_lse=False)
    assert out_lse is None
    assert_o_close(fw.get(out), reference_merge(*h)[0], "float32")


# --------------------------------------------------------------------------------------------------
# JAX specifics


def test_jax_outputs_are_allocated_and_out_is_refused(rng):
    fw = Jax()
    h = random_pair(rng, dtype="bfloat16")
    d = [fw.put(x) for x in h]
    out, out_lse = attnmerge.merge(*d, out_dtype="float32")
    assert fw.is_mine(out) and fw.is_mine(out_lse)
    assert_merge_matches(fw.get(out), fw.get(out_lse), reference_merge(*h), "float32")
    with pytest.raises(ValueError) as info:
        attnmerge.merge(*d, out=out)
    assert "out" in str(info.value)


