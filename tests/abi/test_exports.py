"""libattnmerge exports exactly the C API attnmerge.h documents, nothing of C++, and the version it
reports agrees with the installed header, the Python package and its distribution metadata."""

from __future__ import annotations

import glob
import importlib.metadata
import os
import pathlib
import re
import shutil
import subprocess

import pytest

import attnmerge
import c_abi

# Symbols every ELF shared library may define besides its own.
_LINKER_SYMBOLS = {"_init", "_fini", "_edata", "_end", "__bss_start"}


def installed_header() -> str:
    path = os.path.join(attnmerge.include_dir(), "attnmerge", "attnmerge.h")
    assert os.path.isfile(path), f"the package ships no C header at {path}"
    with open(path) as f:
        return f.read()


def documented_functions(header: str) -> set[str]:
    """The names of the functions declared ATTNMERGE_API (a declaration may span lines)."""
    code = re.sub(r"/\*.*?\*/", " ", header, flags=re.S)
    code = re.sub(r"#define[^\n]*(\\\n[^\n]*)*", " ", code)  # not the macro's own definition
    return set(re.findall(r"\bATTNMERGE_API\b[^;{]*?\b(attnmerge_\w+)\s*\(", code, flags=re.S))


def macro(header: str, name: str) -> str:
    m = re.search(rf"^#define\s+{name}\s+(.+?)\s*$", header, flags=re.M)
    assert m, f"{name} is not defined in attnmerge.h"
    return m.group(1)


def exported_symbols() -> set[str]:
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm (binutils) is not installed")
    out = subprocess.run([nm, "-D", "--defined-only", attnmerge.library_path()], capture_output=True, text=True,
                         check=True).stdout
    names = set()
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 2:
            names.add(parts[-1].split("@")[0])
    return names - _LINKER_SYMBOLS


def test_the_header_declares_the_api_the_ctypes_binding_covers():
    assert documented_functions(installed_header()) == set(c_abi.FUNCTIONS)


def test_the_library_exports_exactly_the_documented_functions():
    documented = documented_functions(installed_header())
    exported = exported_symbols()
    assert exported - documented == set(), f"exported but not in attnmerge.h: {sorted(exported - documented)}"
    assert documented - exported == set(), f"documented but not exported: {sorted(documented - exported)}"


def test_no_cpp_symbols_are_exported():
    mangled = sorted(s for s in exported_symbols() if s.startswith("_Z"))
    assert not mangled, f"C++ symbols leak from libattnmerge: {mangled[:20]}"


def test_the_installed_header_is_the_source_header():
    source = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "cpp", "include", "attnmerge", "attnmerge.h")
    if not os.path.isfile(source):
        pytest.skip("not run from a source checkout")
    with open(source) as f:
        assert f.read() == installed_header(), "the installed attnmerge.h differs from cpp/include/attnmerge/attnmerge.h"


def test_versions_agree():
    header = installed_header()
    major, minor, patch = (int(macro(header, f"ATTNMERGE_VERSION_{p}")) for p in ("MAJOR", "MINOR", "PATCH"))
    string = macro(header, "ATTNMERGE_VERSION_STRING").strip('"')
    lib = c_abi.load()
    assert string == f"{major}.{minor}.{patch}"
    assert lib.attnmerge_version() == major * 10000 + minor * 100 + patch
    assert lib.attnmerge_version_string().decode() == string
    assert attnmerge.__version__ == string
    # the package's distribution: attnmerge, attnmerge-cu12 or attnmerge-cu13, whichever installed it
    distributions = importlib.metadata.packages_distributions().get("attnmerge", [])
    assert distributions and {importlib.metadata.version(d) for d in distributions} == {string}, distributions


def test_the_info_queries_answer_without_a_gpu():
    lib = c_abi.load()
    sass, ptx = lib.attnmerge_cuda_architectures().decode(), lib.attnmerge_cuda_ptx_architectures().decode()
    assert sass or ptx  # a build of PTX alone has no SASS
    assert all(a.isdigit() for a in f"{sass};{ptx}".split(";") if a), (sass, ptx)
    assert lib.attnmerge_cuda_architectures_choice().decode() in {"detected", "no-gpu", "release", "requested"}
    assert lib.attnmerge_cuda_build_version() >= 12000
    assert lib.attnmerge_cuda_driver_version() >= 0
    assert lib.attnmerge_device_count() >= 0
    assert lib.attnmerge_pointer_device(None) == c_abi.HOST
    assert {s: lib.attnmerge_status_string(s).decode() for s in c_abi.STATUSES} == {
        0: "success", 1: "invalid value", 2: "invalid type", 3: "no CUDA device", 4: "CUDA runtime error",
        5: "timed out waiting for a peer"}
    assert lib.attnmerge_status_string(99).decode() == "unknown status"


