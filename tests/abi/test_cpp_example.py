"""examples/cpp, a C++ program that finds the installed CMake package (find_package(attnmerge)),
builds against it and merges on the CPU path (and on the GPU when one is present); it checks its
own results and exits 0.  Needs CMake and a C++ compiler (the test extra installs CMake)."""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest

import attnmerge

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "cpp")


def test_the_cpp_example_builds_against_the_installed_package_and_runs(tmp_path):
    cmake = shutil.which("cmake")
    if cmake is None:
        pytest.skip("no cmake on PATH")
    build = tmp_path / "build"
    args = [cmake, "-S", EXAMPLE, "-B", str(build), f"-Dattnmerge_DIR={attnmerge.cmake_dir()}"]
    if shutil.which("ninja"):
        args += ["-G", "Ninja"]
    configure = subprocess.run(args, capture_output=True, text=True)
    assert configure.returncode == 0, configure.stdout + configure.stderr
    compile_ = subprocess.run([cmake, "--build", str(build)], capture_output=True, text=True)
    assert compile_.returncode == 0, compile_.stdout + compile_.stderr
    run = subprocess.run([str(build / "merge_example")], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "cpu: max error" in run.stdout and "FAILED" not in run.stdout, run.stdout
    assert f"attnmerge {attnmerge.__version__}" in run.stdout, run.stdout
    # With a GPU and a CUDA runtime for CMake to find, the GPU half must have run (and passed: no FAILED).
    cache = (build / "CMakeCache.txt").read_text()
    if attnmerge.build_info()["device_count"] > 0 and "CUDA_cudart_LIBRARY:FILEPATH=/" in cache:
        assert "gpu: max error" in run.stdout, run.stdout
