"""What was built and where it lives: the library's version, toolkit and architectures, the device
count, the C package's folders, and the XLA FFI handlers of attnmerge.jax (built on request)."""
from __future__ import annotations

import os
from typing import Any

from . import _C

# Where the compiled part lives: beside _C (in an editable install, not beside the sources).
HERE = os.path.dirname(os.path.abspath(_C.__file__))
XLA_LIB = os.path.join(HERE, "lib", "libattnmerge_xla.so")
XLA_HOW = ("build attnmerge from source with ATTNMERGE_BUILD_JAX=1 (pip install . with jaxlib installed, Python "
           "3.11 or newer); no wheel with it is published yet")


def _archs(text: str) -> list[str]:
    return [a for a in text.split(";") if a]


def build_info() -> dict[str, Any]:
    """What this attnmerge was built with and what it sees.

    Returns
    -------
    dict
        ``version``; ``cuda_build_version`` (the CUDA toolkit, e.g. 13000); ``cuda_architectures``
        (the SMs with SASS, ["90"]; [] for a build of PTX alone); ``cuda_ptx_architectures`` (the
        virtual architectures whose PTX the driver JIT-compiles at first use for a GPU without SASS
        of its own: the newest not above the GPU's SM; [] for none, and then such a GPU runs
        nothing); ``cuda_architectures_choice`` (how the build chose them: "detected", the build
        machine's GPUs; "no-gpu", none there: PTX alone; "release"; "requested");
        ``driver_version`` (the driver's CUDA version, 0 without a driver); ``device_count``
        (usable GPUs); ``library`` (the path of libattnmerge); ``jax_extension`` (whether
        attnmerge.jax's handlers were built).

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
        "version": _C.version_string(),
        "cuda_build_version": _C.cuda_build_version(),
        "cuda_architectures": _archs(_C.cuda_architectures()),
        "cuda_ptx_architectures": _archs(_C.cuda_ptx_architectures()),
        "cuda_architectures_choice": _C.cuda_architectures_choice(),
        "driver_version": _C.cuda_driver_version(),
        "device_count": _C.device_count(),
        "library": _C.library_path(),
        "jax_extension": os.path.exists(XLA_LIB),
    }


def last_launch() -> dict[str, Any]:
    """What this thread's last attnmerge op enqueued on the GPU, as the launch plan chose it.

    For tests, benchmarks and tools that check which kernel a shape gets.

    Returns
    -------
    dict
        ``kernel`` ("rows", "rows_plain", "rows_inplace", "states", "backward", or "none" for host,
        empty or refused calls), ``launches`` (0, 1 or 2), ``state_groups`` (groups of threads
        sharing a row's states under "states"), ``index_bits`` (32 or 64), ``vec`` (elements per
        vector access), ``pdl``, ``grid`` and ``block``.

    Examples
    --------
    >>> import numpy as np, attnmerge
    >>> o, lse = np.ones((2, 4, 8), np.float32), np.zeros((2, 4), np.float32)
    >>> _ = attnmerge.merge(o, lse, o, lse)
    >>> attnmerge.last_launch()["kernel"]  # a CPU call launches nothing
    'none'
    """
    return _C.last_launch()


def cmake_dir() -> str:
    """The folder holding attnmergeConfig.cmake: pass it as attnmerge_DIR to find_package(attnmerge).

    Examples
    --------
    >>> import os, attnmerge
    >>> os.path.exists(os.path.join(attnmerge.cmake_dir(), "attnmergeConfig.cmake"))
    True
    """
    return os.path.join(HERE, "lib", "cmake", "attnmerge")


def include_dir() -> str:
    """The folder that holds attnmerge/attnmerge.h and the header-only kernels.

    Examples
    --------
    >>> import os, attnmerge
    >>> os.path.exists(os.path.join(attnmerge.include_dir(), "attnmerge", "attnmerge.h"))
    True
    """
    return os.path.join(HERE, "include")


def library_path() -> str:
    """The path of the libattnmerge shared library this package loaded.

    Examples
    --------
    >>> import attnmerge
    >>> "libattnmerge" in attnmerge.library_path()
    True
    """
    return _C.library_path()
