"""Sizes from device memory.  The live number of tokens: every forward op takes `num_tokens`, a
one-element int32 or int64 array on the arrays' device, with the arrays sized for a capacity (a
CUDA graph captured once at that capacity serves every batch up to it).

    merge(..., num_tokens=n), merge_inplace(..., num_tokens=n), merge_states(..., num_tokens=n),
    merge_varlen(..., num_tokens=n)  (its rows), merge_share(..., num_tokens=n)

Rows of tokens below the count are the oracle's; rows at or past it read nothing and write nothing:
every output there keeps what it held, bit for bit (here the NaN poison; the in-place merge's o and
lse their inputs).  A count above the capacity is taken as the capacity, one below 0 as 0.  Outputs
the call allocates have the capacity's tokens.  The kernels' paths with a live count:
test_forward_kernel_emulated.py; a captured graph replayed at other counts: interop/test_cuda_graphs.py.

The two-way merge's a_tokens: a one-element int32 or int64 array where the int goes, read by the
kernel (rows of tokens past it take b alone and never read a, which has every token), clamped to
[0, tokens]; the same bits as the int form.
"""

from __future__ import annotations

import numpy as np
import pytest

import attnmerge
from oracle import (assert_merge_matches, random_lse, random_o, random_pair, random_stacked, reference_merge,
                    reference_merge_share, reference_merge_stacked, reference_merge_varlen)

CAPACITY = 11
# (the count written, the rows it leaves live): none, one, some, every one, past the capacity, below 0
COUNTS = ((0, 0), (1, 1), (6, 6), (CAPACITY, CAPACITY), (CAPACITY + 20, CAPACITY), (-3, 0))
COUNT_IDS = ("zero", "one", "some", "capacity", "above_capacity", "negative")


def count_array(device, n, dtype):
    return device.put(np.array([n], dtype=dtype))


def assert_live_rows(device, outs, refs, before, live, dtype="float32"):
    """Rows below `live` match the oracle; rows at or past it hold the bits they held (`before`)."""
    out, out_lse = (device.get(x) for x in outs)
    assert_merge_matches(out[:live], out_lse[:live], (refs[0][:live], refs[1][:live]), dtype)
    for got, held in zip((out, out_lse), before):
        np.testing.assert_array_equal(got[live:].view(np.uint8), np.asarray(held)[live:].view(np.uint8),
                                      err_msg="a row past the live count was written")


@pytest.mark.parametrize("count_dtype", ("int32", "int64"))
@pytest.mark.parametrize("count,live", COUNTS, ids=COUNT_IDS)
def test_merge_merges_the_live_tokens_alone(rng, device, count, live, count_dtype):
    t, h, d = CAPACITY, 3, 40
    o_a, lse_a, o_b, lse_b = random_pair(rng, t, h, d)
    ref = reference_merge(o_a, lse_a, o_b, lse_b)
    out, out_lse = device.nan((t, h, d)), device.nan((t, h))
    attnmerge.merge(*(device.put(x) for x in (o_a, lse_a, o_b, lse_b)), out=out, out_lse=out_lse,
                    num_tokens=count_array(device, count, count_dtype))
    assert_live_rows(device, (out, out_lse), ref, (np.full((t, h, d), np.nan, np.float32),
                                                   np.full((t, h), np.nan, np.float32)), live)


@pytest.mark.parametrize("count,live", COUNTS, ids=COUNT_IDS)
def test_merge_with_a_tokens_and_a_live_count(rng, device, count, live):
    t, h, d, a = CAPACITY, 2, 32, 4
    o_a, lse_a, o_b, lse_b = random_pair(rng, t, h, d)
    ref = reference_merge(o_a, lse_a, o_b, lse_b, a_tokens=a)
    out, out_lse = device.nan((t, h, d)), device.nan((t, h))
    attnmerge.merge(device.put(o_a[:a]), device.put(lse_a[:a]), device.put(o_b), device.put(lse_b), a_tokens=a,
                    out=out, out_lse=out_lse, num_tokens=count_array(device, count, "int32"))
    assert_live_rows(device, (out, out_lse), ref, (np.full((t, h, d), np.nan, np.float32),
                                                   np.full((t, h), np.nan, np.float32)), live)


