"""Split-KV decode with attention sinks (gpt-oss): attend to the keys in chunks, then merge.

Each decode query attends to a long key set.  The keys are split into S chunks; each chunk's
attention state (O, LSE) is computed independently (in a real server: in parallel, by a decode
kernel), then attnmerge.merge_states merges the S states in one pass.  With attention sinks each
head has a learned logit that takes a share of the softmax and contributes no value: the sink is
added once, in the merge (sink=), never in the chunks.  The result is the attention over all the
keys, with the sinks.

    python examples/split_kv_decode.py                      # CPU, float32
    python examples/split_kv_decode.py --device cuda --dtype bfloat16 --splits 32 --keys 32768

It prints the error against float64 attention with sinks over all the keys, computed in one piece.
From Python (the test does this):

    from split_kv_decode import make_problem, split_kv_attention, attention_with_sinks
    q, k, v, sinks = make_problem(seed=0)
    out, out_lse = split_kv_attention(q, k, v, sinks, splits=8)
"""

from __future__ import annotations

import argparse
import math

import torch

import attnmerge


def make_problem(seed=0, tokens=4, heads=8, head_size=64, keys=4096, dtype=torch.float32, device="cpu"):
    """Queries [tokens, heads, D], keys and values [keys, heads, D], and one sink logit per head."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(n, heads, head_size, generator=g) for n in (tokens, keys, keys))
    sinks = torch.randn(heads, generator=g)
    return (*(x.to(device=device, dtype=dtype) for x in (q, k, v)), sinks.to(device))


def chunk_state(q, k, v):
    """The attention state of one chunk of keys: O [tokens, heads, D] and LSE [tokens, heads],
    natural log, float32, as a decode kernel would write them (no sink)."""
    scores = torch.einsum("thd,khd->thk", q.float(), k.float()) / math.sqrt(q.shape[-1])
    lse = torch.logsumexp(scores, dim=-1)
    o = torch.einsum("thk,khd->thd", torch.exp(scores - lse[..., None]), v.float())
    return o.to(q.dtype), lse


def split_kv_attention(q, k, v, sinks, splits=8):
    """Attention over all the keys with the sinks: S chunk states, stacked [tokens, S, heads, D],
    merged by attnmerge with the sinks (float32 [heads], natural log like the LSEs)."""
    states = [chunk_state(q, kc, vc) for kc, vc in zip(k.chunk(splits), v.chunk(splits))]
    o = torch.stack([s[0] for s in states], dim=1)
    lse = torch.stack([s[1] for s in states], dim=1)
    return attnmerge.merge_states(o, lse, sink=sinks.float())


def attention_with_sinks(q, k, v, sinks):
    """gpt-oss's definition, in float64 and in one piece: a softmax over each head's scores and its
    sink logit, the sink's column then dropped; and the log of the softmax's denominator."""
    q, k, v = (x.double() for x in (q, k, v))
    scores = torch.einsum("thd,khd->thk", q, k) / math.sqrt(q.shape[-1])
    full = torch.cat([scores, sinks.double()[None, :, None].expand(scores.shape[0], -1, 1)], dim=-1)
    p = torch.softmax(full, dim=-1)
    return torch.einsum("thk,khd->thd", p[..., :-1], v), torch.logsumexp(full, dim=-1)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    parser.add_argument("--tokens", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--keys", type=int, default=4096)
    parser.add_argument("--splits", type=int, default=8)
    a = parser.parse_args(argv)
    q, k, v, sinks = make_problem(tokens=a.tokens, heads=a.heads, keys=a.keys, dtype=getattr(torch, a.dtype),
                                  device=a.device)
    out, out_lse = split_kv_attention(q, k, v, sinks, a.splits)
    want, want_lse = attention_with_sinks(q.cpu(), k.cpu(), v.cpu(), sinks.cpu())
    err = (out.double().cpu() - want).norm() / want.norm()
    lse_err = (out_lse.double().cpu() - want_lse).abs().max()
    print(f"{a.splits} splits of {a.keys} keys, {a.dtype} on {a.device}: relative error {err:.2e}, "
          f"LSE max abs error {lse_err:.2e}")


if __name__ == "__main__":
    main()
