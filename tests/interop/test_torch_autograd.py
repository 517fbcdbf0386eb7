"""Autograd through torch.ops.attnmerge: merge, merge_states, merge_varlen and merge_share are
differentiable with respect to every O and LSE input (and to their sink), eagerly and
under torch.compile, on the CPU and (marked gpu) on CUDA; their gradients are the float64 oracle's
(p_i = b^(lse_i - LSE), dO_i = p_i dO, dlse_i = p_i (dLSE + ln(b) <dO, O_i - O>); a sink is a state
of O = 0, its gradient summed over the rows of its head; a share is the N-way merge whose other
states' O are 0); an empty part gets zero gradients; where
no gradient is defined (an FP8 or scaled output) asking for one is refused by name."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", minversion="2.4")

import attnmerge  # noqa: E402
from oracle import (  # noqa: E402
    LN2,
    natural,
    random_lse,
    random_o,
    reference_merge,
    reference_merge_stacked,
    reference_merge_states_backward,
    reference_merge_varlen,
    sink_state,
    stats_lse,
    valid_lse,
)

DEVICES = [pytest.param("cpu", id="cpu"),
           pytest.param("cuda", id="cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
               not torch.cuda.is_available(), reason="no CUDA device")])]
TOLERANCE = {"float32": 2e-5, "bfloat16": 2e-2}  # relative L2 against the float64 oracle


def put(x, device, dtype="float32", grad=True):
    t = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).to(device=device, dtype=getattr(torch, dtype))
    return t.requires_grad_(grad)


def rel(actual, expected):
    actual = actual.detach().double().cpu().numpy()
    scale = max(np.linalg.norm(expected), 1e-30)
    return np.linalg.norm(actual - expected) / scale


def incoming(rng, out, out_lse):
    return (torch.from_numpy(rng.standard_normal(out.shape).astype(np.float32)).to(out.device, out.dtype),
            torch.from_numpy(rng.standard_normal(out_lse.shape).astype(np.float32)).to(out_lse.device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("base", ["e", 2])
def test_merge_states_gradients_are_the_oracles(rng, device, dtype, base):
    o, lse = random_o(rng, (7, 5, 3, 40), dtype), random_lse(rng, (7, 5, 3))
    lse[2, 1] = -np.inf  # an empty part
    lse[4, :, 0] = -np.inf  # an all-empty row
    o_t, lse_t = put(o, device, dtype), put(lse, device)
    out, out_lse = attnmerge.merge_states(o_t, lse_t, base=base)
    grad_out, grad_out_lse = incoming(rng, out, out_lse)
    grad_o, grad_lse = torch.autograd.grad((out, out_lse), (o_t, lse_t), (grad_out, grad_out_lse))
    ref = reference_merge_states_backward(np.swapaxes(o_t.detach().float().cpu().numpy(), 0, 1),
                                          np.swapaxes(lse, 0, 1), out.detach().float().cpu().numpy(),
                                          out_lse.detach().cpu().numpy(), grad_out.float().cpu().numpy(),
                                          grad_out_lse.cpu().numpy(), base=base)
    assert rel(grad_o.float(), np.swapaxes(ref[0], 0, 1)) <= TOLERANCE[dtype]
    assert rel(grad_lse, np.swapaxes(ref[1], 0, 1)) <= TOLERANCE[dtype]
    assert grad_o.dtype == o_t.dtype and grad_o.shape == o_t.shape
    assert torch.all(grad_o[2, 1] == 0) and torch.all(grad_lse[2, 1] == 0)  # empty: zero, never NaN
    assert torch.all(grad_o[4, :, 0] == 0) and torch.all(grad_lse[4, :, 0] == 0)


def ln_base(base):
    return np.log(2.0) if base == 2 else 1.0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("a,b,out_base", [("e", 2, "e"), (2, "e", 2), ("e", "e", 2), (2, 2, "e")])
def test_mixed_bases_gradients_are_the_oracles_chain_rule(rng, device, a, b, out_base):
    """Each LSE of base b_i is lse_i = lambda_i / ln(b_i) of a natural one: the oracle's natural
    gradients, dlse_i = ln(b_i) dlambda_i, with dLAMBDA = dLSE / ln(b_out)."""
    t, h, d = 6, 2, 32
    o_a, lse_a, o_b, lse_b = random_o(rng, (t, h, d)), random_lse(rng, (t, h)), random_o(rng, (t, h, d)), random_lse(
        rng, (t, h))
    lse_b[1, 0] = -np.inf  # an empty part
    x = [put(v, device) for v in (o_a, lse_a, o_b, lse_b)]
    out, out_lse = attnmerge.merge(*x, base=(a, b), out_base=out_base)
    grad_out, grad_out_lse = incoming(rng, out, out_lse)
    grads = torch.autograd.grad((out, out_lse), x, (grad_out, grad_out_lse))
    out64, lse64 = out.detach().cpu().numpy(), out_lse.detach().cpu().numpy()
    ref = reference_merge_states_backward(np.stack([o_a, o_b]), np.stack([natural(lse_a, a), natural(lse_b, b)]),
                                          out64, natural(lse64, out_base), grad_out.cpu().numpy(),
                                          grad_out_lse.cpu().numpy() / ln_base(out_base), base="e")
    assert rel(grads[0], ref[0][0]) <= TOLERANCE["float32"] and rel(grads[2], ref[0][1]) <= TOLERANCE["float32"]
    assert rel(grads[1], ref[1][0] * ln_base(a)) <= TOLERANCE["float32"]
    assert rel(grads[3], ref[1][1] * ln_base(b)) <= TOLERANCE["float32"]
    assert torch.all(grads[3][1, 0] == 0) and torch.all(grads[2][1, 0] == 0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", ["merge_states", "merge_varlen", "merge_share"])
def test_the_merged_lses_own_base_changes_the_gradients_by_the_chain_rule(rng, device, op):
    """out_base 2 of base-e states: out_lse2 = out_lse / ln 2, so each gradient equals that of the
    base-e call with grad_out_lse / ln 2 (and a sink's too)."""
    o, lse, sink = random_o(rng, (5, 3, 2, 16)), random_lse(rng, (5, 3, 2)), random_lse(rng, (2,))

    def run(out_base, scale):
        x = [put(v, device) for v in (o, lse, sink)]
        if op == "merge_states":
            out, out_lse = attnmerge.merge_states(x[0], x[1], sink=x[2], out_base=out_base)
        elif op == "merge_varlen":
            out, out_lse = attnmerge.merge_varlen(x[0][:, 0], x[1][:, 0], torch.tensor([0, 2, 5], device=device),
                                                  sink=x[2], out_base=out_base)
        else:
            out, out_lse = attnmerge.merge_share(x[0][:, 0], x[1], 1, sink=x[2], out_base=out_base)
        g = torch.Generator().manual_seed(3)
        grad_out = torch.randn(out.shape, generator=g).to(device)
        grad_out_lse = torch.randn(out_lse.shape, generator=g).to(device) * scale
        return out_lse.detach(), torch.autograd.grad((out, out_lse), x, (grad_out, grad_out_lse))

    lse2, mixed = run(2, 1.0)
    lse_e, same = run(None, 1.0 / np.log(2.0))
    torch.testing.assert_close(lse2 * np.log(2.0), lse_e, rtol=1e-6, atol=1e-6)
    for m, s in zip(mixed, same):
        torch.testing.assert_close(m, s, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("a_tokens", [None, 3])
def test_merge_gradients_are_those_of_the_two_state_merge_states(rng, device, a_tokens):
    t, h, d = 6, 2, 32
    o_a, lse_a = random_o(rng, (t, h, d)), random_lse(rng, (t, h))
    o_b, lse_b = random_o(rng, (t, h, d)), random_lse(rng, (t, h))
    x = [put(v, device) for v in (o_a, lse_a, o_b, lse_b)]
    out, out_lse = attnmerge.merge(*x, a_tokens=a_tokens)
    grad_out, grad_out_lse = incoming(rng, out, out_lse)
    grads = torch.autograd.grad((out, out_lse), x, (grad_out, grad_out_lse))
    k = t if a_tokens is None else a_tokens
    la = lse_a.copy()
    la[k:] = -np.inf  # rows past a_tokens take b alone: a is an empty part there
    ref_o, ref_lse = reference_merge_states_backward(np.stack([o_a, o_b]), np.stack([la, lse_b]),
                                                     out.detach().cpu().numpy(), out_lse.detach().cpu().numpy(),
                                                     grad_out.cpu().numpy(), grad_out_lse.cpu().numpy())
    for g, r in zip(grads, (ref_o[0], ref_lse[0], ref_o[1], ref_lse[1])):
        assert rel(g, r) <= TOLERANCE["float32"]
    assert torch.all(grads[0][k:] == 0) and torch.all(grads[1][k:] == 0)


@pytest.mark.parametrize("device", DEVICES)
def test_merge_varlen_gradients_and_states_no_row_takes(rng, device):
    indptr = np.array([1, 1, 4, 9], dtype=np.int32)  # state 0 and 9.. belong to no row; row 0 is empty
    o, lse = random_o(rng, (11, 3, 16)), random_lse(rng, (11, 3))
    o_t, lse_t = put(o, device), put(lse, device)
    out, out_lse = attnmerge.merge_varlen(o_t, lse_t, torch.from_numpy(indptr).to(device))
    grad_out, grad_out_lse = incoming(rng, out, out_lse)
    grad_o, grad_lse = torch.autograd.grad((out, out_lse), (o_t, lse_t), (grad_out, grad_out_lse))
    expected_o, expected_lse = np.zeros(o.shape), np.zeros(lse.shape)
    for r in range(3):
        lo, hi = indptr[r], indptr[r + 1]
        if hi > lo:
            g = reference_merge_states_backward(o[lo:hi, None], lse[lo:hi, None], out.detach().cpu().numpy()[r:r + 1],
                                                out_lse.detach().cpu().numpy()[r:r + 1],
                                                grad_out.cpu().numpy()[r:r + 1], grad_out_lse.cpu().numpy()[r:r + 1])
            expected_o[lo:hi], expected_lse[lo:hi] = g[0][:, 0], g[1][:, 0]
    assert rel(grad_o, expected_o) <= TOLERANCE["float32"] and rel(grad_lse, expected_lse) <= TOLERANCE["float32"]
    assert torch.all(grad_o[0] == 0) and torch.all(grad_o[9:] == 0)


@pytest.mark.parametrize("device", DEVICES)
def test_only_the_asked_gradients_and_only_out_or_only_out_lse_used(rng, device):
    o, lse = put(random_o(rng, (4, 3, 2, 16)), device), put(random_lse(rng, (4, 3, 2)), device, grad=False)
    out, out_lse = attnmerge.merge_states(o, lse)
    (grad_o,) = torch.autograd.grad(out.sum(), (o,))  # out_lse unused, an expanded incoming gradient
    ref = reference_merge_states_backward(np.swapaxes(o.detach().cpu().numpy(), 0, 1),
                                          np.swapaxes(lse.cpu().numpy(), 0, 1), out.detach().cpu().numpy(),
                                          out_lse.detach().cpu().numpy(), np.ones(out.shape))
    assert rel(grad_o, np.swapaxes(ref[0], 0, 1)) <= TOLERANCE["float32"]
    lse.requires_grad_()
    _, out_lse = attnmerge.merge_states(o, lse)
    grad_o, grad_lse = torch.autograd.grad(out_lse.sum(), (o, lse))  # out unused: O gets none
    assert torch.all(grad_o == 0)
    ref = reference_merge_states_backward(np.swapaxes(o.detach().cpu().numpy(), 0, 1),
                                          np.swapaxes(lse.detach().cpu().numpy(), 0, 1), out.detach().cpu().numpy(),
                                          out_lse.detach().cpu().numpy(), np.zeros(out.shape), np.ones(out_lse.shape))
    assert rel(grad_lse, np.swapaxes(ref[1], 0, 1)) <= TOLERANCE["float32"]


def sink_oracle(o, lse, sink, out, out_lse, grad_out, grad_out_lse, base):
    """float64 gradients of one row group with a sink: the sink as one more state, of O = 0 (the
    formula's own reading of it); o [S, T, H, D], lse [S, T, H].  Returns (grad_o, grad_lse, the
    sink's gradient [H], summed over the T rows)."""
    so, sl = sink_state(sink, out.shape[0], out.shape[2])
    grad_o, grad_lse = reference_merge_states_backward(np.concatenate([o, so[None]]), np.concatenate([lse, sl[None]]),
                                                       out, out_lse, grad_out, grad_out_lse, base=base)
    return grad_o[:-1], grad_lse[:-1], grad_lse[-1].sum(axis=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("base", ["e", 2])
def test_merge_states_sink_gradients_are_the_oracles(rng, device, base):
    t, s, h, d = 6, 4, 4, 32
    o, lse = random_o(rng, (t, s, h, d)), random_lse(rng, (t, s, h))
    sink = random_lse(rng, (h,))
    sink[1] = -np.inf  # no sink: zero gradient
    x = [put(v, device) for v in (o, lse, sink)]
    out, out_lse = attnmerge.merge_states(x[0], x[1], sink=x[2], base=base)
    grad_out, grad_out_lse = incoming(rng, out, out_lse)
    grads = torch.autograd.grad((out, out_lse), x, (grad_out, grad_out_lse))
    ref = sink_oracle(np.swapaxes(o, 0, 1), np.swapaxes(lse, 0, 1), sink, *(
        v.detach().cpu().numpy() for v in (out, out_lse, grad_out, grad_out_lse)), base)
    assert rel(grads[0], np.swapaxes(ref[0], 0, 1)) <= TOLERANCE["float32"]
    assert rel(grads[1], np.swapaxes(ref[1], 0, 1)) <= TOLERANCE["float32"]
    assert rel(grads[2], ref[2]) <= TOLERANCE["float32"] and grads[2].shape == (h,) and grads[2][1] == 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("a_tokens", [None, 4])
@pytest.mark.parametrize("base", ["e", (2, "e")])
def test_merge_sink_gradients_are_the_oracles(rng, device, base, a_tokens):
    """The two-way merge with a sink (in a's base), with LSEs of two bases and with a_tokens (a's
    later tokens: zero gradients); the sink alone requiring grad takes the op too."""
    t, h, d = 7, 3, 32
    o_a, lse_a, o_b, lse_b = (random_o(rng, (t, h, d)), random_lse(rng, (t, h)), random_o(rng, (t, h, d)),
                              random_lse(rng, (t, h)))
    sink = random_lse(rng, (h,))
    sink[2] = -np.inf  # no sink: zero gradient
    x = [put(v, device) for v in (o_a, lse_a, o_b, lse_b, sink)]
    out, out_lse = attnmerge.merge(*x[:4], sink=x[4], base=base, a_tokens=a_tokens)
    grad_out, grad_out_lse = incoming(rng, out, out_lse)
    grads = torch.autograd.grad((out, out_lse), x, (grad_out, grad_out_lse))
    a_base = base if base == "e" else base[0]
    lse_b_in_a = lse_b if base == "e" else lse_b / np.log(2.0)  # the forward's b, in a's base
    k = t if a_tokens is None else a_tokens
    oa, la = o_a.copy(), lse_a.copy()
    la[k:] = -np.inf  # a's later tokens: not merged
    g_o, g_l, g_s = sink_oracle(np.stack([oa, o_b]), np.stack([la, lse_b_in_a]), sink, *(
        v.detach().cpu().numpy() for v in (out, out_lse, grad_out, grad_out_lse)), a_base)
    assert rel(grads[0], g_o[0]) <= TOLERANCE["float32"] and rel(grads[1], g_l[0]) <= TOLERANCE["float32"]
    assert rel(grads[2], g_o[1]) <= TOLERANCE["float32"]
    c_b = 1.0 if base == "e" else 1.0 / np.log(2.0)  # d(lse_b in a's base) / d lse_b
    assert rel(grads[3], g_l[1] * c_b) <= TOLERANCE["float32"]
    assert rel(grads[4], g_s) <= TOLERANCE["float32"] and grads[4][2] == 0
    assert (grads[0][k:] == 0).all() and (grads[1][k:] == 0).all()
    only_sink = [v.detach() for v in x[:4]]
    out, out_lse = attnmerge.merge(*only_sink, sink=x[4], base=base, a_tokens=a_tokens)
    (g,) = torch.autograd.grad((out, out_lse), (x[4],), (grad_out, grad_out_lse))
    assert rel(g, g_s) <= TOLERANCE["float32"]


@pytest.mark.parametrize("device", DEVICES)
def test_merge_varlen_sink_gradients_are_the_oracles(rng, device):
    indptr, h, d = [0, 3, 3, 5], 3, 16  # the middle row has no states: the sink alone
    o, lse, sink = random_o(rng, (5, h, d)), random_lse(rng, (5, h)), random_lse(rng, (h,))
    x = [put(v, device) for v in (o, lse, sink)]
    out, out_lse = attnmerge.merge_varlen(x[0], x[1], torch.tensor(indptr, device=device), sink=x[2])
    grad_out, grad_out_lse = incoming(rng, out, out_lse)
    grads = torch.autograd.grad((out, out_lse), x, (grad_out, grad_out_lse))
    saved = [v.detach().cpu().numpy() for v in (out, out_lse, grad_out, grad_out_lse)]
    want_o, want_lse, want_sink = np.zeros(o.shape), np.zeros(lse.shape), np.zeros(h)
    for r in range(len(indptr) - 1):
        lo, hi = indptr[r], indptr[r + 1]
        g_o, g_l, g_s = sink_oracle(o[lo:hi, None], lse[lo:hi, None], sink, *(v[r:r + 1] for v in saved), "e")
        want_o[lo:hi], want_lse[lo:hi], want_sink = g_o[:, 0], g_l[:, 0], want_sink + g_s
    assert rel(grads[0], want_o) <= TOLERANCE["float32"] and rel(grads[1], want_lse) <= TOLERANCE["float32"]
    assert rel(grads[2], want_sink) <= TOLERANCE["float32"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("states_axis", [0, 1])
@pytest.mark.parametrize("base", ["e", 2])
def test_merge_share_gradients_are_those_of_the_merge_whose_other_outputs_are_zero(rng, device, states_axis, base):
    """merge_share(o, lse, index) is merge_states of the states whose O is o for `index` and 0 for
    the others: its gradients are that merge's (the float64 oracle's), with a sink too."""
    t, s, h, d, index = 6, 4, 3, 32, 2
    o, lse, sink = random_o(rng, (t, h, d)), random_lse(rng, (s, t, h)), random_lse(rng, (h,))
    lse[1, 2, 0] = -np.inf  # an empty state
    lse[:, 4, 1] = -np.inf  # an all-empty row (the sink of head 1 too)
    sink[1] = -np.inf
    given = lse if states_axis == 0 else np.swapaxes(lse, 0, 1)
    x = [put(v, device) for v in (o, given, sink)]
    out, out_lse = attnmerge.merge_share(x[0], x[1], index, states_axis=states_axis, base=base, sink=x[2])
    grad_out, grad_out_lse = incoming(rng, out, out_lse)
    grads = torch.autograd.grad((out, out_lse), x, (grad_out, grad_out_lse))
    stacked = np.zeros((s, t, h, d))
    stacked[index] = o
    want_o, want_lse, want_sink = sink_oracle(stacked, lse, sink, *(
        v.detach().cpu().numpy() for v in (out, out_lse, grad_out, grad_out_lse)), base)
    assert rel(grads[0], want_o[index]) <= TOLERANCE["float32"]
    assert rel(grads[1], want_lse if states_axis == 0 else np.swapaxes(want_lse, 0, 1)) <= TOLERANCE["float32"]
    assert rel(grads[2], want_sink) <= TOLERANCE["float32"] and grads[2][1] == 0
    g_lse = grads[1] if states_axis == 0 else grads[1].transpose(0, 1)
    assert torch.all(g_lse[1, 2, 0] == 0) and torch.all(g_lse[:, 4, 1] == 0)  # empty: zero, never NaN
    assert torch.all(grads[0][4, 1] == 0)


@pytest.mark.parametrize("device", DEVICES)
def test_merge_share_gradient_of_a_bfloat16_state(rng, device):
    t, s, h, d, index = 5, 3, 2, 64, 0
    o, lse = random_o(rng, (t, h, d), "bfloat16"), random_lse(rng, (t, s, h))
    x = [put(o, device, "bfloat16"), put(lse, device)]
    out, out_lse = attnmerge.merge_share(x[0], x[1], index)
    grad_out, grad_out_lse = incoming(rng, out, out_lse)
    grads = torch.autograd.grad((out, out_lse), x, (grad_out, grad_out_lse))
    stacked = np.zeros((s, t, h, d))
    stacked[index] = x[0].detach().float().cpu().numpy()
    ref = reference_merge_states_backward(stacked, np.swapaxes(lse, 0, 1), out.detach().float().cpu().numpy(),
                                          out_lse.detach().cpu().numpy(), grad_out.float().cpu().numpy(),
                                          grad_out_lse.cpu().numpy())
    assert grads[0].dtype == torch.bfloat16 and rel(grads[0].float(), ref[0][index]) <= TOLERANCE["bfloat16"]
    assert rel(grads[1], np.swapaxes(ref[1], 0, 1)) <= TOLERANCE["bfloat16"]


def test_gradcheck_through_the_registered_ops():
    """torch.autograd.gradcheck of each op against finite differences of itself, in float64 with
    gradcheck's own tolerances: the CPU path computes float64 calls in float64."""
    gen = torch.Generator().manual_seed(1)
    o = torch.randn(3, 4, 2, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    lse = torch.randn(3, 4, 2, generator=gen, dtype=torch.float64).requires_grad_()
    kw = dict(nondet_tol=0.0)
    assert torch.autograd.gradcheck(lambda a, b: attnmerge.merge_states(a, b), (o, lse), **kw)
    assert torch.autograd.gradcheck(lambda a, b, c, d: attnmerge.merge(a, b, c, d, base=2),
                                    (o[:, 0], lse[:, 0], o[:, 1], lse[:, 1]), **kw)
    indptr = torch.tensor([0, 2, 3])  # (an empty row's LSE is -inf: no finite difference there)
    assert torch.autograd.gradcheck(lambda a, b: attnmerge.merge_varlen(a, b, indptr), (o[:, 0], lse[:, 0]), **kw)
    sink = torch.randn(2, generator=gen, dtype=torch.float64).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b, c: attnmerge.merge_states(a, b, sink=c), (o, lse, sink), **kw)
    assert torch.autograd.gradcheck(lambda a, b, c: attnmerge.merge_varlen(a, b, torch.tensor([0, 2, 2, 3]), sink=c),
                                    (o[:, 0], lse[:, 0], sink), **kw)
    assert torch.autograd.gradcheck(lambda a, b, c: attnmerge.merge_share(a, b, 2, sink=c, base=2),
                                    (o[:, 0], lse, sink), **kw)
    # mixed LSE bases (their gradients converted around the one-base backward)
    assert torch.autograd.gradcheck(lambda a, b, c, d: attnmerge.merge(a, b, c, d, base=(2, "e"), out_base="e"),
                                    (o[:, 0], lse[:, 0], o[:, 1], lse[:, 1]), **kw)
    assert torch.autograd.gradcheck(lambda a, b, c: attnmerge.merge_states(a, b, sink=c, out_base=2), (o, lse, sink),
                                    **kw)


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_gradients_are_the_eager_ones(rng, device):
    x = [put(v, device) for v in (random_o(rng, (5, 2, 32)), random_lse(rng, (5, 2)),
                                  random_o(rng, (5, 2, 32)), random_lse(rng, (5, 2)))]

    def loss(*a):
        out, out_lse = attnmerge.merge(*a)
        return (out * out).sum() + out_lse.sum()

    eager = torch.autograd.grad(loss(*x), x)
    compiled = torch.autograd.grad(torch.compile(loss, fullgraph=True, backend="aot_eager")(*x), x)
    for e, c in zip(eager, compiled):
        assert torch.equal(e, c)


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_mixed_bases_gradients_are_the_eager_ones(rng, device):
    x = [put(v, device) for v in (random_o(rng, (5, 2, 32)), random_lse(rng, (5, 2)),
                                  random_o(rng, (5, 2, 32)), random_lse(rng, (5, 2)))]

    def loss(*a):
        out, out_lse = attnmerge.merge(*a, base=(2, "e"), out_base="e")
        return (out * out).sum() + out_lse.sum()

    eager = torch.autograd.grad(loss(*x), x)
    compiled = torch.autograd.grad(torch.compile(loss, fullgraph=True, backend="aot_eager")(*x), x)
    for e, c in zip(eager, compiled):
        torch.testing.assert_close(e, c, rtol=1e-6, atol=1e-7)  # the conversions are torch ops: fusable


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_sink_gradients_are_the_eager_ones(rng, device):
    x = [put(v, device) for v in (random_o(rng, (5, 3, 2, 32)), random_lse(rng, (5, 3, 2)), random_lse(rng, (2,)))]

    def loss(o, lse, sink):
        out, out_lse = attnmerge.merge_states(o, lse, sink=sink)
        return (out * out).sum() + out_lse.sum()

    eager = torch.autograd.grad(loss(*x), x)
    compiled = torch.autograd.grad(torch.compile(loss, fullgraph=True, backend="aot_eager")(*x), x)
    for e, c in zip(eager, compiled):
        assert torch.equal(e, c)


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_share_gradients_are_the_eager_ones(rng, device):
    x = [put(v, device) for v in (random_o(rng, (5, 2, 32)), random_lse(rng, (3, 5, 2)), random_lse(rng, (2,)))]

    def loss(o, lse, sink):
        out, out_lse = attnmerge.merge_share(o, lse, 1, states_axis=0, sink=sink)
        return (out * out).sum() + out_lse.sum()

    eager = torch.autograd.grad(loss(*x), x)
    compiled = torch.autograd.grad(torch.compile(loss, fullgraph=True, backend="aot_eager")(*x), x)
    for e, c in zip(eager, compiled):
        torch.testing.assert_close(e, c, rtol=1e-6, atol=1e-7)  # torch ops: the compiler may fuse them


def test_opcheck_of_the_backward_ops_and_of_the_differentiable_forwards(rng):
    o = torch.from_numpy(random_o(rng, (6, 3, 4, 32))).requires_grad_()
    lse = torch.from_numpy(random_lse(rng, (6, 3, 4))).requires_grad_()
    torch.library.opcheck(torch.ops.attnmerge.merge_states.default, (o, lse), {})
    sink = torch.from_numpy(random_lse(rng, (4,))).requires_grad_()
    torch.library.opcheck(torch.ops.attnmerge.merge_states.default, (o, lse, None, sink), {})
    torch.library.opcheck(torch.ops.attnmerge.merge_varlen.default, (o[:, 0], lse[:, 0], torch.tensor([0, 4, 4, 6]),
                                                                     None, sink), {})
    torch.library.opcheck(torch.ops.attnmerge.merge.default, (o[:, 0], lse[:, 0], o[:, 1], lse[:, 1]),
                          dict(a_tokens=4, base="2"))
    torch.library.opcheck(torch.ops.attnmerge.merge.default, (o[:, 0], lse[:, 0], o[:, 1], lse[:, 1]),
                          dict(base="2,e", out_base="e"))
    torch.library.opcheck(torch.ops.attnmerge.merge_states.default, (o, lse, None, sink), dict(out_base="2"))
    torch.library.opcheck(torch.ops.attnmerge.merge_varlen.default, (o[:, 0], lse[:, 0], torch.tensor([0, 4, 6])), {})
    torch.library.opcheck(torch.ops.attnmerge.merge_share.default, (o[:, 0], lse, None, sink), dict(index=2))
    torch.library.opcheck(torch.ops.attnmerge.merge_share.default, (o[:, 0], lse.transpose(0, 1)),
                          dict(index=0, states_axis=0, base="2"))
    with torch.no_grad():
        out, out_lse = torch.ops.attnmerge.merge_states(o, lse)
    g, gl = torch.randn_like(out), torch.randn_like(out_lse)
    torch.library.opcheck(torch.ops.attnmerge.merge_states_backward.default,
                          (g, gl, out, out_lse, o.detach(), lse.detach()), dict(needs=[True, False]))
    a = [x.detach() for x in (o[:, 0], lse[:, 0], o[:, 1], lse[:, 1])]
    torch.library.opcheck(torch.ops.attnmerge.merge_backward.default, (g, None, out, out_lse, *a),
                          dict(needs=[True, True, False, True], a_tokens=3))
    torch.library.opcheck(torch.ops.attnmerge.merge_varlen_backward.default,
                          (g[:2], gl[:2], out[:2], out_lse[:2], a[0], a[1], torch.tensor([0, 1, 6])),
                          dict(needs=[True, True]))


def test_no_gradient_through_an_fp8_or_scaled_output(rng):
    o, lse = torch.from_numpy(random_o(rng, (4, 3, 2, 16))).requires_grad_(), torch.from_numpy(
        random_lse(rng, (4, 3, 2)))
    with pytest.raises(NotImplementedError, match="attnmerge::merge_states: no gradient through an FP8 output"):
        attnmerge.merge_states(o, lse, out_dtype=torch.float8_e4m3fn)
    with pytest.raises(NotImplementedError, match="output_scale"):
        attnmerge.merge_states(o, lse, out_dtype=torch.float8_e4m3fn, output_scale=2.0)
    with torch.no_grad():
        attnmerge.merge_states(o, lse, out_dtype=torch.float8_e4m3fn)  # without autograd it runs


def test_results_match_the_forward_without_autograd(rng):
    """Routing through the differentiable op changes no bit of the results."""
    o, lse = random_o(rng, (9, 4, 3, 24)), random_lse(rng, (9, 4, 3))
    with_grad = attnmerge.merge_states(torch.from_numpy(o).requires_grad_(), torch.from_numpy(lse))
    without = attnmerge.merge_states(torch.from_numpy(o), torch.from_numpy(lse))
    for a, b in zip(with_grad, without):
        assert torch.equal(a.detach(), b)
    ref = reference_merge_stacked(o, lse)
    assert rel(without[0], ref[0]) <= TOLERANCE["float32"]
    ref2 = reference_merge(o[:, 0], lse[:, 0], o[:, 1], lse[:, 1])
    assert rel(attnmerge.merge(*[torch.from_numpy(x).requires_grad_() for x in (
        o[:, 0], lse[:, 0], o[:, 1], lse[:, 1])])[0], ref2[0]) <= TOLERANCE["float32"]
    ref3 = reference_merge_varlen(o[:, 0], lse[:, 0], np.array([0, 9]))
    assert rel(attnmerge.merge_varlen(torch.from_numpy(o[:, 0]).requires_grad_(), torch.from_numpy(lse[:, 0]),
                                      torch.tensor([0, 9]))[0], ref3[0]) <= TOLERANCE["float32"]


@pytest.mark.parametrize("position", range(4))
def test_autograd_records_a_call_exactly_when_grad_is_on_and_an_input_requires_it(rng, position):
    """Any one of the four inputs requiring grad (an LSE alone, an nn.Parameter) is enough, with
    grad mode on; otherwise the call runs eagerly, without a grad_fn."""
    arrays = [torch.from_numpy(x) for x in (random_o(rng, (5, 3, 16)), random_lse(rng, (5, 3)),
                                            random_o(rng, (5, 3, 16)), random_lse(rng, (5, 3)))]
    out, _ = attnmerge.merge(*arrays)
    assert out.grad_fn is None
    arrays[position].requires_grad_()
    assert attnmerge.merge(*arrays)[0].grad_fn is not None
    with torch.no_grad():
        assert attnmerge.merge(*arrays)[0].grad_fn is None
    params = [torch.nn.Parameter(x.detach(), requires_grad=i == position) for i, x in enumerate(arrays)]
    assert attnmerge.merge(*params)[0].grad_fn is not None
    frozen = [torch.nn.Parameter(x.detach(), requires_grad=False) for x in arrays]
    assert attnmerge.merge(*frozen)[0].grad_fn is None


def test_the_routing_reads_requires_grad_of_torch_tensors_alone():
    """The eager routing's reader of requires_grad (attnmerge._C.flag_reader over torch.Tensor,
    gated by the grad mode): None where no argument is a torch tensor (nothing asked, not even the
    gate); else True only where the gate is open and some tensor's flag is True.  Other objects are
    never read, whatever attribute they carry; a subclass's attribute that raises lets the error
    through, and is not read with the gate closed."""
    from attnmerge import _C

    gates = []

    def gate():
        gates.append(True)
        return torch.is_grad_enabled()

    reader = _C.flag_reader(torch.Tensor, "requires_grad", gate)
    plain, needs = torch.ones(2), torch.ones(2, requires_grad=True)

    class Truthy:
        requires_grad = True  # set, but not a tensor's: autograd records no such object

    class Broken(torch.Tensor):
        @property
        def requires_grad(self):
            raise RuntimeError("unreadable")

    assert reader() is None and reader(None, np.ones(2), Truthy()) is None and gates == []
    assert reader(None, plain, np.ones(2)) is False and reader(plain, Truthy()) is False
    assert reader(plain, None, needs) is True and reader(torch.nn.Parameter(torch.ones(2))) is True
    broken = torch.ones(2).as_subclass(Broken)
    with pytest.raises(RuntimeError, match="unreadable"):
        reader(plain, broken)
    with torch.no_grad():
        assert reader(needs, broken) is False
    assert _C.flag_reader(torch.Tensor, "requires_grad", lambda: 1)(needs) is False  # the gate's True only
    with pytest.raises(ZeroDivisionError):
        _C.flag_reader(torch.Tensor, "requires_grad", lambda: 1 / 0)(needs)
    with pytest.raises(TypeError, match="getset descriptor"):
        _C.flag_reader(Truthy, "requires_grad", torch.is_grad_enabled)
    with pytest.raises(TypeError, match="expected a type"):
        _C.flag_reader(plain, "requires_grad", torch.is_grad_enabled)
    with pytest.raises(TypeError, match="gate: expected a callable"):
        _C.flag_reader(torch.Tensor, "requires_grad", None)


def test_the_routing_asks_whether_torch_traces_only_for_tensor_subclasses():
    """The whole routing check as one C call (attnmerge._C.flag_reader with `tracing`): where the
    first two arrays are exactly torch.Tensor (the eager call), or no array is a tensor, tracing()
    is never asked; otherwise where one is a subclass's (torch.export's FakeTensor) it is asked
    first and its True answers True whatever the flags; its False leaves the flags to decide, and
    its errors come through."""
    from attnmerge import _C

    asked = []

    def tracing(answer):
        def ask():
            asked.append(answer)
            return answer
        return ask

    plain, needs = torch.ones(2), torch.ones(2, requires_grad=True)

    class Sub(torch.Tensor):
        pass

    sub = plain.as_subclass(Sub)
    assert _C.flag_reader(torch.Tensor, "requires_grad", torch.is_grad_enabled, tracing(True))(plain, plain) is False
    assert _C.flag_reader(torch.Tensor, "requires_grad", torch.is_grad_enabled, tracing(True))(None, None) is None
    assert _C.flag_reader(torch.Tensor, "requires_grad", torch.is_grad_enabled, tracing(True))(np.ones(2)) is None
    assert _C.flag_reader(torch.Tensor, "requires_grad", torch.is_grad_enabled, tracing(True))(plain, plain, sub) is False
    assert _C.flag_reader(torch.Tensor, "requires_grad", torch.is_grad_enabled, tracing(True))(plain, np.ones(2)) is False
    assert asked == []
    assert _C.flag_reader(torch.Tensor, "requires_grad", torch.is_grad_enabled, tracing(True))(sub, plain) is True
    assert _C.flag_reader(torch.Tensor, "requires_grad", torch.is_grad_enabled, tracing(True))(plain, None, sub) is True
    with torch.no_grad():  # tracing answers before the grad mode is asked
        assert _C.flag_reader(torch.Tensor, "requires_grad", torch.is_grad_enabled, tracing(True))(sub) is True
    assert asked == [True, True, True]
    reader = _C.flag_reader(torch.Tensor, "requires_grad", torch.is_grad_enabled, tracing(False))
    assert reader(sub, plain) is False and reader(sub, needs) is True and reader(np.ones(2), None, needs) is True
    with pytest.raises(ZeroDivisionError):
        _C.flag_reader(torch.Tensor, "requires_grad", torch.is_grad_enabled, lambda: 1 / 0)(sub, plain)
    with pytest.raises(TypeError, match="tracing: expected None or a callable"):
        _C.flag_reader(torch.Tensor, "requires_grad", torch.is_grad_enabled, 1)


def test_the_python_check_answers_as_the_c_one():
    """_torch_ops._python_takes (the check where this torch cannot register the C one with Dynamo)
    gives the C check's answers, None included, with autograd on and off, outside tracing."""
    from attnmerge import _torch_ops

    plain, needs = torch.ones(2), torch.ones(2, requires_grad=True)

    class Sub(torch.Tensor):
        pass

    sub = plain.as_subclass(Sub)
    arrays = np.ones(2)
    cases = [(plain, plain), (plain, needs), (arrays, arrays), (None, None), (arrays, needs), (plain, None, needs),
             (sub, plain), (sub, needs), (plain, plain, None, needs), (arrays, None, plain)]
    for grad in (True, False):
        with torch.set_grad_enabled(grad):
            for case in cases:
                assert _torch_ops._python_takes(*case) is _torch_ops.takes(*case), (grad, case)


def test_arrays_of_other_libraries_ask_torch_nothing():
    """A call whose arrays are none of them torch tensors (NumPy's here) takes the native road
    without asking whether a torch.func transform is active (nor the grad mode or whether torch
    traces: the reader's tests above); a call of torch tensors asks the transform question where
    autograd would not record it.  The results are the merge's either way."""
    from attnmerge import _roads

    takes, run, transforming = _roads.torch_road()
    asked = []

    def counting():
        asked.append(True)
        return transforming()

    rng = np.random.default_rng(7)
    o_a, o_b = (rng.standard_normal((3, 2, 8), dtype=np.float32) for _ in range(2))
    lse_a, lse_b = (rng.standard_normal((3, 2), dtype=np.float32) for _ in range(2))
    try:
        _roads.use_torch(takes, run, counting)
        out, out_lse = attnmerge.merge(o_a, lse_a, o_b, lse_b)
        assert asked == []
        with torch.no_grad():
            t_out, t_lse = attnmerge.merge(*(torch.from_numpy(x) for x in (o_a, lse_a, o_b, lse_b)))
        assert asked == [True]
    finally:
        _roads.use_torch(takes, run, transforming)
    assert type(out) is np.ndarray and np.array_equal(out, t_out.numpy()) and np.array_equal(out_lse, t_lse.numpy())
    m = np.maximum(lse_a, lse_b).astype(np.float64)
    wa, wb = np.exp(lse_a - m), np.exp(lse_b - m)
    expected = (wa[..., None] * o_a + wb[..., None] * o_b) / (wa + wb)[..., None]
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out_lse, m + np.log(wa + wb), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("which", ["out", "out_lse"])
def test_an_output_that_requires_grad_is_refused_before_any_write(rng, which):
    """As torch's own out= ops refuse to write a tensor autograd tracks, so do the merges: by name,
    the output untouched."""
    o_a, o_b = (put(random_o(rng, (4, 3, 16)), "cpu", grad=False) for _ in range(2))
    lse_a, lse_b = (put(random_lse(rng, (4, 3)), "cpu", grad=False) for _ in range(2))
    outs = {"out": torch.full((4, 3, 16), float("nan")), "out_lse": torch.full((4, 3), float("nan"))}
    outs[which].requires_grad_(True)
    with pytest.raises(NotImplementedError, match=f"{which} requires grad"):
        attnmerge.merge(o_a, lse_a, o_b, lse_b, **outs)
    assert torch.isnan(outs["out"]).all() and torch.isnan(outs["out_lse"]).all()


# ---- softmax statistics and valid states (the forward's StateExtras) --------------------------------
# A state given as (max, sum) has LSE = max + log_b(sum) (oracle.stats_lse): the oracle's gradient of
# that LSE is the max's, and the sum's is it divided by sum ln(b); a state valid says is empty gets
# zero gradients (O, max and sum), whatever it held; valid itself has none.


def stats_oracle(o, m, total, valid, out, out_lse, grad_out, grad_out_lse, base):
    """float64 gradients (o, max, sum) of the N-way merge of states (max, sum), valid (broadcast
    against m; None: all) saying which hold keys; o [S, T, H, D], m and total [S, T, H]."""
    lse = valid_lse(stats_lse(m, total, base), np.ones(m.shape) if valid is None else valid)
    grad_o, grad_lse = reference_merge_states_backward(o, lse, out, out_lse, grad_out, grad_out_lse, base=base)
    with np.errstate(invalid="ignore", divide="ignore"):
        grad_sum = np.where(grad_lse != 0, grad_lse / (total.astype(np.float64) * ln_base(base)), 0.0)
    return grad_o, grad_lse, grad_sum


def stats_of(rng, shape):
    return random_lse(rng, shape), rng.uniform(1.0, 20.0, shape).astype(np.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("states_axis", [0, 1])
@pytest.mark.parametrize("base", ["e", 2])
def test_merge_states_gradients_of_softmax_statistics_and_valid_states(rng, device, states_axis, base):
    t, s, h, d = 6, 5, 3, 32
    o = random_o(rng, (s, t, h, d))
    m, total = stats_of(rng, (s, t, h))
    total[1, 2, 0] = 0.0  # an empty part: its sum 0
    valid = (rng.random((t, s)) < 0.7).astype(np.uint8)
    valid[3] = 0  # a row of no valid state: O = 0, zero gradients
    move = (lambda x: x) if states_axis == 0 else (lambda x: np.swapaxes(x, 0, 1))
    x = [put(move(v), device) for v in (o, m, total)]
    out, out_lse = attnmerge.merge_states(x[0], (x[1], x[2]), states_axis=states_axis, base=base,
                                          valid=torch.from_numpy(valid).to(device))
    grad_out, grad_out_lse = incoming(rng, out, out_lse)
    grads = torch.autograd.grad((out, out_lse), x, (grad_out, grad_out_lse))
    want = stats_oracle(o, m, total, valid.T[:, :, None], *(v.detach().cpu().numpy() for v in
                                                             (out, out_lse, grad_out, grad_out_lse)), base)
    for g, w in zip(grads, want):
        assert rel(g, move(w)) <= TOLERANCE["float32"]
        assert torch.isfinite(g).all()
    g_sum = grads[2].detach().cpu().numpy()
    assert move(g_sum)[1, 2, 0] == 0 and (move(g_sum)[:, 3] == 0).all()  # sum 0; a row of no valid state


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("a_tokens", [None, 4])
def test_merge_gradients_of_softmax_statistics_of_two_bases(rng, device, a_tokens):
    """lse_a as (max, sum) in base 2 and lse_b as (max, sum) in base e, valid [tokens, 2]: each
    sum's gradient in its own base."""
    t, h, d = 7, 2, 32
    o_a, o_b = random_o(rng, (t, h, d)), random_o(rng, (t, h, d))
    (m_a, s_a), (m_b, s_b) = stats_of(rng, (t, h)), stats_of(rng, (t, h))
    valid = np.ones((t, 2), np.uint8)
    valid[1, 0] = valid[2, 1] = 0
    x = [put(v, device) for v in (o_a, m_a, s_a, o_b, m_b, s_b)]
    out, out_lse = attnmerge.merge(x[0], (x[1], x[2]), x[3], (x[4], x[5]), base=(2, "e"), a_tokens=a_tokens,
                                   valid=torch.from_numpy(valid).to(device))
    grad_out, grad_out_lse = incoming(rng, out, out_lse)
    grads = torch.autograd.grad((out, out_lse), x, (grad_out, grad_out_lse))
    k = t if a_tokens is None else a_tokens
    # in natural units: a's LSE is ln 2 (m_a + log2 s_a); b's m_b + ln s_b
    lam_a = valid_lse(stats_lse(m_a, s_a, 2) * LN2, valid[:, :1])
    lam_a[k:] = -np.inf
    lam_b = valid_lse(stats_lse(m_b, s_b), valid[:, 1:])
    g_o, g_l = reference_merge_states_backward(np.stack([o_a, o_b]), np.stack([lam_a, lam_b]),
                                               out.detach().cpu().numpy(), out_lse.detach().cpu().numpy() * LN2,
                                               grad_out.cpu().numpy(), grad_out_lse.cpu().numpy() / LN2)
    g_ma = g_l[0] * LN2  # d lambda_a / d m_a = ln 2
    with np.errstate(invalid="ignore", divide="ignore"):
        want = (g_o[0], g_ma, np.where(g_ma != 0, g_ma / (s_a * LN2), 0.0), g_o[1], g_l[1],
                np.where(g_l[1] != 0, g_l[1] / s_b, 0.0))
    for g, w in zip(grads, want):
        assert rel(g, w) <= TOLERANCE["float32"]
    assert torch.all(grads[1][1] == 0) and torch.all(grads[2][1] == 0) and torch.all(grads[0][1] == 0)


@pytest.mark.parametrize("device", DEVICES)
def test_merge_share_and_varlen_gradients_of_softmax_statistics(rng, device):
    t, s, h, d, index = 5, 4, 2, 32, 1
    o = random_o(rng, (t, h, d))
    m, total = stats_of(rng, (t, s, h))
    x = [put(v, device) for v in (o, m, total)]
    out, out_lse = attnmerge.merge_share(x[0], (x[1], x[2]), index)
    grad_out, grad_out_lse = incoming(rng, out, out_lse)
    grads = torch.autograd.grad((out, out_lse), x, (grad_out, grad_out_lse))
    stacked = np.zeros((s, t, h, d))
    stacked[index] = o
    want = stats_oracle(stacked, np.swapaxes(m, 0, 1), np.swapaxes(total, 0, 1), None,
                        *(v.detach().cpu().numpy() for v in (out, out_lse, grad_out, grad_out_lse)), "e")
    assert rel(grads[0], want[0][index]) <= TOLERANCE["float32"]
    assert rel(grads[1], np.swapaxes(want[1], 0, 1)) <= TOLERANCE["float32"]
    assert rel(grads[2], np.swapaxes(want[2], 0, 1)) <= TOLERANCE["float32"]
    indptr = np.array([0, 2, 5], np.int32)
    o, (m, total) = random_o(rng, (5, h, d)), stats_of(rng, (5, h))
    valid = np.array([1, 0, 1, 1, 0], np.int32)
    x = [put(v, device) for v in (o, m, total)]
    out, out_lse = attnmerge.merge_varlen(x[0], (x[1], x[2]), torch.from_numpy(indptr).to(device),
                                          valid=torch.from_numpy(valid).to(device))
    grad_out, grad_out_lse = incoming(rng, out, out_lse)
    grads = torch.autograd.grad((out, out_lse), x, (grad_out, grad_out_lse))
    for r in range(2):
        lo, hi = indptr[r], indptr[r + 1]
        want = stats_oracle(o[lo:hi, None], m[lo:hi, None], total[lo:hi, None], valid[lo:hi, None, None],
                            *(v.detach().cpu().numpy()[r:r + 1] for v in (out, out_lse, grad_out, grad_out_lse)), "e")
        for g, w in zip(grads, want):
            assert rel(g[lo:hi], w[:, 0]) <= TOLERANCE["float32"]
    assert torch.all(grads[0][1] == 0) and torch.all(grads[2][4] == 0)


def test_gradcheck_of_softmax_statistics():
    """gradcheck of merges of (max, sum) statistics, with valid states, in float64 with gradcheck's
    own tolerances: the CPU path reads float64 sums beside float64 maxima."""
    gen = torch.Generator().manual_seed(2)
    f64 = torch.float64
    o = torch.randn(3, 4, 2, 8, generator=gen, dtype=f64, requires_grad=True)
    m = torch.randn(3, 4, 2, generator=gen, dtype=f64).requires_grad_()
    total = (torch.rand(3, 4, 2, generator=gen, dtype=f64) * 4 + 1).requires_grad_()
    valid = torch.tensor([[1, 1, 0, 1]] * 3, dtype=torch.uint8)
    assert torch.autograd.gradcheck(lambda a, b, c: attnmerge.merge_states(a, (b, c), valid=valid), (o, m, total))
    assert torch.autograd.gradcheck(lambda a, b, c, d, e, f: attnmerge.merge(a, (b, c), d, (e, f), base=2),
                                    (o[:, 0], m[:, 0], total[:, 0], o[:, 1], m[:, 1], total[:, 1]))


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_softmax_statistics_and_valid_states_are_the_eager_ones(rng, device):
    o, (m, total) = random_o(rng, (6, 4, 2, 32)), stats_of(rng, (6, 4, 2))
    valid = torch.from_numpy((rng.random((6, 4)) < 0.7).astype(np.uint8)).to(device)
    x = [put(v, device) for v in (o, m, total)]

    def f(a, b, c):
        out, out_lse = attnmerge.merge_states(a, (b, c), valid=valid)
        return (out * out).sum() + out_lse.sum()

    eager = torch.autograd.grad(f(*x), x)
    compiled = torch.autograd.grad(torch.compile(f, fullgraph=True)(*x), x)
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(a, b)