def dynamic_section(path: str) -> str:
    readelf = shutil.which("readelf")
    if readelf is None:
        pytest.skip("readelf (binutils) is not installed")
    return subprocess.run([readelf, "-d", path], capture_output=True, text=True, check=True).stdout


# The C ABI's generation, which the SONAME names: 1 since 0.2.0, whose attnmerge_options (with
# struct_size) a program built against 0.1.0's (without it) would misread: such a program finds no
# libattnmerge.so.0 and does not start, rather than run with its options misread.
SONAME = "libattnmerge.so.1"


def test_the_library_has_a_versioned_soname_and_the_package_loads_it_by_it():
    # The wheel ships the SONAME file alone; the binding and the CMake package both name it.
    name = SONAME
    path = attnmerge.library_path()
    assert os.path.basename(path) == name, path
    assert f"Library soname: [{name}]" in dynamic_section(path)
    from attnmerge import _C

    assert f"Shared library: [{name}]" in dynamic_section(_C.__file__)
    targets = "".join(pathlib.Path(f).read_text() for f in glob.glob(os.path.join(attnmerge.cmake_dir(), "attnmergeTargets*.cmake")))
    assert name in targets


def test_options_carry_their_layouts_size_and_a_size_not_this_layouts_is_refused():
    """attnmerge_options.struct_size: 0 or sizeof(attnmerge_options) is this layout (the ctypes
    binding's, which must match the header's), the baseline of 0.2.0; any other size is refused
    before anything is written, naming the field (tests/errors/test_caller_names.py reads the
    layout field by field)."""
    import ctypes

    import numpy as np

    rng = np.random.default_rng(0)
    o = rng.standard_normal((3, 2, 2, 8)).astype(np.float32)
    lse = rng.standard_normal((3, 2, 2)).astype(np.float32)
    size = ctypes.sizeof(c_abi.Options)
    for struct_size, ok in ((0, True), (size, True), (size - 4, False), (size + 8, False), (1, False)):
        out, out_lse = np.full((3, 2, 8), np.nan, np.float32), np.full((3, 2), np.nan, np.float32)
        opts = c_abi.options()
        opts.struct_size = struct_size
        t = c_abi.tensor_from
        status = c_abi.merge_states(t(out), t(out_lse), t(o), t(lse), opts)
        if ok:
            assert status == c_abi.SUCCESS and np.isfinite(out).all(), struct_size
        else:
            assert status == c_abi.ERROR_VALUE and c_abi.last_error() == (
                f"options.struct_size: expected 0 or {size} (sizeof(attnmerge_options) of attnmerge 0.2.0), "
                f"got {struct_size}")
            assert np.isnan(out).all() and np.isnan(out_lse).all()


def test_version_and_build_info():
    info = attnmerge.build_info()
    for key in ("version", "cuda_build_version", "cuda_architectures", "driver_version", "device_count"):
        assert key in info, key
    assert info["version"] == attnmerge.__version__
    assert isinstance(attnmerge.__version__, str) and attnmerge.__version__.count(".") >= 2
    assert isinstance(info["device_count"], int) and info["device_count"] >= 0
    assert info["cuda_architectures"] or info["cuda_ptx_architectures"]


@pytest.mark.parametrize("building, linkage", [(False, "__declspec(dllimport)"), (True, "__declspec(dllexport)")])
def test_the_api_macro_exports_where_the_library_is_built_and_imports_elsewhere(building, linkage, tmp_path):
    """ATTNMERGE_API on Windows, as the preprocessor expands it: dllexport for the library's own
    sources (ATTNMERGE_BUILDING_LIBRARY), dllimport for every program that includes the header."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        pytest.skip("no C compiler on PATH")
    src = tmp_path / "includer.c"
    src.write_text("#include <attnmerge/attnmerge.h>\n")
    args = [cc, "-E", "-D_WIN32", "-I", attnmerge.include_dir(), str(src)]
    if building:
        args.insert(2, "-DATTNMERGE_BUILDING_LIBRARY")
    text = subprocess.run(args, capture_output=True, text=True, check=True).stdout
    declared = re.findall(r"(__declspec\(\w+\))\s*attnmerge_status\s+attnmerge_merge\s*\(", text)
    assert declared == [linkage], declared
