"""attnmerge.jax across devices: the merges inside jax.shard_map, on a mesh of 4 CPU devices (XLA's
host platform split in four, in a subprocess: the device count is fixed when JAX starts).

A merge's rows are independent, so a call on each device's shard of the tokens is the merge of
the whole (an FFI call under plain jax.jit would have XLA gather its inputs onto every device).
Context parallelism's combine without gathering the outputs: each rank all-gathers the LSEs,
rolls them so that its own state comes first (merge_share's index is static; the roll takes the
traced rank), takes its share and a psum adds the shares: the merge of every rank's state.
Checked against the float64 oracle."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import attnmerge
from oracle import assert_merge_matches, random_lse, random_o, reference_merge_stacked

pytest.importorskip("jax")
if not attnmerge.build_info()["jax_extension"]:
    pytest.skip("attnmerge was built without the JAX extension (ATTNMERGE_BUILD_JAX=1 builds it)",
                allow_module_level=True)

RANKS, T, H, D = 4, 8, 3, 32

_SCRIPT = textwrap.dedent("""
    import sys
    import numpy as np
    import jax, jax.numpy as jnp
    from jax.sharding import Mesh, PartitionSpec as P
    try:
        from jax import shard_map
    except ImportError:  # JAX before 0.7
        from jax.experimental.shard_map import shard_map
    import attnmerge.jax as amj

    data = np.load(sys.argv[1])
    o, lse = data["o"], data["lse"]  # [ranks, tokens, heads, head_size], [ranks, tokens, heads]
    assert len(jax.devices("cpu")) == {ranks}, jax.devices("cpu")
    mesh = Mesh(np.array(jax.devices("cpu")), ("cp",))

    # Tokens sharded: every device merges its shard's rows, states whole.
    by_tokens = jax.jit(shard_map(lambda a, b: amj.merge_states(a, b, states_axis=0), mesh=mesh,
                                  in_specs=(P(None, "cp"), P(None, "cp")), out_specs=(P("cp"), P("cp"))))
    out_t, lse_t = by_tokens(o, lse)

    # Ranks sharded: each holds its own state; LSEs all-gathered, shares summed.
    def combine(o_rank, lse_rank):
        every = jax.lax.all_gather(lse_rank[0], "cp")  # [ranks, tokens, heads]
        own_first = jnp.roll(every, -jax.lax.axis_index("cp"), axis=0)
        share, merged_lse = amj.merge_share(o_rank[0], own_first, 0, states_axis=0)
        return jax.lax.psum(share, "cp")[None], merged_lse[None]

    by_ranks = jax.jit(shard_map(combine, mesh=mesh, in_specs=(P("cp"), P("cp")), out_specs=(P("cp"), P("cp"))))
    out_r, lse_r = by_ranks(o, lse)
    np.savez(sys.argv[2], out_t=out_t, lse_t=lse_t, out_r=out_r, lse_r=lse_r)
""").format(ranks=RANKS)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    rng = np.random.default_rng(7)
    o, lse = random_o(rng, (RANKS, T, H, D)), random_lse(rng, (RANKS, T, H))
    lse[1, 2, 0] = -np.inf  # a rank whose part of a row is empty
    lse[:, 5, 1] = -np.inf  # a row empty on every rank: O = 0, LSE = -inf
    tmp = tmp_path_factory.mktemp("shard_map")
    np.savez(tmp / "in.npz", o=o, lse=lse)
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={RANKS}", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, str(tmp / "in.npz"), str(tmp / "out.npz")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return o, lse, np.load(tmp / "out.npz")


def test_a_merge_of_token_shards_is_the_merge(results):
    o, lse, got = results
    assert_merge_matches(got["out_t"], got["lse_t"], reference_merge_stacked(o, lse, states_axis=0), "float32")


def test_summed_shares_of_rank_sharded_states_are_the_merge(results):
    """Every rank ends with the whole merge (a psum; a psum_scatter would leave each its slice)."""
    o, lse, got = results
    ref = reference_merge_stacked(o, lse, states_axis=0)
    for rank in range(RANKS):
        assert_merge_matches(got["out_r"][rank], got["lse_r"][rank], ref, "float32")
    assert (got["out_r"][:, 5, 1] == 0).all() and (got["lse_r"][:, 5, 1] == -np.inf).all()
