"""The emulators (tests/native/*_emulator.cpp): the library's GPU plans, launchers and kernels built
as host C++ from the installed headers against tests/native/emulated_cuda, whose launch runs each
block's threads as fibers that change hands only where a thread waits at a barrier or a shuffle,
in a set order (first to last, last to first, or shuffled).  Loaded through ctypes; shared by
test_forward_kernel_emulated.py and test_backward_kernel_emulated.py."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess

import numpy as np
import pytest

import attnmerge
from attnmerge._types import DTYPES

NATIVE = os.path.join(os.path.dirname(__file__), "native")
CODES = {d.name: d.code for d in DTYPES}  # the C ABI's dtype codes, from its own table
ORDERS = (0, 1, 2)  # emulated::Order: first to last, last to first, shuffled
I64P = ctypes.POINTER(ctypes.c_int64)


def build(source: str, tmp_path_factory) -> ctypes.CDLL:
    """tests/native/`source` built as a shared library (skipped without a C++ compiler)."""
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler on PATH")
    lib = tmp_path_factory.mktemp("emulator") / (os.path.splitext(source)[0] + ".so")
    built = subprocess.run([cxx, "-std=c++17", "-O1", "-shared", "-fPIC", "-I", os.path.join(NATIVE, "emulated_cuda"),
                            "-I", NATIVE, "-I", attnmerge.include_dir(), os.path.join(NATIVE, source), "-o", str(lib)],
                           capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr[-3000:]
    emu = ctypes.CDLL(str(lib))
    emu.emulate_error.restype = ctypes.c_char_p
    return emu


def compiled_types(emu) -> tuple:
    """The (input, output) dtype names the emulator's kernels are compiled for."""
    codes = (ctypes.c_int * 64)()
    n = emu.emulate_types(codes, 32)
    names = {d.code: d.name for d in DTYPES}
    return tuple((names[codes[2 * i]], names[codes[2 * i + 1]]) for i in range(n))


def arg(x):
    """(pointer, strides in elements) of an array, or (None, None)."""
    if x is None:
        return None, None
    strides = (ctypes.c_int64 * max(1, x.ndim))(*(s // x.itemsize for s in x.strides))
    return ctypes.c_void_p(x.ctypes.data), ctypes.cast(strides, I64P)


def pointers(*arrays):
    """The (pointer, strides) arguments of the arrays, and the stride arrays to keep alive."""
    args, keep = [], []
    for x in arrays:
        ptr, strides = arg(x)
        keep.append(strides)
        args += [ptr, strides]
    return args, keep


def order(emu, how: int, seed: int = 0) -> None:
    """The order of each block's threads in the launches that follow; forgets earlier launches."""
    emu.emulate_order(how, ctypes.c_uint32(seed))


def check(emu, status: int) -> None:
    """An emulated call's cudaError_t is 0, else the emulator's reason."""
    assert status == 0, f"cudaError_t {status}: {emu.emulate_error().decode()}"


def launches(emu, most: int = 4) -> list[dict]:
    """The launches since `order`: grid, block, dynamic shared memory and PDL of each."""
    dims = (ctypes.c_int64 * (8 * most))()
    n = emu.emulate_launches(dims, most)
    return [dict(grid=tuple(dims[8 * i:8 * i + 3]), block=tuple(dims[8 * i + 3:8 * i + 6]), smem=dims[8 * i + 6],
                 pdl=bool(dims[8 * i + 7])) for i in range(min(n, most))] + [None] * max(0, n - most)


def widest_vec(head_size, *arrays):
    """The vector width the C ABI chooses (route.cpp, choose_vec): 16 bytes of the widest dtype,
    halved until head_size, every pointer and every non-innermost stride allow it."""
    arrays = [x for x in arrays if x is not None]
    vec = 16 // max(x.itemsize for x in arrays)
    while vec > 1:
        ok = head_size % vec == 0 and all(
            x.size == 0 or (x.ctypes.data % (vec * x.itemsize) == 0 and all(
                n <= 1 or (s // x.itemsize) % vec == 0 for n, s in zip(x.shape[:-1], x.strides[:-1]))) for x in arrays)
        if ok:
            return vec
        vec //= 2
    return 1


def nan_like(x, dtype=None):
    return np.full(x.shape, np.nan, np.float32).astype(x.dtype if dtype is None else dtype)
