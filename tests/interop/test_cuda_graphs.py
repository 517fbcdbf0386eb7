"""CUDA graphs: every GPU op is captured by torch.cuda.graph and its replays read the inputs (and an
FP8 scale, and the live number of tokens) as they are at replay, giving the oracle's results.

GPU-only: each test takes the `cuda` device of the device fixture (tests/devices.py; marked `gpu`)
and skips under ATTNMERGE_TEST_CUDA_AS=cpu.  (torch.ops' graphs: interop/test_torch_ops.py; PDL
launches in a graph: semantics/test_launch_options.py.)
"""

from __future__ import annotations

import numpy as np
import pytest

import attnmerge
import devices
from oracle import (
    assert_fp8_close,
    assert_merge_matches,
    assert_o_close,
    random_pair,
    random_stacked,
    random_state,
    reference_merge,
    reference_merge_stacked,
    reference_merge_varlen,
)

pytestmark = pytest.mark.parametrize("device", devices.CUDA_ONLY, indirect=True)


@pytest.fixture
def torch(device):
    device.gpu_only()
    return device.torch


def _capture(torch, fn):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # warm-up off the default stream, as torch recommends
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graph_capture_and_replay(rng, device, torch, dtype):
    h = random_pair(rng, 100, 8, 128, dtype)
    o_a, lse_a, o_b, lse_b = [device.put(x) for x in h]
    out, out_lse = device.nan(h[0].shape, dtype), device.nan(h[1].shape)
    g = _capture(torch, lambda: attnmerge.merge(o_a, lse_a, o_b, lse_b, out=out, out_lse=out_lse))
    for step in range(3):
        h2 = random_pair(rng, 100, 8, 128, dtype)
        h2[1][step] = np.inf  # an empty row, a NaN row
        h2[3][step + 5, 0] = np.nan
        for dev, host in zip((o_a, lse_a, o_b, lse_b), h2):
            dev.copy_(device.put(host))
        out.fill_(float("nan"))
        out_lse.fill_(float("nan"))
        g.replay()
        assert_merge_matches(device.get(out), device.get(out_lse), reference_merge(*h2), dtype)


def test_cuda_graph_capture_with_allocated_outputs(rng, device, torch):
    h = random_pair(rng, 50, 4, 64)
    d = [device.put(x) for x in h]
    attnmerge.merge(*d)  # warm-up
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out, out_lse = attnmerge.merge(*d)
    h2 = random_pair(rng, 50, 4, 64)
    for dev, host in zip(d, h2):
        dev.copy_(device.put(host))
    g.replay()
    assert_merge_matches(device.get(out), device.get(out_lse), reference_merge(*h2), "float32")


@pytest.mark.parametrize("states_axis", (0, 1))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graph_capture_of_merge_states(rng, device, torch, dtype, states_axis):
    t, s, h, d = 100, 8, 8, 128
    o0, lse0 = random_stacked(rng, t, s, h, d, dtype, states_axis)
    o, lse = device.put(o0), device.put(lse0)
    out, out_lse = device.nan((t, h, d), dtype), device.nan((t, h))
    g = _capture(torch, lambda: attnmerge.merge_states(o, lse, out=out, out_lse=out_lse, states_axis=states_axis))
    for step in range(3):
        o1, lse1 = random_stacked(rng, t, s, h, d, dtype, states_axis)
        lse1[(slice(None),) * states_axis + (step,)] = np.inf  # an empty part
        lse1.reshape(-1)[step * 7] = np.nan  # a NaN row
        o.copy_(device.put(o1))
        lse.copy_(device.put(lse1))
        out.fill_(float("nan"))
        out_lse.fill_(float("nan"))
        g.replay()
        assert_merge_matches(device.get(out), device.get(out_lse),
                             reference_merge_stacked(o1, lse1, states_axis=states_axis), dtype)


