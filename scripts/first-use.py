"""The first GPU call of each group of kernels (one per CUDA source of libattnmerge) in this process,
against its second call: in a build with SASS for the GPU, the module's load; in a build of PTX
alone (a source build on a machine without a GPU), also the driver's JIT of that module, unless its
cache (CUDA_CACHE_PATH, ~/.nv/ComputeCache) already holds it.  Needs PyTorch with CUDA.

    export CUDA_CACHE_PATH=$(mktemp -d)
    python scripts/first-use.py        # cold: the JIT, if the build needs one
    python scripts/first-use.py        # warm: the cache's copy
(benchmarks/NOTES.md#default-architectures has the figures.)"""
import sys
import time

import torch

import attnmerge


def seconds(fn):
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main():
    if not torch.cuda.is_available() or attnmerge.build_info()["device_count"] == 0:
        print("first-use: no CUDA GPU visible", file=sys.stderr)
        return 2
    info = attnmerge.build_info()
    major, minor = torch.cuda.get_device_capability()
    print(f"{torch.cuda.get_device_name()} (sm_{major}{minor}); build: SASS {info['cuda_architectures']}, "
          f"PTX {info['cuda_ptx_architectures']} ({info['cuda_architectures_choice']})")
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    o = lambda *shape: torch.randn(*shape, device=dev, dtype=bf16)  # noqa: E731
    lse = lambda *shape: torch.randn(*shape, device=dev, dtype=torch.float32)  # noqa: E731
    t, h, d, s = 256, 32, 128, 4
    o_a, o_b, l_a, l_b = o(t, h, d), o(t, h, d), lse(t, h), lse(t, h)
    stack, stack_lse = o(t, s, h, d), lse(t, s, h)
    flat, flat_lse = o(t * s, h, d), lse(t * s, h)
    indptr = torch.arange(0, t * s + 1, s, device=dev, dtype=torch.int32)
    sink = lse(h)
    out, out_lse = attnmerge.merge(o_a, l_a, o_b, l_b)
    groups = {  # each its own CUDA source (cpp/src/merge_gpu_*.cu, merge_backward_gpu.cu)
        "two-way (merge)": lambda: attnmerge.merge(o_a, l_a, o_b, l_b),
        "two-way with sinks": lambda: attnmerge.merge(o_a, l_a, o_b, l_b, sink=sink),
        "N-way (merge_states)": lambda: attnmerge.merge_states(stack, stack_lse),
        "variable-length (merge_varlen)": lambda: attnmerge.merge_varlen(flat, flat_lse, indptr),
        "merge_share": lambda: attnmerge.merge_share(stack[:, 0], stack_lse, 0),
        "backward (merge_backward)": lambda: attnmerge.merge_backward(o(t, h, d), lse(t, h), out, out_lse,
                                                                      o_a, l_a, o_b, l_b),
    }
    total = 0.0
    for name, call in groups.items():
        first, second = seconds(call), seconds(call)
        total += first
        print(f"  {name:<32} first call {first:8.3f} s   second {second * 1e3:8.3f} ms")
    print(f"  first calls together: {total:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
