"""The two-way merge against the kernel this project started from ("the seed": vLLM's
merge_attn_states, csrc/attention/merge_attn_states.cu of the vllm 0.8.5 source distribution, built
here as a PyTorch extension), PyTorch eager, and the 2-read-1-write roofline, in one run on one GPU,
in vLLM's layout (LSEs [heads, tokens], natural log; attnmerge through attnmerge.compat.vllm).

Per shape: both kernels' outputs checked against a float64 reference first; then the GPU time by
CUDA-graph replay (100 calls a graph, input sets rotated past L2, the median of 7 replays; the two
kernels timed in turn --rounds times, each one's median) and the eager time per call from Python
(host overhead included); the ratio seed / attnmerge (above 1: attnmerge is faster) and each one's
share of the roofline, measured at the start of the same run (torch.add on bfloat16).  Before the
first shape one timing is made and discarded: the first timing of a process comes out fast.
Needs the folder benchmarks/peers/fetch.py writes, nvcc and ninja (PyTorch's extension builder)."""
from __future__ import annotations

import torch

import attnmerge
from attnmerge.bench.sweep import roofline_gbps
from attnmerge.bench.timing import eager_us, graph_us, input_sets
from attnmerge.compat.vllm import merge_attn_states

from . import builds, reference
from .common import alternated_graph_us

SHAPES = [  # tokens, heads, head_size, dtype
    (1, 32, 128, "bfloat16"), (16, 32, 128, "bfloat16"), (128, 32, 128, "bfloat16"), (512, 32, 128, "bfloat16"),
    (2048, 32, 128, "bfloat16"), (8192, 32, 128, "bfloat16"), (32768, 32, 128, "bfloat16"),
    (8192, 128, 128, "bfloat16"), (16384, 16, 256, "bfloat16"), (16384, 64, 64, "bfloat16"),
    (8192, 32, 128, "float16"), (8192, 32, 128, "float32"), (8192, 32, 80, "bfloat16"), (4096, 8, 512, "bfloat16"),
]
CALLS = 100  # calls captured in one graph
CHECK_ELEMS = 1 << 26  # the reference covers the first tokens up to this many elements of O


def add_arguments(parser):
    parser.add_argument("--quick", action="store_true", help="every third shape")
    parser.add_argument("--rounds", type=int, default=3, help="graph timings of each kernel, in turn (%(default)s)")


def shapes(args, runner):
    chosen = SHAPES[::3] if args.quick else SHAPES
    if runner.check_cpu:  # small shapes of every dtype and head size of the list
        chosen = sorted({(3, 4, d, dt) for _, _, d, dt in chosen})
    return chosen


def moved(tokens, heads, head_size, itemsize):
    """Bytes a call moves: two O read and one written, and their LSEs."""
    return 3 * tokens * heads * head_size * itemsize + 3 * tokens * heads * 4


def make_sets(runner, tokens, heads, head_size, dtype, count):
    """(output, output_lse, prefix_output, prefix_lse, suffix_output, suffix_lse) in vLLM's layout."""
    dev = runner.device
    out = []
    for _ in range(count):
        po, so = (torch.randn(tokens, heads, head_size, device=dev, dtype=dtype) for _ in range(2))
        pl, sl = (3 * torch.randn(heads, tokens, device=dev) for _ in range(2))
        out.append((torch.empty_like(po), torch.empty(heads, tokens, device=dev), po, pl, so, sl))
    return out


def ours(output, output_lse, prefix_output, prefix_lse, suffix_output, suffix_lse):
    merge_attn_states(output, prefix_output, prefix_lse, suffix_output, suffix_lse, output_lse)


def torch_eager(output, output_lse, prefix_output, prefix_lse, suffix_output, suffix_lse):
    m = torch.maximum(prefix_lse, suffix_lse)
    wp, ws = torch.exp(prefix_lse - m), torch.exp(suffix_lse - m)
    total = wp + ws
    output.copy_(prefix_output * (wp / total).T.unsqueeze(-1) + suffix_output * (ws / total).T.unsqueeze(-1))
    output_lse.copy_(torch.log(total) + m)


