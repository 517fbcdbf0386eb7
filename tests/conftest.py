"""pytest setup: the `gpu` marker, the `device` fixture, and fixtures shared by the suite.

Tests marked `gpu` need a CUDA GPU and are skipped cleanly without one (CI has none); they run on the
accelerator machine through scripts/gpu-test.sh.  Framework-specific GPU tests also skip when their
framework is missing or sees no GPU.

`device` (tests/devices.py) runs a test once per device, `cpu` (NumPy arrays) and `cuda` (PyTorch CUDA
tensors, marked `gpu` and `cuda_device`).  With ATTNMERGE_TEST_CUDA_AS=cpu the `cuda` device holds
torch CPU tensors and its tests run here, GPU or not, to show that they run.
"""

from __future__ import annotations

import os
import sys
import zlib

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))  # `import oracle` from every test module

import devices  # noqa: E402 - after the path it is found on

# JAX grabs 75% of GPU memory at its first use unless told not to; the GPU suite shares the device
# between torch, CuPy, JAX and Numba in one process.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def gpu_count() -> int:
    """Number of CUDA devices attnmerge can use (0 without a driver, a device, or the package)."""
    try:
        import attnmerge

        return int(attnmerge.build_info()["device_count"])
    except Exception:
        return 0


def pytest_collection_modifyitems(config, items):
    if not any(item.get_closest_marker("gpu") for item in items):
        return
    if gpu_count() > 0:
        return
    skip = pytest.mark.skip(reason="no CUDA GPU visible to attnmerge")
    for item in items:
        if not item.get_closest_marker("gpu"):
            continue
        if devices.CUDA_AS == "cpu" and item.get_closest_marker("cuda_device"):
            continue  # the `cuda` device on torch CPU tensors
        item.add_marker(skip)


@pytest.fixture(params=devices.PARAMS)
def device(request):
    """Where the test's arrays live: `cpu` (NumPy) or `cuda` (torch); see tests/devices.py."""
    return devices.get(request.param)


@pytest.fixture
def rng(request):
    """A NumPy Generator seeded from the test's id: fresh, reproducible inputs per test."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(scope="session")
def am():
    """The attnmerge package."""
    import attnmerge

    return attnmerge
