"""attnmerge.compat.flashinfer: FlashInfer's signatures and conventions (on the CPU; the last test on every device).

merge_state(v_a, s_a, v_b, s_b) -> (v, s)
merge_state_in_place(v, s, v_other, s_other, mask=None) -> None      (writes v and s)
merge_states(v, s) -> (v, s)         v [tokens, S, heads, D], s [tokens, S, heads]
variable_length_merge_states(v, s, indptr) -> (v, s)                  v [total_states, heads, D]

Base-2 LSE (log2-sum-exp2), LSE laid out [tokens, heads]; new arrays in the caller's library
(NumPy in, NumPy out), O in the dtype of the inputs, LSE float32.
"""

from __future__ import annotations

import numpy as np
import pytest

from attnmerge.compat import flashinfer as fi
from oracle import (
    DTYPES,
    assert_lse_close,
    assert_merge_matches,
    assert_o_close,
    np_dtype,
    random_pair,
    random_stacked,
    random_state,
    reference_merge,
    reference_merge_stacked,
    reference_merge_varlen,
    to_f64,
)


def pair(rng, tokens=33, heads=4, head_size=128, dtype="float16"):
    return random_pair(rng, tokens, heads, head_size, dtype)


# --------------------------------------------------------------------------------------------------
# merge_state


@pytest.mark.parametrize("head_size", (1, 3, 64, 100, 128))
@pytest.mark.parametrize("dtype", DTYPES)
def test_merge_state_is_base_2_and_returns_new_numpy_arrays(rng, dtype, head_size):
    v_a, s_a, v_b, s_b = pair(rng, head_size=head_size, dtype=dtype)
    v, s = fi.merge_state(v_a, s_a, v_b, s_b)
    assert isinstance(v, np.ndarray) and isinstance(s, np.ndarray)
    assert v.dtype == np_dtype(dtype) and v.shape == v_a.shape
    assert s.dtype == np.float32 and s.shape == s_a.shape
    assert v is not v_a and v is not v_b
    assert_merge_matches(v, s, reference_merge(v_a, s_a, v_b, s_b, base=2), dtype, "v")


def test_merge_state_is_not_natural_log(rng):
    v_a, s_a, v_b, s_b = pair(rng, dtype="float32")
    v, s = fi.merge_state(v_a, s_a, v_b, s_b)
    ref_e = reference_merge(v_a, s_a, v_b, s_b, base="e")
    assert np.abs(to_f64(s) - ref_e[1]).max() > 1e-3


def test_merge_state_leaves_its_inputs_unchanged(rng):
    v_a, s_a, v_b, s_b = pair(rng, dtype="bfloat16")
    copies = [x.copy() for x in (v_a, s_a, v_b, s_b)]
    fi.merge_state(v_a, s_a, v_b, s_b)
    for x, c in zip((v_a, s_a, v_b, s_b), copies):
        assert np.array_equal(to_f64(x), to_f64(c))


def test_merge_state_empty_and_nan_rows(rng):
    v_a, s_a, v_b, s_b = pair(rng, tokens=12, dtype="float32")
    s_a[0] = -np.inf  # FlashInfer's empty part
    v_a[0] = np.nan
    s_a[1] = s_b[1] = -np.inf  # both empty: 0, -inf
    v_a[1] = v_b[1] = np.nan
    s_b[2, 3] = np.nan
    v, s = fi.merge_state(v_a, s_a, v_b, s_b)
    assert_merge_matches(v, s, reference_merge(v_a, s_a, v_b, s_b, base=2), "float32", "v")
    assert np.array_equal(v[0], v_b[0]) and np.all(v[1] == 0) and np.all(s[1] == -np.inf)


def test_merge_state_of_a_state_with_itself_adds_one(rng):
    v_a, s_a, _, _ = pair(rng, dtype="float32")
    v, s = fi.merge_state(v_a, s_a, v_a.copy(), s_a.copy())
    assert_o_close(v, to_f64(v_a), "float32", "v")
    assert_lse_close(s, to_f64(s_a) + 1.0, "s")


# --------------------------------------------------------------------------------------------------
# merge_state_in_place


@pytest.mark.parametrize("dtype", DTYPES)
def test_merge_state_in_place_writes_v_and_s_and_returns_none(rng, dtype):
    v, s, v_other, s_other = pair(rng, dtype=dtype)
    ref = reference_merge(v, s, v_other, s_other, base=2)
    assert fi.merge_state_in_place(v, s, v_other, s_other) is None
    assert_merge_matches(v, s, ref, dtype, "v")


