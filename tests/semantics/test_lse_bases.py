"""Mixed LSE bases: each LSE argument in its own base, on every device.

Engines differ in their LSE's base (FlashInfer writes log2-sum-exp2, FlashAttention natural
logs), and converting one is a launch of its own at decode sizes.  So:

    merge(o_a, lse_a, o_b, lse_b, base=(a's, b's), out_base=...)     each state in its own base
    merge_inplace(o, lse, o_other, lse_other, base=(lse's, lse_other's))  lse keeps its base
    merge_states / merge_varlen / merge_share(..., base=..., out_base=...)  the merged LSE's own

with `base` "e" or 2 (or, for the two-way and in-place merges, a pair) and out_base None (the
inputs' base, a's for a pair), "e" or 2.  Each LSE is an exact log-sum-exp in its base, so the
merge is that of their natural logs (lse * ln b), and the merged LSE is given in out_base: the
float64 oracle converts, merges in base e and converts back.  The semantics are those of one
base (empty parts, all-empty rows, NaN rows, the sink in the inputs' base); a call whose bases
agree, spelled out or not, gives the same bits.  Gradients: tests/interop/test_torch_autograd.py
and test_jax_ffi.py; the GPU kernels' paths: test_forward_kernel_emulated.py; the C ABI's flags:
the end of this file.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import attnmerge
import c_abi
from oracle import (assert_merge_matches, natural, random_lse, random_o, random_stacked, rebased, reference_merge,
                    reference_merge_share, reference_merge_stacked, reference_merge_varlen, to_f64)

BASES = ("e", 2)
THREE = list(itertools.product(BASES, repeat=3))


def special_rows(rng, lse_a, lse_b):
    """Rows whose states are empty (-inf, or +inf as FlashAttention-2 writes it) or NaN, in a and b."""
    t = lse_a.shape[0]
    for i, (x, y) in enumerate([(-np.inf, 1.0), (1.0, np.inf), (-np.inf, -np.inf), (np.inf, -np.inf), (np.nan, 1.0),
                                (1.0, np.nan)]):
        if i < t:
            lse_a[i, 0], lse_b[i, 0] = x, y


def pair_call(device, o_a, lse_a, o_b, lse_b, **kw):
    out, out_lse = device.nan(o_b.shape, o_b.dtype), device.nan(o_b.shape[:2])
    attnmerge.merge(device.put(o_a), device.put(lse_a), device.put(o_b), device.put(lse_b), out=out, out_lse=out_lse,
                    **kw)
    return device.get(out), device.get(out_lse)


# --------------------------------------------------------------------------------------------------
# the two-way merge: each state in its own base, the merged LSE in a third


@pytest.mark.parametrize("dtype", ("float32", "bfloat16"))
@pytest.mark.parametrize("a,b,out", THREE)
def test_each_state_of_a_two_way_merge_in_its_own_base(rng, device, a, b, out, dtype):
    o_a, o_b = random_o(rng, (23, 4, 40), dtype), random_o(rng, (23, 4, 40), dtype)
    lse_a, lse_b = random_lse(rng, (23, 4)), random_lse(rng, (23, 4))
    special_rows(rng, lse_a, lse_b)
    got = pair_call(device, o_a, lse_a, o_b, lse_b, base=(a, b), out_base=out)
    ref = rebased(reference_merge(o_a, natural(lse_a, a), o_b, natural(lse_b, b)), out)
    assert_merge_matches(*got, ref, dtype)


@pytest.mark.parametrize("a,b,out", [("e", 2, "e"), (2, "e", 2), ("e", "e", 2)])
def test_mixed_bases_with_a_tokens_and_lses_laid_out_heads_first(rng, device, a, b, out):
    """vLLM's layout ([heads, tokens] LSEs, passed transposed) and prefill_tokens_with_context: the
    two-way merge's general kernel, where mixed bases go."""
    t, h, d = 70, 3, 64
    o_a, o_b = random_o(rng, (t, h, d)), random_o(rng, (t, h, d))
    lse_a, lse_b = random_lse(rng, (h, t)).T, random_lse(rng, (h, t)).T
    got = pair_call(device, o_a, lse_a, o_b, lse_b, base=(a, b), out_base=out, a_tokens=40)
    ref = rebased(reference_merge(o_a, natural(lse_a, a), o_b, natural(lse_b, b), a_tokens=40), out)
    assert_merge_matches(*got, ref, "float32")


