"""Softmax statistics as input: every merge takes a state's LSE as a (max, sum) tuple of float32
arrays (TensorRT-LLM's Helix post-processing, a flash-decoding kernel before it takes the log),
against the oracle, on every device.

    merge(o_a, (max_a, sum_a), o_b, (max_b, sum_b)), merge_inplace(o, lse, o_other, (max, sum)),
    merge_states(o, (max, sum)), merge_varlen(o, (max, sum), indptr), merge_share(o, (max, sum), i)

A state's LSE is max + log(sum) (log2 in base 2), taken in float32 as the merge reads it
(oracle.stats_lse); sum = 0 is an empty part whatever max holds (NaN, +-inf, garbage: the max of no
scores); then the LSE's rules: max + log(sum) of +-inf is empty, NaN makes the row NaN (a NaN sum, a
negative sum, a NaN max beside a sum > 0); all empty gives O = 0 and LSE = -inf.  The sum has the
shape of its max and strides of its own.  The merged LSE is an LSE.  The in-place merge takes
statistics for lse_other only (its merged LSE replaces lse), an out_lse that is the max of a pair is
refused, and the backwards take LSEs (tests/errors/bad_inputs.py); gradients are in
tests/interop/test_torch_autograd.py and test_jax_ffi.py, the GPU kernels' paths in
test_forward_kernel_emulated.py.
"""

from __future__ import annotations

import numpy as np
import pytest

import attnmerge
from devices import put_lse
from oracle import (DTYPES, assert_merge_matches, random_lse, random_o, random_stacked, reference_merge,
                    reference_merge_share, reference_merge_stacked, reference_merge_states, reference_merge_varlen,
                    stats_lse, strided_view)


def stats_of(rng, lse_shape, base="e"):
    """Random softmax statistics: a max of scale 3 and a sum from 1 (the max's own key) to 40, as a
    flash-decoding kernel leaves them."""
    return random_lse(rng, lse_shape), rng.uniform(1.0, 40.0, lse_shape).astype(np.float32)


def put_stats(device, m, total):
    return device.put(m), device.put(total)


def merge_call(device, o_a, lse_a, o_b, lse_b, out_dtype=None, **kw):
    """merge on the device, an LSE argument given as an array or a (max, sum) tuple, into
    NaN-poisoned outputs; (out, out_lse) read back."""
    out, out_lse = device.nan(o_b.shape, out_dtype or o_b.dtype), device.nan(o_b.shape[:2])
    res = attnmerge.merge(device.put(o_a), put_lse(device, lse_a), device.put(o_b), put_lse(device, lse_b),
                          out=out, out_lse=out_lse, **kw)
    assert res[0] is out and res[1] is out_lse
    return device.get(out), device.get(out_lse)


# --------------------------------------------------------------------------------------------------
# the formula


@pytest.mark.parametrize("base", ("e", 2))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("which", ("both", "a", "b"))
def test_merge_of_softmax_statistics(rng, device, which, dtype, base):
    t, h, d = 37, 5, 72
    o_a, o_b = random_o(rng, (t, h, d), dtype), random_o(rng, (t, h, d), dtype)
    m_a, s_a = stats_of(rng, (t, h))
    m_b, s_b = stats_of(rng, (t, h))
    lse_a = (m_a, s_a) if which in ("both", "a") else m_a
    lse_b = (m_b, s_b) if which in ("both", "b") else m_b
    out, out_lse = merge_call(device, o_a, lse_a, o_b, lse_b, base=base)
    ref_a = stats_lse(m_a, s_a, base) if which in ("both", "a") else m_a
    ref_b = stats_lse(m_b, s_b, base) if which in ("both", "b") else m_b
    assert_merge_matches(out, out_lse, reference_merge(o_a, ref_a, o_b, ref_b, base=base), dtype)


