"""`python -m attnmerge`: build information, a self-test on the CPU and every GPU, and where the C
package lives (--cmake-dir, --include-dir)."""

from __future__ import annotations

import glob
import os
import subprocess
import sys

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
