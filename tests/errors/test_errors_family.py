"""Bad input to the merge family: ValueError / TypeError naming the argument, nothing written.

As for the two-way merge (test_errors.py): a wrong dtype is a TypeError, a wrong shape, ndim, value
or a read-only output a ValueError; the message names the argument (FlashInfer's and vLLM's names in
their layers) and, where there is one, the expected and the actual value.  Outputs poisoned with NaN
are still all NaN after the error; for the in-place merge the inputs are still bit-identical.
"""

from __future__ import annotations

import numpy as np
import pytest

import attnmerge
from attnmerge.compat import flashinfer as fi
from attnmerge.compat.vllm import merge_attn_states
from oracle import all_nan, fp8_dtype, nan_array, random_lse, random_o, random_stacked, random_state
from test_errors import names

T, S, H, D = 8, 4, 3, 16


def check_message(msg, words, absent=()):
    for w in words:
        assert names(w, msg), f"{w!r} not in the message {msg!r}"
    for w in absent:
        assert not names(w, msg), f"{w!r} should not be in the message {msg!r}"


def bits(x):
    return np.ascontiguousarray(x).view(np.uint8).copy()


# --------------------------------------------------------------------------------------------------
# merge_inplace: nothing written means o and lse bit-identical


def inplace_args(rng, dtype="float32"):
    o, lse = random_state(rng, T, H, D, dtype)
    o_other, lse_other = random_state(rng, T, H, D, dtype)
    return dict(o=o, lse=lse, o_other=o_other, lse_other=lse_other)


def expect_inplace(exc, words, a, **kw):
    before = {k: bits(v) for k, v in a.items() if isinstance(v, np.ndarray)}
    with pytest.raises(exc) as info:
        attnmerge.merge_inplace(a["o"], a["lse"], a["o_other"], a["lse_other"], **kw)
    check_message(str(info.value), words)
    for k, b in before.items():
        assert np.array_equal(bits(a[k]), b), f"{k} was changed before the error"
    return str(info.value)


@pytest.mark.parametrize("name", ["o", "lse"])
def test_inplace_read_only_state(rng, name):
    a = inplace_args(rng)
    a[name].setflags(write=False)
    expect_inplace(ValueError, [name], a)


def test_inplace_read_only_state_with_a_mask(rng):
    a = inplace_args(rng, "bfloat16")
    a["o"].setflags(write=False)
    expect_inplace(ValueError, ["o"], a, mask=np.ones(T, bool))


@pytest.mark.parametrize("length", [T - 1, T + 1, 0])
def test_inplace_mask_of_the_wrong_length(rng, length):
    a = inplace_args(rng)
    expect_inplace(ValueError, ["mask", str(T), str(length)], a, mask=np.ones(length, np.uint8))


@pytest.mark.parametrize("dtype", ["float32", "int32", "int64", "float16"])
def test_inplace_mask_of_the_wrong_dtype(rng, dtype):
    a = inplace_args(rng)
    expect_inplace(TypeError, ["mask", dtype], a, mask=np.ones(T, dtype))


def test_inplace_mask_of_the_wrong_ndim(rng):
    a = inplace_args(rng)
    expect_inplace(ValueError, ["mask"], a, mask=np.ones((T, 1), np.uint8))


def test_inplace_mask_not_an_array(rng):
    a = inplace_args(rng)
    expect_inplace(TypeError, ["mask"], a, mask="yes")


@pytest.mark.parametrize("name,shape", [("o_other", (T, H, D + 1)), ("o_other", (T - 1, H, D)),
                                        ("lse_other", (T, H + 1)), ("lse", (H, T)), ("o", (T, H, D, 1))])
def test_inplace_shapes(rng, name, shape):
    a = inplace_args(rng)
    a[name] = np.ones(shape, a[name].dtype)
    expect_inplace(ValueError, [name], a)


def test_inplace_o_other_dtype_must_match_o(rng):
    a = inplace_args(rng)
    a["o_other"] = a["o_other"].astype(np.float16)
    expect_inplace(TypeError, ["o_other", "float16", "float32"], a)


@pytest.mark.parametrize("name", ["lse", "lse_other"])
def test_inplace_lse_must_be_float32(rng, name):
    a = inplace_args(rng)
    a[name] = a[name].astype(np.float64)
    expect_inplace(TypeError, [name, "float32", "float64"], a)


