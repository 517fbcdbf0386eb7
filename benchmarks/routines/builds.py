"""The peers' code, built on the machine that runs it, from the folders benchmarks/peers/fetch.py
fills: FlashInfer's cascade launchers through benchmarks/peers/flashinfer_cascade.cu (a shared
library, called through ctypes) and vLLM's merge_attn_states through benchmarks/peers/vllm_merge.cpp
(a PyTorch extension).  Builds go to benchmarks/peers/build/ (ignored), named by a hash of their
sources, flags and target, so that a changed source or flag builds anew and nothing is built twice."""
from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import time

PEERS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "peers")
BUILD = os.path.join(PEERS, "build")
# benchmarks/peers/fetch.py: what each peer is and where its folder lies
_spec = importlib.util.spec_from_file_location("peers_fetch", os.path.join(PEERS, "fetch.py"))
fetch = sys.modules.setdefault(_spec.name, importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(fetch)

# The flags FlashInfer's JIT gives its cascade module; the library links its CUDA runtime statically.
FLASHINFER_FLAGS = ["-O3", "-std=c++17", "-use_fast_math", "-DNDEBUG", "--expt-relaxed-constexpr", "-shared",
                    "-Xcompiler", "-fPIC"]
# vLLM builds its kernels as Release (-O3) with PyTorch's CUDA flags, which cpp_extension adds.
VLLM_FLAGS = ["-O3"]


class PeerMissing(RuntimeError):
    """A peer's fetched folder is missing or incomplete."""


def require(peer):
    """The peer's folder, or PeerMissing saying how to fetch it."""
    if not fetch.fetched(peer):
        rel = os.path.relpath(fetch.folder(peer))
        raise PeerMissing(
            f"{rel}/ does not hold {fetch.source_line(peer)}: run `python benchmarks/peers/fetch.py` on a machine "
            f"that reaches PyPI, and carry {rel} to the GPU machine (nothing under it may be committed)")
    return fetch.folder(peer)


def arch(torch=None):
    """The target: the current GPU's (sm_90 on an H100 or H200), or sm_90 without one."""
    if torch is not None and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return f"{major}{minor}"
    return "90"


def digest(paths, *extra):
    h = hashlib.sha256(" ".join(extra).encode())
    for p in paths:
        h.update(os.path.basename(p).encode())
        with open(p, "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:16]


def tree(root):
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.endswith((".h", ".cuh", ".cu")))


def nvcc():
    for cand in (os.environ.get("NVCC"), os.path.join(os.environ.get("CUDA_HOME", "/nonexistent"), "bin", "nvcc"),
                 shutil.which("nvcc")):
        if cand and os.access(cand, os.X_OK):
            return cand
    raise RuntimeError("nvcc not found (set NVCC or CUDA_HOME, or put nvcc on PATH)")


def flashinfer_library(sm):
    """The path of the FlashInfer library for sm_`sm`, built here unless one of the same sources and
    flags exists."""
    root = require(fetch.FLASHINFER)
    src = os.path.join(PEERS, "flashinfer_cascade.cu")
    flags = FLASHINFER_FLAGS + [f"-arch=sm_{sm}"]
    lib = os.path.join(BUILD, f"libam_flashinfer-{digest([src] + tree(root), *flags)}.so")
    if not os.path.isfile(lib):
        os.makedirs(BUILD, exist_ok=True)
        cmd = [nvcc(), *flags, "-I", os.path.join(root, "include"), src, "-o", lib + ".tmp"]
        start = time.time()
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"nvcc failed ({done.returncode}): {' '.join(cmd)}\n{done.stdout}{done.stderr}")
        os.replace(lib + ".tmp", lib)
        print(f"built {os.path.relpath(lib)} in {time.time() - start:.0f} s", flush=True)
    return lib


