"""One adapter per GPU array library (PyTorch, CuPy, JAX, Numba): put NumPy data on the GPU, read it
back, build strided views; each skips (pytest.skip) where its library is missing or sees no GPU.
Used by the interop tests of GPU arrays, streams and devices."""

from __future__ import annotations

import numpy as np
import pytest

from oracle import np_dtype




def _elem_layout(view: np.ndarray, buf: np.ndarray):
    """(element offset, element strides) of a NumPy view into a C-contiguous buffer."""
    off = (view.__array_interface__["data"][0] - buf.__array_interface__["data"][0]) // view.itemsize
    return off, tuple(s // view.itemsize for s in view.strides)


class Torch:
    name = "torch"
    mutable = True

    def __init__(self):
        self.torch = torch = pytest.importorskip("torch")
        if not torch.cuda.is_available():
            pytest.skip("torch sees no CUDA GPU")

    def put(self, x: np.ndarray):
        t = self.torch
        if x.dtype.name == "bfloat16":
            return t.from_numpy(x.astype(np.float32)).to("cuda").to(t.bfloat16)
        return t.from_numpy(np.ascontiguousarray(x)).to("cuda")

    def get(self, x) -> np.ndarray:
        self.torch.cuda.synchronize()
        if x.dtype == self.torch.bfloat16:
            return x.float().cpu().numpy()
        return x.cpu().numpy()

    def strided(self, view, buf):
        off, strides = _elem_layout(view, buf)
        return self.torch.as_strided(self.put(buf), view.shape, strides, off)

    def is_mine(self, x):
        return isinstance(x, self.torch.Tensor) and x.is_cuda

    def dtype(self, name):
        return getattr(self.torch, name)


class CuPy:
    name = "cupy"
    mutable = True

    def __init__(self):
        self.cp = cp = pytest.importorskip("cupy")
        try:
            if cp.cuda.runtime.getDeviceCount() == 0:
                pytest.skip("cupy sees no CUDA GPU")
        except cp.cuda.runtime.CUDARuntimeError:
            pytest.skip("cupy sees no CUDA GPU")

    def put(self, x):
        try:
            return self.cp.asarray(x)
        except Exception as e:  # bfloat16 needs a CuPy that knows ml_dtypes
            pytest.skip(f"cupy cannot hold {x.dtype}: {e}")

    def get(self, x):
        self.cp.cuda.runtime.deviceSynchronize()
        return self.cp.asnumpy(x)

    def strided(self, view, buf):
        off, strides = _elem_layout(view, buf)
        flat = self.put(buf).ravel()
        return self.cp.lib.stride_tricks.as_strided(
            flat[off:], shape=view.shape, strides=tuple(s * view.itemsize for s in strides)
        )

    def is_mine(self, x):
        return isinstance(x, self.cp.ndarray)

    def dtype(self, name):
        return np_dtype(name)


class Jax:
    name = "jax"
    mutable = False  # JAX arrays are immutable: outputs are always allocated

    def __init__(self):
        self.jax = jax = pytest.importorskip("jax")
        try:
            self.dev = jax.devices("gpu")[0]
        except RuntimeError:
            pytest.skip("jax sees no GPU")

    def put(self, x):
        return self.jax.device_put(x, self.dev)

    def get(self, x):
        x.block_until_ready()
        return np.asarray(x)

    def strided(self, view, buf):
        pytest.skip("JAX arrays have no strided views")

    def is_mine(self, x):
        return isinstance(x, self.jax.Array) and list(x.devices())[0].platform == "gpu"

    def dtype(self, name):
        return np_dtype(name)


class Numba:
    name = "numba"
    mutable = True

    def __init__(self):
        pytest.importorskip("numba")
        from numba import cuda

        self.cuda = cuda
        if not cuda.is_available():
            pytest.skip("numba sees no CUDA GPU")

    def put(self, x):
        if x.dtype.name == "bfloat16":
            pytest.skip("numba device arrays have no bfloat16")
        return self.cuda.to_device(np.ascontiguousarray(x))

    def get(self, x):
        self.cuda.synchronize()
        return x.copy_to_host()

    def strided(self, view, buf):
        off, strides = _elem_layout(view, buf)
        d = self.put(buf)
        # numba device arrays slice like NumPy; rebuild the same view by slicing
        if view.ndim == 3 and strides[1] == buf.shape[2] and strides[0] == buf.shape[1] * buf.shape[2]:
            d3 = d.reshape(buf.shape) if d.ndim != 3 else d
            start = off % buf.shape[2]
            return d3[:, : view.shape[1], start : start + view.shape[2]]
        pytest.skip("this layout is not a plain slice for numba")

    def is_mine(self, x):
        return self.cuda.is_cuda_array(x)

    def dtype(self, name):
        return np_dtype(name)


FRAMEWORKS = {"torch": Torch, "cupy": CuPy, "jax": Jax, "numba": Numba}
