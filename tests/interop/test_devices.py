"""Devices: a call runs on the device its arrays are on and leaves the caller's current device as
it was; arrays on the GPU and the host, or on two GPUs, are refused naming the argument; raw pointers
declared on the wrong device are an error, never a crash.

Every test here carries the `gpu` marker (skipped without a CUDA GPU); the two-GPU cases skip with
one GPU.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

import attnmerge
from gpu_frameworks import Torch
from oracle import random_pair, assert_merge_matches, nan_array, reference_merge

pytestmark = pytest.mark.gpu


@pytest.fixture
def torch():
    return Torch().torch


def test_the_current_device_is_unchanged(rng, torch):
    fw = Torch()
    n = torch.cuda.device_count()
    before = torch.cuda.current_device()
    h = random_pair(rng)
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
    h = random_pair(rng)
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
    h = random_pair(rng)
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
