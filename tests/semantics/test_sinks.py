"""Attention sinks: merge, merge_states and merge_varlen with `sink`, against the oracle, on every
device (merge_share's are in test_merge_share.py).

merge(o_a, lse_a, o_b, lse_b, *, sink=None, ...), merge_states(o, lse, *, sink=None, ...),
merge_varlen(o, lse, indptr, *, sink=None, ...)

sink: float32 [heads], any stride: each head's sink logit in the LSE's base, one more state of
every row of its head whose O is 0 (oracle.sink_state):

    m = max(sink, max_i lse_i),  W = exp(sink - m) + sum_i exp(lse_i - m),
    O = sum_i (exp(lse_i - m) / W) O_i,  LSE = m + log W

A row with no states gets O = 0 and LSE = sink; a sink of -inf (or +inf, an empty part) adds
nothing; a NaN sink makes the rows of its head NaN.  The in-place merge refuses a sink (a chain of
them takes it as its first state), and shapes and dtypes are checked like any argument's (tests/errors/bad_inputs.py); gradients are in
tests/interop/test_torch_autograd.py and test_jax_ffi.py; the GPU kernels' paths with a sink in
test_forward_kernel_emulated.py.
"""

from __future__ import annotations

import numpy as np
import pytest

import attnmerge
from oracle import (DTYPES, assert_group_fp8_close, assert_merge_matches, random_lse, random_o,
                    random_stacked, reference_merge, reference_merge_stacked, reference_merge_varlen, strided_view)

S_VALUES = (0, 1, 2, 3, 8, 64, 257)


def states_call(device, o, lse, sink, states_axis=1, out_dtype=None, placed_sink=None, **kw):
    """merge_states on the device, the sink copied there (or `placed_sink`, already there), into
    NaN-poisoned outputs; (out, out_lse) read back."""
    t, h, d = o.shape[1 - states_axis], o.shape[2], o.shape[3]
    out, out_lse = device.nan((t, h, d), out_dtype or o.dtype), device.nan((t, h))
    attnmerge.merge_states(device.put(o), device.put(lse), out=out, out_lse=out_lse, states_axis=states_axis,
                           sink=device.put(sink) if placed_sink is None else placed_sink, **kw)
    return device.get(out), device.get(out_lse)


def varlen_call(device, o, lse, indptr, sink, out_dtype=None, **kw):
    rows, h, d = len(indptr) - 1, o.shape[1], o.shape[2]
    out, out_lse = device.nan((rows, h, d), out_dtype or o.dtype), device.nan((rows, h))
    attnmerge.merge_varlen(device.put(o), device.put(lse), device.put(np.asarray(indptr, np.int64)), out=out,
                           out_lse=out_lse, sink=device.put(sink), **kw)
    return device.get(out), device.get(out_lse)


def sinks(rng, heads, lse_scale=3.0):
    return random_lse(rng, (heads,), lse_scale)


# --------------------------------------------------------------------------------------------------
# the formula


@pytest.mark.parametrize("base", ("e", 2))
@pytest.mark.parametrize("states_axis", (0, 1))
@pytest.mark.parametrize("s", S_VALUES)
def test_merge_states_with_a_sink(rng, device, s, states_axis, base):
    o, lse = random_stacked(rng, 9, s, 4, 40, states_axis=states_axis)
    sink = sinks(rng, 4)
    out, out_lse = states_call(device, o, lse, sink, states_axis, base=base)
    ref = reference_merge_stacked(o, lse, states_axis=states_axis, base=base, sink=sink)
    assert_merge_matches(out, out_lse, ref, "float32")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("s", (16, 64, 128))
def test_decode_shapes_with_a_sink(rng, device, s, dtype):
    """Few rows, many states: split-KV decode (on the GPU the state-parallel kernel)."""
    o, lse = random_stacked(rng, 16, s, 32, 128, dtype=dtype)
    sink = sinks(rng, 32)
    out, out_lse = states_call(device, o, lse, sink)
    assert_merge_matches(out, out_lse, reference_merge_stacked(o, lse, sink=sink), dtype)


def test_float32_states_into_bfloat16_with_a_sink(rng, device):
    """FA3's combine: float32 partials into a bfloat16 output."""
    o, lse = random_stacked(rng, 16, 96, 8, 128, dtype="float32")
    sink = sinks(rng, 8)
    out, out_lse = states_call(device, o, lse, sink, out_dtype="bfloat16")
    assert_merge_matches(out, out_lse, reference_merge_stacked(o, lse, sink=sink), "bfloat16")


