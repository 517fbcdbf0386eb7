"""Context parallelism in JAX (examples/context_parallel_jax.py): every form inside jax.shard_map on
meshes of 2 and 4 CPU devices (XLA's host platform split in four, in a subprocess: the device count
is fixed when JAX starts).

Each device holds the queries and one shard of the keys; the forms combine the devices' states:
all_gather + merge_states, all_gather of the LSEs + merge_share + psum_scatter over heads,
all_to_all + merge_states with the devices' axis at 0, 1 or 2 of the receive buffer (concat_axis),
plain or as packed records, and the ring (ppermute, merge into a float32 accumulator).  Every
device's part must be the float64 attention over all the keys (float32: relative L2 error < 1e-5,
LSE within 1e-5); the all-to-all's receive buffers hold the all-gather's states, so their rows
are its rows bit for bit.  docs/jax.md shows the example's recipes as written there.
"""
from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import sys

import numpy as np
import pytest

import attnmerge
from oracle import assert_lse_close, rel_l2

pytest.importorskip("jax")
if not attnmerge.build_info()["jax_extension"]:
    pytest.skip("attnmerge was built without the JAX extension (ATTNMERGE_BUILD_JAX=1 builds it)",
                allow_module_level=True)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "context_parallel_jax.py")
DEVICES, WORLDS = 4, (2, 4)
PROBLEM = dict(seed=5, tokens=24, heads=4, head_size=64, keys=1000)  # keys: a multiple of every mesh size


def example():
    spec = importlib.util.spec_from_file_location("context_parallel_jax", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """{(world, label): (out, out_lse)} of the example's run on 2 and 4 devices, and the example."""
    out = tmp_path_factory.mktemp("cp_jax") / "results.npz"
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={DEVICES}", JAX_PLATFORMS="cpu")
    args = [f"--{k.replace('_', '-')}={v}" for k, v in PROBLEM.items()]
    proc = subprocess.run([sys.executable, EXAMPLE, f"--worlds={','.join(map(str, WORLDS))}", f"--save={out}", *args],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    saved = np.load(out)
    found = {}
    for key in saved.files:
        world, name, part = key.split("/")
        found.setdefault((int(world), name), {})[part] = saved[key]
    return {k: (v["out"], v["out_lse"]) for k, v in found.items()}, example()


def labels():
    mod = example()
    return [mod.label(*v) for v in mod.variants()]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("label", labels())
def test_every_form_is_the_attention_over_all_keys(results, world, label):
    got, mod = results
    ref_o, ref_lse = mod.reference_attention(*mod.make_problem(**PROBLEM))
    out, out_lse = got[world, label]
    assert out.shape[0] == world
    for device in range(world):
        begin, end = mod.heads_of(label.split("[")[0], device, world, PROBLEM["heads"])
        err = rel_l2(out[device], ref_o[:, begin:end])
        assert err < 1e-5, f"{label}, device {device}: relative L2 error {err:.3g} of O"
        assert_lse_close(out_lse[device], ref_lse[:, begin:end], f"{label}, device {device} lse")


@pytest.mark.parametrize("world", WORLDS)
def test_the_all_to_all_layouts_merge_the_gathered_rows_bit_for_bit(results, world):
    got, mod = results
    gathered, gathered_lse = got[world, "gather"]
    for label in labels():
        if label.startswith("all_to_all"):
            out, out_lse = got[world, label]
            for device in range(world):
                begin, end = mod.heads_of("all_to_all", device, world, PROBLEM["heads"])
                assert np.array_equal(out[device], gathered[device][:, begin:end]), label
                assert np.array_equal(out_lse[device], gathered_lse[device][:, begin:end]), label


def _functions(code):
    return {node.name: ast.dump(node) for node in ast.parse(code).body if isinstance(node, ast.FunctionDef)}


def test_the_docs_show_the_example_s_recipes():
    """Each function docs/jax.md defines under "Across devices" that the example also defines is the
    example's, as written there (the docs' own test runs them on the devices JAX sees)."""
    sys.path.insert(0, os.path.join(ROOT, "tests", "docs"))
    from doc_blocks import blocks

    with open(EXAMPLE, encoding="utf-8") as f:
        ours = _functions(f.read())
    shown = {}
    for block in blocks("docs/jax.md"):
        if block.language == "python":
            shown.update(_functions(block.code))
    common = sorted(set(shown) & set(ours))
    assert {"combine_all_to_all", "ring_attention", "combine_share"} <= set(common), common
    for name in common:
        assert shown[name] == ours[name], f"docs/jax.md's {name} is not examples/context_parallel_jax.py's"
