"""Context parallelism's step across processes, one a GPU of one host: for each form of
examples/context_parallel.py, each size and dtype, the exchange alone, the merge alone and the two
together, timed, and each form's result checked against attention over all the keys on one device.

    python benchmarks/run.py cp_step --world 2 --json benchmarks/results/<card>x2-cp-step.json

W processes are started here (torch.multiprocessing), rank r on GPU r over NCCL, 32 heads, bfloat16
and float32 states at decode (8 to 128 tokens) and prefill (8192) sizes, head sizes 128 and 512:

    gather      the exchange: an all-gather of O and one of LSE into [W, T, H, D] and [W, T, H];
                the merge: merge_states of them where they landed (states_axis=0): every head
    share       the exchange: an all-gather of the LSEs and a reduce-scatter of the shares over
                heads; the merge: merge_share of this rank's state, written head-major: H / W heads
    all_to_all  the exchange: all_to_all of O and of LSE (H / W heads to each rank); the merge:
                merge_states of the receive buffer [W, T, H / W, D]
    packed      all_to_all with O and LSE in one buffer of 16-byte-aligned records (one exchange; the
                records packed once, as an attention kernel would write them)
    fused       attnmerge's exchange over PyTorch's symmetric memory: publish and merge in one call
                (the exchange and the merge are one kernel: "both" alone)
    ring        checked, not timed: its step interleaves attention with the exchange

"both" runs the exchange then the merge, as a step does (the share: the merge between its two
collectives).  Each phase's calls run back to back after
a barrier, timed by CUDA events (`--graph`: captured in a CUDA graph first, where the form's
collectives allow it, replayed; "eager" in the row where they do not), `--iters` calls a repetition,
the median of 5 repetitions, the slowest rank's.  The states are the same buffers in every call (a
step's exchange reads states its attention just wrote).  NVLink multicast stays off
(examples/context_parallel.py's MULTICAST_OFF).  --check-cpu: 2 processes over gloo (the fused form
on a shared file), the smallest case, every form checked, untimed."""
from __future__ import annotations

import math
import os
import statistics
import sys
import tempfile
import time

import attnmerge

HEADS = 32
REPEATS = 5
# The largest |out - attention| allowed, by the states' dtype (the merge is float32 inside).
TOLERANCE = {"float32": 2e-4, "bfloat16": 3e-2}
EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir, "examples")


def ints(text):
    return tuple(int(x) for x in text.split(","))


def add_arguments(p):
    p.add_argument("--world", type=int, default=2, help="processes, one a GPU (default 2)")
    p.add_argument("--tokens", type=ints, default=(8, 32, 128, 8192), help="tokens (default 8,32,128,8192)")
    p.add_argument("--head-sizes", type=ints, default=(128, 512), help="head sizes (default 128,512)")
    p.add_argument("--dtypes", default="bfloat16,float32", help="the states' dtypes (default bfloat16,float32)")
    p.add_argument("--keys", type=int, default=4096, help="keys over all ranks (default 4096)")
    p.add_argument("--iters", type=int, default=50, help="calls a repetition (default 50)")
    p.add_argument("--graph", action="store_true", help="capture each phase in a CUDA graph where it can be")
    p.add_argument("--forms", default="gather,share,all_to_all,packed,fused,ring",
                   help="the forms (default every one: gather,share,all_to_all,packed,fused,ring)")


def _example():
    if EXAMPLES not in sys.path:
        sys.path.insert(0, EXAMPLES)
    import context_parallel

    return context_parallel