@pytest.mark.parametrize("mask_dtype", ["bool", "uint8"])
def test_merge_state_in_place_with_a_mask(rng, mask_dtype):
    v, s, v_other, s_other = pair(rng, tokens=20, dtype="bfloat16")
    mask = (np.arange(20) % 3 != 0).astype(mask_dtype)
    off = mask == 0
    v_other[off] = np.nan  # not read where the mask is 0
    s_other[off] = np.nan
    ref = reference_merge(v, s, v_other, s_other, base=2)
    v0, s0 = v.copy(), s.copy()
    assert fi.merge_state_in_place(v, s, v_other, s_other, mask=mask) is None
    assert np.array_equal(v[off].view(np.uint16), v0[off].view(np.uint16)) and np.array_equal(s[off], s0[off])
    assert_o_close(v[~off], ref[0][~off], "bfloat16", "v")
    assert_lse_close(s[~off], ref[1][~off], "s")


def test_merge_state_in_place_mask_positional(rng):
    v, s, v_other, s_other = pair(rng, tokens=6, dtype="float32")
    ref = reference_merge(v, s, v_other, s_other, base=2)
    mask = np.array([1, 1, 1, 1, 1, 1], bool)
    fi.merge_state_in_place(v, s, v_other, s_other, mask)
    assert_merge_matches(v, s, ref, "float32", "v")


# --------------------------------------------------------------------------------------------------
# merge_states


@pytest.mark.parametrize("n", (1, 2, 3, 8, 64))
@pytest.mark.parametrize("dtype", DTYPES)
def test_merge_states(rng, dtype, n):
    v, s = random_stacked(rng, 17, n, 4, 64, dtype)
    v_m, s_m = fi.merge_states(v, s)
    assert isinstance(v_m, np.ndarray) and v_m.shape == (17, 4, 64) and v_m.dtype == np_dtype(dtype)
    assert s_m.shape == (17, 4) and s_m.dtype == np.float32
    assert_merge_matches(v_m, s_m, reference_merge_stacked(v, s, base=2), dtype, "v")


def test_merge_states_of_strided_views(rng):
    v0, s0 = random_stacked(rng, 9, 5, 3, 72, "float16", states_axis=0)
    v = np.moveaxis(v0, 0, 1)  # [tokens, S, heads, D] view of an [S, tokens, ...] buffer
    s = np.moveaxis(s0, 0, 1)
    v_m, s_m = fi.merge_states(v, s)
    assert_merge_matches(v_m, s_m, reference_merge_stacked(v0, s0, states_axis=0, base=2), "float16", "v")


def test_merge_states_empty_parts(rng):
    v, s = random_stacked(rng, 10, 6, 2, 32, "float32")
    s[:, ::2] = -np.inf
    v[:, ::2] = np.nan
    s[0] = -np.inf
    v[0] = np.nan
    v_m, s_m = fi.merge_states(v, s)
    assert_merge_matches(v_m, s_m, reference_merge_stacked(v, s, base=2), "float32", "v")
    assert np.all(v_m[0] == 0) and np.all(s_m[0] == -np.inf)


# --------------------------------------------------------------------------------------------------
# variable_length_merge_states


