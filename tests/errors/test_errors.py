"""Bad input: every mistake raises ValueError or TypeError before anything is written.

The message names the argument, the expected and the actual value.  Each case poisons its outputs with
NaN and checks that they are still all NaN after the error.  Native API first, then the vLLM
compatibility layer, then the raw layer (all on the CPU).
"""

from __future__ import annotations

import re

import numpy as np
import pytest

import attnmerge
from attnmerge import raw
from attnmerge.compat.vllm import merge_attn_states
from oracle import all_nan, nan_array, random_lse, random_o, random_state
from devices import raw_lse as lse_desc
from devices import raw_o as o_desc

T, H, D = 8, 3, 16


def vllm_inputs(rng, tokens=33, heads=4, head_size=128, dtype="float16"):
    """prefix/suffix outputs [T, H, D] and LSEs [H, T], as vLLM lays them out."""
    return dict(
        prefix_output=random_o(rng, (tokens, heads, head_size), dtype),
        prefix_lse=random_lse(rng, (heads, tokens)),
        suffix_output=random_o(rng, (tokens, heads, head_size), dtype),
        suffix_lse=random_lse(rng, (heads, tokens)),
    )


def names(word: str, msg: str) -> bool:
    """`word` occurs in msg as a whole word or number ("output" is not in "prefix_output", "8" not in "18")."""
    return re.search(r"(?<![\w.-])" + re.escape(str(word)) + r"(?![\w.])", msg) is not None


def good(rng, dtype="float32"):
    """Valid inputs and NaN-poisoned outputs of [T, H, D]."""
    o_a, lse_a = random_state(rng, T, H, D, dtype)
    o_b, lse_b = random_state(rng, T, H, D, dtype)
    return dict(o_a=o_a, lse_a=lse_a, o_b=o_b, lse_b=lse_b, out=nan_array((T, H, D), dtype), out_lse=nan_array((T, H)))


def expect(exc, words, args, **options):
    """Call merge with args (a dict from `good`, changed), expect exc naming `words`; nothing written."""
    outs = [args[k] for k in ("out", "out_lse") if isinstance(args.get(k), np.ndarray)]
    with pytest.raises(exc) as info:
        attnmerge.merge(args["o_a"], args["lse_a"], args["o_b"], args["lse_b"],
                        out=args.get("out"), out_lse=args.get("out_lse"), **options)
    msg = str(info.value)
    for w in words:
        assert names(w, msg), f"{w!r} not in the message {msg!r}"
    for o in outs:
        if o.size:
            assert all_nan(o), "an output was written before the error"
    return msg


# --------------------------------------------------------------------------------------------------
# native API: dtypes (TypeError)


def test_o_dtypes_must_match(rng):
    a = good(rng)
    a["o_b"] = a["o_b"].astype(np.float16)
    expect(TypeError, ["o_b", "float16", "float32"], a)


@pytest.mark.parametrize("bad", ["int32", "float64", "int8", "bool"])
def test_o_dtype_must_be_a_float_type(rng, bad):
    a = good(rng)
    a["o_a"] = a["o_a"].astype(bad)
    a["o_b"] = a["o_b"].astype(bad)
    expect(TypeError, ["o_a", bad], a)


@pytest.mark.parametrize("name", ["lse_a", "lse_b", "out_lse"])
@pytest.mark.parametrize("bad", ["float16", "float64"])
def test_lse_must_be_float32(rng, name, bad):
    a = good(rng)
    a[name] = a[name].astype(bad)
    msg = expect(TypeError, [name, "float32", bad], a)
    assert "bfloat16" not in msg, f"an LSE is float32 only, but the message offers more: {msg!r}"


def test_out_dtype_must_be_a_float_type(rng):
    a = good(rng)
    a["out"] = np.zeros((T, H, D), np.int16)
    a["out"][...] = 0
    with pytest.raises(TypeError) as info:
        attnmerge.merge(a["o_a"], a["lse_a"], a["o_b"], a["lse_b"], out=a["out"])
    assert names("out", str(info.value)) and names("int16", str(info.value))
    assert np.all(a["out"] == 0)


@pytest.mark.parametrize("bad", ["int8", "float64", "complex64"])
def test_out_dtype_argument_must_be_supported(rng, bad):
    a = good(rng)
    a.pop("out")
    expect(TypeError, ["out_dtype", bad], a, out_dtype=bad)