def check(fn, s, dtype_name):
    """fn's result on set s (outputs poisoned with NaN first) against the float64 reference on the
    first tokens."""
    out, out_lse, po, pl, so, sl = s
    out.fill_(float("nan"))
    out_lse.fill_(float("nan"))
    fn(*s)
    n = max(1, min(po.shape[0], CHECK_ELEMS // (po.shape[1] * po.shape[2])))
    ref_o, ref_lse = reference.merge(torch.stack([po[:n], so[:n]], 1), torch.stack([pl[:, :n].T, sl[:, :n].T], 1))
    return reference.errors(out[:n], out_lse[:, :n].T, ref_o, ref_lse, dtype_name)


def run(args, runner):
    impls = {"ours": ours}
    if not runner.check_cpu:
        impls["seed"] = builds.vllm(torch)
    roof = None if runner.check_cpu else roofline_gbps(torch)
    if roof:
        print(f"{torch.cuda.get_device_name()}: roofline (torch.add bf16, 2 reads + 1 write) {roof:.0f} GB/s")
        print(f"{'tokens':>6} {'heads':>5} {'dim':>4} {'dtype':>8} {'MB':>7} | {'graph us: seed':>14} {'ours':>7} "
              f"{'seed/ours':>9} {'ours %roof':>10} | {'eager us: seed':>14} {'ours':>7} {'seed/ours':>9} | "
              f"{'torch eager':>11} | {'check':>5}")
    rows, first = [], True
    for tokens, heads, head_size, dtype_name in shapes(args, runner):
        dtype = getattr(torch, dtype_name)
        nbytes = moved(tokens, heads, head_size, dtype.itemsize)
        sets = make_sets(runner, tokens, heads, head_size, dtype, runner.count or input_sets(nbytes))
        row = dict(tokens=tokens, heads=heads, head_size=head_size, dtype=dtype_name, MB=nbytes / 1e6,
                   check={name: check(fn, sets[0], dtype_name) for name, fn in impls.items()})
        row["rel_err"], row["lse_err"] = row["check"]["ours"]["o_rel_l2"], row["check"]["ours"]["lse_err"]
        rows.append(row)
        if runner.check_cpu:
            torch_eager(*sets[0])  # runs on CPU tensors too
            print(f"{tokens} x {heads} x {head_size} {dtype_name}: attnmerge against the float64 reference "
                  f"{'ok' if row['check']['ours']['ok'] else 'FAILED'} (|dO| {row['check']['ours']['o_err']:.1e}, "
                  f"|dLSE| {row['lse_err']:.1e})", flush=True)
            continue
        if first:  # the first timing of a process comes out fast: made and discarded
            graph_us(torch, ours, sets, calls=CALLS)
            first = False
        row["seed_graph_us"], row["ours_graph_us"] = alternated_graph_us(
            torch, (impls["seed"], ours), sets, rounds=args.rounds, calls=CALLS)
        row["seed_eager_us"] = eager_us(torch, impls["seed"], sets, calls=200)
        row["ours_eager_us"] = eager_us(torch, ours, sets, calls=200)
        row["torch_eager_us"] = eager_us(torch, torch_eager, sets, calls=50)
        row["seed_roof_pct"] = 100 * nbytes / row["seed_graph_us"] / 1e3 / roof
        row["ours_roof_pct"] = 100 * nbytes / row["ours_graph_us"] / 1e3 / roof
        ok = all(c["ok"] for c in row["check"].values())
        print(f"{tokens:>6} {heads:>5} {head_size:>4} {dtype_name:>8} {nbytes / 1e6:>7.1f} | "
              f"{row['seed_graph_us']:>14.2f} {row['ours_graph_us']:>7.2f} "
              f"{row['seed_graph_us'] / row['ours_graph_us']:>9.3f} {row['ours_roof_pct']:>9.1f}% | "
              f"{row['seed_eager_us']:>14.2f} {row['ours_eager_us']:>7.2f} "
              f"{row['seed_eager_us'] / row['ours_eager_us']:>9.3f} | {row['torch_eager_us']:>11.1f} | "
              f"{'ok' if ok else 'BAD':>5}", flush=True)
        del sets
        torch.cuda.empty_cache()
    result = dict(rows=rows, vllm=builds.fetch.source_line(builds.fetch.VLLM), attnmerge=attnmerge.__version__)
    if roof:
        result.update(device=torch.cuda.get_device_name(), roofline_GBps=roof, roofline_end_GBps=roofline_gbps(torch),
                      calls=CALLS, rounds=args.rounds)
        ratios = [r["seed_graph_us"] / r["ours_graph_us"] for r in rows]
        print(f"roofline at the end {result['roofline_end_GBps']:.0f} GB/s; seed / attnmerge by graph replay "
              f"{min(ratios):.3f} to {max(ratios):.3f}")
    result["failed"] = sum(not r["check"]["ours"]["ok"] for r in rows)
    if runner.check_cpu:
        result["failed"] += check_binding()
    return result


def check_binding():
    """Under --check-cpu: whether the binding declares vLLM's function as the fetched kernel defines
    it (the kernel itself compiles and runs on the GPU machine only); 1 when it does not."""
    try:
        ok, (kernel, binding) = builds.vllm_binding_matches()
    except builds.PeerMissing as e:
        print(f"SKIP vLLM's kernel: {e}")
        return 0
    print(f"{'PASS' if ok else 'FAIL'} benchmarks/peers/vllm_merge.cpp declares merge_attn_states({binding}) "
          f"as {builds.fetch.source_line(builds.fetch.VLLM)} defines it" + ("" if ok else f": ({kernel})"))
    return 0 if ok else 1