@pytest.mark.parametrize("index_dtype", ["int32", "int64"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_variable_length_merge_states(rng, dtype, index_dtype):
    counts = [1, 4, 0, 2, 9, 3]
    indptr = np.concatenate([[0], np.cumsum(counts)]).astype(index_dtype)
    v, s = random_state(rng, int(indptr[-1]), 4, 64, dtype)
    v_m, s_m = fi.variable_length_merge_states(v, s, indptr)
    assert isinstance(v_m, np.ndarray) and v_m.shape == (6, 4, 64) and v_m.dtype == np_dtype(dtype)
    assert s_m.shape == (6, 4) and s_m.dtype == np.float32
    assert_merge_matches(v_m, s_m, reference_merge_varlen(v, s, indptr, base=2), dtype, "v")
    assert np.all(to_f64(v_m[2]) == 0) and np.all(s_m[2] == -np.inf)


# --------------------------------------------------------------------------------------------------
# torch CPU tensors in, torch CPU tensors out


def test_torch_cpu_tensors_in_torch_tensors_out(rng):
    torch = pytest.importorskip("torch")
    v_a, s_a, v_b, s_b = pair(rng, tokens=11, dtype="float32")
    v, s = fi.merge_state(*[torch.from_numpy(x) for x in (v_a, s_a, v_b, s_b)])
    assert isinstance(v, torch.Tensor) and isinstance(s, torch.Tensor)
    assert_merge_matches(v.numpy(), s.numpy(), reference_merge(v_a, s_a, v_b, s_b, base=2), "float32", "v")

    vs, ss = random_stacked(rng, 11, 3, 4, 128, "float32")
    v, s = fi.merge_states(torch.from_numpy(vs), torch.from_numpy(ss))
    assert isinstance(v, torch.Tensor)
    assert_merge_matches(v.numpy(), s.numpy(), reference_merge_stacked(vs, ss, base=2), "float32", "v")

    indptr = np.array([0, 2, 2, 5], np.int32)
    vv, sv = random_state(rng, 5, 4, 128)
    v, s = fi.variable_length_merge_states(torch.from_numpy(vv), torch.from_numpy(sv), torch.from_numpy(indptr))
    assert isinstance(v, torch.Tensor)
    assert_merge_matches(v.numpy(), s.numpy(), reference_merge_varlen(vv, sv, indptr, base=2), "float32", "v")

    tv, ts = torch.from_numpy(v_a.copy()), torch.from_numpy(s_a.copy())
    fi.merge_state_in_place(tv, ts, torch.from_numpy(v_b), torch.from_numpy(s_b), mask=torch.ones(11, dtype=torch.bool))
    assert_merge_matches(tv.numpy(), ts.numpy(), reference_merge(v_a, s_a, v_b, s_b, base=2), "float32", "v")


# --------------------------------------------------------------------------------------------------
# the signatures FlashInfer's callers rely on


def test_signatures_are_flashinfers():
    import inspect

    names = {f: list(inspect.signature(getattr(fi, f)).parameters) for f in
             ("merge_state", "merge_state_in_place", "merge_states", "variable_length_merge_states")}
    assert names == {"merge_state": ["v_a", "s_a", "v_b", "s_b"],
                     "merge_state_in_place": ["v", "s", "v_other", "s_other", "mask"],
                     "merge_states": ["v", "s"], "variable_length_merge_states": ["v", "s", "indptr"]}
    assert inspect.signature(fi.merge_state_in_place).parameters["mask"].default is None


# --------------------------------------------------------------------------------------------------
# errors name FlashInfer's arguments, whichever layer words them (the names are passed down): the
# table's fi.* rows (tests/errors/bad_inputs.py); here the torch.ops path autograd takes


def test_under_autograd_errors_name_flashinfers_arguments_too(rng):
    """A call autograd records goes through torch.ops.attnmerge, whose kernels get the names too."""
    torch = pytest.importorskip("torch")
    v_a, s_a, v_b, s_b = (torch.from_numpy(x).requires_grad_() for x in pair(rng, 5, 3, 8, "float32"))
    with pytest.raises(ValueError) as info:
        fi.merge_state(v_a, s_a, v_b, s_b[:-1])
    assert str(info.value) == "s_b: expected shape [5, 3] (the number of tokens of v_a, s_a and v_b), got [4, 3]"
    vs, ss = (torch.from_numpy(x).requires_grad_() for x in random_stacked(rng, 5, 2, 3, 8, "float32"))
    with pytest.raises(ValueError) as info:
        fi.merge_states(vs[:, 0], ss)
    assert str(info.value) == "v: expected 4 dimensions, got 3 (shape [5, 3, 8])"


# --------------------------------------------------------------------------------------------------
# every function on every device


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_function_on_every_device(rng, device, dtype):
    """The four functions on the `device` fixture's arrays (NumPy on the CPU, torch on CUDA): new
    arrays of the caller's library on its device, the oracle's values in base 2."""
    t, h, d = 33, 4, 128
    v_a, s_a, v_b, s_b = pair(rng, t, h, d, dtype)
    v, s = fi.merge_state(device.put(v_a), device.put(s_a), device.put(v_b), device.put(s_b))
    assert device.is_mine(v) and device.is_mine(s) and v.dtype == device.dtype(dtype)
    assert_merge_matches(device.get(v), device.get(s), reference_merge(v_a, s_a, v_b, s_b, base=2), dtype, "v")

    tv, ts = device.put(v_a), device.put(s_a)
    on = np.arange(t) % 2 == 0
    assert fi.merge_state_in_place(tv, ts, device.put(v_b), device.put(s_b), mask=device.put(on)) is None
    ref = reference_merge(v_a, s_a, v_b, s_b, base=2)
    assert_o_close(device.get(tv)[on], ref[0][on], dtype, "v")
    assert np.array_equal(device.get(tv)[~on], v_a[~on])

    vs, ss = random_stacked(rng, t, 8, h, d, dtype)
    v, s = fi.merge_states(device.put(vs), device.put(ss))
    assert_merge_matches(device.get(v), device.get(s), reference_merge_stacked(vs, ss, base=2), dtype, "v")

    indptr = np.array([0, 4, 4, 9, 12], np.int32)
    vv, sv = random_state(rng, 12, h, d, dtype)
    v, s = fi.variable_length_merge_states(device.put(vv), device.put(sv), device.put(indptr))
    assert_merge_matches(device.get(v), device.get(s), reference_merge_varlen(vv, sv, indptr, base=2), dtype, "v")
