"""The in-tree build backend (build_backend/_attnmerge_backend.py), on the CPU with stand-in
programs: which toolkit a flavor takes, which clang compiles a cu12 build from PyPI, what CMake is
told, and the renaming of a wheel to its flavor's distribution."""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import os
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BACKEND = os.path.join(ROOT, "build_backend", "_attnmerge_backend.py")


@pytest.fixture
def backend(monkeypatch, tmp_path):
    pytest.importorskip("scikit_build_core")
    if not os.path.isfile(BACKEND):
        pytest.skip("not run from a source tree")
    for var in ("ATTNMERGE_CUDA_FLAVOR", "ATTNMERGE_CUDA_FROM_PYPI", "ATTNMERGE_CUDA_CLANG", "CUDACXX", "CUDA_HOME",
                "CUDA_PATH"):
        monkeypatch.delenv(var, raising=False)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", str(bin_dir))  # only the stand-ins below
    spec = importlib.util.spec_from_file_location("_attnmerge_backend_under_test", BACKEND)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.test_bin = bin_dir
    return module


def stand_in(directory, name, output):
    path = directory / name
    path.write_text(f"#!/bin/sh\necho '{output}'\n")
    path.chmod(0o755)
    return str(path)


def nvcc(backend, release):
    return stand_in(backend.test_bin, "nvcc", f"Cuda compilation tools, release {release}, V{release}.1")


def test_an_unknown_flavor_is_refused(backend, monkeypatch):
    monkeypatch.setenv("ATTNMERGE_CUDA_FLAVOR", "cu11")
    with pytest.raises(ValueError, match="ATTNMERGE_CUDA_FLAVOR.*cu12.*cu13.*'cu11'"):
        backend._flavor()


@pytest.mark.parametrize("flavor,release,pypi", [
    (None, None, True), (None, "13.0", False), (None, "12.4", False),
    ("cu13", None, True), ("cu13", "13.0", False), ("cu13", "12.9", True),
    ("cu12", None, True), ("cu12", "12.4", False), ("cu12", "13.0", True),
])
def test_a_flavor_takes_the_machines_nvcc_only_of_its_cuda(backend, monkeypatch, flavor, release, pypi):
    if flavor:
        monkeypatch.setenv("ATTNMERGE_CUDA_FLAVOR", flavor)
    if release:
        nvcc(backend, release)
    assert backend._use_pypi_toolkit() is pypi


def test_from_pypi_forces_either_way(backend, monkeypatch):
    nvcc(backend, "13.0")
    monkeypatch.setenv("ATTNMERGE_CUDA_FROM_PYPI", "1")
    assert backend._use_pypi_toolkit()
    monkeypatch.setenv("ATTNMERGE_CUDA_FLAVOR", "cu12")
    monkeypatch.setenv("ATTNMERGE_CUDA_FROM_PYPI", "0")
    assert not backend._use_pypi_toolkit()  # CMake then refuses the CUDA 13 nvcc, by its flavor


def test_each_flavor_asks_pypi_for_its_own_cuda(backend, monkeypatch):
    assert backend._pypi_requirements() == backend.CUDA_TOOLKIT_REQUIREMENTS
    monkeypatch.setenv("ATTNMERGE_CUDA_FLAVOR", "cu13")
    assert backend._pypi_requirements() == backend.CUDA_TOOLKIT_REQUIREMENTS
    monkeypatch.setenv("ATTNMERGE_CUDA_FLAVOR", "cu12")
    reqs = backend._pypi_requirements()
    assert all("-cu12==12.9." in r for r in reqs) and any(r.startswith("nvidia-nvfatbin-cu12") for r in reqs)


def test_the_newest_clang_19_or_later_on_path_compiles_a_cu12_build(backend):
    stand_in(backend.test_bin, "clang++-18", "Debian clang version 18.1.8")
    stand_in(backend.test_bin, "clang++-19", "Debian clang version 19.1.7 (3~deb12u1)")
    stand_in(backend.test_bin, "clang++", "clang version 17.0.6")
    assert backend._find_clang() == str(backend.test_bin / "clang++-19")


def test_no_clang_is_refused_before_any_download(backend, monkeypatch):
    stand_in(backend.test_bin, "clang++", "clang version 18.1.8")
    monkeypatch.setenv("ATTNMERGE_CUDA_FLAVOR", "cu12")
    with pytest.raises(RuntimeError, match="clang 19 or newer.*ATTNMERGE_CUDA_CLANG"):
        backend._add_requires([], {})