def test_inplace_bad_base(rng):
    expect_inplace(ValueError, ["base"], inplace_args(rng), base=10)


def test_inplace_o_not_an_array(rng):
    a = inplace_args(rng)
    with pytest.raises(TypeError) as info:
        attnmerge.merge_inplace(a["o"].tolist(), a["lse"], a["o_other"], a["lse_other"])
    check_message(str(info.value), ["o"])


# --------------------------------------------------------------------------------------------------
# merge_states


def states_args(rng, s=S, dtype="float32"):
    o, lse = random_stacked(rng, T, s, H, D, dtype)
    return dict(o=o, lse=lse, out=nan_array((T, H, D), dtype), out_lse=nan_array((T, H)))


def expect_states(exc, words, a, **kw):
    with pytest.raises(exc) as info:
        attnmerge.merge_states(a["o"], a["lse"], out=a.get("out"), out_lse=a.get("out_lse"), **kw)
    check_message(str(info.value), words)
    for k in ("out", "out_lse"):
        if isinstance(a.get(k), np.ndarray) and a[k].size:
            assert all_nan(a[k]), f"{k} was written before the error"
    return str(info.value)


def test_states_mismatched_s_between_o_and_lse(rng):
    a = states_args(rng)
    a["lse"] = a["lse"][:, :3]
    expect_states(ValueError, ["lse", "3", "4"], a)


def test_states_mismatched_s_in_the_all_gather_layout(rng):
    o, lse = random_stacked(rng, T, 4, H, D, states_axis=0)
    a = dict(o=o, lse=lse[:2], out=nan_array((T, H, D)), out_lse=nan_array((T, H)))
    expect_states(ValueError, ["lse", "2", "4"], a, states_axis=0)


def test_states_three_dimensional_o(rng):
    a = states_args(rng)
    a["o"] = a["o"][:, 0]
    msg = expect_states(ValueError, ["o"], a)
    assert names("4", msg) and names("3", msg), msg


def test_states_two_dimensional_lse(rng):
    a = states_args(rng)
    a["lse"] = a["lse"][:, 0]
    expect_states(ValueError, ["lse"], a)


@pytest.mark.parametrize("name,shape", [("lse", (T + 1, S, H)), ("lse", (T, S, H + 1)),
                                        ("out", (T, H, D + 1)), ("out", (T - 1, H, D)), ("out_lse", (T, H + 2))])
def test_states_shapes(rng, name, shape):
    a = states_args(rng)
    a[name] = np.full(shape, np.nan if name.startswith("out") else 1.0, a[name].dtype)
    msg = expect_states(ValueError, [name], a)
    assert all(names(n, msg) for n in shape), msg


@pytest.mark.parametrize("bad", [2, -1, 3, "tokens"])
def test_states_bad_states_axis(rng, bad):
    expect_states((ValueError, TypeError), ["states_axis"], states_args(rng), states_axis=bad)


def test_states_lse_must_be_float32(rng):
    a = states_args(rng)
    a["lse"] = a["lse"].astype(np.float16)
    expect_states(TypeError, ["lse", "float32", "float16"], a)


def test_states_o_dtype_must_be_a_float_type(rng):
    a = states_args(rng)
    a["o"] = a["o"].astype(np.int32)
    expect_states(TypeError, ["o", "int32"], a)


@pytest.mark.parametrize("name", ["out", "out_lse"])
def test_states_read_only_outputs(rng, name):
    a = states_args(rng)
    a[name].setflags(write=False)
    expect_states(ValueError, [name], a)


def test_states_head_size_axis_must_be_unit_stride(rng):
    a = states_args(rng)
    buf = np.ones((T, S, H, 2 * D), np.float32)
    a["o"] = buf[..., ::2]
    expect_states(ValueError, ["o", "stride"], a)


def test_states_a_non_array(rng):
    a = states_args(rng)
    a["lse"] = None
    expect_states(TypeError, ["lse"], a)


# --------------------------------------------------------------------------------------------------
# merge_varlen


def varlen_args(rng, rows=4, total=10):
    o, lse = random_state(rng, total, H, D)
    indptr = np.array([0, 3, 3, 7, 10], np.int32)
    return dict(o=o, lse=lse, indptr=indptr, out=nan_array((rows, H, D)), out_lse=nan_array((rows, H)))


