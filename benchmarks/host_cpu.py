"""Host time per call of attnmerge.merge from Python on tiny torch CPU tensors (1 x 32 x 128
float32, outputs given: the eager decode call's Python and binding layers, with a CPU merge of 4096
elements), with autograd on, under torch.no_grad and under torch.inference_mode, and torch.add of
the same tensors for scale: the best of 7 repeats of 20000 calls, one thread.

To compare two builds (say before and after a change of the Python layers), install each in its
own environment and run this alternately in both a few times:
    python benchmarks/host_cpu.py
"""

import timeit

import torch

import attnmerge


def per_call_us(f, calls=20000):
    for _ in range(100):
        f()
    return min(timeit.repeat(f, number=calls, repeat=7)) / calls * 1e6


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