def test_out_dtype_must_agree_with_a_given_out(rng):
    a = good(rng)
    with pytest.raises((TypeError, ValueError)) as info:
        attnmerge.merge(a["o_a"], a["lse_a"], a["o_b"], a["lse_b"], out=a["out"], out_dtype="float16")
    assert names("out", str(info.value))
    assert all_nan(a["out"])


@pytest.mark.parametrize("outputs", ["given", "allocated"])
@pytest.mark.parametrize("name", ["o_a", "lse_a", "o_b", "lse_b"])
@pytest.mark.parametrize("obj", [None, "array", 3.0], ids=["None", "str", "float"])
def test_non_array_inputs(rng, name, obj, outputs):
    a = good(rng)
    a[name] = obj
    if outputs == "allocated":
        del a["out"], a["out_lse"]
    expect(TypeError, [name], a)


@pytest.mark.parametrize("outputs", ["given", "allocated"])
def test_a_nested_list_is_not_an_array(rng, outputs):
    a = good(rng)
    a["o_a"] = a["o_a"].tolist()
    if outputs == "allocated":
        del a["out"], a["out_lse"]
    expect(TypeError, ["o_a"], a)


@pytest.mark.parametrize("name", ["out", "out_lse"])
def test_non_array_outputs(rng, name):
    a = good(rng)
    a[name] = [1.0, 2.0]
    expect(TypeError, [name], a)


# --------------------------------------------------------------------------------------------------
# native API: shapes and ndim (ValueError)


@pytest.mark.parametrize("name,shape", [
    ("o_a", (T, H * D)), ("o_b", (T, H, D, 1)), ("out", (T, H, 1, D)),
    ("lse_a", (T * H,)), ("lse_b", (T, H, 1)), ("out_lse", (T * H,)),
])
def test_ndim(rng, name, shape):
    a = good(rng)
    a[name] = a[name].reshape(shape)
    msg = expect(ValueError, [name], a)
    assert names(len(shape), msg), msg


@pytest.mark.parametrize("name,shape", [
    ("o_b", (T, H + 1, D)), ("o_b", (T, H, D + 1)), ("o_b", (T + 1, H, D)), ("o_a", (T, H, D - 1)),
    ("out", (T, H, 2 * D)), ("out", (T - 1, H, D)), ("lse_a", (T, H + 1)), ("lse_b", (T + 2, H)),
    ("out_lse", (T, H - 1)), ("lse_a", (H, T)),
])
def test_shape_mismatch_names_argument_expected_and_actual(rng, name, shape):
    a = good(rng)
    a[name] = np.full(shape, np.nan if name.startswith("out") else 1.0, dtype=a[name].dtype)
    msg = expect(ValueError, [name], a)
    assert all(names(s, msg) for s in shape), f"the actual shape {shape} is not in {msg!r}"


def test_o_a_with_fewer_tokens_needs_a_tokens(rng):
    a = good(rng)
    a["o_a"] = a["o_a"][:5]
    a["lse_a"] = a["lse_a"][:5]
    expect(ValueError, ["o_a", "5", "8"], a)


def test_a_tokens_past_the_tokens_of_a(rng):
    a = good(rng)
    a["o_a"] = a["o_a"][:5]
    a["lse_a"] = a["lse_a"][:5]
    expect(ValueError, ["a_tokens"], a, a_tokens=6)


def test_a_tokens_past_the_tokens(rng):
    expect(ValueError, ["a_tokens", str(T + 1)], good(rng), a_tokens=T + 1)


def test_a_tokens_negative(rng):
    expect(ValueError, ["a_tokens", "-1"], good(rng), a_tokens=-1)


# --------------------------------------------------------------------------------------------------
# native API: strides, alignment, read-only, overlap (ValueError)


@pytest.mark.parametrize("name", ["o_a", "o_b", "out"])
def test_head_size_axis_must_be_unit_stride(rng, name):
    a = good(rng)
    buf = np.full((T, H, 2 * D), np.nan, dtype=np.float32)
    buf[...] = np.nan if name == "out" else 1.0
    a[name] = buf[:, :, ::2]
    expect(ValueError, [name, "stride"], a)


@pytest.mark.parametrize("name", ["o_a", "lse_b", "out", "out_lse"])
def test_negative_strides(rng, name):
    a = good(rng)
    a[name] = a[name][::-1]
    expect(ValueError, [name], a)


