"""Softmax statistics and empty states with every option of the merges, against the oracle, on
every device: each op that takes states (merge, merge_states, merge_varlen, merge_share) with its
states given as (max, sum) statistics, as LSEs with a `valid` mask, or both at once, and each option
issue 37 names for every form:

    sink=            each head's sink, one more state (in the inputs' base)
    out_dtype=fp8    an FP8 output with output_scale
    group_size=      per-group FP8 with its scales
    block_format=    MXFP8 and NVFP4 outputs with their block scales (docs/semantics.md)
    base=2, out_base the inputs' LSEs (the maxima, the sums' exp2) in base 2, the merged LSE in e
    return_lse=False no merged LSE
    batch_invariant  the row's bits independent of the batch

The oracle merges the states' LSEs as the merge reads them: max + log(sum) (oracle.stats_lse; sum
= 0 an empty part, its max NaN here), -inf where valid is 0 (oracle.valid_lse; the state's O and
LSE NaN here), in float64, natural, then rebased into the merged LSE's base.
"""

from __future__ import annotations

import numpy as np
import pytest

import attnmerge
from oracle import (assert_block_close, assert_fp8_close, assert_group_fp8_close, assert_lse_close,
                    assert_merge_matches, natural, random_lse, random_o, rebased, reference_merge, reference_merge_share,
                    reference_merge_stacked, reference_merge_varlen, stats_lse, valid_lse)

OPS = ("merge", "merge_states", "merge_varlen", "merge_share")
FORMS = ("stats", "valid", "both")
OPTIONS = ("sink", "fp8", "group_fp8", "mxfp8", "nvfp4", "bases", "no_lse", "batch_invariant")
T, H, D, S, GROUP = 24, 3, 64, 5, 16


class States:
    """One op's inputs: per LSE argument its (maxima or LSEs, sums or None), the valid mask (or
    None), and the natural float64 LSEs the merge is to read (`natural`)."""

    def __init__(self, rng, form, shapes, valid_shape, base, valid_to_lse):
        self.lses, self.natural = [], []
        self.valid = None
        if form in ("valid", "both"):
            self.valid = (rng.random(valid_shape) < 0.7).astype(np.uint8)
            self.valid.reshape(-1)[0] = 0
        for shape in shapes:
            lse = random_lse(rng, shape)
            total = None
            if form in ("stats", "both"):
                total = rng.uniform(1.0, 40.0, shape).astype(np.float32)
                total[rng.random(shape) < 0.15] = 0.0  # empty parts: their max is anything
                eff = stats_lse(lse, total, base)
                lse[total == 0] = np.nan
            else:
                eff = lse.astype(np.float64)
            if self.valid is not None:
                empty = valid_to_lse(self.valid, len(self.lses)) == 0
                eff = valid_lse(eff, ~np.broadcast_to(empty, eff.shape))
                lse[np.broadcast_to(empty, shape)] = np.nan  # never read
            self.lses.append((lse, total))
            self.natural.append(natural(eff, base))

    def args(self, device):
        return [device.put(m) if s is None else (device.put(m), device.put(s)) for m, s in self.lses]


def call_and_reference(rng, device, op, form, base, kw, sink):
    """(the op's result, the oracle's natural (O, LSE)) for states of `form`."""
    if op == "merge":
        st = States(rng, form, [(T, H), (T, H)], (T, 2), base, lambda v, i: v[:, i][:, None])
        o_a, o_b = random_o(rng, (T, H, D)), random_o(rng, (T, H, D))
        if st.valid is not None:
            o_a[st.valid[:, 0] == 0] = np.nan
            o_b[st.valid[:, 1] == 0] = np.nan
        la, lb = st.args(device)
        res = attnmerge.merge(device.put(o_a), la, device.put(o_b), lb, valid=valid_of(device, st), **kw)
        return res, reference_merge(o_a, st.natural[0], o_b, st.natural[1], sink=sink)
    if op == "merge_states":  # an all-gather's [S, T, H, ...]
        st = States(rng, form, [(S, T, H)], (T, S), base, lambda v, i: v.T[:, :, None])
        o = random_o(rng, (S, T, H, D))
        if st.valid is not None:
            o[st.valid.T == 0] = np.nan
        (lse,) = st.args(device)
        res = attnmerge.merge_states(device.put(o), lse, states_axis=0, valid=valid_of(device, st), **kw)
        return res, reference_merge_stacked(o, st.natural[0], states_axis=0, sink=sink)
    if op == "merge_varlen":
        indptr = np.array([0, 3, 3, 4, 9, 14, 20], np.int32)
        n = int(indptr[-1])
        st = States(rng, form, [(n, H)], (n,), base, lambda v, i: v[:, None])
        o = random_o(rng, (n, H, D))
        if st.valid is not None:
            o[st.valid == 0] = np.nan
        (lse,) = st.args(device)
        res = attnmerge.merge_varlen(device.put(o), lse, device.put(indptr), valid=valid_of(device, st), **kw)
        return res, reference_merge_varlen(o, st.natural[0], indptr, sink=sink)
    # merge_share: state 1's share; its own O NaN where it is empty
    st = States(rng, form, [(T, S, H)], (T, S), base, lambda v, i: v[:, :, None])
    o = random_o(rng, (T, H, D))
    if st.valid is not None:
        o[st.valid[:, 1] == 0] = np.nan
    (lse,) = st.args(device)
    res = attnmerge.merge_share(device.put(o), lse, 1, valid=valid_of(device, st), **kw)
    return res, reference_merge_share(o, st.natural[0], 1, sink=sink)


