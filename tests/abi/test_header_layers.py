"""The layers' boundaries, on the CPU: every public header compiles on its own (host C++ for the .h
headers, nvcc for the .cuh ones where a toolkit is on PATH), and the binding includes nothing of the
library but its C ABI header."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

import attnmerge

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
INCLUDE = os.path.join(ROOT, "cpp", "include")
HEADERS = sorted(os.listdir(os.path.join(INCLUDE, "attnmerge")))


def _compiler(kind):
    if kind == "cuh":
        return shutil.which("nvcc") or (
            "/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None)
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")


@pytest.mark.parametrize("header", HEADERS)
def test_header_compiles_alone(header, tmp_path):
    kind = "cuh" if header.endswith(".cuh") else "h"
    cc = _compiler(kind)
    if cc is None:
        pytest.skip(f"no {'nvcc' if kind == 'cuh' else 'C++ compiler'} on PATH")
    src = tmp_path / ("one.cu" if kind == "cuh" else "one.cpp")
    src.write_text(f'#include "attnmerge/{header}"\n#include "attnmerge/{header}"\n')  # and guarded
    cmd = [cc, "-std=c++17", "-I", INCLUDE, "-c", str(src), "-o", str(tmp_path / "one.o")]
    if kind == "h":
        cmd[1:1] = ["-Wall"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr


def test_installed_headers_are_the_tree_headers():
    assert sorted(os.listdir(os.path.join(attnmerge.include_dir(), "attnmerge"))) == HEADERS


def test_binding_includes_only_the_c_abi():
    allowed = {"attnmerge/attnmerge.h"}
    for name in sorted(os.listdir(os.path.join(ROOT, "python", "src"))):
        path = os.path.join(ROOT, "python", "src", name)
        if not name.endswith((".cpp", ".h")) or not os.path.isfile(path):
            continue
        with open(path) as f:
            included = re.findall(r'#include\s+[<"](attnmerge/[^>"]+)[>"]', f.read())
        assert set(included) <= allowed, (name, included)