def expect_varlen(exc, words, a, **kw):
    with pytest.raises(exc) as info:
        attnmerge.merge_varlen(a["o"], a["lse"], a["indptr"], out=a.get("out"), out_lse=a.get("out_lse"), **kw)
    check_message(str(info.value), words)
    for k in ("out", "out_lse"):
        if isinstance(a.get(k), np.ndarray) and a[k].size:
            assert all_nan(a[k]), f"{k} was written before the error"
    return str(info.value)


@pytest.mark.parametrize("dtype", ["float32", "float64", "int16", "uint32", "bool"])
def test_varlen_indptr_of_the_wrong_dtype(rng, dtype):
    a = varlen_args(rng)
    a["indptr"] = a["indptr"].astype(dtype)
    expect_varlen(TypeError, ["indptr", dtype], a)


def test_varlen_indptr_of_the_wrong_ndim(rng):
    a = varlen_args(rng)
    a["indptr"] = a["indptr"].reshape(1, -1)
    expect_varlen(ValueError, ["indptr"], a)


def test_varlen_empty_indptr(rng):
    a = varlen_args(rng)
    a["indptr"] = np.zeros(0, np.int32)
    del a["out"], a["out_lse"]
    expect_varlen(ValueError, ["indptr"], a)


@pytest.mark.parametrize("bad", [[0, 3, 2, 7, 10], [-1, 3, 3, 7, 10], [0, 3, 3, 7, 11], [0, 3, 3, 12, 10]])
def test_varlen_bad_indptr_values(rng, bad):
    a = varlen_args(rng)
    a["indptr"] = np.array(bad, np.int64)
    expect_varlen(ValueError, ["indptr"], a)


def test_varlen_out_rows_must_match_indptr(rng):
    a = varlen_args(rng)
    a["out"] = nan_array((5, H, D))
    expect_varlen(ValueError, ["out", "4", "5"], a)


@pytest.mark.parametrize("name,shape", [("o", (10, H, D, 1)), ("o", (10, H * D)), ("lse", (9, H)), ("lse", (10, H + 1))])
def test_varlen_state_shapes(rng, name, shape):
    a = varlen_args(rng)
    a[name] = np.ones(shape, np.float32)
    expect_varlen(ValueError, [name], a)


def test_varlen_read_only_out(rng):
    a = varlen_args(rng)
    a["out"].setflags(write=False)
    expect_varlen(ValueError, ["out"], a)


def test_varlen_indptr_not_an_array(rng):
    a = varlen_args(rng)
    a["indptr"] = "0,3,3,7,10"
    expect_varlen(TypeError, ["indptr"], a)


# --------------------------------------------------------------------------------------------------
# output_scale


def test_output_scale_with_a_non_fp8_output_merge(rng):
    o_a, lse_a = random_state(rng, T, H, D)
    o_b, lse_b = random_state(rng, T, H, D)
    out = nan_array((T, H, D))
    with pytest.raises(ValueError) as info:
        attnmerge.merge(o_a, lse_a, o_b, lse_b, out=out, output_scale=0.5)
    check_message(str(info.value), ["output_scale"])
    assert all_nan(out)
    with pytest.raises(ValueError, match="output_scale"):
        attnmerge.merge(o_a, lse_a, o_b, lse_b, out_dtype="bfloat16", output_scale=np.array([0.5], np.float32))


def test_output_scale_with_a_non_fp8_output_merge_states(rng):
    expect_states(ValueError, ["output_scale"], states_args(rng), output_scale=2.0)


def test_output_scale_with_a_non_fp8_output_merge_varlen(rng):
    expect_varlen(ValueError, ["output_scale"], varlen_args(rng), output_scale=np.array([2.0], np.float32))


def test_output_scale_array_of_two_elements(rng):
    a = states_args(rng)
    a["out"] = nan_array((T, H, D), fp8_dtype())
    expect_states(ValueError, ["output_scale"], a, output_scale=np.array([1.0, 2.0], np.float32))


def test_output_scale_array_of_the_wrong_dtype(rng):
    a = states_args(rng)
    a["out"] = nan_array((T, H, D), fp8_dtype())
    expect_states((TypeError, ValueError), ["output_scale", "float64"], a, output_scale=np.array([1.0]))


