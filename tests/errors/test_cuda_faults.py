"""Faults that are not ours: after another kernel faults, the CUDA context is broken for the rest of
the process (a "sticky" error).  attnmerge then reports that CUDA error by name, as an earlier
error, and never as a bad argument.  Each case runs in a child process, whose context it breaks.
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.gpu

CHILD = textwrap.dedent(
    """
    import json, torch, attnmerge
    o = torch.randn(4, 2, 8, device="cuda")
    lse = torch.randn(4, 2, device="cuda")
    out = torch.empty_like(o)
    attnmerge.merge(o, lse, o, lse, out=out)  # fine before the fault
    torch.cuda.synchronize()
    x = torch.zeros(1, device="cuda")
    try:
        x[torch.tensor([5], device="cuda")] += 1  # an out-of-bounds index: a device-side assert
        torch.cuda.synchronize()
        print(json.dumps({"fault": None}))
        raise SystemExit(0)
    except RuntimeError as e:
        fault = str(e).splitlines()[0]
    try:
        attnmerge.merge(o, lse, o, lse, out=out)
        torch.cuda.synchronize()
        result = {"fault": fault, "type": None, "message": ""}
    except Exception as e:
        result = {"fault": fault, "type": type(e).__name__, "message": str(e)}
    print(json.dumps(result))
    """
)


def test_a_fault_elsewhere_is_reported_as_the_cuda_error_it_is():
    pytest.importorskip("torch")
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, f"child printed no result (rc {proc.returncode}): {proc.stderr[-2000:]}"
    result = json.loads(lines[-1])
    if result["fault"] is None:
        pytest.skip("this torch build did not fault on an out-of-bounds index")
    assert result["type"] == "RuntimeError", result
    assert "cudaErrorAssert" in result["message"], result
    assert "earlier" in result["message"], result
