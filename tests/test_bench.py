"""The benchmark's CPU mode runs end to end and writes its figures (python -m attnmerge bench --cpu)."""
from __future__ import annotations

import json
import subprocess
import sys


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
