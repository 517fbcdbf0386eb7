"""Context parallelism across processes (examples/context_parallel.py), on the CPU with gloo.

P processes each compute the attention state of one shard of the keys for the same queries, and
combine the ranks' states in every form of the example: all-gather + merge_states, all-gather of
the LSEs + merge_share + a reduce-scatter over heads, all-to-all + merge_states on each receive
layout ([cp, T, H, D], [T, cp, H, D], [T, H, cp, D]; O and LSE in two buffers or in one of packed
records), the ring (shards by send/recv, merge_inplace into a float32 accumulator) and the fused
exchange (attnmerge.Exchange over buffers in shared memory every process maps).  Every rank's part
of every form must be the single-process attention over all the keys, computed here in float64
(float32 inputs: relative L2 error < 1e-5, LSE within 1e-5); the all-to-all and fused forms merge
the same states as the all-gather, so their rows are its rows bit for bit.

The processes start once per world size (2 and 4), as torchrun starts them (env:// rendezvous, one
subprocess per rank, `--combine all`); with two GPUs the same runs over NCCL (a `gpu` test).  The
fused form is also run by processes torch.multiprocessing starts, handed tensors in shared memory
(share_memory_()) that every one of them addresses.
"""

from __future__ import annotations

import ast
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

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "context_parallel.py")
DOC = os.path.join(ROOT, "docs", "context-parallel.md")
# A problem whose key count does not divide by P: the shards differ in size.
PROBLEM = dict(seed=7, tokens=24, heads=4, head_size=64, keys=1001)
# Every form of --combine all on gloo, by the example's labels (NCCL: the receive layout [cp, T, H, D] alone).
LABELS = ["gather", "share"] + [f"all_to_all[{layout}{packed}]" for layout in ("cp,T,H,D", "T,cp,H,D", "T,H,cp,D")
                                 for packed in ("", ", packed")] + ["ring", "fused"]


def labels(backend):
    return [x for x in LABELS if backend == "gloo" or not x.startswith(("all_to_all[T,cp", "all_to_all[T,H,cp"))]


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


def check(results, label):
    """Every rank's result of form `label` is its heads of the float64 attention."""
    q, k, v = example().make_problem(**PROBLEM)
    ref_o, ref_lse = reference(q, k, v)
    for rank, by_label in enumerate(results):
        out, out_lse, (begin, end) = by_label[label]
        out, out_lse = out.numpy(), out_lse.numpy()
        assert out.shape == ref_o[:, begin:end].shape and out_lse.shape == ref_lse[:, begin:end].shape, label
        err = rel_l2(out, ref_o[:, begin:end])
        assert err < 1e-5, f"{label}, rank {rank}: relative L2 error {err:.3g} of O"
        assert_lse_close(out_lse, ref_lse[:, begin:end], f"{label}, rank {rank} lse")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module", params=[("gloo", 2), ("gloo", 4), pytest.param(("nccl", 2), marks=pytest.mark.gpu)],
                ids=lambda p: f"{p[0]}, {p[1]} processes")
def launched(request, tmp_path_factory):
    """`torchrun --nproc-per-node P examples/context_parallel.py --combine all`, emulated: one process
    per rank with torchrun's environment variables (env:// rendezvous on a free local port), gloo on
    the CPU or NCCL with a GPU each (skipped without two).  The backend, each rank's results by
    label, and rank 0's printout."""
    backend, world = request.param
    if backend == "nccl" and torch.cuda.device_count() < world:
        pytest.skip(f"NCCL with {world} processes needs {world} GPUs, torch sees {torch.cuda.device_count()}")
    folder = tmp_path_factory.mktemp(f"cp_{backend}{world}")
    port = free_port()
    args = [f"--{k.replace('_', '-')}={v}" for k, v in PROBLEM.items()]
    device = "cpu" if backend == "gloo" else "cuda"
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                   LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1", NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
        if backend == "gloo":
            env["CUDA_VISIBLE_DEVICES"] = ""
        cmd = [sys.executable, EXAMPLE, f"--device={device}", f"--backend={backend}", f"--save={folder}",
               "--combine=all", *args]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=180)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for rank, (p, text) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"rank {rank} exited with {p.returncode}:\n{text}"
    return backend, [torch.load(folder / f"rank{rank}.pt") for rank in range(world)], outputs[0]


