"""Where a test's arrays live: the two devices of the `device` fixture (tests/conftest.py).

A semantic test is written once against this interface and runs on every device:

    cpu   NumPy arrays: the CPU path.
    cuda  PyTorch CUDA tensors: the GPU path.  The param carries the `gpu` marker (skipped without a
          GPU, as every GPU test) and the `cuda_device` marker.

ATTNMERGE_TEST_CUDA_AS=cpu makes the `cuda` device hold PyTorch CPU tensors instead, so that the
cuda-parametrized tests are executed, and shown to run, on a machine without a GPU; what only a GPU
does (a clamped bad indptr, CUDA graphs, launch records) is skipped there by `device.gpu_only()`.

    dev.put(x)                 a copy of NumPy array x on the device (any dtype of the oracle, FP8 too)
    dev.get(x)                 a device array (or None) read back as NumPy, after synchronizing
    dev.nan(shape, dtype)      an output poisoned with NaN
    dev.strided(view, buf)     (the device twin of a NumPy view into buffer buf, the twin of buf)
    dev.readback(view, buf, dview, dbuf)
                               (the view's values, whether all of the buffer outside it is still NaN)
    dev.is_mine(x)             x is an array of this device's library, on this device
    dev.dtype(name)            the library's dtype object of a dtype name
    dev.raw_device             the raw layer's `device=` for this device's arrays

put_lse(dev, x): an LSE argument on the device: an array, or a (max, sum) tuple of them.
raw_o(x), raw_lse(x): the raw layer's descriptors (attnmerge.raw) of a NumPy array or a torch tensor.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from oracle import fp8_dtype, nan_array, np_dtype, outside_view_is_nan

#: "" (the `cuda` device is CUDA) or "cpu" (it holds torch CPU tensors: the tests check themselves)
CUDA_AS = os.environ.get("ATTNMERGE_TEST_CUDA_AS", "").strip().lower()
if CUDA_AS not in ("", "cpu"):
    raise ValueError(f"ATTNMERGE_TEST_CUDA_AS: expected unset or 'cpu', got {CUDA_AS!r}")

CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.cuda_device])
#: the params of the `device` fixture
PARAMS = ["cpu", CUDA]
#: for `@pytest.mark.parametrize("device", CUDA_ONLY, indirect=True)`: a test of the GPU path only
CUDA_ONLY = [CUDA]


def element_strides(x) -> tuple:
    """Strides in elements of a NumPy array or torch tensor (NumPy gives a zero-size array zero
    strides: C-contiguous ones there)."""
    if isinstance(x, np.ndarray):
        if x.size == 0:
            return tuple(int(np.prod(x.shape[i + 1 :])) for i in range(x.ndim))
        return tuple(s // x.itemsize for s in x.strides)
    return tuple(x.stride())


def pointer(x) -> int:
    return x.ctypes.data if isinstance(x, np.ndarray) else x.data_ptr()


def put_lse(device, x):
    """An LSE argument on `device`: a NumPy array, or softmax statistics as a (max, sum) tuple of them."""
    return tuple(device.put(y) for y in x) if isinstance(x, tuple) else device.put(x)


def raw_o(x):
    """(ptr, dtype name, stride_token, stride_head) of a [T, H, D] view: attnmerge.raw's O descriptor."""
    st = element_strides(x)
    assert st[2] == 1
    name = x.dtype.name if isinstance(x, np.ndarray) else str(x.dtype).removeprefix("torch.")
    return (pointer(x), name, st[0], st[1])


def raw_lse(x):
    """(ptr, stride_token, stride_head) of a logical [T, H] float32 view: attnmerge.raw's LSE descriptor."""
    st = element_strides(x)
    return (pointer(x), st[0], st[1])


def _dtype(name):
    if isinstance(name, str) and name in ("float8_e4m3fn", "float8_e4m3"):
        return fp8_dtype()
    return np_dtype(name) if isinstance(name, str) else np.dtype(name)


