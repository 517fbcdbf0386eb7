"""ATTNMERGE_NUM_THREADS (the most threads a CPU call takes), read at the first CPU call: a whole
number from 1 to 1024, or unset.  The library never prints, so any other value is never taken
silently: every CPU call fails before it writes anything, with a message that names the variable
and its value (and every layer above passes it on: attnmerge.merge raises it as a ValueError).

It is the one variable the package reads at run time (the library, the binding and the Python
package); the build's (ATTNMERGE_CUDA_ARCHITECTURES, ATTNMERGE_BUILD_JAX, ...) are read by CMake
and the build backend.  A variable read at run time joins CHECKED with a test of its bad values."""
from __future__ import annotations

import glob
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
    import attnmerge

    rng = np.random.default_rng(0)
    # 512 x 32 x 128: three threads' worth of accesses; a backward too
    o_a, o_b = (rng.standard_normal((512, 32, 128)).astype(np.float32) for _ in range(2))
    lse_a, lse_b = (rng.standard_normal((512, 32)).astype(np.float32) for _ in range(2))
    out, out_lse = np.full_like(o_a, np.nan), np.full_like(lse_a, np.nan)
    t = c_abi.tensor_from
    status = c_abi.merge(t(out), t(out_lse), t(o_a), t(lse_a), t(o_b), t(lse_b))
    print(status, c_abi.last_error(), np.isnan(out).all() and np.isnan(out_lse).all(), sep="|")
    grad = np.full_like(o_a, np.nan)
    status = c_abi.merge_backward(None, None, t(grad), None, t(o_a), None, None, t(lse_a), t(o_a), t(lse_a), t(o_b),
                                  t(lse_b))
    print(status, c_abi.last_error(), np.isnan(grad).all(), sep="|")
    try:
        attnmerge.merge(o_a[:1], lse_a[:1], o_b[:1], lse_b[:1])  # a small call, one thread
        print("ValueError|none")
    except ValueError as e:
        print("ValueError", e, sep="|")
""")


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: the environment variables read at run time, each with its bad values' test in this file
CHECKED = {"ATTNMERGE_NUM_THREADS"}


def test_every_variable_read_at_run_time_is_checked_here():
    """Every read of the environment in the run-time sources (getenv, os.environ, os.getenv) names
    a variable of CHECKED, and each is read: a new one needs its bad values tested."""
    sources = [p for d in ("cpp/src", "cpp/include", "python/src", "python/attnmerge")
               for p in glob.glob(os.path.join(ROOT, d, "**", "*"), recursive=True)
               if p.endswith((".cpp", ".h", ".cuh", ".cu", ".py"))]
    if not sources:
        pytest.skip("not run from a source tree")
    read = set()
    for path in sources:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if re.search(r"\bgetenv\b|\benviron\b", line):
                    names = set(re.findall(r"[\"'](\w+)[\"']", line))
                    assert names, f"{path}:{n}: an environment read whose variable is not spelled out: {line.strip()}"
                    read |= names
    assert read == CHECKED, f"read at run time: {sorted(read)}; with tests of their bad values here: {sorted(CHECKED)}"


def run_with(value):
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")]))
    env.pop("ATTNMERGE_NUM_THREADS", None)
    if value is not None:
        env["ATTNMERGE_NUM_THREADS"] = value
    r = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    return [line.split("|") for line in r.stdout.splitlines()]


@pytest.mark.parametrize("value, shown", [
    ("abc", "abc"), ("-3", "-3"), ("0", "0"), ("", ""), (" 4", " 4"), ("4 ", "4 "), ("4x", "4x"), ("+4", "+4"),
    ("1025", "1025"), ("99999999999999999999999", "99999999999999999999999"),
    ("7" * 60, "7" * 40 + "..."),
])
def test_a_bad_value_fails_every_cpu_call_naming_it(value, shown):
    message = (f'ATTNMERGE_NUM_THREADS: expected a whole number from 1 to 1024 (the most threads a CPU call takes), '
               f'or the variable unset, got "{shown}"')
    forward, backward, python = run_with(value)
    assert forward == ["1", message, "True"]  # ATTNMERGE_ERROR_VALUE, nothing written
    assert backward == ["1", message, "True"]
    assert python == ["ValueError", message]


@pytest.mark.parametrize("value", [None, "1", "2", "0016", "1024"])
def test_a_whole_number_from_1_to_1024_or_none_is_taken(value):
    forward, backward, python = run_with(value)
    assert forward == ["0", "", "False"] and backward == ["0", "", "False"] and python == ["ValueError", "none"]
