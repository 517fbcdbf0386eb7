"""What the exchange's entry points refuse (attnmerge_merge_exchange, attnmerge_exchange_publish,
attnmerge_exchange_status), each before anything is launched or written, by name with the expected
and the actual value: the exchange's own fields, every rank's pointers (NULL, misaligned, on the wrong
device; its sums' too), sizes that disagree, valid's shape and dtype, the slice, outputs over a rank's
state, an epoch below 0.  Stale epochs
and timeouts are the protocol's (tests/semantics/test_exchange_protocol.py)."""

from __future__ import annotations

import ctypes
import re

import numpy as np
import pytest

import c_abi
from devices import CUDA_ONLY, pointer
from exchange_ranks import Ranks, descriptor
from oracle import random_lse, random_o

WORLD, T, H, D = 3, 4, 6, 32


@pytest.fixture
def ranks(rng, device):
    o = [random_o(rng, (T, H, D), "bfloat16") for _ in range(WORLD)]
    lse = [random_lse(rng, (T, H)) for _ in range(WORLD)]
    return Ranks(device, o, lse)


@pytest.fixture
def stats_ranks(rng, device):
    """The ranks' states as softmax statistics: lse their maxima, exchange.sum their sums."""
    o = [random_o(rng, (T, H, D), "bfloat16") for _ in range(WORLD)]
    m = [random_lse(rng, (T, H)) for _ in range(WORLD)]
    sums = [rng.uniform(0.5, 2.0, (T, H)).astype(np.float32) for _ in range(WORLD)]
    return Ranks(device, o, m, sums=sums)


def outputs(ranks, heads=2, tokens=T, head_size=D):
    return ranks.dev.nan((tokens, heads, head_size), "bfloat16"), ranks.dev.nan((tokens, heads))


def merge(ranks, x, out, out_lse, slice=c_abi.SLICE_HEADS, begin=0, epoch=0, opts=None):
    out_t = descriptor(out, ranks.device_id)
    lse_t = None if out_lse is None else descriptor(out_lse, ranks.device_id)
    return c_abi.merge_exchange(out_t, lse_t, x, slice, begin, epoch, opts, ranks.stream(0))


def refused(ranks, status, message, out=None, code=c_abi.ERROR_VALUE):
    got = c_abi.last_error()
    assert status == code, got
    assert (re.fullmatch(message, got) if isinstance(message, re.Pattern) else got == message), got
    if out is not None:
        assert np.isnan(ranks.dev.get(out).astype(np.float32)).all()  # nothing written
    assert ranks.status(0)[0] == c_abi.SUCCESS  # nothing recorded either


def with_entry(x, field, index, value):
    """x with entry `index` of its array `field` replaced (a copy of the array)."""
    entries = [getattr(x, field)[i] for i in range(x.world_size)]
    entries[index] = value
    array = (ctypes.c_void_p * len(entries))(*entries)
    setattr(x, "_" + field, array)
    setattr(x, field, ctypes.cast(array, ctypes.POINTER(ctypes.c_void_p)))
    return x


# --------------------------------------------------------------------------------------------------
# the exchange's own fields


EXCHANGE_FIELDS = {
    "NULL": (lambda x: None, "exchange: expected the ranks of an exchange, got NULL"),
    "struct_size": (lambda x: setattr(x, "struct_size", 7) or x,
                    f"exchange.struct_size: expected 0 or {ctypes.sizeof(c_abi.Exchange)} (sizeof(attnmerge_exchange) "
                    "of attnmerge 0.2.0), got 7"),
    "no ranks": (lambda x: setattr(x, "world_size", 0) or x, "exchange.world_size: expected 1 to 72 ranks, got 0"),
    "too many ranks": (lambda x: setattr(x, "world_size", 73) or x,
                       "exchange.world_size: expected 1 to 72 ranks, got 73"),
    "rank past the ranks": (lambda x: setattr(x, "rank", 3) or x,
                            "exchange.rank: expected 0 <= rank < 3 (world_size), got 3"),
    "negative rank": (lambda x: setattr(x, "rank", -1) or x,
                      "exchange.rank: expected 0 <= rank < 3 (world_size), got -1"),
    "reuse": (lambda x: setattr(x, "reuse", 2) or x,
              "exchange.reuse: expected ATTNMERGE_EXCHANGE_WAIT_READERS (0) or ATTNMERGE_EXCHANGE_ALTERNATE (1), got 2"),
    "no timeout": (lambda x: setattr(x, "timeout_ns", 0) or x,
                   "exchange.timeout_ns: expected nanoseconds > 0 (a wait that can end), got 0"),
    "no pads": (lambda x: setattr(x, "pads", None) or x, "exchange.pads: expected 3 pointers (one per rank), got NULL"),
    "a NULL pad": (lambda x: with_entry(x, "pads", 2, None), "exchange.pads[2]: expected rank 2's pointer, got NULL"),
    "a pad misaligned": (lambda x: with_entry(x, "pads", 1, x.pads[1] + 4),
                         re.compile(r"exchange\.pads\[1\]: expected a pointer aligned to 8 bytes, got 0x[0-9a-f]+")),
}


