"""The merge family on the GPU with PyTorch CUDA tensors: merge_inplace, merge_states, merge_varlen,
FP8 output, the FlashInfer and vLLM layers, CUDA graphs.

Every test carries the `gpu` marker (skipped without a CUDA GPU) and skips without torch CUDA.
Inputs are made with NumPy (seeded), moved to the device, and the results compared with the float64
oracle.  (For checking the tests themselves on a machine without a GPU,
ATTNMERGE_GPU_FAMILY_DEVICE=cpu runs them on torch CPU tensors, skipping the GPU-only behaviour.)
"""

from __future__ import annotations

import os

import numpy as np
import pytest

import attnmerge
from oracle import (
    DTYPES,
    assert_fp8_close,
    assert_merge_matches,
    assert_o_close,
    fp8_dtype,
    nan_array,
    outside_view_is_nan,
    random_stacked,
    random_state,
    reference_merge,
    reference_merge_stacked,
    reference_merge_varlen,
)

DEVICE = os.environ.get("ATTNMERGE_GPU_FAMILY_DEVICE", "cuda")
ON_GPU = DEVICE.startswith("cuda")
if ON_GPU:
    pytestmark = pytest.mark.gpu

S_VALUES = (1, 2, 3, 8, 64, 256)


@pytest.fixture(scope="module")
def torch():
    torch = pytest.importorskip("torch")
    if ON_GPU and not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA GPU")
    return torch


def gpu_only():
    if not ON_GPU:
        pytest.skip("GPU-only behaviour")


def put(x: np.ndarray):
    import torch

    if x.dtype.name == "bfloat16":
        return torch.from_numpy(x.astype(np.float32)).to(DEVICE).to(torch.bfloat16)
    return torch.from_numpy(np.array(x, copy=True, order="C")).to(DEVICE)  # never shares x's memory


def get(t) -> np.ndarray:
    import torch

    if t.is_cuda:
        torch.cuda.synchronize(t.device)
    if t.dtype == torch.bfloat16:
        return t.float().cpu().numpy()
    if t.dtype == getattr(torch, "float8_e4m3fn", None):
        return t.cpu().view(torch.uint8).numpy().view(fp8_dtype())
    return t.cpu().numpy()


