"""The two published builds, attnmerge-cu12 and attnmerge-cu13, on the CPU:
- the error of a GPU call on a driver older than the build's CUDA names the driver's CUDA version,
  the build's, the driver the build needs and the build that fits (cpp/src/cuda_builds.h, printed
  by tests/native/driver_probe.cpp);
- that table and the build backend's agree on the distributions and their drivers;
- the installed library carries the GPU code build_info() names: a cubin for each SM of its SASS and
  PTX for each of its virtual architectures (a build of PTX alone, the default where the build machine
  has no GPU, has no cubin), and the wheels the release list;
- the cubins are what its CUDA version promises: cuobjdump reads each one's ELF ABI (7 for CUDA 12
  below sm_100, which drivers from R525 on load; 8 for CUDA 13, R580 on), the toolkit that assembled
  it and its SM, and the PTX's ISA version;
- it compiles no more kernels per architecture than the stated budget, in its cubins and its PTX."""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import shutil
import subprocess

import pytest

import attnmerge

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SRC = os.path.join(ROOT, "cpp", "src")
PROBE = os.path.join(os.path.dirname(__file__), "..", "native", "driver_probe.cpp")
BACKEND = os.path.join(ROOT, "build_backend", "_attnmerge_backend.py")


@pytest.fixture(scope="module")
def describe(tmp_path_factory):
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler on PATH")
    if not os.path.isfile(os.path.join(SRC, "cuda_builds.h")):
        pytest.skip("not run from a source tree")
    exe = tmp_path_factory.mktemp("probe") / "driver_probe"
    build = subprocess.run([cxx, "-std=c++17", "-Wall", "-I", SRC, PROBE, "-o", str(exe)], capture_output=True,
                           text=True)
    assert build.returncode == 0, build.stderr

    def texts(pairs):
        run = subprocess.run([str(exe)], input="".join(f"{d} {b}\n" for d, b in pairs), capture_output=True,
                             text=True, timeout=60)
        assert run.returncode == 0, run.stderr
        lines = run.stdout.splitlines()
        assert len(lines) == len(pairs)
        return [None if line == "-" else line for line in lines]

    return texts


def test_a_cuda13_build_on_an_r570_driver_points_at_the_cuda12_build(describe):
    (text,) = describe([(12080, 13000)])
    for word in ["CUDA 12.8", "CUDA 13.0", "R580", "install attnmerge-cu12", "R525", "update the driver"]:
        assert word in text, (word, text)


def test_a_cuda12_build_on_a_cuda11_driver_asks_for_a_new_driver(describe):
    (text,) = describe([(11080, 12090)])
    for word in ["CUDA 11.8", "CUDA 12.9", "R525", "update the driver"]:
        assert word in text, (word, text)
    assert "install" not in text  # no build fits CUDA 11


@pytest.mark.parametrize("driver,build", [(12000, 12090), (12020, 12090), (13000, 12090), (13000, 13050),
                                          (0, 13000), (0, 12090)])
def test_no_text_where_the_driver_is_not_the_reason(describe, driver, build):
    # minor-version compatibility: a 12.9 build runs on CUDA 12.0's driver; 0: no driver at all,
    # which the library reports as before.
    assert describe([(driver, build)]) == [None]


def _library_table():
    with open(os.path.join(SRC, "cuda_builds.h")) as f:
        text = f.read()
    return {int(m): (drv, dist) for m, drv, dist in re.findall(r'\{(\d+), "(R\d+)", "([\w-]+)"\}', text)}


def _backend_flavors():
    with open(BACKEND) as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "FLAVORS" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("no FLAVORS in the build backend")


def test_the_library_and_the_build_backend_name_the_same_builds():
    if not os.path.isfile(BACKEND) or not os.path.isfile(os.path.join(SRC, "cuda_builds.h")):
        pytest.skip("not run from a source tree")
    library = _library_table()
    flavors = _backend_flavors()
    assert library == {f["major"]: (f["driver"], f["distribution"]) for f in flavors.values()}
    assert all(name == f"cu{f['major']}" for name, f in flavors.items())


# --- the installed library's device code ------------------------------------------------------