@pytest.mark.parametrize("a,b,out", [(2, "e", "e"), ("e", 2, 2), ("e", "e", 2)])
def test_a_two_way_merge_written_over_its_first_state_in_another_base(rng, device, a, b, out):
    """out = o_a and out_lse = lse_a: the merged LSE written over an input's, in the same launch on
    the GPU (every lane of a row reads the old one first), converted into out_base."""
    t, h, d = 19, 4, 128
    o_a, o_b = random_o(rng, (t, h, d), "bfloat16"), random_o(rng, (t, h, d), "bfloat16")
    lse_a, lse_b = random_lse(rng, (t, h)), random_lse(rng, (t, h))
    special_rows(rng, lse_a, lse_b)
    ref = rebased(reference_merge(o_a, natural(lse_a, a), o_b, natural(lse_b, b)), out)
    da, dla = device.put(o_a), device.put(lse_a)
    attnmerge.merge(da, dla, device.put(o_b), device.put(lse_b), out=da, out_lse=dla, base=(a, b), out_base=out)
    assert_merge_matches(device.get(da), device.get(dla), ref, "bfloat16")


def test_bases_spelled_out_that_agree_change_no_bit(rng, device):
    o_a, lse_a, o_b, lse_b = (random_o(rng, (9, 4, 72), "float16"), random_lse(rng, (9, 4)),
                              random_o(rng, (9, 4, 72), "float16"), random_lse(rng, (9, 4)))
    for base in BASES:
        plain = pair_call(device, o_a, lse_a, o_b, lse_b, base=base)
        for spelled in ({"base": (base, base)}, {"base": base, "out_base": base},
                        {"base": (base, base), "out_base": base}):
            got = pair_call(device, o_a, lse_a, o_b, lse_b, **spelled)
            assert np.array_equal(got[0], plain[0], equal_nan=True), spelled
            assert np.array_equal(got[1], plain[1], equal_nan=True), spelled


def test_converting_lse_b_first_is_the_same_merge(rng, device):
    """Mixed bases against the caller's own conversion: the same merge to float32 rounding."""
    o_a, lse_a, o_b, lse_b = (random_o(rng, (17, 2, 24)), random_lse(rng, (17, 2)), random_o(rng, (17, 2, 24)),
                              random_lse(rng, (17, 2)))
    mixed = pair_call(device, o_a, lse_a, o_b, lse_b, base=("e", 2))
    converted = pair_call(device, o_a, lse_a, o_b, (lse_b * np.float32(np.log(2.0))).astype(np.float32))
    np.testing.assert_allclose(mixed[0], converted[0], rtol=2e-6, atol=2e-6)
    np.testing.assert_allclose(mixed[1], converted[1], rtol=2e-6, atol=2e-6)


# --------------------------------------------------------------------------------------------------
# the in-place merge: the other state in its own base, lse keeps its own


@pytest.mark.parametrize("masked", (False, True))
@pytest.mark.parametrize("a,b", list(itertools.product(BASES, repeat=2)))
def test_in_place_the_other_state_in_its_own_base(rng, device, a, b, masked):
    t, h, d = 31, 3, 128
    o, o_other = random_o(rng, (t, h, d), "bfloat16"), random_o(rng, (t, h, d), "bfloat16")
    lse, lse_other = random_lse(rng, (t, h)), random_lse(rng, (t, h))
    special_rows(rng, lse, lse_other)
    mask = (rng.random(t) < 0.5).astype(np.uint8) if masked else None
    ref_o, ref_lse = rebased(reference_merge(o, natural(lse, a), o_other, natural(lse_other, b)), a)
    if masked:
        keep = mask == 0
        ref_o[keep], ref_lse[keep] = to_f64(o[keep]), to_f64(lse[keep])
    do, dl = device.put(o), device.put(lse)
    attnmerge.merge_inplace(do, dl, device.put(o_other), device.put(lse_other),
                            mask=None if mask is None else device.put(mask), base=(a, b))
    assert_merge_matches(device.get(do), device.get(dl), (ref_o, ref_lse), "bfloat16")


# --------------------------------------------------------------------------------------------------
# the N-way and variable-length merges and the share: the merged LSE in its own base


