"""The merge family against FlashInfer's own CUDA cascade kernels, in one run on one GPU, in
FlashInfer's layouts (LSE base 2, [tokens, heads]):

    attnmerge (outputs given, base=2)   FlashInfer host launcher (flashinfer-python 0.7.2.post1)
    merge                               MergeState
    merge_inplace, with and without     MergeStateInPlace
      a uint8 mask
    merge_states, v [tokens, S, H, D]   MergeStates
    merge_varlen, indptr                VariableLengthMergeStates (the persistent kernel FlashInfer's
                                        split-KV decode and prefill call)

FlashInfer's launchers are compiled here, unmodified, from the headers benchmarks/peers/fetch.py
takes from its wheel, through benchmarks/peers/flashinfer_cascade.cu (a C ABI called with ctypes).

Per case: every implementation's output (the timed call itself, outputs poisoned with NaN first)
checked against a float64 reference on the first rows; then the time per call by CUDA-graph replay
(--calls calls a graph over input sets rotated over --set-mb, so that decode-sized calls each read a
set of their own; L2 flushed by a 256 MB read before each replay, outside the timed region; the
median of 7 replays), attnmerge and FlashInfer timed in turn --rounds times, each one's median;
FI/am (above 1: attnmerge is faster), each one's share of the roofline (torch.add on bfloat16,
measured at the start of the same run), and attnmerge against the streaming floor.  Bytes moved:
every input once and every output once (a masked in-place merge: the rows its mask selects).  Before
the first case one timing is made and discarded (the first timing of a process comes out fast;
--keep-first keeps it).  The last line: `vs_flashinfer: N cases, M slower than FlashInfer`."""
from __future__ import annotations

import math
import statistics
import sys
from dataclasses import asdict, dataclass

import torch

import attnmerge
from attnmerge.bench.sweep import roofline_gbps
from attnmerge.bench.timing import graph_us

from . import builds, reference
from .floor import FLOOR_TBPS, FLOOR_US, floor_us

OPS = ("merge", "merge_inplace", "merge_states", "merge_varlen")
FLASHINFER = {"merge": "MergeState", "merge_inplace": "MergeStateInPlace", "merge_states": "MergeStates",
              "merge_varlen": "VariableLengthMergeStates"}
SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
FI_HEAD_DIMS = (64, 128, 256, 512)  # FlashInfer's head-dim dispatch
FLUSH_INTS = 64 << 20  # a 256 MB read flushes L2 (50 to 60 MB)
CHECK_ELEMS = 1 << 26  # the reference covers the first rows up to this many elements of O


