"""Context parallelism on one node: the exchange fused with the merge.

The ranks of a context-parallel group hold the same queries and one shard of the keys each; rank
p's partial state (O_p [tokens, heads, head_size], LSE_p [tokens, heads]) lies in memory every rank
addresses (symmetric memory).  :class:`Exchange` is one rank's view of them: after its producer has
written its state, :meth:`Exchange.publish` signals it; :meth:`Exchange.merge` waits until every rank
has published, reads this rank's slice (a range of heads or of tokens) of every rank's state where
it lies, and writes their merge: the all-to-all and :func:`attnmerge.merge_states` in one kernel.
The ranks meet at signal pads (``exchange_pad_bytes`` each, zeroed before first use); every wait
gives up after a timeout and reports, never hangs.  ``attnmerge.h`` ("Context parallelism on one
node") states the protocol.

Any symmetric-memory engine serves (NVSHMEM, NCCL windows, CUDA IPC): pass every rank's pointers as
this rank addresses them.  :class:`SymmetricExchange` sets it up over PyTorch's symmetric memory
(``torch.distributed._symmetric_memory``).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from . import _C, _native
from ._arrays import empty
from ._call import OPS, named, options
from ._types import Array, Base, DType, Stream

__all__ = ["Exchange", "SymmetricExchange", "exchange_pad_bytes"]

_REUSE = {"wait_readers": _C.EXCHANGE_WAIT_READERS, "alternate": _C.EXCHANGE_ALTERNATE}
_SLICE = {"tokens": _C.SLICE_TOKENS, "heads": _C.SLICE_HEADS}
_STATES = OPS["merge_states"]  # the exchange merges as merge_states does: its options' reading


def exchange_pad_bytes(world_size: int) -> int:
    """The bytes of one rank's signal pad for `world_size` ranks (zero them before first use).

    Examples
    --------
    >>> import attnmerge
    >>> attnmerge.exchange_pad_bytes(4)
    128
    """
    n = _C.exchange_pad_bytes(world_size)
    if n == 0:
        raise ValueError(f"world_size: expected 1 to {_MAX_WORLD}, got {world_size!r}")
    return n


_MAX_WORLD = 72


def _pointer(x, arg):
    """An int pointer, or an array's data pointer (DLPack, __cuda_array_interface__, NumPy)."""
    if isinstance(x, int) and not isinstance(x, bool):
        return x
    ptr = getattr(x, "data_ptr", None)
    if callable(ptr):
        return ptr()
    for interface in ("__cuda_array_interface__", "__array_interface__"):
        desc = getattr(x, interface, None)
        if desc is not None:
            return desc["data"][0]
    raise TypeError(f"{arg}: expected an array or an int pointer, got {type(x).__qualname__}")


def _softmax_stats(lse, peers_lse):
    """(lse, peers' lse, sum, peers' sums): this rank's and every rank's LSEs as given, or their
    maxima and sums apart where `lse` is a (max, sum) tuple (sum None, peers' sums empty: LSEs)."""
    if not isinstance(lse, tuple):
        for p, x in enumerate(peers_lse):
            if isinstance(x, tuple):
                raise TypeError(f"peers_lse[{p}]: expected an array or an int pointer as lse is (an LSE array), "
                                f"got a tuple")
        return lse, peers_lse, None, []
    if len(lse) != 2:
        raise ValueError(f"lse: expected an array or a (max, sum) tuple of float32 arrays, got a tuple of {len(lse)}")
    maxima, sums = [], []
    for p, x in enumerate(peers_lse):
        if not isinstance(x, tuple) or len(x) != 2:
            raise TypeError(f"peers_lse[{p}]: expected a (max, sum) tuple as lse is, got {type(x).__qualname__}")
        maxima.append(x[0])
        sums.append(x[1])
    return lse[0], maxima, lse[1], sums