@pytest.mark.parametrize("name", ["o_a", "out"])
def test_misaligned_data(rng, name):
    a = good(rng)
    raw_bytes = np.zeros(T * H * D * 4 + 4, dtype=np.uint8)
    x = np.ndarray((T, H, D), dtype=np.float32, buffer=raw_bytes, offset=1)  # not float32-aligned
    assert not x.flags.aligned
    x[...] = np.nan if name == "out" else a[name]
    a[name] = x
    expect(ValueError, [name], a)


@pytest.mark.parametrize("name", ["o_a", "lse_b", "out"])
def test_big_endian_arrays_are_refused(rng, name):
    a = good(rng)
    a[name] = a[name].astype(a[name].dtype.newbyteorder(">"))
    expect(TypeError, [name, "big-endian"], a)


@pytest.mark.parametrize("name", ["o_b", "out"])
def test_strides_must_be_whole_elements(rng, name):
    a = good(rng)
    buf = np.zeros(T * H * D * 6 + 8, dtype=np.uint8)
    x = np.ndarray((T, H, D), dtype=np.float32, buffer=buf, strides=(H * D * 6, D * 6, 6))  # 6-byte steps
    x[...] = np.nan if name == "out" else a[name]
    a[name] = x
    expect(ValueError, [name, "strides", "6"], a)


@pytest.mark.parametrize("name", ["out", "out_lse"])
def test_read_only_outputs(rng, name):
    a = good(rng)
    a[name].setflags(write=False)
    expect(ValueError, [name], a)


def test_broadcast_output_is_refused(rng):
    a = good(rng)
    a["out"] = np.broadcast_to(nan_array((1, H, D)), (T, H, D))
    expect(ValueError, ["out"], a)


@pytest.mark.parametrize("name,strides", [
    ("out", (0, D * 4, 4)), ("out", (H * D * 4, 0, 4)), ("out_lse", (0, 4)), ("out_lse", (H * 4, 0)),
])
def test_overlapping_outputs_zero_stride(rng, name, strides):
    a = good(rng)
    shape = a[name].shape
    buf = nan_array((T * H * D,))
    a[name] = np.lib.stride_tricks.as_strided(buf, shape=shape, strides=strides, writeable=True)
    expect(ValueError, [name], a)
    assert all_nan(buf)


@pytest.mark.parametrize("bad", [10, "10", "two", 2.5])
def test_bad_base(rng, bad):
    expect(ValueError, ["base"], good(rng), base=bad)


def test_jax_arrays_are_refused_as_out(rng):
    jnp = pytest.importorskip("jax.numpy")
    a = good(rng)
    a["out"] = jnp.zeros((T, H, D), jnp.float32)
    with pytest.raises(ValueError) as info:
        attnmerge.merge(a["o_a"], a["lse_a"], a["o_b"], a["lse_b"], out=a["out"])
    assert names("out", str(info.value))


# --------------------------------------------------------------------------------------------------
# the vLLM layer names vLLM's arguments
def _call_and_expect(x, output, output_lse, exc, *words, **kw):
    with pytest.raises(exc) as info:
        merge_attn_states(output, **x, output_lse=output_lse, **kw)
    msg = str(info.value)
    for w in words:
        assert names(w, msg), f"{w!r} not in the message {msg!r}"
    assert all_nan(output), "output was written before the error"
    if output_lse is not None:
        assert all_nan(output_lse), "output_lse was written before the error"
    return msg


def test_vllm_error_names_prefix_output_dtype(rng):
    x = vllm_inputs(rng, dtype="float16")
    x["prefix_output"] = x["prefix_output"].astype(np.float64)
    _call_and_expect(x, nan_array((33, 4, 128), "float16"), nan_array((4, 33)), TypeError, "prefix_output", "float64")


def test_vllm_error_names_suffix_output_shape(rng):
    x = vllm_inputs(rng)
    x["suffix_output"] = x["suffix_output"][:, :3]
    _call_and_expect(x, nan_array((33, 4, 128), "float16"), nan_array((4, 33)), ValueError, "suffix_output", "3")


def test_vllm_error_names_prefix_lse_in_tokens_heads_layout(rng):
    """An LSE laid out [tokens, heads] (not vLLM's [heads, tokens]) is refused, naming prefix_lse."""
    x = vllm_inputs(rng)
    x["prefix_lse"] = np.ascontiguousarray(x["prefix_lse"].T)
    _call_and_expect(x, nan_array((33, 4, 128), "float16"), nan_array((4, 33)), ValueError, "prefix_lse")