def test_cuda_graph_capture_of_fp8_merge_states_reads_the_scale_at_replay(rng, device, torch):
    o0, lse0 = random_stacked(rng, 64, 4, 4, 128, "float16")
    o, lse = device.put(o0), device.put(lse0)
    out = device.nan((64, 4, 128), "float8_e4m3fn")
    scale = device.put(np.array([1.0], np.float32))
    g = _capture(torch, lambda: attnmerge.merge_states(o, lse, out=out, output_scale=scale))
    ref_o = reference_merge_stacked(o0, lse0)[0]
    for sv in (0.5, 3.0):
        scale.fill_(sv)
        g.replay()
        assert_fp8_close(device.get(out), ref_o, sv)


def test_cuda_graph_capture_of_varlen_and_inplace(rng, device, torch):
    indptr = device.put(np.array([0, 2, 2, 7, 8], np.int32))
    o0, lse0 = random_state(rng, 8, 4, 64)
    o, lse = device.put(o0), device.put(lse0)
    out, out_lse = device.nan((4, 4, 64)), device.nan((4, 4))
    acc0, acc_lse0 = random_state(rng, 8, 4, 64)
    acc, acc_lse = device.put(acc0), device.put(acc_lse0)
    mask = np.array([1, 0, 1, 1, 0, 1, 1, 1], np.uint8)
    dmask = device.put(mask)

    def step():
        attnmerge.merge_varlen(o, lse, indptr, out=out, out_lse=out_lse)
        attnmerge.merge_inplace(acc, acc_lse, o, lse, mask=dmask)

    g = _capture(torch, step)  # the warm-up ran the in-place merge once already
    acc.copy_(device.put(acc0))
    acc_lse.copy_(device.put(acc_lse0))
    out.fill_(float("nan"))
    g.replay()
    assert_merge_matches(device.get(out), device.get(out_lse),
                         reference_merge_varlen(o0, lse0, np.array([0, 2, 2, 7, 8])), "float32")
    on = mask != 0
    ref = reference_merge(acc0, acc_lse0, o0, lse0)
    assert_o_close(device.get(acc)[on], ref[0][on], "float32", "o")
    assert np.array_equal(device.get(acc)[~on], acc0[~on])


# ---- a graph captured at a capacity, replayed at the live count (num_tokens) ---------------------

CAPACITY = 256


def _bits(torch, x):
    return x.contiguous().view(torch.uint8).cpu().numpy()


def _live_case(rng, device, op):
    """(the graph's inputs and written arrays, run(n, count): the op on the capacity's arrays with
    the live count `count`, or count None: the eager op on the first n tokens alone, returning its
    results).  merge_states and merge_varlen batch-invariant: a decode-sized eager call may take the
    state-parallel kernel, whose bits the rows kernel of the capacity does not promise."""
    h, d = 8, 128
    if op in ("merge", "merge_inplace"):
        o_a, lse_a, o_b, lse_b = (device.put(x) for x in random_pair(rng, CAPACITY, h, d, "bfloat16"))
        if op == "merge":
            out, out_lse = device.nan((CAPACITY, h, d), "bfloat16"), device.nan((CAPACITY, h))

            def run(n, count):
                if count is None:
                    return attnmerge.merge(o_a[:n], lse_a[:n], o_b[:n], lse_b[:n])
                return attnmerge.merge(o_a, lse_a, o_b, lse_b, out=out, out_lse=out_lse, num_tokens=count)
            return (out, out_lse), run
        held = (o_a.clone(), lse_a.clone())

        def run(n, count):
            if count is None:
                o, lse = held[0][:n].clone(), held[1][:n].clone()
                return attnmerge.merge_inplace(o, lse, o_b[:n], lse_b[:n])
            return attnmerge.merge_inplace(o_a, lse_a, o_b, lse_b, num_tokens=count)
        return (o_a, lse_a), run, held
    if op == "merge_varlen":
        counts = rng.integers(0, 7, CAPACITY)
        indptr_h = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        o, lse = (device.put(x) for x in random_state(rng, int(indptr_h[-1]), h, d))
        indptr = device.put(indptr_h)
        out, out_lse = device.nan((CAPACITY, h, d)), device.nan((CAPACITY, h))

        def run(n, count):
            if count is None:
                return attnmerge.merge_varlen(o, lse, indptr[:n + 1], batch_invariant=True)
            return attnmerge.merge_varlen(o, lse, indptr, out=out, out_lse=out_lse, num_tokens=count,
                                          batch_invariant=True)
        return (out, out_lse), run
    s = 16
    out, out_lse = device.nan((CAPACITY, h, d)), device.nan((CAPACITY, h))
    if op == "merge_states":
        o, lse = (device.put(x) for x in random_stacked(rng, CAPACITY, s, h, d))

        def run(n, count):
            if count is None:
                return attnmerge.merge_states(o[:n], lse[:n], batch_invariant=True)
            return attnmerge.merge_states(o, lse, out=out, out_lse=out_lse, num_tokens=count, batch_invariant=True)
        return (out, out_lse), run
    o, lse = device.put(random_state(rng, CAPACITY, h, d)[0]), device.put(random_stacked(rng, CAPACITY, s, h, 1)[1])

    def run(n, count):
        if count is None:
            return attnmerge.merge_share(o[:n], lse[:n], 3)
        return attnmerge.merge_share(o, lse, 3, out=out, out_lse=out_lse, num_tokens=count)
    return (out, out_lse), run


