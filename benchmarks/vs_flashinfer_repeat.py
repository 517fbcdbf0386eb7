"""Chosen cases of the vs_flashinfer harness timed again and again in one process, attnmerge and
FlashInfer alternately, each repetition printed: whether a figure of one `bench.py` run holds (the
first case a process times may meet warm caches; some decode cases are bimodal).  Uses the
harness's own buffer sets, calls and timer (graph replay, L2 flushed before each replay) with its
default settings.

    python benchmarks/vs_flashinfer_repeat.py [--bench-dir ../shared/bench/vs_flashinfer] \\
        [--only "merge_state 1x32x128,merge_states S=16 16x32x128"] [--repeats 5]
"""

import argparse
import os
import sys


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bench-dir", default=os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "shared",
                                                            "bench", "vs_flashinfer"))
    parser.add_argument("--only", default="merge_state 1x32x128,merge_state 16x32x128,merge_state_in_place 1x32x128,"
                                          "merge_states S=16 16x32x128",
                        help="comma-separated substrings of 'op label', as bench.py's --only")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    sys.path.insert(0, os.path.abspath(args.bench_dir))
    import bench  # the harness: its cases, buffer sets, calls and timer
    import torch

    cases = bench.select(bench.expand(bench.PUBLIC), argparse.Namespace(only=args.only, ops=None))
    fi = bench.FlashInferCUDA(bench.build_fi_library(bench.FI_DIR))
    fi.set_device(torch.cuda.current_device())
    env = dict(fi=fi, pdl=False)
    # bench.py's defaults: --calls, --replays, flush, --slow-ms, --replay-budget
    timer = bench.Timer(100, 7, True, 100, 0.25)
    for op, p in cases:
        if bench.fi_skip(op, p):
            continue
        mask = None
        if op == "merge_state_in_place" and p["mask"]:  # as bench.py draws it
            g = torch.Generator().manual_seed(99)
            mask = (torch.rand(p["tokens"], generator=g) < 0.5).to(torch.uint8)
            mask[0] = 1
            mask = mask.cuda()
        lengths = bench.lengths_for(p) if op == "variable_length_merge_states" else None
        indptr = None
        if lengths is not None:
            ip = [0]
            for k in lengths:
                ip.append(ip[-1] + k)
            indptr = torch.tensor(ip, dtype=torch.int32, device="cuda")
        mask_ones = int(mask.sum()) if mask is not None else None
        _, set_bytes = bench.shape_bytes(op, p, lengths, mask_ones)
        nsets = max(1, min(100, -(-512 * (1 << 20) // set_bytes)))
        torch.manual_seed(7)
        sets = [bench.make_set(op, p, "cuda", lengths, indptr, mask) for _ in range(nsets)]
        times = {"attnmerge": [], "flashinfer_cuda": []}
        for _ in range(args.repeats):
            for impl in times:
                times[impl].append(timer.time([bench.timing_call(op, impl, st, env) for st in sets])["us"])
        print(f"{op} {bench.label(op, p)}: " + " | ".join(
            f"{impl} " + " ".join(f"{t:.3f}" for t in ts) for impl, ts in times.items()), flush=True)


if __name__ == "__main__":
    main()
