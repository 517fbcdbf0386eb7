"""python -m attnmerge: build and device information, then a self-test against the float64
reference on the CPU and every visible GPU, with a bandwidth figure for each.  Exit status 1 on
any failure.  --cmake-dir / --include-dir print where the C package lives; `bench` runs the benchmark
(python -m attnmerge bench --help)."""
import argparse
import re
import sys

import numpy as np

import attnmerge
from attnmerge._reference import merge_reference
from attnmerge.bench.timing import median_seconds

TOLERANCE = {"float32": 1e-6, "float16": 1e-3}


def _inputs(rng, tokens, heads, dim):
    o_a, o_b = (rng.standard_normal((tokens, heads, dim)).astype(np.float32) for _ in range(2))
    lse_a, lse_b = (3 * rng.standard_normal((tokens, heads)).astype(np.float32) for _ in range(2))
    lse_a[0, 0] = np.inf  # one empty part, one NaN-free but empty row
    lse_a[-1, -1] = lse_b[-1, -1] = -np.inf
    return o_a, lse_a, o_b, lse_b


def _error(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def check(to_device, from_device, timer, label):
    """Runs the small correctness cases and one bandwidth case through `to_device` arrays."""
    rng = np.random.default_rng(0)
    ok = True
    for dtype, tol in TOLERANCE.items():
        o_a, lse_a, o_b, lse_b = _inputs(rng, 67, 5, 80)
        o_a, o_b = o_a.astype(dtype), o_b.astype(dtype)
        want_o, want_lse = merge_reference(o_a, lse_a, o_b, lse_b)
        out, out_lse = attnmerge.merge(*(to_device(x) for x in (o_a, lse_a, o_b, lse_b)))
        out, out_lse = from_device(out), from_device(out_lse)
        err = _error(out, want_o)
        lse_ok = np.allclose(out_lse, want_lse, rtol=1e-5, atol=1e-5, equal_nan=True)
        good = err <= tol and lse_ok and np.isfinite(np.asarray(out, np.float64)).all()
        ok &= bool(good)
        verdict = "pass" if good else "FAIL"
        print(f"  {label:<8} {dtype:<8} rel err {err:.1e}  lse {'ok' if lse_ok else 'WRONG'}  {verdict}")
    tokens, heads, dim = 2048, 32, 128
    o_a, lse_a, o_b, lse_b = (to_device(x) for x in _inputs(rng, tokens, heads, dim))
    out, out_lse = attnmerge.merge(o_a, lse_a, o_b, lse_b)
    seconds = timer(lambda: attnmerge.merge(o_a, lse_a, o_b, lse_b, out=out, out_lse=out_lse))
    nbytes = 3 * tokens * heads * dim * 4 + 3 * tokens * heads * 4
    print(f"  {label:<8} bandwidth {nbytes / seconds / 1e9:.1f} GB/s ({tokens}x{heads}x{dim} float32, median)")
    return ok


# How the build chose its GPU code (build_info()["cuda_architectures_choice"]), in words.
_CHOICE = {
    "detected": "for the GPUs found at build time",
    "no-gpu": "no GPU found at build time; ATTNMERGE_CUDA_ARCHITECTURES=release builds SASS for every supported GPU",
    "release": "the release list",
    "requested": "as requested at build time",
}


def _sm(arch):
    return int(re.match(r"\d+", arch).group())


def gpu_code_lines(info):
    """The build's GPU code in two lines: the SMs with SASS and the PTX, and what a GPU without SASS
    of its own gets (the driver's JIT of the newest PTX not above its SM, or nothing runnable)."""
    sass, ptx = info["cuda_architectures"], sorted(info["cuda_ptx_architectures"], key=_sm)
    cuda = info["cuda_build_version"]
    choice = info["cuda_architectures_choice"]
    code = [f"SASS for {' '.join('sm_' + a for a in sass)}" if sass else "no SASS",
            f"PTX {' '.join('compute_' + a for a in ptx)}" if ptx else "no PTX"]
    lines = [f"build: CUDA {cuda // 1000}.{cuda % 1000 // 10}, {', '.join(code)} ({_CHOICE.get(choice, choice)})"]
    if ptx:
        lines.append(f"GPUs without SASS here: from sm_{ptx[0]} on, the driver JIT-compiles the newest PTX not above "
                     f"the GPU's SM at first use (seconds, once: its cache keeps the result); below sm_{ptx[0]}, "
                     "nothing runs")
    else:
        lines.append("GPUs without SASS here: nothing runs (the build has no PTX to JIT-compile); "
                     "ATTNMERGE_CUDA_ARCHITECTURES=release builds for every supported GPU")
    return lines


def _gpu_check(device):
    """The GPU self-test through whichever array library can allocate on the device."""
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None and torch.cuda.is_available():
        dev = torch.device("cuda", device)

        def timer(fn, reps=20):
            fn()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            times = []
            for _ in range(reps):
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            return float(np.median(times))

        return check(lambda x: torch.from_numpy(x).to(dev), lambda x: x.cpu().numpy(), timer, f"cuda:{device}")
    try:
        import cupy
    except ImportError:
        print(f"  cuda:{device}  skipped: neither PyTorch nor CuPy is installed to allocate GPU arrays")
        return True
    with cupy.cuda.Device(device):

        def timer(fn, reps=20):
            fn()
            times = []
            for _ in range(reps):
                start, end = cupy.cuda.Event(), cupy.cuda.Event()
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(cupy.cuda.get_elapsed_time(start, end) / 1e3)
            return float(np.median(times))

        return check(cupy.asarray, cupy.asnumpy, timer, f"cuda:{device}")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # python -m attnmerge bench ...: the benchmark (attnmerge.bench)
        from attnmerge.bench import main as bench

        return bench(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m attnmerge", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"attnmerge {attnmerge.__version__}")
    parser.add_argument("--cmake-dir", action="store_true", help="print the CMake package folder and exit")
    parser.add_argument("--include-dir", action="store_true", help="print the C header folder and exit")
    args = parser.parse_args(argv)
    if args.cmake_dir:
        print(attnmerge.cmake_dir())
        return 0
    if args.include_dir:
        print(attnmerge.include_dir())
        return 0
    info = attnmerge.build_info()
    print(f"attnmerge {info['version']}  ({info['library']})")
    print("\n".join(gpu_code_lines(info)))
    driver = info["driver_version"]
    print(f"driver: {'CUDA %d.%d' % (driver // 1000, driver % 1000 // 10) if driver else 'none'}")
    print(f"GPUs: {info['device_count'] or 'none visible'}")
    jax_ext = "built" if info["jax_extension"] else f"not built; to get it, {attnmerge._XLA_HOW}"
    print(f"JAX extension (attnmerge.jax): {jax_ext}")
    print("self-test against the float64 reference:")
    ok = check(lambda x: x, lambda x: x, lambda fn: median_seconds(fn, 5), "cpu")
    for device in range(info["device_count"]):
        ok &= _gpu_check(device)
    print("self-test: pass" if ok else "self-test: FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
