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

Two builds are published, as the CUDA ecosystem does it (CuPy's cupy-cuda12x / cupy-cuda13x,
JAX's cuda12 / cuda13 plugins, PyTorch's cu12x / cu130 indexes): ``ATTNMERGE_CUDA_FLAVOR=cu12`` or
``cu13`` builds against that CUDA major only and names the distribution ``attnmerge-cu12`` or
``attnmerge-cu13`` (both install the package ``attnmerge``).  Unset, the build takes any CUDA 12.0
to 13.x and is named ``attnmerge``.  A cu12 build uses an nvcc of CUDA 12 where the machine has
one; otherwise CUDA 12.9 from PyPI, which has no nvcc: clang compiles the CUDA sources against
PyPI's headers, and PyPI's ptxas, nvFatbin and libcudart_static do the rest
(cmake/attnmerge_clang_cuda.cmake); clang 19 or newer comes from ``ATTNMERGE_CUDA_CLANG`` or PATH.
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from scikit_build_core import build as _skbuild
from scikit_build_core.build import (  # noqa: F401  (re-exported PEP 517 hooks)
    build_sdist,
    get_requires_for_build_sdist,
)

# The CUDA 13 toolkit, from PyPI.  The extras pull nvidia-cuda-nvcc (nvcc, ptxas, fatbinary,
# nvlink), nvidia-nvvm (cicc, libdevice), nvidia-cuda-crt (crt/ headers), nvidia-cuda-runtime
# (cuda_runtime.h, cuda_fp16.h, cuda_bf16.h, libcudart_static.a, libcudart.so.13) and
# nvidia-cuda-cccl (the CCCL headers nvcc's profile puts on the system include path).
CUDA_TOOLKIT_REQUIREMENTS = ["cuda-toolkit[nvcc,nvvm,crt,cudart,cccl]>=13.3,<14"]

_ENV_FORCE = "ATTNMERGE_CUDA_FROM_PYPI"

# CUDA 12.9 from PyPI, for clang: nvidia-cuda-nvcc-cu12 (ptxas and libdevice; no nvcc), the runtime
# (headers, libcudart_static.a), CCCL (headers cuda_fp16.h needs) and nvFatbin (the fatbinary
# writer).  Installed under site-packages/nvidia/{cuda_nvcc,cuda_runtime,cuda_cccl,nvfatbin}.
CUDA12_CLANG_REQUIREMENTS = [
    "nvidia-cuda-nvcc-cu12==12.9.*",
    "nvidia-cuda-runtime-cu12==12.9.*",
    "nvidia-cuda-cccl-cu12==12.9.*",
    "nvidia-nvfatbin-cu12==12.9.*",
]
CUDA12_ROOTS = ["cuda_nvcc", "cuda_runtime", "cuda_cccl", "nvfatbin"]

# The published builds: one distribution per CUDA major, and the drivers each runs on.
_ENV_FLAVOR = "ATTNMERGE_CUDA_FLAVOR"
FLAVORS = {
    "cu12": {"major": 12, "distribution": "attnmerge-cu12", "driver": "R525"},
    "cu13": {"major": 13, "distribution": "attnmerge-cu13", "driver": "R580"},
}
_ENV_CLANG = "ATTNMERGE_CUDA_CLANG"
_CLANG_MIN = 19  # as cmake/attnmerge_clang_cuda.cmake checks

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


