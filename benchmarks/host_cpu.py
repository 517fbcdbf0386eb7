"""Host time per call of attnmerge.merge from Python on tiny torch tensors (1 x 32 x 128, outputs
given: the eager decode call's Python and binding layers), with autograd on, under torch.no_grad
and under torch.inference_mode, each timed with and without the torch road (the decision between
the native road and torch.ops.attnmerge, which is all the ops added to an eager call; "without"
unregisters the road, as before the ops existed), alternately, and torch.add of the same tensors
for scale: the bench's host timer (attnmerge.bench.timing.host_us, median of 15 batches), one thread.

    python benchmarks/host_cpu.py                  # float32 CPU tensors (a CPU merge of 4096 elements)
    python benchmarks/host_cpu.py --device cuda    # bfloat16 CUDA tensors, as the bench's host section
    python benchmarks/host_cpu.py --device numpy   # float32 NumPy arrays, torch imported beside
    python benchmarks/host_cpu.py --allocated      # the results allocated by the call (no out=)

To compare two builds, install each in its own environment (or `pip install --target` folder) and
run each tree's own copy of this script alternately under both; the timer is the same in both.

    python benchmarks/host_cpu.py --instructions   # instructions per call, by library (valgrind)

--instructions counts instead of timing: the instructions one call executes, under valgrind's
callgrind (counted over --calls calls once 200 have run), grouped by the library they run in, with
the torch road registered, in each mode.  Counts do not vary with the machine's load, so two
builds compare in one run each; host arrays only (the CPU merge's arithmetic is in attnmerge's
library and libm, the same in every build of one kernel).
"""

import argparse
import collections
import importlib.util
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile

import numpy as np
import torch

import attnmerge

# This tree's timer, whichever build of attnmerge is installed: an A/B of two builds times both alike.
_spec = importlib.util.spec_from_file_location(
    "timing", os.path.join(os.path.dirname(__file__), os.pardir, "python", "attnmerge", "bench", "timing.py"))
timing = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(timing)

MODES = {"autograd on": torch.enable_grad, "torch.no_grad": torch.no_grad, "torch.inference_mode": torch.inference_mode}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda", "numpy"), default="cpu",
                        help="CPU tensors, CUDA tensors, or NumPy arrays in a process that imported torch")
    parser.add_argument("--repeats", type=int, default=5, help="alternations of with and without (default 5)")
    parser.add_argument("--allocated", action="store_true", help="no out= or out_lse=: the call allocates them")
    parser.add_argument("--instructions", action="store_true", help="count instructions per call (valgrind)")
    parser.add_argument("--calls", type=int, default=2000, help="calls counted with --instructions (%(default)s)")
    parser.add_argument("--counted", choices=tuple(MODES), help=argparse.SUPPRESS)  # the process valgrind runs
    args = parser.parse_args()
    torch.set_num_threads(1)
    merge = merge_call(args.device, args.allocated)
    if args.counted:
        return counted(merge, args.counted, args.calls)
    if args.instructions:
        return instructions(args)
    cuda = args.device == "cuda"

    def per_call_us(f):
        return timing.host_us(torch if cuda else None, f, calls=2000)

    from attnmerge import _roads  # the timing's alone: --instructions counts builds from before it too

    o_a, o_b, out = merge.arrays
    outputs = "allocated" if args.allocated else "given"
    print(f"attnmerge {attnmerge.__version__} ({attnmerge.__file__}), torch {torch.__version__}, "
          f"{args.device} {str(o_a.dtype).removeprefix('torch.')}, outputs {outputs}")
    road = _roads.torch_road()
    times = {mode: ([], []) for mode in MODES}  # (routed, without) per mode, alternated
    for _ in range(args.repeats):
        for mode, context in MODES.items():
            with context():
                _roads.use_torch(None, None, None)
                times[mode][1].append(per_call_us(merge))
                _roads.use_torch(*road)
                times[mode][0].append(per_call_us(merge))
    for mode, (routed, without) in times.items():
        deltas = sorted(r - w for r, w in zip(routed, without))
        print(f"attnmerge.merge, {mode:<22} {statistics.median(routed):6.3f} us per call, "
              f"{statistics.median(without):6.3f} without the torch road: {statistics.median(deltas):+.3f} "
              f"(median of {len(deltas)} alternations, {deltas[0]:+.3f} to {deltas[-1]:+.3f})")
    add = np.add if args.device == "numpy" else torch.add
    print(f"{add.__module__.split('.')[0]}.add (for scale)                  "
          f"{per_call_us(lambda: add(o_a, o_b, out=out)):6.3f} us")


