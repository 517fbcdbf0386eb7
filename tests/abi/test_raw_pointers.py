"""attnmerge.raw.merge, the raw-pointer layer: over NumPy arrays' integer pointers on the CPU, and over
torch tensors' data_ptr() on the `cuda` device (tests/devices.py; marked `gpu`).

raw.merge(*, tokens, heads, head_size, out, o_a, lse_a, o_b, lse_b, out_lse=None, device, stream=0,
          base="e", a_tokens=None, lse_heads_first=False, pdl=False, check_pointers=True)
O descriptors: (ptr, dtype name, stride_token, stride_head); LSE descriptors: (ptr, stride_token,
stride_head); strides in elements; device "cpu" or a CUDA ordinal.
"""

from __future__ import annotations

import numpy as np
import pytest

from attnmerge import raw
import devices
from devices import raw_lse, raw_o
from oracle import (
    DTYPES,
    assert_merge_matches,
    assert_o_close,
    lse_view,
    nan_array,
    o_view,
    outside_view_is_nan,
    random_state,
    reference_merge,
)


def call(out, out_lse, o_a, lse_a, o_b, lse_b, **kw):
    t, h, d = o_b.shape
    return raw.merge(
        tokens=t, heads=h, head_size=d,
        out=raw_o(out), o_a=raw_o(o_a), lse_a=raw_lse(lse_a), o_b=raw_o(o_b), lse_b=raw_lse(lse_b),
        out_lse=None if out_lse is None else raw_lse(out_lse), device=kw.pop("device", "cpu"), **kw,
    )