def strided(view: np.ndarray, buf: np.ndarray):
    """The torch tensor on DEVICE with the layout of a NumPy view of a C-contiguous buffer; and the buffer."""
    import torch

    off = (view.__array_interface__["data"][0] - buf.__array_interface__["data"][0]) // view.itemsize
    strides = tuple(s // view.itemsize for s in view.strides)
    tbuf = put(buf)
    return torch.as_strided(tbuf, view.shape, strides, off), tbuf


def nan_tensor(shape, dtype="float32"):
    return put(nan_array(shape, dtype))


def fp8_nan_tensor(torch, shape):
    return torch.full(shape, float("nan"), device=DEVICE).to(torch.float8_e4m3fn)


def buffer_outside_is_nan(view_t, buf_t, np_view, np_buf):
    """Every element of the torch buffer outside the view is NaN (the NumPy twin gives the geometry)."""
    host = get(buf_t)
    twin = np.lib.stride_tricks.as_strided(
        host.reshape(-1)[(np_view.__array_interface__["data"][0] - np_buf.__array_interface__["data"][0]) // np_view.itemsize:],
        shape=np_view.shape, strides=tuple(s // np_view.itemsize * host.itemsize for s in np_view.strides),
    )
    return outside_view_is_nan(twin, host)


# --------------------------------------------------------------------------------------------------
# the FlashInfer layer on torch


@pytest.mark.parametrize("dtype", DTYPES)
def test_flashinfer_layer_on_torch(rng, torch, dtype):
    from attnmerge.compat import flashinfer as fi

    t, h, d = 33, 4, 128
    v_a, s_a = random_state(rng, t, h, d, dtype)
    v_b, s_b = random_state(rng, t, h, d, dtype)
    v, s = fi.merge_state(put(v_a), put(s_a), put(v_b), put(s_b))
    assert isinstance(v, torch.Tensor) and v.device == put(s_a).device and v.dtype == getattr(torch, dtype)
    assert_merge_matches(get(v), get(s), reference_merge(v_a, s_a, v_b, s_b, base=2), dtype, "v")

    tv, ts = put(v_a), put(s_a)
    mask = torch.from_numpy(np.arange(t) % 2 == 0).to(DEVICE)
    before = get(tv).copy()
    assert fi.merge_state_in_place(tv, ts, put(v_b), put(s_b), mask=mask) is None
    ref = reference_merge(v_a, s_a, v_b, s_b, base=2)
    on = np.arange(t) % 2 == 0
    assert_o_close(get(tv)[on], ref[0][on], dtype, "v")
    assert np.array_equal(get(tv)[~on], before[~on])

    vs, ss = random_stacked(rng, t, 8, h, d, dtype)
    v, s = fi.merge_states(put(vs), put(ss))
    assert_merge_matches(get(v), get(s), reference_merge_stacked(vs, ss, base=2), dtype, "v")

    indptr = np.array([0, 4, 4, 9, 12], np.int32)
    vv, sv = random_state(rng, 12, h, d, dtype)
    v, s = fi.variable_length_merge_states(put(vv), put(sv), put(indptr))
    assert_merge_matches(get(v), get(s), reference_merge_varlen(vv, sv, indptr, base=2), dtype, "v")


# --------------------------------------------------------------------------------------------------
# CUDA graphs


def _capture(torch, fn):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # warm-up off the default stream, as torch recommends
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


@pytest.mark.parametrize("states_axis", (0, 1))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graph_capture_of_merge_states(rng, torch, dtype, states_axis):
    gpu_only()
    t, s, h, d = 100, 8, 8, 128
    o0, lse0 = random_stacked(rng, t, s, h, d, dtype, states_axis)
    o, lse = put(o0), put(lse0)
    out, out_lse = nan_tensor((t, h, d), dtype), nan_tensor((t, h))
    g = _capture(torch, lambda: attnmerge.merge_states(o, lse, out=out, out_lse=out_lse, states_axis=states_axis))
    for step in range(3):
        o1, lse1 = random_stacked(rng, t, s, h, d, dtype, states_axis)
        lse1[(slice(None),) * states_axis + (step,)] = np.inf  # an empty part
        lse1.reshape(-1)[step * 7] = np.nan  # a NaN row
        o.copy_(put(o1))
        lse.copy_(put(lse1))
        out.fill_(float("nan"))
        out_lse.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert_merge_matches(get(out), get(out_lse), reference_merge_stacked(o1, lse1, states_axis=states_axis), dtype)


def test_cuda_graph_capture_of_fp8_merge_states_reads_the_scale_at_replay(rng, torch):
    gpu_only()
    o0, lse0 = random_stacked(rng, 64, 4, 4, 128, "float16")
    o, lse = put(o0), put(lse0)
    out = fp8_nan_tensor(torch, (64, 4, 128))
    scale = torch.tensor([1.0], device=DEVICE)
    g = _capture(torch, lambda: attnmerge.merge_states(o, lse, out=out, output_scale=scale))
    ref_o = reference_merge_stacked(o0, lse0)[0]
    for sv in (0.5, 3.0):
        scale.fill_(sv)
        g.replay()
        torch.cuda.synchronize()
        assert_fp8_close(get(out), ref_o, sv)


def test_cuda_graph_capture_of_varlen_and_inplace(rng, torch):
    gpu_only()
    indptr = put(np.array([0, 2, 2, 7, 8], np.int32))
    o0, lse0 = random_state(rng, 8, 4, 64)
    o, lse = put(o0), put(lse0)
    out, out_lse = nan_tensor((4, 4, 64)), nan_tensor((4, 4))
    acc0, acc_lse0 = random_state(rng, 8, 4, 64)
    acc, acc_lse = put(acc0), put(acc_lse0)
    mask = put(np.array([1, 0, 1, 1, 0, 1, 1, 1], np.uint8))

    def step():
        attnmerge.merge_varlen(o, lse, indptr, out=out, out_lse=out_lse)
        attnmerge.merge_inplace(acc, acc_lse, o, lse, mask=mask)

    g = _capture(torch, step)  # the warm-up ran the in-place merge once already
    acc.copy_(put(acc0))
    acc_lse.copy_(put(acc_lse0))
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert_merge_matches(get(out), get(out_lse), reference_merge_varlen(o0, lse0, np.array([0, 2, 2, 7, 8])), "float32")
    on = get(mask) != 0
    ref = reference_merge(acc0, acc_lse0, o0, lse0)
    assert_o_close(get(acc)[on], ref[0][on], "float32", "o")
    assert np.array_equal(get(acc)[~on], acc0[~on])
