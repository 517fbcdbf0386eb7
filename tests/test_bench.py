"""The benchmark runs end to end and writes its figures: python -m attnmerge bench --cpu, and on a GPU
the sweep, the host overhead of a decode call and the PDL chain."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest


def test_the_cpu_benchmark_writes_its_figures(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "attnmerge", "bench", "--cpu", "--quick", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert result["device"] == "cpu"
    assert sorted({r["tokens"] for r in result["rows"]}) == [1, 64, 2048]
    assert "float32" in {r["dtype"] for r in result["rows"]}
    for r in result["rows"]:
        assert r["GBps"] > 0 and r["np_add_GBps"] > 0 and r["call_us"] > 0
        assert abs(r["ratio_to_np_add"] - r["GBps"] / r["np_add_GBps"]) < 1e-9


def test_the_plot_draws_each_implementation_the_same_size_add_and_the_roofline(tmp_path):
    pytest.importorskip("matplotlib")
    from attnmerge import bench

    rows = [dict(impl=impl, op=op, bytes=nbytes, GBps=gbps, add_us=nbytes / 3e3)
            for impl, gbps in (("attnmerge", 2500.0), ("torch eager", 300.0))
            for op in ("merge", "merge_states") for nbytes in (1e6, 1e8)]
    path = tmp_path / "bench.png"
    labels = bench.plot({"device": "test GPU", "roofline_GBps": 4000.0, "rows": rows}, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(labels) == sorted(["attnmerge, merge", "attnmerge, merge_states", "torch eager, merge",
                                     "torch eager, merge_states", "torch.add moving the same bytes",
                                     "roofline (torch.add)"])


@pytest.mark.gpu
def test_the_gpu_benchmark_writes_its_figures(tmp_path):
    pytest.importorskip("torch")
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "attnmerge", "bench", "--quick", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert result["roofline_GBps"] > 0
    ours = [r for r in result["rows"] if r["impl"] == "attnmerge"]
    assert {r["op"] for r in ours} == {"merge", "merge_states"}
    for r in ours:
        assert r["graph_us"] > 0 and r["eager_us"] > 0 and 0 < r["roof_pct"] < 150 and r["add_us"] > 0
    assert {r["call"].split()[0] for r in result["host"]} >= {"attnmerge.merge", "raw.merge"}
    assert all(r["host_us"] > 0 for r in result["host"])
    assert [r["tokens"] for r in result["pdl"]] == [1, 16, 128]
    assert all(r["plain_us"] > 0 and r["pdl_us"] > 0 for r in result["pdl"])
