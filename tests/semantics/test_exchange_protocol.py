"""The exchange's protocol (attnmerge.h, "Context parallelism on one node"), on every device: ranks
simulated in one process (tests/exchange_ranks.py), threads on the host, streams on one GPU.

- step after step, each rank writes its state again once the protocol says it may (after its merge
  with ATTNMERGE_EXCHANGE_WAIT_READERS, into the other of two buffers with _ALTERNATE), and every
  step merges that step's states, however far the ranks drift apart;
- epochs given, or taken from the pad (0), and captured in a CUDA graph that replays step after step;
- a merge waits for a publish that comes after it;
- a stale epoch is refused (on the host, by the call) or recorded (on the GPU, by the kernel, and
  returned by attnmerge_exchange_status);
- a rank that never publishes makes its peers give up after their timeout, each naming it and the
  epoch, never hang; the failure stays until attnmerge_exchange_status clears it.
"""

from __future__ import annotations

import random
import threading
import time

import numpy as np
import pytest

import c_abi
from exchange_ranks import Ranks
from oracle import assert_merge_matches, random_lse, random_o, reference_merge_states

WORLD, T, H, D = 3, 4, 6, 32
SHORT_NS = 50 * 10**6  # a timeout the tests wait out


def step_states(rng, steps, world=WORLD, dtype="float32"):
    """[step][rank] (o, lse), none of two steps alike."""
    return [[(random_o(rng, (T, H, D), dtype), random_lse(rng, (T, H))) for _ in range(world)] for _ in range(steps)]


def step_reference(states, begin, extent):
    o = [x[:, begin:begin + extent] for x, _ in states]
    lse = [x[:, begin:begin + extent] for _, x in states]
    return reference_merge_states(o, lse)