@pytest.mark.parametrize("with_sink", (False, True))
@pytest.mark.parametrize("s", (1, 3, 40))
@pytest.mark.parametrize("base,out_base", list(itertools.product(BASES, repeat=2)))
def test_the_merged_lse_of_n_states_in_its_own_base(rng, device, base, out_base, s, with_sink):
    o, lse = random_stacked(rng, 7, s, 4, 48)
    lse[0, 0, 0] = np.nan
    lse[1, :, 1] = -np.inf
    sink = random_lse(rng, (4,)) if with_sink else None
    out, out_lse = device.nan((7, 4, 48)), device.nan((7, 4))
    attnmerge.merge_states(device.put(o), device.put(lse), out=out, out_lse=out_lse, base=base, out_base=out_base,
                           sink=None if sink is None else device.put(sink))
    ref = rebased(reference_merge_stacked(o, natural(lse, base), sink=natural(sink, base)), out_base)
    assert_merge_matches(device.get(out), device.get(out_lse), ref, "float32")


@pytest.mark.parametrize("base,out_base", list(itertools.product(BASES, repeat=2)))
def test_the_merged_lse_of_a_varlen_merge_in_its_own_base(rng, device, base, out_base):
    indptr = np.array([0, 0, 3, 4, 12], np.int64)
    o, lse = random_o(rng, (12, 2, 32)), random_lse(rng, (12, 2))
    sink = random_lse(rng, (2,))
    out, out_lse = device.nan((4, 2, 32)), device.nan((4, 2))
    attnmerge.merge_varlen(device.put(o), device.put(lse), device.put(indptr), out=out, out_lse=out_lse, base=base,
                           out_base=out_base, sink=device.put(sink))
    ref = rebased(reference_merge_varlen(o, natural(lse, base), indptr, sink=natural(sink, base)), out_base)
    assert_merge_matches(device.get(out), device.get(out_lse), ref, "float32")


@pytest.mark.parametrize("base,out_base", list(itertools.product(BASES, repeat=2)))
def test_a_shares_merged_lse_in_its_own_base(rng, device, base, out_base):
    _, lse = random_stacked(rng, 5, 6, 3, 16)
    o = random_o(rng, (5, 3, 16))
    out, out_lse = device.nan((5, 3, 16)), device.nan((5, 3))
    attnmerge.merge_share(device.put(o), device.put(lse), 2, out=out, out_lse=out_lse, base=base, out_base=out_base)
    ref = rebased(reference_merge_share(o, natural(lse, base), 2), out_base)
    assert_merge_matches(device.get(out), device.get(out_lse), ref, "float32")


# --------------------------------------------------------------------------------------------------
# what is refused


@pytest.mark.parametrize("bad", [(2,), (2, "e", 2), ("e", 10), "2", 2.5, True, None])
def test_a_bad_pair_of_bases_is_refused_naming_base(rng, bad):
    o_a, lse_a, o_b, lse_b = random_o(rng, (2, 1, 8)), random_lse(rng, (2, 1)), random_o(rng, (2, 1, 8)), random_lse(
        rng, (2, 1))
    with pytest.raises(ValueError, match=r"^base: expected 'e', 2 or a pair of them"):
        attnmerge.merge(o_a, lse_a, o_b, lse_b, base=bad)
    with pytest.raises(ValueError, match=r"^base: expected 'e', 2 or a pair of them"):
        attnmerge.merge_inplace(o_a.copy(), lse_a.copy(), o_b, lse_b, base=bad)


def test_a_pair_is_for_two_states_and_out_base_is_one_base(rng):
    o, lse = random_stacked(rng, 2, 3, 1, 8)
    with pytest.raises(ValueError, match=r"^base: expected 'e' or 2, got \(2, 'e'\)"):
        attnmerge.merge_states(o, lse, base=(2, "e"))
    with pytest.raises(ValueError, match=r"^out_base: expected None, 'e' or 2, got \(2, 2\)"):
        attnmerge.merge_states(o, lse, out_base=(2, 2))
    with pytest.raises(TypeError):  # the in-place merge's LSE keeps lse's base
        attnmerge.merge_inplace(o[:, 0].copy(), lse[:, 0].copy(), o[:, 1], lse[:, 1], out_base=2)


def _pair_tensors(rng):
    o_a, lse_a, o_b, lse_b = random_o(rng, (3, 2, 8)), random_lse(rng, (3, 2)), random_o(rng, (3, 2, 8)), random_lse(
        rng, (3, 2))
    out, out_lse = np.full_like(o_a, np.nan), np.full_like(lse_a, np.nan)
    return [c_abi.tensor_from(x) for x in (out, out_lse, o_a, lse_a, o_b, lse_b)], out


