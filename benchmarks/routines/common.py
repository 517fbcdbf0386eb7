"""What the routines share: the input sets of the routines that time attnmerge against itself,
their alternated timing, and the `Runner` that says where a routine's calls run (the GPU, timed;
or, under --check-cpu, once each on CPU tensors of the routine's smallest cases, untimed).

The timers themselves are attnmerge.bench.timing's (the package's, which `python -m attnmerge bench`
uses too); what lives here only the repository's benchmarks use."""
from __future__ import annotations

import math
import statistics

from attnmerge.bench.timing import graph_us, input_sets


def pair_sets(torch, tokens, heads, head_size, device="cuda", count=None):
    """Input sets of a two-way merge, as many as input_sets gives for their bytes (or `count`):
    each (o_a, lse_a, o_b, lse_b: bf16 [tokens, heads, head_size] and float32 [tokens, heads], and
    the outputs out, out_lse of those shapes)."""
    nbytes = 3 * tokens * heads * head_size * 2
    return [(torch.randn(tokens, heads, head_size, device=device, dtype=torch.bfloat16),
             torch.randn(tokens, heads, device=device),
             torch.randn(tokens, heads, head_size, device=device, dtype=torch.bfloat16),
             torch.randn(tokens, heads, device=device),
             torch.empty(tokens, heads, head_size, device=device, dtype=torch.bfloat16),
             torch.empty(tokens, heads, device=device)) for _ in range(count or input_sets(nbytes))]


def stacked_sets(torch, tokens, states, heads, head_size, device="cuda", count=None):
    """Input sets of an N-way merge, as many as input_sets gives for their bytes (or `count`): each
    (o bf16 [tokens, states, heads, head_size], lse float32 [tokens, states, heads], and the outputs
    out bf16 [tokens, heads, head_size], out_lse float32 [tokens, heads])."""
    nbytes = (states + 1) * tokens * heads * head_size * 2
    return [(torch.randn(tokens, states, heads, head_size, device=device, dtype=torch.bfloat16),
             torch.randn(tokens, states, heads, device=device),
             torch.empty(tokens, heads, head_size, device=device, dtype=torch.bfloat16),
             torch.empty(tokens, heads, device=device)) for _ in range(count or input_sets(nbytes))]


def alternated_graph_us(torch, fns, sets, rounds=3, **graph_options):
    """graph_us of each of `fns` over the same sets, timed in turn `rounds` times (so that a drift of
    the GPU's clocks meets them alike): each one's median, in the order of fns."""
    times = [[] for _ in fns]
    for _ in range(rounds):
        for t, fn in zip(times, fns):
            t.append(graph_us(torch, fn, sets, **graph_options))
    return [statistics.median(t) for t in times]


class Runner:
    """Where a routine's calls run.  On the GPU (the default): input sets on "cuda", as many as each
    routine's set maker gives, every case, and `time` alternates the calls' graph timings.  With
    check_cpu: one set on "cpu" of each routine's first case, and `time` calls each function once
    on it and returns NaN for every figure: the routine's cases, arguments and checks are exercised
    without a GPU."""

    def __init__(self, torch, check_cpu=False):
        self.torch = torch
        self.check_cpu = check_cpu
        self.device = "cpu" if check_cpu else "cuda"
        self.count = 1 if check_cpu else None  # input sets: the set makers' own count on the GPU

    def cases(self, cases):
        return list(cases)[:1] if self.check_cpu else list(cases)

    def time(self, fns, sets):
        if self.check_cpu:
            for fn in fns:
                fn(*sets[0])
            return [math.nan] * len(fns)
        return alternated_graph_us(self.torch, fns, sets)
