"""JAX arrays through the native API (attnmerge.merge, merge_states, merge_varlen, ...): one road,
attnmerge.jax.  JAX arrays are immutable, so attnmerge never writes one: a call whose results would
be allocated like a JAX array is attnmerge.jax's (new JAX arrays, on XLA's buffers and stream), and
a JAX array handed over to be written is refused, naming the argument and pointing to
attnmerge.jax's functional form.  On JAX's CPU device here; interop/test_gpu_arrays.py runs the same calls on
a GPU.  Without the JAX extension, such a call says how to get it."""
from __future__ import annotations

import sys

import numpy as np
import pytest

import attnmerge
from attnmerge import _C
from attnmerge._call import Options
from attnmerge.compat import vllm
from oracle import (
    DTYPES,
    all_nan,
    assert_group_fp8_close,
    assert_merge_matches,
    assert_o_close,
    nan_array,
    random_lse,
    random_stacked,
    random_pair,
    random_state,
    natural,
    rebased,
    reference_merge,
    reference_merge_share,
    reference_merge_stacked,
    reference_merge_varlen,
)

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

needs_extension = pytest.mark.skipif(not attnmerge.build_info()["jax_extension"],
                                     reason="attnmerge was built without the JAX extension (ATTNMERGE_BUILD_JAX=1)")


def put(*xs):
    return [jax.device_put(x, jax.devices("cpu")[0]) for x in xs]


def pair(rng, tokens=37, heads=5, head_size=72, dtype="float32"):
    return random_pair(rng, tokens, heads, head_size, dtype)


def is_jax(x):
    return isinstance(x, jax.Array)


# ---- the road: attnmerge.jax ----------------------------------------------------------------------


@needs_extension
def test_mixed_bases_take_the_road_too(rng):
    o_a, lse_a, o_b, lse_b = pair(rng)
    out, out_lse = attnmerge.merge(*put(o_a, lse_a, o_b, lse_b), base=(2, "e"), out_base="e")
    ref = rebased(reference_merge(o_a, natural(lse_a, 2), o_b, natural(lse_b, "e")), "e")
    assert is_jax(out) and is_jax(out_lse)
    assert_merge_matches(np.asarray(out), np.asarray(out_lse), ref, "float32")
    o, lse = random_stacked(rng, 6, 3, 2, 16)
    for fn, args, ref in [
        (attnmerge.merge_states, put(o, lse), reference_merge_stacked(o, lse)),
        (attnmerge.merge_varlen, put(o[:, 0], lse[:, 0], np.array([0, 2, 6], np.int32)),
         reference_merge_varlen(o[:, 0], lse[:, 0], np.array([0, 2, 6]))),
        (attnmerge.merge_share, [*put(o[:, 1], lse), 1], reference_merge_share(o[:, 1], lse, 1)),
    ]:
        out, out_lse = fn(*args, out_base=2)
        assert_merge_matches(np.asarray(out), np.asarray(out_lse), rebased(ref, 2), "float32")


@needs_extension
@pytest.mark.parametrize("out_dtype", DTYPES)
@pytest.mark.parametrize("in_dtype", DTYPES)
def test_merge_returns_new_jax_arrays(rng, in_dtype, out_dtype):
    h = pair(rng, dtype=in_dtype)
    h[1][3] = np.inf  # an empty part
    out, out_lse = attnmerge.merge(*put(*h), out_dtype=out_dtype)
    assert is_jax(out) and is_jax(out_lse) and out.dtype == jnp.dtype(out_dtype)
    assert_merge_matches(np.asarray(out), np.asarray(out_lse), reference_merge(*h), out_dtype)


@needs_extension
def test_merge_options_on_jax_arrays(rng):
    o_a, lse_a, o_b, lse_b = pair(rng, dtype="float16")
    out, out_lse = attnmerge.merge(*put(o_a, lse_a, o_b, lse_b), base=2)
    assert_merge_matches(np.asarray(out), np.asarray(out_lse), reference_merge(o_a, lse_a, o_b, lse_b, base=2),
                         "float16")
    out, out_lse = attnmerge.merge(*put(o_a[:20], lse_a[:20], o_b, lse_b), a_tokens=20, return_lse=False)
    assert out_lse is None
    assert_o_close(np.asarray(out), reference_merge(o_a[:20], lse_a[:20], o_b, lse_b, a_tokens=20)[0], "float16")
    out, out_lse = attnmerge.merge(*put(*pair(rng, tokens=0)))
    assert out.shape == (0, 5, 72) and out_lse.shape == (0, 5)


