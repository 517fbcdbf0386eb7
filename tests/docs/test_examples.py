"""Every example of the README and the docs runs, on the CPU, as a reader would copy it.

Each ```python block runs on its own (its own imports and inputs, a fresh namespace), from the
repository's root; a block that imports PyTorch, JAX, CuPy or Numba skips when that framework is not
installed, and one that imports attnmerge.jax when the build has no JAX extension.  Each ```c block
is a whole program: compiled against the installed headers and libattnmerge, run, its exit status 0
and its output the one its `/* prints: ... */` comment states.  A block that needs a GPU says so above
itself (`<!-- docs-test: gpu -->`) and runs as a `gpu` test, skipped without one; one that cannot run
here at all (several processes) says why (`<!-- docs-test: skip: REASON -->`) and is skipped with that
reason; no other block escapes.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

import attnmerge
from doc_blocks import ROOT, Block, all_blocks, skip_unless_importable

RUN = ("python", "c")
# Languages shown, never run: shell commands, program output, build files.
SHOWN = ("bash", "text", "cmake", "")


def test_every_block_is_run_shown_or_skipped_with_a_reason():
    """A block in a language the tests run is run unless a directive says why not; other blocks are
    only in languages that are shown (commands, output), so that no example is quietly untested."""
    for block in all_blocks():
        assert block.language in RUN + SHOWN, f"{block.id}: a ```{block.language} block, neither run nor shown"
        if block.directive is not None:
            assert block.needs_gpu or block.skip_reason, \
                f"{block.id}: expected 'gpu' or 'skip: REASON', got {block.directive!r}"
            assert block.language in RUN, f"{block.id}: a directive above a block that never runs"
        assert block.indent == "", f"{block.id}: an indented fence (the site's Markdown renders it as text)"


def params(language):
    """The blocks of a language, those that need a GPU marked `gpu` (tests/conftest.py skips them
    without one)."""
    return [pytest.param(b, id=b.id, marks=[pytest.mark.gpu] if b.needs_gpu else []) for b in all_blocks(language)]


@pytest.mark.parametrize("block", params("python"))
def test_python_example_runs(block: Block, monkeypatch):
    if block.skip_reason:
        pytest.skip(f"{block.id}: {block.skip_reason}")
    skip_unless_importable(block.code)
    monkeypatch.chdir(ROOT)
    exec(compile(block.code, block.id, "exec"), {"__name__": "__docs_example__"})


PRINTS = re.compile(r"/\* prints: (.*?) \*/")


def c_compiler() -> str:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    pytest.skip("no C compiler on PATH")


@pytest.mark.parametrize("block", params("c"))
def test_c_example_compiles_links_and_runs(block: Block, tmp_path):
    if block.skip_reason:
        pytest.skip(f"{block.id}: {block.skip_reason}")
    assert "int main" in block.code, f"{block.id}: a C block that is not a whole program (mark it or complete it)"
    source, program = tmp_path / "example.c", tmp_path / "example"
    source.write_text(block.code)
    lib_dir = os.path.dirname(attnmerge.library_path())
    build = subprocess.run([c_compiler(), "-std=c11", "-Wall", "-Werror", str(source), "-o", str(program),
                            f"-I{attnmerge.include_dir()}", f"-L{lib_dir}", "-lattnmerge",
                            f"-Wl,-rpath,{lib_dir}", "-lm"], capture_output=True, text=True)
    assert build.returncode == 0, build.stdout + build.stderr
    run = subprocess.run([str(program)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    expected = PRINTS.findall(block.code)
    assert expected, f"{block.id}: no /* prints: ... */ comment to hold the output to"
    assert run.stdout.strip() == "\n".join(expected), run.stdout
