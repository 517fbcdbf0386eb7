"""The attnmerge benchmark:  python -m attnmerge bench [--cpu] [--quick] [--json FILE] [--png FILE]

GPU (PyTorch with CUDA): the two-way merge over decode (1 to 256 tokens), chunk (512 to 4096) and long
(8192 to 32768) sizes, heads 8 to 128, head sizes 64 to 512, bfloat16/float16/float32, and the N-way
merge (S = 4 and 8); each timed by CUDA-graph replay (the GPU work) and by an eager per-call loop from
Python (host overhead included), with input sets rotated past L2 and medians of 7 runs.  Bandwidth
is reported as GB/s and as a share of the 2-read-1-write roofline measured in the same run (torch.add
on bfloat16).  Compared with PyTorch eager and with FlashInfer, vLLM and sgl-kernel where installed.
CPU (--cpu): the CPU path on NumPy arrays (float32, and bfloat16 with ml_dtypes) against np.add over
the same bytes of float32, with per-call times; ATTNMERGE_NUM_THREADS caps the merge's threads.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

import attnmerge

# (op, tokens, heads, head_size, dtype, states)
DECODE = [("merge", t, 32, 128, "bfloat16", 2) for t in (1, 4, 16, 64, 128, 256)]
CHUNK = [("merge", t, 32, 128, "bfloat16", 2) for t in (512, 1024, 2048, 4096)]
LONG = [("merge", t, 32, 128, "bfloat16", 2) for t in (8192, 16384, 32768)]
AXES = ([("merge", 2048, h, 128, "bfloat16", 2) for h in (8, 128)]
        + [("merge", 2048, 32, d, "bfloat16", 2) for d in (64, 80, 256, 512)]
        + [("merge", 8192, 32, 128, dt, 2) for dt in ("float16", "float32")])
NWAY = [("merge_states", t, 32, 128, "bfloat16", s) for s in (4, 8) for t in (16, 2048, 8192)]
QUICK = [DECODE[0], DECODE[4], CHUNK[0], CHUNK[2], LONG[0], LONG[2], NWAY[4]]


def state_bytes(tokens, heads, head_size, itemsize, states):
    """Bytes moved: states O reads + one O write, and the LSEs likewise."""
    return (states + 1) * tokens * heads * (head_size * itemsize + 4)


# ---------------------------------------------------------------------------------------------
# GPU


def _torch_impls(torch):
    """name -> fn(op, out, out_lse, o, lse) for every installed implementation; o and lse are the
    stacked states [tokens, S, heads, head_size] and [tokens, S, heads] (natural-log LSE)."""

    def ours(op, out, out_lse, o, lse):
        if op == "merge":
            attnmerge.merge(o[:, 0], lse[:, 0], o[:, 1], lse[:, 1], out=out, out_lse=out_lse)
        else:
            attnmerge.merge_states(o, lse, out=out, out_lse=out_lse)

    def eager(op, out, out_lse, o, lse):
        m = lse.amax(dim=1, keepdim=True)
        w = torch.exp(lse - m)
        total = w.sum(dim=1)
        out.copy_((o.float() * (w / total[:, None]).unsqueeze(-1)).sum(dim=1))
        out_lse.copy_(torch.log(total) + m[:, 0])

    impls = {"attnmerge": ours, "torch eager": eager}
    try:
        import flashinfer

        def fi(op, out, out_lse, o, lse):  # base-2 LSEs; results allocated by FlashInfer
            if op == "merge":
                flashinfer.merge_state(o[:, 0], lse[:, 0], o[:, 1], lse[:, 1])
            else:
                flashinfer.merge_states(o, lse)

        impls["flashinfer"] = fi
    except ImportError:
        pass
    try:
        from vllm import _custom_ops as vllm_ops

        def vllm_merge(op, out, out_lse, o, lse):  # LSE [heads, tokens]; two-way only
            if op != "merge":
                raise NotImplementedError
            vllm_ops.merge_attn_states(out, o[:, 0], lse[:, 0].T, o[:, 1], lse[:, 1].T, out_lse.T)

        impls["vllm"] = vllm_merge
    except ImportError:
        pass
    try:
        import sgl_kernel

        def sgl(op, out, out_lse, o, lse):
            if op == "merge":
                sgl_kernel.merge_state(o[:, 0], lse[:, 0], o[:, 1], lse[:, 1])
            else:
                raise NotImplementedError

        impls["sgl-kernel"] = sgl
    except ImportError:
        pass
    return impls


def _graph_us(torch, fn, sets, calls=50):
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
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def _eager_us(torch, fn, sets, calls=100):
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


def _roofline_gbps(torch):
    a = torch.randn(128 << 20, device="cuda", dtype=torch.bfloat16)
    b, c = torch.randn_like(a), torch.empty_like(a)
    us = _graph_us(torch, lambda x, y, z: torch.add(x, y, out=z), [(a, b, c)], calls=10)
    return 3 * a.numel() * 2 / us / 1e3


def run_gpu(shapes):
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench: no CUDA GPU visible to PyTorch (use --cpu for the CPU path)")
    impls = _torch_impls(torch)
    roof = _roofline_gbps(torch)
    print(f"{torch.cuda.get_device_name()}: roofline (torch.add bf16, 2 reads + 1 write) {roof:.0f} GB/s")
    print(f"implementations: {', '.join(impls)}")
    rows = []
    for op, t, h, d, dt, s in shapes:
        dtype = getattr(torch, dt)
        nbytes = state_bytes(t, h, d, torch.tensor([], dtype=dtype).element_size(), s)
        nsets = max(1, min(32, (512 << 20) // max(1, nbytes)))
        sets = []
        for _ in range(nsets):
            o = torch.randn(t, s, h, d, device="cuda", dtype=dtype)
            lse = 3 * torch.randn(t, s, h, device="cuda")
            sets.append((op, torch.empty(t, h, d, device="cuda", dtype=dtype), torch.empty(t, h, device="cuda"), o, lse))
        for name, fn in impls.items():
            row = dict(op=op, tokens=t, heads=h, head_size=d, dtype=dt, states=s, impl=name, bytes=nbytes)
            try:
                row["graph_us"] = _graph_us(torch, fn, sets)
                row["eager_us"] = _eager_us(torch, fn, sets)
            except Exception as e:  # an implementation without this op or layout
                row["error"] = f"{type(e).__name__}: {e}"[:200]
                rows.append(row)
                continue
            row["GBps"] = nbytes / row["graph_us"] / 1e3
            row["roof_pct"] = 100 * row["GBps"] / roof
            rows.append(row)
            print(f"{op:>12} S={s} {t:>6}x{h:>3}x{d:>3} {dt:>8} {nbytes / 1e6:>8.1f} MB | {name:<12} graph "
                  f"{row['graph_us']:>8.2f} us {row['GBps']:>6.0f} GB/s {row['roof_pct']:>5.1f}% | eager {row['eager_us']:>7.2f} us",
                  flush=True)
        del sets
        torch.cuda.empty_cache()
    return {"device": torch.cuda.get_device_name(), "roofline_GBps": roof, "rows": rows}


# ---------------------------------------------------------------------------------------------
# CPU


def median_seconds(fn, runs=7):
    """The median wall time of `runs` calls of fn(), in seconds."""
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run_cpu(quick):
    rng = np.random.default_rng(0)
    shapes = [(1, 32, 128), (64, 32, 128), (2048, 32, 128)]
    if not quick:
        shapes[2:] = [(1024, 32, 128), (8192, 32, 128), (1024, 32, 1024)]
    dtypes = ["float32"]
    try:
        import ml_dtypes

        dtypes.append(ml_dtypes.bfloat16)
    except ImportError:
        pass
    rows = []
    for t, h, d in shapes:
        a, b = (rng.standard_normal((t, h, d), dtype=np.float32) for _ in range(2))
        la, lb = (3 * rng.standard_normal((t, h), dtype=np.float32) for _ in range(2))
        out_lse, c = np.empty_like(la), np.empty_like(a)
        runs = 7 if t * h * d >= 1 << 22 else 201
        add = median_seconds(lambda: np.add(a, b, out=c), runs)
        for dt in dtypes:
            x, y = a.astype(dt), b.astype(dt)
            out = np.empty_like(x)
            merge = median_seconds(lambda: attnmerge.merge(x, la, y, lb, out=out, out_lse=out_lse), runs)
            name = np.dtype(dt).name
            nbytes = state_bytes(t, h, d, x.itemsize, 2)
            row = dict(op="merge", tokens=t, heads=h, head_size=d, dtype=name, states=2, impl="attnmerge cpu",
                       bytes=nbytes, call_us=merge * 1e6, GBps=nbytes / merge / 1e9,
                       np_add_GBps=3 * a.nbytes / add / 1e9, np_add_us=add * 1e6)
            row["ratio_to_np_add"] = row["GBps"] / row["np_add_GBps"]
            rows.append(row)
            print(f"cpu merge {t:>6}x{h}x{d:<4} {name:>8}: {row['call_us']:>9.1f} us {row['GBps']:>6.1f} GB/s | "
                  f"np.add (float32) {row['np_add_us']:>9.1f} us {row['np_add_GBps']:>6.1f} GB/s | "
                  f"{row['ratio_to_np_add']:.2f}x", flush=True)
    return {"device": "cpu", "rows": rows}


def plot(result, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("bench: matplotlib is not installed: no plot", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(8, 5))
    for impl in sorted({r["impl"] for r in result["rows"]}):
        pts = sorted((r["bytes"], r["GBps"]) for r in result["rows"] if r["impl"] == impl and "GBps" in r)
        if pts:
            ax.plot([p[0] / 1e6 for p in pts], [p[1] for p in pts], "o-", label=impl)
    if "roofline_GBps" in result:
        ax.axhline(result["roofline_GBps"], color="gray", linestyle="--", label="roofline (torch.add)")
    ax.set_xscale("log")
    ax.set_xlabel("MB moved")
    ax.set_ylabel("GB/s")
    ax.set_title(f"attnmerge on {result['device']}")
    ax.legend()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    print(f"bench: plot written to {path}")


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m attnmerge bench", description=__doc__.split("\n")[0])
    parser.add_argument("--cpu", action="store_true", help="the CPU path against NumPy instead of the GPU")
    parser.add_argument("--quick", action="store_true", help="a few shapes only")
    parser.add_argument("--json", help="write every figure here")
    parser.add_argument("--png", help="write a plot of GB/s against bytes moved here (needs matplotlib)")
    args = parser.parse_args(argv)
    if args.cpu:
        result = run_cpu(args.quick)
    else:
        result = run_gpu(QUICK if args.quick else DECODE + CHUNK + LONG + AXES + NWAY)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.png:
        plot(result, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
