"""scripts/sass-diff.py: which kernels two builds compile to different machine code.  Its reading of
cuobjdump's SASS and its verdicts on texts written here; on the installed library against itself,
where the tools and cubins exist, "0 differ"."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

import attnmerge

SCRIPT = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "scripts", "sass-diff.py")
_spec = importlib.util.spec_from_file_location("sass_diff", SCRIPT)
sass_diff = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sass_diff)


def sass(functions):
    """cuobjdump -sass text of {name: [instruction, ...]}, as it prints them."""
    lines = ["", "\tcode for sm_90"]
    for name, instructions in functions.items():
        lines.append(f"\t\tFunction : {name}")
        lines.append("\t.headerflags\t@\"EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)\"")
        for i, instruction in enumerate(instructions):
            lines.append(f"        /*{i * 16:04x}*/                   {instruction} ;   /* 0x000fe20000000f00 */")
        lines.append("\t\t..........")
    return "\n".join(lines)


def test_each_kernel_is_read_with_its_addresses_and_constants_masked():
    text = sass({"k1": ["MOV R1, c[0x0][0x28]", "LDG.E R2, desc[UR4][R2.64]"], "k2": ["EXIT"]})
    assert sass_diff.kernels(text) == {"k1": ["MOV R1, c[X][X]", "LDG.E R2, desc[UR4][R2.64]"], "k2": ["EXIT"]}


def test_the_verdicts_tell_a_renumbering_from_other_code():
    old = sass_diff.kernels(sass({"same": ["EXIT"], "regs": ["IADD3 R1, R2, R3, RZ"], "code": ["FADD R1, R2, R3"],
                                  "gone": ["EXIT"]}))
    new = sass_diff.kernels(sass({"same": ["EXIT"], "regs": ["IADD3 R4, R2, R3, RZ"], "code": ["FMUL R1, R2, R3"],
                                  "added": ["EXIT"]}))
    same, differ, beyond, only_old, only_new = sass_diff.compare(old, new)
    assert same == ["same"]
    assert differ == [("code", 1, 1), ("regs", 1, 1)]
    assert beyond == ["code"]
    assert (only_old, only_new) == (["gone"], ["added"])


def test_the_installed_library_against_itself_differs_nowhere():
    if sass_diff.tool("cuobjdump") is None or sass_diff.tool("nvdisasm") is None:
        pytest.skip("no cuobjdump and nvdisasm (a CUDA toolkit, or nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm)")
    if not attnmerge.build_info()["cuda_architectures"]:
        pytest.skip("a build of PTX alone: no cubin to read")
    library = attnmerge.build_info()["library"]
    run = subprocess.run([sys.executable, SCRIPT, library, library], capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr
    assert " 0 differ (0 beyond register numbers); 0 only in the old, 0 only in the new" in run.stdout
