"""Host time per call of attnmerge.merge from Python on tiny torch tensors (1 x 32 x 128, outputs
given: the eager decode call's Python and binding layers), with autograd on, under torch.no_grad
and under torch.inference_mode, each timed with and without the torch road (the decision between
the native road and torch.ops.attnmerge, which is all the ops added to an eager call; "without"
unregisters the road, as before the ops existed), alternately, and torch.add of the same tensors
for scale: the bench's host timer (attnmerge.bench.timing.host_us, median of 15 batches), one thread.

    python benchmarks/host_cpu.py                  # float32 CPU tensors (a CPU merge of 4096 elements)
    python benchmarks/host_cpu.py --device cuda    # bfloat16 CUDA tensors, as the bench's host section

To compare two builds, install each in its own environment (or `pip install --target` folder) and
run each tree's own copy of this script alternately under both; the timer is the same in both.
"""

import argparse
import importlib.util
import os
import statistics

import torch

import attnmerge
from attnmerge import _roads

# This tree's timer, whichever build of attnmerge is installed: an A/B of two builds times both alike.
_spec = importlib.util.spec_from_file_location(
    "timing", os.path.join(os.path.dirname(__file__), os.pardir, "python", "attnmerge", "bench", "timing.py"))
timing = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(timing)

MODES = {"autograd on": torch.enable_grad, "torch.no_grad": torch.no_grad, "torch.inference_mode": torch.inference_mode}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--repeats", type=int, default=5, help="alternations of with and without (default 5)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    cuda = args.device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    t, h, d = 1, 32, 128
    o_a, o_b = (torch.randn(t, h, d, device=args.device).to(dtype) for _ in range(2))
    lse_a, lse_b = (torch.randn(t, h, device=args.device) for _ in range(2))
    out, out_lse = torch.empty_like(o_a), torch.empty_like(lse_a)

    def per_call_us(f):
        return timing.host_us(torch if cuda else None, f, calls=2000)

    def merge():
        attnmerge.merge(o_a, lse_a, o_b, lse_b, out=out, out_lse=out_lse)

    print(f"attnmerge {attnmerge.__version__} ({attnmerge.__file__}), torch {torch.__version__}, "
          f"{args.device} {str(dtype).removeprefix('torch.')}")
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
    print(f"torch.add (for scale)                  {per_call_us(lambda: torch.add(o_a, o_b, out=out)):6.3f} us")

if __name__ == "__main__":
    main()