class Exchange:
    """One rank of an exchange: every rank's state and pad as this rank addresses them.

    Parameters
    ----------
    o, lse : array
        This rank's own state: O [tokens, heads, head_size] (float32, float16 or bfloat16) and
        LSE float32 [tokens, heads], in the layout every rank's shares; its device is this rank's.
        Or softmax statistics, a ``(max, sum)`` tuple of float32 arrays laid out alike, where an
        LSE goes (as :func:`attnmerge.merge_states` takes them: the state's LSE is
        ``max + log(sum)``, ``sum = 0`` an empty part); then every rank's are.
    peers_o, peers_lse, pads : sequence of arrays or int pointers
        Entry p: rank p's O, LSE (a ``(max, sum)`` tuple where `lse` is one) and signal pad as this
        rank addresses them (its own, or a peer's mapped into this rank's address space); one entry
        per rank.
    rank : int
        This rank, 0 <= rank < len(pads).
    reuse : {"wait_readers", "alternate"}, default "wait_readers"
        "wait_readers": a merge returns once every rank has read this rank's state, which may then
        be written again; "alternate": no wait after the merge, every rank keeps two buffers and
        writes its state of epoch e into buffer e % 2 (one Exchange per buffer).
    timeout : float, default 10.0
        Seconds any wait lasts before it gives up (then :meth:`status` raises ``TimeoutError``).

    Examples
    --------
    One rank alone (ranks on the host run on threads of their own):

    >>> import numpy as np, attnmerge
    >>> o = np.random.default_rng(0).standard_normal((4, 2, 8), dtype=np.float32)
    >>> lse = np.zeros((4, 2), np.float32)
    >>> pad = np.zeros(attnmerge.exchange_pad_bytes(1) // 8, np.int64)
    >>> x = attnmerge.Exchange(o, lse, [o], [lse], [pad], rank=0)
    >>> x.publish()
    >>> out, out_lse = x.merge()
    >>> bool(np.array_equal(out, o))
    True

    Softmax statistics, and a rank that holds no keys for token 3 (`valid`, per token and rank):

    >>> m, s = np.zeros((4, 2), np.float32), np.ones((4, 2), np.float32)
    >>> x = attnmerge.Exchange(o, (m, s), [o], [(m, s)], [np.zeros_like(pad)], rank=0)
    >>> x.publish()
    >>> out, out_lse = x.merge(valid=np.array([[1], [1], [1], [0]], np.uint8))
    >>> bool(np.array_equal(out[:3], o[:3])), float(np.abs(out[3]).max()), float(out_lse[3, 0])
    (True, 0.0, -inf)
    """

    def __init__(self, o: Array, lse: Array, peers_o: Sequence, peers_lse: Sequence, pads: Sequence, rank: int, *,
                 reuse: str = "wait_readers", timeout: float = 10.0):
        if reuse not in _REUSE:
            raise ValueError(f"reuse: expected 'wait_readers' or 'alternate', got {reuse!r}")
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not timeout > 0:
            raise ValueError(f"timeout: expected seconds > 0, got {timeout!r}")
        self._arrays = (o, lse, list(peers_o), list(peers_lse), list(pads))  # kept alive: the pointers are theirs
        self.world_size = len(self._arrays[4])
        self.rank = rank
        self._shape = tuple(o.shape)
        self._like = o
        lse, peer_lse, sum_, peer_sums = _softmax_stats(lse, self._arrays[3])
        self._x = _C.Exchange(o, lse, sum_, [_pointer(x, "peers_o") for x in peers_o],
                              [_pointer(x, "peers_lse") for x in peer_lse],
                              [_pointer(x, "peers_lse") for x in peer_sums], [_pointer(x, "pads") for x in pads],
                              rank, _REUSE[reuse], max(1, int(timeout * 1e9)))

    def publish(self, epoch: int = 0, stream: Stream = None) -> None:
        """Signal every rank that this rank's state of `epoch` is written (once the work before it on
        `stream` is done).  epoch 0: the last one this rank published + 1, read from its pad by the
        kernel (what a CUDA graph replays)."""
        self._x.publish(epoch, stream)

    def merge(self, *, out: Array | None = None, out_lse: Array | None = None, return_lse: bool = True,
              slice: str = "heads", slice_begin: int | None = None, epoch: int = 0, out_dtype: DType | None = None,
              output_scale: float | Array | None = None, base: Base = "e", out_base: Base | None = None,
              sink: Array | None = None, valid: Array | None = None, stream: Stream = None, pdl: bool = False,
              _names: dict | None = None) -> tuple[Array, Array | None]:
        """Merge this rank's slice of every rank's state of `epoch`, once each has published it.

        Parameters
        ----------
        out, out_lse : array, optional
            [slice's tokens, slice's heads, head_size] and [slice's tokens, slice's heads]; allocated
            like this rank's O when None (the slice's size: this rank's even share of the axis).
        return_lse : bool, default True
            Whether to return the merged LSE when no `out_lse` is given.
        slice : {"heads", "tokens"}, default "heads"
            The axis this rank takes a range of (the other whole).
        slice_begin : int, optional
            The range's first head or token; None: rank x the share.
        epoch : int, default 0
            The epoch, the last this rank published; 0: that one, read from the pad.
        valid : array, optional
            Which ranks hold keys for each token of out, ``[tokens of out, world_size]`` on this
            rank's device: a uint8 or bool mask, or int32 or int64 key counts (each rank's KV
            length), as :func:`attnmerge.merge_states` takes ``[tokens, S]``: a rank whose entry is 0
            weighs nothing, whatever its O and LSE hold; read by the kernel (no host
            synchronization).  None: every rank holds keys.
        out_dtype, output_scale, base, out_base, sink, stream, pdl
            As for :func:`attnmerge.merge_states` (sink: [heads of out]).

        Returns
        -------
        out, out_lse : array

        Raises
        ------
        ValueError, TypeError
            A bad argument, by name, before anything runs; on the host a stale epoch too.
        TimeoutError
            On the host, a wait that gave up (on the GPU: :meth:`status`).
        """
        if slice not in _SLICE:
            raise ValueError(f"slice: expected 'heads' or 'tokens', got {slice!r}")
        axis = 1 if slice == "heads" else 0
        tokens, heads, head_size = self._shape
        share = self._shape[axis] // self.world_size
        if slice_begin is None:
            slice_begin = self.rank * share
        opt = options(_STATES, out, return_lse, out_dtype, output_scale, base, out_base, None, sink, None, None, False,
                      1, 0, stream, pdl, _names, valid=valid)
        if out is None or (out_lse is None and opt.return_lse):
            rows = (tokens, share) if axis == 1 else (share, heads)
            dtype = opt.out_dtype or _native.o_dtype(self._like, "o")
            like = self._like if out is None else out
            if out is None:
                out = empty(like, rows + (head_size,), dtype, named(_names, "o"))
            if out_lse is None and opt.return_lse:
                out_lse = empty(like, rows, "float32", named(_names, "o"))
        self._x.merge(out, out_lse, _SLICE[slice], slice_begin, epoch, opt)
        return out, out_lse

    def status(self, stream: Stream = None) -> None:
        """Raise what this rank's calls recorded when they gave up (``TimeoutError`` for a wait,
        ``ValueError`` for a stale epoch, naming the ranks and the epoch), and clear it; nothing
        where all went well.  On the GPU it waits for `stream`: the one exchange call that
        synchronizes the host."""
        self._x.status(stream)


