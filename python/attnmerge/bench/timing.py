"""The benchmarks' timers, the only ones: GPU time by CUDA-graph replay and per eager call (on the
GPU's clock), host time per call, and wall-clock medians (alone and paired) for the CPU path.  GPU
timers take `torch` (imported by the caller: the package does not depend on it) and rotate through
input `sets` so that the inputs exceed L2; every figure is a median of 7 runs."""
from __future__ import annotations

import statistics
import time


def input_sets(nbytes):
    """How many input sets a call moving `nbytes` rotates through: together past 512 MB (L2 is
    50 to 60 MB), at most 32."""
    return max(1, min(32, (512 << 20) // max(1, nbytes)))


def graph_us(torch, fn, sets, calls=50, flush=None):
    """GPU time per call of fn(*set), us: `calls` calls (sets in turn) captured in one CUDA graph,
    the median of 7 replays timed by events.  flush: called before each timed replay, outside the
    timed region (a large read, say, so that no replay finds its inputs in L2)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(3):
            fn(*sets[i % len(sets)])
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(*sets[i % len(sets)])
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(7):
        if flush is not None:
            flush()
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def eager_us(torch, fn, sets, calls=100):
    """Time per call of fn(*set) called eagerly from Python, us on the GPU's clock: the larger of
    the host's and the kernel's time (median of 7 loops of `calls`)."""
    for i in range(10):
        fn(*sets[i % len(sets)])
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(7):
        start.record()
        for i in range(calls):
            fn(*sets[i % len(sets)])
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def host_us(torch, fn, calls=200):
    """Host wall time per call of fn(), us (median of 15 batches; the GPU is waited for between
    batches only, and not at all with torch None: calls on the host)."""
    wait = torch.cuda.synchronize if torch is not None else (lambda: None)
    for _ in range(20):
        fn()
    wait()
    times = []
    for _ in range(15):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
        wait()
    return statistics.median(times)


def median_seconds(fn, runs=7):
    """The median wall time of `runs` calls of fn(), in seconds."""
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def paired_seconds(fa, fb, runs=7):
    """fa() and fb() called alternately `runs` times: (median time of fa, median time of fb, median
    of the per-pair ratios time_fb / time_fa), in seconds.  On a shared machine whose speed drifts
    between runs, each pair sees the same machine."""
    ta, tb = [], []
    for _ in range(runs):
        start = time.perf_counter()
        fa()
        mid = time.perf_counter()
        fb()
        ta.append(mid - start)
        tb.append(time.perf_counter() - mid)
    return statistics.median(ta), statistics.median(tb), statistics.median(b / a for a, b in zip(ta, tb))
