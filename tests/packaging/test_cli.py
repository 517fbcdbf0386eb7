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