def _cuobjdump():
    """cuobjdump: on PATH, in a CUDA toolkit, or PyPI's nvidia-cuda-cuobjdump (the test extra), where
    scripts/sass-diff.py finds the CUDA tools."""
    spec = importlib.util.spec_from_file_location(
        "sass_diff", os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "scripts", "sass-diff.py"))
    sass_diff = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sass_diff)
    return sass_diff.tool("cuobjdump")


def _dump(what):
    """cuobjdump's `what` (-elf, -ptx) of the installed libattnmerge; skips without cuobjdump."""
    tool = _cuobjdump()
    if tool is None:
        pytest.skip("no cuobjdump (pip install nvidia-cuda-cuobjdump, or a CUDA toolkit)")
    run = subprocess.run([tool, what, attnmerge.build_info()["library"]], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr
    return run.stdout


def _sass():
    return {int(a) for a in attnmerge.build_info()["cuda_architectures"]}


def _ptx():
    return {int(a) for a in attnmerge.build_info()["cuda_ptx_architectures"]}


@pytest.fixture(scope="module")
def cubins():
    """(sm, ELF ABI, toolkit "major.minor") of every cubin in libattnmerge; none in a build of PTX alone."""
    if not _sass():
        return []
    text = _dump("-elf")
    found = []
    # CUDA 12's cuobjdump prints "64bit elf: type=2, abi=7, sm=90, toolkit=129", CUDA 13's
    # "64-bit ELF: type=ET_EXEC, ABI=8, sm=100, toolkit=12.9".
    for m in re.finditer(r"64-?bit elf: type=\w+, abi=(\d+), sm=(\d+), toolkit=(\d+)\.?(\d*)", text, re.I):
        abi, sm, major, minor = int(m.group(1)), int(m.group(2)), m.group(3), m.group(4)
        toolkit = f"{major}.{minor}" if minor else f"{major[:-1]}.{major[-1]}"
        found.append((sm, abi, toolkit))
    assert found, text[:2000]
    return found


def _build_release():
    v = attnmerge.build_info()["cuda_build_version"]
    return v // 1000, v % 1000 // 10


def test_every_architecture_of_the_build_has_its_sass(cubins):
    assert {sm for sm, _, _ in cubins} == _sass()
    if not cubins:  # then the library has no cubin at all
        assert not re.search(r"64-?bit elf", _dump("-elf"), re.I)


def test_every_virtual_architecture_of_the_build_has_its_ptx():
    targets = {int(t) for t in re.findall(r"^\.target sm_(\d+)", _dump("-ptx"), re.M)}
    assert targets == _ptx()


def test_the_build_has_gpu_code_and_says_why():
    info = attnmerge.build_info()
    assert _sass() or _ptx(), info
    assert info["cuda_architectures_choice"] in {"detected", "no-gpu", "release", "requested"}
    if info["cuda_architectures_choice"] == "no-gpu":
        assert not _sass() and min(_ptx()) == 75 and 90 in _ptx()


def test_a_build_asked_for_the_release_list_has_it():
    """The wheels ask for it (pyproject.toml's cibuildwheel environment, also their tests')."""
    if os.environ.get("ATTNMERGE_CUDA_ARCHITECTURES", "").strip().lower() != "release":
        pytest.skip("not a release build (ATTNMERGE_CUDA_ARCHITECTURES=release asks for one)")
    module = os.path.join(ROOT, "cmake", "attnmerge_cuda_architectures.cmake")
    if not os.path.isfile(module):
        pytest.skip("not run from a source tree")
    with open(module) as f:
        (release,) = re.findall(r'set\(ATTNMERGE_CUDA_RELEASE_ARCHITECTURES "([^"]+)"\)', f.read())
    info = attnmerge.build_info()
    assert info["cuda_architectures_choice"] == "release"
    assert _sass() == {int(a.split("-")[0]) for a in release.split(";") if not a.endswith("-virtual")}
    assert _ptx()  # the newest SM's PTX, or sm_90's from clang


def _no_cubin(cubins):
    if not cubins:
        pytest.skip("a build of PTX alone has no cubin")


def test_the_cubins_were_assembled_by_the_builds_cuda(cubins):
    _no_cubin(cubins)
    major, minor = _build_release()
    assert {toolkit for _, _, toolkit in cubins} == {f"{major}.{minor}"}


def test_the_cubins_carry_the_elf_abi_of_the_builds_cuda(cubins):
    # CUDA 13 moved every SM to ELF ABI 8, which drivers before R580 do not load; CUDA 12 keeps
    # ABI 7 below sm_100 (sm_100 and newer, on R570 and newer drivers, take 8 from CUDA 12.8 on).
    _no_cubin(cubins)
    major, _ = _build_release()
    for sm, abi, _ in cubins:
        expected = 8 if major >= 13 or sm >= 100 else 7
        assert abi == expected, (sm, abi, major)


def test_the_ptx_is_of_an_isa_the_builds_drivers_read():
    versions = {tuple(int(x) for x in v) for v in re.findall(r"^\.version (\d+)\.(\d+)", _dump("-ptx"), re.M)}
    assert versions, "no PTX in the library"
    major, _ = _build_release()
    # CUDA 12.x drivers JIT PTX ISA 8.x (12.9's is 8.8); CUDA 13's is 9.x.
    assert all(v[0] == (8 if major == 12 else 9) for v in versions), versions


# --- the kernels it compiles ----------------------------------------------------------------------

# Kernels per architecture: launch_merge compiles, for each (input, output) dtype and vector width,
# the variants the plan may give (plan.h: Variant, may_plan, kPlainPairs), and the backward its
# own.  Measured 1,166 on sm_90 at 2026-12-05 with six plain pairs (1,873 before the variants
# became a list: 168 share kernels no plan could launch, and plain two-way kernels for every pair),
# then 1,173 with the exchange's (exchange_kernels.cuh: a merge per input dtype and width, the
# output's dtype read at run time, and the publish), 1,174 with the probe of which code the GPU
# runs (PDL); block-scaled outputs, softmax statistics, valid states and device-side token counts
# are run-time modes of those kernels and added none.  The budget
# leaves room for a few new variants; past it, a kernel must earn its place or another must go,
# since each one costs every source build and every wheel.
KERNEL_BUDGET = 1200


def kernels_per_architecture(text: str) -> dict:
    """{sm: kernels} from `cuobjdump -res-usage`: its Function lines under each 'Fatbin elf code'
    (a cubin) of that arch; the PTX sections carry none."""
    counts, arch, elf = {}, None, False
    for line in text.splitlines():
        if line.startswith("Fatbin"):
            elf, arch = line.startswith("Fatbin elf"), None
        elif (m := re.match(r"arch = sm_(\d+)", line)) and elf:
            arch = int(m.group(1))
            counts.setdefault(arch, 0)
        elif arch is not None and re.match(r"\s*Function \S+:", line):
            counts[arch] += 1
    return counts


def ptx_kernels_per_architecture(text: str) -> dict:
    """{sm: kernels} from `cuobjdump -ptx`: the .entry lines under each PTX's .target."""
    counts, arch = {}, None
    for line in text.splitlines():
        if m := re.match(r"\.target sm_(\d+)", line):
            arch = int(m.group(1))
            counts.setdefault(arch, 0)
        elif arch is not None and re.match(r"\s*(\.visible\s+|\.weak\s+)?\.entry\s", line):
            counts[arch] += 1
    return counts


def test_kernels_per_architecture_stay_within_the_budget():
    # Counted in each SM's cubin and in each virtual architecture's PTX, which a build of PTX alone
    # (no cubin) is held to the budget by.
    sass = kernels_per_architecture(_dump("-res-usage")) if _sass() else {}
    ptx = ptx_kernels_per_architecture(_dump("-ptx"))
    assert set(sass) == _sass() and set(ptx) == _ptx(), (sass, ptx)
    counts = {**{f"sm_{a}": n for a, n in sass.items()}, **{f"compute_{a}": n for a, n in ptx.items()}}
    assert counts and all(counts.values()), counts
    assert all(n <= KERNEL_BUDGET for n in counts.values()), counts
