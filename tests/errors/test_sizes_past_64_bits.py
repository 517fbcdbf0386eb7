"""Sizes past 64 bits are refused, naming an argument, in a child process: the library bugs these cases
once hit crashed the process, so a regression fails this test only.  An element count that wraps to
0 mod 2^64 (View::numel() said "empty", every check was skipped, the merge still walked tokens * heads
rows), and a 1-byte tensor spanning exactly 2^63 bytes (the overflow check computed `last + 1` in int64
and wrapped before it multiplied).  Through the C ABI (tests/c_abi.py), the raw layer and the Python
API; the bad-input table (bad_inputs.py) holds the mistakes that cannot crash.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest

_CHILD = textwrap.dedent("""
    import sys
    import numpy as np
    import c_abi
    op = sys.argv[1]
    buf = np.full(1 << 12, np.nan, np.float32)
    lse = np.zeros(4, np.float32)
    idx = np.zeros(4, np.int64)
    B, L, I = buf.ctypes.data, lse.ctypes.data, idx.ctypes.data
    F = c_abi.FLOAT32
    if op == "merge":  # the issue's example: [2^40, 2^20, 128], 2^67 elements
        O = lambda: c_abi.tensor(B, [2**40, 2**20, 128], [2**27, 2**7, 1], F)
        S = lambda: c_abi.tensor(L, [2**40, 2**20], [0, 0], F)
        s = c_abi.merge(O(), None, O(), S(), O(), S())
    elif op == "raw":
        import attnmerge.raw
        try:
            attnmerge.raw.merge(tokens=2**40, heads=2**20, head_size=128, out=(B, "float32", 2**27, 2**7),
                                o_a=(B, "float32", 2**27, 2**7), lse_a=(L, 0, 0), o_b=(B, "float32", 2**27, 2**7),
                                lse_b=(L, 0, 0), device="cpu")
            s = 0
        except ValueError as e:
            print("ValueError", e)
            sys.exit(0)
    elif op == "states":  # o [2^32, 1, 2^16, 2^16]
        out = c_abi.tensor(B, [2**32, 2**16, 2**16], [2**32, 2**16, 1], F)
        o = c_abi.tensor(B, [2**32, 1, 2**16, 2**16], [2**32, 2**32, 2**16, 1], F)
        l = c_abi.tensor(L, [2**32, 1, 2**16], [0, 0, 0], F)
        s = c_abi.merge_states(out, None, o, l)
    elif op in ("mask-c", "mask-python"):  # a uint8 mask [2] with stride 2^63 - 1: 2^63 bytes
        o, l = np.ones((2, 2, 8), np.float32), np.zeros((2, 2), np.float32)
        oo, lo, m = o.copy(), l.copy(), np.ones(2, np.uint8)
        if op == "mask-python":
            import attnmerge
            try:
                attnmerge.merge_inplace(o, l, oo, lo, mask=np.lib.stride_tricks.as_strided(m, (2,), (2**63 - 1,)))
                s = 0
            except ValueError as e:
                print("ValueError", e)
                sys.exit(0)
        else:
            mask = c_abi.tensor(m.ctypes.data, [2], [2**63 - 1], c_abi.UINT8)
            s = c_abi.merge_inplace(*map(c_abi.tensor_from, (o, l, oo, lo)), mask)
    elif op == "varlen":  # out [2^24, 2^24, 2^16]; indptr all zero through a zero stride
        out = c_abi.tensor(B, [2**24, 2**24, 2**16], [2**40, 2**16, 1], F)
        o = c_abi.tensor(B, [2**24, 2**24, 2**16], [2**40, 2**16, 1], F)
        l = c_abi.tensor(L, [2**24, 2**24], [0, 0], F)
        ip = c_abi.tensor(I, [2**24 + 1], [0], c_abi.INT64)
        s = c_abi.merge_varlen(out, None, o, l, ip)
    print("status", s, c_abi.last_error())
    sys.exit(0 if s == c_abi.ERROR_VALUE and c_abi.last_error() else 3)
""")


def _child(op):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(__file__)), os.environ.get("PYTHONPATH", "")]),
               ATTNMERGE_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", _CHILD, op], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, f"child exited with {r.returncode}: {r.stdout[-500:]} {r.stderr[-500:]}"
    assert re.search(r"\b(out|o|mask)\b", r.stdout), f"the message names no argument: {r.stdout!r}"


@pytest.mark.parametrize("op", [
    pytest.param(op) for op in ("merge", "raw", "states", "varlen")])
def test_element_count_wrapping_past_2_64_is_refused(op):
    _child(op)


@pytest.mark.parametrize("op", [
    pytest.param(op) for op in ("mask-c", "mask-python")])
def test_span_of_exactly_2_63_bytes_is_refused(op):
    _child(op)


