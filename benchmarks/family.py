"""The merge family on one GPU, by CUDA-graph replay (medians), against the 2-read-1-write roofline
measured in the same run (torch.add on bfloat16): merge_states at S = 2, 8, 64 on 8192 x 32 x 128
bfloat16, the all-gather layout, a chain of S - 1 two-way merges, and merge_varlen with a mean of
4 states per row (0 to 8) against merge_states with S = 4 on the same rows.  Needs PyTorch with CUDA:  python benchmarks/family.py
"""
import torch, statistics, attnmerge
def graph_us(fn, calls=20):
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls): fn()
    g.replay(); torch.cuda.synchronize()
    st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    out = []
    for _ in range(7):
        st.record(); g.replay(); en.record(); torch.cuda.synchronize(); out.append(st.elapsed_time(en) * 1e3 / calls)
    return statistics.median(out)
a = torch.randn(256 << 20, device="cuda", dtype=torch.bfloat16); b = torch.randn_like(a); c = torch.empty_like(a)
roof = 3 * a.numel() * 2 / graph_us(lambda: torch.add(a, b, out=c)) / 1e3
del a, b, c
print(f"roofline {roof:.0f} GB/s")
T, H, D, S = 8192, 32, 128, 8
state = T * H * D * 2
for S in (2, 8, 64):
    o = torch.randn(T, S, H, D, device="cuda", dtype=torch.bfloat16); l = torch.randn(T, S, H, device="cuda") * 3
    out = torch.empty(T, H, D, device="cuda", dtype=torch.bfloat16); ol = torch.empty(T, H, device="cuda")
    t = graph_us(lambda: attnmerge.merge_states(o, l, out=out, out_lse=ol), calls=5)
    nbytes = (S + 1) * state + (S + 1) * T * H * 4
    print(f"merge_states S={S}: {t:.1f} us, {nbytes / t / 1e3:.0f} GB/s, {100 * nbytes / t / 1e3 / roof:.1f}% roof")
    if S == 8:
        oa = o.transpose(0, 1).contiguous(); la = l.transpose(0, 1).contiguous()
        t0 = graph_us(lambda: attnmerge.merge_states(oa, la, out=out, out_lse=ol, states_axis=0), calls=5)
        print(f"  all-gather layout: {t0:.1f} us, {100 * nbytes / t0 / 1e3 / roof:.1f}% roof")
        acc, accl = torch.empty(T, H, D, device="cuda", dtype=torch.bfloat16), torch.empty(T, H, device="cuda")
        def chain():
            attnmerge.merge(oa[0], la[0], oa[1], la[1], out=acc, out_lse=accl)
            for i in range(2, S):
                attnmerge.merge(acc, accl, oa[i], la[i], out=acc, out_lse=accl)
        tc = graph_us(chain, calls=5)
        print(f"  chain of {S-1} two-way merges: {tc:.1f} us -> N-way is {tc / t:.2f}x faster")
        # varlen, mean 4 states per row over the same bytes as the S=8 case: 2x the rows
        rows = 2 * T
        counts = torch.randint(0, 9, (rows,), device="cuda")
        indptr = torch.zeros(rows + 1, dtype=torch.int32, device="cuda"); indptr[1:] = torch.cumsum(counts, 0)
        total = int(indptr[-1])
        ov = torch.randn(total, H, D, device="cuda", dtype=torch.bfloat16); lv = torch.randn(total, H, device="cuda")
        outv = torch.empty(rows, H, D, device="cuda", dtype=torch.bfloat16); olv = torch.empty(rows, H, device="cuda")
        tv = graph_us(lambda: attnmerge.merge_varlen(ov, lv, indptr, out=outv, out_lse=olv), calls=5)
        vb = total * H * D * 2 + rows * H * D * 2 + (total + rows) * H * 4
        print(f"  varlen mean {total/rows:.2f} states: {tv:.1f} us, {100 * vb / tv / 1e3 / roof:.1f}% roof")
        # the N-way merge on the same rows and about the same bytes: S = 4 everywhere
        o4 = torch.randn(rows, 4, H, D, device="cuda", dtype=torch.bfloat16); l4 = torch.randn(rows, 4, H, device="cuda")
        t4 = graph_us(lambda: attnmerge.merge_states(o4, l4, out=outv, out_lse=olv), calls=5)
        b4 = 5 * rows * H * D * 2 + 5 * rows * H * 4
        print(f"  merge_states S=4 on the same rows: {t4:.1f} us, {100 * b4 / t4 / 1e3 / roof:.1f}% roof; "
              f"varlen at {(vb / tv) / (b4 / t4):.2f}x its bandwidth")
        del o4, l4
    del o, l
