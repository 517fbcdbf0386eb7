"""attnmerge.jax: the merges as XLA FFI custom calls under jax.jit, on the CPU and, on a GPU machine,
on the GPU; checked against the float64 oracle.  Skipped where JAX is not installed or attnmerge
was built without the JAX extension (tests/test_jax_extension.py checks which it should have)."""
from __future__ import annotations

import numpy as np
import pytest

import attnmerge
from oracle import (
    DTYPES,
    assert_merge_matches,
    np_dtype,
    random_lse,
    random_o,
    random_state,
    reference_merge,
    reference_merge_stacked,
)

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

if not attnmerge.build_info()["jax_extension"]:
    pytest.skip("attnmerge was built without the JAX extension (ATTNMERGE_BUILD_JAX=1 builds it)",
                allow_module_level=True)
import attnmerge.jax as amj  # noqa: E402


def devices():
    found = [pytest.param(jax.devices("cpu")[0], id="cpu")]
    try:
        found.append(pytest.param(jax.devices("gpu")[0], id="gpu", marks=pytest.mark.gpu))
    except RuntimeError:
        found.append(pytest.param(None, id="gpu", marks=[pytest.mark.gpu, pytest.mark.skip(reason="JAX sees no GPU")]))
    return found


@pytest.fixture(params=devices())
def dev(request):
    return request.param


def put(x, dev):
    return jax.device_put(x, dev)


@pytest.mark.parametrize("dtype", DTYPES)
def test_merge_under_jit(rng, dev, dtype):
    h = random_state(rng, 37, 5, 72, dtype) + random_state(rng, 37, 5, 72, dtype)
    h[1][3] = np.inf  # an empty part (FlashAttention-2's +inf)
    h[1][4] = h[3][4] = -np.inf  # a row with no parts at all
    out, out_lse = jax.jit(amj.merge)(*[put(x, dev) for x in h])
    assert out.dtype == np_dtype(dtype) and out_lse.dtype == np.float32
    assert_merge_matches(np.asarray(out), np.asarray(out_lse), reference_merge(*h), dtype)


def test_merge_base_2_and_another_output_dtype(rng, dev):
    h = random_state(rng, 16, 4, 64, "bfloat16") + random_state(rng, 16, 4, 64, "bfloat16")
    f = jax.jit(lambda *x: amj.merge(*x, base=2, out_dtype=jnp.float32))
    out, out_lse = f(*[put(x, dev) for x in h])
    assert out.dtype == np.float32
    assert_merge_matches(np.asarray(out), np.asarray(out_lse), reference_merge(*h, base=2), "float32")


@pytest.mark.parametrize("s", [0, 1, 2, 5, 9])
def test_merge_states_under_jit(rng, dev, s):
    o = random_o(rng, (11, s, 3, 40), "float16")
    lse = random_lse(rng, (11, s, 3))
    out, out_lse = jax.jit(amj.merge_states)(put(o, dev), put(lse, dev))
    assert out.shape == (11, 3, 40) and out_lse.shape == (11, 3)
    assert_merge_matches(np.asarray(out), np.asarray(out_lse), reference_merge_stacked(o, lse), "float16")


def test_inside_a_larger_jitted_function_and_under_vmap(rng, dev):
    h = random_state(rng, 8, 2, 32) + random_state(rng, 8, 2, 32)

    @jax.jit
    def f(o_a, lse_a, o_b, lse_b):
        out, out_lse = amj.merge(o_a * 2.0, lse_a, o_b, lse_b + 1.0)
        return out + 1.0, out_lse

    out, out_lse = f(*[put(x, dev) for x in h])
    ref = reference_merge(h[0] * 2.0, h[1], h[2], h[3] + 1.0)
    assert_merge_matches(np.asarray(out) - 1.0, np.asarray(out_lse), ref, "float32")

    batched = [put(np.stack([x, x[::-1]]), dev) for x in h]
    out_b, lse_b = jax.vmap(amj.merge)(*batched)
    for i, flip in enumerate((slice(None), slice(None, None, -1))):
        ref = reference_merge(*[x[flip] for x in h])
        assert_merge_matches(np.asarray(out_b[i]), np.asarray(lse_b[i]), ref, "float32")


def test_a_bad_argument_is_named_when_the_call_runs(rng, dev):
    o, lse = random_state(rng, 5, 3, 16)
    with pytest.raises(Exception, match="lse_b: expected shape"):
        jax.block_until_ready(jax.jit(amj.merge)(put(o, dev), put(lse, dev), put(o, dev), put(lse[:4], dev)))
    with pytest.raises(Exception, match="o_a: expected dtype"):
        jax.block_until_ready(amj.merge(put(o.astype(np.int32), dev), put(lse, dev), put(o, dev), put(lse, dev)))
    with pytest.raises(ValueError, match="base"):
        amj.merge(o, lse, o, lse, base=10)
    with pytest.raises(ValueError, match="^o: expected 4 dimensions"):
        amj.merge_states(o, lse)
