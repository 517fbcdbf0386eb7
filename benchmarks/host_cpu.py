"""Host time per call of attnmerge.merge from Python on tiny torch CPU tensors (1 x 32 x 128
float32, outputs given: the eager decode call's Python and binding layers, with a CPU merge of 4096
elements), with autograd on, under torch.no_grad and under torch.inference_mode, and torch.add of
the same tensors for scale: the bench's host timer (attnmerge.bench.timing.host_us, median of 15
batches), one thread.

To compare two builds (say before and after a change of the Python layers), install each in its
own environment and run this alternately in both a few times; the timer is this tree's in both:
    python benchmarks/host_cpu.py
"""

import importlib.util
import os

import torch

import attnmerge

# This tree's timer, whichever build of attnmerge is installed: an A/B of two builds times both alike.
_spec = importlib.util.spec_from_file_location(
    "timing", os.path.join(os.path.dirname(__file__), os.pardir, "python", "attnmerge", "bench", "timing.py"))
timing = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(timing)


def per_call_us(f):
    return timing.host_us(None, f, calls=2000)


def main():
    torch.set_num_threads(1)
    t, h, d = 1, 32, 128
    o_a, o_b = torch.randn(t, h, d), torch.randn(t, h, d)
    lse_a, lse_b = torch.randn(t, h), torch.randn(t, h)
    out, out_lse = torch.empty_like(o_a), torch.empty_like(lse_a)

    def merge():
        attnmerge.merge(o_a, lse_a, o_b, lse_b, out=out, out_lse=out_lse)

    rows = [("attnmerge.merge, autograd on", per_call_us(merge))]
    with torch.no_grad():
        rows.append(("attnmerge.merge, torch.no_grad", per_call_us(merge)))
    with torch.inference_mode():
        rows.append(("attnmerge.merge, torch.inference_mode", per_call_us(merge)))
    rows.append(("torch.add (for scale)", per_call_us(lambda: torch.add(o_a, o_b, out=out))))
    print(f"attnmerge {attnmerge.__version__} ({attnmerge.__file__}), torch {torch.__version__}")
    for name, us in rows:
        print(f"{name:<40} {us:6.3f} us per call")


if __name__ == "__main__":
    main()
