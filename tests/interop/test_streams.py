"""Which stream a call runs on, decided in one place, the binding's array reader
(python/src/array_view.h): an explicit stream as given; `stream=None` the current stream of the
framework that owns the array the outputs are allocated like (o_b, else o), else the legacy default
stream.  Checked on the CPU through what a producer's __dlpack__ is told (its `stream` argument, 1
for the legacy default stream), with stand-ins for the frameworks; then, marked `gpu`, with the real
ones on a GPU: work enqueued on a side stream that the merge must wait for."""
from __future__ import annotations

import sys
import types

import numpy as np
import pytest

import attnmerge
from gpu_frameworks import CuPy, Numba, Torch
from oracle import random_pair, assert_merge_matches, assert_o_close, nan_array, reference_merge


class Told(Exception):
    pass


class GpuProducer:
    """A CUDA array by DLPack that records the stream it is asked to export for, then refuses."""

    def __init__(self):
        self.streams = []

    def __dlpack_device__(self):
        return (2, 0)  # kDLCUDA, device 0

    def __dlpack__(self, stream=None, max_version=None):
        self.streams.append(stream)
        raise Told()


def told(like, stream=None):
    """The stream merge(o_a=producer, o_b=like) tells the producer (o_a is read before o_b, which
    is then never read: the stream is decided before any array is).  The producer's refusal comes
    back naming o_a, the producer's own exception its cause."""
    producer = GpuProducer()
    with pytest.raises(ValueError, match="^o_a: ") as info:
        attnmerge.merge(producer, np.zeros((2, 1), np.float32), like, np.zeros((2, 1), np.float32),
                        out=np.zeros((2, 1, 4), np.float32), out_lse=np.zeros((2, 1), np.float32), stream=stream)
    assert isinstance(info.value.__cause__, Told)
    assert len(producer.streams) == 1
    return producer.streams[0]


def host_array():
    return np.zeros((2, 1, 4), np.float32)


@pytest.mark.parametrize("stream,expect", [(0, 1), (12345, 12345)])
def test_an_int_stream_is_taken_as_given(stream, expect):
    assert told(host_array(), stream=stream) == expect  # 0, the legacy default stream, is DLPack's 1


def test_stream_objects_are_read_for_their_handle():
    class WithCudaStream:
        cuda_stream = 777

    class WithPtr:
        ptr = 778

    class WithProtocol:
        def __cuda_stream__(self):
            return (0, 779)

    assert [told(host_array(), stream=s()) for s in (WithCudaStream, WithPtr, WithProtocol)] == [777, 778, 779]


def test_none_with_an_array_of_no_known_framework_is_the_legacy_default_stream():
    assert told(host_array()) == 1


def _array_of(module):
    """An instance of a class defined in `module`: the binding tells a framework by its module."""
    return type("Array", (), {"__module__": module})()


def test_none_with_a_cupy_array_is_cupys_current_stream(monkeypatch):
    cuda = types.SimpleNamespace(get_current_stream=lambda: types.SimpleNamespace(ptr=4242))
    monkeypatch.setitem(sys.modules, "cupy", types.ModuleType("cupy"))
    monkeypatch.setitem(sys.modules, "cupy.cuda", cuda)
    assert told(_array_of("cupy._core.core")) == 4242


@pytest.mark.parametrize("stream,expect", [(None, 1), (1, 1), (2, 2), (31337, 31337)])
def test_none_with_a_numba_array_is_the_stream_its_cuda_array_interface_names(stream, expect):
    x = _array_of("numba.cuda.cudadrv.devicearray")
    x.__cuda_array_interface__ = {"stream": stream}
    assert told(x) == expect


def test_an_explicit_stream_wins_over_the_frameworks():
    x = _array_of("numba.cuda.cudadrv.devicearray")
    x.__cuda_array_interface__ = {"stream": 2}
    assert told(x, stream=55) == 55


# --------------------------------------------------------------------------------------------------
# streams on a GPU (marked gpu)


@pytest.fixture
def torch():
    return Torch().torch


def _sleep_then_fill(torch, stream, dst, src):
    """On `stream`: spin the GPU for a while, then copy src into dst.  Work that does not wait for
    `stream` would see dst before the copy."""
    with torch.cuda.stream(stream):
        torch.cuda._sleep(200_000_000)
        dst.copy_(src, non_blocking=True)


@pytest.mark.gpu
def test_stream_none_is_torchs_current_stream(rng, torch):
    fw = Torch()
    h = random_pair(rng, tokens=256, heads=8, head_size=128)
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


@pytest.mark.gpu
@pytest.mark.parametrize("how", ["int", "torch_stream", "object_with_cuda_stream"])
def test_stream_argument(rng, torch, how):
    fw = Torch()
    h = random_pair(rng, tokens=256, heads=8, head_size=128)
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


@pytest.mark.gpu
def test_cupy_stream_object_and_current_stream(rng):
    fw = CuPy()
    cp = fw.cp
    h = random_pair(rng, tokens=128, heads=4, head_size=64, dtype="float16")
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


@pytest.mark.gpu
def test_a_numba_stream_handle(rng):
    fw = Numba()
    h = random_pair(rng, tokens=64, heads=4, head_size=64)
    s = fw.cuda.stream()
    d = [fw.cuda.to_device(x, stream=s) for x in h]
    out = fw.cuda.to_device(nan_array(h[0].shape), stream=s)
    handle = s.handle.value if hasattr(s.handle, "value") else int(s.handle)
    attnmerge.merge(*d, out=out, stream=handle)
    s.synchronize()
    assert_o_close(out.copy_to_host(), reference_merge(*h)[0], "float32")
