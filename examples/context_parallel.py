"""Context parallelism across processes: merge the attention states of P key shards with attnmerge.

Every process (rank) holds the same queries and one shard of the keys and values.  It computes the
attention state of its shard, (O, LSE) per (token, head), and combines the ranks' states in one of
two ways (--combine):

  gather  all-gather the states of every rank with torch.distributed into one [P, tokens, heads, D]
          buffer (and [P, tokens, heads] for the LSE), and merge them in one pass with
          attnmerge.merge_states(..., states_axis=0): the gathered buffers are read where they
          are, without a copy or a permute;
  share   all-gather the LSEs alone, scale the rank's own O by its share of the merge with
          attnmerge.merge_share(o, lse_all, rank, states_axis=0), and sum the shares across ranks
          (an all-reduce here; an engine whose next layer is sharded by heads reduce-scatters
          instead, as vLLM's decode context parallelism does): the outputs cross the network once,
          summed, rather than P times.

Either way the result is the attention over all the keys.

Run it with torchrun, one process per GPU (NCCL) when CUDA is available, else on the CPU (gloo):

    torchrun --nproc-per-node 4 examples/context_parallel.py
    torchrun --nproc-per-node 2 examples/context_parallel.py --tokens 256 --keys 8192 --dtype bfloat16

Rank 0 prints its error against single-process float64 attention over all the keys.

From Python (the test does this), after torch.distributed.init_process_group:

    from context_parallel import make_problem, context_parallel_attention
    q, k, v = make_problem(seed=0, tokens=64, heads=8, head_size=128, keys=4096)
    out, out_lse = context_parallel_attention(q, k, v)   # the full attention, on every rank
    out, out_lse = context_parallel_attention(q, k, v, combine="share")

or `run(rank, world_size, init_method, ...)`, which also sets up and tears down the process group.
"""

from __future__ import annotations

import argparse
import math
import os

import torch
import torch.distributed as dist

import attnmerge


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


def partial_attention(q, k, v, scale):
    """The attention state of q over these keys, per head: O [tokens, heads, D] in q's dtype and
    LSE [tokens, heads] float32 (natural log).  No keys: LSE = -inf (an empty part)."""
    qf, kf, vf = q.float(), k.float(), v.float()
    scores = torch.einsum("thd,khd->htk", qf, kf) * scale  # [heads, tokens, keys]
    lse = torch.logsumexp(scores, dim=-1)  # [heads, tokens]
    o = torch.einsum("htk,khd->thd", torch.softmax(scores, dim=-1), vf)
    if k.shape[0] == 0:
        o = torch.zeros_like(qf)
    return o.to(q.dtype).contiguous(), lse.transpose(0, 1).contiguous()


def _all_gather(local, group=None):
    """[P, *local.shape]: every rank's `local`, gathered into one buffer (a view of it, no copy)."""
    world = dist.get_world_size(group)
    flat = torch.empty((world * local.shape[0],) + tuple(local.shape[1:]), dtype=local.dtype, device=local.device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(flat, local, group=group)  # the concatenated form: gloo and NCCL both take it
    return flat.view((world,) + tuple(local.shape))


def context_parallel_attention(q, k, v, scale=None, group=None, out_dtype=None, combine="gather"):
    """The attention of q over all the keys, each rank computing only its shard: (out, out_lse).

    q, k, v are the full tensors (the same on every rank); a real model would hold only its shard.
    combine: "gather" (the states all-gathered, then merge_states) or "share" (the LSEs
    all-gathered, each rank's share of the merge by merge_share, the shares summed by an
    all-reduce).
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    begin, end = shard_bounds(k.shape[0], world, rank)
    o, lse = partial_attention(q, k[begin:end], v[begin:end], scale)
    lse_all = _all_gather(lse, group)  # [P, tokens, heads]
    if combine == "gather":
        o_all = _all_gather(o, group)  # [P, tokens, heads, D]
        return attnmerge.merge_states(o_all, lse_all, states_axis=0, out_dtype=out_dtype)
    if combine != "share":
        raise ValueError(f"combine: expected 'gather' or 'share', got {combine!r}")
    out, out_lse = attnmerge.merge_share(o, lse_all, rank, states_axis=0, out_dtype=out_dtype)
    dist.all_reduce(out, group=group)  # the sum of the shares: the merge
    return out, out_lse


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


def run(rank, world_size, init_method, backend=None, device=None, seed=0, tokens=64, heads=8, head_size=128,
        keys=4096, dtype="float32", combine="gather"):
    """Join a process group, compute the context-parallel attention, leave: (out, out_lse) on the CPU."""
    cuda = torch.cuda.is_available() if device is None else str(device).startswith("cuda")
    backend = backend or ("nccl" if cuda else "gloo")
    if device is None:
        device = f"cuda:{rank % torch.cuda.device_count()}" if cuda else "cpu"
    if str(device).startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
    try:
        q, k, v = make_problem(seed, tokens, heads, head_size, keys, getattr(torch, dtype), device)
        out, out_lse = context_parallel_attention(q, k, v, combine=combine)
        if str(device).startswith("cuda"):
            torch.cuda.synchronize()
        return out.cpu(), out_lse.cpu()
    finally:
        dist.destroy_process_group()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-size", type=int, default=128)
    ap.add_argument("--keys", type=int, default=4096)
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--backend", default=None, help="nccl or gloo (default: nccl with CUDA, else gloo)")
    ap.add_argument("--device", default=None, help="cpu, or cuda (one GPU per process, by LOCAL_RANK)")
    ap.add_argument("--save", default=None, help="a folder: each rank saves its result as rank<R>.pt")
    ap.add_argument("--combine", default="gather", choices=["gather", "share"],
                    help="all-gather the states and merge_states them, or all-gather the LSEs and sum merge_share's "
                         "shares (default: %(default)s)")
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
    out, out_lse = run(rank, world, "env://", backend, device, args.seed, args.tokens, args.heads,
                       args.head_size, args.keys, args.dtype, args.combine)
    if args.save:
        torch.save({"out": out, "out_lse": out_lse}, os.path.join(args.save, f"rank{rank}.pt"))
    if rank == 0:
        q, k, v = make_problem(args.seed, args.tokens, args.heads, args.head_size, args.keys,
                               getattr(torch, args.dtype))
        max_o, rel_o, max_lse = errors(out, out_lse, reference_attention(q, k, v))
        print(f"{world} ranks ({backend} on {device.split(':')[0]}, combined by {args.combine}), "
              f"{args.tokens} tokens x {args.heads} heads x {args.head_size}, {args.keys} keys, {args.dtype}: "
              f"max |O - ref| {max_o:.3g} (relative L2 {rel_o:.3g}), max |LSE - ref| {max_lse:.3g}")


if __name__ == "__main__":
    main()