@dataclass(frozen=True)
class Case:
    """One case.  tokens: the rows of every op (merge_varlen: its output rows).  states: S of
    merge_states, each row's count of a fixed merge_varlen; lengths (lo, hi, seed): a merge_varlen's
    counts drawn uniformly from lo..hi, seeded.  mask: half the rows of an in-place merge (seeded)."""

    op: str
    tokens: int
    states: int = 2
    lengths: tuple | None = None
    mask: bool = False
    heads: int = 32
    head_dim: int = 128
    dtype: str = "bfloat16"
    out_dtype: str | None = None

    @property
    def out(self):
        return self.out_dtype or self.dtype

    def label(self):
        shape = f"{self.heads}x{self.head_dim}"
        dt = SHORT[self.dtype] + ("" if self.out == self.dtype else f"->{SHORT[self.out]}")
        if self.op == "merge":
            return f"{self.tokens}x{shape} {dt}"
        if self.op == "merge_inplace":
            return f"{self.tokens}x{shape} {dt}" + (" mask" if self.mask else "")
        if self.op == "merge_states":
            return f"S={self.states} {self.tokens}x{shape} {dt}"
        if self.lengths is None:
            return f"{self.tokens} rows x {self.states} st x{shape} {dt}"
        return f"{self.tokens} rows {self.lengths[0]}..{self.lengths[1]} st x{shape} {dt}"

    def counts(self):
        """merge_varlen: the states of each row (the same every run)."""
        if self.lengths is None:
            return [self.states] * self.tokens
        lo, hi, seed = self.lengths
        return torch.randint(lo, hi + 1, (self.tokens,), generator=torch.Generator().manual_seed(seed)).tolist()

    def mask_rows(self):
        """merge_inplace with a mask: the uint8 mask (about half the rows, the first always)."""
        mask = (torch.rand(self.tokens, generator=torch.Generator().manual_seed(99)) < 0.5).to(torch.uint8)
        mask[0] = 1
        return mask

    def moved(self):
        """(bytes one call moves: every input once, every output once; bytes of one input set)."""
        row_in = self.heads * (self.head_dim * getattr(torch, self.dtype).itemsize + 4)  # O and LSE of a state
        row_out = self.heads * (self.head_dim * getattr(torch, self.out).itemsize + 4)
        n = self.tokens
        if self.op == "merge":
            return 2 * n * row_in + n * row_out, 2 * n * row_in + n * row_out
        if self.op == "merge_inplace":
            mask = n if self.mask else 0
            k = int(self.mask_rows().sum()) if self.mask else n  # a masked-out row is neither read nor written
            return 3 * k * row_in + mask, 2 * n * row_in + mask
        if self.op == "merge_states":
            return self.states * n * row_in + n * row_out, self.states * n * row_in + n * row_out
        total = sum(self.counts())
        nbytes = total * row_in + n * row_out + (n + 1) * 4
        return nbytes, nbytes

    def flashinfer_skip(self):
        """Why FlashInfer's launchers cannot run this case, or None."""
        if self.out != self.dtype:
            return "FlashInfer's launchers write their input's type"
        if self.dtype == "float32":
            return "float32: FlashInfer's Python API and this binding take float16 and bfloat16"
        if self.head_dim not in FI_HEAD_DIMS:
            return f"FlashInfer takes head dims {FI_HEAD_DIMS}"
        if self.block_threads() > 1024:
            return f"FlashInfer's block would have {self.block_threads()} threads"
        return None

    def block_threads(self):
        """Threads of FlashInfer's block where it launches one block a token (else 128)."""
        vec = max(16 // getattr(torch, self.dtype).itemsize, self.head_dim // 32)
        one_block = self.op in ("merge", "merge_inplace") or (self.op == "merge_states" and self.states < self.tokens)
        return self.head_dim // vec * self.heads if one_block else 128


def default_cases():
    """The published cases: grouped by op, each bfloat16 merge_states case followed by an attnmerge-only
    row with float32 partials and a bfloat16 output (FlashAttention-3's combine)."""
    cases = [Case("merge", n) for n in (1, 16, 128, 512, 2048, 8192, 32768)]
    cases += [Case("merge", 8192, head_dim=64), Case("merge", 8192, head_dim=256), Case("merge", 8192, dtype="float16")]
    cases += [Case("merge_inplace", n, mask=m) for n in (1, 512, 8192) for m in (False, True)]
    for tokens, s in [(8192, s) for s in (2, 4, 8, 16, 64)] + [(n, s) for n in (16, 128) for s in (16, 64, 128)]:
        cases += [Case("merge_states", tokens, s),
                  Case("merge_states", tokens, s, dtype="float32", out_dtype="bfloat16")]
    cases += [Case("merge_varlen", 8192, lengths=(0, 8, 1234)), Case("merge_varlen", 16, 64),
              Case("merge_varlen", 128, 16)]
    return cases


def cpu_cases():
    """Small cases of every op, dtype and shape kind, for --check-cpu."""
    return [Case("merge", 5, heads=3, head_dim=64, dtype="float32"), Case("merge", 4, heads=2),
            Case("merge", 3, heads=2, head_dim=96), Case("merge_inplace", 6, heads=2, head_dim=64, dtype="float32"),
            Case("merge_inplace", 6, mask=True, heads=2, head_dim=64), Case("merge_states", 3, 5, heads=2, head_dim=64),
            Case("merge_states", 2, 4, heads=2, dtype="float16"),
            Case("merge_states", 3, 4, heads=2, head_dim=64, dtype="float32", out_dtype="bfloat16"),
            Case("merge_varlen", 7, lengths=(0, 4, 1234), heads=2, head_dim=64),
            Case("merge_varlen", 3, 3, heads=2, head_dim=64, dtype="float32")]


def add_arguments(parser):
    parser.add_argument("--ops", help=f"a comma-separated subset of {','.join(OPS)}")
    parser.add_argument("--only", help="comma-separated substrings: the cases whose 'op label' holds one")
    parser.add_argument("--cases", action="store_true",
                        help="print the cases, their bytes and floors, and stop (no GPU)")
    parser.add_argument("--rounds", type=int, default=3, help="graph timings of each implementation, in turn")
    parser.add_argument("--print-rounds", action="store_true", help="print every round's times")
    parser.add_argument("--keep-first", action="store_true", help="do not discard the process's first timing")
    parser.add_argument("--calls", type=int, default=100, help="calls captured in one graph (%(default)s)")
    parser.add_argument("--set-mb", type=float, default=512, help="input sets rotated over at least this (MiB)")
    parser.add_argument("--no-flush", action="store_true", help="do not flush L2 before each replay")
    parser.add_argument("--pdl", action="store_true", help="programmatic dependent launch: attnmerge pdl=True, "
                        "and VariableLengthMergeStates enable_pdl (FlashInfer's only launcher with it)")
    parser.add_argument("--batch-invariant", action="store_true", help="attnmerge batch_invariant=True (a row's "
                        "bits independent of its batch: the N-way merges keep one kernel)")
    parser.add_argument("--attnmerge-only", action="store_true", help="time attnmerge alone (no FlashInfer build)")


def select(cases, args):
    ops = args.ops.split(",") if args.ops else OPS
    unknown = sorted(set(ops) - set(OPS))
    if unknown:
        print(f"--ops: {','.join(unknown)} is not one of {','.join(OPS)}", file=sys.stderr)
        raise SystemExit(2)
    only = [s for s in (args.only or "").split(",") if s]
    return [c for c in cases if c.op in ops and (not only or any(s in f"{c.op} {c.label()}" for s in only))]


def make_set(case, device):
    """One input set, a tuple in the order the op's calls take it (below)."""
    dt, out = getattr(torch, case.dtype), getattr(torch, case.out)
    h, d = case.heads, case.head_dim

    def states(*lead):
        return torch.randn(*lead, h, d, device=device, dtype=dt), 3 * torch.randn(*lead, h, device=device)

    def outputs(n):
        return torch.empty(n, h, d, device=device, dtype=out), torch.empty(n, h, device=device)

    n = case.tokens
    if case.op == "merge":
        return (*states(n), *states(n), *outputs(n))
    if case.op == "merge_inplace":
        return (*states(n), *states(n), case.mask_rows().to(device) if case.mask else None)
    if case.op == "merge_states":
        return (*states(n, case.states), *outputs(n))
    indptr = torch.tensor([0] + case.counts(), dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)
    return (*states(int(indptr[-1])), indptr, *outputs(n))


def calls(case, fi, pdl, batch_invariant=False):
    """{implementation: fn(*set)} for the case: attnmerge's native API with its outputs given (its
    pdl and batch_invariant options), and FlashInfer's launcher where it has one."""
    opts = dict(pdl=pdl, batch_invariant=batch_invariant)
    if case.op == "merge":
        def am(v_a, s_a, v_b, s_b, o, lse):
            attnmerge.merge(v_a, s_a, v_b, s_b, out=o, out_lse=lse, base=2, **opts)
        peer = fi and fi.merge_state
    elif case.op == "merge_inplace":
        def am(v, s, v_other, s_other, mask):
            attnmerge.merge_inplace(v, s, v_other, s_other, mask=mask, base=2, **opts)
        peer = fi and fi.merge_state_in_place
    elif case.op == "merge_states":
        def am(v, s, o, lse):
            attnmerge.merge_states(v, s, out=o, out_lse=lse, base=2, **opts)
        peer = fi and fi.merge_states
    else:
        def am(v, s, indptr, o, lse):
            attnmerge.merge_varlen(v, s, indptr, out=o, out_lse=lse, base=2, **opts)

        def peer(v, s, indptr, o, lse):
            fi.variable_length_merge_states(v, s, indptr, o, lse, enable_pdl=pdl)
        peer = fi and peer
    return {"attnmerge": am, **({"flashinfer_cuda": peer} if peer and not case.flashinfer_skip() else {})}


def result_of(case, fn, s):
    """(O, LSE) of fn on set s, its outputs poisoned with NaN first (in place: on copies of its first
    state)."""
    if case.op == "merge_inplace":
        v, lse = s[0].clone(), s[1].clone()
        fn(v, lse, *s[2:])
        return v, lse
    s[-2].fill_(float("nan"))
    s[-1].fill_(float("nan"))
    fn(*s)
    return s[-2].clone(), s[-1].clone()  # the next implementation writes the same outputs


def expected(case, s):
    """(rows checked, the float64 (O, LSE) of those rows)."""
    per_row = case.heads * case.head_dim
    if case.op == "merge_varlen":
        v, lse, indptr = s[0], s[1], s[2]
        rows = case.tokens
        while rows > 1 and int(indptr[rows] - indptr[0]) * per_row > CHECK_ELEMS:
            rows //= 2
        return rows, reference.merge_varlen(v, lse, indptr, rows, base=2)
    if case.op == "merge_states":
        rows = max(1, min(case.tokens, CHECK_ELEMS // (case.states * per_row)))
        return rows, reference.merge(s[0][:rows], s[1][:rows], base=2)
    rows = max(1, min(case.tokens, CHECK_ELEMS // (2 * per_row)))
    o, lse = reference.merge(torch.stack([s[0][:rows], s[2][:rows]], 1), torch.stack([s[1][:rows], s[3][:rows]], 1),
                             base=2)
    if case.op == "merge_inplace" and case.mask:
        keep = s[4][:rows] == 0  # a masked-out row keeps its state
        o = torch.where(keep[:, None, None], s[0][:rows].double(), o)
        lse = torch.where(keep[:, None], s[1][:rows].double(), lse)
    return rows, (o, lse)


def check(case, fns, s):
    """{implementation: errors against the float64 reference} (and attnmerge's against FlashInfer)."""
    rows, (ref_o, ref_lse) = expected(case, s)
    outs, checks = {}, {}
    for name, fn in fns.items():
        try:
            o, lse = result_of(case, fn, s)
        except Exception as e:  # noqa: BLE001  (reported, and the case goes on without it)
            checks[name] = dict(ok=False, error=f"{type(e).__name__}: {e}"[:400])
            continue
        outs[name] = (o[:rows], lse[:rows])
        checks[name] = dict(rows_checked=rows, **reference.errors(o[:rows], lse[:rows], ref_o, ref_lse, case.out))
    if "attnmerge" in outs and "flashinfer_cuda" in outs:
        (o, lse), (fo, flse) = outs["attnmerge"], outs["flashinfer_cuda"]
        checks["attnmerge"]["o_vs_fi"] = (o.double() - fo.double()).abs().max().item()
        checks["attnmerge"]["lse_vs_fi"] = (lse.double() - flse.double()).nan_to_num(0.0).abs().max().item()
    return checks


def gmean(xs):
    return math.exp(sum(map(math.log, xs)) / len(xs))


def summarize(rows):
    """Geometric means per op (and output type) of FI/am and am/floor; the cases compared and those
    where attnmerge is slower."""
    groups = {}
    for r in rows:
        groups.setdefault(r["op"] + ("" if r["params"]["out_dtype"] is None else " fp32->bf16"), []).append(r)
    per_group = {}
    for g, rs in groups.items():
        d = {}
        for key, xs in (("fi_over_am", [r["ratio"]["flashinfer_cuda"] for r in rs if r["ratio"]]),
                        ("am_over_floor", [r["am_over_floor"] for r in rs if "am_over_floor" in r])):
            if xs:
                d[key] = dict(gmean=gmean(xs), cases=len(xs), min=min(xs), max=max(xs))
        per_group[g] = d
    compared = [r for r in rows if r["ratio"]]
    slower = [dict(op=r["op"], case=r["case"], fi_over_am=r["ratio"]["flashinfer_cuda"])
              for r in compared if r["ratio"]["flashinfer_cuda"] < 1]
    return dict(per_group=per_group, cases=len(compared), slower=len(slower), slower_cases=slower)


def list_cases(cases, args):
    for c in cases:
        nbytes, set_bytes = c.moved()
        print(f"{c.op:<14} {c.label():<34} moves {nbytes / 1e6:9.2f} MB  floor {floor_us(nbytes):8.2f} us  "
              f"sets {nsets(args, set_bytes):3d} x {set_bytes / 1e6:8.2f} MB  "
              f"{c.flashinfer_skip() or 'FlashInfer ' + FLASHINFER[c.op]}")
    print(f"{len(cases)} cases")
    return dict(cases=[dict(op=c.op, case=c.label(), params=asdict(c), bytes=c.moved()[0]) for c in cases])


def nsets(args, set_bytes):
    """Input sets a case rotates over: past --set-mb together, at most one a call."""
    return max(1, min(args.calls, math.ceil(args.set_mb * (1 << 20) / set_bytes)))


def run_check_cpu(cases):
    """attnmerge's timed calls on CPU tensors against the reference; FlashInfer's library built and
    loaded where its headers were fetched (its refusals checked: no kernel runs without a GPU)."""
    rows = []
    for case in cases:
        fns = calls(case, None, False)
        res = check(case, fns, make_set(case, "cpu"))["attnmerge"]
        rows.append(dict(op=case.op, case=case.label(), check=dict(attnmerge=res)))
        print(f"{'PASS' if res['ok'] else 'FAIL'} attnmerge {case.op} {case.label()}: "
              + (res.get("error") or f"|dO| {res['o_err']:.1e} (tol {res['tol_o']:.0e}), |dLSE| {res['lse_err']:.1e}"),
              flush=True)
    library = None
    try:
        fi = builds.FlashInfer(torch, builds.flashinfer_library(builds.arch(torch)))
        library = dict(built=True)
        for what, (type_code, head_dim) in (("an unknown element type", (7, 128)), ("head dim 80", (2, 80))):
            ok = fi.lib.am_fi_merge_state(type_code, *[None] * 6, 1, 32, head_dim, None) == -1
            library[what] = dict(ok=ok, message=fi.lib.am_fi_last_error().decode())
            print(f"{'PASS' if ok else 'FAIL'} FlashInfer's library refuses {what}: {library[what]['message']}")
    except builds.PeerMissing as e:
        print(f"SKIP FlashInfer's library: {e}")
    failed = sum(not r["check"]["attnmerge"]["ok"] for r in rows) + sum(
        not v["ok"] for k, v in (library or {}).items() if k != "built")
    return dict(rows=rows, flashinfer_library=library, failed=failed)


def run(args, runner):
    if runner.check_cpu:
        return run_check_cpu(select(cpu_cases(), args))
    cases = select(default_cases(), args)
    if args.cases:
        return list_cases(cases, args)
    fi = None if args.attnmerge_only else builds.flashinfer(torch)
    roof = roofline_gbps(torch)
    flush_buffer = None if args.no_flush else torch.ones(FLUSH_INTS, dtype=torch.int32, device=runner.device)
    flush = None if flush_buffer is None else flush_buffer.sum
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, attnmerge=attnmerge.__version__,
                flashinfer=None if fi is None else builds.fetch.source_line(builds.fetch.FLASHINFER),
                flashinfer_flags=builds.FLASHINFER_FLAGS + [f"-arch=sm_{builds.arch(torch)}"],
                roofline_GBps=roof, floor=dict(us=FLOOR_US, TBps=FLOOR_TBPS), pdl=args.pdl,
                batch_invariant=args.batch_invariant,
                l2_flush=flush is not None, calls=args.calls, rounds=args.rounds, set_mb=args.set_mb)
    print(f"{meta['device']}  attnmerge {meta['attnmerge']}  FlashInfer {meta['flashinfer']}  pdl={args.pdl}  "
          f"batch_invariant={args.batch_invariant}  "
          f"L2 flush={flush is not None}; roofline (torch.add bf16) {roof:.0f} GB/s; "
          f"floor {FLOOR_US} us + bytes / {FLOOR_TBPS} TB/s")
    head = (f"{'op':<13} {'case':<32} {'MB':>8} | {'am us':>8} {'FI us':>8} {'FI/am':>6} | {'am%rf':>5} {'FI%rf':>5} | "
            f"{'floor':>7} {'am/fl':>5} | {'am-FI dO':>8} {'check':<5}")
    print(head + "\n" + "-" * len(head))
    rows, first = [], not args.keep_first
    for case in cases:
        nbytes, set_bytes = case.moved()
        torch.manual_seed(7)
        sets = [make_set(case, runner.device) for _ in range(nsets(args, set_bytes))]
        fns = calls(case, fi, args.pdl, args.batch_invariant)
        row = dict(op=case.op, case=case.label(), params=asdict(case), bytes=nbytes, set_bytes=set_bytes,
                   nsets=len(sets), floor_us=floor_us(nbytes), impls={}, ratio={}, check=check(case, fns, sets[0]))
        if fi is not None and case.flashinfer_skip():
            row["impls"]["flashinfer_cuda"] = dict(skipped=case.flashinfer_skip())
        timed = {k: fn for k, fn in fns.items() if "error" not in row["check"][k]}
        for k in fns.keys() - timed.keys():
            row["impls"][k] = dict(error=row["check"][k]["error"])
        if first and timed:  # the process's first timing comes out fast: made and discarded
            graph_us(torch, timed["attnmerge"], sets, calls=args.calls, flush=flush)
            first = False
        rounds = {k: [] for k in timed}
        for _ in range(args.rounds):
            for k, fn in list(timed.items()):
                try:
                    rounds[k].append(graph_us(torch, fn, sets, calls=args.calls, flush=flush))
                except Exception as e:  # noqa: BLE001  (reported; the other implementation is still timed)
                    torch.cuda.synchronize()
                    row["impls"][k] = dict(error=f"{type(e).__name__}: {e}"[:400])
                    del timed[k], rounds[k]
        for k, ts in rounds.items():
            us = statistics.median(ts)
            row["impls"][k] = dict(us=us, rounds_us=ts, GBps=nbytes / us / 1e3, roof_pct=100 * nbytes / us / 1e3 / roof)
        am, peer = row["impls"].get("attnmerge", {}), row["impls"].get("flashinfer_cuda", {})
        if "us" in am:
            row["am_over_floor"] = am["us"] / row["floor_us"]
            if "us" in peer:
                row["ratio"]["flashinfer_cuda"] = peer["us"] / am["us"]
        bad = [k for k, v in row["check"].items() if not v["ok"]]
        nan = math.nan
        print(f"{case.op[:13]:<13} {row['case'][:32]:<32} {nbytes / 1e6:>8.2f} | "
              f"{am.get('us', nan):>8.2f} {peer.get('us', nan):>8.2f} "
              f"{row['ratio'].get('flashinfer_cuda', nan):>6.3f} | "
              f"{am.get('roof_pct', nan):>5.1f} {peer.get('roof_pct', nan):>5.1f} | "
              f"{row['floor_us']:>7.2f} {row.get('am_over_floor', nan):>5.2f} | "
              f"{row['check']['attnmerge'].get('o_vs_fi', nan):>8.1e} {'ok' if not bad else 'BAD:' + ','.join(bad)}"
              + (f" | {peer['skipped']}" if "skipped" in peer else ""), flush=True)
        if args.print_rounds:
            print("    rounds: " + " | ".join(f"{k} " + " ".join(f"{t:.3f}" for t in ts) for k, ts in rounds.items()))
        rows.append(row)
        del sets
        torch.cuda.empty_cache()
    meta["roofline_end_GBps"] = roofline_gbps(torch)
    summary = summarize(rows)
    print("\ngeometric means: " + "; ".join(
        f"{g}: " + ", ".join(f"{k} {v['gmean']:.3f} ({v['cases']} cases, min {v['min']:.3f})" for k, v in d.items())
        for g, d in summary["per_group"].items()))
    for s in summary["slower_cases"]:
        print(f"  slower than FlashInfer: {s['op']} {s['case']}: FI/am {s['fi_over_am']:.3f}")
    failed = [(r["op"], r["case"], k) for r in rows for k, v in r["check"].items() if not v["ok"]]
    for op, case, k in failed:
        print(f"  check failed: {op} {case} {k}")
    print(f"roofline at the end {meta['roofline_end_GBps']:.0f} GB/s")
    print(f"vs_flashinfer: {summary['cases']} cases, {summary['slower']} slower than FlashInfer")
    return dict(meta=meta, rows=rows, summary=summary, failed=sum(k == "attnmerge" for _, _, k in failed))
