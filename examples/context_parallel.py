"""Context parallelism across processes: merge the attention states of P key shards with attnmerge.

Every process (rank) holds the same queries and one shard of the keys and values.  It computes the
attention state of its shard, (O, LSE) per (token, head), and the ranks' states are combined into
the attention over all the keys, in one of five forms (--combine):

  gather      all-gather every rank's O and LSE into [P, tokens, heads, D] and [P, tokens, heads]
              and merge them in one pass, merge_states(..., states_axis=0), read where they landed:
              every rank gets every head.
  share       all-gather the LSEs alone; each rank scales its own O by its share of the merge
              (merge_share, written head-major) and a reduce-scatter over heads sums the shares:
              each rank gets its heads, and each output crosses the network once, summed.
  all_to_all  each rank sends heads p*H/P .. of its state to rank p; merge_states reads the receive
              buffer where the ranks' axis lands (--layout: [P, T, H/P, D], [T, P, H/P, D] or
              [T, H/P, P, D]); --packed moves O and LSE in one buffer of records, one exchange.
  ring        the key/value shards travel round the ring (send/recv); each step's state is merged
              into a float32 accumulator with merge_inplace: every rank gets every head.
  fused       the exchange in the merge: every rank's state lies in memory every rank addresses
              (PyTorch's symmetric memory on GPUs of one node; on the CPU a shared-memory file
              every process maps) and attnmerge's Exchange reads this rank's heads of each where it
              lies.
  all         every form (and every all_to_all layout, plain and packed, the backend can take).

Run it with torchrun, one process per GPU (NCCL) when CUDA is available, else on the CPU (gloo):

    torchrun --nproc-per-node 4 examples/context_parallel.py
    torchrun --nproc-per-node 2 examples/context_parallel.py --combine share --tokens 256 --dtype bfloat16

Rank 0 prints each form's error against single-process float64 attention over all the keys.  The
processes keep NVLink multicast off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 unless
set otherwise).

From Python (the tests do this), after torch.distributed.init_process_group:

    from context_parallel import make_problem, context_parallel_attention
    q, k, v = make_problem(seed=0, tokens=64, heads=8, head_size=128, keys=4096)
    out, out_lse = context_parallel_attention(q, k, v, combine="share")   # this rank's heads

or `run(rank, world_size, init_method, ...)`, which also sets up and tears down the process group
and returns every form's result.
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
import uuid

import torch
import torch.distributed as dist

import attnmerge

FORMS = ("gather", "share", "all_to_all", "ring", "fused")
#: the all-to-all's receive buffers: the ranks' axis at index 0, 1 or 2 (merge_states' states_axis)
LAYOUTS = ("cp,T,H,D", "T,cp,H,D", "T,H,cp,D")
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


def make_problem(seed=0, tokens=64, heads=8, head_size=128, keys=4096, dtype=torch.float32, device="cpu"):
    """Queries [tokens, heads, D] and keys, values [keys, heads, D]: the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, heads, head_size, generator=g)
    k = torch.randn(keys, heads, head_size, generator=g)
    v = torch.randn(keys, heads, head_size, generator=g)
    return tuple(x.to(device=device, dtype=dtype) for x in (q, k, v))


def shard_bounds(keys, world_size, rank):
    """[begin, end) of this rank's contiguous shard of the keys (sizes differ by at most one)."""
    base, extra = divmod(keys, world_size)
    begin = rank * base + min(rank, extra)
    return begin, begin + base + (rank < extra)


def partial_attention(q, k, v, scale, o_dtype=None):
    """The attention state of q over these keys, per head: O [tokens, heads, D] (in o_dtype, else
    q's) and LSE [tokens, heads] float32 (natural log).  No keys: LSE = -inf (an empty part)."""
    qf, kf, vf = q.float(), k.float(), v.float()
    scores = torch.einsum("thd,khd->htk", qf, kf) * scale  # [heads, tokens, keys]
    lse = torch.logsumexp(scores, dim=-1)  # [heads, tokens]
    o = torch.einsum("htk,khd->thd", torch.softmax(scores, dim=-1), vf)
    if k.shape[0] == 0:
        o = torch.zeros_like(qf)
    return o.to(o_dtype or q.dtype).contiguous(), lse.transpose(0, 1).contiguous()


