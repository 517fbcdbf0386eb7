"""The attnmerge benchmark:  python -m attnmerge bench [--cpu | --family] [--quick] [--json FILE] [--png FILE]

GPU (PyTorch with CUDA): the two-way merge over decode (1 to 256 tokens), chunk (512 to 4096) and long
(8192 to 32768) sizes, heads 8 to 128, head sizes 64 to 512, bfloat16/float16/float32, and the N-way
merge (S = 4 and 8); each timed by CUDA-graph replay (the GPU work) and by an eager per-call loop from
Python (host overhead included), with input sets rotated past L2 and medians of 7 runs.  Bandwidth
is reported as GB/s and as a share of the 2-read-1-write roofline measured in the same run (torch.add
on bfloat16), and each size also times torch.add moving the same bytes (what one plain streaming
kernel reaches there, launch and drain included).  Compared with PyTorch eager and with FlashInfer,
vLLM and sgl-kernel where installed.
CPU (--cpu): the CPU path on NumPy arrays (float32, and bfloat16 with ml_dtypes) against np.add over
the same bytes of float32, with per-call times; ATTNMERGE_NUM_THREADS caps the merge's threads.
N-way family (--family): merge_states at S = 2, 8, 64, the all-gather layout, a chain of two-way
merges and merge_varlen, against the roofline (attnmerge.bench.family).
"""
from __future__ import annotations

import argparse
import json

def parser():
    """The benchmark's command line (python -m attnmerge bench)."""
    p = argparse.ArgumentParser(prog="python -m attnmerge bench", description=__doc__.split("\n")[0])
    where = p.add_mutually_exclusive_group()  # the N-way family runs on the GPU alone
    where.add_argument("--cpu", action="store_true", help="the CPU path against NumPy instead of the GPU")
    where.add_argument("--family", action="store_true",
                       help="the N-way and variable-length merges instead (GPU; one size, no plot)")
    p.add_argument("--quick", action="store_true", help="a few shapes only (not with --family)")
    p.add_argument("--json", help="write every figure here")
    p.add_argument("--png", help="write a plot of GB/s against bytes moved here (needs matplotlib; not with --family)")
    return p


def main(argv=None):
    p = parser()
    args = p.parse_args(argv)
    if args.family:
        for given, name in ((args.quick, "--quick"), (args.png, "--png")):
            if given:  # refused by name rather than dropped
                p.error(f"argument {name}: not allowed with argument --family (one size, no plot)")
        from .family import run_family

        result = run_family()
    elif args.cpu:
        from .sweep import run_cpu

        result = run_cpu(args.quick)
    else:
        from .sweep import ALL, QUICK, run_gpu

        result = run_gpu(QUICK if args.quick else ALL)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.png:
        from .plot import plot

        plot(result, args.png)
    return 0
