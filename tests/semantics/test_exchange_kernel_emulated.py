"""The exchange's GPU kernels' logic, on the CPU: tests/native/exchange_emulator.cpp runs the library's
plan (plan_exchange), launchers and kernels (attnmerge/exchange_kernels.cuh, the installed header) as
host C++, each block's threads as fibers that meet at the kernels' barriers in the orders
tests/emulators.py sets, and the ranks' kernels on threads of their own, so that a kernel's waits are
met by the other ranks' launches.  Held to the float64 oracle with the GPU tests' tolerances, and to
the same bits in every order of a block's threads: one chunk of states and several (more than 8
ranks), 16-byte and one-element accesses, slices of heads and of tokens, grids of one block and of
many (the last block's count), sinks, LSE bases, output dtypes (FP8 scaled); and the protocol as the
kernels run it: epochs from the pad, both reuses, stale epochs and timeouts recorded in the pad as
attnmerge_exchange_status (the library's, reading the same pads on the host) words them, a failure
that stays until cleared.  (What it cannot check: the device's instructions and memory order; the
`gpu` tests of test_merge_exchange.py and test_exchange_protocol.py do.)
"""

from __future__ import annotations

import ctypes
import threading

import numpy as np
import pytest

import c_abi
from emulators import CODES, ORDERS, build, check, order
from exchange_ranks import descriptor
from oracle import (assert_fp8_close, assert_merge_matches, fp8_dtype, nan_array, random_lse, random_o,
                    reference_merge_states, sink_state, stats_lse, valid_lse)

I64P = ctypes.POINTER(ctypes.c_int64)
LONG_NS = 30 * 10**9
SHORT_NS = 30 * 10**6


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    lib = build("exchange_emulator.cpp", tmp_path_factory)
    lib.emulate_merge_exchange.argtypes = (
        [ctypes.c_int64] * 3 + [ctypes.c_int] * 5 + [ctypes.c_float, ctypes.c_void_p] + [ctypes.c_void_p, I64P] * 2 +
        [ctypes.c_void_p, I64P, ctypes.c_void_p, I64P] + [ctypes.c_int] * 2 + [ctypes.c_int64] * 2 +
        [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int] +
        [ctypes.c_void_p, ctypes.c_void_p, I64P, ctypes.c_int])
    lib.emulate_exchange_publish.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_uint64]
    return lib


