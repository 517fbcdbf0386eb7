"""benchmarks/run.py, the one driver of the repository's benchmarks, and what its comparisons with the
peers rest on: every routine's CPU self-check, the float64 check that a result off the formula
fails, the published cases, the driver's refusals, and benchmarks/peers/fetch.py's extraction."""
from __future__ import annotations

import hashlib
import importlib
import json
import pathlib
import subprocess
import sys
import zipfile

import pytest

torch = pytest.importorskip("torch")

ROOT = pathlib.Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"


def run_driver(*args):
    return subprocess.run([sys.executable, str(BENCHMARKS / "run.py"), *args], capture_output=True, text=True,
                          timeout=600, cwd=ROOT)


@pytest.fixture(scope="module")
def routines():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield importlib.import_module("routines")
    finally:
        sys.path.remove(str(BENCHMARKS))


def test_every_routine_runs_its_cases_and_checks_on_cpu_tensors():
    proc = run_driver("--check-cpu")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.splitlines()[-1] == "14 passed, 0 failed"


def test_the_list_names_every_routine():
    proc = run_driver("--list")
    assert proc.returncode == 0, proc.stderr
    assert [line.split()[0] for line in proc.stdout.splitlines()] == [
        "sinks", "bases", "group_fp8", "block_scaled", "share", "layouts", "state_forms", "exchange", "cp_step",
        "live_tokens", "pdl_chain",
        "plain_pairs", "vs_seed", "vs_flashinfer", "bench", "family"]


def test_an_unknown_op_is_refused_by_name():
    proc = run_driver("vs_flashinfer", "--ops", "merge,bogus", "--cases")
    assert proc.returncode == 2
    assert "--ops: bogus is not one of merge,merge_inplace,merge_states,merge_varlen" in proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without a GPU")
def test_a_gpu_routine_without_a_gpu_says_so():
    proc = run_driver("sinks")
    assert proc.returncode == 2
    assert "no CUDA GPU visible to PyTorch" in proc.stderr


