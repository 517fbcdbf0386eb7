"""benchmarks/native: the CPU one (host_cpu_abi) configures, builds and runs against the installed
package's CMake config with the CUDA ones left out (as on a machine with no CUDA toolkit)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir)


def cmake():
    path = shutil.which("cmake")
    if path is None or subprocess.run([path, "--version"], capture_output=True).returncode != 0:
        pytest.skip("no working cmake on PATH")
    return path


def test_the_cpu_benchmark_builds_and_runs_without_a_cuda_toolkit(tmp_path):
    exe = cmake()
    cmake_dir = subprocess.run([sys.executable, "-m", "attnmerge", "--cmake-dir"], capture_output=True, text=True,
                               check=True).stdout.strip()
    build = tmp_path / "native"
    configure = subprocess.run([exe, "-S", os.path.join(ROOT, "benchmarks", "native"), "-B", str(build),
                                f"-Dattnmerge_DIR={cmake_dir}", "-DCMAKE_BUILD_TYPE=Release",
                                "-DATTNMERGE_BENCH_CUDA=OFF"], capture_output=True, text=True, timeout=300)
    assert configure.returncode == 0, configure.stdout + configure.stderr
    assert "no CUDA benchmarks: host_cpu_abi alone" in configure.stdout
    built = subprocess.run([exe, "--build", str(build)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stdout + built.stderr
    ran = subprocess.run([str(build / "host_cpu_abi")], capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    lines = [line.split() for line in ran.stdout.splitlines() if "us per call" in line]
    assert [line[:5] for line in lines] == [["1", "x", "1", "x", "8"], ["1", "x", "32", "x", "128"]], ran.stdout
    for line in lines:
        assert float(line[5]) > 0, ran.stdout