@pytest.mark.parametrize("name", list(EXCHANGE_FIELDS))
def test_the_exchanges_own_fields_in_every_entry_point(ranks, name):
    bad, message = EXCHANGE_FIELDS[name]
    out, out_lse = outputs(ranks)
    refused(ranks, merge(ranks, bad(ranks.exchange(0)), out, out_lse), message, out)
    refused(ranks, c_abi.exchange_publish(bad(ranks.exchange(0)), 0, ranks.stream(0)), message)
    refused(ranks, c_abi.exchange_status(bad(ranks.exchange(0)), ranks.stream(0)), message)
    assert ranks.dev.get(ranks.pads[0]).sum() == 0  # nothing published


STATE_FIELDS = {
    "no states": (lambda x: setattr(x, "o", None) or x, "exchange.o: expected 3 pointers (one per rank), got NULL"),
    "no lses": (lambda x: setattr(x, "lse", None) or x, "exchange.lse: expected 3 pointers (one per rank), got NULL"),
    "a NULL state": (lambda x: with_entry(x, "o", 1, None), "exchange.o[1]: expected rank 1's pointer, got NULL"),
    "a state misaligned": (lambda x: with_entry(x, "o", 2, x.o[2] + 1),
                           re.compile(r"exchange\.o\[2\]: expected a pointer aligned to 2 bytes, got 0x[0-9a-f]+")),
    "an LSE misaligned": (lambda x: with_entry(x, "lse", 0, x.lse[0] + 2),
                          re.compile(r"exchange\.lse\[0\]: expected a pointer aligned to 4 bytes, got 0x[0-9a-f]+")),
}


@pytest.mark.parametrize("name", list(STATE_FIELDS))
def test_every_ranks_state_pointers(ranks, name):
    """The merge reads them; the publish and the status query do not (a NULL array is theirs to keep)."""
    bad, message = STATE_FIELDS[name]
    out, out_lse = outputs(ranks)
    refused(ranks, merge(ranks, bad(ranks.exchange(0)), out, out_lse), message, out)
    if name in ("no states", "no lses"):
        assert c_abi.exchange_status(bad(ranks.exchange(0)), ranks.stream(0)) == c_abi.SUCCESS


SUM_FIELDS = {
    "a NULL sum": (lambda x: with_entry(x, "sum", 1, None), "exchange.sum[1]: expected rank 1's pointer, got NULL"),
    "a sum misaligned": (lambda x: with_entry(x, "sum", 2, x.sum[2] + 2),
                         re.compile(r"exchange\.sum\[2\]: expected a pointer aligned to 4 bytes, got 0x[0-9a-f]+")),
}


@pytest.mark.parametrize("name", list(SUM_FIELDS))
def test_every_ranks_sum_pointers(stats_ranks, name):
    """exchange.sum where given (NULL: LSEs): one pointer per rank, checked as lse's are."""
    bad, message = SUM_FIELDS[name]
    out, out_lse = outputs(stats_ranks)
    refused(stats_ranks, merge(stats_ranks, bad(stats_ranks.exchange(0)), out, out_lse), message, out)


def test_sums_through_the_options_refused(ranks):
    """The ranks' sums are exchange.sum, one pointer per rank: options.sum_a (one tensor) is refused."""
    out, out_lse = outputs(ranks)
    sums = ranks.dev.put(np.ones((T, H), np.float32))
    opts = c_abi.options(sum_a=descriptor(sums, ranks.device_id))
    refused(ranks, merge(ranks, ranks.exchange(0), out, out_lse, opts=opts),
            "sum_a: expected none for this op (the sums of lse_a, or of lse of the N-way and variable-length merges "
            "and the share; the in-place merge writes its merged LSE over lse, the exchange takes its ranks' sums in "
            "exchange.sum, and the backwards take LSEs), got a tensor", out)


def test_an_output_over_a_ranks_sums(stats_ranks):
    out, _ = outputs(stats_ranks)
    out_lse = stats_ranks.sums[0][1][:, :2]  # in rank 1's sums
    refused(stats_ranks, merge(stats_ranks, stats_ranks.exchange(0), out, out_lse),
            "out_lse: expected memory apart from every rank's state, got a range overlapping exchange.sum[1]", out)


