"""torch.func over the merges: grad, vjp and jacrev of merge, merge_states (its states at any axis),
merge_varlen and merge_share give the float64 oracle's gradients (p_i = b^(lse_i - LSE), dO_i =
p_i dO, dlse_i = p_i (dLSE + ln(b) <dO, O_i - O>)) and JAX's for the same transforms of
attnmerge.jax; vmap of every op is one call per batch element stacked, bit for bit, whether the
batch is flattened into one call or not (a batched sink, a_tokens or indptr); a gradient of a
gradient, which the backward ops do not have, is refused by name, never a silent zero."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", minversion="2.4")

import attnmerge  # noqa: E402
from oracle import random_lse, random_o, random_stacked, reference_merge_states_backward  # noqa: E402

func = torch.func
DEVICES = [pytest.param("cpu", id="cpu"),
           pytest.param("cuda", id="cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
               not torch.cuda.is_available(), reason="no CUDA device")])]


def put(x, device):
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).to(device)


def assert_close(actual, expected, tol=2e-5):
    actual = actual.detach().double().cpu().numpy()
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert np.linalg.norm(actual - expected) <= tol * max(np.linalg.norm(expected), 1e-30)


def oracle_gradients(o, lse, states_axis, grad_out, grad_out_lse):
    """The float64 gradients of merge_states of o, lse (S at states_axis), in their layout."""
    o0, lse0 = np.moveaxis(o, states_axis, 0).astype(np.float64), np.moveaxis(lse, states_axis, 0).astype(np.float64)
    m = lse0.max(axis=0)
    out_lse = m + np.log(np.exp(lse0 - m).sum(axis=0))
    out = (np.exp(lse0 - out_lse)[..., None] * o0).sum(axis=0)
    g_o, g_lse = reference_merge_states_backward(o0, lse0, out, out_lse, grad_out, grad_out_lse)
    return np.moveaxis(g_o, 0, states_axis), np.moveaxis(g_lse, 0, states_axis)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("states_axis", [0, 1, 2])
def test_grad_of_merge_states_is_the_oracles_at_any_states_axis(rng, device, states_axis):
    o, lse = random_stacked(rng, 6, 5, 3, 32, states_axis=states_axis)
    weights = rng.standard_normal((6, 3, 32)), rng.standard_normal((6, 3))

    def loss(o, lse):
        out, out_lse = attnmerge.merge_states(o, lse, states_axis=states_axis)
        return (out * put(weights[0], device)).sum() + (out_lse * put(weights[1], device)).sum()

    g_o, g_lse = func.grad(loss, argnums=(0, 1))(put(o, device), put(lse, device))
    want_o, want_lse = oracle_gradients(o, lse, states_axis, *weights)
    assert_close(g_o, want_o)
    assert_close(g_lse, want_lse)


@pytest.mark.parametrize("device", DEVICES)
def test_vjp_of_merge_is_that_of_merge_states_of_the_two(rng, device):
    o_a, o_b = random_o(rng, (7, 4, 16)), random_o(rng, (7, 4, 16))
    lse_a, lse_b = random_lse(rng, (7, 4)), random_lse(rng, (7, 4))
    lse_a[2, 1] = -np.inf  # an empty part: zero gradients
    inputs = [put(x, device) for x in (o_a, lse_a, o_b, lse_b)]
    (out, out_lse), pullback = func.vjp(attnmerge.merge, *inputs)
    g_out, g_lse = rng.standard_normal((7, 4, 16)), rng.standard_normal((7, 4))
    grads = pullback((put(g_out, device), put(g_lse, device)))
    want_o, want_lse = oracle_gradients(np.stack([o_a, o_b]), np.stack([lse_a, lse_b]), 0, g_out, g_lse)
    for got, want in zip(grads, (want_o[0], want_lse[0], want_o[1], want_lse[1])):
        assert_close(got, want)
    assert float(grads[1][2, 1]) == 0.0 and not torch.any(grads[0][2, 1])


@pytest.mark.parametrize("device", DEVICES)
def test_jacrev_of_merge_varlen_and_merge_share(rng, device):
    o, lse = random_o(rng, (8, 2, 16)), random_lse(rng, (8, 2))
    indptr = torch.tensor([0, 3, 3, 8], dtype=torch.int32, device=device)
    jac = func.jacrev(lambda lse: attnmerge.merge_varlen(put(o, device), lse, indptr)[1])(put(lse, device))
    # d out_lse[r] / d lse[s] is the state's weight p_s in its row, 0 outside it (and for the empty row)
    want = np.zeros((3, 2, 8, 2))
    for r, (a, b) in enumerate([(0, 3), (3, 3), (3, 8)]):
        for h in range(2):
            w = np.exp(lse[a:b, h].astype(np.float64) - np.logaddexp.reduce(lse[a:b, h].astype(np.float64))) \
                if b > a else []
            for s, p in zip(range(a, b), w):
                want[r, h, s, h] = p
    assert_close(jac, want)
    os, lses = random_stacked(rng, 5, 4, 2, 16)
    jac = func.jacrev(lambda lse: attnmerge.merge_share(put(os[:, 1], device), lse, 1)[1])(put(lses, device))
    want_lse = np.zeros((5, 2, 5, 4, 2))  # d LSE / d lse_i = p_i, for the share as for the merge
    p = np.exp(lses.astype(np.float64) - np.logaddexp.reduce(lses.astype(np.float64), axis=1)[:, None])
    for t in range(5):
        for h in range(2):
            want_lse[t, h, t, :, h] = p[t, :, h]
    assert_close(jac, want_lse)


def test_grads_agree_with_jaxs_for_the_same_transform(rng):
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    try:
        import attnmerge.jax as amj
    except ImportError as e:
        pytest.skip(f"attnmerge.jax: {e}")
    o, lse = random_stacked(rng, 6, 5, 3, 32, states_axis=0)
    sink = random_lse(rng, (3,))

    def torch_loss(o, lse, sink):
        out, out_lse = attnmerge.merge_states(o, lse, states_axis=0, sink=sink)
        return out.square().sum() + out_lse.sum()

    def jax_loss(o, lse, sink):
        out, out_lse = amj.merge_states(o, lse, states_axis=0, sink=sink)
        return jnp.square(out).sum() + out_lse.sum()

    got = func.grad(torch_loss, argnums=(0, 1, 2))(*(put(x, "cpu") for x in (o, lse, sink)))
    want = jax.grad(jax_loss, argnums=(0, 1, 2))(*(jnp.asarray(x) for x in (o, lse, sink)))
    for g, w in zip(got, want):
        assert_close(g, np.asarray(w, np.float64), tol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["merge", "merge a_tokens", "merge batched sink", "merge_states axis 2",
                                  "merge_varlen", "merge_share axis 0", "merge_inplace",
                                  "merge softmax statistics, valid", "merge_states softmax statistics axis 2, valid",
                                  "merge_share softmax statistics axis 0, valid"])
def test_vmap_is_the_loop_of_single_calls_bit_for_bit(rng, device, case):
    batch = 3
    o = put(rng.standard_normal((batch, 6, 4, 16)), device)
    lse = put(3 * rng.standard_normal((batch, 6, 4)), device)
    o2, lse2 = o.flip(0), lse.flip(0)
    sinks = put(rng.standard_normal((batch, 4)), device)
    stacked = put(rng.standard_normal((batch, 6, 4, 5, 16)), device)  # [tokens, heads, S, D] per example
    stacked_lse = put(3 * rng.standard_normal((batch, 6, 4, 5)), device)
    indptr = torch.tensor([0, 2, 2, 6], dtype=torch.int64, device=device)
    calls = {
        "merge": (lambda a, la, b, lb: attnmerge.merge(a, la, b, lb), (o, lse, o2, lse2)),
        "merge a_tokens": (lambda a, la, b, lb: attnmerge.merge(a, la, b, lb, a_tokens=4), (o, lse, o2, lse2)),
        "merge batched sink": (lambda a, la, b, lb, s: attnmerge.merge(a, la, b, lb, sink=s), (o, lse, o2, lse2, sinks)),
        "merge_states axis 2": (lambda x, lx: attnmerge.merge_states(x, lx, states_axis=2), (stacked, stacked_lse)),
        "merge_varlen": (lambda x, lx: attnmerge.merge_varlen(x, lx, indptr), (o, lse)),
        "merge_share axis 0": (lambda x, lx: attnmerge.merge_share(x[1], lx, 1, states_axis=0),
                               (o.unsqueeze(1).expand(batch, 2, 6, 4, 16), lse.unsqueeze(1).expand(batch, 2, 6, 4))),
        "merge_inplace": (lambda a, la, b, lb: attnmerge.merge_inplace(a, la, b, lb), (o, lse, o2, lse2)),
        "merge softmax statistics, valid": (
            lambda a, la, b, lb, s, v: attnmerge.merge(a, (la, s), b, (lb, s), valid=v),
            (o, lse, o2, lse2, lse.exp(), (lse > 0).to(torch.uint8)[..., :2])),
        "merge_states softmax statistics axis 2, valid": (
            lambda x, lx, s, v: attnmerge.merge_states(x, (lx, s), states_axis=2, valid=v),
            (stacked, stacked_lse, stacked_lse.exp(), (stacked_lse[:, :, 0] > 0).to(torch.uint8))),
        "merge_share softmax statistics axis 0, valid": (
            lambda x, lx, s, v: attnmerge.merge_share(x[1], (lx, s), 1, states_axis=0, valid=v),
            (o.unsqueeze(1).expand(batch, 2, 6, 4, 16), lse.unsqueeze(1).expand(batch, 2, 6, 4),
             lse.exp().unsqueeze(1).expand(batch, 2, 6, 4), (lse[..., :2] > 0).to(torch.uint8))),
    }
    f, args = calls[case]
    looped = [f(*(x[i].clone() for x in args)) for i in range(batch)]  # first: the in-place merge writes args
    batched = func.vmap(f)(*args)
    for j, got in enumerate(batched):
        assert torch.equal(got, torch.stack([r[j] for r in looped])), (case, j)


def test_a_gradient_of_the_gradient_is_refused_by_name(rng):
    o_a, o_b = put(random_o(rng, (3, 2, 8)), "cpu"), put(random_o(rng, (3, 2, 8)), "cpu")
    lse_a, lse_b = put(random_lse(rng, (3, 2)), "cpu"), put(random_lse(rng, (3, 2)), "cpu")

    def inner(a):
        return func.grad(lambda b: attnmerge.merge(b, lse_a, o_b, lse_b)[0].square().sum())(a).sum()

    with pytest.raises(NotImplementedError, match="attnmerge::merge: no gradient of its gradient"):
        func.grad(inner)(o_a)
