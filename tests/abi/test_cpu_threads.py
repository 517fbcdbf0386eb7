"""The CPU path's threads: a pool, started on the first call that needs it and kept, so that a call
wakes threads rather than starting them; the same bits whatever the threads; calls from several
threads at once, and from a child forked after the parent used the pool, all run."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

import c_abi

# 512 x 32 x 128 float32: 6.3 M element accesses, three threads' worth (one per 2^21).
T, H, D = 512, 32, 128
HERE = os.path.dirname(os.path.abspath(__file__))

# Counts the process's pthread_create calls (LD_PRELOAD): std::thread goes through it.
SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
static int count;
int created_threads(void) { return __atomic_load_n(&count, __ATOMIC_SEQ_CST); }
int pthread_create(pthread_t* t, const pthread_attr_t* a, void* (*f)(void*), void* arg) {
  int (*real)(pthread_t*, const pthread_attr_t*, void* (*)(void*), void*) =
      (int (*)(pthread_t*, const pthread_attr_t*, void* (*)(void*), void*))dlsym(RTLD_NEXT, "pthread_create");
  __atomic_add_fetch(&count, 1, __ATOMIC_SEQ_CST);
  return real(t, a, f, arg);
}
"""

CALLS = textwrap.dedent("""
    import ctypes, os, sys
    import numpy as np
    import c_abi
    created = ctypes.CDLL(None).created_threads
    rng = np.random.default_rng(0)
    o_a, o_b = (rng.standard_normal((512, 32, 128)).astype(np.float32) for _ in range(2))
    lse_a, lse_b = (rng.standard_normal((512, 32)).astype(np.float32) for _ in range(2))
    out, out_lse = np.empty_like(o_a), np.empty_like(lse_a)
    t = c_abi.tensor_from
    # A call of one range first: no pool, but the pointers' first look (a GPU machine's driver
    # starts its own threads then) is behind us.
    small = [np.ascontiguousarray(x[:1, :1, ...]) for x in (out, out_lse, o_a, lse_a, o_b, lse_b)]
    assert c_abi.merge(*(t(x) for x in small)) == c_abi.SUCCESS
    counts = [created()]
    for _ in range(10):
        assert c_abi.merge(t(out), t(out_lse), t(o_a), t(lse_a), t(o_b), t(lse_b)) == c_abi.SUCCESS
        counts.append(created())
    print(*counts)
""")


def subprocess_env(**extra):
    """This environment, with tests/ and this folder on the path (c_abi, this module)."""
    path = os.pathsep.join([HERE, os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")])
    return dict(os.environ, PYTHONPATH=path, **extra)


def test_threads_are_started_once_and_kept_not_per_call(tmp_path):
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler on PATH")
    (tmp_path / "shim.c").write_text(SHIM)
    shim = tmp_path / "shim.so"
    subprocess.run([cc, "-shared", "-fPIC", str(tmp_path / "shim.c"), "-o", str(shim), "-ldl"], check=True)
    r = subprocess.run([sys.executable, "-c", CALLS], capture_output=True, text=True, timeout=300,
                       env=subprocess_env(LD_PRELOAD=str(shim), ATTNMERGE_NUM_THREADS="4"))
    assert r.returncode == 0, r.stderr[-2000:]
    counts = [int(x) for x in r.stdout.split()]
    # the first call starts the pool's threads (two beside the caller for its three ranges), the
    # other nine start none
    assert counts[1] - counts[0] == 2 and counts[1:] == [counts[1]] * 10, counts


def states(rng):
    o_a, o_b = (rng.standard_normal((T, H, D)).astype(np.float32) for _ in range(2))
    lse_a, lse_b = (rng.standard_normal((T, H)).astype(np.float32) for _ in range(2))
    return o_a, lse_a, o_b, lse_b


def merged(o_a, lse_a, o_b, lse_b):
    out, out_lse = np.full_like(o_a, np.nan), np.full_like(lse_a, np.nan)
    t = c_abi.tensor_from
    assert c_abi.merge(t(out), t(out_lse), t(o_a), t(lse_a), t(o_b), t(lse_b)) == c_abi.SUCCESS, c_abi.last_error()
    return out, out_lse


ONE_THREAD = textwrap.dedent("""
    import sys
    import numpy as np
    import c_abi
    from test_cpu_threads import merged, states
    out, out_lse = merged(*states(np.random.default_rng(int(sys.argv[1]))))
    sys.stdout.buffer.write(out.tobytes() + out_lse.tobytes())
""")


def one_thread(seed):
    r = subprocess.run([sys.executable, "-c", ONE_THREAD, str(seed)], capture_output=True, timeout=300,
                       env=subprocess_env(ATTNMERGE_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def test_calls_from_several_threads_at_once_give_one_threads_bits():
    """ctypes lets go of the GIL: eight threads' calls meet in the pool at once."""
    seeds = range(8)
    results = {}

    def call(seed):
        results[seed] = b"".join(x.tobytes() for x in merged(*states(np.random.default_rng(seed))))

    threads = [threading.Thread(target=call, args=(s,)) for s in seeds]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for seed in (0, 5):
        assert results[seed] == one_thread(seed), seed


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork()")
def test_a_child_forked_after_the_parent_used_the_threads_merges_too():
    args = states(np.random.default_rng(3))
    expected = merged(*args)
    pid = os.fork()
    if pid == 0:  # the child: a call that needs threads, then out, whatever happens
        code = 1
        try:
            out, out_lse = merged(*args)
            code = 0 if np.array_equal(out, expected[0]) and np.array_equal(out_lse, expected[1]) else 2
        finally:
            os._exit(code)
    for _ in range(600):  # 60 s
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        threading.Event().wait(0.1)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    pytest.fail("the forked child's merge did not finish in 60 s")
