"""CMake refuses an unsupported CUDA toolkit at configure time, before project(), in one line: the
version found, the versions supported, and how to point the build at another toolkit; for nvcc,
and for the clang route of a CUDA 12 build from PyPI (ATTNMERGE_CUDA_CLANG, ATTNMERGE_CUDA_ROOT).
Checked with stand-ins that only answer --version or exist (no toolkit needed)."""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
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
    rc, out = configure(tmp_path, nvcc, archs="release")  # the release list has sm_100 and sm_120
    assert rc != 0
    lines = refusal(out)
    assert len(lines) == 1, out
    for word in ["CUDA 12.4", "sm_100", "12.8", "ATTNMERGE_CUDA_ARCHITECTURES", *WAYS_OUT]:
        assert word in lines[0], f"{word!r} not in {lines[0]!r}"


@pytest.mark.parametrize("release,archs", [("12.0", "80;90"), ("12.8", "release"), ("13.0", "release")])
def test_a_supported_toolkit_passes_the_check(tmp_path, release, archs):
    # CMake's own compiler checks then fail on the stand-in; the check must not be what stops it.
    rc, out = configure(tmp_path, fake_nvcc(tmp_path, release), archs=archs)
    assert not refusal(out), out


# --- the clang route (ATTNMERGE_CUDA_CLANG): clang compiles, the toolkit's ptxas and nvFatbin
# assemble; stand-ins of each piece that only answer --version or exist.


def fake_clang(tmp_path, version):
    path = tmp_path / "bin" / "clang++"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/bin/sh\necho 'Debian clang version {version}'\n")
    path.chmod(0o755)
    return str(path)


def fake_cuda_roots(tmp_path, headers="12.9", ptxas="12.9", missing=()):
    """PyPI's CUDA 12 layout: four roots, each with its part of the toolkit."""
    major, minor = (int(x) for x in headers.split("."))
    files = {
        "cuda_runtime/include/cuda.h": f"#define CUDA_VERSION {major * 1000 + minor * 10}\n",
        "cuda_runtime/include/cuda_runtime.h": "",
        "cuda_runtime/lib/libcudart_static.a": "",
        "cuda_nvcc/include/crt/host_defines.h": "",
        "cuda_nvcc/nvvm/libdevice/libdevice.10.bc": "",
        "cuda_cccl/include/cuda/std/cstdint": "",
        "nvfatbin/lib/libnvfatbin.so.12": "",
        "nvfatbin/include/nvFatbin.h": "",
    }
    roots = [tmp_path / "nvidia" / name for name in ("cuda_nvcc", "cuda_runtime", "cuda_cccl", "nvfatbin")]
    for rel, text in files.items():
        if any(rel.endswith(m) for m in missing):
            continue
        p = tmp_path / "nvidia" / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    if "ptxas" not in missing:
        p = tmp_path / "nvidia" / "cuda_nvcc" / "bin" / "ptxas"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(f"#!/bin/sh\necho 'Cuda compilation tools, release {ptxas}, V{ptxas}.86'\n")
        p.chmod(0o755)
    return ";".join(str(r) for r in roots)


def configure_clang(tmp_path, clang, roots, archs="90", flavor=None):
    cmake = shutil.which("cmake")
    if cmake is None:
        pytest.skip("no cmake on PATH")
    env = {k: v for k, v in os.environ.items() if k not in ("CUDACXX", "ATTNMERGE_CUDA_ARCHITECTURES")}
    args = [cmake, "-S", ROOT, "-B", str(tmp_path / "build"), "-DATTNMERGE_BUILD_PYTHON=OFF",
            f"-DATTNMERGE_CUDA_CLANG={clang}", f"-DATTNMERGE_CUDA_ROOT={roots}", f"-DATTNMERGE_CUDA_ARCHITECTURES={archs}"]
    if flavor:
        args.append(f"-DATTNMERGE_CUDA_FLAVOR={flavor}")
    p = subprocess.run(args, capture_output=True, text=True, env=env, timeout=120)
    return p.returncode, p.stdout + p.stderr


def one_refusal(output):
    lines = [line.strip() for line in output.splitlines() if line.strip().startswith("attnmerge: ")]
    assert len(lines) == 1, output
    return lines[0]


def test_pypis_split_cuda12_configures_with_clang(tmp_path):
    rc, out = configure_clang(tmp_path, fake_clang(tmp_path, "19.1.7"), fake_cuda_roots(tmp_path), flavor="cu12")
    assert rc == 0, out
    assert "compiled by" in out and "against CUDA 12.9" in out
    merged = tmp_path / "build" / "attnmerge-cuda-root"
    for rel in ("include/cuda.h", "include/crt/host_defines.h", "include/cuda/std/cstdint", "include/nvFatbin.h",
                "bin/ptxas", "nvvm/libdevice/libdevice.10.bc", "include/curand_mtgp32_kernel.h"):
        assert (merged / rel).exists(), rel


@pytest.mark.parametrize("case,words", [
    ("old clang", ["clang 18.1", "clang 19 or newer"]),
    ("cuda 11", ["CUDA 11.8", "CUDA 12.0 to 13.x"]),
    ("mixed", ["ptxas of CUDA 13.0", "headers of CUDA 12.9"]),
    ("flavor", ["CUDA 12.9", "ATTNMERGE_CUDA_FLAVOR=cu13", "CUDA 13.x"]),
    ("no ptxas", ["bin/ptxas"]),
    ("no nvfatbin", ["libnvfatbin"]),
    ("sm_120 on 12.4", ["CUDA 12.4", "sm_120", "12.8"]),
])
def test_the_clang_route_refuses_a_toolkit_in_one_line(tmp_path, case, words):
    clang = fake_clang(tmp_path, "18.1.8" if case == "old clang" else "19.1.7")
    roots = fake_cuda_roots(tmp_path, headers={"cuda 11": "11.8", "sm_120 on 12.4": "12.4"}.get(case, "12.9"),
                            ptxas={"cuda 11": "11.8", "mixed": "13.0", "sm_120 on 12.4": "12.4"}.get(case, "12.9"),
                            missing={"no ptxas": ("ptxas",), "no nvfatbin": ("libnvfatbin.so.12",)}.get(case, ()))
    rc, out = configure_clang(tmp_path, clang, roots, archs="90;120" if case == "sm_120 on 12.4" else "90",
                              flavor="cu13" if case == "flavor" else None)
    assert rc != 0
    line = one_refusal(out)
    for word in words:
        assert word in line, (word, line)


def test_an_nvcc_of_the_other_major_is_refused_by_the_flavor(tmp_path):
    nvcc = fake_nvcc(tmp_path, "13.0")
    cmake = shutil.which("cmake")
    if cmake is None:
        pytest.skip("no cmake on PATH")
    p = subprocess.run([cmake, "-S", ROOT, "-B", str(tmp_path / "build"), "-DATTNMERGE_BUILD_PYTHON=OFF",
                        f"-DCMAKE_CUDA_COMPILER={nvcc}", "-DATTNMERGE_CUDA_ARCHITECTURES=90",
                        "-DATTNMERGE_CUDA_FLAVOR=cu12"], capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    line = one_refusal(p.stdout + p.stderr)
    for word in ["CUDA 13.0", "ATTNMERGE_CUDA_FLAVOR=cu12", "CUDA 12.x", *WAYS_OUT]:
        assert word in line, (word, line)