@pytest.mark.parametrize("count_dtype", ("int32", "int64"))
@pytest.mark.parametrize("op", ("merge", "merge_inplace", "merge_states", "merge_varlen", "merge_share"))
def test_a_graph_captured_at_a_capacity_replays_at_the_live_count(rng, device, torch, op, count_dtype):
    """Captured once at 256 tokens with num_tokens on the device, replayed with 1, 17 and 256 live
    tokens written into it: the live rows are the eager call's at that size bit for bit, and every
    row past the count is untouched (the NaN poison; the in-place merge's inputs)."""
    case = _live_case(rng, device, op)
    written, run = case[0], case[1]
    held = case[2] if op == "merge_inplace" else None
    count = device.put(np.array([CAPACITY], count_dtype))
    g = _capture(torch, lambda: run(CAPACITY, count))
    for n in (1, 17, CAPACITY):
        count.fill_(n)
        for x, before in zip(written, held or (None, None)):
            if before is None:
                x.fill_(float("nan"))
            else:
                x.copy_(before)
        g.replay()
        torch.cuda.synchronize()
        eager = run(n, None)
        for x, e in zip(written, eager):
            np.testing.assert_array_equal(_bits(torch, x[:n]), _bits(torch, e), err_msg=f"{op} at {n} live tokens")
        for x, before in zip(written, held or (torch.full_like(written[0], float("nan")),
                                               torch.full_like(written[1], float("nan")))):
            np.testing.assert_array_equal(_bits(torch, x[n:]), _bits(torch, before[n:]),
                                          err_msg=f"{op}: a row past {n} live tokens was written")


@pytest.mark.parametrize("count_dtype", ("int32", "int64"))
def test_a_graph_takes_a_tokens_from_memory_at_each_replay(rng, device, torch, count_dtype):
    """The two-way merge captured once with a_tokens in device memory: each replay merges a into
    the rows of the tokens below the count written before it, bit for bit the eager merge with that
    int, and reads nothing of a past it (NaN there)."""
    o_a, lse_a, o_b, lse_b = random_pair(rng, CAPACITY, 8, 128, "bfloat16")
    x = [device.put(v) for v in (o_a, lse_a, o_b, lse_b)]
    out, out_lse = device.nan((CAPACITY, 8, 128), "bfloat16"), device.nan((CAPACITY, 8))
    count = device.put(np.array([CAPACITY], count_dtype))
    g = _capture(torch, lambda: attnmerge.merge(*x, out=out, out_lse=out_lse, a_tokens=count))
    for k in (0, 17, CAPACITY):
        count.fill_(k)
        x[0].copy_(device.put(o_a))
        x[1].copy_(device.put(lse_a))
        x[0][k:] = float("nan")
        x[1][k:] = float("nan")
        g.replay()
        torch.cuda.synchronize()
        eager = attnmerge.merge(x[0][:k], x[1][:k], x[2], x[3], a_tokens=k)
        for got, want in zip((out, out_lse), eager):
            np.testing.assert_array_equal(_bits(torch, got), _bits(torch, want), err_msg=f"a_tokens {k}")