VALID = {
    "one rank too many": ((T, WORLD + 1), np.uint8, c_abi.ERROR_VALUE,
                          f"valid: expected shape [{T}, {WORLD}] (the sizes of o, shape [{T}, {H}, {D}]), "
                          f"got [{T}, {WORLD + 1}]"),
    "every token, sliced by tokens": ((T, WORLD), np.uint8, c_abi.ERROR_VALUE,
                                      f"valid: expected shape [2, {WORLD}] (the sizes of o, shape [{T}, {H}, {D}]), "
                                      f"got [{T}, {WORLD}]"),
    "float32": ((T, WORLD), np.float32, c_abi.ERROR_TYPE, None),
}


@pytest.mark.parametrize("name", list(VALID))
def test_valid_per_token_of_out_and_rank(ranks, name):
    """options.valid [tokens of out, world_size]: its shape and dtype (a mask or counts), checked as the
    merges' are."""
    shape, dtype, code, message = VALID[name]
    by_tokens = name == "every token, sliced by tokens"
    out, out_lse = outputs(ranks, heads=H, tokens=2) if by_tokens else outputs(ranks)
    valid = ranks.dev.put(np.ones(shape, dtype))
    opts = c_abi.options(valid=descriptor(valid, ranks.device_id))
    status = merge(ranks, ranks.exchange(0), out, out_lse, slice=c_abi.SLICE_TOKENS if by_tokens else c_abi.SLICE_HEADS,
                   opts=opts)
    if message is None:
        assert status == code and c_abi.last_error().startswith("valid: expected dtype"), c_abi.last_error()
        assert "float32" in c_abi.last_error()
        return
    refused(ranks, status, message, out, code=code)


# --------------------------------------------------------------------------------------------------
# sizes and the slice