# ---- the forms: each takes this rank's state and returns its part of the merge -----------------


# The single-tensor collectives, by their newer names where this torch has them.
all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_into = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather(local, group=None):
    """[P, *local.shape]: every rank's tensor, in one buffer."""
    world = dist.get_world_size(group)
    flat = torch.empty((world * local.shape[0], *local.shape[1:]), dtype=local.dtype, device=local.device)
    all_gather_into(flat, local.contiguous(), group=group)
    return flat.view(world, *local.shape)


def combine_gather(o, lse, group=None):
    """Every head of the merge: the states all-gathered and merged where they landed."""
    return attnmerge.merge_states(all_gather(o, group), all_gather(lse, group), states_axis=0)


def combine_share(o, lse, group=None):
    """This rank's heads of the merge: the LSEs all-gathered, this rank's share of the merge written
    head-major, and a reduce-scatter over heads sums the shares."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    tokens, heads, d = o.shape
    shares = torch.empty(heads, tokens, d, dtype=o.dtype, device=o.device)  # chunk p: rank p's heads
    _, out_lse = attnmerge.merge_share(o, all_gather(lse, group), rank, states_axis=0, out=shares.transpose(0, 1))
    mine = torch.empty(heads // world, tokens, d, dtype=o.dtype, device=o.device)
    reduce_scatter_into(mine, shares, group=group)  # the sum of the shares: the merge
    return mine.transpose(0, 1), out_lse[:, rank * (heads // world):(rank + 1) * (heads // world)]


def all_to_all(send, layout=0, group=None):
    """send [P, ...]: chunk p goes to rank p.  Returns the receive buffer, the ranks' axis at `layout`."""
    shape = list(send.shape[1:])
    shape.insert(layout, send.shape[0])
    recv = torch.empty(shape, dtype=send.dtype, device=send.device)
    if layout == 0:
        dist.all_to_all_single(recv, send.contiguous(), group=group)
        return recv
    views = list(recv.unbind(layout))
    try:  # into strided views of the buffer (gloo writes them; NCCL takes contiguous ones only)
        dist.all_to_all(views, list(send.unbind(0)), group=group)
    except RuntimeError as e:  # a gloo without the list form (older torch): refused on every rank alike
        if "does not support alltoall" not in str(e):
            raise
        landed = torch.empty(send.shape, dtype=send.dtype, device=send.device)  # contiguous, as send is sent
        dist.all_to_all_single(landed, send.contiguous(), group=group)
        for view, chunk in zip(views, landed):
            view.copy_(chunk)
    return recv


