"""python -m attnmerge: build and device information, then a self-test against the float64
reference on the CPU and every visible GPU (--cpu: the CPU alone) over every dtype the package
takes, with a bandwidth figure for each.  Exit status 1 on any failure.  --cmake-dir / --include-dir
print where the C package lives; `bench` runs the benchmark (python -m attnmerge bench --help)."""
import argparse
import re
import sys

import numpy as np

import attnmerge
from attnmerge import _C
from attnmerge._arrays import _numpy_dtype
from attnmerge._reference import merge_reference
from attnmerge._types import NO_GRADIENT_DTYPES, O_IN_DTYPES, dtypes_of
from attnmerge.bench.timing import median_seconds

# Relative L2 error against the float64 reference, by the output's dtype: DESIGN.md's for the
# 16- and 32-bit dtypes, float64's own arithmetic, and FP8 E4M3's 3 mantissa bits.
TOLERANCE = {"float32": 1e-6, "float16": 1e-3, "bfloat16": 8e-3, "float64": 1e-12, "float8_e4m3fn": 7e-2}
# Every dtype the package takes, from its table: each O dtype merged into itself, and each dtype
# only an output may be (FP8) from float32.  The LSEs are float64 with float64 O (a call's O and
# LSE are float64 all or none), float32 otherwise.
CASES = [(d, d) for d in O_IN_DTYPES] + [("float32", d) for d in NO_GRADIENT_DTYPES]
LSE_DTYPES = dtypes_of(_C.ROLE_LSE)


def _inputs(rng, tokens, heads, dim):
    o_a, o_b = (rng.standard_normal((tokens, heads, dim)).astype(np.float32) for _ in range(2))
    lse_a, lse_b = (3 * rng.standard_normal((tokens, heads)).astype(np.float32) for _ in range(2))
    lse_a[0, 0] = np.inf  # one empty part, one NaN-free but empty row
    lse_a[-1, -1] = lse_b[-1, -1] = -np.inf
    return o_a, lse_a, o_b, lse_b


