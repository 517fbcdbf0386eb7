"""Split-KV decode with attention sinks (examples/split_kv_decode.py), with PyTorch tensors.

The keys are split into S chunks, each chunk's state computed without the sink, and the states
merged by attnmerge.merge_states with the sinks: the result must be gpt-oss's attention with sinks
over all the keys, computed in float64 in one piece (float32 inputs: relative L2 error < 1e-5, LSE
within 1e-5), for chunk counts that do and do not divide the keys; and the script itself runs.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from oracle import assert_lse_close, rel_l2

torch = pytest.importorskip("torch")

EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples",
                       "split_kv_decode.py")
DEVICES = [pytest.param("cpu", id="cpu"),
           pytest.param("cuda", id="cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
               not torch.cuda.is_available(), reason="no CUDA device")])]


def example():
    spec = importlib.util.spec_from_file_location("split_kv_decode", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("splits", (1, 7, 64))
def test_split_kv_attention_with_sinks_is_the_whole_attention(device, splits):
    ex = example()
    q, k, v, sinks = ex.make_problem(seed=3, tokens=5, heads=4, head_size=64, keys=1000, device=device)
    out, out_lse = ex.split_kv_attention(q, k, v, sinks, splits)
    want, want_lse = ex.attention_with_sinks(q.cpu(), k.cpu(), v.cpu(), sinks.cpu())
    assert rel_l2(out.cpu().numpy(), want.numpy()) < 1e-5
    assert_lse_close(out_lse.cpu().numpy(), want_lse.numpy())
    without = ex.attention_with_sinks(q.cpu(), k.cpu(), v.cpu(), torch.full_like(sinks.cpu(), -float("inf")))[0]
    assert rel_l2(out.cpu().numpy(), without.numpy()) > 1e-3  # the sinks took their share


def test_the_script_runs():
    r = subprocess.run([sys.executable, EXAMPLE, "--splits", "5", "--keys", "999"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    err = float(r.stdout.split("relative error ")[1].split(",")[0])
    assert err < 1e-5, r.stdout