def strides(x):
    return (ctypes.c_int64 * x.ndim)(*(s // x.itemsize for s in x.strides))


class Group:
    """`world` ranks' states (NumPy, one layout) and zeroed pads, on the host."""

    def __init__(self, o, lse, sums=None):
        self.o, self.lse, self.sums = o, lse, sums  # sums: softmax sums (lse the maxima); None: LSEs
        self.world = len(o)
        words = c_abi.load().attnmerge_exchange_pad_bytes(self.world) // 8
        self.pads = [np.zeros(words, np.uint64) for _ in range(self.world)]
        self.pad_ptrs = (ctypes.c_void_p * self.world)(*(p.ctypes.data for p in self.pads))
        self.o_ptrs = (ctypes.c_void_p * self.world)(*(x.ctypes.data for x in o))
        self.lse_ptrs = (ctypes.c_void_p * self.world)(*(x.ctypes.data for x in lse))
        self.sum_ptrs = None if sums is None else (ctypes.c_void_p * self.world)(*(x.ctypes.data for x in sums))
        self.plans = {}  # rank: (vec, blocks, threads per block) of its last merge

    def publish(self, emu, rank, epoch=0):
        check(emu, emu.emulate_exchange_publish(self.pad_ptrs, rank, self.world, epoch))

    def merge(self, emu, rank, out, out_lse, token0=0, head0=0, *, vec=None, sms=0, bases=0, inv_scale=1.0,
              scale=None, sink=None, epoch=0, timeout_ns=LONG_NS, reuse=c_abi.WAIT_READERS, how=0, valid=None):
        """Rank `rank`'s merge into out (its rows offset by token0, head0), valid [tokens of out, world]
        where given; its cudaError_t."""
        order(emu, how, rank)
        in_size = self.o[0].itemsize
        vec = (16 // in_size) if vec is None else vec
        keep = [strides(x) for x in (out, self.o[0], self.lse[0])] + ([strides(out_lse)] if out_lse is not None else [])
        status = emu.emulate_merge_exchange(
            *out.shape, CODES[self.o[0].dtype.name], CODES[out.dtype.name], vec, sms, bases, inv_scale,
            None if scale is None else scale.ctypes.data, out.ctypes.data, keep[0],
            None if out_lse is None else out_lse.ctypes.data, keep[3] if out_lse is not None else None,
            self.o_ptrs, keep[1], self.lse_ptrs, keep[2], self.world, rank, token0, head0,
            None if sink is None else sink.ctypes.data, 1, self.pad_ptrs, epoch, timeout_ns, reuse, self.sum_ptrs,
            None if valid is None else valid.ctypes.data, None if valid is None else strides(valid),
            0 if valid is None else valid.itemsize)
        fields = (ctypes.c_int64 * 3)()
        emu.emulate_exchange_plan(fields)  # this thread's
        self.plans[rank] = tuple(fields)
        return status

    def status(self, rank):
        """The library's attnmerge_exchange_status of these host pads: (status, message)."""
        layout = descriptor(self.o[0], c_abi.HOST)
        x = c_abi.exchange(rank, [a.ctypes.data for a in self.o], [a.ctypes.data for a in self.lse],
                           [p.ctypes.data for p in self.pads], layout, descriptor(self.lse[0], c_abi.HOST))
        return c_abi.exchange_status(x), c_abi.last_error()


def together(fns):
    """fns called at once, each on a thread of its own; their results."""
    results = [None] * len(fns)

    def run(i):
        results[i] = fns[i]()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def group(rng, world, tokens, heads, head_size, dtype="float32"):
    return Group([random_o(rng, (tokens, heads, head_size), dtype) for _ in range(world)],
                 [random_lse(rng, (tokens, heads)) for _ in range(world)])


def heads_slices(heads, world):
    size = heads // world
    return [(r * size, size) for r in range(world)]


def exchange(emu, g, slices, out_dtype=None, *, how=0, with_lse=True, **kw):
    """Every rank's publish, then its merge of its heads' slice, all at once: [(out, out_lse)]."""
    tokens, _, head_size = g.o[0].shape
    outs = [nan_array((tokens, n, head_size), out_dtype or g.o[0].dtype) for _, n in slices]
    out_lses = [nan_array((tokens, n)) if with_lse else None for _, n in slices]

    def rank(r):
        return lambda: (g.publish(emu, r), g.merge(emu, r, outs[r], out_lses[r], 0, slices[r][0], how=how, **kw))[1]

    for r, status in enumerate(together([rank(r) for r in range(g.world)])):
        check(emu, status)
        status, message = g.status(r)
        assert status == c_abi.SUCCESS, message
    return list(zip(outs, out_lses))


def reference(g, begin, extent, base="e", sink=None):
    os = [x[:, begin:begin + extent] for x in g.o]
    ls = [x[:, begin:begin + extent] for x in g.lse]
    if sink is not None:
        so, sl = sink_state(sink, os[0].shape[0], os[0].shape[2])
        os, ls = os + [so], ls + [sl]
    return reference_merge_states(os, ls, base=base)


# --------------------------------------------------------------------------------------------------
# the rows


@pytest.mark.parametrize("world, dtype, head_size, vec", (
    (1, "float32", 64, None), (3, "bfloat16", 128, None), (4, "float16", 40, 1), (9, "bfloat16", 64, None),
    (12, "float32", 16, 1)), ids=("one rank", "three", "unaligned", "two chunks", "two chunks, one element"))
def test_every_rank_merges_its_slice_the_same_in_every_order(emu, rng, world, dtype, head_size, vec):
    g = group(rng, world, 5, world, head_size, dtype)
    if world > 8:
        g.lse[-1][:] += 30.0  # the second chunk raises the max: the first chunk's sums are rescaled
    slices = heads_slices(world, world)
    first = None
    for how in ORDERS:
        for pad in g.pads:
            pad[:] = 0  # a fresh exchange
        result = exchange(emu, g, slices, how=how, vec=vec)
        for (begin, extent), (out, out_lse) in zip(slices, result):
            assert_merge_matches(out, out_lse, reference(g, begin, extent), dtype)
        bits = [(o.tobytes(), lse.tobytes()) for o, lse in result]
        assert first is None or bits == first, f"order {how}: other bits"
        first = bits


@pytest.mark.parametrize("sms", (0, 132))
def test_grids_of_many_blocks_count_their_last(emu, rng, sms):
    """Rows over several blocks (blocks of 256 threads, or narrower to spread over 132 SMs): every
    block waits and merges its rows, the last to arrive resets the count and signals; twice, so that
    the count starts from 0 again."""
    g = group(rng, 2, 33, 4, 128, "bfloat16")
    slices = heads_slices(4, 2)
    for step in range(2):
        for r in range(2):
            g.o[r][...] = random_o(rng, g.o[r].shape, "bfloat16")
        result = exchange(emu, g, slices, sms=sms)
        assert all(blocks > 1 for _, blocks, _ in g.plans.values()), g.plans
        for (begin, extent), (out, out_lse) in zip(slices, result):
            assert_merge_matches(out, out_lse, reference(g, begin, extent), "bfloat16", what=f"step {step}: out")
    for pad in g.pads:
        assert pad[1] == 0  # kArrivals: reset by each merge's last block


def test_a_rank_with_no_rows_still_takes_its_part(emu, rng):
    """A rank whose slice is empty launches one block that reads nothing but signals, so that its
    peers (ATTNMERGE_EXCHANGE_WAIT_READERS) are not kept waiting."""
    g = group(rng, 3, 4, 5, 16)
    slices = [(0, 3), (3, 0), (3, 2)]
    result = exchange(emu, g, slices)
    assert g.plans[1][1:] == (1, 256)  # one block
    for (begin, extent), (out, out_lse) in zip(slices, result):
        if extent:
            assert_merge_matches(out, out_lse, reference(g, begin, extent), "float32")
    assert all(list(pad[11:14]) == [1, 1, 1] for pad in g.pads)  # every rank read every rank's state


def test_empty_parts_and_nan_rows(emu, rng):
    g = group(rng, 3, 4, 3, 32)
    g.o[1][:] = np.nan
    g.lse[1][:] = -np.inf
    g.lse[2][0] = np.inf
    g.lse[0][1, 1] = np.nan
    for r in range(3):
        g.lse[r][3] = np.inf
    (out, out_lse), = exchange(emu, g, [(0, 3)] + [(0, 0)] * 2)[:1]
    assert_merge_matches(out, out_lse, reference(g, 0, 3), "float32")
    assert (out[3] == 0).all() and (out_lse[3] == -np.inf).all()
    assert np.isnan(out[1, 1]).all() and not np.isnan(out[0]).any()


def test_slices_of_tokens(emu, rng):
    g = group(rng, 2, 6, 3, 16, "float16")
    outs = [nan_array((3, 3, 16), "float16") for _ in range(2)]
    lses = [nan_array((3, 3)) for _ in range(2)]
    for r in range(2):
        g.publish(emu, r)
    statuses = together([lambda r=r: g.merge(emu, r, outs[r], lses[r], 3 * r, 0) for r in range(2)])
    for r in range(2):
        check(emu, statuses[r])
        ref = reference_merge_states([x[3 * r:3 * r + 3] for x in g.o], [x[3 * r:3 * r + 3] for x in g.lse])
        assert_merge_matches(outs[r], lses[r], ref, "float16")


@pytest.mark.parametrize("world, vec, slice", ((3, None, "heads"), (10, None, "heads"), (10, 1, "tokens"),
                                               (4, 1, "heads")),
                         ids=("one chunk", "two chunks", "two chunks by tokens, one element", "one element"))
def test_softmax_statistics_and_valid_ranks_the_same_in_every_order(emu, rng, world, vec, slice):
    """Every rank's (max, sum) (a sum of 0: empty whatever the max holds) and valid [tokens of out,
    world] (0: the rank holds no keys for the token, its O and max garbage): each rank taken one at a
    time, its LSE settled before its O is read, the same bits in every order of a block's threads."""
    tokens, heads, d = (6, world, 32) if slice == "heads" else (2 * world, 3, 32)  # two rows of the axis a rank
    o = [random_o(rng, (tokens, heads, d), "bfloat16") for _ in range(world)]
    m = [random_lse(rng, (tokens, heads)) for _ in range(world)]
    sums = [rng.uniform(0.25, 4.0, (tokens, heads)).astype(np.float32) for _ in range(world)]
    sums[1][0] = 0.0
    m[1][0] = np.nan  # the max of no scores
    m[world - 1][:] += 30.0  # the last chunk raises the max
    valid = (rng.random((tokens, world)) < 0.7).astype(np.uint8)
    valid[2] = 0  # no rank holds keys: O = 0, LSE = -inf
    for p in range(world):
        bad = valid[:, p] == 0
        o[p][bad] = np.nan
        m[p][bad] = np.nan
    g = Group(o, m, sums)
    lse = [valid_lse(stats_lse(m[p], sums[p]), valid[:, p, None]) for p in range(world)]
    share = (heads if slice == "heads" else tokens) // world
    slices = [(r * share, share) for r in range(world)]
    first = None
    for how in ORDERS:
        for pad in g.pads:
            pad[:] = 0
        if slice == "heads":
            result = exchange(emu, g, slices, how=how, vec=vec, valid=valid)
        else:
            outs = [nan_array((share, heads, d), "bfloat16") for _ in range(world)]
            lses = [nan_array((share, heads)) for _ in range(world)]
            for r in range(world):
                g.publish(emu, r)
            statuses = together([lambda r=r: g.merge(emu, r, outs[r], lses[r], r * share, 0, vec=vec, how=how,
                                                     valid=valid[r * share:(r + 1) * share]) for r in range(world)])
            for status in statuses:
                check(emu, status)
            result = list(zip(outs, lses))
        for (begin, extent), (out, out_lse) in zip(slices, result):
            cut = (lambda x: x[:, begin:begin + extent]) if slice == "heads" else (lambda x: x[begin:begin + extent])
            assert_merge_matches(out, out_lse, reference_merge_states([cut(x) for x in o], [cut(x) for x in lse]),
                                 "bfloat16")
            if begin <= 2 < begin + extent or slice == "heads":  # the token no rank holds keys for
                row = 2 if slice == "heads" else 2 - begin
                assert (out[row] == 0).all() and (out_lse[row] == -np.inf).all()
        bits = [(x.tobytes(), y.tobytes()) for x, y in result]
        assert first is None or bits == first, f"order {how}: other bits"
        first = bits


def test_sinks_bases_and_an_output_without_lse(emu, rng):
    g = group(rng, 2, 4, 4, 32)
    sinks = [random_lse(rng, (2,)) for _ in range(2)]
    outs = [nan_array((4, 2, 32)) for _ in range(2)]
    lses = [nan_array((4, 2)), None]
    bases = c_abi.LSE_BASE2 | c_abi.OUT_LSE_BASE_E
    for r in range(2):
        g.publish(emu, r)
    statuses = together([lambda r=r: g.merge(emu, r, outs[r], lses[r], 0, 2 * r, bases=bases, sink=sinks[r])
                         for r in range(2)])
    for r in range(2):
        check(emu, statuses[r])
        ref_o, ref_lse = reference(g, 2 * r, 2, base=2, sink=sinks[r])
        assert_merge_matches(outs[r], lses[r], (ref_o, ref_lse * np.log(2.0)), "float32")
    assert lses[1] is None


@pytest.mark.parametrize("in_memory", (False, True))
@pytest.mark.parametrize("out_dtype", ("float32", "float16", "bfloat16", "float8_e4m3fn"))
def test_every_output_dtype_from_one_kernel(emu, rng, out_dtype, in_memory):
    """The output dtype is read at run time by the kernel of the input's dtype; FP8 scaled."""
    g = group(rng, 2, 3, 2, 64, "bfloat16")
    fp8 = out_dtype == "float8_e4m3fn"
    scale = np.array([0.5], np.float32)
    kw = dict(scale=scale) if fp8 and in_memory else dict(inv_scale=2.0 if fp8 else 1.0)
    result = exchange(emu, g, heads_slices(2, 2), fp8_dtype() if fp8 else out_dtype, **kw)
    for (begin, extent), (out, out_lse) in zip(heads_slices(2, 2), result):
        ref_o, ref_lse = reference(g, begin, extent)
        if fp8:
            assert_fp8_close(out, ref_o, scale=0.5)
        else:
            assert_merge_matches(out, out_lse, (ref_o, ref_lse), out_dtype)


# --------------------------------------------------------------------------------------------------
# the protocol as the kernels run it


@pytest.mark.parametrize("reuse", (c_abi.WAIT_READERS, c_abi.ALTERNATE))
def test_epochs_from_the_pad_step_after_step(emu, rng, reuse):
    g = group(rng, 3, 2, 3, 16)
    for step in range(1, 4):
        for r in range(3):
            g.o[r][...] = random_o(rng, g.o[r].shape)
        result = exchange(emu, g, heads_slices(3, 3), reuse=reuse)
        for r, (out, out_lse) in enumerate(result):
            assert_merge_matches(out, out_lse, reference(g, r, 1), "float32")
        for pad in g.pads:
            assert pad[0] == step  # kPublished
            assert list(pad[8:11]) == [step] * 3  # ready slots
            assert list(pad[11:14]) == ([step] * 3 if reuse == c_abi.WAIT_READERS else [0] * 3)  # done slots


def test_a_stale_epoch_is_recorded_and_nothing_written(emu, rng):
    g = group(rng, 1, 2, 1, 8)
    g.publish(emu, 0, 4)
    g.publish(emu, 0, 4)  # stale: recorded, nothing published
    assert g.status(0) == (c_abi.ERROR_VALUE,
                           "epoch: expected an epoch newer than 4 (the last rank 0 published), got 4 (stale)")
    out, out_lse = nan_array((2, 1, 8)), nan_array((2, 1))
    check(emu, g.merge(emu, 0, out, out_lse, epoch=3))
    assert g.status(0) == (c_abi.ERROR_VALUE, "epoch: expected 4 (the last epoch rank 0 published), got 3 (stale)")
    assert np.isnan(out).all() and np.isnan(out_lse).all()
    check(emu, g.merge(emu, 0, out, out_lse, epoch=4))
    assert_merge_matches(out, out_lse, reference(g, 0, 1), "float32")


@pytest.mark.parametrize("reuse", (c_abi.WAIT_READERS, c_abi.ALTERNATE))
def test_a_rank_that_never_publishes_is_recorded_and_the_failure_stays(emu, rng, reuse):
    g = group(rng, 2, 3, 2, 16)
    out, out_lse = nan_array((3, 1, 16)), nan_array((3, 1))
    g.publish(emu, 0)
    check(emu, g.merge(emu, 0, out, out_lse, 0, 0, timeout_ns=SHORT_NS, reuse=reuse, sms=132))
    assert np.isnan(out).all()
    want = (f"exchange: rank 0 waited {SHORT_NS} ns for rank 1 to publish epoch 1 and gave up (its ready slot held "
            f"epoch 0)")
    assert g.pads[0][1] == 0  # the count reset, whatever the blocks' verdicts
    # recorded: the next merge does nothing, even now that rank 1 has published
    g.publish(emu, 1)
    check(emu, g.merge(emu, 0, out, out_lse, 0, 0, timeout_ns=SHORT_NS, reuse=reuse))
    assert np.isnan(out).all()
    assert g.status(0) == (c_abi.ERROR_TIMEOUT, want)
    assert g.status(0)[0] == c_abi.SUCCESS  # cleared


def test_a_rank_that_never_reads_is_recorded_after_the_merge(emu, rng):
    g = group(rng, 2, 3, 2, 16)
    out, out_lse = nan_array((3, 1, 16)), nan_array((3, 1))
    g.publish(emu, 0)
    g.publish(emu, 1)
    check(emu, g.merge(emu, 0, out, out_lse, 0, 0, timeout_ns=SHORT_NS))
    assert_merge_matches(out, out_lse, reference(g, 0, 1), "float32")
    assert g.status(0) == (c_abi.ERROR_TIMEOUT, f"exchange: rank 0 waited {SHORT_NS} ns for rank 1 to read its state "
                                                f"of epoch 1 and gave up (its done slot held epoch 0)")
    assert g.pads[1][10 + 0] == 1  # rank 0 told rank 1 it has read its state (done slot of rank 0 in rank 1's pad)