@pytest.mark.parametrize("count,live", COUNTS, ids=COUNT_IDS)
def test_merge_inplace_leaves_the_rows_past_the_count_as_they_were(rng, device, count, live):
    t, h, d = CAPACITY, 3, 64
    o, lse, o_other, lse_other = random_pair(rng, t, h, d)
    ref = reference_merge(o, lse, o_other, lse_other)
    do, dlse = device.put(o), device.put(lse)
    attnmerge.merge_inplace(do, dlse, device.put(o_other), device.put(lse_other),
                            num_tokens=count_array(device, count, "int64"))
    assert_live_rows(device, (do, dlse), ref, (o, lse), live)


@pytest.mark.parametrize("count,live", COUNTS, ids=COUNT_IDS)
def test_merge_inplace_masked_with_a_live_count(rng, device, count, live):
    t, h, d = CAPACITY, 2, 16
    o, lse, o_other, lse_other = random_pair(rng, t, h, d)
    mask = (np.arange(t) % 3 != 1).astype(np.uint8)
    ref_o, ref_lse = reference_merge(o, lse, o_other, lse_other)
    ref_o[mask == 0], ref_lse[mask == 0] = o[mask == 0], lse[mask == 0]
    do, dlse = device.put(o), device.put(lse)
    attnmerge.merge_inplace(do, dlse, device.put(o_other), device.put(lse_other), mask=device.put(mask),
                            num_tokens=count_array(device, count, "int32"))
    assert_live_rows(device, (do, dlse), (ref_o, ref_lse), (o, lse), live)


@pytest.mark.parametrize("states_axis", (0, 1))
@pytest.mark.parametrize("s", (2, 3, 64))  # the two-way kernels, kRows, and decode sizes (kStates on a GPU)
@pytest.mark.parametrize("count,live", COUNTS, ids=COUNT_IDS)
def test_merge_states_merges_the_live_tokens_alone(rng, device, count, live, s, states_axis):
    t, h, d = CAPACITY, 2, 64
    o, lse = random_stacked(rng, t, s, h, d, states_axis=states_axis)
    ref = reference_merge_stacked(o, lse, states_axis=states_axis)
    out, out_lse = device.nan((t, h, d)), device.nan((t, h))
    attnmerge.merge_states(device.put(o), device.put(lse), states_axis=states_axis, out=out, out_lse=out_lse,
                           num_tokens=count_array(device, count, "int32"))
    assert_live_rows(device, (out, out_lse), ref, (np.full((t, h, d), np.nan, np.float32),
                                                   np.full((t, h), np.nan, np.float32)), live)


@pytest.mark.parametrize("count,live", COUNTS, ids=COUNT_IDS)
def test_merge_varlen_merges_the_live_rows_alone(rng, device, count, live):
    counts = np.array([3, 0, 1, 5, 2, 2, 7, 1, 0, 4, 3])  # CAPACITY rows, two of them empty
    indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    total, h, d = int(indptr[-1]), 3, 32
    o, lse = random_o(rng, (total, h, d)), random_lse(rng, (total, h))
    ref = reference_merge_varlen(o, lse, indptr)
    out, out_lse = device.nan((CAPACITY, h, d)), device.nan((CAPACITY, h))
    attnmerge.merge_varlen(device.put(o), device.put(lse), device.put(indptr), out=out, out_lse=out_lse,
                           num_tokens=count_array(device, count, "int64"))
    assert_live_rows(device, (out, out_lse), ref, (np.full((CAPACITY, h, d), np.nan, np.float32),
                                                   np.full((CAPACITY, h), np.nan, np.float32)), live)


@pytest.mark.parametrize("s", (3, 40))
@pytest.mark.parametrize("count,live", COUNTS, ids=COUNT_IDS)
def test_merge_share_shares_the_live_tokens_alone(rng, device, count, live, s):
    t, h, d, index = CAPACITY, 2, 48, 1
    o, lse = random_o(rng, (t, h, d)), random_lse(rng, (t, s, h))
    ref = reference_merge_share(o, lse, index)
    out, out_lse = device.nan((t, h, d)), device.nan((t, h))
    attnmerge.merge_share(device.put(o), device.put(lse), index, out=out, out_lse=out_lse,
                          num_tokens=count_array(device, count, "int32"))
    assert_live_rows(device, (out, out_lse), ref, (np.full((t, h, d), np.nan, np.float32),
                                                   np.full((t, h), np.nan, np.float32)), live)