class Phases:
    """One rank's calls of one form on one problem: exchange(), merge(), both() on buffers made
    once; result() the (out, out_lse) of this rank's heads after both()."""

    def __init__(self, form, o, lse, group_world, rank, buffers=None):
        import torch
        import torch.distributed as dist

        cp = _example()
        self.form, self.rank, self.world = form, rank, group_world
        tokens, heads, d = o.shape
        mine = heads // self.world
        self.heads = (0, heads) if form == "gather" else (rank * mine, (rank + 1) * mine)
        if form == "gather":
            self.o_all = o.new_empty(self.world, tokens, heads, d)
            self.lse_all = lse.new_empty(self.world, tokens, heads)
            self.out, self.out_lse = torch.empty_like(o), torch.empty_like(lse)

            def exchange():
                cp.all_gather_into(self.o_all.view(-1, heads, d), o)
                cp.all_gather_into(self.lse_all.view(-1, heads), lse)

            def merge():
                attnmerge.merge_states(self.o_all, self.lse_all, states_axis=0, out=self.out, out_lse=self.out_lse)
        elif form == "share":
            self.lse_all = lse.new_empty(self.world, tokens, heads)
            self.shares = o.new_empty(heads, tokens, d)
            self.shares_lse = lse.new_empty(tokens, heads)
            self.mine = o.new_empty(mine, tokens, d)
            self.out, self.out_lse = self.mine.transpose(0, 1), self.shares_lse[:, self.heads[0]:self.heads[1]]

            def gather():
                cp.all_gather_into(self.lse_all.view(-1, heads), lse)

            def scatter():
                cp.reduce_scatter_into(self.mine, self.shares)

            def exchange():
                gather()
                scatter()

            def merge():
                attnmerge.merge_share(o, self.lse_all, rank, states_axis=0, out=self.shares.transpose(0, 1),
                                      out_lse=self.shares_lse)

            def both():  # the shares are summed once written: the merge between the two collectives
                gather()
                merge()
                scatter()
        elif form in ("all_to_all", "packed"):
            send_o = o.view(tokens, self.world, mine, d).transpose(0, 1).contiguous()
            send_lse = lse.view(tokens, self.world, mine).transpose(0, 1).contiguous()
            self.out, self.out_lse = o.new_empty(tokens, mine, d), lse.new_empty(tokens, mine)
            if form == "packed":
                send = cp.pack_records(send_o, send_lse)
                recv = torch.empty_like(send)
                self.recv_o, self.recv_lse = cp.unpack_records(recv, d)

                def exchange():
                    dist.all_to_all_single(recv, send)
            else:
                self.recv_o, self.recv_lse = torch.empty_like(send_o), torch.empty_like(send_lse)

                def exchange():
                    dist.all_to_all_single(self.recv_o, send_o)
                    dist.all_to_all_single(self.recv_lse, send_lse)

            def merge():
                attnmerge.merge_states(self.recv_o, self.recv_lse, states_axis=0, out=self.out, out_lse=self.out_lse)
        elif form == "fused":
            self.out, self.out_lse = o.new_empty(tokens, mine, d), lse.new_empty(tokens, mine)
            if o.is_cuda:
                self.x = attnmerge.SymmetricExchange(dist.group.WORLD, tokens, heads, d, dtype=o.dtype)
                self.x.o.copy_(o)
                self.x.lse.copy_(lse)

                def both():
                    self.x(out=self.out, out_lse=self.out_lse)
            else:
                o_all, lse_all, pads = buffers
                o_all[rank].copy_(o)
                lse_all[rank].copy_(lse)
                self.x = attnmerge.Exchange(o_all[rank], lse_all[rank], o_all, lse_all, pads, rank)
                self.epoch = 0

                def both():
                    self.epoch += 1
                    self.x.publish(self.epoch)
                    self.x.merge(epoch=self.epoch, out=self.out, out_lse=self.out_lse)

            self.exchange = self.merge = None
            self.both = both
            return
        else:
            raise ValueError(f"form: expected one of gather, share, all_to_all, packed, fused, got {form!r}")
        self.exchange, self.merge = exchange, merge
        if form != "share":
            def both():
                exchange()
                merge()

        self.both = both

    def poison(self):
        """NaN in every buffer the form writes (the receive buffers, the shares, the results), so
        that a check after both() sees what that call wrote alone."""
        for name in ("o_all", "lse_all", "shares", "shares_lse", "mine", "recv_o", "recv_lse", "out", "out_lse"):
            buffer = getattr(self, name, None)
            if buffer is not None and buffer.is_floating_point():
                buffer.fill_(float("nan"))

    def phases(self):
        return [(name, fn) for name, fn in (("exchange", self.exchange), ("merge", self.merge), ("both", self.both))
                if fn is not None]


