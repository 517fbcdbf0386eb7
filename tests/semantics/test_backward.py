"""The backward of the merges (issue 16): merge_backward, merge_states_backward, merge_varlen_backward.

For a row with the forward's output O and LSE, the gradients dO and dLSE of them, and states i:

    p_i = b^(lse_i - LSE)      (b = e, or 2 with base=2)
    dO_i = p_i dO,   dlse_i = p_i (dLSE + ln(b) <dO, O_i - O>)

- an empty part (lse -inf or +inf), a part of zero weight and every part of an all-empty row get
  zero gradients, never NaN, whatever their O or dO hold;
- a NaN LSE gives NaN to the gradients of its row's other parts (errors surface);
- the forward's O and LSE are passed in as saved: the backward is a function of them (without O,
  <dO, O> comes from the states: sum_j p_j <dO, O_j>);
- every dtype and stride the forward takes; gradients not asked for are not written.

The oracle (oracle.reference_merge_states_backward) is float64 NumPy written from the formula, and is
itself checked against finite differences of the forward's oracle.  Every spec runs on each device
of the `device` fixture (tests/devices.py): the CPU (NumPy arrays) and, marked `gpu`, CUDA through
PyTorch tensors (skipped without a GPU).  Outputs are
poisoned with NaN before each call; inputs are random, never zeros.  Tolerances: dO_i the forward's
(relative L2, RTOL of its dtype), dlse_i (float32, from float32 arithmetic on exact inputs) GRAD_LSE_RTOL.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import attnmerge
import c_abi
import devices
from oracle import (
    DTYPES,
    LN2,
    assert_o_close,
    np_dtype,
    random_lse,
    random_o,
    reference_merge_stacked,
    reference_merge_states,
    reference_merge_states_backward,
    reference_merge_varlen,
    rel_l2,
    strided_view,
    to_f64,
)

#: dlse is float32 whatever the O dtypes: rel L2 against the oracle (a dot over head_size in float32)
GRAD_LSE_RTOL = 1e-5
#: ... without the forward's O (out None): <dO, O_i - O> is then <dO, O_i> - sum_j p_j <dO, O_j>, a
#: difference of float32 dots whose rounding is relative to the dots, not to their difference
#: (Hypothesis found rows at 3.9e-5 and 5.9e-5 with 1e-5)
GRAD_LSE_RTOL_WITHOUT_O = 1e-4

BASES = ("e", 2)


# --------------------------------------------------------------------------------------------------
# helpers


def forward_states(o, lse, out_dtype, base):
    """The forward's saved results for stacked states o [T, S, H, D]: the float64 oracle rounded to
    out_dtype (O) and float32 (LSE), as a merge would have stored them."""
    ref_o, ref_lse = reference_merge_stacked(o, lse, base=base)
    return ref_o.astype(np.float32).astype(np_dtype(out_dtype)), ref_lse.astype(np.float32)


def expected_states(o, lse, out, out_lse, grad_out, grad_out_lse, base):
    """The oracle for stacked states o [T, S, H, D], lse [T, S, H]: (grad_o, grad_lse) in that layout."""
    g_o, g_l = reference_merge_states_backward(np.moveaxis(to_f64(o), 1, 0), np.moveaxis(to_f64(lse), 1, 0), out,
                                               out_lse, grad_out, grad_out_lse, base=base)
    return np.moveaxis(g_o, 0, 1), np.moveaxis(g_l, 0, 1)


def assert_grads(grad_o, grad_lse, expected, in_dtype, what="", lse_rtol=GRAD_LSE_RTOL):
    assert_o_close(grad_o, expected[0], in_dtype, what + "grad_o")
    a, e = to_f64(grad_lse), expected[1]
    assert np.array_equal(np.isnan(a), np.isnan(e)), f"{what}grad_lse: NaN pattern differs"
    ok = ~np.isnan(e)
    err = rel_l2(a[ok], e[ok])
    assert err <= lse_rtol, f"{what}grad_lse: rel L2 error {err:.3g} > {lse_rtol:g}"


def case(rng, tokens, s, heads, head_size, in_dtype, out_dtype, base, lse_scale=3.0):
    """Random stacked states, the forward's saved results and random incoming gradients (host)."""
    o = random_o(rng, (tokens, s, heads, head_size), in_dtype)
    lse = random_lse(rng, (tokens, s, heads), lse_scale)
    out, out_lse = forward_states(o, lse, out_dtype, base)
    grad_out = random_o(rng, (tokens, heads, head_size), out_dtype)
    grad_out_lse = random_lse(rng, (tokens, heads), 1.0)
    return o, lse, out, out_lse, grad_out, grad_out_lse


# --------------------------------------------------------------------------------------------------
# the oracle itself