def test_sizes_that_disagree(ranks):
    out, out_lse = outputs(ranks)
    x = ranks.exchange(0)
    x.lse_layout.shape[1] = H - 1
    refused(ranks, merge(ranks, x, out, out_lse), f"o and lse: expected the same number of heads, got {H} (o, shape "
                                                  f"[{T}, {H}, {D}]) and {H - 1} (lse, shape [{T}, {H - 1}])", out)
    short, short_lse = outputs(ranks, head_size=D // 2)
    refused(ranks, merge(ranks, ranks.exchange(0), short, short_lse),
            f"out: expected shape [{T}, 2, {D}] (the sizes of o, shape [{T}, {H}, {D}]), got [{T}, 2, {D // 2}]", short)
    refused(ranks, merge(ranks, ranks.exchange(0), out, ranks.dev.nan((T, 3))),
            f"out_lse: expected shape [{T}, 2] (the sizes of o, shape [{T}, {H}, {D}]), got [{T}, 3]", out)
    x = ranks.exchange(0)
    x.o_layout.dtype = c_abi.FLOAT8_E4M3
    refused(ranks, merge(ranks, x, out, out_lse), "o: expected dtype float32, float16, bfloat16 or float64, "
            "got float8_e4m3", out, code=c_abi.ERROR_TYPE)
    x = ranks.exchange(0)
    x.o_layout.dtype = x.lse_layout.dtype = c_abi.FLOAT64  # the layouts' dtypes are checked before any pointer is read
    refused(ranks, merge(ranks, x, out, out_lse), "o: expected a dtype other than float64 (the exchange merges the "
            "16- and 32-bit states of GPU engines), got float64",
            out, code=c_abi.ERROR_TYPE)


def test_the_slice(ranks):
    out, out_lse = outputs(ranks)
    refused(ranks, merge(ranks, ranks.exchange(0), out, out_lse, slice=2),
            "slice: expected ATTNMERGE_SLICE_TOKENS (0) or ATTNMERGE_SLICE_HEADS (1), got 2", out)
    refused(ranks, merge(ranks, ranks.exchange(0), out, out_lse, begin=5),
            f"slice_begin: expected 0 to {H - 2} (the states' {H} heads less the 2 of out), got 5", out)
    refused(ranks, merge(ranks, ranks.exchange(0), out, out_lse, begin=-1),
            f"slice_begin: expected 0 to {H - 2} (the states' {H} heads less the 2 of out), got -1", out)
    tokens, tokens_lse = outputs(ranks, heads=H, tokens=T - 1)
    refused(ranks, merge(ranks, ranks.exchange(0), tokens, tokens_lse, slice=c_abi.SLICE_HEADS),
            f"out: expected the {T} tokens of the states (a slice of heads takes every one), got {T - 1}", tokens)
    refused(ranks, merge(ranks, ranks.exchange(0), out, out_lse, slice=c_abi.SLICE_TOKENS),
            f"out: expected the {H} heads of the states (a slice of tokens takes every one), got 2", out)


def test_an_output_over_a_ranks_state(ranks):
    """out would overwrite what a peer reads: refused whichever rank's state it lies in."""
    x = ranks.exchange(0)
    out = ranks.o[0][2][:, :2]  # in rank 2's O
    out_lse = ranks.dev.nan((T, 2))
    refused(ranks, merge(ranks, x, out, out_lse),
            "out: expected memory apart from every rank's state, got a range overlapping exchange.o[2]")
    own_lse = ranks.lse[0][0][:, :2]
    refused(ranks, merge(ranks, x, outputs(ranks)[0], own_lse),
            "out_lse: expected memory disjoint from lse, got overlapping ranges")


def test_an_epoch_below_zero(ranks):
    out, out_lse = outputs(ranks)
    refused(ranks, merge(ranks, ranks.exchange(0), out, out_lse, epoch=-1),
            "epoch: expected an epoch >= 0 (0: the one the pad keeps), got -1", out)
    refused(ranks, c_abi.exchange_publish(ranks.exchange(0), -2, ranks.stream(0)),
            "epoch: expected an epoch >= 0 (0: the one the pad keeps), got -2")


def test_no_group_scales(ranks):
    out, out_lse = outputs(ranks)
    scales = ranks.dev.nan((T, 2, 1))
    opts = c_abi.options(group_scales=descriptor(scales, ranks.device_id), group_size=32)
    status = merge(ranks, ranks.exchange(0), out, out_lse, opts=opts)
    assert status == c_abi.ERROR_VALUE and c_abi.last_error().startswith("group_scales: expected none for this op")


# --------------------------------------------------------------------------------------------------
# devices


def test_device_memory_on_the_host_path(ranks):
    """A rank's state in GPU memory, handed to a host exchange: refused where CUDA can tell."""
    if ranks.on_gpu or c_abi.load().attnmerge_device_count() == 0:
        pytest.skip("a host exchange on a machine with a GPU")
    import torch

    gpu = torch.zeros(T * H * D, dtype=torch.bfloat16, device="cuda")
    out, out_lse = outputs(ranks)
    refused(ranks, merge(ranks, with_entry(ranks.exchange(0), "o", 1, gpu.data_ptr()), out, out_lse),
            "exchange.o[1]: expected host memory (device -1), got memory of CUDA device 0", out)


@pytest.mark.parametrize("device", CUDA_ONLY, indirect=True)
@pytest.mark.parametrize("field", ("o", "lse", "pads", "sum"))
def test_host_memory_on_a_gpu(stats_ranks, device, field):
    """A rank's pointer into host memory (pageable or pinned), handed to a GPU exchange."""
    device.gpu_only()
    torch = device.torch
    ranks = stats_ranks
    for host in (np.zeros(T * H * D, np.float32), torch.zeros(T * H * D, pin_memory=True)):
        x = with_entry(ranks.exchange(0), field, 1, pointer(host))
        out, out_lse = outputs(ranks)
        want = (f"exchange.{field}[1]: expected memory of CUDA device {ranks.device_id} or of a peer it can access, "
                f"got host memory")
        if field == "pads":
            refused(ranks, c_abi.exchange_publish(x, 0, ranks.stream(0)), want)
        refused(ranks, merge(ranks, x, out, out_lse), want, out)


@pytest.mark.parametrize("device", CUDA_ONLY, indirect=True)
def test_memory_of_a_device_that_is_not_a_peer(ranks, device):
    """A rank's state on another GPU that this one cannot access as a peer."""
    device.gpu_only()
    torch = device.torch
    if torch.cuda.device_count() < 2:
        pytest.skip("one GPU")
    if torch.cuda.can_device_access_peer(ranks.device_id, 1 - ranks.device_id):
        pytest.skip("the GPUs are peers")
    other = torch.zeros(T * H * D, dtype=torch.bfloat16, device=f"cuda:{1 - ranks.device_id}")
    x = with_entry(ranks.exchange(0), "o", 1, other.data_ptr())
    out, out_lse = outputs(ranks)
    refused(ranks, merge(ranks, x, out, out_lse),
            f"exchange.o[1]: expected memory of CUDA device {ranks.device_id} or of a peer it can access, got memory of "
            f"device {1 - ranks.device_id}, which device {ranks.device_id} cannot access", out)
