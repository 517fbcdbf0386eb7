"""attnmerge's benchmarks, one driver with a routine each:

    python benchmarks/run.py ROUTINE [--json OUT] [routine options]   on a GPU
    python benchmarks/run.py ROUTINE --check-cpu                      no GPU: the routine's cases,
        calls and checks on CPU tensors, untimed (every routine where none is named)
    python benchmarks/run.py --list                                    the routines

Every GPU time comes from attnmerge.bench.timing (CUDA-graph replay, input sets rotated past L2,
medians).  vs_seed and vs_flashinfer time the peers' own kernels, built here from the folders
`python benchmarks/peers/fetch.py` fills (on a machine that reaches PyPI: carry them to the GPU
machine).  `bench` and `family` are `python -m attnmerge bench` and `... bench --family`, their
options after the routine's name.  The exit code is 0, 1 when a check of attnmerge failed, 2 when a
routine could not run (no GPU, a peer not fetched)."""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from routines import ROUTINES  # noqa: E402


def routine(name):
    return importlib.import_module(f"routines.{ROUTINES[name][0]}")


def parser():
    p = argparse.ArgumentParser(prog="python benchmarks/run.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--list", action="store_true", help="the routines, one a line")
    p.add_argument("--check-cpu", action="store_true", help="every routine's CPU self-check")
    sub = p.add_subparsers(dest="routine", metavar="ROUTINE")
    for name, (module, text) in ROUTINES.items():
        sp = sub.add_parser(name, help=text, description=text)
        if module == "package":
            sp.add_argument("options", nargs="*", help="`python -m attnmerge bench` options (its --help)")
            continue
        sp.add_argument("--json", help="write every figure here")
        sp.add_argument("--check-cpu", action="store_true", help="no GPU: the cases, calls and checks on CPU "
                        "tensors, untimed")
        adder = getattr(routine(name), "add_arguments", None)
        if adder is not None:
            adder(sp)
    return p


def run_one(name, args, check_cpu):
    """The routine's result (a dict or a list of rows), after printing its lines."""
    import torch

    from routines.common import Runner

    return routine(name).run(args, Runner(torch, check_cpu=check_cpu))


def failed(result):
    return result.get("failed", 0) if isinstance(result, dict) else 0


def check_all(p):
    """Every timing routine's CPU self-check, with its own defaults; 'N passed, M failed'."""
    passed, bad = [], []
    for name, (module, _) in ROUTINES.items():
        if module == "package":
            continue
        print(f"== {name} --check-cpu", flush=True)
        try:
            ok = failed(run_one(name, p.parse_args([name, "--check-cpu"]), True)) == 0
        except Exception:  # noqa: BLE001  (reported; the other routines still run)
            traceback.print_exc()
            ok = False
        (passed if ok else bad).append(name)
    if bad:
        print(f"failed: {', '.join(bad)}")
    print(f"{len(passed)} passed, {len(bad)} failed")
    return 1 if bad else 0


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in ROUTINES and ROUTINES[argv[0]][0] == "package":
        # its options are the package's, passed on whole (argparse would read them as the driver's)
        return routine(argv[0]).forward(argv[0], argv[1:])
    p = parser()
    args = p.parse_args(argv)
    if args.list:
        for name, (_, text) in ROUTINES.items():
            print(f"{name:<14} {text}")
        return 0
    if args.routine is None:
        if args.check_cpu:
            return check_all(p)
        p.print_usage(sys.stderr)
        return 2
    from routines.builds import PeerMissing

    if not (args.check_cpu or getattr(args, "cases", False)):
        import torch

        if not torch.cuda.is_available():
            print(f"run.py {args.routine}: no CUDA GPU visible to PyTorch (--check-cpu runs what needs none)",
                  file=sys.stderr)
            return 2
    try:
        result = run_one(args.routine, args, args.check_cpu)
    except PeerMissing as e:
        print(f"run.py {args.routine}: {e}", file=sys.stderr)
        return 2
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result if isinstance(result, dict) else {"routine": args.routine, "rows": result}, f, indent=1,
                      default=str)
        print(f"wrote {args.json}")
    return 1 if failed(result) else 0


if __name__ == "__main__":
    sys.exit(main())
