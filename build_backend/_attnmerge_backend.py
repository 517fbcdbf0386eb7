"""In-tree PEP 517 backend: scikit-build-core, plus a CUDA toolkit from PyPI when none is installed.

Every hook is scikit-build-core's.  Two are extended:

* ``get_requires_for_build_wheel`` / ``_editable`` add the CUDA 13 toolkit wheels (nvcc, cicc,
  ptxas, the crt and runtime headers, CCCL, libcudart_static) to the build requirements when the
  machine has no nvcc (none in ``$CUDACXX``, on ``PATH``, or in ``$CUDA_HOME``/``$CUDA_PATH``), or
  when ``ATTNMERGE_CUDA_FROM_PYPI=1`` forces it (``=0`` forbids it);
* ``build_wheel`` / ``build_editable`` then point CMake at that toolkit explicitly
  (``CMAKE_CUDA_COMPILER``, ``CUDAToolkit_ROOT``, ``CUDA_CUDART``), so that nothing is picked up
  implicitly from ``/usr/local/cuda``.

The JAX extension (the XLA FFI handlers of ``attnmerge.jax``) is built only on request:
``ATTNMERGE_BUILD_JAX=1`` (or ``-C cmake.define.ATTNMERGE_BUILD_JAX=ON``) adds jaxlib, whose
headers it needs, to the build requirements and turns the CMake option on.  A plain source build
downloads no JAX package; the release wheels (cibuildwheel, pyproject.toml) ask for it.

The wheels install under ``site-packages/nvidia/cu13/`` (``bin/nvcc``, ``nvvm/bin/cicc``,
``include/``, ``include/cccl/``, ``lib/libcudart_static.a``, ``lib/libcudart.so.13``).  nvcc wheels
older than 13.3 carry an ``nvcc.profile`` that points at ``lib64`` and breaks CMake's detection,
hence the lower bound.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from scikit_build_core import build as _skbuild
from scikit_build_core.build import (  # noqa: F401  (re-exported PEP 517 hooks)
    build_sdist,
    get_requires_for_build_sdist,
    prepare_metadata_for_build_editable,
    prepare_metadata_for_build_wheel,
)

# The CUDA 13 toolkit, from PyPI.  The extras pull nvidia-cuda-nvcc (nvcc, ptxas, fatbinary,
# nvlink), nvidia-nvvm (cicc, libdevice), nvidia-cuda-crt (crt/ headers), nvidia-cuda-runtime
# (cuda_runtime.h, cuda_fp16.h, cuda_bf16.h, libcudart_static.a, libcudart.so.13) and
# nvidia-cuda-cccl (the CCCL headers nvcc's profile puts on the system include path).
CUDA_TOOLKIT_REQUIREMENTS = ["cuda-toolkit[nvcc,nvvm,crt,cudart,cccl]>=13.3,<14"]

_ENV_FORCE = "ATTNMERGE_CUDA_FROM_PYPI"

# XLA's FFI headers for the JAX extension come with jaxlib.
JAX_REQUIREMENTS = ["jaxlib>=0.5; python_version >= '3.11'"]
_ENV_JAX = "ATTNMERGE_BUILD_JAX"
_JAX_DEFINE = "cmake.define.ATTNMERGE_BUILD_JAX"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _log(msg: str) -> None:
    print(f"attnmerge build: {msg}", file=sys.stderr, flush=True)


def _is_exe(path: str | os.PathLike[str] | None) -> bool:
    return bool(path) and os.path.isfile(path) and os.access(path, os.X_OK)


def _system_nvcc() -> str | None:
    """The nvcc this machine would use: $CUDACXX, nvcc on PATH, $CUDA_HOME or $CUDA_PATH."""
    cudacxx = os.environ.get("CUDACXX", "").strip()
    if cudacxx:
        found = cudacxx if os.sep in cudacxx else shutil.which(cudacxx)
        if _is_exe(found):
            return found
    found = shutil.which("nvcc")
    if _is_exe(found):
        return found
    for var in ("CUDA_HOME", "CUDA_PATH"):
        root = os.environ.get(var, "").strip()
        if root and _is_exe(os.path.join(root, "bin", "nvcc")):
            return os.path.join(root, "bin", "nvcc")
    return None


def _use_pypi_toolkit() -> bool:
    force = os.environ.get(_ENV_FORCE, "").strip().lower()
    if force in _TRUE:
        return True
    if force in _FALSE:
        return False
    return _system_nvcc() is None


def _pypi_toolkit_root() -> Path | None:
    """site-packages/nvidia/cu13 of the toolkit wheels, searched on sys.path."""
    for entry in sys.path:
        root = Path(entry or ".") / "nvidia" / "cu13"
        if _is_exe(root / "bin" / "nvcc"):
            return root.resolve()
    return None


def _flag(value: str, name: str) -> bool:
    value = value.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE or value == "":  # unset: off
        return False
    raise ValueError(f"attnmerge: {name}: expected one of {sorted(_TRUE | _FALSE)}, got {value!r}")


def _build_jax(config_settings) -> bool:
    """Whether the JAX extension is asked for: the CMake define if given, else the environment."""
    setting = (config_settings or {}).get(_JAX_DEFINE)
    if setting is not None:
        return _flag(str(setting), _JAX_DEFINE)
    return _flag(os.environ.get(_ENV_JAX, ""), _ENV_JAX)


def _add_requires(requires: list[str], config_settings) -> list[str]:
    if _use_pypi_toolkit():
        why = f"{_ENV_FORCE} is set" if _system_nvcc() else "no nvcc on this machine"
        _log(f"{why}: the CUDA toolkit comes from PyPI ({', '.join(CUDA_TOOLKIT_REQUIREMENTS)})")
        requires = [*requires, *CUDA_TOOLKIT_REQUIREMENTS]
    if _build_jax(config_settings):
        _log(f"the JAX extension is asked for: {', '.join(JAX_REQUIREMENTS)}")
        requires = [*requires, *JAX_REQUIREMENTS]
    else:
        _log(f"the JAX extension (attnmerge.jax) is not built; {_ENV_JAX}=1 builds it")
    return requires


def get_requires_for_build_wheel(config_settings=None):
    return _add_requires(list(_skbuild.get_requires_for_build_wheel(config_settings)), config_settings)


def get_requires_for_build_editable(config_settings=None):
    return _add_requires(list(_skbuild.get_requires_for_build_editable(config_settings)), config_settings)


def _toolkit_settings(config_settings):
    """config_settings with the JAX extension's switch, and CMake pointed at the PyPI toolkit when
    that is the one to use."""
    settings = dict(config_settings or {})
    settings[_JAX_DEFINE] = "ON" if _build_jax(config_settings) else "OFF"
    if not _use_pypi_toolkit():
        return settings
    root = _pypi_toolkit_root()
    if root is None:
        raise RuntimeError(
            "attnmerge: no nvcc was found ($CUDACXX, PATH, $CUDA_HOME, $CUDA_PATH) and the CUDA "
            "toolkit wheels are not installed in the build environment (site-packages/nvidia/cu13/"
            "bin/nvcc).  Build with pip's build isolation (the default), install "
            f"{CUDA_TOOLKIT_REQUIREMENTS[0]!r} first, or put a CUDA 13 nvcc on PATH."
        )
    nvcc = root / "bin" / "nvcc"
    cudart = sorted((root / "lib").glob("libcudart.so*"))
    defines = {
        "CMAKE_CUDA_COMPILER": str(nvcc),
        "CUDAToolkit_ROOT": str(root),
    }
    if cudart:
        # FindCUDAToolkit looks for an unversioned libcudart.so, which the wheel does not ship.
        defines["CUDA_CUDART"] = str(cudart[0])
    for key, value in defines.items():
        settings.setdefault(f"cmake.define.{key}", value)
    _log(f"CUDA toolkit from PyPI: {root}")
    return settings


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    return _skbuild.build_wheel(wheel_directory, _toolkit_settings(config_settings), metadata_directory)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    return _skbuild.build_editable(wheel_directory, _toolkit_settings(config_settings), metadata_directory)