def pack_records(o, lse):
    """Records [..., D + 16 / itemsize] of o's dtype: a row's O, its float32 LSE bit-cast into the
    lanes after it, the rest padding, so that rows stay 16-byte aligned (D + 8 lanes of bf16)."""
    d = o.shape[-1]
    records = torch.zeros(*o.shape[:-1], d + 16 // o.element_size(), dtype=o.dtype, device=o.device)
    records[..., :d] = o
    unpack_records(records, d)[1].copy_(lse)
    return records


def unpack_records(records, head_size):
    """(o, lse): two strided views of the one buffer of records, no copy."""
    lse_lanes = records[..., head_size:head_size + 4 // records.element_size()]
    return records[..., :head_size], lse_lanes.view(torch.float32)[..., 0]


def combine_all_to_all(o, lse, group=None, layout=0, packed=False):
    """This rank's heads of the merge: rank p receives heads p*H/P .. of every rank's state, and
    merge_states reads the receive buffer where the ranks' axis lands (`layout`: 0, 1 or 2)."""
    world = dist.get_world_size(group)
    tokens, heads, d = o.shape
    send_o = o.view(tokens, world, heads // world, d).transpose(0, 1)  # [P, T, H/P, D]: chunk p to rank p
    send_lse = lse.view(tokens, world, heads // world).transpose(0, 1)
    if packed:  # one exchange moves both
        recv_o, recv_lse = unpack_records(all_to_all(pack_records(send_o, send_lse), layout, group), d)
    else:
        recv_o, recv_lse = all_to_all(send_o, layout, group), all_to_all(send_lse, layout, group)
    return attnmerge.merge_states(recv_o, recv_lse, states_axis=layout)


def ring_attention(q, kv, sizes, scale, group=None):
    """Every head of the attention over every rank's keys: the [2, keys, H, D] key/value shards
    travel round the ring (`sizes`: each rank's key count), each step's state merged into a float32
    accumulator while the next shard arrives."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    peer = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
    acc_o = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    acc_lse = torch.full(q.shape[:2], -math.inf, device=q.device)  # an empty state to start from
    for step in range(world):
        if step + 1 < world:
            arriving = kv.new_empty((2, sizes[(rank - step - 1) % world], *kv.shape[2:]))
            pending = dist.batch_isend_irecv([dist.P2POp(dist.isend, kv, peer((rank + 1) % world), group),
                                              dist.P2POp(dist.irecv, arriving, peer((rank - 1) % world), group)])
        attnmerge.merge_inplace(acc_o, acc_lse, *partial_attention(q, kv[0], kv[1], scale, torch.float32))
        if step + 1 < world:
            for p in pending:
                p.wait()
            kv = arriving
    return acc_o.to(q.dtype), acc_lse


def combine_fused(o, lse, buffers, rank, epoch=1):
    """This rank's heads of the merge, on the host: `buffers` (every rank's O, LSE and signal pad,
    [P, T, H, D], [P, T, H], [P, words]) lie in memory every process maps."""
    o_all, lse_all, pads = buffers
    o_all[rank].copy_(o)  # where the attention kernel would write
    lse_all[rank].copy_(lse)
    x = attnmerge.Exchange(o_all[rank], lse_all[rank], o_all, lse_all, pads, rank)
    x.publish(epoch)
    return x.merge(epoch=epoch)


def combine_symmetric(o, lse, group=None):
    """This rank's heads of the merge, on GPUs of one node: the states in PyTorch's symmetric memory."""
    cp = attnmerge.SymmetricExchange(group or dist.group.WORLD, *o.shape, dtype=o.dtype)
    cp.o.copy_(o)  # where the attention kernel would write
    cp.lse.copy_(lse)
    return cp()


def host_buffers(world, tokens, heads, head_size, dtype, group=None):
    """(o_all, lse_all, pads) for combine_fused in memory every process addresses: tensors in shared
    memory (share_memory_()) to hand to processes this one starts, or with a process group a file
    every rank maps (rank 0 creates it; removed once every rank has mapped it)."""
    pad_words = attnmerge.exchange_pad_bytes(world) // 8
    sizes = (world * pad_words * 8, world * tokens * heads * 4, world * tokens * heads * head_size * dtype.itemsize)
    offsets = [0]
    for size in sizes:  # each region 64-byte aligned
        offsets.append(offsets[-1] + -(-size // 64) * 64)
    nbytes = offsets[-1]
    if group is None and not dist.is_initialized():
        raw = torch.zeros(nbytes, dtype=torch.uint8).share_memory_()
    else:
        path = [None]
        if dist.get_rank(group) == 0:
            folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
            path[0] = os.path.join(folder, f"attnmerge-cp-{uuid.uuid4().hex}")
            with open(path[0], "wb") as f:
                f.truncate(nbytes)  # zeros: the pads start zeroed
        dist.broadcast_object_list(path, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
        raw = torch.from_file(path[0], shared=True, size=nbytes, dtype=torch.uint8)
        dist.barrier(group=group)
        if dist.get_rank(group) == 0:
            os.unlink(path[0])
    pads, lse_all, o_all = (raw[at:at + size] for at, size in zip(offsets, sizes))
    return (o_all.view(dtype).view(world, tokens, heads, head_size),
            lse_all.view(torch.float32).view(world, tokens, heads), pads.view(torch.int64).view(world, pad_words))


# ---- the driver ---------------------------------------------------------------------------------


def heads_of(combine, rank, world, heads):
    """[begin, end) of the heads of the merge a form leaves on `rank`: every head (gather, ring) or
    its share."""
    if combine in ("gather", "ring"):
        return 0, heads
    return rank * (heads // world), (rank + 1) * (heads // world)


def context_parallel_attention(q, k, v, combine="gather", scale=None, group=None, layout=0, packed=False,
                               buffers=None):
    """The attention of q over all the keys, each rank computing only its shard: (out, out_lse) of
    the heads heads_of(combine, ...) names.

    q, k, v are the full tensors (the same on every rank); a real model would hold only its shard.
    combine: one of FORMS; layout and packed: the all_to_all form's receive buffer (LAYOUTS' index)
    and whether O and LSE travel as records; buffers: the fused form's on the CPU (host_buffers;
    made here, over `group`, when None).
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    begin, end = shard_bounds(k.shape[0], world, rank)
    if combine == "ring":
        sizes = [e - b for b, e in (shard_bounds(k.shape[0], world, r) for r in range(world))]
        return ring_attention(q, torch.stack([k[begin:end], v[begin:end]]), sizes, scale, group)
    if combine not in FORMS:
        raise ValueError(f"combine: expected one of {', '.join(FORMS)}, got {combine!r}")
    if combine != "gather" and q.shape[1] % world:
        raise ValueError(f"heads: expected a multiple of the {world} ranks for combine={combine!r}, got {q.shape[1]}")
    if combine == "all_to_all" and layout and dist.get_backend(group) == "nccl":
        raise ValueError(f"layout: expected 0 with NCCL (its all_to_all takes contiguous tensors only), got {layout}")
    o, lse = partial_attention(q, k[begin:end], v[begin:end], scale)
    if combine == "gather":
        return combine_gather(o, lse, group)
    if combine == "share":
        return combine_share(o, lse, group)
    if combine == "all_to_all":
        return combine_all_to_all(o, lse, group, layout, packed)
    if o.is_cuda:
        return combine_symmetric(o, lse, group)
    return combine_fused(o, lse, buffers or host_buffers(world, *o.shape, o.dtype, group), rank)


def variants(combine="all", layout=0, packed=False, backend="gloo"):
    """The (combine, layout, packed) runs of --combine: one, or with "all" every form and every
    all_to_all layout, plain and packed, that the backend takes."""
    if combine != "all":
        return [(combine, layout, packed)]
    layouts = [0] if backend == "nccl" else range(len(LAYOUTS))
    return ([("gather", 0, False), ("share", 0, False)]
            + [("all_to_all", lay, pk) for lay in layouts for pk in (False, True)]
            + [("ring", 0, False), ("fused", 0, False)])


def label(combine, layout=0, packed=False):
    """A run's name: the form, and for all_to_all its receive buffer ("all_to_all[T,cp,H,D, packed]")."""
    if combine != "all_to_all":
        return combine
    return f"all_to_all[{LAYOUTS[layout]}{', packed' if packed else ''}]"


def run(rank, world_size, init_method, backend=None, device=None, seed=0, tokens=64, heads=8, head_size=128,
        keys=4096, dtype="float32", combine="all", layout=0, packed=False, buffers=None):
    """Join a process group, run the forms `combine` names (variants()), leave: {label: (out,
    out_lse, heads)} on the CPU, heads the [begin, end) of the heads out holds.  buffers: the fused form's on
    the CPU when its processes were handed them (host_buffers before they started)."""
    for name, value in MULTICAST_OFF.items():
        os.environ.setdefault(name, value)
    cuda = torch.cuda.is_available() if device is None else str(device).startswith("cuda")
    backend = backend or ("nccl" if cuda else "gloo")
    if device is None:
        device = f"cuda:{rank % torch.cuda.device_count()}" if cuda else "cpu"
    if str(device).startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
    try:
        q, k, v = make_problem(seed, tokens, heads, head_size, keys, getattr(torch, dtype), device)
        results = {}
        for form, lay, pk in variants(combine, layout, packed, backend):
            if form == "fused" and buffers is None and not q.is_cuda:
                buffers = host_buffers(world_size, tokens, heads, head_size, q.dtype)
            out, out_lse = context_parallel_attention(q, k, v, form, layout=lay, packed=pk, buffers=buffers)
            if q.is_cuda:
                torch.cuda.synchronize()
            results[label(form, lay, pk)] = (out.cpu(), out_lse.cpu(), heads_of(form, rank, world_size, heads))
        return results
    finally:
        dist.destroy_process_group()


def reference_attention(q, k, v, scale=None):
    """Single-process attention over all the keys, in float64 on the CPU: (O, LSE)."""
    q, k, v = (x.detach().to("cpu", torch.float64) for x in (q, k, v))
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = torch.einsum("thd,khd->htk", q, k) * scale
    lse = torch.logsumexp(scores, dim=-1)
    o = torch.einsum("htk,khd->thd", torch.softmax(scores, dim=-1), v)
    return o, lse.transpose(0, 1)


def errors(out, out_lse, ref):
    """(max |O - ref|, relative L2 error of O, max |LSE - ref|)."""
    o = out.detach().to("cpu", torch.float64)
    lse = out_lse.detach().to("cpu", torch.float64)
    d = o - ref[0]
    return float(d.abs().max()), float(d.norm() / ref[0].norm()), float((lse - ref[1]).abs().max())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--combine", default="all", choices=FORMS + ("all",), help="the form (default: %(default)s)")
    ap.add_argument("--layout", default=LAYOUTS[0], choices=LAYOUTS,
                    help="all_to_all: the receive buffer, cp the ranks' axis (default: %(default)s)")
    ap.add_argument("--packed", action="store_true", help="all_to_all: O and LSE in one buffer of records")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-size", type=int, default=128)
    ap.add_argument("--keys", type=int, default=4096)
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--backend", default=None, help="nccl or gloo (default: nccl with CUDA, else gloo)")
    ap.add_argument("--device", default=None, help="cpu, or cuda (one GPU per process, by LOCAL_RANK)")
    ap.add_argument("--save", default=None, help="a folder: each rank saves its results as rank<R>.pt")
    args = ap.parse_args(argv)

    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    device = args.device
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        device = f"cuda:{local_rank}"
    backend = args.backend or ("nccl" if device.startswith("cuda") else "gloo")
    results = run(rank, world, "env://", backend, device, args.seed, args.tokens, args.heads, args.head_size,
                  args.keys, args.dtype, args.combine, LAYOUTS.index(args.layout), args.packed)
    if args.save:
        torch.save(results, os.path.join(args.save, f"rank{rank}.pt"))
    if rank == 0:
        q, k, v = make_problem(args.seed, args.tokens, args.heads, args.head_size, args.keys,
                               getattr(torch, args.dtype))
        ref_o, ref_lse = reference_attention(q, k, v)
        print(f"{world} ranks ({backend} on {device.split(':')[0]}), {args.tokens} tokens x {args.heads} heads x "
              f"{args.head_size}, {args.keys} keys, {args.dtype}; rank 0 against float64 attention:")
        for name, (out, out_lse, heads) in results.items():
            mine = slice(*heads)
            max_o, rel_o, max_lse = errors(out, out_lse, (ref_o[:, mine], ref_lse[:, mine]))
            print(f"  {name:<28} heads {heads[0]}-{heads[1] - 1}: max |O - ref| {max_o:.3g} "
                  f"(relative L2 {rel_o:.3g}), max |LSE - ref| {max_lse:.3g}")


if __name__ == "__main__":
    main()