def merge_call(device, o_a, lse_a, o_b, lse_b, sink, out_dtype=None, **kw):
    """merge on the device into NaN-poisoned outputs; (out, out_lse) read back."""
    out, out_lse = device.nan(o_b.shape, out_dtype or o_b.dtype), device.nan(lse_b.shape)
    attnmerge.merge(*[device.put(x) for x in (o_a, lse_a, o_b, lse_b)], out=out, out_lse=out_lse,
                    sink=device.put(sink), **kw)
    return device.get(out), device.get(out_lse)


@pytest.mark.parametrize("base", ("e", 2))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", (1, 16, 200))
def test_merge_with_a_sink(rng, device, tokens, dtype, base):
    """The two-way merge with a sink (cascade attention's prefix and suffix, the sink added once):
    a NaN sink's head NaN, an empty part and an empty row among the others."""
    h, d = 4, 64
    o_a, lse_a = random_o(rng, (tokens, h, d), dtype), random_lse(rng, (tokens, h))
    o_b, lse_b = random_o(rng, (tokens, h, d), dtype), random_lse(rng, (tokens, h))
    lse_a[0, 1] = -np.inf
    lse_a[-1, 2] = lse_b[-1, 2] = -np.inf
    sink = sinks(rng, h)
    sink[3] = np.nan
    out, out_lse = merge_call(device, o_a, lse_a, o_b, lse_b, sink, base=base)
    ref = reference_merge(o_a, lse_a, o_b, lse_b, base=base, sink=sink)
    assert np.isnan(out[:, 3]).all() and np.isnan(out_lse[:, 3]).all()
    assert_merge_matches(out, out_lse, ref, dtype)
    np.testing.assert_array_equal(out_lse[-1, 2], sink[2])  # a row of no states: LSE = the sink, O = 0
    assert (out[-1, 2] == 0).all()


@pytest.mark.parametrize("layout", ("heads_first", "a_tokens", "mixed_bases", "float32_into_bf16"))
def test_merge_with_a_sink_and_the_two_way_options(rng, device, layout):
    """With vLLM's [heads, tokens] LSEs (tiled rows past 64 tokens on the GPU), a_tokens, LSEs of
    two bases (the sink in a's), and float32 states into a bfloat16 output."""
    t, h, d = 130, 3, 128
    o_a, lse_a = random_o(rng, (t, h, d)), random_lse(rng, (t, h))
    o_b, lse_b = random_o(rng, (t, h, d)), random_lse(rng, (t, h))
    sink = sinks(rng, h)
    kw, ref_kw, out_dtype = {}, {}, None
    if layout == "heads_first":
        lse_a, lse_b = np.ascontiguousarray(lse_a.T).T, np.ascontiguousarray(lse_b.T).T
    elif layout == "a_tokens":
        kw = ref_kw = dict(a_tokens=50)
    elif layout == "float32_into_bf16":
        out_dtype = "bfloat16"
    if layout == "mixed_bases":  # lse_b natural, a's (and the sink's) base 2
        out, out_lse = merge_call(device, o_a, lse_a, o_b, lse_b, sink, base=(2, "e"))
        ref = reference_merge(o_a, lse_a, o_b, lse_b / np.log(2.0), base=2, sink=sink)
    else:
        out, out_lse = merge_call(device, o_a, lse_a, o_b, lse_b, sink, out_dtype, **kw)
        ref = reference_merge(o_a, lse_a, o_b, lse_b, sink=sink, **ref_kw)
    assert_merge_matches(out, out_lse, ref, out_dtype or "float32")


def test_a_merge_into_its_own_lse_takes_no_sink(rng, device):
    """out_lse given as lse_a (or lse_b) runs the merge in place, which takes no sink: refused by
    name before any write; the output O alone may still be an input's."""
    o_a, lse_a = random_o(rng, (6, 2, 32)), random_lse(rng, (6, 2))
    o_b, lse_b = random_o(rng, (6, 2, 32)), random_lse(rng, (6, 2))
    d = [device.put(x) for x in (o_a, lse_a, o_b, lse_b)]
    sink = device.put(sinks(rng, 2))
    for own in (1, 3):
        with pytest.raises(ValueError, match=f"^sink: expected none where out_lse is {('lse_a', 'lse_b')[own // 2]} "
                                             r"\(a merge in place takes no sink\)"):
            attnmerge.merge(*d, out=d[0], out_lse=d[own], sink=sink)
    np.testing.assert_array_equal(device.get(d[0]), o_a)
    np.testing.assert_array_equal(device.get(d[1]), lse_a)
    out_lse = device.nan((6, 2))
    attnmerge.merge(*d, out=d[2], out_lse=out_lse, sink=sink)  # out is o_b: each thread reads its pack first
    assert_merge_matches(device.get(d[2]), device.get(out_lse),
                         reference_merge(o_a, lse_a, o_b, lse_b, sink=device.get(sink)), "float32")