class FlashInfer:
    """FlashInfer's four cascade launchers, on torch tensors, on torch's current stream."""

    TYPES = {"float16": 1, "bfloat16": 2}

    def __init__(self, torch, path):
        self.torch = torch
        lib = self.lib = ctypes.CDLL(path)
        i, u, p = ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p
        lib.am_fi_last_error.restype, lib.am_fi_last_error.argtypes = ctypes.c_char_p, []
        for name, args in {"am_fi_set_device": [i],
                           "am_fi_merge_state": [i, p, p, p, p, p, p, u, u, u, p],
                           "am_fi_merge_state_in_place": [i, p, p, p, p, p, u, u, u, p],
                           "am_fi_merge_states": [i, p, p, p, p, u, u, u, u, p],
                           "am_fi_variable_length_merge_states": [i, p, p, p, p, p, u, u, u, i, p]}.items():
            getattr(lib, name).argtypes, getattr(lib, name).restype = args, i
        self._ok(lib.am_fi_set_device(torch.cuda.current_device()) if torch.cuda.is_available() else 0, "set_device")

    def _ok(self, rc, what):
        if rc != 0:
            raise RuntimeError(f"FlashInfer's {what} returned {rc}: {self.lib.am_fi_last_error().decode()}")

    def _type(self, x):
        return self.TYPES[str(x.dtype).removeprefix("torch.")]

    def _stream(self):
        return self.torch.cuda.current_stream().cuda_stream

    def merge_state(self, v_a, s_a, v_b, s_b, v_merged, s_merged):
        n, h, d = v_a.shape
        self._ok(self.lib.am_fi_merge_state(self._type(v_a), v_a.data_ptr(), s_a.data_ptr(), v_b.data_ptr(),
                                            s_b.data_ptr(), v_merged.data_ptr(), s_merged.data_ptr(), n, h, d,
                                            self._stream()), "MergeState")

    def merge_state_in_place(self, v, s, v_other, s_other, mask=None):
        n, h, d = v.shape
        self._ok(self.lib.am_fi_merge_state_in_place(self._type(v), v.data_ptr(), s.data_ptr(), v_other.data_ptr(),
                                                     s_other.data_ptr(), None if mask is None else mask.data_ptr(),
                                                     n, h, d, self._stream()), "MergeStateInPlace")

    def merge_states(self, v, s, v_merged, s_merged):
        n, k, h, d = v.shape
        self._ok(self.lib.am_fi_merge_states(self._type(v), v.data_ptr(), s.data_ptr(), v_merged.data_ptr(),
                                             s_merged.data_ptr(), k, n, h, d, self._stream()), "MergeStates")

    def variable_length_merge_states(self, v, s, indptr, v_merged, s_merged, enable_pdl=False):
        rows, h, d = v_merged.shape
        self._ok(self.lib.am_fi_variable_length_merge_states(
            self._type(v), v.data_ptr(), s.data_ptr(), indptr.data_ptr(), v_merged.data_ptr(), s_merged.data_ptr(),
            rows, h, d, int(enable_pdl), self._stream()), "VariableLengthMergeStates")


def flashinfer(torch):
    return FlashInfer(torch, flashinfer_library(arch(torch)))


def vllm_sources():
    root = require(fetch.VLLM)
    kernel = os.path.join(root, "csrc", "attention", "merge_attn_states.cu")
    return root, [kernel, os.path.join(PEERS, "vllm_merge.cpp")]


def vllm(torch):
    """vLLM's merge_attn_states(output, output_lse, prefix_output, prefix_lse, suffix_output,
    suffix_lse), built here as a PyTorch extension for the current GPU unless already built."""
    from torch.utils.cpp_extension import load

    root, sources = vllm_sources()
    sm = arch(torch)
    flags = VLLM_FLAGS + [f"-gencode=arch=compute_{sm},code=sm_{sm}"]
    name = f"am_vllm_merge_{digest(sources + tree(root), *flags)}"
    directory = os.path.join(BUILD, name)
    os.makedirs(directory, exist_ok=True)
    start = time.time()
    module = load(name, sources, extra_include_paths=[os.path.join(root, "csrc", "attention")],
                  extra_cuda_cflags=flags, build_directory=directory, verbose=False)
    print(f"vLLM's merge_attn_states loaded from {os.path.relpath(directory)} ({time.time() - start:.0f} s)",
          flush=True)
    return module.merge_attn_states



def declaration(path):
    """The declaration or definition of `void merge_attn_states(...)` in a C++ file, its whitespace
    collapsed."""
    import re

    with open(path) as f:
        text = f.read()
    found = re.search(r"void\s+merge_attn_states\s*\(([^)]*)\)", text)
    return None if found is None else " ".join(found.group(1).split())


def vllm_binding_matches():
    """(whether the binding declares merge_attn_states as the fetched kernel defines it, both texts)."""
    _, (kernel, binding) = vllm_sources()
    got = declaration(kernel), declaration(binding)
    return got[0] is not None and got[0] == got[1], got
