"""Algebraic properties of the merge, checked with hypothesis on every device (the `device` fixture).

Merging is the softmax-weighted union of key sets, so it is
  - commutative and associative (up to float32 rounding);
  - the identity with an empty state (exactly: the weight is 1 and the other part is not read);
  - idempotent on O with a copy of itself, adding ln 2 (1 in base 2) to the LSE;
  - one N-way merge equals a chain of two-way merges (up to rounding), in any order of the states,
    and the variable-length and in-place merges agree with it.

"Up to rounding": |x - y| <= TOL * max |O_i| elementwise for O (the scale of the inputs, since a
merged O may be near zero), |x - y| <= 1e-5 * max(1, |y|) for the LSE; NaN and +-inf in the same
places.  Each example draws a seed and the sizes; the arrays come from NumPy with that seed.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import attnmerge
from oracle import DTYPES, np_dtype, to_f64

TOL = 2e-5
LSE_TOL = 1e-5
# The device fixture is the same for every example of a test: hypothesis may share it.
SETTINGS = settings(max_examples=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

BASES = st.sampled_from(["e", 2])


@st.composite
def shapes(draw, max_tokens=9, max_heads=4):
    return dict(
        seed=draw(st.integers(0, 2**32 - 1)),
        tokens=draw(st.integers(1, max_tokens)),
        heads=draw(st.integers(1, max_heads)),
        head_size=draw(st.sampled_from([1, 2, 3, 7, 16, 64, 70])),
        lse_scale=draw(st.sampled_from([0.5, 3.0, 10.0])),
        empty=draw(st.sampled_from([0.0, 0.2, 0.6])),
    )


def state(rng, p, dtype="float32"):
    """A random state of p's sizes; a fraction p["empty"] of its rows empty (+inf or -inf LSE, NaN O)."""
    t, h, d = p["tokens"], p["heads"], p["head_size"]
    o = rng.standard_normal((t, h, d))
    o = np.where(np.abs(o) < 1e-2, 0.5, o).astype(np.float32).astype(np_dtype(dtype))
    lse = (p["lse_scale"] * rng.standard_normal((t, h))).astype(np.float32)
    lse[lse == 0] = 0.25
    empty = rng.random((t, h)) < p["empty"]
    lse[empty] = np.where(rng.random(int(empty.sum())) < 0.5, np.inf, -np.inf)
    o[empty] = np.nan
    return o, lse


def scale_of(*os):
    vals = [np.abs(to_f64(o)) for o in os]
    m = max(float(np.nanmax(v)) if v.size and not np.all(np.isnan(v)) else 0.0 for v in vals)
    return max(m, 1e-30)


def assert_same(x, y, scale, what):
    """x and y equal up to rounding (see the module's docstring)."""
    x, y = to_f64(x), to_f64(y)
    assert x.shape == y.shape
    assert np.array_equal(np.isnan(x), np.isnan(y)), f"{what}: NaN differs"
    fin = np.isfinite(y)
    assert np.array_equal(x[~fin & ~np.isnan(y)], y[~fin & ~np.isnan(y)]), f"{what}: inf differs"
    d = np.abs(x[fin] - y[fin])
    assert np.all(np.isfinite(x[fin])), f"{what}: non-finite where the other is finite"
    if what.endswith("lse"):
        lim = LSE_TOL * np.maximum(1.0, np.abs(y[fin]))
    else:
        lim = TOL * scale
    assert np.all(d <= lim), f"{what}: max difference {d.max():.3g} > {np.max(lim):.3g}"


def on(device, fn, *arrays, **kw):
    """fn of host arrays put on the device; its results read back (None stays None)."""
    return tuple(device.get(r) for r in fn(*(device.put(x) for x in arrays), **kw))


def merge(device, a, b, base):
    return on(device, attnmerge.merge, a[0], a[1], b[0], b[1], base=base)


# --------------------------------------------------------------------------------------------------


@SETTINGS
@given(p=shapes(), base=BASES)
def test_merging_is_commutative(device, p, base):
    rng = np.random.default_rng(p["seed"])
    a, b = state(rng, p), state(rng, p)
    ab, ba = merge(device, a, b, base), merge(device, b, a, base)
    s = scale_of(a[0], b[0])
    assert_same(ab[0], ba[0], s, "o")
    assert_same(ab[1], ba[1], s, "lse")


@SETTINGS
@given(p=shapes(), base=BASES)
def test_merging_is_associative(device, p, base):
    rng = np.random.default_rng(p["seed"])
    a, b, c = state(rng, p), state(rng, p), state(rng, p)
    left = merge(device, merge(device, a, b, base), c, base)
    right = merge(device, a, merge(device, b, c, base), base)
    s = scale_of(a[0], b[0], c[0])
    assert_same(left[0], right[0], s, "o")
    assert_same(left[1], right[1], s, "lse")


@SETTINGS
@given(p=shapes(), base=BASES, dtype=st.sampled_from(DTYPES), empty=st.sampled_from([np.inf, -np.inf]),
       first=st.booleans())