@needs_extension
@pytest.mark.parametrize("states_axis", [1, 0])
def test_merge_states_and_merge_varlen_return_new_jax_arrays(rng, states_axis):
    o, lse = random_stacked(rng, 9, 3, 4, 64, "bfloat16", states_axis=states_axis)
    out, out_lse = attnmerge.merge_states(*put(o, lse), states_axis=states_axis, out_dtype="float32")
    assert is_jax(out) and out.dtype == jnp.float32
    ref = reference_merge_stacked(o, lse, states_axis=states_axis)
    assert_merge_matches(np.asarray(out), np.asarray(out_lse), ref, "float32")
    o, lse = random_state(rng, 7, 4, 64)
    indptr = np.array([0, 2, 2, 7], np.int32)
    out, out_lse = attnmerge.merge_varlen(*put(o, lse, indptr))
    assert is_jax(out) and out.shape == (3, 4, 64)
    assert_merge_matches(np.asarray(out), np.asarray(out_lse), reference_merge_varlen(o, lse, indptr), "float32")
    sink = random_state(rng, 1, 4, 1)[1][0]  # float32 [heads]: the sink goes down the same road
    out, out_lse = attnmerge.merge_varlen(*put(o, lse, indptr), sink=put(sink)[0])
    assert is_jax(out)
    assert_merge_matches(np.asarray(out), np.asarray(out_lse), reference_merge_varlen(o, lse, indptr, sink=sink),
                         "float32")
    lse_all = random_lse(rng, (7, 3, 4))  # merge_share: o is state 1 of three
    out, out_lse = attnmerge.merge_share(*put(o, lse_all), 1)
    assert is_jax(out)
    assert_merge_matches(np.asarray(out), np.asarray(out_lse), reference_merge_share(o, lse_all, 1), "float32")


@needs_extension
def test_a_sink_takes_the_road_too(rng):
    h = pair(rng)
    sink = random_lse(rng, (5,))
    out, out_lse = attnmerge.merge(*put(*h, sink)[:4], sink=put(sink)[0])
    assert is_jax(out) and is_jax(out_lse)
    assert_merge_matches(np.asarray(out), np.asarray(out_lse), reference_merge(*h, sink=sink), "float32")


@needs_extension
def test_per_group_fp8_takes_the_road_and_returns_the_scales(rng):
    o, lse = random_stacked(rng, 6, 5, 2, 128, "bfloat16")
    for fn, args, ref in [
        (attnmerge.merge, put(o[:, 0], lse[:, 0], o[:, 1], lse[:, 1]),
         reference_merge(o[:, 0], lse[:, 0], o[:, 1], lse[:, 1])),
        (attnmerge.merge_states, put(o, lse), reference_merge_stacked(o, lse)),
        (attnmerge.merge_varlen, put(o[:, 0], lse[:, 0], np.array([0, 2, 6], np.int32)),
         reference_merge_varlen(o[:, 0], lse[:, 0], np.array([0, 2, 6]))),
        (attnmerge.merge_share, [*put(o[:, 1], lse), 1], reference_merge_share(o[:, 1], lse, 1)),
    ]:
        out, out_lse, scales = fn(*args, group_size=64, scale_ue8m0=True, return_lse=False)
        assert is_jax(out) and is_jax(scales) and out_lse is None and out.dtype == jnp.float8_e4m3fn
        assert_group_fp8_close(np.asarray(out), np.asarray(scales), ref[0], 64, True)


@needs_extension
def test_the_native_functions_trace_under_jit(rng):
    h = pair(rng)
    out, out_lse = jax.jit(lambda *s: attnmerge.merge(*s, base=2))(*put(*h))
    assert_merge_matches(np.asarray(out), np.asarray(out_lse), reference_merge(*h, base=2), "float32")


@needs_extension
def test_a_host_output_with_jax_inputs_is_written_reading_them(rng):
    """The results are allocated like out, not like a JAX array: the direct path, which reads JAX
    arrays through DLPack as any framework's."""
    h = pair(rng)
    out, out_lse = nan_array(h[0].shape), nan_array(h[1].shape)
    res, res_lse = attnmerge.merge(*put(*h), out=out, out_lse=out_lse)
    assert res is out and res_lse is out_lse
    assert_merge_matches(out, out_lse, reference_merge(*h), "float32")


