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


def forms_against_first(runner, cases, heads, names, make, call, check):
    """The routines that time forms of one merge against its first form (layouts, state_forms):
    per (tokens, cp, head_size) case, input sets from make(tokens, cp, head_size), as many as
    their bytes ask (bf16 O of cp states and the merge, float32 LSEs); each form called once on
    the first set (call(set, name)) and checked (check(set, name): the largest |O - ref| and
    |LSE - ref|, within bf16's rounding of O and float32's of the LSE), then every form timed in
    turn.  (rows, failed cases): a row per case with each form's us and its ratio to the first
    form's, and the forms that failed their check, each case printed as it ends."""
    rows, failed, first = [], 0, names[0]
    for tokens, cp, head_size in runner.cases(cases):
        nbytes = (cp + 1) * tokens * heads * (head_size * 2 + 4)  # the states read and the merge written
        sets = [make(tokens, cp, head_size) for _ in range(runner.count or input_sets(nbytes * len(names)))]
        bad = []
        for name in names:
            call(sets[0], name)
            o_err, lse_err = check(sets[0], name)
            if not (o_err <= 3e-2 and lse_err <= 1e-4):  # bf16 rounding of O; LSE in float32
                bad.append(f"{name} (|O - ref| {o_err:.2g}, |LSE - ref| {lse_err:.2g})")
        failed += bool(bad)
        fns = [lambda *inputs, name=name: call(inputs, name) for name in names]
        times = dict(zip(names, runner.time(fns, sets)))
        ratios = {name: times[name] / times[first] for name in names}
        rows.append(dict(tokens=tokens, cp=cp, heads=heads, head_size=head_size, bytes=nbytes,
                         **{f"{name}_us": t for name, t in times.items()},
                         **{f"{name}_ratio": r for name, r in ratios.items() if name != first}, failed=bad))
        print(f"{tokens} tokens, cp {cp}, D {head_size} ({nbytes / 1e6:.2f} MB): {first} {times[first]:.2f} us; "
              + ", ".join(f"{name} {ratios[name]:.3f}x" for name in names[1:])
              + ("" if not bad else "; FAILED " + "; ".join(bad)), flush=True)
    return rows, failed


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
