"""Context parallelism in JAX: the attention states of P key shards merged with attnmerge.jax inside
jax.shard_map.

Each device of a mesh axis "cp" holds the same queries and one shard of the keys and values,
computes the attention state of its shard, (O, LSE) per (token, head), and the devices' states are
combined into the attention over all the keys, in one of four forms:

  gather      all_gather every device's O and LSE ([P, T, H, D], [P, T, H]) and merge_states them,
              states_axis=0: every device gets every head.
  share       all_gather the LSEs alone, each device's share of the merge (merge_share) and a
              psum_scatter over heads sums the shares: each device gets its heads.
  all_to_all  device p receives heads p*H/P .. of every device's state; all_to_all's concat_axis
              puts the devices' axis where the merge reads it (--layout: [P, T, H/P, D],
              [T, P, H/P, D] or [T, H/P, P, D]); packed: O and LSE in one array of records, one
              all_to_all.
  ring        the key/value shards travel round the ring (ppermute), each step's state merged into a
              float32 accumulator with attnmerge.jax.merge: every device gets every head.

(The fused exchange reads peers' memory through pointers, which XLA does not hand out: it is
PyTorch's and the C ABI's, examples/context_parallel.py.)

    XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu python examples/context_parallel_jax.py
    python examples/context_parallel_jax.py --dtype bfloat16      # on the GPUs JAX sees

It prints, per mesh size (--worlds) and form, the error of device 0's result against float64
attention over all the keys computed on the host.
"""
from __future__ import annotations

import argparse
import math

import numpy as np
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

try:
    from jax import shard_map
except ImportError:  # JAX before 0.7
    from jax.experimental.shard_map import shard_map

import attnmerge.jax

AXIS = "cp"
LAYOUTS = ("cp,T,H,D", "T,cp,H,D", "T,H,cp,D")


def partial_attention(q, k, v, scale, o_dtype=None):
    """The attention state of q over these keys: O [tokens, heads, D] (o_dtype, else q's) and LSE
    [tokens, heads] float32."""
    scores = jnp.einsum("thd,khd->htk", q.astype(jnp.float32), k.astype(jnp.float32)) * scale
    lse = jax.nn.logsumexp(scores, axis=-1)  # [heads, tokens]
    o = jnp.einsum("htk,khd->thd", jnp.exp(scores - lse[..., None]), v.astype(jnp.float32))
    return o.astype(o_dtype or q.dtype), lse.T


def combine_gather(o, lse):
    """Every head of the merge: the states all-gathered and merged."""
    return attnmerge.jax.merge_states(jax.lax.all_gather(o, AXIS), jax.lax.all_gather(lse, AXIS), states_axis=0)


def combine_share(o, lse):
    """This device's heads of the merge: the LSEs all-gathered, the shares summed by a psum_scatter."""
    every = jax.lax.all_gather(lse, AXIS)  # [P, tokens, heads]
    own_first = jnp.roll(every, -jax.lax.axis_index(AXIS), axis=0)  # merge_share's index is static
    share, out_lse = attnmerge.jax.merge_share(o, own_first, 0, states_axis=0)
    mine = jax.lax.psum_scatter(share, AXIS, scatter_dimension=1, tiled=True)  # [tokens, heads / P, D]
    heads = mine.shape[1]
    return mine, jax.lax.dynamic_slice_in_dim(out_lse, jax.lax.axis_index(AXIS) * heads, heads, axis=1)