def test_vllm_error_names_suffix_lse_dtype(rng):
    x = vllm_inputs(rng)
    x["suffix_lse"] = x["suffix_lse"].astype(np.float16)
    _call_and_expect(x, nan_array((33, 4, 128), "float16"), nan_array((4, 33)), TypeError, "suffix_lse", "float32")


def test_vllm_error_names_output_shape(rng):
    x = vllm_inputs(rng)
    _call_and_expect(x, nan_array((33, 4, 64), "float16"), nan_array((4, 33)), ValueError, "output", "64", "128")


def test_vllm_error_names_output_lse_shape(rng):
    x = vllm_inputs(rng)
    _call_and_expect(x, nan_array((33, 4, 128), "float16"), nan_array((33, 4)), ValueError, "output_lse")


def test_vllm_error_names_read_only_output(rng):
    x = vllm_inputs(rng)
    output = nan_array((33, 4, 128), "float16")
    output.setflags(write=False)
    _call_and_expect(x, output, nan_array((4, 33)), ValueError, "output")


def test_vllm_error_names_prefill_tokens_with_context_past_the_end(rng):
    x = vllm_inputs(rng)
    _call_and_expect(
        x, nan_array((33, 4, 128), "float16"), nan_array((4, 33)), ValueError,
        "prefill_tokens_with_context", "34", prefill_tokens_with_context=34,
    )


def test_vllm_error_names_a_non_array_prefix_output(rng):
    x = vllm_inputs(rng)
    x["prefix_output"] = x["prefix_output"].tolist()
    _call_and_expect(x, nan_array((33, 4, 128), "float16"), nan_array((4, 33)), TypeError, "prefix_output")


# --------------------------------------------------------------------------------------------------
# the raw layer
def _raises(exc, words, out_array, out_lse_array, **kw):
    with pytest.raises(exc) as info:
        raw.merge(**kw)
    msg = str(info.value)
    for w in words:
        assert names(w, msg), f"{w!r} not in the message {msg!r}"
    assert all_nan(out_array) and all_nan(out_lse_array), "output written before the error"


def _good(rng):
    o_a, lse_a = random_state(rng, 8, 2, 8)
    o_b, lse_b = random_state(rng, 8, 2, 8)
    out = nan_array(o_a.shape)
    out_lse = nan_array(lse_a.shape)
    kw = dict(
        tokens=8, heads=2, head_size=8, out=o_desc(out), o_a=o_desc(o_a), lse_a=lse_desc(lse_a),
        o_b=o_desc(o_b), lse_b=lse_desc(lse_b), out_lse=lse_desc(out_lse), device="cpu",
    )
    return out, out_lse, kw, (o_a, lse_a, o_b, lse_b)


def test_raw_error_bad_dtype_name(rng):
    out, out_lse, kw, keep = _good(rng)
    kw["o_b"] = (kw["o_b"][0], "float64") + kw["o_b"][2:]
    _raises(TypeError, ["o_b", "float64"], out, out_lse, **kw)


def test_raw_error_mismatched_input_dtypes(rng):
    out, out_lse, kw, keep = _good(rng)
    kw["o_b"] = (kw["o_b"][0], "float16") + kw["o_b"][2:]
    _raises(TypeError, ["o_b", "float16", "float32"], out, out_lse, **kw)


def test_raw_error_negative_stride(rng):
    out, out_lse, kw, keep = _good(rng)
    kw["lse_a"] = (kw["lse_a"][0], -2, 1)
    _raises(ValueError, ["lse_a", "-2"], out, out_lse, **kw)


def test_raw_error_overlapping_output(rng):
    out, out_lse, kw, keep = _good(rng)
    kw["out"] = (kw["out"][0], "float32", 0, 8)  # every token onto one row
    _raises(ValueError, ["out"], out, out_lse, **kw)


def test_raw_error_overlapping_output_lse(rng):
    out, out_lse, kw, keep = _good(rng)
    kw["out_lse"] = (kw["out_lse"][0], 2, 0)
    _raises(ValueError, ["out_lse"], out, out_lse, **kw)


def test_raw_error_negative_tokens(rng):
    out, out_lse, kw, keep = _good(rng)
    kw["tokens"] = -1
    _raises(ValueError, ["tokens", "-1"], out, out_lse, **kw)


