"""attnmerge.Exchange, the exchange fused with the merge, from Python: ranks simulated in one process
(threads on the host, one CUDA stream each on one GPU), each merging its slice of every rank's
state; the slices together are merge_states of the gathered states bit for bit, step after step;
states as softmax statistics and ranks with no keys (valid) as merge_states takes them; a rank that
never publishes makes its peers' waits give up as TimeoutError, naming it; bad arguments are refused
by name."""
from __future__ import annotations

import threading

import numpy as np
import pytest

import attnmerge
from oracle import random_lse, random_o

T, H, D = 6, 8, 32


def host_ranks(rng, world, reuse="wait_readers", buffers=1, timeout=20.0):
    os_ = [[random_o(rng, (T, H, D)) for _ in range(world)] for _ in range(buffers)]
    lses = [[random_lse(rng, (T, H)) for _ in range(world)] for _ in range(buffers)]
    pads = [np.zeros(attnmerge.exchange_pad_bytes(world) // 8, np.int64) for _ in range(world)]
    xs = [[attnmerge.Exchange(os_[b][r], lses[b][r], os_[b], lses[b], pads, r, reuse=reuse, timeout=timeout)
           for r in range(world)] for b in range(buffers)]
    return os_, lses, xs


def on_threads(world, step):
    results, errors = [None] * world, []

    def run(r):
        try:
            results[r] = step(r)
        except Exception as e:  # noqa: BLE001 - reported below, with its rank
            errors.append((r, e))

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, errors


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("slice", ["heads", "tokens"])
def test_the_slices_together_are_merge_states_of_the_gathered_states(rng, world, slice):
    os_, lses, xs = host_ranks(rng, world)
    if slice == "tokens" and T % world:
        pytest.skip("tokens not a multiple of the ranks")
    for epoch in (1, 2, 3):  # step after step, the states rewritten between steps
        for r in range(world):
            os_[0][r][...] = random_o(rng, (T, H, D))
            lses[0][r][...] = random_lse(rng, (T, H))
        results, errors = on_threads(world, lambda r: (xs[0][r].publish(epoch),
                                                       xs[0][r].merge(epoch=epoch, slice=slice))[1])
        assert not errors, errors
        want_o, want_lse = attnmerge.merge_states(np.stack(os_[0], 1), np.stack(lses[0], 1))
        axis = 1 if slice == "heads" else 0
        assert np.array_equal(np.concatenate([o for o, _ in results], axis), want_o)
        assert np.array_equal(np.concatenate([lse for _, lse in results], axis), want_lse)


@pytest.mark.parametrize("slice", ["heads", "tokens"])
def test_softmax_statistics_and_valid_as_merge_states_takes_them(rng, slice):
    """Every rank's (max, sum) where its LSE goes, and valid [tokens of out, world] (KV lengths, 0
    for a rank with no keys for the token): the slices together are merge_states of the gathered
    statistics with the same valid, bit for bit."""
    world = 2
    os_ = [random_o(rng, (T, H, D)) for _ in range(world)]
    stats = [(random_lse(rng, (T, H)), rng.uniform(0.5, 3.0, (T, H)).astype(np.float32)) for _ in range(world)]
    stats[1][1][4] = 0.0  # an empty part whatever its max
    lengths = rng.integers(0, 3, (T, world)).astype(np.int32)
    lengths[0] = 0  # no rank holds keys for token 0
    for p in range(world):
        os_[p][lengths[:, p] == 0] = np.nan
    pads = [np.zeros(attnmerge.exchange_pad_bytes(world) // 8, np.int64) for _ in range(world)]
    xs = [attnmerge.Exchange(os_[r], stats[r], os_, stats, pads, r) for r in range(world)]
    share = (H if slice == "heads" else T) // world
    mine = [lengths if slice == "heads" else lengths[r * share:(r + 1) * share] for r in range(world)]
    results, errors = on_threads(world, lambda r: (xs[r].publish(1),
                                                   xs[r].merge(epoch=1, slice=slice, valid=mine[r]))[1])
    assert not errors, errors
    gathered = (np.stack([m for m, _ in stats], 1), np.stack([s for _, s in stats], 1))
    want_o, want_lse = attnmerge.merge_states(np.stack(os_, 1), gathered, valid=lengths)
    axis = 1 if slice == "heads" else 0
    assert np.array_equal(np.concatenate([o for o, _ in results], axis), want_o)
    assert np.array_equal(np.concatenate([lse for _, lse in results], axis), want_lse)
    assert (want_o[0] == 0).all() and (want_lse[0] == -np.inf).all()


def test_statistics_refused_unless_every_rank_gives_them(rng):
    o, m, s = random_o(rng, (T, H, D)), random_lse(rng, (T, H)), np.ones((T, H), np.float32)
    pads = [np.zeros(attnmerge.exchange_pad_bytes(2) // 8, np.int64) for _ in range(2)]
    with pytest.raises(TypeError, match=r"^peers_lse\[1\]: expected a \(max, sum\) tuple as lse is, got ndarray"):
        attnmerge.Exchange(o, (m, s), [o, o], [(m, s), m], pads, 0)
    with pytest.raises(TypeError, match=r"^peers_lse\[0\]: expected an array or an int pointer as lse is"):
        attnmerge.Exchange(o, m, [o, o], [(m, s), m], pads, 0)
    with pytest.raises(ValueError, match=r"^lse\[1\]: expected the layout of lse\[0\]"):
        attnmerge.Exchange(o, (m, np.ones((T, H + 1), np.float32)[:, :H]), [o, o], [(m, s), (m, s)], pads, 0)


def test_alternate_buffers_and_epochs_from_the_pad(rng):
    world = 2
    os_, lses, xs = host_ranks(rng, world, reuse="alternate", buffers=2)
    for epoch in (1, 2, 3, 4):
        b = epoch % 2
        results, errors = on_threads(world, lambda r: (xs[b][r].publish(0), xs[b][r].merge(epoch=0))[1])
        assert not errors, errors
        want = attnmerge.merge_states(np.stack(os_[b], 1), np.stack(lses[b], 1))[0]
        assert np.array_equal(np.concatenate([o for o, _ in results], 1), want)


def test_a_rank_that_never_publishes_times_out_by_name(rng):
    _, _, xs = host_ranks(rng, 2, timeout=0.05)
    xs[0][0].publish(1)
    with pytest.raises(TimeoutError, match="rank 0 waited 50000000 ns for rank 1 to publish epoch 1"):
        xs[0][0].merge(epoch=1)


def test_bad_arguments_are_refused_by_name(rng):
    o, lse = random_o(rng, (T, H, D)), random_lse(rng, (T, H))
    pads = [np.zeros(attnmerge.exchange_pad_bytes(2) // 8, np.int64) for _ in range(2)]
    with pytest.raises(ValueError, match="^reuse: expected 'wait_readers' or 'alternate', got 'never'"):
        attnmerge.Exchange(o, lse, [o, o], [lse, lse], pads, 0, reuse="never")
    with pytest.raises(ValueError, match="^timeout: expected seconds > 0, got 0"):
        attnmerge.Exchange(o, lse, [o, o], [lse, lse], pads, 0, timeout=0)
    with pytest.raises(TypeError, match="^peers_o: expected an array or an int pointer, got str"):
        attnmerge.Exchange(o, lse, ["x", o], [lse, lse], pads, 0)
    with pytest.raises(ValueError, match="^world_size: expected 1 to 72, got 0"):
        attnmerge.exchange_pad_bytes(0)
    x = attnmerge.Exchange(o, lse, [o, o], [lse, lse], pads, 0)
    with pytest.raises(ValueError, match="^slice: expected 'heads' or 'tokens', got 'rows'"):
        x.merge(slice="rows")


@pytest.mark.gpu
def test_ranks_on_one_gpu_streams(rng):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    world = 4
    os_ = [torch.from_numpy(random_o(rng, (T, H, D))).cuda().to(torch.bfloat16) for _ in range(world)]
    lses = [torch.from_numpy(random_lse(rng, (T, H))).cuda() for _ in range(world)]
    pads = [torch.zeros(attnmerge.exchange_pad_bytes(world) // 8, dtype=torch.int64, device="cuda")
            for _ in range(world)]
    xs = [attnmerge.Exchange(os_[r], lses[r], os_, lses, pads, r) for r in range(world)]
    streams = [torch.cuda.Stream() for _ in range(world)]
    torch.cuda.synchronize()
    events = []
    for r in range(world):  # every publish before any merge: a waiting merge keeps its SMs
        with torch.cuda.stream(streams[r]):
            xs[r].publish(1)
            events.append(torch.cuda.Event())
            events[-1].record()
    outs = []
    for r in range(world):
        with torch.cuda.stream(streams[r]):
            for e in events:
                streams[r].wait_event(e)
            outs.append(xs[r].merge(epoch=1))
    torch.cuda.synchronize()
    for x in xs:
        x.status()
    want_o, want_lse = attnmerge.merge_states(torch.stack(os_, 1), torch.stack(lses, 1))
    # the GPU's kernels need not round alike (the host's are bit-identical: above)
    torch.testing.assert_close(torch.cat([o for o, _ in outs], 1).float(), want_o.float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(torch.cat([lse for _, lse in outs], 1), want_lse, rtol=1e-6, atol=1e-6)