def _time_us(fn, iters, on_gpu, graph):
    """(median us a call, "graph" or "eager") of fn's calls back to back, this rank's."""
    import torch
    import torch.distributed as dist

    mode = "eager"
    run = fn
    if on_gpu and graph:
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                fn()  # warm: NCCL's communicators and the kernels' first launch outside the capture
            torch.cuda.current_stream().wait_stream(stream)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn()
            run, mode = g.replay, "graph"
        except Exception:  # noqa: BLE001  (a form whose collectives cannot be captured: timed eagerly)
            torch.cuda.synchronize()
            run, mode = fn, "eager"
    run()
    times = []
    for _ in range(REPEATS):
        if on_gpu:
            torch.cuda.synchronize()
        dist.barrier()
        if on_gpu:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / iters)
        else:
            t0 = time.perf_counter()
            for _ in range(iters):
                run()
            times.append((time.perf_counter() - t0) * 1e6 / iters)
    return statistics.median(times), mode


def _reference(q, k, v, scale, heads):
    """Attention of q over all the keys for heads [begin, end), float32 on q's device, a chunk of
    tokens at a time: (out, lse)."""
    import torch

    qf, kf, vf = (x[:, heads[0]:heads[1]].float() for x in (q, k, v))
    outs, lses = [], []
    for t in range(0, qf.shape[0], 1024):
        scores = torch.einsum("thd,khd->htk", qf[t:t + 1024], kf) * scale
        lses.append(torch.logsumexp(scores, dim=-1).transpose(0, 1))
        outs.append(torch.einsum("htk,khd->thd", torch.softmax(scores, dim=-1), vf))
    return torch.cat(outs), torch.cat(lses)


def _errors(out, out_lse, ref):
    return float((out.float() - ref[0]).abs().max()), float((out_lse.float() - ref[1]).abs().max())