def test_fp8_is_an_output_dtype_only(rng):
    o, lse = random_stacked(rng, T, S, H, D)
    with pytest.raises(TypeError) as info:
        attnmerge.merge_states(o.astype(fp8_dtype()), lse)
    check_message(str(info.value), ["o"])


# --------------------------------------------------------------------------------------------------
# the vLLM layer: output_scale


def vllm_args(rng, dtype="float16"):
    return dict(
        prefix_output=random_o(rng, (T, H, D), dtype), prefix_lse=random_lse(rng, (H, T)),
        suffix_output=random_o(rng, (T, H, D), dtype), suffix_lse=random_lse(rng, (H, T)),
    )


def test_vllm_output_scale_with_a_non_fp8_output(rng):
    output, output_lse = nan_array((T, H, D), "float16"), nan_array((H, T))
    with pytest.raises(ValueError) as info:
        merge_attn_states(output, **vllm_args(rng), output_lse=output_lse, output_scale=np.array([0.5], np.float32))
    check_message(str(info.value), ["output_scale"])
    assert all_nan(output) and all_nan(output_lse)


def test_vllm_output_scale_of_two_elements(rng):
    output, output_lse = nan_array((T, H, D), fp8_dtype()), nan_array((H, T))
    with pytest.raises(ValueError) as info:
        merge_attn_states(output, **vllm_args(rng), output_lse=output_lse, output_scale=np.array([0.5, 1.0], np.float32))
    check_message(str(info.value), ["output_scale"])
    assert all_nan(output) and all_nan(output_lse)


# --------------------------------------------------------------------------------------------------
# the FlashInfer layer names FlashInfer's arguments


def fi_pair(rng, dtype="float16"):
    v_a, s_a = random_state(rng, T, H, D, dtype)
    v_b, s_b = random_state(rng, T, H, D, dtype)
    return dict(v_a=v_a, s_a=s_a, v_b=v_b, s_b=s_b)


NATIVE_NAMES = ("o_a", "o_b", "lse_a", "lse_b", "o_other", "lse_other")


def test_fi_merge_state_dtype_names_v_b(rng):
    a = fi_pair(rng)
    a["v_b"] = a["v_b"].astype(np.float32)
    with pytest.raises(TypeError) as info:
        fi.merge_state(**a)
    check_message(str(info.value), ["v_b", "float32", "float16"], absent=NATIVE_NAMES)


@pytest.mark.parametrize("name,shape", [("s_a", (T, H + 1)), ("s_b", (H, T)), ("v_b", (T, H, D + 2)), ("v_a", (T, H * D))])
def test_fi_merge_state_shapes_name_the_argument(rng, name, shape):
    a = fi_pair(rng)
    a[name] = np.ones(shape, a[name].dtype)
    with pytest.raises(ValueError) as info:
        fi.merge_state(**a)
    check_message(str(info.value), [name], absent=NATIVE_NAMES)


def test_fi_merge_state_s_must_be_float32(rng):
    a = fi_pair(rng)
    a["s_a"] = a["s_a"].astype(np.float16)
    with pytest.raises(TypeError) as info:
        fi.merge_state(**a)
    check_message(str(info.value), ["s_a", "float16"], absent=NATIVE_NAMES)


def fi_inplace(rng, dtype="float16"):
    v, s = random_state(rng, T, H, D, dtype)
    v_other, s_other = random_state(rng, T, H, D, dtype)
    return dict(v=v, s=s, v_other=v_other, s_other=s_other)


def expect_fi_inplace(exc, words, a, **kw):
    before = {k: bits(x) for k, x in a.items()}
    with pytest.raises(exc) as info:
        fi.merge_state_in_place(a["v"], a["s"], a["v_other"], a["s_other"], **kw)
    check_message(str(info.value), words, absent=NATIVE_NAMES)
    for k, b in before.items():
        assert np.array_equal(bits(a[k]), b), f"{k} was changed before the error"


@pytest.mark.parametrize("name", ["v", "s"])
def test_fi_in_place_read_only_state(rng, name):
    a = fi_inplace(rng)
    a[name].setflags(write=False)
    expect_fi_inplace(ValueError, [name], a)


def test_fi_in_place_mask_of_the_wrong_length(rng):
    expect_fi_inplace(ValueError, ["mask", str(T), str(T + 3)], fi_inplace(rng), mask=np.ones(T + 3, bool))