def test_a_cu12_build_from_pypi_points_cmake_at_clang_and_the_wheels(backend, monkeypatch, tmp_path):
    site = tmp_path / "site"
    for name in backend.CUDA12_ROOTS:
        (site / "nvidia" / name).mkdir(parents=True)
    (site / "nvidia" / "cuda_nvcc" / "bin").mkdir()
    stand_in(site / "nvidia" / "cuda_nvcc" / "bin", "ptxas", "Cuda compilation tools, release 12.9, V12.9.86")
    clang = stand_in(backend.test_bin, "clang++-19", "clang version 19.1.7")
    monkeypatch.setattr(backend.sys, "path", [str(site)])
    monkeypatch.setenv("ATTNMERGE_CUDA_FLAVOR", "cu12")
    settings = backend._toolkit_settings({})
    assert settings["cmake.define.ATTNMERGE_CUDA_FLAVOR"] == "cu12"
    assert settings["cmake.define.ATTNMERGE_CUDA_CLANG"] == clang
    roots = settings["cmake.define.ATTNMERGE_CUDA_ROOT"].split(";")
    assert [os.path.basename(r) for r in roots] == backend.CUDA12_ROOTS


def test_a_flavor_with_the_machines_nvcc_tells_cmake_its_flavor_only(backend, monkeypatch):
    nvcc(backend, "12.4")
    monkeypatch.setenv("ATTNMERGE_CUDA_FLAVOR", "cu12")
    settings = backend._toolkit_settings({})
    assert settings["cmake.define.ATTNMERGE_CUDA_FLAVOR"] == "cu12"
    assert not any("CUDA_CLANG" in k or "CUDA_COMPILER" in k for k in settings)


def _wheel(path, files):
    record = []
    with zipfile.ZipFile(path, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            record.append(f"{name},sha256={digest},{len(data)}")
        info = next(n.split("/")[0] for n in files if ".dist-info/" in n)
        z.writestr(f"{info}/RECORD", "\n".join(record + [f"{info}/RECORD,,"]) + "\n")


def test_a_wheel_renamed_to_its_flavors_distribution_is_a_valid_wheel(backend, tmp_path):
    wheel = tmp_path / "attnmerge-0.1.0-cp311-cp311-linux_x86_64.whl"
    _wheel(wheel, {
        "attnmerge/__init__.py": b"x = 1\n",
        "attnmerge/lib/libattnmerge.so.0": b"\x7fELF...",
        "attnmerge-0.1.0.dist-info/METADATA": b"Metadata-Version: 2.4\nName: attnmerge\nVersion: 0.1.0\n\nName: kept\n",
        "attnmerge-0.1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\n",
        "attnmerge-0.1.0.dist-info/licenses/LICENSE": b"Apache-2.0\n",
    })
    renamed = backend.rename_wheel(wheel, "attnmerge-cu12")
    assert renamed.name == "attnmerge_cu12-0.1.0-cp311-cp311-linux_x86_64.whl"
    assert not wheel.exists()
    with zipfile.ZipFile(renamed) as z:
        names = set(z.namelist())
        assert names == {"attnmerge/__init__.py", "attnmerge/lib/libattnmerge.so.0",
                         "attnmerge_cu12-0.1.0.dist-info/METADATA", "attnmerge_cu12-0.1.0.dist-info/WHEEL",
                         "attnmerge_cu12-0.1.0.dist-info/licenses/LICENSE", "attnmerge_cu12-0.1.0.dist-info/RECORD"}
        metadata = z.read("attnmerge_cu12-0.1.0.dist-info/METADATA").decode()
        assert "Name: attnmerge-cu12\n" in metadata and "Name: kept" in metadata  # only the header's
        rows = [r.split(",") for r in z.read("attnmerge_cu12-0.1.0.dist-info/RECORD").decode().splitlines()]
        assert {r[0] for r in rows} == names
        for name, digest, size in rows:
            if name.endswith("RECORD"):
                assert digest == size == ""
                continue
            data = z.read(name)
            assert int(size) == len(data)
            assert digest == "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def test_prepared_metadata_is_renamed_too(backend, monkeypatch, tmp_path):
    info = tmp_path / "attnmerge-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.4\nName: attnmerge\nVersion: 0.1.0\n")
    monkeypatch.setenv("ATTNMERGE_CUDA_FLAVOR", "cu13")
    assert backend._renamed_metadata(tmp_path, info.name) == "attnmerge_cu13-0.1.0.dist-info"
    assert "Name: attnmerge-cu13\n" in (tmp_path / "attnmerge_cu13-0.1.0.dist-info" / "METADATA").read_text()
    monkeypatch.delenv("ATTNMERGE_CUDA_FLAVOR")
    assert backend._renamed_metadata(tmp_path, "attnmerge_cu13-0.1.0.dist-info") == "attnmerge_cu13-0.1.0.dist-info"