def _worker(rank, world, init, cfg, result_path):
    import torch
    import torch.distributed as dist

    cp = _example()
    for name, value in cp.MULTICAST_OFF.items():
        os.environ.setdefault(name, value)
    on_gpu = not cfg["check_cpu"]
    device = f"cuda:{rank}" if on_gpu else "cpu"
    if on_gpu:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if on_gpu else "gloo", init_method=init, rank=rank, world_size=world,
                            **({"device_id": torch.device(device)} if on_gpu else {}))
    rows = []
    try:
        for dtype_name in cfg["dtypes"]:
            dtype = getattr(torch, dtype_name)
            for head_size in cfg["head_sizes"]:
                for tokens in cfg["tokens"]:
                    q, k, v = cp.make_problem(seed=tokens + head_size, tokens=tokens, heads=cfg["heads"],
                                              head_size=head_size, keys=cfg["keys"], device=device)
                    scale = 1.0 / math.sqrt(head_size)
                    begin, end = cp.shard_bounds(k.shape[0], world, rank)
                    o, lse = cp.partial_attention(q, k[begin:end], v[begin:end], scale, dtype)
                    buffers = None if on_gpu else cp.host_buffers(world, tokens, cfg["heads"], head_size, dtype)
                    for form in cfg["forms"]:
                        row = dict(form=form, tokens=tokens, heads=cfg["heads"], head_size=head_size, dtype=dtype_name,
                                   world=world)
                        inputs = (q, k, v)
                        if form == "ring":  # its keys and values travel in the states' dtype: checked against them
                            inputs = tuple(x.to(dtype) for x in inputs)
                            sizes = [e - b for b, e in (cp.shard_bounds(k.shape[0], world, r) for r in range(world))]
                            out, out_lse = cp.ring_attention(inputs[0], torch.stack(
                                [inputs[1][begin:end], inputs[2][begin:end]]), sizes, scale)
                            heads = (0, cfg["heads"])
                        else:
                            ph = Phases(form, o, lse, world, rank, buffers)
                            for phase, fn in ph.phases():
                                if cfg["check_cpu"]:
                                    fn()
                                    continue
                                us, mode = _time_us(fn, cfg["iters"], on_gpu, cfg["graph"])
                                slowest = torch.tensor([us], device=device)
                                dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
                                row[f"{phase}_us"], row[f"{phase}_mode"] = float(slowest), mode
                            ph.poison()
                            ph.both()
                            out, out_lse, heads = ph.out, ph.out_lse, ph.heads
                        if on_gpu:
                            torch.cuda.synchronize()
                        err = torch.tensor(_errors(out, out_lse, _reference(*inputs, scale, heads)), device=device)
                        dist.all_reduce(err, op=dist.ReduceOp.MAX)
                        row["max_err"], row["max_lse_err"] = float(err[0]), float(err[1])
                        row["failed"] = int(not (row["max_err"] <= TOLERANCE[dtype_name]
                                                 and row["max_lse_err"] <= 1e-3))
                        rows.append(row)
                        if rank == 0:
                            times = ", ".join(f"{p} {row[p + '_us']:.2f} us ({row[p + '_mode']})"
                                              for p in ("exchange", "merge", "both") if p + "_us" in row)
                            print(f"W={world} {form:<10} {tokens}x{cfg['heads']}x{head_size} {dtype_name}: "
                                  f"{times or 'untimed'}; max |err| {row['max_err']:.2e}, LSE {row['max_lse_err']:.2e}"
                                  f"{'  FAILED' if row['failed'] else ''}", flush=True)
        if rank == 0:
            import json

            with open(result_path, "w") as f:
                json.dump(rows, f)
    finally:
        dist.destroy_process_group()


def run(args, runner):
    import json

    import torch
    import torch.multiprocessing as mp

    check = runner.check_cpu
    forms = ("gather", "share", "all_to_all", "packed", "fused", "ring")
    unknown = [form for form in args.forms.split(",") if form not in forms]
    if unknown:
        print(f"--forms: {','.join(unknown)} is not one of {','.join(forms)}", file=sys.stderr)
        raise SystemExit(2)
    world = 2 if check else args.world
    if not check and torch.cuda.device_count() < world:
        print(f"--world: {world} needs as many GPUs, {torch.cuda.device_count()} visible", file=sys.stderr)
        raise SystemExit(2)
    cfg = dict(check_cpu=check, dtypes=args.dtypes.split(","), head_sizes=args.head_sizes[:1] if check else
               args.head_sizes, tokens=(4,) if check else args.tokens, heads=4 if check else HEADS,
               keys=64 if check else args.keys, iters=args.iters, graph=args.graph, forms=args.forms.split(","))
    if check:
        cfg["head_sizes"] = (16,)
    with tempfile.TemporaryDirectory() as tmp:
        init, result = "file://" + os.path.join(tmp, "rendezvous"), os.path.join(tmp, "rows.json")
        mp.spawn(_worker, args=(world, init, cfg, result), nprocs=world, join=True)
        with open(result) as f:
            rows = json.load(f)
    meta = dict(world=world, torch=torch.__version__, check_cpu=check, iters=args.iters, graph=args.graph,
                keys=cfg["keys"])
    if not check:
        meta["devices"] = [torch.cuda.get_device_name(r) for r in range(world)]
        meta["nccl"] = ".".join(str(x) for x in torch.cuda.nccl.version())
    return dict(routine="cp_step", meta=meta, rows=rows, failed=sum(r["failed"] for r in rows))
