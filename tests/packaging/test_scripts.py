"""The repository's shell scripts parse: the GPU machine has no one to fix a syntax error in
scripts/gpu-test.sh before a lent device's time is spent, so CI reads every script first."""
import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPTS = sorted([*ROOT.glob("scripts/*.sh"), ROOT / ".ci" / "run"])


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_script_parses(script):
    done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_every_script_is_found():
    assert {p.name for p in SCRIPTS} >= {"gpu-test.sh", "sanitize.sh", "gpu-truth.sh", "build-cu12.sh", "run"}