def outputs(dev, world=WORLD, heads=H // WORLD):
    return [dev.nan((T, heads, D)) for _ in range(world)], [dev.nan((T, heads)) for _ in range(world)]


def begins(world=WORLD, heads=H // WORLD):
    return [r * heads for r in range(world)]


# --------------------------------------------------------------------------------------------------
# step after step


def host_steps(ranks, states, reuse, epochs):
    """Every rank on a thread of its own through every step, none waiting for another between steps
    but through the exchange (random pauses make them drift): write its state (into buffer e % 2
    under _ALTERNATE, once its merge of e - 1 has returned), publish, merge.  [step][rank] (out, out_lse)."""
    results = [[None] * ranks.world for _ in states]
    errors = []

    def rank_loop(r):
        pause = random.Random(r)
        heads = H // ranks.world
        for e, step in enumerate(states):
            buffer = e % 2 if reuse == c_abi.ALTERNATE else 0
            ranks.write(r, *step[r], buffer=buffer)
            time.sleep(pause.random() * 0.002)
            out, out_lse = np.full((T, heads, D), np.nan, np.float32), np.full((T, heads), np.nan, np.float32)
            epoch = epochs[e]
            statuses = (ranks.publish(r, epoch, buffer),
                        ranks.merge(r, out, out_lse, c_abi.SLICE_HEADS, r * heads, epoch, None, buffer))
            if statuses != (c_abi.SUCCESS, c_abi.SUCCESS):
                errors.append((r, e, statuses, c_abi.last_error()))
                return
            results[e][r] = (out, out_lse)

    threads = [threading.Thread(target=rank_loop, args=(r,)) for r in range(ranks.world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return results


def gpu_steps(ranks, states, reuse, epochs):
    """Every step enqueued on the ranks' streams without a host wait between steps: each rank writes
    its state (into buffer e % 2 under _ALTERNATE) and publishes; each rank's merge waits for every
    rank's publish of the step (events), so that no merge spins while a publish waits for an SM."""
    dev, torch = ranks.dev, ranks.torch
    heads = H // ranks.world
    outs = [[(dev.nan((T, heads, D)), dev.nan((T, heads))) for _ in range(ranks.world)] for _ in states]
    for e, step in enumerate(states):
        buffer = e % 2 if reuse == c_abi.ALTERNATE else 0
        events = []
        for r in range(ranks.world):
            ranks.write(r, *step[r], buffer=buffer)
            assert ranks.publish(r, epochs[e], buffer) == c_abi.SUCCESS, c_abi.last_error()
            events.append(torch.cuda.Event())
            events[-1].record(ranks.streams[r])
        for r in range(ranks.world):
            for event in events:
                ranks.streams[r].wait_event(event)
            status = ranks.merge(r, *outs[e][r], c_abi.SLICE_HEADS, r * heads, epochs[e], None, buffer)
            assert status == c_abi.SUCCESS, c_abi.last_error()
    torch.cuda.synchronize()
    return [[(dev.get(o), dev.get(lse)) for o, lse in step] for step in outs]


@pytest.mark.parametrize("epochs", ("given", "from the pad"))
@pytest.mark.parametrize("reuse", (c_abi.WAIT_READERS, c_abi.ALTERNATE), ids=("wait_readers", "alternate"))
def test_every_step_merges_its_own_states(rng, device, reuse, epochs):
    steps = 6
    states = step_states(rng, steps)
    epoch_of = [e + 1 for e in range(steps)] if epochs == "given" else [0] * steps
    ranks = Ranks(device, *zip(*states[0]), reuse=reuse, buffers=2 if reuse == c_abi.ALTERNATE else 1)
    results = (gpu_steps if ranks.on_gpu else host_steps)(ranks, states, reuse, epoch_of)
    heads = H // WORLD
    for e in range(steps):
        for r in range(WORLD):
            assert_merge_matches(*results[e][r], step_reference(states[e], r * heads, heads), "float32",
                                 what=f"step {e}, rank {r}: out")
    for r in range(WORLD):
        assert ranks.status(r)[0] == c_abi.SUCCESS


def test_a_merge_waits_for_a_publish_that_comes_after_it(rng, device):
    """Rank 1 publishes (then merges) some time after every other rank has begun to merge: theirs wait
    for it.  On a GPU the merges are small enough to leave SMs for rank 1's publish, enqueued on its
    stream after them."""
    (step,) = step_states(rng, 1)
    ranks = Ranks(device, *zip(*step), timeout_ns=10 * 10**9)
    outs, out_lses = outputs(device)
    late = 1
    statuses = {}

    def merge(r):
        statuses[r] = ranks.merge(r, outs[r], out_lses[r], c_abi.SLICE_HEADS, begins()[r])

    early = [r for r in range(WORLD) if r != late]
    for r in early:
        assert ranks.publish(r) == c_abi.SUCCESS
    threads = [threading.Thread(target=merge, args=(r,)) for r in early]
    for t in threads:
        t.start()
        if ranks.on_gpu:
            t.join()  # enqueued: the merges spin on the GPU
    time.sleep(0.05)
    assert ranks.publish(late) == c_abi.SUCCESS
    merge(late)
    for t in threads:
        t.join()
    if ranks.on_gpu:
        ranks.torch.cuda.synchronize()
    assert statuses == {r: c_abi.SUCCESS for r in range(WORLD)}
    for r in range(WORLD):
        assert ranks.status(r)[0] == c_abi.SUCCESS
        assert_merge_matches(device.get(outs[r]), device.get(out_lses[r]), step_reference(step, 2 * r, 2), "float32")


def test_captured_in_a_cuda_graph_replays_step_after_step(rng, device):
    """Epoch 0 (from the pad): every rank's publish and merge captured once, on the ranks' streams
    forked from the capture's, each merge after every publish; each replay is the next step.  The
    descriptors vouch for their devices (ATTNMERGE_DEVICE_KNOWN), as a framework's binding does."""
    device.gpu_only()
    torch = device.torch
    steps = 3
    states = step_states(rng, steps)
    ranks = Ranks(device, *zip(*states[0]), known=True)
    outs, out_lses = outputs(device)
    graph = torch.cuda.CUDAGraph()
    capture = torch.cuda.Stream()
    with torch.cuda.graph(graph, stream=capture):
        published = []
        for r in range(WORLD):
            ranks.streams[r].wait_stream(capture)
            assert ranks.publish(r) == c_abi.SUCCESS, c_abi.last_error()
            published.append(torch.cuda.Event())
            published[-1].record(ranks.streams[r])
        for r in range(WORLD):
            for event in published:
                ranks.streams[r].wait_event(event)
            assert ranks.merge(r, outs[r], out_lses[r], c_abi.SLICE_HEADS, begins()[r]) == c_abi.SUCCESS
            capture.wait_stream(ranks.streams[r])
    for e in range(steps):
        for r in range(WORLD):
            ranks.write(r, *states[e][r])
            outs[r].fill_(float("nan"))
        torch.cuda.synchronize()
        graph.replay()
        torch.cuda.synchronize()
        for r in range(WORLD):
            assert_merge_matches(device.get(outs[r]), device.get(out_lses[r]), step_reference(states[e], 2 * r, 2),
                                 "float32", what=f"replay {e}, rank {r}: out")
    for r in range(WORLD):
        assert ranks.status(r)[0] == c_abi.SUCCESS
        assert int(device.get(ranks.pads[r])[0]) == steps  # the last epoch published, kept in the pad


# --------------------------------------------------------------------------------------------------
# stale epochs


def refused_or_recorded(ranks, rank, status, message):
    """A stale epoch: refused by the call on the host; on the GPU the call succeeds, the kernel
    records it, and the status query returns it (and clears it)."""
    if ranks.on_gpu:
        assert status == c_abi.SUCCESS, c_abi.last_error()
        status, got = ranks.status(rank)
        assert status == c_abi.ERROR_VALUE and got == message
    else:
        assert status == c_abi.ERROR_VALUE and c_abi.last_error() == message
    assert ranks.status(rank)[0] == c_abi.SUCCESS  # nothing (more) recorded


def test_a_stale_publish(rng, device):
    (step,) = step_states(rng, 1)
    ranks = Ranks(device, *zip(*step))
    assert ranks.publish(0, 3) == c_abi.SUCCESS
    refused_or_recorded(ranks, 0, ranks.publish(0, 3),
                        "epoch: expected an epoch newer than 3 (the last rank 0 published), got 3 (stale)")
    refused_or_recorded(ranks, 0, ranks.publish(0, 2),
                        "epoch: expected an epoch newer than 3 (the last rank 0 published), got 2 (stale)")
    assert ranks.publish(0) == c_abi.SUCCESS  # 4, from the pad
    assert int(ranks.dev.get(ranks.pads[0])[0]) == 4


@pytest.mark.parametrize("epoch, message", (
    (0, "epoch: expected an epoch rank 0 has published, got 0 and it has published none"),
    (1, "epoch: expected 0 (the last epoch rank 0 published), got 1 (not published yet)")))
def test_a_merge_before_any_publish(rng, device, epoch, message):
    (step,) = step_states(rng, 1)
    ranks = Ranks(device, *zip(*step))
    outs, out_lses = outputs(device)
    status = ranks.merge(0, outs[0], out_lses[0], c_abi.SLICE_HEADS, 0, epoch)
    refused_or_recorded(ranks, 0, status, message)
    assert np.isnan(device.get(outs[0])).all()  # nothing written


def test_a_merge_of_an_older_epoch(rng, device):
    (step,) = step_states(rng, 1)
    ranks = Ranks(device, *zip(*step))
    outs, out_lses = outputs(device)
    assert ranks.publish(0, 5) == c_abi.SUCCESS
    status = ranks.merge(0, outs[0], out_lses[0], c_abi.SLICE_HEADS, 0, 4)
    refused_or_recorded(ranks, 0, status, "epoch: expected 5 (the last epoch rank 0 published), got 4 (stale)")
    assert np.isnan(device.get(outs[0])).all()


# --------------------------------------------------------------------------------------------------
# a rank that never publishes


@pytest.mark.parametrize("reuse", (c_abi.WAIT_READERS, c_abi.ALTERNATE), ids=("wait_readers", "alternate"))
def test_a_rank_that_never_publishes_is_reported_not_waited_for(rng, device, reuse):
    """Rank 2 never publishes: ranks 0 and 1 give up after their timeout, each naming rank 2 and the
    epoch, and stay failed (their calls do nothing) until the status query clears the record."""
    (step,) = step_states(rng, 1)
    ranks = Ranks(device, *zip(*step), timeout_ns=SHORT_NS, reuse=reuse)
    outs, out_lses = outputs(device)
    start = time.monotonic()
    result = ranks.step(outs, out_lses, c_abi.SLICE_HEADS, begins(), ranks=[0, 1])
    assert time.monotonic() - start < 30  # not hung
    for r in (0, 1):
        want = (f"exchange: rank {r} waited {SHORT_NS} ns for rank 2 to publish epoch 1 and gave up (its ready slot "
                f"held epoch 0)")
        publish, merge, message = result[r]
        assert publish == c_abi.SUCCESS
        if ranks.on_gpu:
            assert merge == c_abi.SUCCESS  # found by the kernel
        else:
            assert (merge, message) == (c_abi.ERROR_TIMEOUT, want)
            # a later call returns the failure recorded, and does nothing
            outs[r][...] = np.nan
            assert ranks.merge(r, outs[r], out_lses[r], c_abi.SLICE_HEADS, begins()[r]) == c_abi.ERROR_TIMEOUT
            assert c_abi.last_error() == want
        assert ranks.status(r) == (c_abi.ERROR_TIMEOUT, want)
        assert ranks.status(r)[0] == c_abi.SUCCESS  # cleared
        assert np.isnan(device.get(outs[r])).all()


def test_a_rank_that_never_merges_is_reported_by_the_ranks_it_keeps_waiting(rng, device):
    """ATTNMERGE_EXCHANGE_WAIT_READERS: every rank publishes, rank 2 never merges: ranks 0 and 1 merge
    their rows, then give up waiting for rank 2 to read their states, naming it."""
    (step,) = step_states(rng, 1)
    ranks = Ranks(device, *zip(*step), timeout_ns=SHORT_NS)
    outs, out_lses = outputs(device)
    for r in range(WORLD):
        assert ranks.publish(r) == c_abi.SUCCESS
    if ranks.on_gpu:
        ranks.torch.cuda.synchronize()  # every publish done before the merges, which wait with their blocks
    result = ranks.step(outs, out_lses, c_abi.SLICE_HEADS, begins(), ranks=[0, 1], publish=[])
    for r in (0, 1):
        want = (f"exchange: rank {r} waited {SHORT_NS} ns for rank 2 to read its state of epoch 1 and gave up (its "
                f"done slot held epoch 0)")
        if not ranks.on_gpu:
            assert result[r][1:] == (c_abi.ERROR_TIMEOUT, want)
        assert ranks.status(r) == (c_abi.ERROR_TIMEOUT, want)
        assert_merge_matches(device.get(outs[r]), device.get(out_lses[r]), step_reference(step, 2 * r, 2), "float32")