def test_the_package_benchmark_is_a_routine(tmp_path):
    out = tmp_path / "bench.json"
    proc = run_driver("bench", "--cpu", "--quick", "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads(out.read_text())["device"] == "cpu"


def test_the_published_flashinfer_cases_are_the_routines(routines):
    """The README's table comes from benchmarks/results/h200-vs-flashinfer.json: the routine runs the
    same cases, with the same bytes and the same input sets."""
    vs = importlib.import_module("routines.vs_flashinfer")
    published = json.loads((BENCHMARKS / "results" / "h200-vs-flashinfer.json").read_text())["rows"]
    args = type("Args", (), dict(calls=100, set_mb=512))
    ours = [(c.label(), c.moved()[0], vs.nsets(args, c.moved()[1])) for c in vs.default_cases()]
    assert ours == [(r["case"], r["bytes"], r["nsets"]) for r in published]


@pytest.mark.parametrize("op", ["merge", "merge_inplace", "merge_states", "merge_varlen"])
def test_a_result_off_the_formula_fails_the_check(routines, op):
    """A merge whose LSEs are read in the wrong base (natural, where FlashInfer's layout is base 2)
    fails the float64 check, and the right one passes it."""
    vs = importlib.import_module("routines.vs_flashinfer")
    case = next(c for c in vs.cpu_cases() if c.op == op)
    right = vs.calls(case, None, False)["attnmerge"]
    s = vs.make_set(case, "cpu")
    assert vs.check(case, {"attnmerge": right}, s)["attnmerge"]["ok"]
    import attnmerge

    wrong = {"merge": lambda v_a, s_a, v_b, s_b, o, lse: attnmerge.merge(v_a, s_a, v_b, s_b, out=o, out_lse=lse),
             "merge_inplace": lambda v, s, vo, so, mask: attnmerge.merge_inplace(v, s, vo, so, mask=mask),
             "merge_states": lambda v, s, o, lse: attnmerge.merge_states(v, s, out=o, out_lse=lse),
             "merge_varlen": lambda v, s, ip, o, lse: attnmerge.merge_varlen(v, s, ip, out=o, out_lse=lse)}[op]
    assert not vs.check(case, {"attnmerge": wrong}, s)["attnmerge"]["ok"]


def test_the_seed_comparison_checks_vllms_layout(routines):
    """vs_seed's check reads the LSEs as vLLM lays them out ([heads, tokens]): attnmerge through
    attnmerge.compat.vllm passes, the same merge given the LSEs as [tokens, heads] views fails."""
    seed = importlib.import_module("routines.vs_seed")
    runner = importlib.import_module("routines.common").Runner(torch, check_cpu=True)
    s = seed.make_sets(runner, 5, 4, 64, torch.float32, 1)[0]
    assert seed.check(seed.ours, s, "float32")["ok"]

    def transposed(out, out_lse, po, pl, so, sl):  # every LSE read along the wrong axis
        import attnmerge

        attnmerge.merge(po, pl.reshape(5, 4), so, sl.reshape(5, 4), out=out, out_lse=out_lse.view(5, 4))

    assert not seed.check(transposed, s, "float32")["ok"]


def synthetic_peer(fetch, tmp_path, name="demo"):
    """A wheel-like archive whose entry header includes one header beside it and one by a path under
    the include root, which includes a system header; plus an unrelated header and the license."""
    files = {
        "pkg/data/include/demo/a/entry.cuh": '#include "beside.cuh"\n#include <demo/b/deep.cuh>\n',
        "pkg/data/include/demo/a/beside.cuh": "#pragma once\n",
        "pkg/data/include/demo/b/deep.cuh": "#include <cuda_runtime.h>\n",
        "pkg/data/include/demo/b/unrelated.cuh": "int unrelated;\n",
        "demo.dist-info/LICENSE": "the license\n",
    }
    archive = tmp_path / f"{name}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(archive, "w") as z:
        for path, text in files.items():
            z.writestr(path, text)
    peer = fetch.Peer(folder=f"{name}-1.0", project=name, version="1.0", filename=archive.name,
                      sha256=hashlib.sha256(archive.read_bytes()).hexdigest(), root="pkg/data",
                      entry="include/demo/a/entry.cuh", include_root="include", license="demo.dist-info/LICENSE")
    return peer, archive


@pytest.fixture
def fetch(routines, tmp_path, monkeypatch):
    module = importlib.import_module("routines.builds").fetch
    monkeypatch.setattr(module, "HERE", str(tmp_path / "peers"))
    (tmp_path / "peers").mkdir()
    return module


def test_fetch_keeps_the_entry_and_what_it_includes(fetch, tmp_path):
    peer, archive = synthetic_peer(fetch, tmp_path)
    assert not fetch.fetched(peer)
    fetch.extract(peer, str(fetch.verified(peer, str(archive))))
    folder = tmp_path / "peers" / peer.folder
    kept = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
    assert kept == [".gitignore", "LICENSE", "SOURCE", "include/demo/a/beside.cuh", "include/demo/a/entry.cuh",
                    "include/demo/b/deep.cuh"]
    assert (folder / ".gitignore").read_text().splitlines()[-1] == "*"
    assert fetch.fetched(peer)


def test_fetch_refuses_an_archive_of_another_checksum(fetch, tmp_path):
    peer, archive = synthetic_peer(fetch, tmp_path)
    with zipfile.ZipFile(archive, "a") as z:
        z.writestr("extra.txt", "changed")
    with pytest.raises(SystemExit, match="has SHA-256"):
        fetch.verified(peer, str(archive))


def test_the_fetched_folders_are_ignored_by_git():
    paths = ["benchmarks/peers/vllm-0.8.5/csrc/attention/merge_attn_states.cu",
             "benchmarks/peers/flashinfer-0.7.2.post1/include/flashinfer/attention/cascade.cuh",
             "benchmarks/peers/build/libam_flashinfer-0.so"]
    proc = subprocess.run(["git", "check-ignore", *paths], capture_output=True, text=True, cwd=ROOT)
    if proc.returncode == 128:
        pytest.skip("not a git checkout")
    assert proc.stdout.split() == paths


def test_cp_step_refuses_an_unknown_form_by_name():
    proc = run_driver("cp_step", "--check-cpu", "--forms", "gather,bogus")
    assert proc.returncode == 2
    assert "--forms: bogus is not one of gather,share,all_to_all,packed,fused,ring" in proc.stderr


@pytest.mark.parametrize("invariant", (False, True), ids=("plain", "batch_invariant"))
@pytest.mark.parametrize("op", ("merge", "merge_inplace", "merge_states", "merge_varlen", "merge_share"))
def test_live_tokens_checks_the_capacity_call_against_the_sized_one(routines, op, invariant):
    """live_tokens' check, on CPU tensors (one kernel whatever the size): the capacity's call
    reading the count holds the sized call's bits in its live rows, and a count one short fails it."""
    live_tokens = importlib.import_module("routines.live_tokens")
    for live in (1, 17, 256):
        count = torch.tensor([live], dtype=torch.int32)
        assert live_tokens.agree(torch, op, *live_tokens.make(torch, op, "cpu"), live, count, invariant)
    short = torch.tensor([16], dtype=torch.int32)
    assert not live_tokens.agree(torch, op, *live_tokens.make(torch, op, "cpu"), 17, short, invariant)