def merge_call(device, allocated=False):
    """The timed call: attnmerge.merge of 1 x 32 x 128 states, outputs given unless `allocated`
    (`.arrays`: o_a, o_b and an out, for the scale's add)."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    t, h, d = 1, 32, 128
    where = "cpu" if device == "numpy" else device
    o_a, o_b = (torch.randn(t, h, d, device=where).to(dtype) for _ in range(2))
    lse_a, lse_b = (torch.randn(t, h, device=where) for _ in range(2))
    if device == "numpy":
        o_a, o_b, lse_a, lse_b = (x.numpy() for x in (o_a, o_b, lse_a, lse_b))
    empty_like = np.empty_like if device == "numpy" else torch.empty_like
    out, out_lse = empty_like(o_a), empty_like(lse_a)

    if allocated:
        def merge():
            attnmerge.merge(o_a, lse_a, o_b, lse_b)
    else:
        def merge():
            attnmerge.merge(o_a, lse_a, o_b, lse_b, out=out, out_lse=out_lse)

    merge.arrays = (o_a, o_b, out)
    return merge


def counted(merge, mode, calls):
    """The process valgrind runs: `calls` calls in `mode`, counted alone (callgrind_control turns
    the count on after the warm-up and off after them)."""
    def count(on):
        subprocess.run(["callgrind_control", "-i", on, str(os.getpid())], check=True, capture_output=True)

    with MODES[mode]():
        for _ in range(200):
            merge()
        count("on")
        for _ in range(calls):
            merge()
        count("off")


# Libraries by the group they are reported in: a file name's pattern, first match.
_GROUPS = (("attnmerge (C ABI, CPU merge)", r"libattnmerge\."), ("attnmerge._C (binding)", r"^_C\.cpython"),
           ("Python", r"libpython|^python|Python-3"), ("torch", r"libtorch|libc10|libgomp"),
           ("libm (exp, log)", r"libm\.|ieee754|^\./math/"), ("libc, loader", r"libc\.|ld-linux|libstdc|^\./"))


def instructions(args):
    if args.device == "cuda":
        sys.exit("--instructions: host arrays only (valgrind does not run CUDA)")
    missing = [tool for tool in ("valgrind", "callgrind_control", "callgrind_annotate") if shutil.which(tool) is None]
    if missing:
        sys.exit(f"--instructions needs valgrind's tools on PATH: {', '.join(missing)} not found")
    arrays = "NumPy arrays" if args.device == "numpy" else "torch tensors"
    outputs = "allocated" if args.allocated else "given"
    print(f"attnmerge {attnmerge.__version__} ({attnmerge.__file__}), torch {torch.__version__}: instructions per "
          f"call of attnmerge.merge (1 x 32 x 128 float32 {arrays}, outputs {outputs}), {args.calls} calls counted")
    with tempfile.TemporaryDirectory() as tmp:
        for mode in MODES:
            profile = os.path.join(tmp, "callgrind.out")
            run = subprocess.run(
                ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={profile}",
                 sys.executable, __file__, "--counted", mode, "--calls", str(args.calls), "--device", args.device,
                 *(["--allocated"] if args.allocated else [])],
                env={**os.environ, "PYTHONHASHSEED": "0"}, capture_output=True, text=True)
            if run.returncode != 0:
                sys.exit(f"valgrind failed ({run.returncode}): {run.stderr[-2000:]}")
            table = subprocess.run(["callgrind_annotate", "--threshold=100", profile], check=True,
                                   capture_output=True, text=True).stdout
            groups = collections.Counter()
            for line in table.splitlines():
                m = re.match(r"\s*([\d,]+) \([^)]*\)\s+(\S.*)$", line)
                if m is None or "PROGRAM TOTALS" in line:
                    continue
                where = re.search(r"\[([^\]]+)\]\s*$", m.group(2))
                name = os.path.basename(where.group(1)) if where else m.group(2).split(":")[0]
                group = next((g for g, pattern in _GROUPS if re.search(pattern, name)), "other")
                groups[group] += int(m.group(1).replace(",", ""))
            total = sum(groups.values()) / args.calls
            parts = ", ".join(f"{g} {groups[g] / args.calls:.0f}" for g, _ in (*_GROUPS, ("other", "")) if groups[g])
            print(f"attnmerge.merge, {mode:<22} {total:7.0f} instructions per call: {parts}")

if __name__ == "__main__":
    main()