def test_merge_with_a_sink_into_per_group_fp8(rng, device):
    o_a, lse_a = random_o(rng, (9, 2, 128), "bfloat16"), random_lse(rng, (9, 2))
    o_b, lse_b = random_o(rng, (9, 2, 128), "bfloat16"), random_lse(rng, (9, 2))
    sink = sinks(rng, 2)
    out, _, scales = attnmerge.merge(*[device.put(x) for x in (o_a, lse_a, o_b, lse_b)], sink=device.put(sink),
                                     group_size=64)
    ref_o, _ = reference_merge(o_a, lse_a, o_b, lse_b, sink=sink)
    assert_group_fp8_close(device.get(out), device.get(scales), ref_o, 64)


def test_cascade_attention_with_sinks_is_attention_with_sinks(rng, device):
    """A shared prefix's attention and each request's suffix's, each without the sink, merged with
    it: gpt-oss's attention with sinks over the whole key set."""
    t, h, d, prefix, suffix = 5, 2, 32, 40, 24
    q, k, v = (rng.standard_normal(s) for s in ((t, h, d), (prefix + suffix, h, d), (prefix + suffix, h, d)))
    sink = rng.standard_normal(h)
    scores = np.einsum("thd,khd->thk", q, k) / np.sqrt(d)
    full = np.concatenate([scores, np.broadcast_to(sink[None, :, None], (t, h, 1))], axis=-1)
    m = full.max(-1, keepdims=True)
    p = np.exp(full - m) / np.exp(full - m).sum(-1, keepdims=True)
    want, want_lse = np.einsum("thk,khd->thd", p[..., :-1], v), np.log(np.exp(full - m).sum(-1)) + m[..., 0]

    def part(keys):
        s = scores[..., keys]
        lse = np.log(np.exp(s - s.max(-1, keepdims=True)).sum(-1)) + s.max(-1)
        return np.einsum("thk,khd->thd", np.exp(s - lse[..., None]), v[keys]).astype(np.float32), lse.astype(np.float32)

    o_p, lse_p = part(np.arange(prefix))
    o_s, lse_s = part(np.arange(prefix, prefix + suffix))
    out, out_lse = merge_call(device, o_p, lse_p, o_s, lse_s, sink.astype(np.float32))
    assert_merge_matches(out, out_lse, (want, want_lse), "float32")


@pytest.mark.parametrize("base", ("e", 2))
@pytest.mark.parametrize("counts", [(0, 1, 2, 5, 0, 17), (64, 0, 3), (0, 0)])
def test_merge_varlen_with_a_sink(rng, device, counts, base):
    indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    o, lse = random_o(rng, (int(indptr[-1]), 3, 64)), random_lse(rng, (int(indptr[-1]), 3))
    sink = sinks(rng, 3)
    out, out_lse = varlen_call(device, o, lse, indptr, sink, base=base)
    assert_merge_matches(out, out_lse, reference_merge_varlen(o, lse, indptr, base=base, sink=sink), "float32")


# --------------------------------------------------------------------------------------------------
# edges


@pytest.mark.parametrize("op", ("states", "varlen"))
def test_a_row_with_no_states_takes_the_sink(rng, device, op):
    """O = 0 and LSE = the sink, exactly: the sink is the row's one state of weight."""
    sink = sinks(rng, 5)
    if op == "states":
        o, lse = random_stacked(rng, 3, 0, 5, 24)
        out, out_lse = states_call(device, o, lse, sink)
    else:
        o, lse = random_o(rng, (4, 5, 24)), random_lse(rng, (4, 5))
        out, out_lse = varlen_call(device, o, lse, [0, 0, 4, 4], sink)
        out, out_lse = out[[0, 2]], out_lse[[0, 2]]
    assert (out == 0).all()
    assert (out_lse == sink[None, :]).all()


@pytest.mark.parametrize("s", (0, 2, 9, 64))
def test_empty_and_nan_sinks(rng, device, s):
    """-inf and +inf add nothing (the merge without a sink), NaN makes its head's rows NaN."""
    o, lse = random_stacked(rng, 6, s, 4, 32)
    sink = np.array([-np.inf, np.inf, np.nan, 1.5], np.float32)
    out, out_lse = states_call(device, o, lse, sink)
    ref_o, ref_lse = reference_merge_stacked(o, lse, sink=sink)
    none_o, none_lse = reference_merge_stacked(o, lse)
    np.testing.assert_array_equal(ref_o[:, :2], none_o[:, :2])
    np.testing.assert_array_equal(ref_lse[:, :2], none_lse[:, :2])
    assert np.isnan(out[:, 2]).all() and np.isnan(out_lse[:, 2]).all()
    assert not np.isnan(out[:, [0, 1, 3]]).any() and not np.isnan(out_lse[:, [0, 1, 3]]).any()
    assert_merge_matches(out, out_lse, (ref_o, ref_lse), "float32")


