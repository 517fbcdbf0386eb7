"""A decode chain, graph-captured: a producer kernel writes the states (an elementwise pass over O
and the LSEs, as an attention kernel's epilogue would), then the merge reads them; timed with and
without programmatic dependent launch (pdl=True) for the two-way, N-way and variable-length merges
at 1 to 128 tokens (bf16 O, 32 heads of 128), against the producer alone and the merge alone.
What PDL saves is the merge's launch and prologue overlapping the producer's tail; `added_*` is
what the merge adds to the chain beyond the producer."""
from __future__ import annotations

import attnmerge

from .common import pair_sets, stacked_sets

HEADS, HEAD_SIZE, STATES = 32, 128, 4
TOKENS = (1, 4, 16, 64, 128)
OPS = ("merge", "merge_states", "merge_varlen")


def add_arguments(p):
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="comma-separated token counts")


def _sets(torch, op, tokens, device, count):
    """(producer's sources and destinations, the merge's call) per input set: the producer writes
    every array the merge reads, from a source of its own."""
    if op == "merge":
        sets = pair_sets(torch, tokens, HEADS, HEAD_SIZE, device, count)
        return [((s[0], s[1], s[2], s[3]), s) for s in sets]
    sets = stacked_sets(torch, tokens, STATES, HEADS, HEAD_SIZE, device, count)
    if op == "merge_states":
        return [((s[0], s[1]), s) for s in sets]
    indptr = torch.arange(0, tokens * STATES + 1, STATES, device=device, dtype=torch.int32)
    return [((o.view(-1, HEADS, HEAD_SIZE), lse.view(-1, HEADS)),
             (o.view(-1, HEADS, HEAD_SIZE), lse.view(-1, HEADS), indptr, out, out_lse))
            for o, lse, out, out_lse in sets]


def _call(op, pdl):
    if op == "merge":
        return lambda o_a, lse_a, o_b, lse_b, out, out_lse: attnmerge.merge(
            o_a, lse_a, o_b, lse_b, out=out, out_lse=out_lse, pdl=pdl)
    if op == "merge_states":
        return lambda o, lse, out, out_lse: attnmerge.merge_states(o, lse, out=out, out_lse=out_lse, pdl=pdl)
    return lambda o, lse, indptr, out, out_lse: attnmerge.merge_varlen(o, lse, indptr, out=out, out_lse=out_lse,
                                                                       pdl=pdl)


def run(args, runner):
    torch = runner.torch
    rows = []
    for op in OPS:
        for tokens in runner.cases(int(t) for t in args.tokens.split(",")):
            pairs = _sets(torch, op, tokens, runner.device, runner.count)
            sources = [tuple(torch.randn_like(x) for x in written) for written, _ in pairs]
            # One argument list per set: the producer's sources, its destinations (the merge's inputs),
            # then the merge's own arguments; each timed function takes what it needs of it.
            sets = [(src, written, merge_args) for src, (written, merge_args) in zip(sources, pairs)]
            plain, early = _call(op, False), _call(op, True)

            def produce(src, written):
                for s, w in zip(src, written):
                    torch.mul(s, 1.0009765625, out=w)

            def producer(src, written, merge_args):
                produce(src, written)

            def merge_alone(src, written, merge_args):
                plain(*merge_args)

            def chain(src, written, merge_args):
                produce(src, written)
                plain(*merge_args)

            def chain_pdl(src, written, merge_args):
                produce(src, written)
                early(*merge_args)

            p, m, c, cp = runner.time((producer, merge_alone, chain, chain_pdl), sets)
            rows.append(dict(op=op, tokens=tokens, producer_us=p, merge_us=m, chain_us=c, chain_pdl_us=cp,
                             added_us=c - p, added_pdl_us=cp - p))
            print(f"{op} {tokens} tokens: producer {p:.2f} us, merge {m:.2f} us, chain {c:.2f} us, with PDL "
                  f"{cp:.2f} us (the merge adds {c - p:.2f} us, {cp - p:.2f} us with PDL)", flush=True)
    return rows