def _error(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


# What a GPU says of a dtype it does not take (float64), which the self-test counts as a pass there.
CPU_ONLY = "runs on the CPU path only"


def _case(rng, to_device, from_device, in_dtype, out_dtype, label):
    """One merge of (in_dtype, out_dtype) against the reference: True where it passes, or where a
    GPU refuses a dtype of the CPU path; None where the arrays cannot be made (no ml_dtypes, or a
    library without the dtype)."""
    name = in_dtype if in_dtype == out_dtype else f"{in_dtype}->{out_dtype}"
    lse_dtype = in_dtype if in_dtype in LSE_DTYPES else "float32"
    try:
        o_a, lse_a, o_b, lse_b = _inputs(rng, 67, 5, 80)
        o_a, o_b = (x.astype(_numpy_dtype(in_dtype)) for x in (o_a, o_b))
        lse_a, lse_b = (x.astype(_numpy_dtype(lse_dtype)) for x in (lse_a, lse_b))
        poisoned = [np.full(shape, np.nan, np.float32).astype(_numpy_dtype(dtype))
                    for shape, dtype in (((67, 5, 80), out_dtype), ((67, 5), lse_dtype))]
        args = [to_device(x) for x in (o_a, lse_a, o_b, lse_b, *poisoned)]
    except (TypeError, ValueError) as e:
        print(f"  {label:<8} {name:<22} skipped: {e}")
        return None
    try:
        attnmerge.merge(*args[:4], out=args[4], out_lse=args[5])
    except (TypeError, ValueError) as e:
        if label != "cpu" and CPU_ONLY in str(e):
            print(f"  {label:<8} {name:<22} refused ({in_dtype} {CPU_ONLY})  pass")
            return True
        print(f"  {label:<8} {name:<22} {type(e).__name__}: {e}  FAIL")
        return False
    want_o, want_lse = merge_reference(o_a, lse_a, o_b, lse_b)
    out, out_lse = from_device(args[4]), from_device(args[5])
    err = _error(out, want_o)
    lse_ok = np.allclose(np.asarray(out_lse, np.float64), want_lse, rtol=1e-5, atol=1e-5, equal_nan=True)
    good = err <= TOLERANCE[out_dtype] and lse_ok and np.isfinite(np.asarray(out, np.float64)).all()
    print(f"  {label:<8} {name:<22} rel err {err:.1e}  lse {'ok' if lse_ok else 'WRONG'}  {'pass' if good else 'FAIL'}")
    return bool(good)


def check(to_device, from_device, timer, label):
    """Runs the small correctness cases, one per dtype, and one bandwidth case through `to_device`
    arrays."""
    rng = np.random.default_rng(0)
    ok = True
    for in_dtype, out_dtype in CASES:
        ok &= _case(rng, to_device, from_device, in_dtype, out_dtype, label) is not False
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


def torch_io(torch, device):
    """(to_device, from_device) between NumPy arrays and torch tensors on `device`: bfloat16 and FP8,
    which torch.from_numpy does not read (ml_dtypes' types), move as their bits."""

    def to_device(x):
        try:
            return torch.from_numpy(np.ascontiguousarray(x)).to(device)
        except TypeError:
            bits = np.ascontiguousarray(x).view(np.int16 if x.itemsize == 2 else np.int8)
            return torch.from_numpy(bits).view(getattr(torch, x.dtype.name)).to(device)

    def from_device(t):
        t = t.cpu()
        try:
            return t.numpy()
        except TypeError:
            bits = t.view(torch.int16 if t.element_size() == 2 else torch.int8).numpy()
            return bits.view(_numpy_dtype(str(t.dtype).rpartition(".")[2]))

    return to_device, from_device


def _gpu_check(device):
    """The GPU self-test through whichever array library can allocate on the device."""
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None and torch.cuda.is_available():
        dev = torch.device("cuda", device)
        to_device, from_device = torch_io(torch, dev)

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

        return check(to_device, from_device, timer, f"cuda:{device}")
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


def parser():
    """The command line: the information and self-test, the C package's folders, and the `bench`
    sub-command (its own options after it: python -m attnmerge bench --help)."""
    p = argparse.ArgumentParser(prog="python -m attnmerge", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"attnmerge {attnmerge.__version__}")
    only = p.add_mutually_exclusive_group()
    only.add_argument("--cmake-dir", action="store_true", help="print the CMake package folder and exit")
    only.add_argument("--include-dir", action="store_true", help="print the C header folder and exit")
    only.add_argument("--cpu", action="store_true", help="self-test the CPU path alone (no GPU)")
    commands = p.add_subparsers(dest="command", title="sub-commands", metavar="{bench}")
    commands.add_parser("bench", add_help=False, help="the benchmark: python -m attnmerge bench [--help]")
    return p


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # python -m attnmerge bench ...: the benchmark (attnmerge.bench), its own options
        from attnmerge.bench import main as bench

        return bench(argv[1:])
    p = parser()
    args = p.parse_args(argv)
    if args.command == "bench":  # options before it would be the self-test's
        p.error(f"argument bench: give it first, its options after it "
                f"(python -m attnmerge bench {' '.join(argv[:-1])})")
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
    jax_ext = "built" if info["jax_extension"] else f"not built; to get it, {attnmerge._build.XLA_HOW}"
    print(f"JAX extension (attnmerge.jax): {jax_ext}")
    print("self-test against the float64 reference:")
    ok = check(lambda x: x, lambda x: x, lambda fn: median_seconds(fn, 5), "cpu")
    if args.cpu:
        print("  GPUs     not tested (--cpu)")
    for device in range(0 if args.cpu else info["device_count"]):
        ok &= _gpu_check(device)
    print("self-test: pass" if ok else "self-test: FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
