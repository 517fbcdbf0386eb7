"""attnmerge_contiguous_tensor (attnmerge.h): the descriptor of a contiguous array, as a C program
compiled against the installed header gets it: the fields given, row-major strides in elements,
flags 0; an ndim outside 0 to ATTNMERGE_MAX_NDIM kept as given, with no shape, for the ops to refuse."""
from __future__ import annotations

import os
import shutil
import subprocess

import numpy as np
import pytest

import attnmerge
import c_abi

PROGRAM = r"""
#include <stdio.h>
#include <attnmerge/attnmerge.h>

int main(void) {
  static const int64_t shape[5] = {3, 0, 5, 7, 11};
  static const int32_t ndims[] = {0, 1, 2, 3, 4, 5, -1};
  int k, i;
  for (k = 0; k < (int)(sizeof ndims / sizeof ndims[0]); ++k) {
    int dummy;
    const attnmerge_tensor t = attnmerge_contiguous_tensor(&dummy, ATTNMERGE_BFLOAT16, 2, ndims[k], shape + 1);
    printf("%d %d %d %u %d", t.ndim, t.dtype, t.device, t.flags, t.data == (void*)&dummy);
    for (i = 0; i < ATTNMERGE_MAX_NDIM; ++i) printf(" %lld", (long long)t.shape[i]);
    for (i = 0; i < ATTNMERGE_MAX_NDIM; ++i) printf(" %lld", (long long)t.strides[i]);
    printf("\n");
  }
  return 0;
}
"""


@pytest.fixture(scope="module")
def lines(tmp_path_factory):
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        pytest.skip("no C compiler on PATH")
    tmp = tmp_path_factory.mktemp("contiguous")
    (tmp / "main.c").write_text(PROGRAM)
    build = subprocess.run([cc, "-std=c99", "-Wall", "-Wextra", "-pedantic", "-Werror", "-I", attnmerge.include_dir(),
                            str(tmp / "main.c"), "-o", str(tmp / "main")], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    out = subprocess.run([str(tmp / "main")], capture_output=True, text=True, check=True).stdout
    return [[int(x) for x in line.split()] for line in out.splitlines()]


def expected(ndim):
    shape = [0, 5, 7, 11][:ndim]
    strides = np.zeros(0, np.int64) if ndim == 0 else np.cumprod([1] + shape[:0:-1])[::-1]
    pad = [0] * (4 - ndim)
    return shape + pad, [int(s) for s in strides] + pad


@pytest.mark.parametrize("k, ndim", [(k, k) for k in range(5)])
def test_the_strides_are_a_contiguous_arrays(lines, k, ndim):
    line = lines[k]
    assert line[:5] == [ndim, c_abi.BFLOAT16, 2, 0, 1]
    shape, strides = expected(ndim)
    assert line[5:9] == shape and line[9:13] == strides
    # as NumPy lays out the same array (a size of 0 included), in elements
    if ndim:
        assert strides[:ndim] == [s // 2 for s in np.empty([max(n, 1) for n in shape[:ndim]], np.float16).strides]


@pytest.mark.parametrize("k, ndim", [(5, 5), (6, -1)])
def test_an_ndim_out_of_range_is_kept_for_the_ops_to_refuse(lines, k, ndim):
    assert lines[k] == [ndim, c_abi.BFLOAT16, 2, 0, 1] + [0] * 8
