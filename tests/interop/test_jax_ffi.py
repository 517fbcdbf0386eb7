"""attnmerge.jax: the merges as XLA FFI custom calls under jax.jit and jax.vmap, on the CPU and, on a
GPU machine, on the GPU; checked against the float64 oracle.  Skipped where JAX is not installed or
attnmerge was built without the JAX extension (tests/packaging/test_jax_extension.py checks which it should
have)."""
from __future__ import annotations

import functools

import numpy as np
import pytest

import attnmerge
from oracle import (
    DTYPES,
    assert_merge_matches,
    np_dtype,
    random_lse,
    random_o,
    random_stacked,
    assert_fp8_close,
    assert_block_close,
    assert_group_fp8_close,
    assert_lse_close,
    natural,
    random_state,
    rebased,
    reference_merge,
    reference_merge_share,
    reference_merge_stacked,
    reference_merge_states_backward,
    reference_merge_varlen,
    sink_state,
    stats_lse,
    valid_lse,
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


def ffi_calls(f, *args):
    """The attnmerge custom calls in f's jaxpr, and whether it loops (a sequential vmap)."""
    text = str(jax.make_jaxpr(f)(*args))
    return text.count("attnmerge_"), "while[" in text or "scan[" in text


def test_options_are_static_inside_a_jitted_function_and_refused_when_traced(rng, dev):
    h = [put(x, dev) for x in random_state(rng, 6, 2, 32, "bfloat16") + random_state(rng, 6, 2, 32, "bfloat16")]
    f = jax.jit(functools.partial(amj.merge, base=2, out_dtype=jnp.float32))
    out, out_lse = f(*h)
    assert out.dtype == np.float32
    assert_merge_matches(np.asarray(out), np.asarray(out_lse), reference_merge(*map(np.asarray, h), base=2), "float32")
    with pytest.raises(TypeError, match="^base: expected a Python value"):
        jax.jit(amj.merge)(*h, base=2)
    with pytest.raises(TypeError, match="^a_tokens: expected a Python value"):
        jax.jit(amj.merge)(*h, a_tokens=3)


@pytest.mark.parametrize("in_axes", [(0, 0, 0, 0), (0, 0, None, None)])
def test_vmap_of_merge_is_one_call_over_the_batch(rng, dev, in_axes):
    batch = 3
    h = random_state(rng, 5, 4, 24) + random_state(rng, 5, 4, 24)
    args = [np.stack([x * (i + 1) if x.ndim == 3 else x - i for i in range(batch)]) if ax == 0 else x
            for x, ax in zip(h, in_axes)]
    f = jax.vmap(amj.merge, in_axes=in_axes)
    assert ffi_calls(f, *args) == (1, False)
    out, out_lse = f(*[put(x, dev) for x in args])
    for i in range(batch):
        one = [x[i] if ax == 0 else x for x, ax in zip(args, in_axes)]
        assert_merge_matches(np.asarray(out[i]), np.asarray(out_lse[i]), reference_merge(*one), "float32")


def test_vmap_of_merge_states_is_one_call_and_of_varlen_a_loop(rng, dev):
    o, lse = random_o(rng, (2, 7, 3, 2, 16), "float16"), random_lse(rng, (2, 7, 3, 2))
    f = jax.vmap(amj.merge_states)
    assert ffi_calls(f, o, lse) == (1, False)
    out, out_lse = f(put(o, dev), put(lse, dev))
    for i in range(2):
        assert_merge_matches(np.asarray(out[i]), np.asarray(out_lse[i]), reference_merge_stacked(o[i], lse[i]),
                             "float16")
    ov, lv = random_o(rng, (2, 9, 2, 16)), random_lse(rng, (2, 9, 2))
    indptr = np.array([[0, 3, 3, 9], [0, 1, 5, 9]], dtype=np.int32)
    g = jax.vmap(amj.merge_varlen)
    assert ffi_calls(g, ov, lv, indptr)[1]  # per-example indptr: once per element
    out, out_lse = g(put(ov, dev), put(lv, dev), put(indptr, dev))
    for i in range(2):
        ref = reference_merge_varlen(ov[i], lv[i], indptr[i])
        assert_merge_matches(np.asarray(out[i]), np.asarray(out_lse[i]), ref, "float32")


@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
def test_merge_varlen_under_jit(rng, dev, index_dtype):
    counts = np.array([0, 1, 4, 0, 9, 2])
    indptr = np.concatenate([[0], np.cumsum(counts)]).astype(index_dtype)
    o, lse = random_o(rng, (int(indptr[-1]), 3, 40), "bfloat16"), random_lse(rng, (int(indptr[-1]), 3))
    lse[5] = -np.inf  # an empty part inside a row
    out, out_lse = jax.jit(functools.partial(amj.merge_varlen, out_dtype=jnp.float32))(
        put(o, dev), put(lse, dev), put(indptr, dev))
    assert out.shape == (6, 3, 40) and out.dtype == np.float32
    assert_merge_matches(np.asarray(out), np.asarray(out_lse), reference_merge_varlen(o, lse, indptr), "float32")


def test_merge_with_a_tokens(rng, dev):
    o_b, lse_b = random_state(rng, 9, 2, 32)
    o_a, lse_a = random_state(rng, 4, 2, 32)  # a has only its first 4 tokens
    out, out_lse = jax.jit(functools.partial(amj.merge, a_tokens=4))(*[put(x, dev) for x in (o_a, lse_a, o_b, lse_b)])
    ref = reference_merge(o_a, lse_a, o_b, lse_b, a_tokens=4)
    assert_merge_matches(np.asarray(out), np.asarray(out_lse), ref, "float32")


@pytest.mark.parametrize("scale", [0.25, "array"])
def test_fp8_outputs_with_an_output_scale(rng, dev, scale):
    h = random_state(rng, 7, 3, 32) + random_state(rng, 7, 3, 32)
    value = 0.25
    arg = put(np.array([value], dtype=np.float32), dev) if scale == "array" else value
    f = jax.jit(lambda *x: amj.merge(*x, out_dtype=jnp.float8_e4m3fn, output_scale=arg))
    out, out_lse = f(*[put(x, dev) for x in h])
    ref_o, ref_lse = reference_merge(*h)
    assert_fp8_close(np.asarray(out), ref_o, value)
    assert_lse_close(np.asarray(out_lse), ref_lse)
    o, lse = random_o(rng, (7, 5, 3, 32)), random_lse(rng, (7, 5, 3))
    out, _ = amj.merge_states(put(o, dev), put(lse, dev), out_dtype=jnp.float8_e4m3fn, output_scale=arg)
    assert_fp8_close(np.asarray(out), reference_merge_stacked(o, lse)[0], value)


# per-group FP8 (group_size=, scale_ue8m0=: the group scales a third result)


def _grouped(op, rng, dev, **kwargs):
    """`op`'s call under jit with `kwargs` on random bfloat16 states with an empty and a NaN row, and
    the float64 reference of its O."""
    o, lse = random_o(rng, (9, 6, 3, 128), "bfloat16"), random_lse(rng, (9, 6, 3))
    lse[2, :, 1] = -np.inf
    lse[4, 1, 0] = np.nan
    if op == "merge":
        args, ref = (o[:, 0], lse[:, 0], o[:, 1], lse[:, 1]), reference_merge(o[:, 0], lse[:, 0], o[:, 1], lse[:, 1])
    elif op == "merge_states":
        args, ref = (o, lse), reference_merge_stacked(o, lse)
    elif op == "merge_varlen":
        indptr = np.array([0, 4, 4, 9], np.int32)
        args, ref = (o[:, 0], lse[:, 0], indptr), reference_merge_varlen(o[:, 0], lse[:, 0], indptr)
    else:
        args, ref = (o[:, 4], lse), reference_merge_share(o[:, 4], lse, 4)
        kwargs["index"] = 4
    f = jax.jit(functools.partial(getattr(amj, op), **kwargs))
    return f(*[put(x, dev) for x in args]), ref[0]


@pytest.mark.parametrize("ue8m0", [False, True], ids=["float", "ue8m0"])
@pytest.mark.parametrize("op", ["merge", "merge_states", "merge_varlen", "merge_share"])
def test_per_group_fp8_under_jit(rng, dev, op, ue8m0):
    (out, out_lse, scales), ref = _grouped(op, rng, dev, group_size=32, scale_ue8m0=ue8m0)
    assert out.dtype == jnp.float8_e4m3fn and scales.dtype == np.float32
    assert scales.shape == out.shape[:2] + (4,)
    assert_group_fp8_close(np.asarray(out), np.asarray(scales), ref, 32, ue8m0)
    assert out_lse.dtype == np.float32 and out_lse.shape == out.shape[:2]


@pytest.mark.parametrize("layout", ["row_major", "swizzled"])
@pytest.mark.parametrize("fmt, rounding", [("mxfp8", "floor"), ("mxfp8", "rceil"), ("nvfp4", "floor")])
@pytest.mark.parametrize("op", ["merge", "merge_states", "merge_varlen", "merge_share"])
def test_block_scaled_outputs_under_jit(rng, dev, op, fmt, rounding, layout):
    """The scales a third result in their layout; the bytes attnmerge's native call gives."""
    kwargs = dict(block_format=fmt, scale_rounding=rounding, scale_layout=layout)
    (out, out_lse, scales), ref = _grouped(op, rng, dev, **kwargs)
    assert out.dtype == (jnp.uint8 if fmt == "nvfp4" else jnp.float8_e4m3fn)
    assert out.shape[-1] == (64 if fmt == "nvfp4" else 128)
    assert_block_close(fmt, rounding, None, np.asarray(out), np.asarray(scales), ref, layout)
    with pytest.raises(NotImplementedError, match="block-scaled"):
        jax.grad(lambda a, b: amj.merge_states(a, b, **kwargs)[1].sum())(
            *[put(x, dev) for x in (random_o(rng, (2, 3, 1, 32)), random_lse(rng, (2, 3, 1)))])


def test_per_group_fp8_under_vmap_is_one_call_and_has_no_gradient(rng, dev):
    o, lse = random_o(rng, (2, 5, 4, 3, 64), "float16"), random_lse(rng, (2, 5, 4, 3))
    f = jax.vmap(functools.partial(amj.merge_states, group_size=16))
    assert ffi_calls(f, o, lse) == (1, False)
    out, _, scales = f(put(o, dev), put(lse, dev))
    assert scales.shape == (2, 5, 3, 4)
    for i in range(2):
        assert_group_fp8_close(np.asarray(out[i]), np.asarray(scales[i]), reference_merge_stacked(o[i], lse[i])[0],
                               16)
    loss = lambda a, b: amj.merge_states(a, b, group_size=16)[1].sum()  # noqa: E731
    with pytest.raises(NotImplementedError, match="attnmerge.jax.merge_states: no gradient .* group scales"):
        jax.grad(loss)(put(o[0], dev), put(lse[0], dev))


def test_bad_group_arguments_are_named(rng, dev):
    h = [put(x, dev) for x in random_state(rng, 4, 2, 64) + random_state(rng, 4, 2, 64)]
    with pytest.raises(Exception, match=r"group_size: expected a divisor of head_size \(64\), got 128"):
        jax.block_until_ready(amj.merge(*h, group_size=128))
    with pytest.raises(Exception, match=r"out: expected dtype float8_e4m3 for per-group scales"):
        jax.block_until_ready(amj.merge(*h, group_size=16, out_dtype=jnp.bfloat16))
    with pytest.raises(Exception, match=r"output_scale: expected none with group_scales"):
        jax.block_until_ready(amj.merge(*h, group_size=16, output_scale=0.5))
    with pytest.raises(ValueError, match=r"^scale_ue8m0: expected False without group_size"):
        amj.merge(*h, scale_ue8m0=True)
    with pytest.raises(TypeError, match=r"^group_size: expected a Python value"):
        jax.jit(lambda g, *x: amj.merge(*x, group_size=g))(16, *h)


def test_the_all_gather_layout(rng, dev):
    o, lse = random_o(rng, (4, 6, 2, 16)), random_lse(rng, (4, 6, 2))  # [S, tokens, ...]
    out, out_lse = amj.merge_states(put(o, dev), put(lse, dev), states_axis=0)
    ref = reference_merge_stacked(o, lse, states_axis=0)
    assert_merge_matches(np.asarray(out), np.asarray(out_lse), ref, "float32")


def test_shapes_are_checked_when_traced(rng):
    o, lse = random_state(rng, 5, 3, 16)
    spec = jax.ShapeDtypeStruct
    cases = [
        (amj.merge, (o, lse, o, lse[:4]), "^lse_b: expected shape \\[5, 3\\]"),
        (amj.merge, (o[:, :2], lse, o, lse), "^o_a: expected shape \\[5 or more, 3, 16\\]"),
        (amj.merge, (o, lse, o[0], lse), "^o_b: expected 3 dimensions"),
        (amj.merge_states, (o[:, None], lse[:, :1]), "^lse: expected shape \\[5, 1, 3\\]"),
        (amj.merge_varlen, (o, lse, np.zeros((2, 2), np.int32)), "^indptr: expected 1 dimensions"),
    ]
    for f, args, message in cases:
        with pytest.raises(ValueError, match=message):
            jax.eval_shape(f, *[spec(np.shape(x), x.dtype) for x in args])


# --------------------------------------------------------------------------------------------------
# gradients (custom_vjp over the fused backward)


def _cotangents(rng, out, out_lse):
    return (jnp.asarray(rng.standard_normal(out.shape).astype(np.float32)).astype(out.dtype),
            jnp.asarray(rng.standard_normal(out_lse.shape).astype(np.float32)))


@pytest.mark.parametrize("base", ["e", 2])
def test_merge_states_gradients_are_the_oracles(rng, dev, base):
    o, lse = random_o(rng, (6, 5, 3, 24)), random_lse(rng, (6, 5, 3))
    lse[1, 2] = -np.inf  # an empty part: zero gradients
    f = jax.jit(functools.partial(amj.merge_states, base=base))
    (out, out_lse), vjp = jax.vjp(f, put(o, dev), put(lse, dev))
    g_out, g_lse = _cotangents(rng, out, out_lse)
    grad_o, grad_lse = vjp((g_out, g_lse))
    ref = reference_merge_states_backward(np.swapaxes(o, 0, 1), np.swapaxes(lse, 0, 1), np.asarray(out),
                                          np.asarray(out_lse), np.asarray(g_out), np.asarray(g_lse), base=base)
    assert_merge_matches(np.asarray(grad_o), np.asarray(grad_lse),
                         (np.swapaxes(ref[0], 0, 1), np.swapaxes(ref[1], 0, 1)), "float32", "grad")
    assert np.all(np.asarray(grad_o)[1, 2] == 0) and np.all(np.asarray(grad_lse)[1, 2] == 0)


def _ln(base):
    return np.log(2.0) if base == 2 else 1.0


@pytest.mark.parametrize("a,b,out_base", [("e", 2, "e"), (2, "e", 2), ("e", "e", 2)])
def test_mixed_bases_under_jit_and_their_gradients(rng, dev, a, b, out_base):
    """Each state in its own base, the merged LSE in out_base: the oracle's merge of the natural
    LSEs, and its natural gradients by the chain rule (dlse_i = ln(b_i) dlambda_i, dLAMBDA = dLSE /
    ln(b_out))."""
    o_a, lse_a = random_state(rng, 6, 2, 24)
    o_b, lse_b = random_state(rng, 6, 2, 24)
    lse_b[2, 1] = -np.inf  # an empty part: zero gradients
    f = jax.jit(functools.partial(amj.merge, base=(a, b), out_base=out_base))
    (out, out_lse), vjp = jax.vjp(f, *[put(x, dev) for x in (o_a, lse_a, o_b, lse_b)])
    ref = rebased(reference_merge(o_a, natural(lse_a, a), o_b, natural(lse_b, b)), out_base)
    assert_merge_matches(np.asarray(out), np.asarray(out_lse), ref, "float32")
    g_out, g_lse = _cotangents(rng, out, out_lse)
    grads = vjp((g_out, g_lse))
    ref = reference_merge_states_backward(np.stack([o_a, o_b]), np.stack([natural(lse_a, a), natural(lse_b, b)]),
                                          np.asarray(out), natural(np.asarray(out_lse), out_base), np.asarray(g_out),
                                          np.asarray(g_lse) / _ln(out_base), base="e")
    assert_merge_matches(np.asarray(grads[0]), np.asarray(grads[1]), (ref[0][0], ref[1][0] * _ln(a)), "float32", "grad")
    assert_merge_matches(np.asarray(grads[2]), np.asarray(grads[3]), (ref[0][1], ref[1][1] * _ln(b)), "float32", "grad")
    assert np.all(np.asarray(grads[3])[2, 1] == 0)


@pytest.mark.parametrize("op", ["merge_states", "merge_varlen", "merge_share"])
def test_the_merged_lse_in_its_own_base_under_jit(rng, dev, op):
    o, lse = random_o(rng, (5, 3, 2, 16)), random_lse(rng, (5, 3, 2))
    sink = random_lse(rng, (2,))
    if op == "merge_states":
        f = lambda ob: amj.merge_states(put(o, dev), put(lse, dev), sink=put(sink, dev), out_base=ob)  # noqa: E731
        ref = reference_merge_stacked(o, lse, sink=sink)
    elif op == "merge_varlen":
        indptr = np.array([0, 2, 5], np.int32)
        f = lambda ob: amj.merge_varlen(put(o[:, 0], dev), put(lse[:, 0], dev), put(indptr, dev),  # noqa: E731
                                        sink=put(sink, dev), out_base=ob)
        ref = reference_merge_varlen(o[:, 0], lse[:, 0], indptr, sink=sink)
    else:
        f = lambda ob: amj.merge_share(put(o[:, 1], dev), put(lse, dev), 1, sink=put(sink, dev), out_base=ob)  # noqa: E731
        ref = reference_merge_share(o[:, 1], lse, 1, sink=sink)
    out, out_lse = jax.jit(f, static_argnums=0)(2)
    assert_merge_matches(np.asarray(out), np.asarray(out_lse), rebased(ref, 2), "float32")


@pytest.mark.parametrize("a_tokens", [None, 3])
def test_merge_gradients_with_and_without_a_tokens(rng, dev, a_tokens):
    o_b, lse_b = random_state(rng, 7, 2, 16)
    o_a, lse_a = random_state(rng, 7 if a_tokens is None else 5, 2, 16)  # a longer than a_tokens
    f = jax.jit(functools.partial(amj.merge, a_tokens=a_tokens))
    args = [put(x, dev) for x in (o_a, lse_a, o_b, lse_b)]
    (out, out_lse), vjp = jax.vjp(f, *args)
    g = _cotangents(rng, out, out_lse)
    grads = vjp(g)
    k = 7 if a_tokens is None else a_tokens
    la = np.full((7, 2), -np.inf, np.float32)
    oa = np.zeros((7, 2, 16), np.float32)
    la[:k], oa[:k] = lse_a[:k], o_a[:k]
    ref_o, ref_l = reference_merge_states_backward(np.stack([oa, o_b]), np.stack([la, lse_b]), np.asarray(out),
                                                   np.asarray(out_lse), np.asarray(g[0]), np.asarray(g[1]))
    assert grads[0].shape == o_a.shape and np.all(np.asarray(grads[0])[k:] == 0)
    assert_merge_matches(np.asarray(grads[0])[:k], np.asarray(grads[1])[:k], (ref_o[0][:k], ref_l[0][:k]), "float32")
    assert_merge_matches(np.asarray(grads[2]), np.asarray(grads[3]), (ref_o[1], ref_l[1]), "float32")


def test_merge_varlen_gradients_and_check_grads(rng, dev):
    indptr = np.array([0, 2, 2, 6], dtype=np.int32)
    o, lse = random_o(rng, (6, 2, 8)), random_lse(rng, (6, 2))
    (out, out_lse), vjp = jax.vjp(lambda a, b: amj.merge_varlen(a, b, put(indptr, dev)), put(o, dev), put(lse, dev))
    g = _cotangents(rng, out, out_lse)
    grad_o, grad_lse = vjp(g)
    for r in (0, 2):
        lo, hi = indptr[r], indptr[r + 1]
        ref = reference_merge_states_backward(o[lo:hi, None], lse[lo:hi, None], np.asarray(out)[r:r + 1],
                                              np.asarray(out_lse)[r:r + 1], np.asarray(g[0])[r:r + 1],
                                              np.asarray(g[1])[r:r + 1])
        assert_merge_matches(np.asarray(grad_o)[lo:hi], np.asarray(grad_lse)[lo:hi], (ref[0][:, 0], ref[1][:, 0]),
                             "float32", "grad")
    from jax.test_util import check_grads

    # float32 (the library takes no float64): a large step, loose tolerances
    check_grads(lambda a, b: amj.merge_varlen(a, b, indptr[[0, 1, 3]]), (put(o, dev), put(lse, dev)), order=1,
                modes=["rev"], eps=1e-2, atol=2e-2, rtol=2e-2)
    stacked = (put(o[:3, None].repeat(2, 1), dev), put(lse[:3, None].repeat(2, 1), dev))
    check_grads(lambda a, b: amj.merge_states(a, b), stacked, order=1, modes=["rev"], eps=1e-2, atol=2e-2, rtol=2e-2)


def test_gradients_under_vmap_and_none_through_fp8(rng, dev):
    o, lse = random_o(rng, (3, 4, 5, 2, 8)), random_lse(rng, (3, 4, 5, 2))
    loss = lambda a, b: sum(x.sum() for x in amj.merge_states(a, b))  # noqa: E731
    batched = jax.vmap(jax.grad(loss, argnums=(0, 1)))(put(o, dev), put(lse, dev))
    for i in range(3):
        one = jax.grad(loss, argnums=(0, 1))(put(o[i], dev), put(lse[i], dev))
        for b, s in zip(batched, one):
            np.testing.assert_allclose(np.asarray(b[i]), np.asarray(s), rtol=1e-6, atol=1e-7)
    fp8 = lambda a, b: amj.merge_states(a, b, out_dtype=jnp.float8_e4m3fn)[1].sum()  # noqa: E731
    with pytest.raises(NotImplementedError, match="attnmerge.jax.merge_states: no gradient through an FP8"):
        jax.grad(fp8)(put(o[0], dev), put(lse[0], dev))


# attention sinks (merge_states and merge_varlen: a float32 [heads] operand, differentiable)


@pytest.mark.parametrize("base", ["e", 2])
def test_a_sink_under_jit_and_its_gradient(rng, dev, base):
    o, lse, sink = random_o(rng, (6, 5, 3, 24)), random_lse(rng, (6, 5, 3)), random_lse(rng, (3,))
    sink[1] = -np.inf  # no sink: zero gradient
    f = jax.jit(functools.partial(amj.merge_states, base=base))
    (out, out_lse), vjp = jax.vjp(lambda a, b, c: f(a, b, sink=c), put(o, dev), put(lse, dev), put(sink, dev))
    assert_merge_matches(np.asarray(out), np.asarray(out_lse), reference_merge_stacked(o, lse, base=base, sink=sink),
                         "float32")
    g_out, g_lse = _cotangents(rng, out, out_lse)
    grad_o, grad_lse, grad_sink = vjp((g_out, g_lse))
    so, sl = sink_state(sink, 6, 24)  # the sink as the formula reads it: a state of O = 0
    ref_o, ref_l = reference_merge_states_backward(np.concatenate([np.swapaxes(o, 0, 1), so[None]]),
                                                   np.concatenate([np.swapaxes(lse, 0, 1), sl[None]]), np.asarray(out),
                                                   np.asarray(out_lse), np.asarray(g_out), np.asarray(g_lse), base=base)
    assert_merge_matches(np.asarray(grad_o), np.asarray(grad_lse),
                         (np.swapaxes(ref_o[:-1], 0, 1), np.swapaxes(ref_l[:-1], 0, 1)), "float32", "grad")
    np.testing.assert_allclose(np.asarray(grad_sink), ref_l[-1].sum(axis=0), rtol=2e-5, atol=1e-6)
    assert np.asarray(grad_sink)[1] == 0


@pytest.mark.parametrize("a_tokens", [None, 3])
def test_a_sink_in_merge_under_jit_vmap_and_its_gradient(rng, dev, a_tokens):
    h = random_state(rng, 6, 3, 16) + random_state(rng, 6, 3, 16)
    sink = random_lse(rng, (3,))
    f = jax.jit(functools.partial(amj.merge, a_tokens=a_tokens))
    out, out_lse = f(*[put(x, dev) for x in h], sink=put(sink, dev))
    assert_merge_matches(np.asarray(out), np.asarray(out_lse), reference_merge(*h, a_tokens=a_tokens, sink=sink),
                         "float32")
    sinks = np.stack([sink, sink - 2.0])  # one sink per batch element: a loop
    batched = jax.vmap(lambda s: amj.merge(*[put(x, dev) for x in h], sink=s))(sinks)
    for i in range(2):
        assert_merge_matches(np.asarray(batched[0][i]), np.asarray(batched[1][i]),
                             reference_merge(*h, sink=sinks[i]), "float32")
    from jax.test_util import check_grads

    check_grads(lambda a, b, c, d, s: amj.merge(a, b, c, d, sink=s, a_tokens=a_tokens),
                tuple(put(x, dev) for x in (*h, sink)), order=1, modes=["rev"], eps=1e-2, atol=2e-2, rtol=2e-2)


def test_a_sink_in_merge_varlen_under_vmap_and_check_grads(rng, dev):
    indptr = np.array([0, 2, 2, 6], dtype=np.int32)  # the middle row: the sink alone
    o, lse, sink = random_o(rng, (6, 2, 8)), random_lse(rng, (6, 2)), random_lse(rng, (2,))
    out, out_lse = jax.jit(amj.merge_varlen)(put(o, dev), put(lse, dev), put(indptr, dev), sink=put(sink, dev))
    assert_merge_matches(np.asarray(out), np.asarray(out_lse), reference_merge_varlen(o, lse, indptr, sink=sink),
                         "float32")
    sinks = np.stack([sink, sink + 1.0])  # one sink per batch element
    batched = jax.vmap(lambda s: amj.merge_states(put(o[:4, None].repeat(3, 1), dev), put(lse[:4, None].repeat(3, 1),
                                                                                           dev), sink=s))(sinks)
    for i in range(2):
        ref = reference_merge_stacked(o[:4, None].repeat(3, 1), lse[:4, None].repeat(3, 1), sink=sinks[i])
        assert_merge_matches(np.asarray(batched[0][i]), np.asarray(batched[1][i]), ref, "float32")
    from jax.test_util import check_grads

    check_grads(lambda a, b, c: amj.merge_varlen(a, b, indptr, sink=c), (put(o, dev), put(lse, dev), put(sink, dev)),
                order=1, modes=["rev"], eps=1e-2, atol=2e-2, rtol=2e-2)


def test_a_sink_of_another_shape_is_refused_when_traced(rng):
    o, lse = random_o(rng, (2, 3, 4, 8)), random_lse(rng, (2, 3, 4))
    with pytest.raises(ValueError, match=r"sink: expected shape \[4\]"):
        amj.merge_states(o, lse, sink=np.zeros(3, np.float32) + 1.0)


# merge_share: one state's share of the N-way merge (static index; differentiable)


@pytest.mark.parametrize("states_axis", [0, 1])
@pytest.mark.parametrize("base", ["e", 2])
def test_merge_share_under_jit_and_its_gradients(rng, dev, states_axis, base):
    """The share's gradients are those of merge_states of the states whose O is 0 but index's."""
    t, s, h, d, index = 5, 4, 3, 24, 1
    o, lse, sink = random_o(rng, (t, h, d)), random_lse(rng, (s, t, h)), random_lse(rng, (h,))
    lse[2, 1, 0] = -np.inf  # an empty state
    given = lse if states_axis == 0 else np.swapaxes(lse, 0, 1)
    f = jax.jit(functools.partial(amj.merge_share, index=index, states_axis=states_axis, base=base))
    (out, out_lse), vjp = jax.vjp(lambda a, b, c: f(a, b, sink=c), put(o, dev), put(given, dev), put(sink, dev))
    assert_merge_matches(np.asarray(out), np.asarray(out_lse),
                         reference_merge_share(o, lse, index, states_axis=0, base=base, sink=sink), "float32")
    g_out, g_lse = _cotangents(rng, out, out_lse)
    grad_o, grad_lse, grad_sink = vjp((g_out, g_lse))
    stacked = np.zeros((s, t, h, d))
    stacked[index] = o
    so, sl = sink_state(sink, t, d)
    ref_o, ref_l = reference_merge_states_backward(np.concatenate([stacked, so[None]]), np.concatenate([lse, sl[None]]),
                                                   np.asarray(out), np.asarray(out_lse), np.asarray(g_out),
                                                   np.asarray(g_lse), base=base)
    want_l = ref_l[:-1] if states_axis == 0 else np.swapaxes(ref_l[:-1], 0, 1)
    assert_merge_matches(np.asarray(grad_o), np.asarray(grad_lse), (ref_o[index], want_l), "float32", "grad")
    np.testing.assert_allclose(np.asarray(grad_sink), ref_l[-1].sum(axis=0), rtol=2e-5, atol=1e-6)


def test_merge_share_under_vmap_is_one_call_and_the_shares_sum_to_the_merge(rng, dev):
    """vmap over ranks: each batch element is one rank's share; summed, they are merge_states."""
    o, lse = random_o(rng, (3, 6, 2, 16)), random_lse(rng, (3, 6, 2))  # [S, T, H, D], [S, T, H]
    share = functools.partial(amj.merge_share, index=0, states_axis=0)
    f = jax.vmap(share, in_axes=(0, None))
    assert ffi_calls(f, o, lse) == (1, False)
    outs = [np.asarray(amj.merge_share(put(o[i], dev), put(lse, dev), i, states_axis=0)[0]) for i in range(3)]
    ref = reference_merge_stacked(o, lse, states_axis=0)
    assert_merge_matches(sum(x.astype(np.float64) for x in outs).astype(np.float32), None, ref, "float32")
    out, _ = f(put(o, dev), put(lse, dev))  # every element index 0: o[i]'s share as state 0
    for i in range(3):
        assert_merge_matches(np.asarray(out[i]), None, reference_merge_share(o[i], lse, 0, states_axis=0), "float32")
    from jax.test_util import check_grads

    check_grads(lambda a, b: amj.merge_share(a, b, 2, states_axis=0), (put(o[2], dev), put(lse, dev)), order=1,
                modes=["rev"], eps=1e-2, atol=2e-2, rtol=2e-2)


def test_merge_share_arguments_are_checked_when_traced(rng):
    o, lse = random_o(rng, (2, 3, 8)), random_lse(rng, (2, 4, 3))
    with pytest.raises(ValueError, match=r"index: expected 0 <= index < 4 \(the states of lse\), got 4"):
        amj.merge_share(o, lse, 4)
    with pytest.raises(TypeError, match="index: expected an int"):
        amj.merge_share(o, lse, 1.5)
    with pytest.raises(ValueError, match=r"lse: expected shape \[2, 4, 3\]"):
        amj.merge_share(o, lse[:, :, :2], 1)
    with pytest.raises(TypeError, match="index: expected a Python value"):
        jax.jit(lambda a, b, i: amj.merge_share(a, b, i))(o, lse, 1)


# ---- softmax statistics and valid states -------------------------------------------------------------


def _stats(rng, shape):
    return random_lse(rng, shape), rng.uniform(1.0, 20.0, shape).astype(np.float32)


@pytest.mark.parametrize("states_axis", [0, 1])
@pytest.mark.parametrize("base", ["e", 2])
def test_merge_states_of_softmax_statistics_and_valid_states_and_their_gradients(rng, dev, states_axis, base):
    """lse as a (max, sum) tuple and valid [tokens, S] under jit: the oracle's merge of max +
    log(sum) with the empty states at -inf, and its gradients: the max's that LSE's, the sum's it
    divided by sum ln(b), zero for an empty state (its sum 0, or valid 0) whatever it held."""
    s, t, h, d = 5, 6, 3, 24
    o = random_o(rng, (s, t, h, d))
    m, total = _stats(rng, (s, t, h))
    total[1, 2, 0] = 0.0
    valid = (rng.random((t, s)) < 0.7).astype(np.uint8)
    lse = valid_lse(stats_lse(m, total, base), valid.T[:, :, None])
    move = (lambda x: x) if states_axis == 0 else (lambda x: np.swapaxes(x, 0, 1))
    f = jax.jit(lambda a, b, c, v: amj.merge_states(a, (b, c), states_axis=states_axis, base=base, valid=v))
    args = [put(move(x), dev) for x in (o, m, total)] + [put(valid, dev)]
    (out, out_lse), vjp = jax.vjp(f, *args)
    assert_merge_matches(np.asarray(out), np.asarray(out_lse), reference_merge_stacked(o, lse, states_axis=0, base=base),
                         "float32")
    g_out, g_lse = _cotangents(rng, out, out_lse)
    grad_o, grad_m, grad_s, _ = vjp((g_out, g_lse))
    ref_o, ref_l = reference_merge_states_backward(o, lse, np.asarray(out), np.asarray(out_lse), np.asarray(g_out),
                                                   np.asarray(g_lse), base=base)
    with np.errstate(invalid="ignore", divide="ignore"):
        ref_s = np.where(ref_l != 0, ref_l / (total * _ln(base)), 0.0)
    for got, want in ((grad_o, ref_o), (grad_m, ref_l), (grad_s, ref_s)):
        assert_merge_matches(np.asarray(got), None, (move(want), None), "float32", "grad")
    assert np.asarray(move(grad_s))[1, 2, 0] == 0


def test_merge_and_merge_share_of_softmax_statistics_under_jit_and_vmap(rng, dev):
    t, h, d = 7, 2, 32
    o_a, o_b = random_o(rng, (t, h, d)), random_o(rng, (t, h, d))
    (m_a, s_a), (m_b, s_b) = _stats(rng, (t, h)), _stats(rng, (t, h))
    valid = np.ones((t, 2), np.int32)
    valid[3, 0] = 0
    out, out_lse = jax.jit(lambda *x: amj.merge(x[0], (x[1], x[2]), x[3], (x[4], x[5]), valid=x[6]))(
        *(put(x, dev) for x in (o_a, m_a, s_a, o_b, m_b, s_b, valid)))
    ref = reference_merge(o_a, valid_lse(stats_lse(m_a, s_a), valid[:, :1]), o_b, stats_lse(m_b, s_b))
    assert_merge_matches(np.asarray(out), np.asarray(out_lse), ref, "float32")
    # a batch of three merges: one call over the flattened batch, valid batched with them
    batched = [np.stack([x, x[::-1], x * 0 + x]) for x in (o_a, m_a, s_a, o_b, m_b, s_b)]
    vb = np.stack([valid] * 3)
    outs = jax.vmap(lambda *x: amj.merge(x[0], (x[1], x[2]), x[3], (x[4], x[5]), valid=x[6]))(
        *(put(x, dev) for x in (*batched, vb)))
    for i in range(3):
        x = [b[i] for b in batched]
        want = reference_merge(x[0], valid_lse(stats_lse(x[1], x[2]), valid[:, :1]), x[3], stats_lse(x[4], x[5]))
        assert_merge_matches(np.asarray(outs[0][i]), np.asarray(outs[1][i]), want, "float32")
    # a share: the shares of every state sum to the N-way merge of the statistics
    s = 3
    o = random_o(rng, (t, s, h, d))
    m, total = _stats(rng, (t, s, h))
    shares = sum(np.asarray(amj.merge_share(put(o[:, i], dev), (put(m, dev), put(total, dev)), i)[0]) for i in range(s))
    assert_merge_matches(shares, None, (reference_merge_stacked(o, stats_lse(m, total))[0], None), "float32")
    # the native functions on JAX arrays take attnmerge.jax's road, statistics and valid included
    native = attnmerge.merge_states(put(o, dev), (put(m, dev), put(total, dev)), valid=put(valid[:, :1].repeat(3, 1), dev))
    assert isinstance(native[0], jax.Array)
    assert_merge_matches(np.asarray(native[0]), np.asarray(native[1]),
                         reference_merge_stacked(o, valid_lse(stats_lse(m, total), valid[:, :1, None])), "float32")


def test_softmax_statistics_of_another_shape_are_refused_when_traced(rng):
    o, (m, total) = random_o(rng, (4, 3, 2, 8)), _stats(rng, (4, 3, 2))
    with pytest.raises(ValueError, match=r"lse\[1\]: expected shape \[4, 3, 2\]"):
        amj.merge_states(o, (m, total[:, :2]))
    with pytest.raises(ValueError, match=r"valid: expected shape \[4, 3\]"):
        amj.merge_states(o, m, valid=np.ones((3, 4), np.uint8))


# ---- the live number of tokens (num_tokens): an operand read on the device -------------------------


@pytest.mark.parametrize("count_dtype", (np.int32, np.int64))
def test_a_live_count_merges_the_live_tokens_under_jit(rng, dev, count_dtype):
    """num_tokens an operand of the FFI call: the same compiled function serves every count, the live
    rows the oracle's (the rows past it, of new arrays, are unspecified)."""
    t, h, d = 9, 3, 32
    h_ = [random_o(rng, (t, h, d)), random_lse(rng, (t, h)), random_o(rng, (t, h, d)), random_lse(rng, (t, h))]
    ref = reference_merge(*h_)
    f = jax.jit(lambda a, b, c, e, n: amj.merge(a, b, c, e, num_tokens=n))
    x = [put(v, dev) for v in h_]
    for n in (0, 1, 4, t, t + 5):
        out, out_lse = f(*x, put(np.array([n], count_dtype), dev))
        live = min(n, t)
        assert_merge_matches(np.asarray(out)[:live], np.asarray(out_lse)[:live], (ref[0][:live], ref[1][:live]),
                             "float32")
    v, s = random_stacked(rng, t, 5, h, d)
    states = jax.jit(lambda v, s, n: amj.merge_states(v, s, num_tokens=n))(put(v, dev), put(s, dev),
                                                                        put(np.array([3], count_dtype), dev))
    ref = reference_merge_stacked(v, s)
    assert_merge_matches(np.asarray(states[0])[:3], np.asarray(states[1])[:3], (ref[0][:3], ref[1][:3]), "float32")


def test_a_live_count_under_vmap_counts_each_examples_tokens(rng, dev):
    """Under vmap the count is each example's (one call per example, never a count over the batch
    folded into tokens)."""
    b, t, h, d = 3, 6, 2, 16
    o_a, o_b = random_o(rng, (b, t, h, d)), random_o(rng, (b, t, h, d))
    lse_a, lse_b = random_lse(rng, (b, t, h)), random_lse(rng, (b, t, h))
    counts = np.array([[1], [4], [6]], np.int32)
    out, out_lse = jax.vmap(lambda a, x, c, y, n: amj.merge(a, x, c, y, num_tokens=n))(
        *(put(v, dev) for v in (o_a, lse_a, o_b, lse_b, counts)))
    for i, n in enumerate(counts[:, 0]):
        ref = reference_merge(o_a[i], lse_a[i], o_b[i], lse_b[i])
        assert_merge_matches(np.asarray(out[i])[:n], np.asarray(out_lse[i])[:n], (ref[0][:n], ref[1][:n]), "float32")


def test_no_gradient_with_a_live_count(rng, dev):
    t, h, d = 5, 2, 16
    x = [put(v, dev) for v in (random_o(rng, (t, h, d)), random_lse(rng, (t, h)), random_o(rng, (t, h, d)),
                               random_lse(rng, (t, h)))]
    n = put(np.array([3], np.int32), dev)
    with pytest.raises(NotImplementedError, match="num_tokens"):
        jax.grad(lambda o: amj.merge(o, x[1], x[2], x[3], num_tokens=n)[0].sum())(x[0])


def test_the_native_functions_take_a_live_count_on_jax_arrays(rng, dev):
    t, h, d = 7, 2, 16
    h_ = [random_o(rng, (t, h, d)), random_lse(rng, (t, h)), random_o(rng, (t, h, d)), random_lse(rng, (t, h))]
    out, out_lse = attnmerge.merge(*(put(v, dev) for v in h_), num_tokens=put(np.array([2], np.int64), dev))
    ref = reference_merge(*h_)
    assert_merge_matches(np.asarray(out)[:2], np.asarray(out_lse)[:2], (ref[0][:2], ref[1][:2]), "float32")


def test_a_tokens_as_an_array_is_refused_by_name(rng, dev):
    t, h, d = 5, 2, 16
    x = [put(v, dev) for v in (random_o(rng, (t, h, d)), random_lse(rng, (t, h)), random_o(rng, (t, h, d)),
                               random_lse(rng, (t, h)))]
    with pytest.raises(ValueError, match="a_tokens: expected None or an int"):
        amj.merge(*x, a_tokens=put(np.array([3], np.int32), dev))
