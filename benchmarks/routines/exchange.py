"""The exchange fused with the merge (attnmerge_merge_exchange), its ranks simulated on one GPU: rank 0
of W reads its slice of heads (32 / W of 32, head size 128 or 512, bfloat16) of every rank's state
where it lies (the peers' buffers on the same device) and writes their merge, at decode sizes (8 to
128 tokens), against

    floor     the streaming floor of its bytes, measured in the same run (torch.add on bfloat16 of the
              same bytes, two read and one written) and as the model (2.04 us + bytes / 4.37 TB/s, the
              best copy kernel on an H200: routines/floor.py)
    gathered  merge_states over the states gathered ([W, tokens, 32 / W, D], states_axis=0: what an
              all-to-all leaves), the all-to-all itself not timed

Timed: the merge alone with ATTNMERGE_EXCHANGE_ALTERNATE (no wait after the merge) and with
ATTNMERGE_EXCHANGE_WAIT_READERS (its last block's count, signals and wait), every call finding every
rank's state published (the ranks' publish and one merge of every rank before the timing); and a
publish then the merge (ALTERNATE, the peers' ready slots set far ahead by their publish of a late
epoch), the epoch from the pad in every call, as a captured graph has it.  Bytes: every rank's slice
of O and LSE read once, the output and its LSE written once.  The target: the merge within 1.25x the
floor.  Each result is checked against a float64 merge first.  CUDA graph replay, input sets rotated
past L2, the median of 3 alternations.  Until the Python binding exists the C ABI is called through
tests/c_abi.py."""
import os
import sys
import threading

import attnmerge
from attnmerge.bench.timing import input_sets

from .floor import floor_us

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir, "tests"))
import c_abi  # noqa: E402  (the C ABI by ctypes)

HEADS = 32
TARGET = 1.25  # the merge's time over the floor's, at most
LATE = 1 << 62  # an epoch the peers publish so that rank 0's every later epoch finds them ready


def ints(text):
    return tuple(int(x) for x in text.split(","))


def add_arguments(p):
    p.add_argument("--worlds", type=ints, default=(4, 8), help="ranks, comma-separated (default 4,8)")
    p.add_argument("--tokens", type=ints, default=(8, 16, 32, 64, 128), help="tokens (default 8,16,32,64,128)")
    p.add_argument("--head-sizes", type=ints, default=(128, 512), help="head sizes (default 128,512)")
    p.add_argument("--timeout-ns", type=int, default=10**10, help="the exchange's timeout (default 10 s)")


