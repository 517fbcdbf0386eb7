"""A C program links against the installed library the plain way, -L<libdir> -lattnmerge, with no
CMake: a wheel cannot hold the libattnmerge.so symlink, so it ships a linker script of that name
(INPUT(libattnmerge.so.1)), and the program then needs the SONAME file, as through the link."""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest

import attnmerge

PROGRAM = r"""
#include <math.h>
#include <stdio.h>
#include <attnmerge/attnmerge.h>

/* One row of two states: the merge of (1, lse 0) and (3, lse 0) is 2, with LSE log 2. */
int main(void) {
  float o_a[4] = {1, 1, 1, 1}, o_b[4] = {3, 3, 3, 3}, lse_a[1] = {0}, lse_b[1] = {0}, out[4], out_lse[1];
  const int64_t o_shape[3] = {1, 1, 4}, lse_shape[2] = {1, 1};
  attnmerge_tensor t_out = attnmerge_contiguous_tensor(out, ATTNMERGE_FLOAT32, ATTNMERGE_HOST, 3, o_shape);
  attnmerge_tensor t_out_lse = attnmerge_contiguous_tensor(out_lse, ATTNMERGE_FLOAT32, ATTNMERGE_HOST, 2, lse_shape);
  attnmerge_tensor t_oa = attnmerge_contiguous_tensor(o_a, ATTNMERGE_FLOAT32, ATTNMERGE_HOST, 3, o_shape);
  attnmerge_tensor t_la = attnmerge_contiguous_tensor(lse_a, ATTNMERGE_FLOAT32, ATTNMERGE_HOST, 2, lse_shape);
  attnmerge_tensor t_ob = attnmerge_contiguous_tensor(o_b, ATTNMERGE_FLOAT32, ATTNMERGE_HOST, 3, o_shape);
  attnmerge_tensor t_lb = attnmerge_contiguous_tensor(lse_b, ATTNMERGE_FLOAT32, ATTNMERGE_HOST, 2, lse_shape);
  attnmerge_status s = attnmerge_merge(&t_out, &t_out_lse, &t_oa, &t_la, &t_ob, &t_lb, NULL, NULL);
  if (s != ATTNMERGE_SUCCESS) {
    printf("%s\n", attnmerge_last_error());
    return 1;
  }
  printf("attnmerge %s: %g %g\n", attnmerge_version_string(), out[0], fabs(out_lse[0] - log(2.0)) < 1e-6 ? 1.0 : 0.0);
  return 0;
}
"""


def test_a_c_program_links_with_dash_l_attnmerge_and_runs(tmp_path):
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler on PATH")
    libdir = os.path.dirname(attnmerge.library_path())
    (tmp_path / "main.c").write_text(PROGRAM)
    exe = tmp_path / "main"
    build = subprocess.run([cc, "-std=c99", "-I", attnmerge.include_dir(), str(tmp_path / "main.c"), "-o", str(exe),
                            f"-L{libdir}", "-lattnmerge", f"-Wl,-rpath,{libdir}", "-lm"], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stdout == f"attnmerge {attnmerge.__version__}: 2 1\n", run.stdout + run.stderr
    # the program names the SONAME file, not libattnmerge.so
    readelf = shutil.which("readelf")
    if readelf:
        dynamic = subprocess.run([readelf, "-d", str(exe)], capture_output=True, text=True, check=True).stdout
        assert "Shared library: [libattnmerge.so.1]" in dynamic, dynamic