def test_raw_error_zero_head_size(rng):
    out, out_lse, kw, keep = _good(rng)
    kw["head_size"] = 0
    _raises(ValueError, ["head_size"], out, out_lse, **kw)


def test_raw_error_misaligned_pointer(rng):
    out, out_lse, kw, keep = _good(rng)
    kw["o_a"] = (kw["o_a"][0] + 1,) + kw["o_a"][1:]  # not float32-aligned
    _raises(ValueError, ["o_a"], out, out_lse, **kw)


def test_raw_error_null_pointer(rng):
    out, out_lse, kw, keep = _good(rng)
    kw["lse_b"] = (0,) + kw["lse_b"][1:]
    _raises((TypeError, ValueError), ["lse_b"], out, out_lse, **kw)


def test_raw_error_bad_device(rng):
    out, out_lse, kw, keep = _good(rng)
    kw["device"] = "tpu"
    _raises(ValueError, ["device", "tpu"], out, out_lse, **kw)


def test_raw_error_bad_base(rng):
    out, out_lse, kw, keep = _good(rng)
    kw["base"] = 10
    _raises(ValueError, ["base", "10"], out, out_lse, **kw)


def test_raw_error_a_tokens_past_tokens(rng):
    out, out_lse, kw, keep = _good(rng)
    kw["a_tokens"] = 9
    _raises(ValueError, ["a_tokens", "9"], out, out_lse, **kw)


def test_raw_error_malformed_descriptor(rng):
    out, out_lse, kw, keep = _good(rng)
    kw["o_a"] = kw["o_a"][:2]
    _raises((TypeError, ValueError), ["o_a"], out, out_lse, **kw)


@pytest.mark.parametrize("framework", ["numpy", "torch"])
def test_raw_error_a_dtype_object_instead_of_a_name(rng, framework):
    out, out_lse, kw, keep = _good(rng)
    if framework == "torch":
        dtype = pytest.importorskip("torch").float32
    else:
        dtype = np.dtype("float32")
    kw["o_a"] = (kw["o_a"][0], dtype) + kw["o_a"][2:]
    with pytest.raises(TypeError) as info:
        raw.merge(**kw)
    msg = str(info.value)
    for w in ["o_a", "float32", "float16", "bfloat16", "float8_e4m3fn", repr(dtype)]:
        assert w in msg, f"{w!r} not in the message {msg!r}"
    assert "C++" not in msg, msg
    assert all_nan(out) and all_nan(out_lse), "output written before the error"


def test_raw_error_a_negative_pointer(rng):
    out, out_lse, kw, keep = _good(rng)
    kw["o_b"] = (-64,) + kw["o_b"][1:]
    _raises(ValueError, ["o_b", "ptr", "-64"], out, out_lse, **kw)


def test_raw_error_a_stride_that_is_not_an_int(rng):
    out, out_lse, kw, keep = _good(rng)
    kw["lse_b"] = kw["lse_b"][:2] + (1.0,)
    _raises(TypeError, ["lse_b", "stride_1", "1.0"], out, out_lse, **kw)


# --------------------------------------------------------------------------------------------------
# meta tensors: refused naming the caller's argument, with no C++ backtrace


@pytest.mark.parametrize("meta", ["o_a", "o_b"])
def test_a_meta_tensor_is_refused_by_its_own_name(rng, meta):
    torch = pytest.importorskip("torch")
    a = {k: torch.from_numpy(v) for k, v in good(rng).items()}
    a[meta] = torch.empty(a[meta].shape, device="meta")
    with pytest.raises(ValueError) as info:  # no out=: attnmerge allocates it like o_b, on the meta device
        attnmerge.merge(a["o_a"], a["lse_a"], a["o_b"], a["lse_b"])
    msg = str(info.value)
    assert msg.startswith(f"{meta}: "), msg
    assert "meta tensors are not supported outside torch.compile tracing" in msg, msg
    assert not names("out", msg), f"the caller passed no out, yet the message blames it: {msg!r}"
    assert "\n" not in msg and "frame #" not in msg, f"a backtrace in the message: {msg!r}"


def test_poisoned_output_is_all_nan_before_the_call():
    # guards the error tests' "nothing is written" check
    assert all_nan(nan_array((3, 2, 4), "bfloat16")) and all_nan(nan_array((3, 2), "float32"))
    assert nan_array((1,), "bfloat16").dtype.name == "bfloat16"