def test_a_sum_of_one_is_the_max_as_an_lse_bit_for_bit(rng, device):
    """(max, 1) is the LSE max: log(1) = 0, so the results are those of the LSEs, every bit (the
    statistics take the general kernel on the GPU, the LSEs the plain one: a row's bits do not
    depend on the kernel)."""
    t, h, d = 64, 8, 128
    o_a, o_b = random_o(rng, (t, h, d)), random_o(rng, (t, h, d))
    m_a, m_b = random_lse(rng, (t, h)), random_lse(rng, (t, h))
    ones = np.ones((t, h), np.float32)
    got = merge_call(device, o_a, (m_a, ones), o_b, (m_b, ones))
    want = merge_call(device, o_a, m_a, o_b, m_b)
    for x, y in zip(got, want):
        np.testing.assert_array_equal(x.view(np.uint32), y.view(np.uint32))


def test_the_semantics_table(rng, device):
    """Per row (token 0..9 of one head): sum 0 is empty whatever the max (NaN, +inf, -inf, finite),
    both empty give O = 0 and LSE = -inf; a max of -inf or +inf beside a sum > 0 is empty (max +
    log(sum) is that infinity: the LSE's rule); a NaN sum, a negative sum and a NaN max beside a
    sum > 0 make the row NaN; a sum below float32's normal range is a tiny weight, not an empty
    part (not flushed to 0).  An empty part's O (NaN here) is never read."""
    cases = [  # (max_a, sum_a, max_b, sum_b)
        (np.nan, 0.0, 1.0, 2.0), (np.inf, 0.0, 1.0, 2.0), (-np.inf, 0.0, 1.0, 2.0), (5.0, 0.0, 1.0, 2.0),
        (np.nan, 0.0, 3.0, 0.0), (-np.inf, 4.0, 1.0, 2.0), (np.inf, 4.0, 1.0, 2.0), (1.0, np.nan, 1.0, 2.0),
        (1.0, -1.0, 1.0, 2.0), (np.nan, 4.0, 1.0, 2.0), (100.0, 1e-40, 1.0, 2.0),
    ]
    t, h, d = len(cases), 1, 64
    m_a, s_a, m_b, s_b = (np.array([[c[i]] for c in cases], np.float32) for i in range(4))
    o_a, o_b = random_o(rng, (t, h, d)), random_o(rng, (t, h, d))
    empty_a = (s_a == 0) | np.isinf(m_a)
    o_a[empty_a[:, 0]] = np.nan
    o_b[(s_b == 0)[:, 0]] = np.nan
    out, out_lse = merge_call(device, o_a, (m_a, s_a), o_b, (m_b, s_b))
    assert_merge_matches(out, out_lse, reference_merge(o_a, stats_lse(m_a, s_a), o_b, stats_lse(m_b, s_b)), "float32")
    assert (out[4] == 0).all() and out_lse[4, 0] == -np.inf  # both parts empty
    assert np.isnan(out_lse[7:10]).all() and np.isnan(out[7:10]).all()
    assert out_lse[10, 0] > 7.0  # a's LSE 100 + ln(1e-40), about 7.9, counted: a subnormal sum is no empty part


@pytest.mark.parametrize("layout", ("transposed", "token_step", "pair_axis"))
def test_a_sum_has_strides_of_its_own(rng, device, layout):
    """The sum is read through its own strides, whatever the max's: stored [heads, tokens], every
    third token of a larger buffer, or beside its max in one [tokens, heads, 2] buffer (a kernel's
    (max, sum) pairs)."""
    t, h, d = 40, 6, 64
    o_a, o_b = random_o(rng, (t, h, d)), random_o(rng, (t, h, d))
    m_a, s_a = stats_of(rng, (t, h))
    m_b, s_b = stats_of(rng, (t, h))
    if layout == "pair_axis":
        pairs = np.stack([m_b, s_b], axis=-1)  # [tokens, heads, 2]
        lse_b = (pairs[..., 0], pairs[..., 1])
    else:
        order, steps = ((1, 0), None) if layout == "transposed" else (None, {0: 3})
        lse_b = (m_b, strided_view(s_b, order=order, steps=steps)[0])
    out, out_lse = merge_call(device, o_a, (m_a, strided_view(s_a, order=(1, 0))[0]), o_b, lse_b)
    assert_merge_matches(out, out_lse, reference_merge(o_a, stats_lse(m_a, s_a), o_b, stats_lse(m_b, s_b)), "float32")