def valid_of(device, st):
    return None if st.valid is None else device.put(st.valid)


@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("op", OPS)
def test_every_form_with_every_option(rng, device, op, form, option):
    base = 2 if option == "bases" else "e"
    kw, sink, out_base = {}, None, base
    if option == "sink":
        sink = random_lse(rng, (H,))
        kw["sink"] = device.put(sink)
    elif option == "fp8":
        kw.update(out_dtype="float8_e4m3fn", output_scale=0.5)
    elif option == "group_fp8":
        kw["group_size"] = GROUP
    elif option in ("mxfp8", "nvfp4"):
        kw["block_format"] = option
    elif option == "bases":
        kw.update(base=2, out_base="e")
        out_base = "e"
    elif option == "no_lse":
        kw["return_lse"] = False
    elif option == "batch_invariant":
        kw["batch_invariant"] = True
    res, ref = call_and_reference(rng, device, op, form, base, kw, None if sink is None else natural(sink, base))
    want_o, want_lse = rebased(ref, out_base)
    out, out_lse = device.get(res[0]), device.get(res[1])
    if option == "fp8":
        assert_fp8_close(out, want_o, 0.5)
        assert_lse_close(out_lse, want_lse)
    elif option == "group_fp8":
        assert_group_fp8_close(out, device.get(res[2]), want_o, GROUP)
        assert_lse_close(out_lse, want_lse)
    elif option in ("mxfp8", "nvfp4"):
        assert_block_close(option, "floor", None, out, device.get(res[2]), want_o)
        assert_lse_close(out_lse, want_lse)
    elif option == "no_lse":
        assert out_lse is None
        assert_merge_matches(out, np.zeros(want_lse.shape, np.float32), (want_o, np.zeros(want_lse.shape)), "float32")
    else:
        assert_merge_matches(out, out_lse, (want_o, want_lse), "float32")


def test_the_c_abi_reads_sums_and_valid_from_its_options(rng):
    """The C ABI itself (host arrays, no Python layer): options.sum_a / sum_b hold the sums of the
    op's first / second LSE argument (which then holds maxima), options.valid the states holding
    keys; every forward op against the oracle, into NaN-poisoned outputs."""
    import c_abi

    def stats(shape):
        m, total = random_lse(rng, shape), rng.uniform(1.0, 40.0, shape).astype(np.float32)
        total[rng.random(shape) < 0.2] = 0.0
        return m, total, stats_lse(m, total)

    def run(call, out_shape, *arrays, **opts):
        out, out_lse = np.full(out_shape, np.nan, np.float32), np.full(out_shape[:2], np.nan, np.float32)
        opt = c_abi.options(**{k: c_abi.tensor_from(v) for k, v in opts.items()})
        status = call(c_abi.tensor_from(out), c_abi.tensor_from(out_lse), *arrays, opt)
        assert status == c_abi.SUCCESS, c_abi.last_error()
        return out, out_lse

    o_a, o_b = random_o(rng, (T, H, D)), random_o(rng, (T, H, D))
    (m_a, s_a, l_a), (m_b, s_b, l_b) = stats((T, H)), stats((T, H))
    valid2 = (rng.random((T, 2)) < 0.7).astype(np.uint8)
    got = run(c_abi.merge, (T, H, D), *map(c_abi.tensor_from, (o_a, m_a, o_b, m_b)), sum_a=s_a, sum_b=s_b,
              valid=valid2)
    assert_merge_matches(*got, reference_merge(o_a, valid_lse(l_a, valid2[:, :1]), o_b, valid_lse(l_b, valid2[:, 1:])),
                         "float32")

    o = random_o(rng, (T, S, H, D))
    m, total, lse = stats((T, S, H))
    lengths = rng.integers(0, 3, (T, S)).astype(np.int64)  # key counts: 0 is an empty shard
    got = run(c_abi.merge_states, (T, H, D), *map(c_abi.tensor_from, (o, m)), sum_a=total, valid=lengths)
    assert_merge_matches(*got, reference_merge_stacked(o, valid_lse(lse, lengths[:, :, None])), "float32")

    got = run(lambda out, out_lse, *a: c_abi.merge_share(out, out_lse, *a[:2], 2, a[2]), (T, H, D),
              c_abi.tensor_from(o[:, 2]), c_abi.tensor_from(m), sum_a=total, valid=lengths)
    assert_merge_matches(*got, reference_merge_share(o[:, 2], valid_lse(lse, lengths[:, :, None]), 2), "float32")

    indptr = np.array([0, 2, 2, 7, 12], np.int64)
    n = int(indptr[-1])
    ov = random_o(rng, (n, H, D))
    mv, sv, lv = stats((n, H))
    valid1 = np.array([1, 0, 1, 1, 0, 1, 1, 1, 0, 0, 1, 1], bool)
    got = run(c_abi.merge_varlen, (len(indptr) - 1, H, D), *map(c_abi.tensor_from, (ov, mv, indptr)), sum_a=sv,
              valid=valid1)
    assert_merge_matches(*got, reference_merge_varlen(ov, valid_lse(lv, valid1[:, None]), indptr), "float32")
