"""The one dispatch over dtypes (cpp/src/internal.h): each dtype code an O may have reaches its own
storage type, and a code with none (which validation refuses first, so only a bug of the library
could bring one there) is reported as an error naming it, never run as another type.  float64 is
the CPU path's alone: the GPU's dispatch (dispatch_in_dtype / dispatch_out_dtype, which every
kernel is compiled from) has no type for it, and the CPU path's takes it in float64 calls only."""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest

import c_abi

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Each line: the code, the dispatch, its status, the type's size (0: none was called), the message.
PROBE = r"""
#include <cstdio>
#include "internal.h"
using namespace attnmerge::detail;
template <typename Real>
void cpu(int code, const char* kind) {
  std::size_t in_size = 0, out_size = 0;
  clear_error();
  const attnmerge_status in = dispatch_cpu_in_dtype<Real>(code, [&](auto tag) { in_size = sizeof tag; });
  std::printf("%d %s-in %d %zu %s\n", code, kind, static_cast<int>(in), in_size, attnmerge_last_error());
  clear_error();
  const attnmerge_status out = dispatch_cpu_out_dtype<Real>(code, [&](auto tag) { out_size = sizeof tag; });
  std::printf("%d %s-out %d %zu %s\n", code, kind, static_cast<int>(out), out_size, attnmerge_last_error());
}
int main() {
  for (int code = -1; code <= 9; ++code) {
    cpu<float>(code, "cpu32");
    cpu<double>(code, "cpu64");
    std::size_t in_size = 0, out_size = 0;
    clear_error();
    const attnmerge_status in = dispatch_in_dtype(code, [&](auto tag) { in_size = sizeof tag; });
    std::printf("%d in %d %zu %s\n", code, static_cast<int>(in), in_size, attnmerge_last_error());
    clear_error();
    const attnmerge_status out = dispatch_out_dtype(code, [&](auto tag) {
      out_size = sizeof tag;
      return ATTNMERGE_ERROR_CUDA;  // a status f returns comes back
    });
    std::printf("%d out %d %zu %s\n", code, static_cast<int>(out), out_size, attnmerge_last_error());
  }
  return 0;
}
"""


@pytest.fixture(scope="module")
def lines(tmp_path_factory):
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if cxx is None or not os.path.isdir(os.path.join(ROOT, "cpp", "src")):
        pytest.skip("needs a C++ compiler and a source checkout")
    tmp = tmp_path_factory.mktemp("dispatch")
    (tmp / "probe.cpp").write_text(PROBE)
    exe = tmp / "probe"
    build = subprocess.run([cxx, "-std=c++17", "-DATTNMERGE_BUILDING_LIBRARY", "-I", os.path.join(ROOT, "cpp", "include"),
                            "-I", os.path.join(ROOT, "cpp", "src"), str(tmp / "probe.cpp"),
                            os.path.join(ROOT, "cpp", "src", "errors.cpp"), "-o", str(exe)],
                           capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-3000:]
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout
    return {(int(code), kind): (int(status), int(size), message.strip())
            for code, kind, status, size, message in (line.split(" ", 4) for line in out.splitlines())}


def message(code):
    return (f"dtype {code}: reached the dispatch of libattnmerge's kernels unvalidated (a bug of the library; "
            "please report it)")


@pytest.mark.parametrize("code, size", [(c_abi.FLOAT32, 4), (c_abi.FLOAT16, 2), (c_abi.BFLOAT16, 2)])
def test_each_input_dtype_reaches_its_own_type(lines, code, size):
    assert lines[code, "in"] == (c_abi.SUCCESS, size, "")
    assert lines[code, "out"] == (c_abi.ERROR_CUDA, size, "")


def test_fp8_reaches_its_type_as_an_output_only(lines):
    assert lines[c_abi.FLOAT8_E4M3, "out"] == (c_abi.ERROR_CUDA, 1, "")
    assert lines[c_abi.FLOAT8_E4M3, "in"] == (c_abi.ERROR_TYPE, 0, message(c_abi.FLOAT8_E4M3))


@pytest.mark.parametrize("code", [-1, c_abi.UINT8, c_abi.BOOL, c_abi.INT32, c_abi.INT64, 9])
def test_a_code_with_no_type_is_an_error_naming_it_and_runs_nothing(lines, code):
    for kind in ("in", "out", "cpu32-in", "cpu32-out", "cpu64-in", "cpu64-out"):
        assert lines[code, kind] == (c_abi.ERROR_TYPE, 0, message(code)), kind


def test_float64_reaches_double_on_the_cpu_path_alone(lines):
    for kind in ("in", "out", "cpu32-in", "cpu32-out"):  # the GPU's, and a float32 call's
        assert lines[c_abi.FLOAT64, kind] == (c_abi.ERROR_TYPE, 0, message(c_abi.FLOAT64)), kind
    for kind in ("cpu64-in", "cpu64-out"):
        assert lines[c_abi.FLOAT64, kind] == (c_abi.SUCCESS, 8, ""), kind


@pytest.mark.parametrize("code", [c_abi.FLOAT32, c_abi.FLOAT16, c_abi.BFLOAT16, c_abi.FLOAT8_E4M3])
def test_a_float64_call_reaches_no_other_type(lines, code):
    for kind in ("cpu64-in", "cpu64-out"):
        assert lines[code, kind] == (c_abi.ERROR_TYPE, 0, message(code)), kind


@pytest.mark.parametrize("code, size", [(c_abi.FLOAT32, 4), (c_abi.FLOAT16, 2), (c_abi.BFLOAT16, 2)])
def test_a_float32_calls_cpu_dispatch_is_the_gpus(lines, code, size):
    assert lines[code, "cpu32-in"] == (c_abi.SUCCESS, size, "")
    assert lines[code, "cpu32-out"] == (c_abi.SUCCESS, size, "")
    assert lines[c_abi.FLOAT8_E4M3, "cpu32-out"] == (c_abi.SUCCESS, 1, "")