def _major_version(program: str, pattern: str) -> int | None:
    """The major version `program --version` prints after `pattern` (None if it does not run or say)."""
    try:
        out = subprocess.run([program, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(pattern + r" (\d+)\.", out)
    return int(m.group(1)) if m else None


def _nvcc_major(nvcc: str) -> int | None:
    return _major_version(nvcc, "release")


def _flavor() -> str | None:
    """cu12, cu13 or None (unset: any CUDA 12.0 to 13.x, the distribution named attnmerge)."""
    value = os.environ.get(_ENV_FLAVOR, "").strip().lower()
    if value == "":
        return None
    if value not in FLAVORS:
        raise ValueError(f"attnmerge: {_ENV_FLAVOR}: expected one of {sorted(FLAVORS)} or nothing, got {value!r}")
    return value


def _use_pypi_toolkit() -> bool:
    """Whether the toolkit comes from PyPI: forced either way by ATTNMERGE_CUDA_FROM_PYPI, else when
    the machine has no nvcc (of the flavor's CUDA major, when a flavor is asked for)."""
    force = os.environ.get(_ENV_FORCE, "").strip().lower()
    if force in _TRUE:
        return True
    if force in _FALSE:
        return False
    nvcc = _system_nvcc()
    if nvcc is None:
        return True
    flavor = _flavor()
    return flavor is not None and _nvcc_major(nvcc) != FLAVORS[flavor]["major"]


def _clang_major(clang: str) -> int | None:
    return _major_version(clang, "clang version")


def _find_clang() -> str:
    """The clang++ that compiles the CUDA sources of a cu12 build from PyPI: $ATTNMERGE_CUDA_CLANG,
    else the newest clang++-NN on PATH, else clang++ (clang 19 or newer)."""
    given = os.environ.get(_ENV_CLANG, "").strip()
    if given:
        found = given if os.sep in given else shutil.which(given)
        if not _is_exe(found):
            raise RuntimeError(f"attnmerge: {_ENV_CLANG}={given}: no such program")
        return found
    for name in [*(f"clang++-{v}" for v in range(30, _CLANG_MIN - 1, -1)), "clang++"]:
        found = shutil.which(name)
        if found and (_clang_major(found) or 0) >= _CLANG_MIN:
            return found
    raise RuntimeError(
        f"attnmerge: {_ENV_FLAVOR}=cu12 takes CUDA 12.9 from PyPI, which has no nvcc, and compiles the CUDA "
        f"sources with clang {_CLANG_MIN} or newer, but none is on PATH: install one (Debian: apt-get install "
        f"clang-19; manylinux_2_28: dnf install clang) or name it in {_ENV_CLANG}=/path/to/clang++; or put a "
        "CUDA 12 nvcc on PATH")


def _pypi_toolkit_root() -> Path | None:
    """site-packages/nvidia/cu13 of the toolkit wheels, searched on sys.path."""
    for entry in sys.path:
        root = Path(entry or ".") / "nvidia" / "cu13"
        if _is_exe(root / "bin" / "nvcc"):
            return root.resolve()
    return None


def _pypi_cuda12_roots() -> list[Path] | None:
    """site-packages/nvidia/{cuda_nvcc,...} of the CUDA 12 wheels, searched on sys.path."""
    for entry in sys.path:
        base = Path(entry or ".") / "nvidia"
        roots = [base / name for name in CUDA12_ROOTS]
        if _is_exe(roots[0] / "bin" / "ptxas") and all(r.is_dir() for r in roots):
            return [r.resolve() for r in roots]
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


def _pypi_requirements() -> list[str]:
    """The toolkit wheels the build takes from PyPI: CUDA 12.9's for clang (cu12), else CUDA 13's."""
    return CUDA12_CLANG_REQUIREMENTS if _flavor() == "cu12" else CUDA_TOOLKIT_REQUIREMENTS


def _add_requires(requires: list[str], config_settings) -> list[str]:
    flavor = _flavor()
    if flavor is not None:
        build = FLAVORS[flavor]
        _log(f"{_ENV_FLAVOR}={flavor}: a CUDA {build['major']} build, named {build['distribution']}")
    if _use_pypi_toolkit():
        nvcc = _system_nvcc()
        why = (f"{_ENV_FORCE} is set" if os.environ.get(_ENV_FORCE, "").strip().lower() in _TRUE
               else f"the nvcc on this machine ({nvcc}) is not of CUDA {FLAVORS[flavor]['major']}" if nvcc
               else "no nvcc on this machine")
        if flavor == "cu12":
            _log(f"compiled by {_find_clang()}")  # refused here, before any download, if there is none
        _log(f"{why}: the CUDA toolkit comes from PyPI ({', '.join(_pypi_requirements())})")
        requires = [*requires, *_pypi_requirements()]
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
    """config_settings with the JAX extension's switch, the flavor, and CMake pointed at the PyPI
    toolkit when that is the one to use."""
    settings = dict(config_settings or {})
    settings[_JAX_DEFINE] = "ON" if _build_jax(config_settings) else "OFF"
    flavor = _flavor()
    if flavor is not None:
        settings.setdefault("cmake.define.ATTNMERGE_CUDA_FLAVOR", flavor)
    if not _use_pypi_toolkit():
        return settings
    if flavor == "cu12":
        roots = _pypi_cuda12_roots()
        if roots is None:
            raise RuntimeError(
                "attnmerge: the CUDA 12 toolkit wheels are not installed in the build environment "
                f"(site-packages/nvidia/{{{','.join(CUDA12_ROOTS)}}}).  Build with pip's build isolation "
                f"(the default), or install {' '.join(repr(r) for r in CUDA12_CLANG_REQUIREMENTS)} first.")
        settings.setdefault("cmake.define.ATTNMERGE_CUDA_CLANG", _find_clang())
        settings.setdefault("cmake.define.ATTNMERGE_CUDA_ROOT", ";".join(str(r) for r in roots))
        _log(f"CUDA 12 toolkit from PyPI: {', '.join(str(r) for r in roots)}")
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


def _distribution() -> str | None:
    """The flavor's distribution name (attnmerge-cu12, attnmerge-cu13), or None to keep pyproject's."""
    flavor = _flavor()
    return FLAVORS[flavor]["distribution"] if flavor is not None else None


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _rename_metadata(text: str, name: str) -> str:
    return re.sub(r"^Name: .*$", f"Name: {name}", text, count=1, flags=re.M)


def rename_wheel(wheel: Path, name: str) -> Path:
    """The wheel `wheel` as distribution `name` (its file name, .dist-info folder, METADATA's Name and
    RECORD), written beside it in place of the original.  The package it installs is unchanged:
    pyproject.toml's name cannot vary, and one source tree builds every flavor."""
    old_stem = wheel.name.split("-", 1)[0]
    new_stem = re.sub(r"[-_.]+", "_", name)
    if old_stem == new_stem:
        return wheel
    version = wheel.name.split("-")[1]
    old_info, new_info = f"{old_stem}-{version}.dist-info/", f"{new_stem}-{version}.dist-info/"
    target = wheel.with_name(new_stem + wheel.name[len(old_stem):])
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as dst:
        records = []
        for info in src.infolist():
            data = src.read(info)
            path = new_info + info.filename[len(old_info):] if info.filename.startswith(old_info) else info.filename
            if path == new_info + "RECORD":
                continue  # written last, from what was written
            if path == new_info + "METADATA":
                data = _rename_metadata(data.decode(), name).encode()
            out = zipfile.ZipInfo(path, info.date_time)
            out.external_attr, out.compress_type = info.external_attr, zipfile.ZIP_DEFLATED
            dst.writestr(out, data)
            records.append(f"{path},{_record_hash(data)},{len(data)}")
        records.append(f"{new_info}RECORD,,")
        dst.writestr(new_info + "RECORD", "\n".join(records) + "\n")
    wheel.unlink()
    return target


def _renamed(wheel_directory, filename: str) -> str:
    name = _distribution()
    if name is None:
        return filename
    renamed = rename_wheel(Path(wheel_directory) / filename, name)
    _log(f"distribution {name}: {renamed.name}")
    return renamed.name


def _renamed_metadata(metadata_directory, info_dir: str) -> str:
    name = _distribution()
    if name is None:
        return info_dir
    old = Path(metadata_directory) / info_dir
    new = old.with_name(re.sub(r"[-_.]+", "_", name) + info_dir[info_dir.index("-"):])
    metadata = old / "METADATA"
    metadata.write_text(_rename_metadata(metadata.read_text(), name))
    old.rename(new)
    return new.name


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    return _renamed_metadata(metadata_directory,
                             _skbuild.prepare_metadata_for_build_wheel(metadata_directory, config_settings))


def prepare_metadata_for_build_editable(metadata_directory, config_settings=None):
    return _renamed_metadata(metadata_directory,
                             _skbuild.prepare_metadata_for_build_editable(metadata_directory, config_settings))


# A renamed flavor's metadata_directory is not handed on: scikit-build-core holds it to its own
# METADATA, which names pyproject's distribution; the wheel is renamed to match it afterwards.
def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    metadata_directory = metadata_directory if _distribution() is None else None
    return _renamed(wheel_directory,
                    _skbuild.build_wheel(wheel_directory, _toolkit_settings(config_settings), metadata_directory))


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    metadata_directory = metadata_directory if _distribution() is None else None
    return _renamed(wheel_directory,
                    _skbuild.build_editable(wheel_directory, _toolkit_settings(config_settings), metadata_directory))