@pytest.mark.parametrize("flags,which", [(c_abi.LSE_B_BASE2 | c_abi.LSE_B_BASE_E, "ATTNMERGE_LSE_B_BASE2"),
                                         (c_abi.OUT_LSE_BASE2 | c_abi.OUT_LSE_BASE_E, "ATTNMERGE_OUT_LSE_BASE2")])
def test_the_c_abi_refuses_both_bases_of_one_argument_before_any_write(rng, flags, which):
    tensors, out = _pair_tensors(rng)
    status = c_abi.merge(*tensors, c_abi.options(flags))
    assert status == c_abi.ERROR_VALUE
    assert c_abi.last_error().startswith(f"options.flags: expected at most one of {which}")
    assert np.isnan(out).all()


@pytest.mark.parametrize("base2", (False, True))
def test_c_abi_flags_that_name_the_calls_own_base_change_no_bit(rng, base2):
    """LSE_B_* and OUT_LSE_* naming the base the call has anyway: the results of a call without them."""
    same = (c_abi.LSE_B_BASE2 | c_abi.OUT_LSE_BASE2) if base2 else (c_abi.LSE_B_BASE_E | c_abi.OUT_LSE_BASE_E)
    base = c_abi.LSE_BASE2 if base2 else 0
    o_a, lse_a, o_b, lse_b = random_o(rng, (5, 3, 16)), random_lse(rng, (5, 3)), random_o(rng, (5, 3, 16)), random_lse(
        rng, (5, 3))
    results = []
    for flags in (base, base | same):
        out, out_lse = np.full_like(o_a, np.nan), np.full_like(lse_a, np.nan)
        tensors = [c_abi.tensor_from(x) for x in (out, out_lse, o_a, lse_a, o_b, lse_b)]
        assert c_abi.merge(*tensors, c_abi.options(flags)) == c_abi.SUCCESS, c_abi.last_error()
        results.append((out, out_lse))
    assert np.array_equal(results[0][0], results[1][0]) and np.array_equal(results[0][1], results[1][1])


@pytest.mark.parametrize("flags", [c_abi.LSE_B_BASE2, c_abi.OUT_LSE_BASE_E])
def test_the_c_abi_backward_takes_one_base(rng, flags):
    """The backward takes every LSE in one base: its caller converts (a gradient through lse' = c lse
    is c dlse'), as the torch ops and attnmerge.jax do."""
    (out, out_lse, o_a, lse_a, o_b, lse_b), _ = _pair_tensors(rng)
    grads = [c_abi.tensor_from(np.full((3, 2, 8), np.nan, np.float32)), None, None, None]
    status = c_abi.merge_backward(*grads, c_abi.tensor_from(np.ones((3, 2, 8), np.float32)), None, out, out_lse, o_a,
                                  lse_a, o_b, lse_b, c_abi.options(flags))
    assert status == c_abi.ERROR_VALUE
    assert c_abi.last_error().startswith("options.flags: expected flags within")


@pytest.mark.parametrize("op", ("merge_states", "merge_varlen", "merge_share"))
def test_the_c_abi_takes_lse_b_flags_only_where_there_is_a_b(rng, op):
    o, lse = random_stacked(rng, 2, 3, 1, 8)
    out, out_lse = np.full((2, 1, 8), np.nan, np.float32), np.full((2, 1), np.nan, np.float32)
    opts = c_abi.options(c_abi.LSE_B_BASE2)
    t = c_abi.tensor_from
    if op == "merge_states":
        status = c_abi.merge_states(t(out), t(out_lse), t(o), t(lse), opts)
    elif op == "merge_varlen":
        flat_o, flat_l = np.ascontiguousarray(o.reshape(6, 1, 8)), np.ascontiguousarray(lse.reshape(6, 1))
        status = c_abi.merge_varlen(t(out), t(out_lse), t(flat_o), t(flat_l), t(np.array([0, 3, 6], np.int64)), opts)
    else:
        status = c_abi.merge_share(t(out), t(out_lse), t(np.ascontiguousarray(o[:, 0])), t(lse), 0, opts)
    assert status == c_abi.ERROR_VALUE and c_abi.last_error().startswith("options.flags: expected flags within")
    assert np.isnan(out).all()
