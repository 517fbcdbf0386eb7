"""The attnmerge benchmark:  python -m attnmerge bench [--cpu] [--quick] [--json FILE] [--png FILE]

GPU (PyTorch with CUDA): the two-way merge over decode (1 to 256 tokens), chunk (512 to 4096) and long
(8192 to 32768) sizes, heads 8 to 128, head sizes 64 to 512, bfloat16/float16/float32, and the N-way
merge (S = 4 and 8); each timed by CUDA-graph replay (the GPU work) and by an eager per-call loop from
Python (host overhead included), with input sets rotated past L2 and medians of 7 runs.  Bandwidth
is reported as GB/s and as a share of the 2-read-1-write roofline measured in the same run (torch.add
on bfloat16), and each size also times torch.add moving the same bytes (what one plain streaming
kernel reaches there, launch and drain included).  Compared with PyTorch eager and with FlashInfer,
vLLM and sgl-kernel where installed.
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
    """name -> fn(op, out, out_lse, *states) for every installed implementation: states are
    (o_a, lse_a, o_b, lse_b) for "merge" ([tokens, heads, head_size], [tokens, heads]) and the
    stacked (o, lse) ([tokens, S, heads, head_size], [tokens, S, heads]) for "merge_states";
    natural-log LSEs.  The others' layouts and LSE bases differ: their timings stand, their results
    are not compared."""

    def ours(op, out, out_lse, *states):
        if op == "merge":
            attnmerge.merge(*states, out=out, out_lse=out_lse)
        else:
            attnmerge.merge_states(*states, out=out, out_lse=out_lse)

    def eager(op, out, out_lse, *states):
        if op == "merge":
            o_a, lse_a, o_b, lse_b = states
            m = torch.maximum(lse_a, lse_b)
            w_a, w_b = torch.exp(lse_a - m), torch.exp(lse_b - m)
            total = w_a + w_b
            out.copy_(o_a * (w_a / total).unsqueeze(-1) + o_b * (w_b / total).unsqueeze(-1))
        else:
            o, lse = states
            m = lse.amax(dim=1, keepdim=True)
            w = torch.exp(lse - m)
            total = w.sum(dim=1)
            out.copy_((o.float() * (w / total[:, None]).unsqueeze(-1)).sum(dim=1))
            m = m[:, 0]
        out_lse.copy_(torch.log(total) + m)

    impls = {"attnmerge": ours, "torch eager": eager}
    try:
        import flashinfer

        def fi(op, out, out_lse, *states):  # results allocated by FlashInfer
            if op == "merge":
                flashinfer.merge_state(*states)
            else:
                flashinfer.merge_states(*states)

        impls["flashinfer"] = fi
    except ImportError:
        pass
    try:
        from vllm import _custom_ops as vllm_ops

        def vllm_merge(op, out, out_lse, *states):  # two-way only; reads LSEs as [heads, tokens]
            if op != "merge":
                raise NotImplementedError
            o_a, lse_a, o_b, lse_b = states
            vllm_ops.merge_attn_states(out, o_a, lse_a, o_b, lse_b, out_lse)

        impls["vllm"] = vllm_merge
    except ImportError:
        pass
    try:
        import sgl_kernel

        def sgl(op, out, out_lse, *states):
            if op == "merge":
                sgl_kernel.merge_state(*states)
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


def _input_sets(nbytes):
    """How many input sets a call moving `nbytes` rotates through: together past 512 MB (L2 is
    50 to 60 MB), at most 32."""
    return max(1, min(32, (512 << 20) // max(1, nbytes)))


def _same_size_add_us(torch, nbytes, calls=50):
    """torch.add on bfloat16 moving `nbytes` (2 reads + 1 write), graph-timed with rotated inputs:
    what one plain streaming kernel reaches at that size, fixed costs included."""
    n = max(1, nbytes // 6)
    sets = [(torch.randn(n, device="cuda", dtype=torch.bfloat16), torch.randn(n, device="cuda", dtype=torch.bfloat16),
             torch.empty(n, device="cuda", dtype=torch.bfloat16)) for _ in range(_input_sets(nbytes))]
    return _graph_us(torch, lambda x, y, z: torch.add(x, y, out=z), sets, calls=calls)


def _roofline_gbps(torch):
    """The roofline: torch.add on 2 x 128 Mi bfloat16 elements into a third (768 MiB moved)."""
    nbytes = 6 * (128 << 20)
    return nbytes / _same_size_add_us(torch, nbytes, calls=10) / 1e3


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
        sets = []
        for _ in range(_input_sets(nbytes)):
            if op == "merge":
                states = []
                for _ in range(2):
                    states += [torch.randn(t, h, d, device="cuda", dtype=dtype), 3 * torch.randn(t, h, device="cuda")]
            else:
                states = [torch.randn(t, s, h, d, device="cuda", dtype=dtype), 3 * torch.randn(t, s, h, device="cuda")]
            sets.append((op, torch.empty(t, h, d, device="cuda", dtype=dtype), torch.empty(t, h, device="cuda"), *states))
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
        add_us = _same_size_add_us(torch, nbytes)
        for row in rows:
            if row["bytes"] == nbytes and "graph_us" in row and "add_us" not in row:
                row["add_us"] = add_us
        print(f"{'':>12} torch.add moving the same {nbytes / 1e6:.1f} MB (2 reads + 1 write, bf16): {add_us:.2f} us, "
              f"{100 * nbytes / add_us / 1e3 / roof:.1f}% of the roofline", flush=True)
        torch.cuda.empty_cache()
    return {"device": torch.cuda.get_device_name(), "roofline_GBps": roof, "rows": rows,
            "host": _host_overhead(torch), "pdl": _pdl_chain(torch)}


def _host_us(fn, calls=200):
    """Host wall time per call (median of 15 batches; the GPU is waited for between batches only)."""
    import torch

    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(15):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(times)


def _host_overhead(torch):
    """Per-call cost from Python at 1 x 32 x 128 bfloat16 (the decode step): host time, and the
    eager time per call on the GPU's clock (the larger of host and kernel time)."""
    t, h, d = 1, 32, 128
    o_a, o_b = (torch.randn(t, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    lse_a, lse_b = (torch.randn(t, h, device="cuda") for _ in range(2))
    out, out_lse = torch.empty_like(o_a), torch.empty_like(lse_a)
    from . import raw
    from .compat.vllm import merge_attn_states

    stream = torch.cuda.current_stream().cuda_stream
    device = o_a.device.index or 0
    o_desc = [(x.data_ptr(), "bfloat16", h * d, d) for x in (out, o_a, o_b)]
    l_desc = [(x.data_ptr(), h, 1) for x in (out_lse, lse_a, lse_b)]
    heads_first = [x.T for x in (out_lse, lse_a, lse_b)]  # vLLM's [heads, tokens] LSEs
    calls = {
        "attnmerge.merge (torch tensors)": lambda: attnmerge.merge(o_a, lse_a, o_b, lse_b, out=out, out_lse=out_lse),
        "compat.vllm.merge_attn_states (torch)": lambda: merge_attn_states(out, o_a, heads_first[1], o_b,
                                                                           heads_first[2], heads_first[0]),
        "raw.merge (integer pointers)": lambda: raw.merge(
            tokens=t, heads=h, head_size=d, out=o_desc[0], out_lse=l_desc[0], o_a=o_desc[1], lse_a=l_desc[1],
            o_b=o_desc[2], lse_b=l_desc[2], device=device, stream=stream),
        "raw.merge, check_pointers=False": lambda: raw.merge(
            tokens=t, heads=h, head_size=d, out=o_desc[0], out_lse=l_desc[0], o_a=o_desc[1], lse_a=l_desc[1],
            o_b=o_desc[2], lse_b=l_desc[2], device=device, stream=stream, check_pointers=False),
        "torch.add (one kernel, for scale)": lambda: torch.add(o_a, o_b, out=out),
    }
    rows = []
    for name, fn in calls.items():
        row = dict(call=name, host_us=_host_us(fn), eager_us=_eager_us(torch, lambda *_: fn(), [()], calls=200))
        rows.append(row)
        print(f"host  {name:<40} host {row['host_us']:6.2f} us per call | eager {row['eager_us']:6.2f} us", flush=True)
    return rows


def _pdl_chain(torch):
    """Two dependent merges (the second reads the first's result), graph-timed, with and without
    programmatic dependent launch, at decode sizes."""
    rows = []
    for t in (1, 16, 128):
        shape = (t, 32, 128)
        x = [torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
        lx = [torch.randn(shape[:2], device="cuda") for _ in range(3)]
        mid, mid_lse = torch.empty_like(x[0]), torch.empty_like(lx[0])
        out, out_lse = torch.empty_like(x[0]), torch.empty_like(lx[0])
        row = dict(tokens=t, heads=32, head_size=128, dtype="bfloat16")
        for pdl in (False, True):
            def chain(pdl=pdl):
                attnmerge.merge(x[0], lx[0], x[1], lx[1], out=mid, out_lse=mid_lse, pdl=pdl)
                attnmerge.merge(mid, mid_lse, x[2], lx[2], out=out, out_lse=out_lse, pdl=pdl)

            row["pdl_us" if pdl else "plain_us"] = _graph_us(torch, lambda *_: chain(), [()], calls=50)
        rows.append(row)
        print(f"pdl   chain of 2 dependent merges {t:>4}x32x128 bfloat16: plain {row['plain_us']:6.2f} us, "
              f"pdl {row['pdl_us']:6.2f} us ({row['plain_us'] / row['pdl_us']:.2f}x)", flush=True)
    return rows


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
        for dt in dtypes:
            x, y = a.astype(dt), b.astype(dt)
            out = np.empty_like(x)
            # np.add and the merge alternate, and the ratio is the median of each pair's
            merge, add, add_over_merge = paired_seconds(
                lambda: attnmerge.merge(x, la, y, lb, out=out, out_lse=out_lse), lambda: np.add(a, b, out=c), runs
            )
            name = np.dtype(dt).name
            nbytes = state_bytes(t, h, d, x.itemsize, 2)
            row = dict(op="merge", tokens=t, heads=h, head_size=d, dtype=name, states=2, impl="attnmerge cpu",
                       bytes=nbytes, call_us=merge * 1e6, GBps=nbytes / merge / 1e9,
                       np_add_GBps=3 * a.nbytes / add / 1e9, np_add_us=add * 1e6)
            # bandwidth over np.add's: (nbytes / merge) / (3 a.nbytes / add), pair by pair
            row["ratio_to_np_add"] = add_over_merge * nbytes / (3 * a.nbytes)
            rows.append(row)
            print(f"cpu merge {t:>6}x{h}x{d:<4} {name:>8}: {row['call_us']:>9.1f} us {row['GBps']:>6.1f} GB/s | "
                  f"np.add (float32) {row['np_add_us']:>9.1f} us {row['np_add_GBps']:>6.1f} GB/s | "
                  f"{row['ratio_to_np_add']:.2f}x", flush=True)
    return {"device": "cpu", "rows": rows}


def plot(result, path):
    """A PNG of GB/s against bytes moved at `path`: a line per (implementation, op), torch.add moving
    the same bytes, the roofline.  Returns the lines' labels (None without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("bench: matplotlib is not installed: no plot", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(8, 5))
    for impl, op in sorted({(r["impl"], r["op"]) for r in result["rows"]}):
        pts = sorted((r["bytes"], r["GBps"]) for r in result["rows"]
                     if r["impl"] == impl and r["op"] == op and "GBps" in r)
        if pts:
            ax.plot([p[0] / 1e6 for p in pts], [p[1] for p in pts], "o-" if op == "merge" else "s--",
                    label=f"{impl}, {op}")
    # What a plain streaming kernel reaches at each size: torch.add moving the same bytes.
    same = sorted({(r["bytes"], r["bytes"] / r["add_us"] / 1e3) for r in result["rows"] if r.get("add_us")})
    if same:
        ax.plot([p[0] / 1e6 for p in same], [p[1] for p in same], ":", color="gray",
                label="torch.add moving the same bytes")
    if "roofline_GBps" in result:
        ax.axhline(result["roofline_GBps"], color="gray", linestyle="--", label="roofline (torch.add)")
    ax.set_xscale("log")
    ax.set_xlabel("MB moved")
    ax.set_ylabel("GB/s")
    ax.set_title(f"attnmerge on {result['device']}")
    ax.legend()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    print(f"bench: plot written to {path}")
    return [line.get_label() for line in ax.get_lines()]


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
