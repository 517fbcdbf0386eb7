"""batch_invariant=True: a row's output and LSE bits depend only on that row's inputs and the call's
options, never on the number of rows, the row's position, the kernel the launch plan picks for them
or the GPU's size.  Row r of a batch is bit-identical to row r merged alone, for every forward op
and dtype, over row counts that cross the plan's switch points (the state-parallel kernel of decode
sizes, the chunk of a variable-length merge), on every device.  The GPU's bits are not the CPU's
(the GPU takes the hardware's exp2 and log2): each device is compared with itself."""
from __future__ import annotations

import numpy as np
import pytest

import attnmerge
from oracle import DTYPES, random_lse, random_o

TOKENS = (1, 2, 16, 64, 256)  # with 8 heads: 8 to 2048 rows
STATES = (2, 5, 16, 64)
HEADS, HEAD_SIZE = 8, 64


def bits(device, x):
    return np.asarray(device.get(x)).view(np.uint8)


def rows_alone_equal(device, run, tokens, picks):
    """run(sl) merges the rows of tokens `sl` (a slice); each of `picks` alone must give the bits the
    whole batch gave it."""
    out, out_lse = run(slice(0, tokens))
    whole_o, whole_lse = bits(device, out), bits(device, out_lse)
    for t in picks:
        one_o, one_lse = run(slice(t, t + 1))
        assert np.array_equal(bits(device, one_o), whole_o[t:t + 1]), t
        assert np.array_equal(bits(device, one_lse), whole_lse[t:t + 1]), t


def picks_of(tokens):
    return sorted({0, tokens // 2, tokens - 1})


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("states", STATES)
@pytest.mark.parametrize("tokens", TOKENS)
def test_merge_states_row_bits_do_not_depend_on_the_batch(rng, device, dtype, states, tokens):
    o, lse = random_o(rng, (tokens, states, HEADS, HEAD_SIZE), dtype), random_lse(rng, (tokens, states, HEADS))
    lse[rng.random(lse.shape) < 0.1] = -np.inf
    o_d, lse_d = device.put(o), device.put(lse)

    def run(sl):
        return attnmerge.merge_states(o_d[sl], lse_d[sl], batch_invariant=True)

    rows_alone_equal(device, run, tokens, picks_of(tokens))
    if getattr(device, "on_gpu", False):  # the plan kept the row kernel
        assert attnmerge.last_launch()["kernel"] != "states"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", TOKENS)
def test_merge_varlen_row_bits_do_not_depend_on_the_batch(rng, device, dtype, tokens):
    counts = rng.integers(0, 12, tokens)  # rows of 0 to 11 states: the mean moves with the batch
    counts[tokens // 2] = 7  # a row the chunk of 4 would split and the chunk of 8 would not
    indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    total = int(indptr[-1])
    o, lse = random_o(rng, (total, HEADS, HEAD_SIZE), dtype), random_lse(rng, (total, HEADS))
    o_d, lse_d = device.put(o), device.put(lse)

    def run(sl):
        a, b = int(indptr[sl.start]), int(indptr[sl.stop])
        ind = device.put(indptr[sl.start:sl.stop + 1] - a)
        return attnmerge.merge_varlen(o_d[a:b], lse_d[a:b], ind, batch_invariant=True)

    rows_alone_equal(device, run, tokens, picks_of(tokens))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", TOKENS)
def test_the_two_state_ops_row_bits_do_not_depend_on_the_batch(rng, device, dtype, tokens):
    o_a, o_b = (random_o(rng, (tokens, HEADS, HEAD_SIZE), dtype) for _ in range(2))
    lse_a, lse_b = (random_lse(rng, (tokens, HEADS)) for _ in range(2))
    lses = random_lse(rng, (tokens, 16, HEADS))
    d = [device.put(x) for x in (o_a, lse_a, o_b, lse_b, lses)]

    def merged(sl):
        return attnmerge.merge(d[0][sl], d[1][sl], d[2][sl], d[3][sl], batch_invariant=True)

    def shared(sl):
        return attnmerge.merge_share(d[0][sl], d[4][sl], 3, batch_invariant=True)

    def in_place(sl):
        o, lse = device.put(o_a[sl]), device.put(lse_a[sl])
        return attnmerge.merge_inplace(o, lse, d[2][sl], d[3][sl], batch_invariant=True)

    for run in (merged, shared, in_place):
        rows_alone_equal(device, run, tokens, picks_of(tokens))


def test_batch_invariant_takes_true_or_false_only(rng, device):
    o, lse = random_o(rng, (2, 3, 2, 16)), random_lse(rng, (2, 3, 2))
    with pytest.raises(TypeError, match="^batch_invariant: expected True or False, got 'yes'"):
        attnmerge.merge_states(device.put(o), device.put(lse), batch_invariant="yes")
