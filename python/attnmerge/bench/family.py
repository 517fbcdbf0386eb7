"""The merge family on one GPU, by CUDA-graph replay (medians), against the 2-read-1-write roofline
measured in the same run (torch.add on bfloat16): merge_states at S = 2, 8, 64 on 8192 x 32 x 128
bfloat16, the all-gather layout, a chain of S - 1 two-way merges, and merge_varlen with a mean of
4 states per row (0 to 8) against merge_states with S = 4 on the same rows.  Needs PyTorch with
CUDA:  python -m attnmerge bench --family [--json FILE]"""
from __future__ import annotations

import attnmerge

from .sweep import roofline_gbps
from .timing import graph_us

T, H, D = 8192, 32, 128


def _us(torch, fn, calls=5):
    return graph_us(torch, lambda: fn(), [()], calls=calls)


def run_family():
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench: no CUDA GPU visible to PyTorch")
    roof = roofline_gbps(torch)
    print(f"roofline {roof:.0f} GB/s")
    rows = []

    def report(case, us, nbytes, **extra):
        row = dict(case=case, us=us, bytes=nbytes, roof_pct=100 * nbytes / us / 1e3 / roof, **extra)
        rows.append(row)
        print(f"{case}: {us:.1f} us, {nbytes / us / 1e3:.0f} GB/s, {row['roof_pct']:.1f}% roof", flush=True)
        return row

    state = T * H * D * 2
    for s in (2, 8, 64):
        o = torch.randn(T, s, H, D, device="cuda", dtype=torch.bfloat16)
        lse = torch.randn(T, s, H, device="cuda") * 3
        out = torch.empty(T, H, D, device="cuda", dtype=torch.bfloat16)
        out_lse = torch.empty(T, H, device="cuda")
        nbytes = (s + 1) * state + (s + 1) * T * H * 4
        t = report(f"merge_states S={s}", _us(torch, lambda: attnmerge.merge_states(o, lse, out=out, out_lse=out_lse)),
                   nbytes)["us"]
        if s != 8:
            continue
        oa, la = o.transpose(0, 1).contiguous(), lse.transpose(0, 1).contiguous()
        report("  all-gather layout", _us(torch, lambda: attnmerge.merge_states(
            oa, la, out=out, out_lse=out_lse, states_axis=0)), nbytes)
        acc, acc_lse = torch.empty_like(out), torch.empty_like(out_lse)

        def chain():
            attnmerge.merge(oa[0], la[0], oa[1], la[1], out=acc, out_lse=acc_lse)
            for i in range(2, s):
                attnmerge.merge(acc, acc_lse, oa[i], la[i], out=acc, out_lse=acc_lse)

        tc = _us(torch, chain)
        rows.append(dict(case=f"chain of {s - 1} two-way merges", us=tc, nway_speedup=tc / t))
        print(f"  chain of {s - 1} two-way merges: {tc:.1f} us -> N-way is {tc / t:.2f}x faster")
        # varlen, a mean of 4 states a row over about the bytes of S = 8: twice the rows
        n_rows = 2 * T
        counts = torch.randint(0, 9, (n_rows,), device="cuda")
        indptr = torch.zeros(n_rows + 1, dtype=torch.int32, device="cuda")
        indptr[1:] = torch.cumsum(counts, 0)
        total = int(indptr[-1])
        ov = torch.randn(total, H, D, device="cuda", dtype=torch.bfloat16)
        lv = torch.randn(total, H, device="cuda")
        outv = torch.empty(n_rows, H, D, device="cuda", dtype=torch.bfloat16)
        olv = torch.empty(n_rows, H, device="cuda")
        vb = total * H * D * 2 + n_rows * H * D * 2 + (total + n_rows) * H * 4
        tv = report(f"  varlen mean {total / n_rows:.2f} states",
                    _us(torch, lambda: attnmerge.merge_varlen(ov, lv, indptr, out=outv, out_lse=olv)), vb)["us"]
        # the N-way merge on the same rows and about the same bytes: S = 4 everywhere
        o4 = torch.randn(n_rows, 4, H, D, device="cuda", dtype=torch.bfloat16)
        l4 = torch.randn(n_rows, 4, H, device="cuda")
        b4 = 5 * n_rows * H * D * 2 + 5 * n_rows * H * 4
        t4 = report("  merge_states S=4 on the same rows",
                    _us(torch, lambda: attnmerge.merge_states(o4, l4, out=outv, out_lse=olv)), b4)["us"]
        print(f"  varlen at {(vb / tv) / (b4 / t4):.2f}x the bandwidth of S = 4")
    return {"device": torch.cuda.get_device_name(), "roofline_GBps": roof, "rows": rows}