def test_merging_with_an_empty_state_is_the_identity(device, p, base, dtype, empty, first):
    rng = np.random.default_rng(p["seed"])
    a = state(rng, p, dtype)
    e = (np.full_like(a[0], np.nan), np.full_like(a[1], empty))  # its O is garbage: never read
    out, out_lse = merge(device, e, a, base) if first else merge(device, a, e, base)
    lse_a = np.where(a[1] == np.inf, -np.inf, a[1])  # an empty row of a stays empty: 0, -inf
    o_a = to_f64(a[0]).copy()
    o_a[lse_a == -np.inf] = 0.0
    assert np.array_equal(to_f64(out), o_a), "merging with an empty state changed O"
    assert np.array_equal(out_lse, lse_a), "merging with an empty state changed the LSE"


@SETTINGS
@given(p=shapes(), base=BASES)
def test_merging_a_state_with_itself_keeps_o_and_adds_log_2(device, p, base):
    rng = np.random.default_rng(p["seed"])
    a = state(rng, p)
    out, out_lse = merge(device, a, (a[0].copy(), a[1].copy()), base)
    empty = np.isinf(a[1])
    o_want = to_f64(a[0]).copy()
    o_want[empty] = 0.0
    lse_want = to_f64(a[1]) + (np.log(2.0) if base == "e" else 1.0)
    lse_want[empty] = -np.inf
    assert_same(out, o_want, scale_of(a[0]), "o")
    assert_same(out_lse, lse_want, 1.0, "lse")


@SETTINGS
@given(p=shapes(), base=BASES, n=st.integers(1, 12), states_axis=st.sampled_from([0, 1]))
def test_the_n_way_merge_equals_a_chain_of_two_way_merges(device, p, base, n, states_axis):
    rng = np.random.default_rng(p["seed"])
    parts = [state(rng, p) for _ in range(n)]
    o = np.stack([x[0] for x in parts], axis=states_axis)
    lse = np.stack([x[1] for x in parts], axis=states_axis)
    out, out_lse = on(device, attnmerge.merge_states, o, lse, base=base, states_axis=states_axis)
    acc = parts[0]
    if n == 1:  # a chain of one: the state itself, empty rows as 0, -inf
        acc = merge(device, acc, (np.full_like(acc[0], np.nan), np.full_like(acc[1], -np.inf)), base)
    for x in parts[1:]:
        acc = merge(device, acc, x, base)
    s = scale_of(*[x[0] for x in parts])
    assert_same(out, acc[0], s, "o")
    assert_same(out_lse, acc[1], s, "lse")


@SETTINGS
@given(p=shapes(max_tokens=5), base=BASES, n=st.integers(2, 8), data=st.data())
def test_the_n_way_merge_does_not_depend_on_the_order_of_the_states(device, p, base, n, data):
    rng = np.random.default_rng(p["seed"])
    parts = [state(rng, p) for _ in range(n)]
    perm = data.draw(st.permutations(range(n)))
    o = np.stack([x[0] for x in parts], axis=1)
    lse = np.stack([x[1] for x in parts], axis=1)
    a, a_lse = on(device, attnmerge.merge_states, o, lse, base=base)
    b, b_lse = on(device, attnmerge.merge_states, o[:, list(perm)], lse[:, list(perm)], base=base)
    s = scale_of(o)
    assert_same(a, b, s, "o")
    assert_same(a_lse, b_lse, s, "lse")


@SETTINGS
@given(p=shapes(), base=BASES, counts=st.lists(st.integers(0, 6), min_size=1, max_size=8))
def test_the_variable_length_merge_equals_the_n_way_merge_row_by_row(device, p, base, counts):
    rng = np.random.default_rng(p["seed"])
    p = dict(p, tokens=int(sum(counts)))
    o, lse = state(rng, p)
    indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    out, out_lse = on(device, attnmerge.merge_varlen, o, lse, indptr, base=base)
    for r, (lo, hi) in enumerate(zip(indptr[:-1], indptr[1:])):
        want, want_lse = on(device, attnmerge.merge_states, o[None, lo:hi], lse[None, lo:hi], base=base)
        s = scale_of(o[lo:hi]) if hi > lo else 1.0
        assert_same(out[r : r + 1], want, s, f"row {r} o")
        assert_same(out_lse[r : r + 1], want_lse, s, f"row {r} lse")


@SETTINGS
@given(p=shapes(), base=BASES)
def test_the_in_place_merge_equals_the_merge(device, p, base):
    rng = np.random.default_rng(p["seed"])
    a, b = state(rng, p), state(rng, p)
    want, want_lse = merge(device, a, b, base)
    o, lse = on(device, attnmerge.merge_inplace, a[0], a[1], b[0], b[1], base=base)
    s = scale_of(a[0], b[0])
    assert_same(o, want, s, "o")
    assert_same(lse, want_lse, s, "lse")


@pytest.mark.parametrize("base", ["e", 2])
def test_a_nan_lse_wins_over_everything(device, base):
    o = np.ones((1, 3, 1, 4), np.float32)
    lse = np.array([[[np.nan], [np.inf], [5.0]]], np.float32)
    out, out_lse = on(device, attnmerge.merge_states, o, lse, base=base)
    assert np.all(np.isnan(out)) and np.isnan(out_lse).all()