def _twin(view: np.ndarray, buf: np.ndarray, host_buf: np.ndarray) -> np.ndarray:
    """The view of host_buf (a copy of buf's values) with view's geometry inside buf."""
    offset = (view.__array_interface__["data"][0] - buf.__array_interface__["data"][0]) // view.itemsize
    return np.lib.stride_tricks.as_strided(
        host_buf.reshape(-1)[offset:], shape=view.shape,
        strides=tuple(s // view.itemsize * host_buf.itemsize for s in view.strides))


class Cpu:
    """NumPy arrays: the CPU path."""

    name = "cpu"
    on_gpu = False
    emulated = False
    torch = None
    raw_device = "cpu"

    def put(self, x):
        return np.array(x, copy=True)

    def get(self, x):
        return None if x is None else np.asarray(x)

    def nan(self, shape, dtype="float32"):
        return nan_array(shape, _dtype(dtype))

    def strided(self, view, buf):
        return view, buf

    def readback(self, view, buf, dview, dbuf):
        return np.asarray(dview), outside_view_is_nan(dview, dbuf)

    def is_mine(self, x) -> bool:
        return isinstance(x, np.ndarray)

    def dtype(self, name):
        return _dtype(name)

    def synchronize(self):
        pass

    def gpu_only(self):
        pytest.skip("GPU-only behaviour")

    def __repr__(self):
        return "cpu"


class Cuda:
    """PyTorch CUDA tensors: the GPU path (torch CPU tensors under ATTNMERGE_TEST_CUDA_AS=cpu)."""

    name = "cuda"

    def __init__(self, torch):
        self.torch = torch
        self.emulated = CUDA_AS == "cpu"
        self.on_gpu = not self.emulated
        self.where = "cpu" if self.emulated else "cuda"
        self.raw_device = "cpu" if self.emulated else torch.cuda.current_device()

    def put(self, x):
        torch = self.torch
        x = np.asarray(x)
        # Bit for bit, NaN payloads too (a poisoned output is compared byte by byte after a refused call).
        if x.dtype.name == "bfloat16":
            return torch.from_numpy(np.array(x.view(np.int16), order="C")).to(self.where).view(torch.bfloat16)
        if x.dtype.name == "float8_e4m3fn":
            return torch.from_numpy(np.array(x.view(np.uint8), order="C")).to(self.where).view(torch.float8_e4m3fn)
        return torch.from_numpy(np.array(x, copy=True, order="C")).to(self.where)  # never shares x's memory

    def get(self, t):
        torch = self.torch
        if t is None or not isinstance(t, torch.Tensor):
            return None if t is None else np.asarray(t)
        self.synchronize()
        if t.dtype == torch.bfloat16:
            return t.cpu().contiguous().view(torch.int16).numpy().view(np_dtype("bfloat16"))
        if t.dtype == getattr(torch, "float8_e4m3fn", None):
            return t.cpu().contiguous().view(torch.uint8).numpy().view(fp8_dtype())
        return t.cpu().numpy()

    def nan(self, shape, dtype="float32"):
        return self.put(nan_array(shape, _dtype(dtype)))

    def strided(self, view, buf):
        offset = (view.__array_interface__["data"][0] - buf.__array_interface__["data"][0]) // view.itemsize
        dbuf = self.put(buf)
        return self.torch.as_strided(dbuf, view.shape, tuple(s // view.itemsize for s in view.strides), offset), dbuf

    def readback(self, view, buf, dview, dbuf):
        host = self.get(dbuf)
        twin = _twin(view, buf, host)
        return np.array(twin), outside_view_is_nan(twin, host)

    def is_mine(self, x) -> bool:
        return isinstance(x, self.torch.Tensor) and x.device.type == self.where

    def dtype(self, name):
        if name in ("float8_e4m3fn", "float8_e4m3"):
            return self.torch.float8_e4m3fn
        return getattr(self.torch, name)

    def synchronize(self):
        if self.on_gpu:
            self.torch.cuda.synchronize()

    def gpu_only(self):
        if not self.on_gpu:
            pytest.skip("GPU-only behaviour (ATTNMERGE_TEST_CUDA_AS=cpu)")

    def __repr__(self):
        return "cuda (torch CPU tensors)" if self.emulated else "cuda"


def get(name: str):
    """The device of a `device` param ("cpu" or "cuda"), or a skip where it is not usable."""
    if name == "cpu":
        return Cpu()
    if name != "cuda":
        raise ValueError(f"device {name!r}")
    torch = pytest.importorskip("torch")
    if CUDA_AS != "cpu" and not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA GPU")
    return Cuda(torch)
