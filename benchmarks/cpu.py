"""The CPU path against NumPy's own np.add over the same bytes (2 reads + 1 write of float32), medians
of 7 runs, NumPy arrays: the two-way merge of T x H x D float32 and bfloat16 (ml_dtypes), and the
host overhead of a tiny call.  ATTNMERGE_NUM_THREADS caps the merge's threads (np.add uses one).
    python benchmarks/cpu.py
"""
import os
import statistics
import time

import numpy as np

import attnmerge


def median_s(fn, runs=7):
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    rng = np.random.default_rng(0)
    print(f"threads: {os.environ.get('ATTNMERGE_NUM_THREADS', 'all')} of {os.cpu_count()} CPUs")
    for t, h, d in ((8192, 32, 128), (1024, 32, 1024)):
        a = rng.standard_normal((t, h, d), dtype=np.float32)
        b = rng.standard_normal((t, h, d), dtype=np.float32)
        c = np.empty_like(a)
        add = median_s(lambda: np.add(a, b, out=c))
        add_gbps = 3 * a.nbytes / add / 1e9
        lse_a, lse_b = (3 * rng.standard_normal((t, h), dtype=np.float32) for _ in range(2))
        out_lse = np.empty_like(lse_a)
        dtypes = ["float32"]
        try:
            import ml_dtypes

            dtypes.append(ml_dtypes.bfloat16)
        except ImportError:
            pass
        for dt in dtypes:
            x, y = a.astype(dt), b.astype(dt)
            out = np.empty_like(x)
            merge = median_s(lambda: attnmerge.merge(x, lse_a, y, lse_b, out=out, out_lse=out_lse))
            gbps = (3 * x.nbytes + 3 * lse_a.nbytes) / merge / 1e9
            print(f"{t} x {h} x {d} {np.dtype(dt).name:>8}: merge {gbps:5.1f} GB/s, np.add (float32) {add_gbps:5.1f} GB/s,"
                  f" ratio {gbps / add_gbps:.2f}")
    o, lse = rng.standard_normal((1, 32, 128), dtype=np.float32), rng.standard_normal((1, 32), dtype=np.float32)
    out, out_lse = np.empty_like(o), np.empty_like(lse)
    calls = 20000
    for _ in range(1000):
        attnmerge.merge(o, lse, o, lse, out=out, out_lse=out_lse)
    start = time.perf_counter()
    for _ in range(calls):
        attnmerge.merge(o, lse, o, lse, out=out, out_lse=out_lse)
    print(f"a tiny call (1 x 32 x 128 float32, given outputs): {(time.perf_counter() - start) / calls * 1e6:.1f} us")


if __name__ == "__main__":
    main()