@pytest.mark.parametrize("out_dtype", DTYPES)
@pytest.mark.parametrize("in_dtype", DTYPES)
def test_every_dtype_pair(rng, in_dtype, out_dtype):
    o_a, lse_a = random_state(rng, 21, 3, 72, in_dtype)
    o_b, lse_b = random_state(rng, 21, 3, 72, in_dtype)
    out = nan_array(o_a.shape, out_dtype)
    out_lse = nan_array(lse_a.shape)
    call(out, out_lse, o_a, lse_a, o_b, lse_b)
    assert_merge_matches(out, out_lse, reference_merge(o_a, lse_a, o_b, lse_b), out_dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_strides_in_elements(rng, dtype):
    """Padded / offset O rows, heads-first O, a transposed LSE: all through strides."""
    o_a0, lse_a0 = random_state(rng, 17, 5, 100, dtype)
    o_b0, lse_b0 = random_state(rng, 17, 5, 100, dtype)
    o_a, _ = o_view(o_a0, "offset")
    o_b, _ = o_view(o_b0, "heads_first")
    lse_a, _ = lse_view(lse_a0, "transposed")
    lse_b, _ = lse_view(lse_b0, "padded")
    out, out_buf = o_view(nan_array(o_a0.shape, dtype), "padded")
    out_lse, out_lse_buf = lse_view(nan_array(lse_a0.shape), "transposed")
    call(out, out_lse, o_a, lse_a, o_b, lse_b)
    assert_merge_matches(out, out_lse, reference_merge(o_a0, lse_a0, o_b0, lse_b0), dtype)
    assert outside_view_is_nan(out, out_buf) and outside_view_is_nan(out_lse, out_lse_buf)


def test_check_pointers_false_trusts_the_device_and_gives_the_same_result(rng):
    o_a, lse_a = random_state(rng, 13, 4, 48, "bfloat16")
    o_b, lse_b = random_state(rng, 13, 4, 48, "bfloat16")
    checked, trusted = nan_array(o_a.shape, "bfloat16"), nan_array(o_a.shape, "bfloat16")
    checked_lse, trusted_lse = nan_array(lse_a.shape), nan_array(lse_a.shape)
    call(checked, checked_lse, o_a, lse_a, o_b, lse_b)
    call(trusted, trusted_lse, o_a, lse_a, o_b, lse_b, check_pointers=False)
    assert_merge_matches(trusted, trusted_lse, reference_merge(o_a, lse_a, o_b, lse_b), "bfloat16")
    assert np.array_equal(trusted.view(np.uint16), checked.view(np.uint16))
    assert np.array_equal(trusted_lse, checked_lse)


def test_out_lse_none(rng):
    o_a, lse_a = random_state(rng, 9, 2, 16)
    o_b, lse_b = random_state(rng, 9, 2, 16)
    out = nan_array(o_a.shape)
    call(out, None, o_a, lse_a, o_b, lse_b)
    assert_o_close(out, reference_merge(o_a, lse_a, o_b, lse_b)[0], "float32")


def test_base_2(rng):
    o_a, lse_a = random_state(rng, 9, 2, 16, "float16")
    o_b, lse_b = random_state(rng, 9, 2, 16, "float16")
    out = nan_array(o_a.shape, "float16")
    out_lse = nan_array(lse_a.shape)
    call(out, out_lse, o_a, lse_a, o_b, lse_b, base=2)
    assert_merge_matches(out, out_lse, reference_merge(o_a, lse_a, o_b, lse_b, base=2), "float16")


@pytest.mark.parametrize("a_tokens", [0, 4, 9])
def test_a_tokens(rng, a_tokens):
    o_a, lse_a = random_state(rng, 9, 2, 16)
    o_b, lse_b = random_state(rng, 9, 2, 16)
    o_a[a_tokens:] = np.nan
    lse_a[a_tokens:] = np.nan
    out = nan_array(o_a.shape)
    out_lse = nan_array(lse_a.shape)
    call(out, out_lse, o_a, lse_a, o_b, lse_b, a_tokens=a_tokens)
    assert_merge_matches(out, out_lse, reference_merge(o_a, lse_a, o_b, lse_b, a_tokens=a_tokens), "float32")


def test_empty_and_nan_rows(rng):
    o_a, lse_a = random_state(rng, 8, 2, 8)
    o_b, lse_b = random_state(rng, 8, 2, 8)
    lse_a[0] = np.inf
    o_a[0] = np.nan
    lse_a[1] = lse_b[1] = np.inf
    lse_b[2] = np.nan
    out = nan_array(o_a.shape)
    out_lse = nan_array(lse_a.shape)
    call(out, out_lse, o_a, lse_a, o_b, lse_b)
    assert_merge_matches(out, out_lse, reference_merge(o_a, lse_a, o_b, lse_b), "float32")


def test_zero_tokens(rng):
    o_a, lse_a = random_state(rng, 0, 2, 8)
    o_b, lse_b = random_state(rng, 0, 2, 8)
    call(nan_array((0, 2, 8)), nan_array((0, 2)), o_a, lse_a, o_b, lse_b)


def test_in_place_into_o_a(rng):
    o_a, lse_a = random_state(rng, 8, 2, 8, "bfloat16")
    o_b, lse_b = random_state(rng, 8, 2, 8, "bfloat16")
    ref = reference_merge(o_a, lse_a, o_b, lse_b)
    call(o_a, lse_a, o_a, lse_a, o_b, lse_b)
    assert_merge_matches(o_a, lse_a, ref, "bfloat16")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_lse_heads_first_takes_strides_in_the_order_of_the_heads_first_array(rng, dtype):
    """lse_heads_first=True: every LSE is a [heads, tokens] array and its descriptor gives that
    array's own strides, (ptr, stride of heads, stride of tokens), as vLLM's layout has them."""
    o_a, _ = random_state(rng, 13, 4, 24, dtype)
    o_b, _ = random_state(rng, 13, 4, 24, dtype)
    lse_a_ht, lse_b_ht = random_state(rng, 4, 13, 1)[1], random_state(rng, 4, 13, 1)[1]  # [H, T]
    out = nan_array(o_a.shape, dtype)
    out_lse_ht = nan_array((4, 13))

    def ht(x):
        return (x.ctypes.data, x.strides[0] // 4, x.strides[1] // 4)

    raw.merge(tokens=13, heads=4, head_size=24, out=raw_o(out), o_a=raw_o(o_a), lse_a=ht(lse_a_ht),
              o_b=raw_o(o_b), lse_b=ht(lse_b_ht), out_lse=ht(out_lse_ht), device="cpu", lse_heads_first=True)
    ref = reference_merge(o_a, lse_a_ht.T, o_b, lse_b_ht.T)
    assert_merge_matches(out, out_lse_ht.T, ref, dtype)

    # the same memory described as [tokens, heads] views with swapped strides
    out2 = nan_array(o_a.shape, dtype)
    out_lse2 = nan_array((4, 13))
    call(out2, out_lse2.T, o_a, lse_a_ht.T, o_b, lse_b_ht.T)
    assert np.array_equal(out2, out, equal_nan=True) and np.array_equal(out_lse2, out_lse_ht, equal_nan=True)


# --------------------------------------------------------------------------------------------------
# device pointers: the `cuda` device's torch tensors by data_ptr() (on the CPU under
# ATTNMERGE_TEST_CUDA_AS=cpu, with device="cpu")


def _stream(device):
    return device.torch.cuda.current_stream().cuda_stream if device.on_gpu else 0


@pytest.mark.parametrize("device", devices.CUDA_ONLY, indirect=True)
@pytest.mark.parametrize("check_pointers", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_device_pointers_of_torch_tensors(rng, device, dtype, check_pointers):
    h = (*random_state(rng, 33, 4, 80, dtype), *random_state(rng, 33, 4, 80, dtype))
    o_a, lse_a, o_b, lse_b = [device.put(x) for x in h]
    out = device.nan(h[0].shape, dtype)
    out_lse_ht = device.nan((4, 33))  # [heads, tokens], described by strides
    raw.merge(tokens=33, heads=4, head_size=80, out=raw_o(out), o_a=raw_o(o_a), lse_a=raw_lse(lse_a), o_b=raw_o(o_b),
              lse_b=raw_lse(lse_b), out_lse=raw_lse(out_lse_ht.T), device=device.raw_device, stream=_stream(device),
              check_pointers=check_pointers)
    assert_merge_matches(device.get(out), device.get(out_lse_ht).T, reference_merge(*h), dtype)


@pytest.mark.parametrize("device", devices.CUDA_ONLY, indirect=True)
def test_device_pointers_base_2_and_a_tokens(rng, device):
    h = (*random_state(rng, 40, 2, 64), *random_state(rng, 40, 2, 64))
    o_a, lse_a, o_b, lse_b = [device.put(x) for x in h]
    out = device.nan(h[0].shape)
    raw.merge(tokens=40, heads=2, head_size=64, out=raw_o(out), o_a=raw_o(o_a), lse_a=raw_lse(lse_a), o_b=raw_o(o_b),
              lse_b=raw_lse(lse_b), device=device.raw_device, base=2, a_tokens=25)
    device.synchronize()
    assert_o_close(device.get(out), reference_merge(*h, base=2, a_tokens=25)[0], "float32")