@pytest.mark.parametrize("label", LABELS)
def test_every_form_is_the_attention_over_all_keys(launched, label):
    backend, results, printout = launched
    assert all(list(r) == labels(backend) for r in results)
    if label not in labels(backend):
        pytest.skip(f"{backend} takes no {label}")
    check(results, label)
    assert label in printout, printout


def test_every_rank_merges_the_same_gathered_states(launched):
    """The all-gather leaves every rank the same buffers: the same merge, bit for bit (the ring's
    ranks merge the shards in orders of their own, equal within rounding)."""
    _, results, _ = launched
    for out, out_lse, _ in (r["gather"] for r in results[1:]):
        assert torch.equal(out, results[0]["gather"][0]) and torch.equal(out_lse, results[0]["gather"][1])


def test_the_exchanged_layouts_merge_the_gathered_rows_bit_for_bit(launched):
    """The all-to-all's receive buffers (read where they landed, packed or not) and the fused exchange
    hold the all-gather's states: the same rows, bit for bit, on the CPU."""
    backend, results, _ = launched
    if backend != "gloo":
        pytest.skip("on GPUs the forms' kernels may round differently")
    for by_label in results:
        everything = by_label["gather"]
        for label in LABELS:
            if label.startswith("all_to_all") or label == "fused":
                out, out_lse, (begin, end) = by_label[label]
                assert torch.equal(out, everything[0][:, begin:end]), label
                assert torch.equal(out_lse, everything[1][:, begin:end]), label


def _fused_worker(rank, world, init_method, folder, problem, buffers):
    """torch.multiprocessing target: the example's run() of the fused form over the buffers the
    parent made in shared memory, its result saved for the test."""
    sys.path.insert(0, os.path.dirname(EXAMPLE))
    import context_parallel

    torch.set_num_threads(1)
    results = context_parallel.run(rank, world, init_method, backend="gloo", device="cpu", combine="fused",
                                   buffers=buffers, **problem)
    torch.save(results, os.path.join(folder, f"rank{rank}.pt"))


def test_the_fused_form_over_tensors_in_shared_memory(tmp_path):
    """Every rank's O, LSE and signal pad in tensors the parent put in shared memory and handed to the
    processes it starts: each process addresses every rank's buffers, as on one node's GPUs, and
    the parent sees each rank's state where that rank wrote it."""
    import torch.multiprocessing as mp

    world, cp = 2, example()
    buffers = cp.host_buffers(world, PROBLEM["tokens"], PROBLEM["heads"], PROBLEM["head_size"], torch.float32)
    assert all(b.is_shared() for b in buffers)
    init = f"file://{tmp_path / 'rendezvous'}"
    mp.spawn(_fused_worker, args=(world, init, str(tmp_path), PROBLEM, buffers), nprocs=world, join=True)
    results = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(world)]
    check(results, "fused")
    q, k, v = cp.make_problem(**PROBLEM)
    for rank in range(world):
        begin, end = cp.shard_bounds(PROBLEM["keys"], world, rank)
        o, lse = cp.partial_attention(q, k[begin:end], v[begin:end], PROBLEM["head_size"] ** -0.5)
        # the parent computes with threads of its own: another summation order, within float32's rounding
        torch.testing.assert_close(buffers[0][rank], o, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(buffers[1][rank], lse, rtol=1e-5, atol=1e-5)


def _listless_worker(rank, world, init_method, folder, problem):
    """torch.multiprocessing target: the example's run() of every form where gloo has no list
    all_to_all (torch 2.11's refuses it, as here), its result saved for the test."""
    sys.path.insert(0, os.path.dirname(EXAMPLE))
    import context_parallel

    def refused(*args, **kwargs):
        raise RuntimeError("Backend gloo does not support alltoall")

    context_parallel.dist.all_to_all = refused
    torch.set_num_threads(1)
    results = context_parallel.run(rank, world, init_method, backend="gloo", device="cpu", combine="all", **problem)
    torch.save(results, os.path.join(folder, f"rank{rank}.pt"))


def test_the_all_to_all_layouts_where_gloo_has_no_list_form(tmp_path):
    """Where gloo refuses the list all_to_all (older torch), the strided receive layouts take one
    contiguous all_to_all_single and move its chunks into the views: every rank's part is still the
    attention over all the keys, and the all-gather's rows bit for bit."""
    import torch.multiprocessing as mp

    world = 2
    mp.spawn(_listless_worker, args=(world, f"file://{tmp_path / 'rendezvous'}", str(tmp_path), PROBLEM),
             nprocs=world, join=True)
    results = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(world)]
    for label in LABELS:
        if label.startswith("all_to_all"):
            check(results, label)
    for by_label in results:
        everything = by_label["gather"]
        for label in (x for x in LABELS if x.startswith("all_to_all")):
            out, out_lse, (begin, end) = by_label[label]
            assert torch.equal(out, everything[0][:, begin:end]), label
            assert torch.equal(out_lse, everything[1][:, begin:end]), label


