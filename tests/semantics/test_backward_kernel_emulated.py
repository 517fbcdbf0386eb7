"""The GPU backward's logic, on the CPU: tests/native/backward_emulator.cpp runs the library's plan
(plan_backward), launcher and kernel (attnmerge/merge_backward_kernels.cuh, the installed header)
as host C++, each block's threads as fibers whose shuffles meet (tests/emulators.py), in the
orders it sets.  The results are held to the same oracle and tolerances as
tests/semantics/test_backward.py: rows and their lanes, chunks of states, rows wider than a warp,
which lane writes which state's dlse, the two passes without O, the variable-length rows' edges and
a_tokens, all without a GPU.  (What it cannot check: the device's own instructions, vector
accesses and approximations; the `gpu` tests do.)
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import attnmerge
from emulators import CODES, ORDERS, build, check, nan_like, order, pointers, widest_vec
from oracle import DTYPES, np_dtype, random_lse, random_o, reference_merge_stacked, reference_merge_varlen, strided_view
from test_backward import (BASES, GRAD_LSE_RTOL, GRAD_LSE_RTOL_WITHOUT_O, assert_grads, case, expected_states,
                           forward_states, layouts, varlen_expected)


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    return build("backward_emulator.cpp", tmp_path_factory)


def call(emu, fn, sizes, in_dtype, out_dtype, base, vec, sms, *arrays, tail=(), how=0, seed=0):
    ptrs, strides = pointers(*arrays)
    order(emu, how, seed)
    check(emu, fn(*[ctypes.c_int64(v) for v in sizes], CODES[in_dtype], CODES[out_dtype], int(base == 2), vec, sms,
                  *ptrs, *tail))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_states_backward_kernel(emu, data):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    # up to 20 states: rows split into up to 8 groups of 2 (the plan's, with the forward's O)
    t, s, h = data.draw(st.integers(0, 4)), data.draw(st.integers(0, 20)), data.draw(st.integers(1, 3))
    d = data.draw(st.sampled_from((1, 3, 8, 24, 64, 128, 160, 264)))
    in_dtype, out_dtype, base = (data.draw(st.sampled_from(x)) for x in (DTYPES, DTYPES, BASES))
    o, lse, out, out_lse, grad_out, grad_out_lse = case(rng, t, s, h, d, in_dtype, out_dtype, base)
    empty = rng.random(lse.shape) < 0.25
    lse[empty] = -np.inf
    o[empty] = np.nan
    out, out_lse = forward_states(o, lse, out_dtype, base)
    without_out, without_dlse = data.draw(st.booleans()), data.draw(st.booleans())
    want_out = reference_merge_stacked(o, lse, base=base)[0] if without_out else out
    want = expected_states(o, lse, want_out, out_lse, grad_out, None if without_dlse else grad_out_lse, base)
    ov = strided_view(o, **data.draw(layouts(4, True)))[0]
    grad_o = strided_view(nan_like(o), **data.draw(layouts(4, True)))[0]
    grad_lse = strided_view(nan_like(lse), **data.draw(layouts(3, False)))[0]
    arrays = (grad_o, grad_lse, grad_out, None if without_dlse else grad_out_lse, None if without_out else out,
              out_lse, ov, lse)
    vec = widest_vec(d, grad_o, grad_out, None if without_out else out, ov)
    sms = data.draw(st.sampled_from((0, 132)))
    call(emu, emu.emulate_states_backward, (t, s, h, d), in_dtype, out_dtype, base, vec, sms, *arrays,
         how=data.draw(st.sampled_from(ORDERS)), seed=data.draw(st.integers(0, 2**32 - 1)))
    # without O, dlse's dot is a difference of two float32 dots (test_backward's reason)
    assert_grads(grad_o, grad_lse, want, in_dtype, lse_rtol=GRAD_LSE_RTOL_WITHOUT_O if without_out else GRAD_LSE_RTOL)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_varlen_backward_kernel(emu, data):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    counts = data.draw(st.lists(st.integers(0, 9), max_size=5))
    before, after = data.draw(st.integers(0, 3)), data.draw(st.integers(0, 3))
    indptr = np.concatenate([[before], before + np.cumsum(counts, dtype=np.int64)]).astype(np.int64)
    total, h, d = int(indptr[-1]) + after, data.draw(st.integers(1, 3)), data.draw(st.sampled_from((2, 16, 40, 136)))
    in_dtype, base = data.draw(st.sampled_from(DTYPES)), data.draw(st.sampled_from(BASES))
    o, lse = random_o(rng, (total, h, d), in_dtype), random_lse(rng, (total, h))
    out, out_lse = attnmerge.merge_varlen(o, lse, indptr, base=base)
    grad_out, grad_out_lse = random_o(rng, out.shape, in_dtype), random_lse(rng, out_lse.shape, 1.0)
    without_out = data.draw(st.booleans())
    exact = reference_merge_varlen(o, lse, indptr, base=base)[0] if without_out else out.astype(np.float64)
    want = varlen_expected(o, lse, indptr, exact, out_lse, grad_out, grad_out_lse, base)
    grad_o = strided_view(nan_like(o), **data.draw(layouts(3, True)))[0]
    grad_lse = strided_view(nan_like(lse), **data.draw(layouts(2, False)))[0]
    arrays = (grad_o, grad_lse, grad_out, grad_out_lse, None if without_out else out, out_lse, o, lse)
    vec = widest_vec(d, grad_o, grad_out, None if without_out else out, o)
    call(emu, emu.emulate_varlen_backward, (len(counts), total, h, d), in_dtype, in_dtype, base, vec, 132, *arrays,
         tail=(ctypes.c_void_p(indptr.ctypes.data),), how=data.draw(st.sampled_from(ORDERS)))
    assert_grads(grad_o, grad_lse, want, in_dtype, lse_rtol=GRAD_LSE_RTOL_WITHOUT_O if without_out else GRAD_LSE_RTOL)


@pytest.mark.parametrize("without_out", (False, True))
@pytest.mark.parametrize("a_tokens", (0, 3, 7))
@pytest.mark.parametrize("in_dtype", DTYPES)
def test_merge_backward_kernel(emu, rng, in_dtype, a_tokens, without_out):
    tokens, h, d = 7, 3, 40
    o, lse, _, _, grad_out, grad_out_lse = case(rng, tokens, 2, h, d, in_dtype, "float32", "e")
    lse[a_tokens:, 0] = -np.inf  # what a_tokens means: no state a past them
    out, out_lse = forward_states(o, lse, "float32", "e")
    want_out = reference_merge_stacked(o, lse)[0] if without_out else out
    want = expected_states(o, lse, want_out, out_lse, grad_out, grad_out_lse, "e")
    o_a, o_b = np.ascontiguousarray(o[:a_tokens + 1, 0]), np.ascontiguousarray(o[:, 1])
    lse_a, lse_b = np.ascontiguousarray(lse[:a_tokens + 1, 0]), np.ascontiguousarray(lse[:, 1])
    g_oa, g_la = np.full((a_tokens, h, d), np.nan, np_dtype(in_dtype)), np.full((a_tokens, h), np.nan, np.float32)
    g_ob, g_lb = nan_like(o_b), np.full((h, tokens), np.nan, np.float32).T  # an LSE gradient [heads, tokens]
    arrays = (g_oa, g_la, g_ob, g_lb, grad_out, grad_out_lse, None if without_out else out, out_lse, o_a, lse_a, o_b,
              lse_b)
    vec = widest_vec(d, g_oa, g_ob, grad_out, out, o_a, o_b)
    call(emu, emu.emulate_merge_backward, (tokens, a_tokens, h, d), in_dtype, "float32", "e", vec, 132, *arrays,
         how=2, seed=a_tokens)
    assert_grads(g_oa, g_la, (want[0][:a_tokens, 0], want[1][:a_tokens, 0]), in_dtype, "a: ")
    assert_grads(g_ob, g_lb, (want[0][:, 1], want[1][:, 1]), in_dtype, "b: ")
    # b's gradients alone: a's are not written (null), b's the same
    g_ob2 = nan_like(o_b)
    call(emu, emu.emulate_merge_backward, (tokens, a_tokens, h, d), in_dtype, "float32", "e", vec, 132, None, None,
         g_ob2, None, grad_out, grad_out_lse, None if without_out else out, out_lse, o_a, lse_a, o_b, lse_b)
    np.testing.assert_array_equal(g_ob2.astype(np.float32), g_ob.astype(np.float32))


@pytest.mark.parametrize("states", (1, 2, 3, 8))
@pytest.mark.parametrize("chunk", (2, 4))
@pytest.mark.parametrize("with_out", (True, False))
def test_launcher_refuses_a_plan_without_the_second_pass(emu, states, chunk, with_out):
    """The kernel of 2 states in flight has no second pass: without the forward's O, a plan that
    gives it rows of more than 2 states (plan_backward never does) is refused by
    launch_merge_backward (cudaErrorInvalidValue), not run wrong."""
    emu.emulate_backward_plan_fits.restype = ctypes.c_int
    fits = emu.emulate_backward_plan_fits(ctypes.c_int64(states), chunk, int(with_out))
    assert fits == (chunk != 2 or with_out or states <= 2)
