"""benchmarks/run.py, the one driver of the repository's benchmarks: every routine's CPU self-check,
the routines it lists and the driver's refusals."""
from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

ROOT = pathlib.Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"


def run_driver(*args):
    return subprocess.run([sys.executable, str(BENCHMARKS / "run.py"), *args], capture_output=True, text=True,
                          timeout=600, cwd=ROOT)


def test_every_routine_runs_its_cases_and_checks_on_cpu_tensors():
    proc = run_driver("--check-cpu")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.splitlines()[-1] == "5 passed, 0 failed"


def test_the_list_names_every_routine():
    proc = run_driver("--list")
    assert proc.returncode == 0, proc.stderr
    assert [line.split()[0] for line in proc.stdout.splitlines()] == [
        "sinks", "bases", "group_fp8", "share", "plain_pairs", "bench", "family"]


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
