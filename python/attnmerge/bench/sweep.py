"""The sweep: the shapes, the implementations compared, the roofline and torch.add moving the same
bytes, the host overhead of a decode call and the PDL chain on the GPU; the CPU path against np.add.
Every time comes from attnmerge.bench.timing."""
from __future__ import annotations

import numpy as np

import attnmerge

from .timing import eager_us, graph_us, host_us, input_sets, paired_seconds

# (op, tokens, heads, head_size, dtype, states)
DECODE = [("merge", t, 32, 128, "bfloat16", 2) for t in (1, 4, 16, 64, 128, 256)]
CHUNK = [("merge", t, 32, 128, "bfloat16", 2) for t in (512, 1024, 2048, 4096)]
LONG = [("merge", t, 32, 128, "bfloat16", 2) for t in (8192, 16384, 32768)]
AXES = ([("merge", 2048, h, 128, "bfloat16", 2) for h in (8, 128)]
        + [("merge", 2048, 32, d, "bfloat16", 2) for d in (64, 80, 256, 512)]
        + [("merge", 8192, 32, 128, dt, 2) for dt in ("float16", "float32")])
NWAY = [("merge_states", t, 32, 128, "bfloat16", s) for s in (4, 8) for t in (16, 2048, 8192)]
ALL = DECODE + CHUNK + LONG + AXES + NWAY
QUICK = [DECODE[0], DECODE[4], CHUNK[0], CHUNK[2], LONG[0], LONG[2], NWAY[4]]


def state_bytes(tokens, heads, head_size, itemsize, states):
    """Bytes moved: states O reads + one O write, and the LSEs likewise."""
    return (states + 1) * tokens * heads * (head_size * itemsize + 4)



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


def _same_size_add_us(torch, nbytes, calls=50):
    """torch.add on bfloat16 moving `nbytes` (2 reads + 1 write), graph-timed with rotated inputs:
    what one plain streaming kernel reaches at that size, fixed costs included."""
    n = max(1, nbytes // 6)
    sets = [(torch.randn(n, device="cuda", dtype=torch.bfloat16), torch.randn(n, device="cuda", dtype=torch.bfloat16),
             torch.empty(n, device="cuda", dtype=torch.bfloat16)) for _ in range(input_sets(nbytes))]
    return graph_us(torch, lambda x, y, z: torch.add(x, y, out=z), sets, calls=calls)


def roofline_gbps(torch):
    """The roofline: torch.add on 2 x 128 Mi bfloat16 elements into a third (768 MiB moved)."""
    nbytes = 6 * (128 << 20)
    return nbytes / _same_size_add_us(torch, nbytes, calls=10) / 1e3


def run_gpu(shapes):
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench: no CUDA GPU visible to PyTorch (use --cpu for the CPU path)")
    impls = _torch_impls(torch)
    roof = roofline_gbps(torch)
    print(f"{torch.cuda.get_device_name()}: roofline (torch.add bf16, 2 reads + 1 write) {roof:.0f} GB/s")
    print(f"implementations: {', '.join(impls)}")
    rows = []
    for op, t, h, d, dt, s in shapes:
        dtype = getattr(torch, dt)
        nbytes = state_bytes(t, h, d, torch.tensor([], dtype=dtype).element_size(), s)
        sets = []
        for _ in range(input_sets(nbytes)):
            if op == "merge":
                states = []
                for _ in range(2):
                    states += [torch.randn(t, h, d, device="cuda", dtype=dtype), 3 * torch.randn(t, h, device="cuda")]
            else:
                states = [torch.randn(t, s, h, d, device="cuda", dtype=dtype), 3 * torch.randn(t, s, h, device="cuda")]
            out = torch.empty(t, h, d, device="cuda", dtype=dtype)
            sets.append((op, out, torch.empty(t, h, device="cuda"), *states))
        for name, fn in impls.items():
            row = dict(op=op, tokens=t, heads=h, head_size=d, dtype=dt, states=s, impl=name, bytes=nbytes)
            try:
                row["graph_us"] = graph_us(torch, fn, sets)
                row["eager_us"] = eager_us(torch, fn, sets)
            except Exception as e:  # an implementation without this op or layout
                row["error"] = f"{type(e).__name__}: {e}"[:200]
                rows.append(row)
                continue
            row["GBps"] = nbytes / row["graph_us"] / 1e3
            row["roof_pct"] = 100 * row["GBps"] / roof
            rows.append(row)
            print(f"{op:>12} S={s} {t:>6}x{h:>3}x{d:>3} {dt:>8} {nbytes / 1e6:>8.1f} MB | {name:<12} graph "
                  f"{row['graph_us']:>8.2f} us {row['GBps']:>6.0f} GB/s {row['roof_pct']:>5.1f}% | "
                  f"eager {row['eager_us']:>7.2f} us",
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


def _host_overhead(torch):
    """Per-call cost from Python at 1 x 32 x 128 bfloat16 (the decode step): host time, and the
    eager time per call on the GPU's clock (the larger of host and kernel time)."""
    t, h, d = 1, 32, 128
    o_a, o_b = (torch.randn(t, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    lse_a, lse_b = (torch.randn(t, h, device="cuda") for _ in range(2))
    out, out_lse = torch.empty_like(o_a), torch.empty_like(lse_a)
    from .. import raw
    from ..compat.vllm import merge_attn_states

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
        row = dict(call=name, host_us=host_us(torch, fn), eager_us=eager_us(torch, lambda *_: fn(), [()], calls=200))
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

            row["pdl_us" if pdl else "plain_us"] = graph_us(torch, lambda *_: chain(), [()], calls=50)
        rows.append(row)
        print(f"pdl   chain of 2 dependent merges {t:>4}x32x128 bfloat16: plain {row['plain_us']:6.2f} us, "
              f"pdl {row['pdl_us']:6.2f} us ({row['plain_us'] / row['pdl_us']:.2f}x)", flush=True)
    return rows


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
    # A header over every column: the last is the merge's bandwidth over np.add's, pair by pair.
    columns = "{:>14} {:>8} | {:>10} {:>7} | {:>10} {:>7} | {:>13}"
    print("cpu merge against np.add on float32 arrays of the shape (2 reads, 1 write), medians", flush=True)
    print(columns.format("shape", "dtype", "merge us", "GB/s", "np.add us", "GB/s", "GB/s / np.add"), flush=True)
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
                       np_add_bytes=3 * a.nbytes, np_add_GBps=3 * a.nbytes / add / 1e9, np_add_us=add * 1e6)
            # bandwidth over np.add's: (nbytes / merge) / (3 a.nbytes / add), pair by pair
            row["ratio_to_np_add"] = add_over_merge * nbytes / (3 * a.nbytes)
            rows.append(row)
            print(columns.format(f"{t}x{h}x{d}", name, f"{row['call_us']:.1f}", f"{row['GBps']:.1f}",
                                 f"{row['np_add_us']:.1f}", f"{row['np_add_GBps']:.1f}",
                                 f"{row['ratio_to_np_add']:.2f}x"), flush=True)
    return {"device": "cpu", "rows": rows}
