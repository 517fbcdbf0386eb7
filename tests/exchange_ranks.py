"""The ranks of an exchange (attnmerge_merge_exchange: attnmerge.h's "Context parallelism on one node")
simulated in one process, for the tests: every rank's state, signal pad and output on a test device
(tests/devices.py), described to the C ABI through tests/c_abi.py.  On the host each rank's calls
are made from a thread of its own (the CPU path waits on the pads); on a GPU each rank's work is
enqueued on a CUDA stream of its own, every rank's publish before any rank's merge (a merge waits
with its blocks on the GPU: a publish enqueued behind it could find no SM).

    ranks = Ranks(dev, [o_0, o_1, ...], [lse_0, lse_1, ...])     # NumPy states, one per rank
    statuses = ranks.step(outs, out_lses, c_abi.SLICE_HEADS, begins)
"""

from __future__ import annotations

import ctypes
import threading

import numpy as np

import c_abi
from devices import element_strides, pointer

LONG_NS = 20 * 10**9  # a wait that only a broken protocol exhausts (the test machine may be slow)


def descriptor(x, device_id, flags=0) -> c_abi.Tensor:
    """A C ABI descriptor of a NumPy array or torch tensor."""
    name = x.dtype.name if isinstance(x, np.ndarray) else str(x.dtype).removeprefix("torch.")
    code = next(code for code, d in c_abi.dtypes().items() if d[1] == name)
    return c_abi.tensor(pointer(x), x.shape, element_strides(x), code, device=device_id, flags=flags)


class Ranks:
    """`world` ranks, each with `buffers` states (ATTNMERGE_EXCHANGE_ALTERNATE: two) and a zeroed pad."""

    def __init__(self, dev, o_states, lse_states, *, reuse=c_abi.WAIT_READERS, timeout_ns=LONG_NS, buffers=1,
                 known=False, sums=None):
        self.dev = dev
        self.flags = c_abi.DEVICE_KNOWN if known else 0  # every descriptor's: the pointers asked of CUDA, or not
        self.world = len(o_states)
        self.on_gpu = bool(getattr(dev, "on_gpu", False))
        self.torch = dev.torch if self.on_gpu else None
        self.device_id = self.torch.cuda.current_device() if self.on_gpu else c_abi.HOST
        self.reuse, self.timeout_ns = reuse, timeout_ns
        self.o = [[dev.put(x) for x in o_states] for _ in range(buffers)]
        self.lse = [[dev.put(x) for x in lse_states] for _ in range(buffers)]
        # softmax sums (exchange.sum: lse then holds the maxima), laid out as the LSEs; None: LSEs
        self.sums = None if sums is None else [[dev.put(x) for x in sums] for _ in range(buffers)]
        words = c_abi.load().attnmerge_exchange_pad_bytes(self.world) // 8
        self.pads = [dev.put(np.zeros(words, np.int64)) for _ in range(self.world)]
        self.streams = [self.torch.cuda.Stream() for _ in range(self.world)] if self.on_gpu else None

    def exchange(self, rank, buffer=0, **fields) -> c_abi.Exchange:
        """Rank `rank`'s attnmerge_exchange over buffer `buffer`; `fields` override its own."""
        o, lse = self.o[buffer], self.lse[buffer]
        args = dict(timeout_ns=self.timeout_ns, reuse=self.reuse)
        if self.sums is not None:
            args["sum"] = [pointer(x) for x in self.sums[buffer]]
        args.update(fields)
        return c_abi.exchange(rank, [pointer(x) for x in o], [pointer(x) for x in lse], [pointer(p) for p in self.pads],
                              descriptor(o[0], self.device_id, self.flags), descriptor(lse[0], self.device_id, self.flags),
                              **args)

    def write(self, rank, o, lse, buffer=0):
        """Rank `rank`'s state of the next step (its producer), on its stream on a GPU."""
        if self.on_gpu:
            with self.torch.cuda.stream(self.streams[rank]):
                self.o[buffer][rank].copy_(self.dev.put(o), non_blocking=True)
                self.lse[buffer][rank].copy_(self.dev.put(lse), non_blocking=True)
        else:
            self.o[buffer][rank][...] = self.dev.put(o)
            self.lse[buffer][rank][...] = self.dev.put(lse)

    def stream(self, rank):
        return None if not self.on_gpu else ctypes.c_void_p(self.streams[rank].cuda_stream)

    def publish(self, rank, epoch=0, buffer=0) -> int:
        return c_abi.exchange_publish(self.exchange(rank, buffer), epoch, self.stream(rank))

    def merge(self, rank, out, out_lse, slice, begin, epoch=0, opts=None, buffer=0) -> int:
        out_t = descriptor(out, self.device_id, self.flags)
        lse_t = None if out_lse is None else descriptor(out_lse, self.device_id, self.flags)
        return c_abi.merge_exchange(out_t, lse_t, self.exchange(rank, buffer), slice, begin, epoch, opts,
                                    self.stream(rank))

    def status(self, rank) -> tuple[int, str]:
        """attnmerge_exchange_status of rank `rank` (the GPU's after its stream): (status, message)."""
        status = c_abi.exchange_status(self.exchange(rank), self.stream(rank))
        return status, c_abi.last_error()

    def step(self, outs, out_lses, slice, begins, *, epoch=0, opts=None, buffer=0, ranks=None, publish=None,
             before=None):
        """One step of every rank in `ranks` (all): before(rank) (its producer, say), its publish (unless
        `publish` leaves it out: a rank that never publishes) and its merge into outs[rank],
        out_lses[rank] with `opts` (a list: opts[rank]).  On the host each rank on a thread of its own, together; on a GPU enqueued
        on each rank's stream, every publish before any merge.  {rank: (publish's status, merge's
        status, the merge's message)}, after every rank's work is done."""
        ranks = range(self.world) if ranks is None else ranks
        publish = set(ranks) if publish is None else set(publish)
        options = opts if isinstance(opts, list) else [opts] * self.world
        result = {}

        def run(rank):
            if before is not None:
                before(rank)
            p = self.publish(rank, epoch, buffer) if rank in publish else None
            m = self.merge(rank, outs[rank], out_lses[rank], slice, begins[rank], epoch, options[rank], buffer)
            result[rank] = (p, m, c_abi.last_error())

        if not self.on_gpu:
            threads = [threading.Thread(target=run, args=(r,)) for r in ranks]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            return result
        torch = self.torch
        published = {}
        for r in ranks:
            if before is not None:
                before(r)
            p = self.publish(r, epoch, buffer) if r in publish else None
            event = torch.cuda.Event()
            event.record(self.streams[r])
            published[r] = (p, event)
        for r in ranks:
            for _, event in published.values():
                self.streams[r].wait_event(event)
            m = self.merge(r, outs[r], out_lses[r], slice, begins[r], epoch, options[r], buffer)
            result[r] = (published[r][0], m, c_abi.last_error())
        torch.cuda.synchronize()
        return result