def pack_records(o, lse):
    """Records [..., D + 16 / itemsize] of o's dtype: O, the float32 LSE bit-cast into the lanes
    after it, zeros to 16 bytes (D + 8 lanes of bf16)."""
    lse_lanes = 4 // o.dtype.itemsize
    bits = jax.lax.bitcast_convert_type(lse, o.dtype).reshape(*lse.shape, lse_lanes)
    padding = jnp.zeros((*lse.shape, 16 // o.dtype.itemsize - lse_lanes), o.dtype)
    return jnp.concatenate([o, bits, padding], axis=-1)


def unpack_records(records, head_size):
    """(o, lse) of records: O's lanes, and the LSE's bit-cast back to float32."""
    lse_lanes = records[..., head_size:head_size + 4 // records.dtype.itemsize]
    lse = jax.lax.bitcast_convert_type(lse_lanes, jnp.float32).reshape(records.shape[:-1])
    return records[..., :head_size], lse


def combine_all_to_all(o, lse, layout=0, packed=False):
    """This device's heads of the merge: device p receives heads p*H/P .. of every device's state, the
    devices' axis at `layout` of the receive buffer (0, 1 or 2), where merge_states reads it."""
    world = jax.lax.psum(1, AXIS)  # the axis' size
    tokens, heads, d = o.shape
    if packed:  # one all_to_all moves both
        records = pack_records(o, lse).reshape(tokens, world, heads // world, -1)
        recv_o, recv_lse = unpack_records(jax.lax.all_to_all(records, AXIS, 1, layout), d)
    else:
        recv_o = jax.lax.all_to_all(o.reshape(tokens, world, heads // world, d), AXIS, 1, layout)
        recv_lse = jax.lax.all_to_all(lse.reshape(tokens, world, heads // world), AXIS, 1, layout)
    return attnmerge.jax.merge_states(recv_o, recv_lse, states_axis=layout)


def ring_attention(q, k, v, scale):
    """Every head of the attention over every device's keys: the shards travel round the ring, each
    step's state merged into a float32 accumulator while the next shard arrives."""
    world = jax.lax.psum(1, AXIS)
    acc_o = jnp.zeros(q.shape, jnp.float32)
    acc_lse = jnp.full(q.shape[:2], -jnp.inf, jnp.float32)  # an empty state to start from
    for step in range(world):
        if step + 1 < world:
            arriving = jax.lax.ppermute((k, v), AXIS, [(i, (i + 1) % world) for i in range(world)])
        acc_o, acc_lse = attnmerge.jax.merge(acc_o, acc_lse, *partial_attention(q, k, v, scale, jnp.float32))
        if step + 1 < world:
            k, v = arriving
    return acc_o.astype(q.dtype), acc_lse


def heads_of(combine, device, world, heads):
    """[begin, end) of the heads of the merge a form leaves on `device`."""
    if combine in ("gather", "ring"):
        return 0, heads
    return device * (heads // world), (device + 1) * (heads // world)


def variants():
    """Every (combine, layout, packed) the example runs."""
    return ([("gather", 0, False), ("share", 0, False)]
            + [("all_to_all", layout, packed) for layout in range(len(LAYOUTS)) for packed in (False, True)]
            + [("ring", 0, False)])


def label(combine, layout=0, packed=False):
    if combine != "all_to_all":
        return combine
    return f"all_to_all[{LAYOUTS[layout]}{', packed' if packed else ''}]"


def context_parallel_attention(q, k, v, mesh, combine="gather", layout=0, packed=False):
    """Every device's result, stacked: (out [P, tokens, heads', D], out_lse [P, tokens, heads']),
    heads' the heads heads_of names.  q replicated, k and v sharded over their keys."""
    scale = 1.0 / math.sqrt(q.shape[-1])

    def body(q, k, v):
        if combine == "ring":
            out, out_lse = ring_attention(q, k, v, scale)
        else:
            o, lse = partial_attention(q, k, v, scale)
            if combine == "gather":
                out, out_lse = combine_gather(o, lse)
            elif combine == "share":
                out, out_lse = combine_share(o, lse)
            else:
                out, out_lse = combine_all_to_all(o, lse, layout, packed)
        return out[None], out_lse[None]

    f = shard_map(body, mesh=mesh, in_specs=(P(), P(AXIS), P(AXIS)), out_specs=(P(AXIS), P(AXIS)))
    return jax.jit(f)(q, k, v)


def make_problem(seed=0, tokens=64, heads=8, head_size=128, keys=4096, dtype="float32"):
    """NumPy float32 queries [tokens, heads, D] and keys, values [keys, heads, D], rounded to dtype."""
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((n, heads, head_size), dtype=np.float32) for n in (tokens, keys, keys))
    return tuple(np.asarray(jnp.asarray(x, dtype).astype(jnp.float32)) for x in (q, k, v))


def reference_attention(q, k, v):
    """float64 attention over all the keys on the host: (O [T, H, D], LSE [T, H])."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    scores = np.einsum("thd,khd->thk", q, k) / math.sqrt(q.shape[-1])
    lse = np.logaddexp.reduce(scores, axis=-1)
    return np.einsum("thk,khd->thd", np.exp(scores - lse[..., None]), v), lse


def run(worlds, seed=0, tokens=64, heads=8, head_size=128, keys=4096, dtype="float32"):
    """{(world, label): (out, out_lse)} on the host, every form on a mesh of the first `world`
    devices for each world."""
    q, k, v = make_problem(seed, tokens, heads, head_size, keys, dtype)
    q, k, v = (jnp.asarray(x, dtype) for x in (q, k, v))
    results = {}
    for world in worlds:
        mesh = Mesh(np.array(jax.devices()[:world]), (AXIS,))
        for combine, layout, packed in variants():
            out, out_lse = context_parallel_attention(q, k, v, mesh, combine, layout, packed)
            results[world, label(combine, layout, packed)] = (np.asarray(out.astype(jnp.float32)),
                                                              np.asarray(out_lse))
    return results


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", default=None, help="mesh sizes, comma-separated (default: every device)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-size", type=int, default=128)
    ap.add_argument("--keys", type=int, default=4096, help="a multiple of every mesh size")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save", default=None, help="an .npz file for every result")
    args = ap.parse_args(argv)
    worlds = [jax.device_count()] if args.worlds is None else [int(w) for w in args.worlds.split(",")]
    results = run(worlds, args.seed, args.tokens, args.heads, args.head_size, args.keys, args.dtype)
    if args.save:
        np.savez(args.save, **{f"{w}/{name}/{part}": x for (w, name), pair in results.items()
                               for part, x in zip(("out", "out_lse"), pair)})
    ref_o, ref_lse = reference_attention(*make_problem(args.seed, args.tokens, args.heads, args.head_size,
                                                       args.keys, args.dtype))
    for (world, name), (out, out_lse) in results.items():
        begin, end = heads_of(name.split("[")[0], 0, world, args.heads)
        err_o = np.abs(out[0] - ref_o[:, begin:end])
        rel = np.linalg.norm(out[0] - ref_o[:, begin:end]) / np.linalg.norm(ref_o[:, begin:end])
        err_lse = np.abs(out_lse[0] - ref_lse[:, begin:end]).max()
        print(f"{world} devices, {name:<28} device 0, heads {begin}-{end - 1}: max |O - ref| {err_o.max():.3g} "
              f"(relative L2 {rel:.3g}), max |LSE - ref| {err_lse:.3g}")


if __name__ == "__main__":
    main()
