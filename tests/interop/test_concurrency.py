"""Concurrency: many threads calling at once give the bits of serial calls, and each thread sees
its own errors (the C ABI's last-error message is thread-local; the Python layer releases the GIL
around every call).  The CPU tests run everywhere; the GPU test gives each thread its own stream.
"""
from __future__ import annotations

import threading

import numpy as np
import pytest

import attnmerge
from oracle import nan_array, random_state

THREADS = 8
ROUNDS = 6


def run_threads(body):
    """Runs body(i) on THREADS threads released together; re-raises the first failure."""
    start = threading.Barrier(THREADS)
    errors = []

    def main(i):
        try:
            start.wait()
            body(i)
        except BaseException as e:  # noqa: BLE001 - reported to the test below
            errors.append(e)

    threads = [threading.Thread(target=main, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def cpu_inputs(rng, i):
    # thread i gets its own shape; the last one is large enough (> 16 MiB moved) for the CPU path
    # to start worker threads of its own
    tokens = 16 + 40 * i if i < THREADS - 1 else 1500
    a = random_state(rng, tokens, 8, 128 if i % 2 else 96)
    b = random_state(rng, tokens, 8, a[0].shape[2])
    return (*a, *b)


def test_threads_on_the_cpu_give_the_serial_bits(rng):
    inputs = [cpu_inputs(rng, i) for i in range(THREADS)]
    serial = [attnmerge.merge(*x) for x in inputs]
    got = [[] for _ in range(THREADS)]

    def body(i):
        for _ in range(ROUNDS):
            out = nan_array(inputs[i][0].shape)
            out_lse = nan_array(inputs[i][1].shape)
            attnmerge.merge(*inputs[i], out=out, out_lse=out_lse)
            got[i].append((out, out_lse))

    run_threads(body)
    for i in range(THREADS):
        for out, out_lse in got[i]:
            np.testing.assert_array_equal(out, serial[i][0])
            np.testing.assert_array_equal(out_lse, serial[i][1])


def test_each_thread_sees_its_own_error(rng):
    # Even threads pass a bad out_lse, odd threads a bad lse_b; good calls interleave with the bad
    # ones, so a message that leaked across threads would name the other argument.
    o, lse = random_state(rng, 32, 4, 64)
    wrong = {0: "out_lse", 1: "lse_b"}

    def body(i):
        for r in range(50):
            if r % 2:
                attnmerge.merge(o, lse, o, lse)
                continue
            kwargs = {"out_lse": nan_array((31, 4))} if i % 2 == 0 else {}
            lse_b = lse if i % 2 == 0 else lse[:31]
            with pytest.raises(ValueError) as e:
                attnmerge.merge(o, lse, o, lse_b, **kwargs)
            assert str(e.value).startswith(wrong[i % 2] + ":"), str(e.value)

    run_threads(body)


@pytest.mark.gpu
def test_threads_on_their_own_streams_give_the_serial_bits(rng):
    torch = pytest.importorskip("torch")
    inputs, serial = [], []
    for i in range(THREADS):
        h = random_state(rng, 256 + 32 * i, 32, 128) + random_state(rng, 256 + 32 * i, 32, 128)
        x = [torch.from_numpy(a).cuda().to(torch.bfloat16 if a.ndim == 3 else torch.float32) for a in h]
        inputs.append(x)
        serial.append(attnmerge.merge(*x))
    torch.cuda.synchronize()
    outs = [[] for _ in range(THREADS)]

    def body(i):
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):  # attnmerge takes torch's current stream of this thread
            for _ in range(ROUNDS):
                out = torch.full_like(inputs[i][0], float("nan"))
                out_lse = torch.full_like(inputs[i][1], float("nan"))
                attnmerge.merge(*inputs[i], out=out, out_lse=out_lse)
                outs[i].append((out, out_lse))
        stream.synchronize()

    run_threads(body)
    for i in range(THREADS):
        for out, out_lse in outs[i]:
            assert torch.equal(out, serial[i][0]) and torch.equal(out_lse, serial[i][1])