@pytest.mark.parametrize("dtype", ["float32", "int64"])
def test_fi_in_place_mask_of_the_wrong_dtype(rng, dtype):
    expect_fi_inplace(TypeError, ["mask", dtype], fi_inplace(rng), mask=np.ones(T, dtype))


@pytest.mark.parametrize("name,shape", [("v_other", (T, H, D + 1)), ("s_other", (T + 1, H))])
def test_fi_in_place_shapes(rng, name, shape):
    a = fi_inplace(rng)
    a[name] = np.ones(shape, a[name].dtype)
    expect_fi_inplace(ValueError, [name], a)


def test_fi_in_place_s_other_dtype(rng):
    a = fi_inplace(rng)
    a["s_other"] = a["s_other"].astype(np.float64)
    expect_fi_inplace(TypeError, ["s_other", "float64"], a)


def test_fi_merge_states_three_dimensional_v(rng):
    v, s = random_state(rng, T, H, D)  # [tokens, heads, D]: the S axis is missing
    with pytest.raises(ValueError) as info:
        fi.merge_states(v, s)
    msg = str(info.value)
    check_message(msg, ["v", "4", "3"], absent=NATIVE_NAMES)


def test_fi_merge_states_mismatched_s_between_v_and_s(rng):
    v, s = random_stacked(rng, T, 5, H, D)
    with pytest.raises(ValueError) as info:
        fi.merge_states(v, s[:, :2])
    msg = str(info.value)
    assert names("s", msg) or names("v", msg), msg
    check_message(msg, ["5", "2"], absent=NATIVE_NAMES)


def test_fi_merge_states_s_of_the_wrong_dtype(rng):
    v, s = random_stacked(rng, T, 5, H, D)
    with pytest.raises(TypeError) as info:
        fi.merge_states(v, s.astype(np.float64))
    check_message(str(info.value), ["s", "float64"], absent=NATIVE_NAMES)


@pytest.mark.parametrize("dtype", ["float32", "int16"])
def test_fi_variable_length_indptr_of_the_wrong_dtype(rng, dtype):
    v, s = random_state(rng, 6, H, D)
    with pytest.raises(TypeError) as info:
        fi.variable_length_merge_states(v, s, np.array([0, 2, 6], dtype))
    check_message(str(info.value), ["indptr", dtype], absent=NATIVE_NAMES)


@pytest.mark.parametrize("bad", [[0, 4, 2], [-2, 2, 6], [0, 2, 7]])
def test_fi_variable_length_bad_indptr(rng, bad):
    v, s = random_state(rng, 6, H, D)
    with pytest.raises(ValueError) as info:
        fi.variable_length_merge_states(v, s, np.array(bad, np.int32))
    check_message(str(info.value), ["indptr"], absent=NATIVE_NAMES)


def test_fi_variable_length_four_dimensional_v(rng):
    v, s = random_stacked(rng, 6, 2, H, D)
    with pytest.raises(ValueError) as info:
        fi.variable_length_merge_states(v, s, np.array([0, 2, 6], np.int32))
    check_message(str(info.value), ["v"], absent=NATIVE_NAMES)


# --------------------------------------------------------------------------------------------------
# output_scale: one rule at every layer (a scale is a finite number > 0; None, in C 0, is no scale;
# outputs other than FP8 take none, or 1)


@pytest.mark.parametrize("scale,shown", [(0, "0"), (0.0, "0.0"), (-1.0, "-1"), (float("nan"), "nan"),
                                         (float("inf"), "inf")])
def test_every_bad_output_scale_states_the_same_rule(rng, scale, shown):
    o_a, lse_a = random_state(rng, T, H, D)
    o_b, lse_b = random_state(rng, T, H, D)
    out = nan_array((T, H, D), fp8_dtype())
    with pytest.raises(ValueError) as info:
        attnmerge.merge(o_a, lse_a, o_b, lse_b, out=out, output_scale=scale)
    msg = str(info.value)
    assert msg.startswith("output_scale: expected "), msg
    assert "a finite scale > 0" in msg, msg
    check_message(msg, [shown])
    assert np.isnan(out.astype(np.float32)).all(), "written before the error"


