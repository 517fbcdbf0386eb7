"""Context parallelism across processes (examples/context_parallel.py), on the CPU with gloo.

P processes each compute the attention state of one shard of the keys for the same queries, and
either all-gather (O, LSE) with torch.distributed into [P, tokens, heads, D] / [P, tokens, heads]
buffers and merge them with attnmerge.merge_states(..., states_axis=0) (--combine gather), or
all-gather the LSEs alone and sum each rank's attnmerge.merge_share (--combine share).  Every
rank's result must be the
single-process attention over all the keys, computed here in float64 (float32 inputs: relative L2
error < 1e-5, LSE within 1e-5).  Two launchers: the script itself as torchrun starts it (env://
rendezvous, one subprocess per rank), and its importable `run` under torch.multiprocessing (file://).
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

import attnmerge
from oracle import assert_lse_close, rel_l2

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is unavailable", allow_module_level=True)

EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples", "context_parallel.py")
# A problem whose key count does not divide by P: the shards differ in size.
PROBLEM = dict(seed=7, tokens=24, heads=4, head_size=64, keys=1001)


def example():
    spec = importlib.util.spec_from_file_location("context_parallel", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def reference(q, k, v, scale=None):
    """float64 attention of q over all keys, per head: O [T, H, D], LSE [T, H] (natural log)."""
    q, k, v = (x.double().numpy() for x in (q, k, v))
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
    scores = np.einsum("thd,khd->thk", q, k) * scale
    m = scores.max(axis=-1, keepdims=True)
    e = np.exp(scores - m)
    w = e.sum(axis=-1, keepdims=True)
    o = np.einsum("thk,khd->thd", e / w, v)
    return o, (m + np.log(w))[..., 0]


def check(results, world):
    q, k, v = example().make_problem(**PROBLEM)
    ref_o, ref_lse = reference(q, k, v)
    assert len(results) == world
    for rank, (out, out_lse) in enumerate(results):
        out, out_lse = out.numpy(), out_lse.numpy()
        assert out.shape == ref_o.shape and out_lse.shape == ref_lse.shape
        err = rel_l2(out, ref_o)
        assert err < 1e-5, f"rank {rank}: relative L2 error {err:.3g} of O"
        assert_lse_close(out_lse, ref_lse, f"rank {rank} lse")
    for out, out_lse in results[1:]:  # every rank merged the same gathered states
        assert torch.equal(out, results[0][0]) and torch.equal(out_lse, results[0][1])


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("combine", ["gather", "share"])
@pytest.mark.parametrize("world", [2, 4])
def test_the_script_as_torchrun_starts_it(tmp_path, world, combine):
    """`torchrun --nproc-per-node P examples/context_parallel.py`, emulated: one process per rank,
    with torchrun's environment variables (env:// rendezvous on a free local port)."""
    port = free_port()
    args = [f"--{k.replace('_', '-')}={v}" for k, v in PROBLEM.items()]
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                   LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
        cmd = [sys.executable, EXAMPLE, "--device=cpu", "--backend=gloo", f"--save={tmp_path}", f"--combine={combine}",
               *args]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=120)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for rank, (p, text) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"rank {rank} exited with {p.returncode}:\n{text}"
    assert "max |O - ref|" in outputs[0], outputs[0]
    results = []
    for rank in range(world):
        saved = torch.load(os.path.join(tmp_path, f"rank{rank}.pt"))
        results.append((saved["out"], saved["out_lse"]))
    check(results, world)


def _worker(rank, world, init_method, folder, problem, combine="gather"):
    """torch.multiprocessing target: the example's importable run(), its result saved for the test."""
    sys.path.insert(0, os.path.dirname(EXAMPLE))
    import context_parallel

    torch.set_num_threads(1)
    out, out_lse = context_parallel.run(rank, world, init_method, backend="gloo", device="cpu", combine=combine,
                                       **problem)
    torch.save({"out": out, "out_lse": out_lse}, os.path.join(folder, f"rank{rank}.pt"))


@pytest.mark.parametrize("combine", ["gather", "share"])
@pytest.mark.parametrize("world", [2, 4])
def test_the_importable_run_under_torch_multiprocessing(tmp_path, world, combine):
    import torch.multiprocessing as mp

    init = f"file://{tmp_path / 'rendezvous'}"
    mp.spawn(_worker, args=(world, init, str(tmp_path), PROBLEM, combine), nprocs=world, join=True)
    results = []
    for rank in range(world):
        saved = torch.load(os.path.join(tmp_path, f"rank{rank}.pt"))
        results.append((saved["out"], saved["out_lse"]))
    check(results, world)


def test_an_empty_shard_is_an_empty_part():
    """More ranks than keys: a rank with no keys contributes LSE = -inf, and the merge ignores it."""
    cp = example()
    q, k, v = cp.make_problem(seed=1, tokens=5, heads=2, head_size=16, keys=3)
    states = [cp.partial_attention(q, k[b:e], v[b:e], 0.25) for b, e in (cp.shard_bounds(3, 4, r) for r in range(4))]
    assert torch.isinf(states[3][1]).all() and (states[3][1] < 0).all()
    o_all = torch.stack([s[0] for s in states])
    lse_all = torch.stack([s[1] for s in states])
    out, out_lse = attnmerge.merge_states(o_all, lse_all, states_axis=0)
    ref_o, ref_lse = reference(q, k, v, 0.25)
    assert rel_l2(out.numpy(), ref_o) < 1e-5
    assert_lse_close(out_lse.numpy(), ref_lse)


def test_the_shares_of_every_shard_sum_to_the_attention():
    """The share combine without processes: each shard's merge_share of the gathered LSEs, summed, is
    the attention over all the keys (an empty shard's share is 0)."""
    cp = example()
    q, k, v = cp.make_problem(seed=2, tokens=6, heads=3, head_size=32, keys=5)
    bounds = [cp.shard_bounds(5, 7, r) for r in range(7)]  # 7 ranks, 5 keys: two empty shards
    states = [cp.partial_attention(q, k[b:e], v[b:e], 0.5) for b, e in bounds]
    lse_all = torch.stack([s[1] for s in states])
    shares = [attnmerge.merge_share(o, lse_all, r, states_axis=0) for r, (o, _) in enumerate(states)]
    ref_o, ref_lse = reference(q, k, v, 0.5)
    assert rel_l2(sum(s[0].double() for s in shares).numpy(), ref_o) < 1e-5
    for _, out_lse in shares:
        assert_lse_close(out_lse.numpy(), ref_lse)
    assert all((shares[r][0] == 0).all() for r, (b, e) in enumerate(bounds) if b == e)