class Case:
    """One world, tokens and head size: `count` input sets, each every rank's state, rank 0's output
    and the gathered states, and two groups of pads (A: every rank published and merged epoch 1; B:
    the peers published LATE)."""

    def __init__(self, runner, world, tokens, head_size, timeout_ns):
        torch = self.torch = runner.torch
        self.on_gpu = runner.device == "cuda"
        self.device_id = torch.cuda.current_device() if self.on_gpu else c_abi.HOST
        self.world, self.tokens, self.head_size, self.timeout_ns = world, tokens, head_size, timeout_ns
        self.heads = HEADS // world
        t, h, d = tokens, self.heads, head_size
        self.bytes = world * t * h * (d * 2 + 4) + t * h * (d * 2 + 4)
        count = runner.count or input_sets(self.bytes)
        dev = runner.device
        self.o = [[torch.randn(t, HEADS, d, device=dev, dtype=torch.bfloat16) for _ in range(world)]
                  for _ in range(count)]
        self.lse = [[torch.randn(t, HEADS, device=dev) for _ in range(world)] for _ in range(count)]
        self.out = [torch.empty(t, h, d, device=dev, dtype=torch.bfloat16) for _ in range(count)]
        self.out_lse = [torch.empty(t, h, device=dev) for _ in range(count)]
        self.gathered = [(torch.stack([x[:, :h] for x in o]), torch.stack([x[:, :h] for x in lse]))
                         for o, lse in zip(self.o, self.lse)]
        self.gathered_out = [(torch.empty(t, h, d, device=dev, dtype=torch.bfloat16), torch.empty(t, h, device=dev))
                             for _ in range(count)]
        n = self.bytes // 6  # bfloat16 elements of a, b and c: 2 n read, n written
        self.add = [tuple(torch.randn(n, device=dev, dtype=torch.bfloat16) for _ in range(3)) for _ in range(count)]
        words = c_abi.load().attnmerge_exchange_pad_bytes(world) // 8
        self.pads = {g: [torch.zeros(words, dtype=torch.int64, device=dev) for _ in range(world)] for g in "AB"}
        self.streams = [torch.cuda.Stream() for _ in range(world)] if self.on_gpu else None

    def desc(self, x):
        code = c_abi.BFLOAT16 if x.dtype == self.torch.bfloat16 else c_abi.FLOAT32
        return c_abi.tensor(x.data_ptr(), x.shape, x.stride(), code, device=self.device_id)

    def exchange(self, s, rank, group, reuse):
        o, lse = self.o[s], self.lse[s]
        return c_abi.exchange(rank, [x.data_ptr() for x in o], [x.data_ptr() for x in lse],
                              [p.data_ptr() for p in self.pads[group]], self.desc(o[0]), self.desc(lse[0]),
                              timeout_ns=self.timeout_ns, reuse=reuse)

    def stream(self, rank=None):
        if not self.on_gpu:
            return None
        s = self.streams[rank] if rank is not None else self.torch.cuda.current_stream()
        return s.cuda_stream

    def merge(self, s, rank, group, reuse, out=None, stream=None):
        """Rank `rank`'s merge of set s into `out` ((out, out_lse); rank 0's of set s where None), on
        `stream` (None: the current one)."""
        out, out_lse = (self.out[s], self.out_lse[s]) if out is None else out
        return c_abi.merge_exchange(self.desc(out), self.desc(out_lse), self.exchange(s, rank, group, reuse),
                                    c_abi.SLICE_HEADS, rank * self.heads, 0, None,
                                    self.stream() if stream is None else stream)

    def prepare(self):
        """Group A: every rank publishes epoch 1 and merges it once (each on a stream or thread of its
        own, after every publish), so that rank 0's merges of epoch 1 find every state published and
        every rank's done slot set.  Group B: the peers publish LATE."""
        torch = self.torch
        for r in range(self.world):
            check(c_abi.exchange_publish(self.exchange(0, r, "A", c_abi.WAIT_READERS), 1, self.stream()))
            if r:
                check(c_abi.exchange_publish(self.exchange(0, r, "B", c_abi.ALTERNATE), LATE, self.stream()))
        scratch = [(torch.empty_like(self.out[0]), torch.empty_like(self.out_lse[0])) for _ in range(self.world)]
        if self.on_gpu:
            torch.cuda.synchronize()
            for r in range(self.world):
                check(self.merge(0, r, "A", c_abi.WAIT_READERS, scratch[r], self.stream(r)))
            torch.cuda.synchronize()
        else:
            statuses = [None] * self.world

            def rank(r):
                statuses[r] = self.merge(0, r, "A", c_abi.WAIT_READERS, scratch[r])

            threads = [threading.Thread(target=rank, args=(r,)) for r in range(self.world)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            for s in statuses:
                check(s)
        self.verify("A")

    def verify(self, group):
        """What rank 0's pad recorded (nothing, else a failure of the protocol): 0 or 1."""
        status = c_abi.exchange_status(self.exchange(0, 0, group, c_abi.ALTERNATE), self.stream())
        if status != c_abi.SUCCESS:
            print(f"  exchange, pads {group}: {c_abi.last_error()}", flush=True)
        return int(status != c_abi.SUCCESS)

    def error(self, s):
        """Rank 0's output of set s against a float64 merge of its slice: the relative L2 error."""
        o = self.gathered[s][0].double()
        lse = self.gathered[s][1].double()
        w = (lse - lse.max(0).values).exp()
        ref = (w[..., None] * o).sum(0) / w.sum(0)[..., None]
        return float((self.out[s].double() - ref).norm() / ref.norm())


def check(status):
    if status != c_abi.SUCCESS:
        raise RuntimeError(f"exchange: {c_abi.last_error()}")


def run(args, runner):
    torch = runner.torch
    rows, failed = [], 0
    cases = [(w, t, d) for w in args.worlds for d in args.head_sizes for t in args.tokens]
    for world, tokens, head_size in runner.cases(cases):
        case = Case(runner, world, tokens, head_size, args.timeout_ns)
        case.prepare()

        def alternate(s):
            check(case.merge(s, 0, "A", c_abi.ALTERNATE))

        def wait_readers(s):
            check(case.merge(s, 0, "A", c_abi.WAIT_READERS))

        def published(s):
            check(c_abi.exchange_publish(case.exchange(s, 0, "B", c_abi.ALTERNATE), 0, case.stream()))
            check(case.merge(s, 0, "B", c_abi.ALTERNATE))

        def gathered(s):
            attnmerge.merge_states(*case.gathered[s], out=case.gathered_out[s][0], out_lse=case.gathered_out[s][1],
                                   states_axis=0)

        def floor(s):
            a, b, c = case.add[s]
            torch.add(a, b, out=c)

        sets = [(s,) for s in range(len(case.o))]
        alternate(0)
        if runner.device == "cuda":
            torch.cuda.synchronize()
        err = case.error(0)
        bad = int(not err <= 8e-3) + case.verify("A")
        times = runner.time((alternate, wait_readers, published, gathered, floor), sets)
        bad += case.verify("A") + case.verify("B")
        failed += bad
        us = dict(zip(("exchange_us", "wait_readers_us", "publish_exchange_us", "gathered_us", "floor_add_us"), times))
        model = floor_us(case.bytes)
        floor_measured = us["floor_add_us"]
        row = dict(world=world, tokens=tokens, heads=HEADS, head_size=head_size, bytes=case.bytes, error=err,
                   **us, floor_model_us=model, over_floor=us["exchange_us"] / floor_measured,
                   over_floor_model=us["exchange_us"] / model, over_gathered=us["exchange_us"] / us["gathered_us"],
                   failed=bad)
        rows.append(row)
        print(f"W={world} {tokens}x{HEADS}x{head_size}: exchange {us['exchange_us']:.2f} us (wait readers "
              f"{us['wait_readers_us']:.2f}, publish + exchange {us['publish_exchange_us']:.2f}), gathered "
              f"merge_states {us['gathered_us']:.2f} us, floor {floor_measured:.2f} us measured / {model:.2f} "
              f"model ({case.bytes / 1e6:.3f} MB): {row['over_floor']:.2f}x the floor "
              f"{'<=' if row['over_floor'] <= TARGET else '>'} {TARGET}x; error {err:.1e}"
              f"{'' if not bad else ' FAILED'}", flush=True)
    print(f"exchange: {len(rows)} cases, {sum(r['over_floor'] > TARGET for r in rows)} past {TARGET}x the floor, "
          f"{failed} failed")
    return dict(routine="exchange", rows=rows, failed=failed)