class SymmetricExchange:
    """An :class:`Exchange` over PyTorch's symmetric memory, for the ranks of a process group.

    Allocates this rank's state buffers and signal pad in symmetric memory
    (``torch.distributed._symmetric_memory``), exchanges handles with ``rendezvous`` and builds the
    rank's Exchange over every rank's buffers as this rank maps them.  The attention kernel writes
    :attr:`o` and :attr:`lse` (with ``reuse="alternate"``: :meth:`buffers` of the epoch); then
    ``publish()`` and ``merge()``, or call the object to do both (``merge`` takes ``valid=`` as
    :meth:`Exchange.merge` does).

    Parameters
    ----------
    group : ProcessGroup or str
        The context-parallel group (one NVLink domain).
    tokens, heads, head_size : int
        The states' shape.
    dtype : torch.dtype, default torch.bfloat16
    softmax_stats : bool, default False
        Whether the states come as softmax statistics: :attr:`lse` then receives the running
        maxima and :attr:`sum` the sums (float32 [tokens, heads] each), merged as the ``(max,
        sum)`` tuples :class:`Exchange` takes.
    reuse, timeout
        As for :class:`Exchange`.
    """

    def __init__(self, group: Any, tokens: int, heads: int, head_size: int, dtype: Any = None, *,
                 softmax_stats: bool = False, reuse: str = "wait_readers", timeout: float = 10.0):
        import torch
        import torch.distributed as dist
        from torch.distributed import _symmetric_memory as symm

        dtype = dtype or torch.bfloat16
        device = torch.device("cuda", torch.cuda.current_device())
        group_name = group if isinstance(group, str) else group.group_name
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        n_buffers = 2 if reuse == "alternate" else 1
        o_bytes = tokens * heads * head_size * dtype.itemsize
        lse_bytes = tokens * heads * 4
        if not isinstance(softmax_stats, bool):
            raise TypeError(f"softmax_stats: expected a bool, got {softmax_stats!r}")
        n_lse = 2 if softmax_stats else 1  # the maxima, then the sums
        step = -(-(o_bytes + n_lse * lse_bytes) // 256) * 256  # 256-byte aligned buffers
        self._state = symm.empty(n_buffers * step, dtype=torch.uint8, device=device)
        self._pads = symm.empty(exchange_pad_bytes(world) // 8, dtype=torch.int64, device=device).zero_()
        self._handles = (symm.rendezvous(self._state, group_name), symm.rendezvous(self._pads, group_name))
        self._handles[0].barrier()  # every pad zeroed before any rank signals
        state, pads = self._handles

        def view(p, b, offset, shape, dt):
            return state.get_buffer(p, shape, dt, b * step + offset)

        self._exchanges, self._buffers = [], []
        for b in range(n_buffers):
            os_ = [view(p, b, 0, (tokens, heads, head_size), dtype) for p in range(world)]
            lses = [view(p, b, o_bytes, (tokens, heads), torch.float32) for p in range(world)]
            if softmax_stats:
                lses = [(m, view(p, b, o_bytes + lse_bytes, (tokens, heads), torch.float32))
                        for p, m in enumerate(lses)]
            pad_views = [pads.get_buffer(p, self._pads.shape, torch.int64) for p in range(world)]
            self._buffers.append((os_[rank], lses[rank]))
            self._exchanges.append(Exchange(os_[rank], lses[rank], os_, lses, pad_views, rank, reuse=reuse,
                                            timeout=timeout))
        self.rank, self.world_size, self._epoch = rank, world, 0

    @property
    def o(self):
        """This rank's O buffer (the first; with reuse="alternate" see :meth:`buffers`)."""
        return self._buffers[0][0]

    @property
    def lse(self):
        """This rank's LSE buffer (the first); with softmax_stats its maxima."""
        lse = self._buffers[0][1]
        return lse[0] if isinstance(lse, tuple) else lse

    @property
    def sum(self):
        """This rank's softmax sums buffer (the first), with softmax_stats; else None."""
        lse = self._buffers[0][1]
        return lse[1] if isinstance(lse, tuple) else None

    def buffers(self, epoch: int):
        """(O, LSE) this rank writes its state of `epoch` into; with softmax_stats (O, (max, sum))."""
        return self._buffers[epoch % len(self._buffers)]

    def publish(self, epoch: int, stream: Stream = None) -> None:
        self._exchanges[epoch % len(self._exchanges)].publish(epoch, stream)

    def merge(self, epoch: int, **kwargs):
        return self._exchanges[epoch % len(self._exchanges)].merge(epoch=epoch, **kwargs)

    def status(self, stream: Stream = None) -> None:
        for x in self._exchanges:
            x.status(stream)

    def __call__(self, **kwargs):
        """Publish the next epoch and merge it: this rank's slice of the merged state."""
        self._epoch += 1
        self.publish(self._epoch)
        return self.merge(self._epoch, **kwargs)