def test_the_processes_keep_nvlink_multicast_off(tmp_path, monkeypatch):
    """run() sets NCCL_NVLS_ENABLE=0 and TORCH_SYMM_MEM_DISABLE_MULTICAST=1 where they are unset
    (a one-process group here)."""
    monkeypatch.delenv("NCCL_NVLS_ENABLE", raising=False)
    monkeypatch.delenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", raising=False)
    results = example().run(0, 1, f"file://{tmp_path / 'rendezvous'}", backend="gloo", device="cpu",
                            combine="gather", **dict(PROBLEM, keys=8))
    assert list(results) == ["gather"]
    assert os.environ["NCCL_NVLS_ENABLE"] == "0" and os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"


def test_packed_records_are_two_views_of_one_buffer():
    """pack_records puts a row's O and its LSE in one record (16-byte aligned rows); unpack_records
    gives them back as views of that buffer, which merge_states reads as the two arrays."""
    cp = example()
    g = torch.Generator().manual_seed(3)
    o = torch.randn(5, 3, 2, 64, generator=g).to(torch.bfloat16)
    lse = torch.randn(5, 3, 2, generator=g) * 3
    records = cp.pack_records(o, lse)
    assert records.shape == (5, 3, 2, 72) and records.stride()[-2] * 2 % 16 == 0
    o_view, lse_view = cp.unpack_records(records, 64)
    assert o_view.data_ptr() == records.data_ptr() and lse_view.data_ptr() == records.data_ptr() + 128
    assert torch.equal(o_view, o) and torch.equal(lse_view, lse)
    got, want = attnmerge.merge_states(o_view, lse_view), attnmerge.merge_states(o, lse)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


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


def _functions(code):
    return {node.name: ast.dump(node) for node in ast.parse(code).body if isinstance(node, ast.FunctionDef)}


def test_the_docs_show_the_example_s_recipes():
    """docs/context-parallel.md's recipes are the example's functions as written there: every function
    of a block the docs' tests skip (several processes: the tests above run them), and every one a
    block they run shares with the example."""
    sys.path.insert(0, os.path.join(ROOT, "tests", "docs"))
    from doc_blocks import blocks

    with open(EXAMPLE, encoding="utf-8") as f:
        ours = _functions(f.read())
    shown = [b for b in blocks(os.path.relpath(DOC, ROOT)) if b.language == "python"]
    skipped = [b for b in shown if b.skip_reason]
    assert skipped and all("examples/context_parallel.py" in b.skip_reason for b in skipped)
    for block in shown:
        functions = _functions(block.code)
        assert functions or not block.skip_reason, f"{block.id}: a skipped block that defines no function"
        for name, tree in functions.items():
            if block.skip_reason or name in ours:
                assert ours.get(name) == tree, f"{block.id}: {name} is not examples/context_parallel.py's {name}"
    recipes = {name for b in shown for name in _functions(b.code)} & set(ours)
    assert {"combine_gather", "combine_share", "combine_all_to_all", "pack_records", "ring_attention",
            "combine_fused"} <= recipes, recipes
