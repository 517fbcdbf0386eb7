"""attnmerge on the GPU: PyTorch, CuPy, JAX and Numba arrays, streams, CUDA graphs, devices.

Every test here carries the `gpu` marker (skipped without a CUDA GPU) and skips when its framework is
missing or sees no GPU.  Inputs are made with NumPy (seeded), moved to the device, and the results
compared with the float64 oracle.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

import attnmerge
from oracle import (
    DTYPES,
    assert_merge_matches,
    assert_o_close,
    lse_view,
    nan_array,
    np_dtype,
    o_view,
    random_lse,
    random_state,
    reference_merge,
    to_f64,
)

pytestmark = pytest.mark.gpu


# --------------------------------------------------------------------------------------------------
# one adapter per array library: put NumPy data on the GPU, read it back, build strided views


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


@pytest.fixture(params=list(FRAMEWORKS))
def fw(request):
    return FRAMEWORKS[request.param]()


@pytest.fixture
def torch():
    return Torch().torch


def host_inputs(rng, tokens=37, heads=5, head_size=72, dtype="float32", lse_scale=3.0):
    o_a, lse_a = random_state(rng, tokens, heads, head_size, dtype, lse_scale)
    o_b, lse_b = random_state(rng, tokens, heads, head_size, dtype, lse_scale)
    return o_a, lse_a, o_b, lse_b


# --------------------------------------------------------------------------------------------------
# every library, every dtype pair


@pytest.mark.parametrize("out_dtype", DTYPES)
@pytest.mark.parametrize("in_dtype", DTYPES)
def test_every_dtype_pair_allocated_in_the_callers_library(rng, fw, in_dtype, out_dtype):
    h = host_inputs(rng, dtype=in_dtype)
    d = [fw.put(x) for x in h]
    out, out_lse = attnmerge.merge(*d, out_dtype=out_dtype)
    assert fw.is_mine(out) and fw.is_mine(out_lse), (type(out), type(out_lse))
    assert tuple(out.shape) == h[0].shape and tuple(out_lse.shape) == h[1].shape
    assert_merge_matches(fw.get(out), fw.get(out_lse), reference_merge(*h), out_dtype)


@pytest.mark.parametrize("out_dtype", DTYPES)
@pytest.mark.parametrize("in_dtype", DTYPES)
def test_every_dtype_pair_into_a_given_output(rng, fw, in_dtype, out_dtype):
    if not fw.mutable:
        pytest.skip(f"{fw.name} arrays cannot be outputs")
    h = host_inputs(rng, dtype=in_dtype)
    d = [fw.put(x) for x in h]
    out = fw.put(nan_array(h[0].shape, out_dtype))
    out_lse = fw.put(nan_array(h[1].shape))
    res, res_lse = attnmerge.merge(*d, out=out, out_lse=out_lse)
    assert res is out and res_lse is out_lse
    assert_merge_matches(fw.get(out), fw.get(out_lse), reference_merge(*h), out_dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size", (1, 3, 72, 80, 100, 256, 512))
def test_any_head_size(rng, fw, head_size, dtype):
    h = host_inputs(rng, tokens=67, heads=7, head_size=head_size, dtype=dtype)
    out, out_lse = attnmerge.merge(*[fw.put(x) for x in h])
    assert_merge_matches(fw.get(out), fw.get(out_lse), reference_merge(*h), dtype)


LAYOUT_CASES = [
    (("padded", "padded", "padded"), ("contiguous", "contiguous", "contiguous")),
    (("offset", "contiguous", "offset"), ("transposed", "transposed", "transposed")),
    (("heads_first", "token_step", "contiguous"), ("padded", "token_step", "transposed")),
    (("head_step", "offset", "token_step"), ("transposed", "padded", "token_step")),
]


@pytest.mark.parametrize("head_size", (3, 72, 128))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("o_layouts,lse_layouts", LAYOUT_CASES, ids=lambda c: "-".join(c))
@pytest.mark.parametrize("lib", ["torch", "cupy"])
def test_strided_views(rng, lib, o_layouts, lse_layouts, dtype, head_size):
    fw = FRAMEWORKS[lib]()
    o_a0, lse_a0, o_b0, lse_b0 = host_inputs(rng, tokens=45, heads=6, head_size=head_size, dtype=dtype)
    o_a = fw.strided(*o_view(o_a0, o_layouts[0]))
    o_b = fw.strided(*o_view(o_b0, o_layouts[1]))
    out = fw.strided(*o_view(nan_array(o_a0.shape, dtype), o_layouts[2]))
    lse_a = fw.strided(*lse_view(lse_a0, lse_layouts[0]))
    lse_b = fw.strided(*lse_view(lse_b0, lse_layouts[1]))
    out_lse = fw.strided(*lse_view(nan_array(lse_a0.shape), lse_layouts[2]))
    attnmerge.merge(o_a, lse_a, o_b, lse_b, out=out, out_lse=out_lse)
    assert_merge_matches(fw.get(out), fw.get(out_lse), reference_merge(o_a0, lse_a0, o_b0, lse_b0), dtype)


def test_numba_padded_head_size_view(rng):
    fw = Numba()
    o_a0, lse_a0, o_b0, lse_b0 = host_inputs(rng, tokens=20, heads=4, head_size=100, dtype="float16")
    o_a = fw.strided(*o_view(o_a0, "padded"))
    out = fw.strided(*o_view(nan_array(o_a0.shape, "float16"), "offset"))
    out_lse = fw.put(nan_array(lse_a0.shape))
    attnmerge.merge(o_a, fw.put(lse_a0), fw.put(o_b0), fw.put(lse_b0), out=out, out_lse=out_lse)
    assert_merge_matches(fw.get(out), fw.get(out_lse), reference_merge(o_a0, lse_a0, o_b0, lse_b0), "float16")


# --------------------------------------------------------------------------------------------------
# semantics on the GPU


@pytest.mark.parametrize("dtype", DTYPES)
def test_empty_all_empty_nan_and_underflow_rows(rng, fw, dtype):
    o_a, lse_a, o_b, lse_b = host_inputs(rng, tokens=64, heads=4, head_size=80, dtype=dtype)
    lse_a[0:8] = np.inf  # empty a (+inf), NaN in its O
    o_a[0:8] = np.nan
    lse_b[8:16] = -np.inf  # empty b (-inf)
    o_b[8:16] = np.nan
    lse_a[16:20] = np.inf  # both empty: 0, -inf
    lse_b[16:20] = -np.inf
    o_a[16:20] = np.nan
    o_b[16:20] = np.nan
    lse_a[20, 1] = np.nan  # NaN rows
    lse_b[21, 3] = np.nan
    lse_a[24:28] = lse_b[24:28] - 1000.0  # a underflows to weight 0: its NaN is not read
    o_a[24:28] = np.nan
    d = [fw.put(x) for x in (o_a, lse_a, o_b, lse_b)]
    out, out_lse = attnmerge.merge(*d)
    out, out_lse = fw.get(out), fw.get(out_lse)
    assert_merge_matches(out, out_lse, reference_merge(o_a, lse_a, o_b, lse_b), dtype)
    assert np.all(to_f64(out[16:20]) == 0) and np.all(out_lse[16:20] == -np.inf)
    assert np.isnan(to_f64(out)).sum() == 2 * 80 and np.isnan(out_lse).sum() == 2


@pytest.mark.parametrize("dtype", DTYPES)
def test_base_2(rng, fw, dtype):
    h = host_inputs(rng, dtype=dtype)
    out, out_lse = attnmerge.merge(*[fw.put(x) for x in h], base=2)
    assert_merge_matches(fw.get(out), fw.get(out_lse), reference_merge(*h, base=2), dtype)


@pytest.mark.parametrize("a_tokens", [0, 1, 20, 37])
def test_a_tokens(rng, fw, a_tokens):
    o_a, lse_a, o_b, lse_b = host_inputs(rng, dtype="float16")
    o_a, lse_a = o_a[:a_tokens].copy(), lse_a[:a_tokens].copy()
    lse_b[-1] = np.inf
    out, out_lse = attnmerge.merge(*[fw.put(x) for x in (o_a, lse_a, o_b, lse_b)], a_tokens=a_tokens)
    ref = reference_merge(o_a, lse_a, o_b, lse_b, a_tokens=a_tokens)
    assert_merge_matches(fw.get(out), fw.get(out_lse), ref, "float16")


def test_zero_tokens(rng, fw):
    h = host_inputs(rng, tokens=0)
    out, out_lse = attnmerge.merge(*[fw.put(x) for x in h])
    assert tuple(out.shape) == (0, 5, 72) and tuple(out_lse.shape) == (0, 5)


def test_zero_tokens_of_torch_made_empty_tensors(torch):
    """Zero-size CUDA tensors made by torch itself (ordinary strides, possibly a null data pointer)."""
    o = torch.empty(0, 4, 64, device="cuda", dtype=torch.float16)
    lse = torch.empty(0, 4, device="cuda")
    out, out_lse = attnmerge.merge(o, lse, o, lse)
    assert out.shape == (0, 4, 64) and out.is_cuda and out_lse.shape == (0, 4)
    attnmerge.merge(o, lse, o, lse, out=torch.empty_like(o), out_lse=torch.empty_like(lse))


def test_return_lse_false(rng, fw):
    h = host_inputs(rng)
    out, out_lse = attnmerge.merge(*[fw.put(x) for x in h], return_lse=False)
    assert out_lse is None
    assert_o_close(fw.get(out), reference_merge(*h)[0], "float32")


# --------------------------------------------------------------------------------------------------
# streams


def _sleep_then_fill(torch, stream, dst, src):
    """On `stream`: spin the GPU for a while, then copy src into dst.  Work that does not wait for
    `stream` would see dst before the copy."""
    with torch.cuda.stream(stream):
        torch.cuda._sleep(200_000_000)
        dst.copy_(src, non_blocking=True)


def test_stream_none_is_torchs_current_stream(rng, torch):
    fw = Torch()
    h = host_inputs(rng, tokens=256, heads=8, head_size=128)
    o_a, lse_a, o_b, lse_b = [fw.put(x) for x in h]
    src = o_a.clone()
    o_a.fill_(float("nan"))
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    _sleep_then_fill(torch, side, o_a, src)
    with torch.cuda.stream(side):
        out, out_lse = attnmerge.merge(o_a, lse_a, o_b, lse_b)  # enqueued after the fill on `side`
    side.synchronize()
    assert_merge_matches(out.cpu().numpy(), out_lse.cpu().numpy(), reference_merge(*h), "float32")


@pytest.mark.parametrize("how", ["int", "torch_stream", "object_with_cuda_stream"])
def test_stream_argument(rng, torch, how):
    fw = Torch()
    h = host_inputs(rng, tokens=256, heads=8, head_size=128)
    o_a, lse_a, o_b, lse_b = [fw.put(x) for x in h]
    out = fw.put(nan_array(h[0].shape))
    out_lse = fw.put(nan_array(h[1].shape))
    src = o_a.clone()
    o_a.fill_(float("nan"))
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    _sleep_then_fill(torch, side, o_a, src)

    class Handle:
        cuda_stream = side.cuda_stream

    stream = {"int": side.cuda_stream, "torch_stream": side, "object_with_cuda_stream": Handle()}[how]
    attnmerge.merge(o_a, lse_a, o_b, lse_b, out=out, out_lse=out_lse, stream=stream)
    side.synchronize()
    assert_merge_matches(out.cpu().numpy(), out_lse.cpu().numpy(), reference_merge(*h), "float32")


def test_cupy_stream_object_and_current_stream(rng):
    fw = CuPy()
    cp = fw.cp
    h = host_inputs(rng, tokens=128, heads=4, head_size=64, dtype="float16")
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        d = [cp.asarray(x) for x in h]
        out, out_lse = attnmerge.merge(*d)  # stream=None: CuPy's current stream, s
    s.synchronize()
    assert_merge_matches(cp.asnumpy(out), cp.asnumpy(out_lse), reference_merge(*h), "float16")
    out2 = cp.full(h[0].shape, cp.nan, dtype=cp.float16)
    attnmerge.merge(*d, out=out2, stream=s)  # an object with .ptr
    s.synchronize()
    assert cp.array_equal(out2, out)


def test_a_numba_stream_handle(rng):
    fw = Numba()
    h = host_inputs(rng, tokens=64, heads=4, head_size=64)
    s = fw.cuda.stream()
    d = [fw.cuda.to_device(x, stream=s) for x in h]
    out = fw.cuda.to_device(nan_array(h[0].shape), stream=s)
    handle = s.handle.value if hasattr(s.handle, "value") else int(s.handle)
    attnmerge.merge(*d, out=out, stream=handle)
    s.synchronize()
    assert_o_close(out.copy_to_host(), reference_merge(*h)[0], "float32")


# --------------------------------------------------------------------------------------------------
# devices


def test_the_current_device_is_unchanged(rng, torch):
    fw = Torch()
    n = torch.cuda.device_count()
    before = torch.cuda.current_device()
    h = host_inputs(rng)
    attnmerge.merge(*[fw.put(x) for x in h])
    torch.cuda.synchronize()
    assert torch.cuda.current_device() == before
    if n >= 2:  # tensors on device 1 while device 0 is current
        torch.cuda.set_device(0)
        d = [torch.from_numpy(x).to("cuda:1") for x in h]
        out, out_lse = attnmerge.merge(*d)
        assert torch.cuda.current_device() == 0
        assert out.device == d[0].device
        torch.cuda.synchronize(1)
        assert_merge_matches(out.cpu().numpy(), out_lse.cpu().numpy(), reference_merge(*h), "float32")


def test_arrays_on_the_gpu_and_the_host_are_refused(rng, torch):
    fw = Torch()
    h = host_inputs(rng)
    o_a, lse_a, o_b, lse_b = [fw.put(x) for x in h]
    out = fw.put(nan_array(h[0].shape))
    with pytest.raises(ValueError) as info:
        attnmerge.merge(o_a, lse_a, h[2], lse_b, out=out)  # o_b is a NumPy array
    assert "o_b" in str(info.value)
    with pytest.raises(ValueError) as info:
        attnmerge.merge(o_a, lse_a, o_b, torch.from_numpy(h[3]), out=out)  # lse_b a torch CPU tensor
    assert "lse_b" in str(info.value)
    with pytest.raises(ValueError) as info:
        attnmerge.merge(o_a, lse_a, o_b, lse_b, out=torch.from_numpy(nan_array(h[0].shape)))
    assert "out" in str(info.value)
    assert torch.isnan(out).all()


def test_arrays_on_two_gpus_are_refused(rng, torch):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    h = host_inputs(rng)
    d = [torch.from_numpy(x).to("cuda:0") for x in h]
    d[2] = d[2].to("cuda:1")
    with pytest.raises(ValueError) as info:
        attnmerge.merge(*d)
    assert "o_b" in str(info.value)


def _run_python(code):
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)


def test_raw_device_pointers_with_the_wrong_device_do_not_crash():
    """GPU pointers declared as host memory, or as another device: an error, never a crash.
    (In a subprocess, so that a crash fails this test only.)"""
    p = _run_python("""
        import torch, attnmerge
        from attnmerge import raw
        t, h, d = 8, 2, 16
        o = torch.randn(t, h, d, device="cuda"); l = torch.randn(t, h, device="cuda")
        out = torch.full((t, h, d), float("nan"), device="cuda")
        od = lambda x: (x.data_ptr(), "float32", x.stride(0), x.stride(1))
        ld = lambda x: (x.data_ptr(), x.stride(0), x.stride(1))
        for dev in ("cpu", torch.cuda.device_count()):
            try:
                raw.merge(tokens=t, heads=h, head_size=d, out=od(out), o_a=od(o), lse_a=ld(l), o_b=od(o),
                          lse_b=ld(l), device=dev)
                print("no error for", dev)
            except ValueError as e:
                print("ValueError", dev, e)
        torch.cuda.synchronize()
        print("nan after", bool(torch.isnan(out).all()))
    """)
    assert p.returncode == 0, f"exit {p.returncode}\n{p.stdout}\n{p.stderr}"
    assert "no error" not in p.stdout, p.stdout
    assert p.stdout.count("ValueError") == 2 and "nan after True" in p.stdout, p.stdout


def test_merge_on_a_second_gpu_pointer_passed_as_device_0(torch):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    p = _run_python("""
        import torch
        from attnmerge import raw
        o = torch.randn(8, 2, 16, device="cuda:1"); l = torch.randn(8, 2, device="cuda:1")
        od = (o.data_ptr(), "float32", 32, 16); ld = (l.data_ptr(), 2, 1)
        try:
            raw.merge(tokens=8, heads=2, head_size=16, out=od, o_a=od, lse_a=ld, o_b=od, lse_b=ld, device=0)
            print("no error")
        except ValueError as e:
            print("ValueError", e)
    """)
    assert p.returncode == 0 and "ValueError" in p.stdout, p.stdout + p.stderr


# --------------------------------------------------------------------------------------------------
# JAX specifics


def test_jax_outputs_are_allocated_and_out_is_refused(rng):
    fw = Jax()
    h = host_inputs(rng, dtype="bfloat16")
    d = [fw.put(x) for x in h]
    out, out_lse = attnmerge.merge(*d, out_dtype="float32")
    assert fw.is_mine(out) and fw.is_mine(out_lse)
    assert_merge_matches(fw.get(out), fw.get(out_lse), reference_merge(*h), "float32")
    with pytest.raises(ValueError) as info:
        attnmerge.merge(*d, out=out)
    assert "out" in str(info.value)


# --------------------------------------------------------------------------------------------------
# the vLLM layer and the raw layer on the GPU


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [None, 0, 30, 77])
def test_vllm_merge_attn_states_on_torch(rng, torch, dtype, k):
    from attnmerge.compat.vllm import merge_attn_states

    fw = Torch()
    t, h, d = 77, 8, 128
    po, so = [fw.put(x) for x in (random_state(rng, t, h, d, dtype)[0], random_state(rng, t, h, d, dtype)[0])]
    pl, sl = fw.put(random_lse(rng, (h, t))), fw.put(random_lse(rng, (h, t)))
    pl[1, 3] = float("inf")
    output = fw.put(nan_array((t, h, d), dtype))
    output_lse = fw.put(nan_array((h, t)))
    merge_attn_states(output, po, pl, so, sl, output_lse, prefill_tokens_with_context=k)
    ref = reference_merge(fw.get(po), fw.get(pl).T, fw.get(so), fw.get(sl).T, a_tokens=k)
    assert_merge_matches(fw.get(output), fw.get(output_lse).T, ref, dtype, "output")
    output2 = fw.put(nan_array((t, h, d), dtype))
    merge_attn_states(output2, po, pl, so, sl, None, prefill_tokens_with_context=k)
    assert torch.equal(output2, output)


@pytest.mark.parametrize("check_pointers", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_raw_layer_with_torch_data_ptr(rng, torch, dtype, check_pointers):
    from attnmerge import raw

    fw = Torch()
    h = host_inputs(rng, tokens=33, heads=4, head_size=80, dtype=dtype)
    o_a, lse_a, o_b, lse_b = [fw.put(x) for x in h]
    out = fw.put(nan_array(h[0].shape, dtype))
    out_lse_ht = fw.put(nan_array((4, 33)))  # [heads, tokens], described by strides

    def od(x):
        return (x.data_ptr(), dtype, x.stride(0), x.stride(1))

    def ld(x):
        return (x.data_ptr(), x.stride(0), x.stride(1))

    raw.merge(tokens=33, heads=4, head_size=80, out=od(out), o_a=od(o_a), lse_a=ld(lse_a), o_b=od(o_b),
              lse_b=ld(lse_b), out_lse=ld(out_lse_ht.T), device=torch.cuda.current_device(),
              stream=torch.cuda.current_stream().cuda_stream, check_pointers=check_pointers)
    assert_merge_matches(fw.get(out), fw.get(out_lse_ht).T, reference_merge(*h), dtype)


def test_raw_layer_base_2_and_a_tokens(rng, torch):
    from attnmerge import raw

    fw = Torch()
    h = host_inputs(rng, tokens=40, heads=2, head_size=64)
    o_a, lse_a, o_b, lse_b = [fw.put(x) for x in h]
    out = fw.put(nan_array(h[0].shape))
    od = lambda x: (x.data_ptr(), "float32", x.stride(0), x.stride(1))  # noqa: E731
    ld = lambda x: (x.data_ptr(), x.stride(0), x.stride(1))  # noqa: E731
    raw.merge(tokens=40, heads=2, head_size=64, out=od(out), o_a=od(o_a), lse_a=ld(lse_a), o_b=od(o_b),
              lse_b=ld(lse_b), device=0, base=2, a_tokens=25)
    assert_o_close(fw.get(out), reference_merge(*h, base=2, a_tokens=25)[0], "float32")
