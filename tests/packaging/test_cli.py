"""`python -m attnmerge`: build information, a self-test on the CPU and every GPU, and where the C
package lives (--cmake-dir, --include-dir)."""

from __future__ import annotations

import glob
import os
import subprocess
import sys

import pytest

import attnmerge


def run(*args, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "attnmerge", *args], capture_output=True, text=True, timeout=timeout,
    )


def test_info_and_self_test_pass():
    p = run()
    assert p.returncode == 0, f"exit {p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}"
    assert attnmerge.__version__ in p.stdout
    assert "pass" in p.stdout.lower()
    assert "cpu" in p.stdout.lower()
    assert ("JAX extension (attnmerge.jax): built" if attnmerge.build_info()["jax_extension"]
            else "JAX extension (attnmerge.jax): not built; to get it") in p.stdout


def test_cmake_dir_holds_the_cmake_package():
    p = run("--cmake-dir", timeout=60)
    assert p.returncode == 0, p.stderr
    path = p.stdout.strip()
    assert os.path.isdir(path), f"--cmake-dir printed {path!r}, not a directory"
    configs = glob.glob(os.path.join(path, "**", "attnmerge[Cc]onfig.cmake"), recursive=True) + glob.glob(
        os.path.join(path, "**", "attnmerge-config.cmake"), recursive=True
    )
    assert configs, f"no attnmergeConfig.cmake under {path}"


def test_include_dir_holds_the_c_header():
    p = run("--include-dir", timeout=60)
    assert p.returncode == 0, p.stderr
    path = p.stdout.strip()
    assert os.path.isdir(path), f"--include-dir printed {path!r}, not a directory"
    assert os.path.isfile(os.path.join(path, "attnmerge", "attnmerge.h"))


def test_version_prints_the_library_version():
    p = run("--version", timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == f"attnmerge {attnmerge.__version__}"


def test_help_shows_the_whole_description():
    p = run("--help", timeout=60)
    assert p.returncode == 0, p.stderr
    assert "--cmake-dir" in p.stdout and "bench" in p.stdout and "--version" in p.stdout


def test_the_usage_names_every_option_and_sub_command():
    p = run("--help", timeout=60)
    usage = p.stdout.split("\n\n")[0]
    for word in ("--version", "--cmake-dir", "--include-dir", "--cpu", "bench"):
        assert word in usage, f"{word} is not in the usage: {usage!r}"
    p = run("bench", "--help", timeout=60)
    usage = p.stdout.split("\n\n")[0]
    assert p.returncode == 0 and usage.startswith("usage: python -m attnmerge bench"), p.stdout + p.stderr
    for word in ("--cpu", "--family", "--quick", "--json", "--png"):
        assert word in usage, f"{word} is not in bench's usage: {usage!r}"


def test_the_self_test_covers_every_dtype_of_the_package_and_cpu_keeps_it_on_the_cpu():
    from attnmerge._types import NO_GRADIENT_DTYPES, O_IN_DTYPES

    p = run("--cpu")
    assert p.returncode == 0, f"exit {p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}"
    lines = [line.split() for line in p.stdout.splitlines() if line.startswith("  cpu ")]
    tested = {words[1]: words[-1] for words in lines if words[1] != "bandwidth"}
    assert set(tested) == {*O_IN_DTYPES, *(f"float32->{d}" for d in NO_GRADIENT_DTYPES)}, tested
    assert set(tested.values()) == {"pass"}, tested
    assert "not tested (--cpu)" in p.stdout and "cuda:" not in p.stdout


def test_the_self_test_moves_every_dtype_through_torch_as_on_a_gpu():
    """The GPU self-test's torch conversions (bfloat16 and FP8 as their bits), here on torch CPU
    tensors: every case passes."""
    torch = pytest.importorskip("torch")
    from attnmerge.__main__ import check, torch_io

    to_device, from_device = torch_io(torch, torch.device("cpu"))
    assert check(to_device, from_device, lambda fn: (fn(), 1.0)[1], "torch")


@pytest.mark.parametrize("args, named", [
    (("bench", "--family", "--cpu"), ("--cpu", "--family")),
    (("bench", "--family", "--quick"), ("--quick", "--family")),
    (("bench", "--family", "--png", "plot.png"), ("--png", "--family")),
    (("--cpu", "--cmake-dir"), ("--cpu", "--cmake-dir")),
    (("--cpu", "bench"), ("bench",)),
], ids=lambda x: " ".join(x) if isinstance(x, tuple) else None)
def test_an_option_a_command_cannot_honour_is_refused_by_name(args, named):
    p = run(*args, timeout=60)
    assert p.returncode == 2, p.stdout + p.stderr
    error = p.stderr.strip().splitlines()[-1]
    assert all(name in error for name in named), error


def test_info_says_which_sms_have_sass_and_what_other_gpus_get():
    from attnmerge.__main__ import gpu_code_lines

    p = run()
    assert p.returncode == 0, p.stderr
    lines = gpu_code_lines(attnmerge.build_info())
    assert lines[0].startswith("build: CUDA ") and lines[1].startswith("GPUs without SASS here: ")
    for line in lines:
        assert line in p.stdout.splitlines(), (line, p.stdout)


def _info(sass, ptx, choice):
    return {"cuda_build_version": 13000, "cuda_architectures": sass, "cuda_ptx_architectures": ptx,
            "cuda_architectures_choice": choice}


@pytest.mark.parametrize("info,build,others", [
    (_info([], ["90", "75"], "no-gpu"),
     ["build: CUDA 13.0, no SASS, PTX compute_75 compute_90 (no GPU found at build time;",
      "ATTNMERGE_CUDA_ARCHITECTURES=release"],
     ["from sm_75 on, the driver JIT-compiles the newest PTX not above the GPU's SM at first use",
      "below sm_75, nothing runs"]),
    (_info(["90"], ["90"], "detected"),
     ["build: CUDA 13.0, SASS for sm_90, PTX compute_90 (for the GPUs found at build time)"],
     ["from sm_90 on, the driver JIT-compiles", "below sm_90, nothing runs"]),
    (_info(["80", "86"], [], "detected"),
     ["build: CUDA 13.0, SASS for sm_80 sm_86, no PTX (for the GPUs found at build time)"],
     ["GPUs without SASS here: nothing runs (the build has no PTX", "ATTNMERGE_CUDA_ARCHITECTURES=release"]),
    (_info(["75", "80", "86", "89", "90", "100", "120"], ["120"], "release"),
     ["SASS for sm_75 sm_80 sm_86 sm_89 sm_90 sm_100 sm_120, PTX compute_120 (the release list)"],
     ["from sm_120 on, the driver JIT-compiles", "below sm_120, nothing runs"]),
    (_info(["90"], ["90"], "requested"), ["(as requested at build time)"], ["from sm_90 on"]),
], ids=["ptx alone", "detected", "detected, no ptx", "release", "requested"])
def test_the_gpu_code_lines_say_what_a_gpu_without_sass_gets(info, build, others):
    from attnmerge.__main__ import gpu_code_lines

    lines = gpu_code_lines(info)
    assert len(lines) == 2, lines
    for words, line in ((build, lines[0]), (others, lines[1])):
        for word in words:
            assert word in line, (word, line)