def test_a_sink_far_above_the_states_takes_the_weight(rng, device):
    """A sink 30 above every LSE: O shrinks by about e^-30 and LSE is the sink's (no overflow)."""
    o, lse = random_stacked(rng, 5, 8, 3, 16)
    sink = (lse.max(axis=(0, 1)) + 30.0).astype(np.float32)
    out, out_lse = states_call(device, o, lse, sink)
    assert_merge_matches(out, out_lse, reference_merge_stacked(o, lse, sink=sink), "float32")
    assert np.abs(out).max() < 1e-9
    np.testing.assert_allclose(out_lse, np.broadcast_to(sink, out_lse.shape), rtol=1e-6)


def test_a_strided_sink(rng, device):
    """The sink is read through its stride (here every other float of a NaN-filled buffer)."""
    o, lse = random_stacked(rng, 7, 5, 4, 32)
    sink = sinks(rng, 4)
    view, buf = strided_view(sink, steps={0: 2})
    dview, _ = device.strided(view, buf)
    out, out_lse = states_call(device, o, lse, sink, placed_sink=dview)
    assert_merge_matches(out, out_lse, reference_merge_stacked(o, lse, sink=sink), "float32")


def test_one_sink_for_every_head(rng):
    """A stride of 0: every head reads the same sink (NumPy, which has zero strides)."""
    o, lse = random_stacked(rng, 7, 5, 4, 32)
    one = np.broadcast_to(np.float32(0.75), (4,))
    out, out_lse = attnmerge.merge_states(o, lse, sink=one)
    assert_merge_matches(out, out_lse, reference_merge_stacked(o, lse, sink=np.full(4, 0.75, np.float32)), "float32")


def test_the_allocated_outputs_count_the_sink(rng, device):
    """Results allocated by the call (no out=) are those of the given outputs."""
    o, lse = random_stacked(rng, 4, 6, 2, 16)
    sink = sinks(rng, 2)
    out, out_lse = attnmerge.merge_states(device.put(o), device.put(lse), sink=device.put(sink))
    assert_merge_matches(device.get(out), device.get(out_lse), reference_merge_stacked(o, lse, sink=sink), "float32")


# --------------------------------------------------------------------------------------------------
# what a sink is for


def test_split_kv_attention_with_sinks_is_attention_with_sinks(rng, device):
    """gpt-oss's attention with sinks is a softmax over each head's scores and its sink logit, the
    sink's column then dropped.  Split the keys into chunks, attend to each without the sink
    (O_i, LSE_i), and merge_states with the sink: the same attention."""
    t, h, d, keys, chunks = 4, 3, 32, 96, 6
    q, k, v = (rng.standard_normal(s) for s in ((t, h, d), (keys, h, d), (keys, h, d)))
    sink = rng.standard_normal(h)
    scores = np.einsum("thd,khd->thk", q, k) / np.sqrt(d)  # [t, h, keys]
    full = np.concatenate([scores, np.broadcast_to(sink[None, :, None], (t, h, 1))], axis=-1)
    p = np.exp(full - full.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    want = np.einsum("thk,khd->thd", p[..., :-1], v)
    want_lse = np.log(np.exp(full - full.max(-1, keepdims=True)).sum(-1)) + full.max(-1)
    o = np.empty((t, chunks, h, d))
    lse = np.empty((t, chunks, h))
    for c, part in enumerate(np.split(np.arange(keys), chunks)):
        s = scores[..., part]
        lse[:, c] = np.log(np.exp(s - s.max(-1, keepdims=True)).sum(-1)) + s.max(-1)
        o[:, c] = np.einsum("thk,khd->thd", np.exp(s - lse[:, c, :, None]), v[part])
    out, out_lse = states_call(device, o.astype(np.float32), lse.astype(np.float32), sink.astype(np.float32))
    assert_merge_matches(out, out_lse, (want, want_lse), "float32")


def test_a_chain_of_in_place_merges_takes_the_sink_as_its_first_state(rng, device):
    """What the README says of the ops that take no sink: start the chain from O = 0, LSE = sink."""
    t, s, h, d = 6, 4, 3, 32
    o, lse = random_stacked(rng, t, s, h, d)
    sink = sinks(rng, h)
    acc_o, acc_lse = device.put(np.zeros((t, h, d), np.float32)), device.put(np.broadcast_to(sink, (t, h)).copy())
    for i in range(s):
        attnmerge.merge_inplace(acc_o, acc_lse, device.put(o[:, i]), device.put(lse[:, i]))
    assert_merge_matches(device.get(acc_o), device.get(acc_lse), reference_merge_stacked(o, lse, sink=sink), "float32")