@pytest.mark.parametrize("option", ("a_tokens", "mixed_bases", "sink", "fp8", "heads_first_views"))
def test_merge_statistics_with_the_two_way_options(rng, device, option):
    """With a_tokens (a's sum read for its first a_tokens tokens alone: the rest of it NaN), LSEs of
    two bases (each sum's log in its own max's base), a sink, an FP8 output, and [heads, tokens]
    buffers seen as [tokens, heads] views (tiled rows on the GPU past 64 tokens)."""
    t, h, d = 130, 3, 128
    o_a, o_b = random_o(rng, (t, h, d)), random_o(rng, (t, h, d))
    m_a, s_a = stats_of(rng, (t, h))
    m_b, s_b = stats_of(rng, (t, h))
    kw, ref_kw, out_dtype = {}, {}, None
    base_a = base_b = "e"
    if option == "a_tokens":
        kw["a_tokens"] = ref_kw["a_tokens"] = 50
        s_a[50:] = m_a[50:] = np.nan
    elif option == "mixed_bases":
        kw["base"], base_b = ("e", 2), 2
    elif option == "sink":
        kw["sink"] = ref_kw["sink"] = random_lse(rng, (h,))
    elif option == "fp8":
        out_dtype = "float8_e4m3fn"
        kw.update(out_dtype=out_dtype, output_scale=0.5)
    if option == "heads_first_views":
        m_a, s_a, m_b, s_b = (np.ascontiguousarray(x.T).T for x in (m_a, s_a, m_b, s_b))
    if option == "sink":
        kw["sink"] = device.put(kw["sink"])
    if out_dtype is None:
        out, out_lse = merge_call(device, o_a, (m_a, s_a), o_b, (m_b, s_b), **kw)
    else:
        out, out_lse = attnmerge.merge(device.put(o_a), put_stats(device, m_a, s_a), device.put(o_b),
                                       put_stats(device, m_b, s_b), **kw)
        out, out_lse = device.get(out), device.get(out_lse)
    lse_b = stats_lse(m_b, s_b, base_b) * (np.log(2.0) if base_b == 2 else 1.0)  # into a's base, as it is merged
    ref = reference_merge(o_a, stats_lse(m_a, s_a, base_a), o_b, lse_b, **ref_kw)
    if out_dtype is None:
        assert_merge_matches(out, out_lse, ref, "float32")
    else:
        from oracle import assert_fp8_close, assert_lse_close
        assert_fp8_close(out, ref[0], 0.5)
        assert_lse_close(out_lse, ref[1])


def test_the_merged_lse_is_an_lse(rng, device):
    """A merge of statistics returns an LSE: merging it again (as an LSE) with a third state is the
    merge of all three."""
    t, h, d = 20, 4, 64
    o = [random_o(rng, (t, h, d)) for _ in range(3)]
    m, total = zip(*(stats_of(rng, (t, h)) for _ in range(3)))
    first, first_lse = merge_call(device, o[0], (m[0], total[0]), o[1], (m[1], total[1]))
    out, out_lse = merge_call(device, first, first_lse, o[2], (m[2], total[2]))
    ref = reference_merge_states(o, [stats_lse(a, b) for a, b in zip(m, total)])
    assert_merge_matches(out, out_lse, ref, "float32")


# --------------------------------------------------------------------------------------------------
# the other ops


