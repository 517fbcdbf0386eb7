"""CMake refuses an unsupported CUDA toolkit at configure time, before project(), in one line: the
version found, the versions supported, and how to point the build at another toolkit.  Checked
with stand-in nvcc scripts that only answer --version (no toolkit needed)."""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
WAYS_OUT = ["CUDACXX=", "-DCMAKE_CUDA_COMPILER=", "ATTNMERGE_CUDA_FROM_PYPI=1"]


def fake_nvcc(tmp_path, release):
    path = tmp_path / "bin" / "nvcc"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\necho 'nvcc: NVIDIA (R) Cuda compiler driver'\n"
                    f"echo 'Cuda compilation tools, release {release}, V{release}.1'\n")
    path.chmod(0o755)
    return str(path)


def configure(tmp_path, nvcc, archs=None, via_env=False):
    cmake = shutil.which("cmake")
    if cmake is None:
        pytest.skip("no cmake on PATH")
    if not os.path.isfile(os.path.join(ROOT, "CMakeLists.txt")):
        pytest.skip("not run from a source tree")
    env = {k: v for k, v in os.environ.items() if k not in ("CUDACXX", "ATTNMERGE_CUDA_ARCHITECTURES")}
    args = [cmake, "-S", ROOT, "-B", str(tmp_path / "build"), "-DATTNMERGE_BUILD_PYTHON=OFF"]
    if via_env:
        env["CUDACXX"] = nvcc
    else:
        args.append(f"-DCMAKE_CUDA_COMPILER={nvcc}")
    if archs is not None:
        args.append(f"-DATTNMERGE_CUDA_ARCHITECTURES={archs}")
    p = subprocess.run(args, capture_output=True, text=True, env=env, timeout=120)
    return p.returncode, p.stdout + p.stderr


def refusal(output):
    """The check's line (CMake prints it unwrapped, after its 'CMake Error at' header)."""
    lines = [line.strip() for line in output.splitlines() if line.strip().startswith("attnmerge: CUDA")]
    return lines


@pytest.mark.parametrize("release", ["11.8", "14.0"])
@pytest.mark.parametrize("via_env", [False, True], ids=["CMAKE_CUDA_COMPILER", "CUDACXX"])
def test_an_unsupported_toolkit_is_refused_in_one_line(tmp_path, release, via_env):
    nvcc = fake_nvcc(tmp_path, release)
    rc, out = configure(tmp_path, nvcc, archs="90", via_env=via_env)
    assert rc != 0
    lines = refusal(out)
    assert len(lines) == 1, out
    line = lines[0]
    for word in [f"CUDA {release}", nvcc, "CUDA 12.0 to 13.x", *WAYS_OUT]:
        assert word in line, f"{word!r} not in {line!r}"
    assert "CMAKE_CUDA_COMPILER_ID" not in out and "simple test program" not in out, "CMake's own checks ran first"


def test_an_sm_the_toolkit_cannot_compile_is_refused(tmp_path):
    nvcc = fake_nvcc(tmp_path, "12.4")
    rc, out = configure(tmp_path, nvcc)  # the release list has sm_100 and sm_120
    assert rc != 0
    lines = refusal(out)
    assert len(lines) == 1, out
    for word in ["CUDA 12.4", "sm_100", "12.8", "ATTNMERGE_CUDA_ARCHITECTURES", *WAYS_OUT]:
        assert word in lines[0], f"{word!r} not in {lines[0]!r}"


@pytest.mark.parametrize("release,archs", [("12.0", "80;90"), ("12.8", None), ("13.0", None)])
def test_a_supported_toolkit_passes_the_check(tmp_path, release, archs):
    # CMake's own compiler checks then fail on the stand-in; the check must not be what stops it.
    rc, out = configure(tmp_path, fake_nvcc(tmp_path, release), archs=archs)
    assert not refusal(out), out