def test_a_scale_of_0_is_none_to_the_python_layer_as_none_is(rng):
    o_a, lse_a = random_state(rng, T, H, D)
    o_b, lse_b = random_state(rng, T, H, D)
    out = nan_array((T, H, D), fp8_dtype())
    with pytest.raises(ValueError) as info:
        attnmerge.merge(o_a, lse_a, o_b, lse_b, out=out, output_scale=0.0)
    check_message(str(info.value), ["output_scale", "None", "0.0"])


def _scale_0_through(path, o_a, lse_a, o_b, lse_b):
    if path == "jax":
        jax = pytest.importorskip("jax")
        if not attnmerge.build_info()["jax_extension"]:
            pytest.skip("attnmerge was built without the JAX extension")
        import attnmerge.jax as amj

        x = [jax.numpy.asarray(v) for v in (o_a, lse_a, o_b, lse_b)]
        return amj.merge(*x, out_dtype=jax.numpy.float8_e4m3fn, output_scale=0.0)
    torch = pytest.importorskip("torch")
    a, la, b, lb = (torch.from_numpy(v) for v in (o_a, lse_a, o_b, lse_b))
    if path == "torch.ops":  # taken for tensors that require grad
        return attnmerge.merge(a.requires_grad_(), la, b, lb, out_dtype=torch.float8_e4m3fn, output_scale=0.0)
    out = torch.zeros((T, H, D)).to(torch.float8_e4m3fn)
    return merge_attn_states(out, a, la.T.contiguous(), b, lb.T.contiguous(), output_scale=0.0)


@pytest.mark.parametrize("path", ["torch.ops", "jax", "vllm"])
def test_a_scale_of_0_is_refused_on_every_path(rng, path):
    """attnmerge.jax, the torch.ops path and the vLLM layer turn a number into a scale as the direct
    path does: 0 is not Python's none."""
    o_a, lse_a = random_state(rng, T, H, D)
    o_b, lse_b = random_state(rng, T, H, D)
    with pytest.raises(ValueError) as info:
        _scale_0_through(path, o_a, lse_a, o_b, lse_b)
    assert str(info.value) == "output_scale: expected None or a finite scale > 0, got 0.0"


def test_a_non_fp8_output_takes_no_scale_but_1(rng):
    o_a, lse_a = random_state(rng, T, H, D)
    o_b, lse_b = random_state(rng, T, H, D)
    out = nan_array((T, H, D))
    with pytest.raises(ValueError) as info:
        attnmerge.merge(o_a, lse_a, o_b, lse_b, out=out, output_scale=2.0)
    msg = str(info.value)
    check_message(msg, ["output_scale", "float32", "2"])
    assert "0" not in msg.split("got")[0], f"the message offers 0, which Python refuses: {msg!r}"
    attnmerge.merge(o_a, lse_a, o_b, lse_b, out=out, output_scale=1.0)  # accepted: changes nothing
    want, _ = attnmerge.merge(o_a, lse_a, o_b, lse_b)
    assert np.array_equal(out, want)


# --------------------------------------------------------------------------------------------------
# a bad indptr on the CPU: ValueError naming indptr, nothing written (on the GPU it is clamped:
# tests/semantics/test_merge_varlen.py)

BAD_INDPTR = {
    "negative_first": [-1, 2, 4],
    "negative_inside": [0, -2, 4],
    "decreasing": [0, 3, 2, 5],
    "past_total": [0, 3, 11],
    "first_past_total": [11, 11, 11],
}


@pytest.mark.parametrize("index_dtype", ["int32", "int64"])
@pytest.mark.parametrize("case", list(BAD_INDPTR))
def test_a_bad_indptr_raises_and_writes_nothing(rng, case, index_dtype):
    o, lse = random_state(rng, 10, 2, 16)
    indptr = np.array(BAD_INDPTR[case], index_dtype)
    rows = len(indptr) - 1
    out, out_lse = nan_array((rows, 2, 16)), nan_array((rows, 2))
    with pytest.raises(ValueError) as info:
        attnmerge.merge_varlen(o, lse, indptr, out=out, out_lse=out_lse)
    assert "indptr" in str(info.value), str(info.value)
    assert all_nan(out) and all_nan(out_lse), "an output was written before the error"


def test_a_bad_indptr_raises_with_allocated_outputs(rng):
    o, lse = random_state(rng, 10, 2, 16)
    with pytest.raises(ValueError, match="indptr"):
        attnmerge.merge_varlen(o, lse, np.array([0, 5, 4], np.int64))