@pytest.mark.parametrize("base", ("e", 2))
@pytest.mark.parametrize("states_axis", (0, 1, 2))
@pytest.mark.parametrize("s", (0, 1, 2, 3, 8, 64))
def test_merge_states_of_softmax_statistics(rng, device, s, states_axis, base):
    o, m = random_stacked(rng, 11, s, 3, 40, states_axis=states_axis)
    total = rng.uniform(1.0, 40.0, m.shape).astype(np.float32)
    total[rng.random(m.shape) < 0.1] = 0.0  # some states empty
    t = o.shape[1 - states_axis] if states_axis < 2 else o.shape[0]
    out, out_lse = device.nan((t, 3, 40)), device.nan((t, 3))
    attnmerge.merge_states(device.put(o), put_stats(device, m, total), out=out, out_lse=out_lse,
                           states_axis=states_axis, base=base)
    ref = reference_merge_stacked(o, stats_lse(m, total, base), states_axis=states_axis, base=base)
    assert_merge_matches(device.get(out), device.get(out_lse), ref, "float32")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("s", (16, 64, 128))
def test_decode_shapes_of_softmax_statistics(rng, device, s, dtype):
    """Few rows, many states (split-KV decode: on the GPU the state-parallel kernel), a sink too."""
    o, m = random_stacked(rng, 16, s, 32, 128, dtype=dtype)
    total = rng.uniform(1.0, 40.0, m.shape).astype(np.float32)
    sink = random_lse(rng, (32,))
    out, out_lse = attnmerge.merge_states(device.put(o), put_stats(device, m, total), sink=device.put(sink))
    ref = reference_merge_stacked(o, stats_lse(m, total), sink=sink)
    assert_merge_matches(device.get(out), device.get(out_lse), ref, dtype)


def test_merge_varlen_of_softmax_statistics(rng, device):
    indptr = np.array([0, 1, 1, 4, 12, 40], np.int64)
    o, (m, total) = random_o(rng, (40, 4, 64)), stats_of(rng, (40, 4))
    total[5] = 0.0
    out, out_lse = attnmerge.merge_varlen(device.put(o), put_stats(device, m, total), device.put(indptr))
    ref = reference_merge_varlen(o, stats_lse(m, total), indptr)
    assert_merge_matches(device.get(out), device.get(out_lse), ref, "float32")


@pytest.mark.parametrize("states_axis", (0, 1, 2))
def test_merge_share_of_softmax_statistics(rng, device, states_axis):
    """Each state's share, the statistics of every state given; the shares sum to merge_states."""
    s, t, h, d = 4, 9, 3, 64
    o_all, m = random_stacked(rng, t, s, h, d, states_axis=states_axis)
    total = rng.uniform(1.0, 40.0, m.shape).astype(np.float32)
    o_states = np.moveaxis(o_all, states_axis, 0)
    lse = stats_lse(m, total)
    whole = np.zeros((t, h, d))
    for i in range(s):
        out, out_lse = attnmerge.merge_share(device.put(np.ascontiguousarray(o_states[i])),
                                             put_stats(device, m, total), i, states_axis=states_axis)
        ref = reference_merge_share(o_states[i], lse, i, states_axis=states_axis)
        assert_merge_matches(device.get(out), device.get(out_lse), ref, "float32")
        whole += device.get(out)
    assert_merge_matches(whole, None, reference_merge_stacked(o_all, lse, states_axis=states_axis), "float32")


@pytest.mark.parametrize("base", ("e", 2, ("e", 2)))
def test_merge_inplace_of_softmax_statistics(rng, device, base):
    """The in-place merge takes lse_other as statistics (a peer's partial state folded into a float32
    accumulator, the ring form); its merged LSE, an LSE, replaces lse."""
    t, h, d = 33, 4, 64
    o, lse = random_o(rng, (t, h, d)), random_lse(rng, (t, h))
    o_other, (m, total) = random_o(rng, (t, h, d)), stats_of(rng, (t, h))
    base_b = base[1] if isinstance(base, tuple) else base
    base_a = base[0] if isinstance(base, tuple) else base
    ref_b = stats_lse(m, total, base_b) * (np.log(2.0) if base_b == 2 and base_a == "e" else 1.0)
    ref = reference_merge(o, lse, o_other, ref_b, base=base_a)
    do, dl = device.put(o), device.put(lse)
    attnmerge.merge_inplace(do, dl, device.put(o_other), put_stats(device, m, total), base=base)
    assert_merge_matches(device.get(do), device.get(dl), ref, "float32")
