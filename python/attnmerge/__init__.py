"""attnmerge: merge partial attention states (O, LSE) on CUDA GPUs and CPUs.

A partial state is an output O, shape [tokens, heads, head_size], and its log-sum-exp LSE, float32
[tokens, heads], over one part of the keys.  Merging gives the attention over all of them:
per (token, head) row, m = max lse_i, w_i = exp(lse_i - m), W = sum w_i,
O = sum (w_i / W) O_i, LSE = m + log W.  +inf LSE marks an empty part; all parts empty give
O = 0 and LSE = -inf; a part of weight zero is never read; a NaN LSE makes its row NaN.

Ops: merge (two states), merge_inplace (into the first, optionally masked), merge_states (S
stacked states in one pass), merge_varlen (a per-row number of states given by indptr) and
merge_share (one state's share of a merge, for context parallelism's reduce-scatter); the
gradients of merge, merge_states and merge_varlen: merge_backward, merge_states_backward and
merge_varlen_backward.  Arrays come from PyTorch, CuPy, JAX, Numba or NumPy (or as raw pointers:
`attnmerge.raw`); the vLLM, FlashInfer and SGLang conventions live in `attnmerge.compat`.  With torch
imported (before or after attnmerge), the ops are also registered as torch.ops.attnmerge.*, which
these functions become under torch.compile and torch.export (attnmerge._torch_ops).
"""
from __future__ import annotations

import os as _os
from typing import Any as _Any

from . import _C
from . import _torch_hook
from ._merge import (merge, merge_backward, merge_inplace, merge_share, merge_states, merge_states_backward,
                     merge_varlen, merge_varlen_backward)

_torch_hook.install()  # torch.ops.attnmerge.*, when torch is (or gets) imported

__version__ = _C.version_string()
__all__ = ["merge", "merge_inplace", "merge_states", "merge_varlen", "merge_share", "merge_backward",
           "merge_states_backward", "merge_varlen_backward", "build_info", "last_launch", "cmake_dir", "include_dir",
           "library_path", "__version__"]

# Where the compiled part lives: beside _C (in an editable install, not beside this file).
_HERE = _os.path.dirname(_os.path.abspath(_C.__file__))
# The XLA FFI handlers of attnmerge.jax, built on request (ATTNMERGE_BUILD_JAX=1; the release
# wheels carry them).
_XLA_LIB = _os.path.join(_HERE, "lib", "libattnmerge_xla.so")
_XLA_HOW = ("install a release wheel, which carries it, or build from source with "
            "ATTNMERGE_BUILD_JAX=1 pip install . (Python 3.11 or newer)")


def _archs(text: str) -> list[str]:
    return [a for a in text.split(";") if a]


def build_info() -> dict[str, _Any]:
    """The library's version, the CUDA toolkit it was built with, its GPU code, the driver's CUDA
    version (0 without a driver), the number of usable GPUs, the library's path and whether the JAX
    extension (attnmerge.jax) was built.

    The GPU code: `cuda_architectures`, the SMs with SASS (["90"]; [] for a build of PTX alone);
    `cuda_ptx_architectures`, the virtual architectures whose PTX the driver JIT-compiles at first
    use for a GPU without SASS of its own (the newest not above the GPU's SM; [] for none, and then
    such a GPU runs nothing); `cuda_architectures_choice`, how the build chose them: "detected" (the
    build machine's GPUs), "no-gpu" (none there: PTX alone), "release" or "requested".

    Examples
    --------
    >>> import attnmerge
    >>> info = attnmerge.build_info()
    >>> info["cuda_architectures_choice"] in {"detected", "no-gpu", "release", "requested"}
    True
    >>> bool(info["cuda_architectures"] or info["cuda_ptx_architectures"])  # some GPU code
    True
    """
    return {
        "version": __version__,
        "cuda_build_version": _C.cuda_build_version(),
        "cuda_architectures": _archs(_C.cuda_architectures()),
        "cuda_ptx_architectures": _archs(_C.cuda_ptx_architectures()),
        "cuda_architectures_choice": _C.cuda_architectures_choice(),
        "driver_version": _C.cuda_driver_version(),
        "device_count": _C.device_count(),
        "library": _C.library_path(),
        "jax_extension": _os.path.exists(_XLA_LIB),
    }


def last_launch() -> dict[str, _Any]:
    """What this thread's last attnmerge op enqueued on the GPU, as the launch plan chose it:
    `kernel` ("rows", "rows_plain", "rows_inplace", "states", "backward", or "none" for host, empty
    or refused calls), `launches` (0, 1 or 2), `state_groups` (groups of threads sharing a row's states under
    "states"), `index_bits` (32 or 64), `vec` (elements per vector access), `pdl`, `grid` and
    `block`.  For tests, benchmarks and tools that check which kernel a shape gets."""
    return _C.last_launch()


def cmake_dir() -> str:
    """The folder holding attnmergeConfig.cmake: pass it as attnmerge_DIR to find_package(attnmerge)."""
    return _os.path.join(_HERE, "lib", "cmake", "attnmerge")


def include_dir() -> str:
    """The folder that holds attnmerge/attnmerge.h and the header-only kernels."""
    return _os.path.join(_HERE, "include")


def library_path() -> str:
    """The path of the libattnmerge shared library this package loaded."""
    return _C.library_path()