@pytest.mark.parametrize("base", BASES)
def test_the_oracle_is_the_gradient_of_the_forward_oracle(rng, base):
    """Central differences of L = <G, O> + <g, LSE> through the float64 forward oracle agree with
    the backward oracle, for every O and LSE element of three states (one of them empty in a row)."""
    s, t, h, d = 3, 2, 2, 5
    o = rng.standard_normal((s, t, h, d))
    lse = 2.0 * rng.standard_normal((s, t, h))
    lse[1, 0, 1] = -np.inf  # an empty part: zero gradients
    big_g, small_g = rng.standard_normal((t, h, d)), rng.standard_normal((t, h))

    def loss(o_, lse_):
        out, out_lse = reference_merge_states(list(o_), list(lse_), base=base)
        return float(np.sum(big_g * out) + np.sum(small_g * out_lse))

    out, out_lse = reference_merge_states(list(o), list(lse), base=base)
    g_o, g_l = reference_merge_states_backward(o, lse, out, out_lse, big_g, small_g, base=base)
    eps = 1e-6
    num_o = np.zeros_like(o)
    for i in np.ndindex(o.shape):
        up, down = o.copy(), o.copy()
        up[i] += eps
        down[i] -= eps
        num_o[i] = (loss(up, lse) - loss(down, lse)) / (2 * eps)
    num_l = np.zeros_like(lse)
    for i in np.ndindex(lse.shape):
        if np.isinf(lse[i]):
            continue  # no neighbourhood to difference in; the gradient is zero by definition
        up, down = lse.copy(), lse.copy()
        up[i] += eps
        down[i] -= eps
        num_l[i] = (loss(o, up) - loss(o, down)) / (2 * eps)
    np.testing.assert_allclose(g_o, num_o, rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(g_l, num_l, rtol=1e-6, atol=1e-8)
    assert g_o[1, 0, 1].tolist() == [0.0] * d and g_l[1, 0, 1] == 0.0


# --------------------------------------------------------------------------------------------------
# merge_states_backward


@pytest.mark.parametrize("base", BASES)
@pytest.mark.parametrize("s", (1, 2, 3, 5, 8, 13))
@pytest.mark.parametrize("out_dtype", DTYPES)
@pytest.mark.parametrize("in_dtype", DTYPES)
def test_merge_states_backward_every_dtype_pair_s_and_base(rng, device, in_dtype, out_dtype, s, base):
    o, lse, out, out_lse, grad_out, grad_out_lse = case(rng, 9, s, 3, 40, in_dtype, out_dtype, base)
    grad_o, grad_lse = device.nan(o.shape, in_dtype), device.nan(lse.shape)
    res = attnmerge.merge_states_backward(device.put(grad_out), device.put(grad_out_lse), device.put(out), device.put(out_lse),
                                          device.put(o), device.put(lse), grad_o=grad_o, grad_lse=grad_lse, base=base)
    assert res[0] is grad_o and res[1] is grad_lse
    assert_grads(device.get(grad_o), device.get(grad_lse), expected_states(o, lse, out, out_lse, grad_out, grad_out_lse, base),
                 in_dtype)


@pytest.mark.parametrize("head_size", (1, 3, 8, 72, 128, 320, 1000))
@pytest.mark.parametrize("in_dtype", ("float32", "bfloat16"))
def test_merge_states_backward_head_sizes(rng, device, in_dtype, head_size):
    """Odd sizes (scalar accesses), packs that are not a power of two, rows of more packs than a warp
    has lanes, and more than the CPU path holds at once (256)."""
    o, lse, out, out_lse, grad_out, grad_out_lse = case(rng, 4, 3, 2, head_size, in_dtype, in_dtype, "e")
    grad_o, grad_lse = attnmerge.merge_states_backward(device.put(grad_out), device.put(grad_out_lse), device.put(out),
                                                       device.put(out_lse), device.put(o), device.put(lse))
    assert_grads(device.get(grad_o), device.get(grad_lse), expected_states(o, lse, out, out_lse, grad_out, grad_out_lse, "e"),
                 in_dtype)


def test_merge_states_backward_many_states(rng, device):
    """More states than a chunk (2 on the GPU with the forward's O), split over groups of threads
    on the GPU (up to 8 here), and more than the CPU's block of dots (64)."""
    o, lse, out, out_lse, grad_out, grad_out_lse = case(rng, 3, 70, 2, 24, "float32", "float32", 2)
    grad_o, grad_lse = attnmerge.merge_states_backward(device.put(grad_out), device.put(grad_out_lse), device.put(out),
                                                       device.put(out_lse), device.put(o), device.put(lse), base=2)
    assert_grads(device.get(grad_o), device.get(grad_lse), expected_states(o, lse, out, out_lse, grad_out, grad_out_lse, 2),
                 "float32")


def test_merge_states_backward_allocates_like_the_inputs(rng, device):
    o, lse, out, out_lse, grad_out, grad_out_lse = case(rng, 5, 3, 2, 16, "bfloat16", "float32", "e")
    grad_o, grad_lse = attnmerge.merge_states_backward(device.put(grad_out), device.put(grad_out_lse), device.put(out),
                                                       device.put(out_lse), device.put(o), device.put(lse))
    assert tuple(grad_o.shape) == o.shape and tuple(grad_lse.shape) == lse.shape
    assert "bfloat16" in str(grad_o.dtype) and "float32" in str(grad_lse.dtype)
    assert type(grad_o) is type(device.put(o))


@pytest.mark.parametrize("states_axis", (0, 1))
def test_merge_states_backward_strided_everywhere(rng, device, states_axis):
    """Every array a strided view into a NaN-filled buffer: padded, offset (unaligned), permuted,
    stepped; the gradients land in their views and nowhere else."""
    t, s, h, d = 6, 3, 4, 24
    o, lse, out, out_lse, grad_out, grad_out_lse = case(rng, t, s, h, d, "float16", "float32", "e")
    want = expected_states(o, lse, out, out_lse, grad_out, grad_out_lse, "e")
    if states_axis == 0:  # the all-gather's [S, tokens, ...]
        o, lse, want = np.swapaxes(o, 0, 1), np.swapaxes(lse, 0, 1), (np.swapaxes(want[0], 0, 1), np.swapaxes(want[1], 0, 1))
    ov, ob = strided_view(o, order=(2, 0, 1, 3), pad=3)
    lv, lb = strided_view(lse, order=(2, 1, 0), steps={0: 2})
    gov, gob = strided_view(np.zeros(o.shape, o.dtype), order=(1, 0, 2, 3), offset=1, pad=2)
    glv, glb = strided_view(np.zeros(lse.shape, np.float32), order=(0, 2, 1), pad=1)
    outv, outb = strided_view(out, order=(1, 0, 2), offset=1)
    goutv, goutb = strided_view(grad_out, steps={1: 2})
    olv, olb = strided_view(out_lse, order=(1, 0))
    golv, golb = strided_view(grad_out_lse, steps={0: 3})
    gov[...] = np.nan
    glv[...] = np.nan
    tg, tgb = device.strided(gov, gob)
    tl, tlb = device.strided(glv, glb)
    attnmerge.merge_states_backward(device.strided(goutv, goutb)[0], device.strided(golv, golb)[0],
                                    device.strided(outv, outb)[0], device.strided(olv, olb)[0], device.strided(ov, ob)[0],
                                    device.strided(lv, lb)[0], grad_o=tg, grad_lse=tl, states_axis=states_axis)
    got_o, clean_o = device.readback(gov, gob, tg, tgb)
    got_l, clean_l = device.readback(glv, glb, tl, tlb)
    assert clean_o and clean_l, "a gradient was written outside its view"
    assert_grads(got_o, got_l, want, "float16")


def test_empty_parts_and_all_empty_rows_get_zero_gradients(rng, device):
    """Whatever an empty part's O and dO hold (NaN here), its gradients are exactly zero, and so
    are those of every part of an all-empty row (LSE -inf)."""
    t, s, h, d = 4, 3, 2, 16
    o, lse, _, _, grad_out, grad_out_lse = case(rng, t, s, h, d, "float32", "float32", "e")
    lse[0, 1, 0] = -np.inf  # one empty part (its O is NaN)
    o[0, 1, 0] = np.nan
    lse[1, 2, 1] = np.inf  # FlashAttention-2's empty part
    o[1, 2, 1] = np.nan
    lse[2, :, 0] = -np.inf  # an all-empty row, NaN in its O
    o[2, :, 0] = np.nan
    lse[3, :, 1] = [np.inf, -np.inf, np.inf]
    out, out_lse = forward_states(o, lse, "float32", "e")
    assert out_lse[2, 0] == -np.inf and np.all(out[2, 0] == 0)
    grad_out[2, 0] = np.nan  # even a NaN dO of an all-empty row gives zeros
    grad_o, grad_lse = attnmerge.merge_states_backward(device.put(grad_out), device.put(grad_out_lse), device.put(out),
                                                       device.put(out_lse), device.put(o), device.put(lse))
    g_o, g_l = device.get(grad_o), device.get(grad_lse)
    for token, state, head in [(0, 1, 0), (1, 2, 1)] + [(2, i, 0) for i in range(s)] + [(3, i, 1) for i in range(s)]:
        assert np.all(g_o[token, state, head] == 0) and g_l[token, state, head] == 0, (token, state, head)
    assert not np.isnan(g_o).any() and not np.isnan(g_l).any()
    assert_grads(g_o, g_l, expected_states(o, lse, out, out_lse, grad_out, grad_out_lse, "e"), "float32")


def test_a_nan_lse_makes_the_rest_of_its_row_nan(rng, device):
    """A NaN LSE (an error upstream) surfaces in the gradients of its row's parts, not elsewhere;
    an empty part of that row still gets zeros."""
    o, lse, _, _, grad_out, grad_out_lse = case(rng, 3, 3, 2, 8, "float32", "float32", "e")
    lse[1, 0, 1] = np.nan
    lse[1, 2, 1] = -np.inf
    out, out_lse = forward_states(o, lse, "float32", "e")
    assert np.isnan(out_lse[1, 1])
    grad_o, grad_lse = attnmerge.merge_states_backward(device.put(grad_out), device.put(grad_out_lse), device.put(out),
                                                       device.put(out_lse), device.put(o), device.put(lse))
    g_o, g_l = device.get(grad_o), device.get(grad_lse)
    assert np.isnan(g_o[1, :2, 1]).all() and np.isnan(g_l[1, :2, 1]).all()
    assert np.all(g_o[1, 2, 1] == 0) and g_l[1, 2, 1] == 0
    g_o[1, :, 1], g_l[1, :, 1] = 0, 0
    assert not np.isnan(g_o).any() and not np.isnan(g_l).any()


def test_without_grad_out_lse_dlse_is_zero(rng, device):
    o, lse, out, out_lse, grad_out, _ = case(rng, 5, 4, 3, 16, "bfloat16", "bfloat16", 2)
    grad_o, grad_lse = attnmerge.merge_states_backward(device.put(grad_out), None, device.put(out), device.put(out_lse),
                                                       device.put(o), device.put(lse), base=2)
    assert_grads(device.get(grad_o), device.get(grad_lse), expected_states(o, lse, out, out_lse, grad_out, None, 2), "bfloat16")


def test_gradients_not_asked_for_are_not_computed(rng, device):
    o, lse, out, out_lse, grad_out, grad_out_lse = case(rng, 5, 3, 2, 16, "float32", "float32", "e")
    want = expected_states(o, lse, out, out_lse, grad_out, grad_out_lse, "e")
    args = [device.put(x) for x in (grad_out, grad_out_lse, out, out_lse, o, lse)]
    grad_o, grad_lse = attnmerge.merge_states_backward(*args, needs_grad=(True, False))
    assert grad_lse is None
    assert_o_close(device.get(grad_o), want[0], "float32")
    grad_o, grad_lse = attnmerge.merge_states_backward(*args, needs_grad=(False, True))
    assert grad_o is None
    assert rel_l2(device.get(grad_lse), want[1]) <= GRAD_LSE_RTOL


@pytest.mark.parametrize("s", (2, 3, 8, 70))
@pytest.mark.parametrize("in_dtype", ("float32", "bfloat16"))
def test_without_out_the_dot_with_o_comes_from_the_states(rng, device, in_dtype, s):
    """out=None: <dO, O> is sum_j p_j <dO, O_j>, the exact O's (no O read); rows of more states than
    a chunk (4 on the GPU, 64 on the CPU) finish their dots in a second pass."""
    o, lse, _, out_lse, grad_out, grad_out_lse = case(rng, 6, s, 3, 40, in_dtype, in_dtype, 2)
    exact_o = reference_merge_stacked(o, lse, base=2)[0]
    lse[0, 0, 1] = -np.inf  # an empty part, NaN in its O: still zeros, and no NaN in its row
    o[0, 0, 1] = np.nan
    exact_o[0, 1] = reference_merge_stacked(o[:1], lse[:1], base=2)[0][0, 1]
    out_lse[0, 1] = reference_merge_stacked(o[:1], lse[:1], base=2)[1][0, 1]
    grad_o, grad_lse = device.nan(o.shape, in_dtype), device.nan(lse.shape)
    attnmerge.merge_states_backward(device.put(grad_out), device.put(grad_out_lse), None, device.put(out_lse), device.put(o),
                                    device.put(lse), grad_o=grad_o, grad_lse=grad_lse, base=2)
    assert_grads(device.get(grad_o), device.get(grad_lse),
                 expected_states(o, lse, exact_o, out_lse, grad_out, grad_out_lse, 2), in_dtype)


def test_without_out_two_way_and_varlen(rng, device):
    o, lse, _, out_lse, grad_out, grad_out_lse = case(rng, 7, 2, 3, 24, "float16", "float16", "e")
    exact_o = reference_merge_stacked(o, lse)[0]
    want = expected_states(o, lse, exact_o, out_lse, grad_out, grad_out_lse, "e")
    res = attnmerge.merge_backward(device.put(grad_out), device.put(grad_out_lse), None, device.put(out_lse), device.put(o[:, 0]),
                                   device.put(lse[:, 0]), device.put(o[:, 1]), device.put(lse[:, 1]))
    for i in range(2):
        assert_grads(device.get(res[2 * i]), device.get(res[2 * i + 1]), (want[0][:, i], want[1][:, i]), "float16")
    indptr = np.array([0, 3, 3, 9], np.int32)
    v, sv = random_o(rng, (9, 2, 16)), random_lse(rng, (9, 2))
    out, out_lse = attnmerge.merge_varlen(v, sv, indptr)
    exact = reference_merge_varlen(v, sv, indptr)[0]
    grad_out, grad_out_lse = random_o(rng, out.shape), random_lse(rng, out_lse.shape, 1.0)
    g = attnmerge.merge_varlen_backward(device.put(grad_out), device.put(grad_out_lse), None, device.put(out_lse), device.put(v),
                                        device.put(sv), device.put(indptr))
    assert_grads(device.get(g[0]), device.get(g[1]), varlen_expected(v, sv, indptr, exact, out_lse, grad_out, grad_out_lse, "e"),
                 "float32")


# --------------------------------------------------------------------------------------------------
# merge_backward (two-way)


@pytest.mark.parametrize("base", BASES)
@pytest.mark.parametrize("out_dtype", DTYPES)
@pytest.mark.parametrize("in_dtype", DTYPES)
def test_merge_backward_every_dtype_pair_and_base(rng, device, in_dtype, out_dtype, base):
    o, lse, out, out_lse, grad_out, grad_out_lse = case(rng, 11, 2, 3, 64, in_dtype, out_dtype, base)
    want = expected_states(o, lse, out, out_lse, grad_out, grad_out_lse, base)
    grads = [device.nan((11, 3, 64), in_dtype), device.nan((11, 3)), device.nan((11, 3, 64), in_dtype), device.nan((11, 3))]
    res = attnmerge.merge_backward(device.put(grad_out), device.put(grad_out_lse), device.put(out), device.put(out_lse),
                                   device.put(o[:, 0]), device.put(lse[:, 0]), device.put(o[:, 1]), device.put(lse[:, 1]),
                                   grad_o_a=grads[0], grad_lse_a=grads[1], grad_o_b=grads[2], grad_lse_b=grads[3],
                                   base=base)
    assert all(r is g for r, g in zip(res, grads))
    for i, name in enumerate("ab"):
        assert_grads(device.get(res[2 * i]), device.get(res[2 * i + 1]), (want[0][:, i], want[1][:, i]), in_dtype, name + ": ")


def test_merge_backward_lses_heads_first(rng, device):
    """vLLM's [heads, tokens] LSEs, passed as transposed views, gradients of LSE in any layout."""
    o, lse, out, out_lse, grad_out, grad_out_lse = case(rng, 7, 2, 4, 32, "bfloat16", "bfloat16", "e")
    want = expected_states(o, lse, out, out_lse, grad_out, grad_out_lse, "e")
    t = lambda x: device.put(np.ascontiguousarray(x.T)).T  # noqa: E731 - [heads, tokens] storage
    res = attnmerge.merge_backward(device.put(grad_out), t(grad_out_lse), device.put(out), t(out_lse), device.put(o[:, 0]),
                                   t(lse[:, 0]), device.put(o[:, 1]), t(lse[:, 1]), grad_lse_a=device.nan((4, 7)).T)
    for i in range(2):
        assert_grads(device.get(res[2 * i]), device.get(res[2 * i + 1]), (want[0][:, i], want[1][:, i]), "bfloat16")


@pytest.mark.parametrize("a_tokens", (0, 5, 12))
def test_merge_backward_a_tokens(rng, device, a_tokens):
    """Rows from a_tokens on took b alone: b's gradients there are dO and dLSE (p_b = 1), and a's
    gradients cover only the a_tokens tokens the forward read."""
    tokens, h, d = 12, 3, 16
    o_b = random_o(rng, (tokens, h, d), "float32")
    lse_b = random_lse(rng, (tokens, h))
    o_a = random_o(rng, (tokens + 2, h, d), "float32")  # a may be longer: its later tokens unread
    lse_a = random_lse(rng, (tokens + 2, h))
    out, out_lse = attnmerge.merge(o_a, lse_a, o_b, lse_b, a_tokens=a_tokens)
    grad_out, grad_out_lse = random_o(rng, (tokens, h, d)), random_lse(rng, (tokens, h), 1.0)
    res = attnmerge.merge_backward(device.put(grad_out), device.put(grad_out_lse), device.put(out), device.put(out_lse),
                                   device.put(o_a), device.put(lse_a), device.put(o_b), device.put(lse_b), a_tokens=a_tokens)
    g = [device.get(x) for x in res]
    assert g[0].shape == (a_tokens, h, d) and g[1].shape == (a_tokens, h)
    stacked_o = np.stack([np.concatenate([o_a[:a_tokens], np.full((tokens - a_tokens, h, d), np.nan, np.float32)]), o_b], 1)
    stacked_l = np.stack([np.concatenate([lse_a[:a_tokens], np.full((tokens - a_tokens, h), -np.inf, np.float32)]), lse_b], 1)
    want = expected_states(stacked_o, stacked_l, out, out_lse, grad_out, grad_out_lse, "e")
    assert_grads(g[0], g[1], (want[0][:a_tokens, 0], want[1][:a_tokens, 0]), "float32", "a: ")
    assert_grads(g[2], g[3], (want[0][:, 1], want[1][:, 1]), "float32", "b: ")
    assert_o_close(g[2][a_tokens:], to_f64(grad_out[a_tokens:]), "float32")  # p_b = 1: dO itself


def test_merge_backward_agrees_with_merge_states_backward_of_two(rng, device):
    o, lse, out, out_lse, grad_out, grad_out_lse = case(rng, 9, 2, 4, 48, "float16", "float16", 2)
    args = [device.put(x) for x in (grad_out, grad_out_lse, out, out_lse)]
    pair = attnmerge.merge_backward(*args, device.put(o[:, 0]), device.put(lse[:, 0]), device.put(o[:, 1]), device.put(lse[:, 1]),
                                    base=2)
    stack = attnmerge.merge_states_backward(*args, device.put(o), device.put(lse), base=2)
    s_o, s_l = device.get(stack[0]), device.get(stack[1])
    for i in range(2):
        np.testing.assert_array_equal(to_f64(device.get(pair[2 * i])), to_f64(s_o[:, i]))
        np.testing.assert_allclose(device.get(pair[2 * i + 1]), s_l[:, i], rtol=1e-6, atol=1e-7)


def test_merge_backward_one_input_only(rng, device):
    """Gradients of b only (a needs none): a's are neither written nor returned."""
    o, lse, out, out_lse, grad_out, grad_out_lse = case(rng, 6, 2, 2, 16, "float32", "float32", "e")
    want = expected_states(o, lse, out, out_lse, grad_out, grad_out_lse, "e")
    res = attnmerge.merge_backward(device.put(grad_out), device.put(grad_out_lse), device.put(out), device.put(out_lse),
                                   device.put(o[:, 0]), device.put(lse[:, 0]), device.put(o[:, 1]), device.put(lse[:, 1]),
                                   needs_grad=(False, False, True, True))
    assert res[0] is None and res[1] is None
    assert_grads(device.get(res[2]), device.get(res[3]), (want[0][:, 1], want[1][:, 1]), "float32")


# --------------------------------------------------------------------------------------------------
# merge_varlen_backward


def varlen_expected(o, lse, indptr, out, out_lse, grad_out, grad_out_lse, base):
    """Each row's states through the stacked oracle; states no row takes: zeros."""
    want_o, want_l = np.zeros(o.shape), np.zeros(lse.shape)
    for r in range(len(indptr) - 1):
        lo, hi = indptr[r], indptr[r + 1]
        if hi > lo:
            g_o, g_l = reference_merge_states_backward(o[lo:hi, None], lse[lo:hi, None], out[r:r + 1], out_lse[r:r + 1],
                                                       grad_out[r:r + 1], grad_out_lse[r:r + 1], base=base)
            want_o[lo:hi], want_l[lo:hi] = g_o[:, 0], g_l[:, 0]
    return want_o, want_l


@pytest.mark.parametrize("base", BASES)
@pytest.mark.parametrize("index_dtype", ("int32", "int64"))
@pytest.mark.parametrize("in_dtype", DTYPES)
def test_merge_varlen_backward(rng, device, in_dtype, index_dtype, base):
    """Rows of 0 to 9 states, and states before the first row's and after the last row's (no row
    takes them: zero gradients)."""
    counts = [3, 0, 1, 9, 2, 0, 5]
    indptr = np.concatenate([[2], 2 + np.cumsum(counts)]).astype(index_dtype)
    total = int(indptr[-1]) + 3
    h, d = 3, 40
    o, lse = random_o(rng, (total, h, d), in_dtype), random_lse(rng, (total, h))
    out, out_lse = attnmerge.merge_varlen(o, lse, indptr, base=base)
    grad_out, grad_out_lse = random_o(rng, out.shape, in_dtype), random_lse(rng, out_lse.shape, 1.0)
    grad_o, grad_lse = device.nan(o.shape, in_dtype), device.nan(lse.shape)
    attnmerge.merge_varlen_backward(device.put(grad_out), device.put(grad_out_lse), device.put(out), device.put(out_lse), device.put(o),
                                    device.put(lse), device.put(indptr), grad_o=grad_o, grad_lse=grad_lse, base=base)
    want = varlen_expected(o, lse, indptr, out, out_lse, grad_out, grad_out_lse, base)
    g_o, g_l = device.get(grad_o), device.get(grad_lse)
    assert np.all(to_f64(g_o[:2]) == 0) and np.all(to_f64(g_o[-3:]) == 0) and np.all(g_l[:2] == 0) and np.all(g_l[-3:] == 0)
    assert_grads(g_o, g_l, want, in_dtype)


def test_merge_varlen_backward_no_rows_gives_zeros(rng, device):
    o, lse = random_o(rng, (5, 2, 8)), random_lse(rng, (5, 2))
    grad_o, grad_lse = device.nan(o.shape), device.nan(lse.shape)
    attnmerge.merge_varlen_backward(device.put(np.zeros((0, 2, 8), np.float32)), None, device.put(np.zeros((0, 2, 8), np.float32)),
                                    device.put(np.zeros((0, 2), np.float32)), device.put(o), device.put(lse),
                                    device.put(np.array([3], np.int32)), grad_o=grad_o, grad_lse=grad_lse)
    assert np.all(device.get(grad_o) == 0) and np.all(device.get(grad_lse) == 0)


def test_merge_varlen_backward_strided(rng, device):
    indptr = np.array([0, 2, 5, 6], np.int64)
    o, lse = random_o(rng, (6, 4, 24), "bfloat16"), random_lse(rng, (6, 4))
    out, out_lse = attnmerge.merge_varlen(o, lse, indptr)
    grad_out, grad_out_lse = random_o(rng, out.shape, "bfloat16"), random_lse(rng, out_lse.shape, 1.0)
    want = varlen_expected(o, lse, indptr, out, out_lse, grad_out, grad_out_lse, "e")
    ov, ob = strided_view(o, order=(1, 0, 2), pad=8)
    lv, lb = strided_view(lse, order=(1, 0))
    gov, gob = strided_view(np.zeros(o.shape, o.dtype), steps={1: 2}, offset=3)
    glv, glb = strided_view(np.zeros(lse.shape, np.float32), steps={0: 2})
    gov[...] = np.nan
    glv[...] = np.nan
    tg, tgb = device.strided(gov, gob)
    tl, tlb = device.strided(glv, glb)
    attnmerge.merge_varlen_backward(device.put(grad_out), device.put(grad_out_lse), device.put(out), device.put(out_lse),
                                    device.strided(ov, ob)[0], device.strided(lv, lb)[0], device.put(indptr), grad_o=tg,
                                    grad_lse=tl)
    got_o, clean_o = device.readback(gov, gob, tg, tgb)
    got_l, clean_l = device.readback(glv, glb, tl, tlb)
    assert clean_o and clean_l
    assert_grads(got_o, got_l, want, "bfloat16")


# --------------------------------------------------------------------------------------------------
# any shape, layout and option at once


@st.composite
def layouts(draw, ndim, unit_last):
    """strided_view arguments: a storage order of the axes, padding, an offset and steps (never on
    the innermost stored axis of an O, which must stay unit-stride)."""
    order = draw(st.permutations(range(ndim - 1)))
    order = list(order) + [ndim - 1] if unit_last else list(draw(st.permutations(range(ndim))))
    steps = {a: draw(st.integers(1, 3)) for a in order[:-1] if draw(st.booleans())}
    if not unit_last and draw(st.booleans()):
        steps[order[-1]] = draw(st.integers(2, 3))
    return dict(order=order, pad=draw(st.integers(0, 3)), offset=draw(st.integers(0, 2)), steps=steps)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_merge_states_backward_any_layout_shape_and_option(device, data):
    seed = data.draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    t, s, h, d = (data.draw(st.integers(lo, hi)) for lo, hi in ((0, 5), (0, 6), (1, 3), (1, 40)))
    in_dtype, out_dtype = data.draw(st.sampled_from(DTYPES)), data.draw(st.sampled_from(DTYPES))
    base = data.draw(st.sampled_from(BASES))
    o, lse, out, out_lse, grad_out, grad_out_lse = case(rng, t, s, h, d, in_dtype, out_dtype, base)
    empty = rng.random(lse.shape) < data.draw(st.sampled_from((0.0, 0.3, 1.0)))
    lse[empty] = rng.choice([-np.inf, np.inf], size=int(empty.sum()))
    o[empty] = np.nan  # an empty part's O is never used
    out, out_lse = forward_states(o, lse, out_dtype, base)
    without_out = data.draw(st.booleans())
    if without_out:  # the dots then come from the states: compare with the exact O
        out = reference_merge_stacked(o, lse, base=base)[0]
    without_dlse = data.draw(st.booleans())
    want = expected_states(o, lse, out, out_lse, grad_out, None if without_dlse else grad_out_lse, base)
    needs = (data.draw(st.booleans()), data.draw(st.booleans()))

    def put(x, unit_last):
        view, buf = strided_view(x, **data.draw(layouts(x.ndim, unit_last)))
        return device.strided(view, buf)[0]

    grad_views = []
    for x, unit_last, need in ((np.zeros(o.shape, o.dtype), True, needs[0]), (np.zeros(lse.shape, np.float32), False,
                                                                             needs[1])):
        view, buf = strided_view(x, **data.draw(layouts(x.ndim, unit_last)))
        view[...] = np.nan
        grad_views.append((view, buf) + device.strided(view, buf) if need else None)
    res = attnmerge.merge_states_backward(
        put(grad_out, True), None if without_dlse else put(grad_out_lse, False), None if without_out else put(out, True),
        put(out_lse, False), put(o, True), put(lse, False),
        grad_o=grad_views[0][2] if needs[0] else None, grad_lse=grad_views[1][2] if needs[1] else None,
        needs_grad=needs, base=base)
    for i, (g, need) in enumerate(zip(grad_views, needs)):
        if not need:
            assert res[i] is None
            continue
        got, clean = device.readback(*g)
        assert clean, "a gradient was written outside its view"
        if i == 0:
            assert_o_close(got, want[0], in_dtype, "grad_o")
        else:
            tol = GRAD_LSE_RTOL_WITHOUT_O if without_out else GRAD_LSE_RTOL
            assert np.array_equal(np.isnan(got), np.isnan(want[1])) and rel_l2(got, want[1]) <= tol
    for g, need in zip(grad_views, needs):
        if need:
            assert np.all(to_f64(device.readback(*g)[0])[empty] == 0), "an empty part's gradient is not zero"


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_merge_varlen_backward_any_rows_layout_and_option(device, data):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    counts = data.draw(st.lists(st.integers(0, 7), max_size=6))
    before, after = data.draw(st.integers(0, 3)), data.draw(st.integers(0, 3))
    indptr = np.concatenate([[before], before + np.cumsum(counts, dtype=np.int64)]).astype(data.draw(
        st.sampled_from(("int32", "int64"))))
    total, h, d = int(indptr[-1]) + after, data.draw(st.integers(1, 3)), data.draw(st.integers(1, 36))
    in_dtype, base = data.draw(st.sampled_from(DTYPES)), data.draw(st.sampled_from(BASES))
    o, lse = random_o(rng, (total, h, d), in_dtype), random_lse(rng, (total, h))
    out, out_lse = attnmerge.merge_varlen(o, lse, indptr, base=base)
    grad_out, grad_out_lse = random_o(rng, out.shape, in_dtype), random_lse(rng, out_lse.shape, 1.0)
    without_out = data.draw(st.booleans())
    exact = reference_merge_varlen(o, lse, indptr, base=base)[0] if without_out else out.astype(np.float64)
    want = varlen_expected(o, lse, indptr, exact, out_lse, grad_out, grad_out_lse, base)
    gov, gob = strided_view(np.zeros(o.shape, o.dtype), **data.draw(layouts(3, True)))
    glv, glb = strided_view(np.zeros(lse.shape, np.float32), **data.draw(layouts(2, False)))
    gov[...] = np.nan
    glv[...] = np.nan
    tg, tgb = device.strided(gov, gob)
    tl, tlb = device.strided(glv, glb)
    ov, ob = strided_view(o, **data.draw(layouts(3, True)))
    attnmerge.merge_varlen_backward(device.put(grad_out), device.put(grad_out_lse), None if without_out else device.put(out),
                                    device.put(out_lse), device.strided(ov, ob)[0], device.put(lse), device.put(indptr),
                                    grad_o=tg, grad_lse=tl, base=base)
    got_o, clean_o = device.readback(gov, gob, tg, tgb)
    got_l, clean_l = device.readback(glv, glb, tl, tlb)
    assert clean_o and clean_l, "a gradient was written outside its view"
    assert_grads(got_o, got_l, want, in_dtype, lse_rtol=GRAD_LSE_RTOL_WITHOUT_O if without_out else GRAD_LSE_RTOL)


# --------------------------------------------------------------------------------------------------
# the C ABI: absent gradients, heads-first LSEs (its refusals: rows of tests/errors/bad_inputs.py)


def test_the_c_abi_skips_absent_gradients_and_reads_no_o_without_lse_gradients(rng):
    """With only dO_i asked for, no O_i or O is read: NaN there cannot reach dO_i."""
    o, lse, out, out_lse, grad_out, grad_out_lse = case(rng, 4, 3, 2, 8, "float32", "float32", "e")
    want = expected_states(o, lse, out, out_lse, grad_out, grad_out_lse, "e")
    o_nan, out_nan = np.full_like(o, np.nan), np.full_like(out, np.nan)
    t = c_abi.tensor_from
    g = np.full(o.shape, np.nan, np.float32)
    assert c_abi.merge_states_backward(t(g), None, t(grad_out), t(grad_out_lse), t(out_nan), t(out_lse), t(o_nan),
                                       t(lse)) == c_abi.SUCCESS
    assert_o_close(g, want[0], "float32")
    assert c_abi.merge_states_backward(None, None, t(grad_out), None, t(out), t(out_lse), t(o), t(lse)) == c_abi.SUCCESS


def test_c_abi_two_way_with_lses_heads_first(rng):
    """ATTNMERGE_LSE_HEADS_FIRST (vLLM's layout) applies to every LSE of the call, the gradients'
    included; with ATTNMERGE_A_TOKENS a's gradients hold a_tokens tokens."""
    tokens, h, d, a_tokens = 6, 3, 16, 4
    o, lse, out, out_lse, grad_out, grad_out_lse = case(rng, tokens, 2, h, d, "float32", "float32", "e")
    lse[a_tokens:, 0] = -np.inf  # what a_tokens means: no state a past them
    out, out_lse = forward_states(o, lse, "float32", "e")
    want = expected_states(o, lse, out, out_lse, grad_out, grad_out_lse, "e")
    ht = lambda x: np.ascontiguousarray(x.T)  # noqa: E731 - [heads, tokens]
    t = c_abi.tensor_from
    g_oa, g_ob = np.full((a_tokens, h, d), np.nan, np.float32), np.full((tokens, h, d), np.nan, np.float32)
    g_la, g_lb = np.full((h, a_tokens), np.nan, np.float32), np.full((h, tokens), np.nan, np.float32)
    o_a, o_b = np.ascontiguousarray(o[:a_tokens, 0]), np.ascontiguousarray(o[:, 1])
    # (the arrays held here: a descriptor keeps only their pointers)
    d_lse, s_lse, lse_a, lse_b = ht(grad_out_lse), ht(out_lse), ht(lse[:a_tokens, 0]), ht(lse[:, 1])
    status = c_abi.merge_backward(t(g_oa), t(g_la), t(g_ob), t(g_lb), t(grad_out), t(d_lse), t(out), t(s_lse), t(o_a),
                                  t(lse_a), t(o_b), t(lse_b),
                                  c_abi.options(flags=c_abi.LSE_HEADS_FIRST | c_abi.A_TOKENS, a_tokens=a_tokens))
    assert status == c_abi.SUCCESS, c_abi.last_error()
    assert_grads(g_oa, g_la.T, (want[0][:a_tokens, 0], want[1][:a_tokens, 0]), "float32", "a: ")
    assert_grads(g_ob, g_lb.T, (want[0][:, 1], want[1][:, 1]), "float32", "b: ")
    other = g_ob.copy()
    status = c_abi.merge_backward(t(g_ob), None, t(other), None, t(grad_out), None, t(out), t(s_lse), t(o_a), t(lse_a),
                                  t(o_b), t(lse_b),
                                  c_abi.options(flags=c_abi.LSE_HEADS_FIRST | c_abi.A_TOKENS, a_tokens=a_tokens))
    assert status == c_abi.ERROR_VALUE and c_abi.last_error().startswith("grad_o_a: expected shape [4, 3, 16]")


@pytest.mark.parametrize("device", devices.CUDA_ONLY, indirect=True)
def test_gpu_launch_is_one_backward_kernel(rng, device):
    device.gpu_only()
    o, lse, out, out_lse, grad_out, grad_out_lse = case(rng, 64, 8, 8, 128, "bfloat16", "bfloat16", "e")
    attnmerge.merge_states_backward(*(device.put(x) for x in (grad_out, grad_out_lse, out, out_lse, o, lse)))
    info = attnmerge.last_launch()
    assert (info["kernel"], info["launches"], info["vec"], info["pdl"]) == ("backward", 1, 8, False)
    assert info["block"][0] == 16  # 128 bfloat16 elements: 16 packs of 8, one lane each
    attnmerge.merge_states_backward(*(device.put(x) for x in (grad_out, grad_out_lse, out, out_lse, o, lse)), pdl=True)
    major = device.torch.cuda.get_device_capability()[0]
    assert attnmerge.last_launch()["pdl"] == (major >= 9)


@pytest.mark.parametrize("device", devices.CUDA_ONLY, indirect=True)
@pytest.mark.parametrize("in_dtype", DTYPES)
def test_gpu_gradients_match_the_cpus(rng, device, in_dtype):
    """The same call on the GPU and on the CPU: the same gradients to the forward's tolerances."""
    gpu, host = device, devices.Cpu()
    o, lse, out, out_lse, grad_out, grad_out_lse = case(rng, 33, 5, 4, 96, in_dtype, "float32", 2)
    args = (grad_out, grad_out_lse, out, out_lse, o, lse)
    on_gpu = attnmerge.merge_states_backward(*(gpu.put(x) for x in args), base=2)
    on_cpu = attnmerge.merge_states_backward(*(host.put(x) for x in args), base=2)
    assert_o_close(gpu.get(on_gpu[0]), to_f64(on_cpu[0]), in_dtype)
    assert rel_l2(gpu.get(on_gpu[1]), on_cpu[1]) <= GRAD_LSE_RTOL


@pytest.mark.parametrize("device", devices.CUDA_ONLY, indirect=True)
def test_gpu_bad_indptr_stays_in_bounds_and_writes_every_state(rng, device):
    """On the GPU a bad indptr is not read back: rows take the forward's clamped ranges, nothing is
    accessed out of bounds, and every state's gradient is still written (states in two rows'
    clamped ranges get one row's)."""
    device.gpu_only()
    o, lse = random_o(rng, (8, 2, 16)), random_lse(rng, (8, 2))
    grad_out, grad_out_lse = random_o(rng, (3, 2, 16)), random_lse(rng, (3, 2), 1.0)
    for bad in ([0, 5, 2, 8], [-3, 4, 6, 99], [6, 1, 0, 2]):
        indptr = device.put(np.array(bad, np.int64))
        out, out_lse = attnmerge.merge_varlen(device.put(o), device.put(lse), indptr)
        grad_o, grad_lse = device.nan(o.shape), device.nan(lse.shape)
        attnmerge.merge_varlen_backward(device.put(grad_out), device.put(grad_out_lse), out, out_lse, device.put(o), device.put(lse),
                                        indptr, grad_o=grad_o, grad_lse=grad_lse)
        assert np.isfinite(device.get(grad_o)).all() and np.isfinite(device.get(grad_lse)).all(), bad


# --------------------------------------------------------------------------------------------------
# torch.autograd.gradcheck (float64, CPU) through a wrapper local to this test


def test_torch_gradcheck_of_the_merge_states_backward():
    """The library's backward as the backward of a float64 forward (the oracle), in a small
    torch.autograd.Function: gradcheck compares it with finite differences of that forward.  The
    backward takes the float64 tensors as they are and computes in float64 (CPU path):
    gradcheck's own tolerances."""
    torch = pytest.importorskip("torch")

    class MergeStates(torch.autograd.Function):
        @staticmethod
        def forward(ctx, o, lse):
            ref_o, ref_lse = reference_merge_stacked(o.detach().numpy(), lse.detach().numpy(), base=2)
            out, out_lse = torch.from_numpy(ref_o), torch.from_numpy(ref_lse)
            ctx.save_for_backward(o, lse, out, out_lse)
            return out, out_lse

        @staticmethod
        def backward(ctx, grad_out, grad_out_lse):
            o, lse, out, out_lse = (x.detach() for x in ctx.saved_tensors)
            grads = [torch.empty_like(o), torch.empty_like(lse)]
            grads = [g if need else None for g, need in zip(grads, ctx.needs_input_grad)]
            return attnmerge.merge_states_backward(grad_out.contiguous(), grad_out_lse.contiguous(), out, out_lse, o,
                                                   lse, grad_o=grads[0], grad_lse=grads[1], base=2,
                                                   needs_grad=ctx.needs_input_grad)

    gen = torch.Generator().manual_seed(0)
    o = torch.randn(3, 4, 2, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    lse = (2 * torch.randn(3, 4, 2, dtype=torch.float64, generator=gen)).requires_grad_()
    assert torch.autograd.gradcheck(MergeStates.apply, (o, lse))


def test_lse_base_2_is_base_e_rescaled(rng, device):
    """The same states in base 2 (lse * log2(e)) give the same dO_i, and dlse_i scaled by ln 2:
    d/d(lse2) = d/d(lse_e) * ln 2."""
    o, lse, out, out_lse, grad_out, grad_out_lse = case(rng, 5, 3, 2, 16, "float32", "float32", "e")
    args = [device.put(x) for x in (grad_out, np.zeros_like(grad_out_lse), out)]
    e = attnmerge.merge_states_backward(*args, device.put(out_lse), device.put(o), device.put(lse))
    two = attnmerge.merge_states_backward(*args, device.put((out_lse / LN2).astype(np.float32)), device.put(o),
                                          device.put((lse / LN2).astype(np.float32)), base=2)
    assert rel_l2(device.get(two[0]), device.get(e[0])) <= 1e-5
    assert rel_l2(device.get(two[1]), device.get(e[1]) * LN2) <= 1e-5