# ---- JAX arrays are never written -----------------------------------------------------------------


@pytest.mark.parametrize("arg", ["out", "out_lse"])
def test_jax_outputs_are_refused_by_name_pointing_to_attnmerge_jax(rng, arg):
    h = pair(rng)
    given = {"out": jnp.zeros(h[0].shape), "out_lse": jnp.zeros(h[1].shape)}
    with pytest.raises(ValueError) as info:
        attnmerge.merge(*h, **{arg: given[arg]})
    msg = str(info.value)
    assert msg.startswith(f"{arg}: expected a writable array, got a JAX array") and "attnmerge.jax.merge" in msg, msg
    with pytest.raises(ValueError, match=f"^{arg}: .*attnmerge.jax.merge_states"):
        attnmerge.merge_states(h[0][:, None], h[1][:, None], **{arg: given[arg]})


@needs_extension
def test_the_jax_road_takes_no_output_and_no_stream(rng):
    d = put(*pair(rng))
    with pytest.raises(ValueError, match=r"^out_lse: expected None, got ndarray: .*attnmerge.jax.merge"):
        attnmerge.merge(*d, out_lse=np.zeros((37, 5), np.float32))
    with pytest.raises(ValueError, match=r"^stream: expected None for JAX arrays"):
        attnmerge.merge(*d, stream=0)
    with pytest.raises(ValueError, match=r"^group_scales: expected None, got ndarray: .*attnmerge.jax.merge"):
        attnmerge.merge(*d, group_size=8, group_scales=np.zeros((37, 5, 9), np.float32))


@pytest.mark.parametrize("arg", ["o", "lse"])
def test_an_in_place_merge_into_jax_arrays_is_refused(rng, arg):
    o, lse, o_other, lse_other = pair(rng)
    target = {"o": o, "lse": lse}
    target[arg] = jnp.asarray(target[arg])
    with pytest.raises(ValueError, match=f"^{arg}: expected a writable array, got a JAX array.*attnmerge.jax.merge"):
        attnmerge.merge_inplace(target["o"], target["lse"], o_other, lse_other)


def test_the_backward_neither_writes_nor_allocates_like_jax_arrays(rng):
    h = pair(rng)
    out, out_lse = attnmerge.merge(*h)
    with pytest.raises(ValueError, match="^o_b: .*got a JAX array.*jax.grad or jax.vjp"):
        attnmerge.merge_backward(out, out_lse, out, out_lse, h[0], h[1], jnp.asarray(h[2]), h[3])
    with pytest.raises(ValueError, match="^grad_o_a: .*got a JAX array"):
        attnmerge.merge_backward(out, out_lse, out, out_lse, *h, grad_o_a=jnp.zeros(h[0].shape))


def test_the_binding_reads_jax_arrays_as_read_only(rng):
    """Whichever layer hands it over, a JAX array is read-only for the C ABI (JAX exports it through
    DLPack with no such flag); the compat layers refuse it before, as the native functions do."""
    o_a, lse_a, o_b, lse_b = pair(rng)
    output = jnp.full(o_a.shape, jnp.nan)
    with pytest.raises(ValueError, match="^output: expected a writable tensor, got a read-only one"):
        _C.merge(output, None, o_a, lse_a.T, o_b, lse_b.T,
                 Options(flags=_C.LSE_HEADS_FIRST, names={"out": "output"}))
    with pytest.raises(ValueError, match="^output: expected a writable array, got a JAX array"):
        vllm.merge_attn_states(output, o_a, lse_a.T, o_b, lse_b.T)
    assert all_nan(np.asarray(output))


# ---- without the extension ------------------------------------------------------------------------


def test_without_the_extension_the_jax_road_says_how_to_get_it(rng, monkeypatch):
    monkeypatch.setattr(attnmerge._build, "XLA_LIB", "/nonexistent/libattnmerge_xla.so")
    monkeypatch.delitem(sys.modules, "attnmerge.jax", raising=False)
    monkeypatch.delattr(attnmerge, "jax", raising=False)
    with pytest.raises(ImportError) as info:
        attnmerge.merge(*put(*pair(rng)))
    msg = str(info.value)
    assert "attnmerge.merge on JAX arrays runs attnmerge.jax" in msg and "ATTNMERGE_BUILD_JAX=1" in msg, msg