def test_allocated_outputs_have_the_capacity(rng, device):
    """Outputs the call allocates are sized for the capacity (the count is never read on the host);
    the live rows are the oracle's."""
    t, s, h, d = CAPACITY, 4, 2, 32
    o, lse = random_stacked(rng, t, s, h, d)
    ref = reference_merge_stacked(o, lse)
    out, out_lse = attnmerge.merge_states(device.put(o), device.put(lse), num_tokens=count_array(device, 5, "int32"))
    assert tuple(out.shape) == (t, h, d) and tuple(out_lse.shape) == (t, h)
    # the live rows alone: the rows past the count are uninitialised memory (compute-sanitizer's
    # initcheck reports a copy that reads them)
    got, got_lse = device.get(out[:5]), device.get(out_lse[:5])
    assert_merge_matches(got, got_lse, (ref[0][:5], ref[1][:5]), "float32")


def test_a_live_count_changes_nothing_for_a_full_batch(rng, device):
    """At the capacity, the same bits as a call without a count."""
    t, h, d = CAPACITY, 3, 40
    o_a, lse_a, o_b, lse_b = (device.put(x) for x in random_pair(rng, t, h, d, "bfloat16"))
    plain = attnmerge.merge(o_a, lse_a, o_b, lse_b)
    counted = attnmerge.merge(o_a, lse_a, o_b, lse_b, num_tokens=count_array(device, t, "int64"))
    for x, y in zip(plain, counted):
        np.testing.assert_array_equal(np.asarray(device.get(x)).view(np.uint8),
            np.asarray(device.get(y)).view(np.uint8))


# --------------------------------------------------------------------------------------------------
# the two-way merge's a_tokens from device memory


@pytest.mark.parametrize("count_dtype", ("int32", "int64"))
@pytest.mark.parametrize("count,k", COUNTS, ids=COUNT_IDS)
def test_merge_takes_a_tokens_from_memory(rng, device, count, k, count_dtype):
    """a_tokens as a one-element array: rows of the first k tokens merge a with b, the others are
    b's alone and never read a (its rows there are NaN, which would poison them); o_a and lse_a
    have every token.  The count is clamped to [0, tokens]."""
    t, h, d = CAPACITY, 3, 40
    o_a, lse_a, o_b, lse_b = random_pair(rng, t, h, d)
    ref = reference_merge(o_a, lse_a, o_b, lse_b, a_tokens=k)
    o_a[k:], lse_a[k:] = np.nan, np.nan
    out, out_lse = attnmerge.merge(*(device.put(x) for x in (o_a, lse_a, o_b, lse_b)),
                                   a_tokens=count_array(device, count, count_dtype))
    assert_merge_matches(device.get(out), device.get(out_lse), ref, "float32")


def test_a_tokens_from_memory_with_a_live_count(rng, device):
    t, h, d, k, n = CAPACITY, 2, 32, 4, 7
    o_a, lse_a, o_b, lse_b = random_pair(rng, t, h, d, "bfloat16")
    ref = reference_merge(o_a, lse_a, o_b, lse_b, a_tokens=k)
    out, out_lse = device.nan((t, h, d), "bfloat16"), device.nan((t, h))
    attnmerge.merge(*(device.put(x) for x in (o_a, lse_a, o_b, lse_b)), out=out, out_lse=out_lse,
                    a_tokens=count_array(device, k, "int32"), num_tokens=count_array(device, n, "int64"))
    got, got_lse = device.get(out), device.get(out_lse)
    assert_merge_matches(got[:n], got_lse[:n], (ref[0][:n], ref[1][:n]), "bfloat16")
    assert np.isnan(got_lse[n:]).all() and np.isnan(got[n:].astype(np.float32)).all()


def test_a_tokens_from_memory_is_the_int_forms_bits(rng, device):
    t, h, d, k = CAPACITY, 3, 64, 5
    x = [device.put(v) for v in random_pair(rng, t, h, d, "float16")]
    by_int = attnmerge.merge(*x, a_tokens=k)
    by_array = attnmerge.merge(*x, a_tokens=count_array(device, k, "int64"))
    for p, q in zip(by_int, by_array):
        np.testing.assert_array_equal(np.asarray(device.get(p)).view(np.uint8),
                                      np.asarray(device.get(q)).view(np.uint8))
