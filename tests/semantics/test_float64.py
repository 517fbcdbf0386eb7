"""float64 (docs/semantics.md, "float64"): on host arrays a call whose every O and LSE is float64 is
computed in float64, forward and backward, and matches the float64 oracle to float64's precision
(float32 arithmetic would miss by some 1e-8); on a GPU such a call is refused, naming where float64
runs, before anything is written.  Each test runs on every device: the `cpu` device computes, the
`cuda` device expects the refusal (with ATTNMERGE_TEST_CUDA_AS=cpu its torch CPU tensors compute).

Outputs are passed in: allocated outputs take their LSE dtypes from the Python layer (see
test_allocated_float64_outputs_are_float64)."""

from __future__ import annotations

import numpy as np
import pytest

import attnmerge
from oracle import (LN2, all_nan, reference_merge, reference_merge_stacked, reference_merge_share,
                    reference_merge_states_backward, reference_merge_varlen)

#: relative L2 error against the oracle of a float64 computation (float32's is some 1e-8)
RTOL = 1e-13
REFUSAL = "float64 runs on the CPU path only"


def o64(rng, shape):
    """Random float64 O whose values need float64: low-order bits past float32's 24."""
    x = rng.standard_normal(shape)
    return np.where(np.abs(x) < 1e-2, 0.5, x) + 1e-9 * rng.standard_normal(shape)


def lse64(rng, shape, scale=3.0):
    return scale * rng.standard_normal(shape) + 1e-9 * rng.standard_normal(shape)


def nan64(device, shape):
    return device.put(np.full(shape, np.nan))


def rel(actual, expected):
    a, e = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.linalg.norm(a - e) / np.linalg.norm(e))


def close(actual, expected, what):
    """float64 results against the oracle: the dtype kept, NaN and inf where the oracle has them, the
    rest within RTOL (relative L2)."""
    a, e = np.asarray(actual), np.asarray(expected, np.float64)
    assert a.dtype == np.float64, f"{what}: dtype {a.dtype}"
    assert np.array_equal(np.isnan(a), np.isnan(e)), f"{what}: NaN differs"
    fin = np.isfinite(e)
    assert np.array_equal(a[~fin & ~np.isnan(e)], e[~fin & ~np.isnan(e)]), f"{what}: inf differs"
    err = rel(a[fin], e[fin])
    assert err <= RTOL, f"{what}: relative L2 error {err:.3g} > {RTOL:g}"


def outcome(device, call, outputs):
    """Runs `call` (which writes `outputs`): on the GPU it must be refused, naming where float64 runs,
    with every output still NaN (None then); elsewhere the outputs read back."""
    if device.on_gpu:
        with pytest.raises(TypeError, match=REFUSAL):
            call()
        assert all(all_nan(device.get(x)) for x in outputs), "an output was written although the call was refused"
        return None
    call()
    return [device.get(x) for x in outputs]


# --------------------------------------------------------------------------------------------------
# the forward


def test_merge(rng, device):
    t, h, d = 37, 5, 72
    o_a, o_b = o64(rng, (t, h, d)), o64(rng, (t, h, d))
    lse_a, lse_b = lse64(rng, (t, h)), lse64(rng, (t, h))
    lse_a[0, 0], lse_b[1, 1], lse_a[2, 2] = np.inf, -np.inf, np.nan  # an empty part each way, a NaN row
    lse_a[3, 3] = lse_b[3, 3] = -np.inf  # an all-empty row: O 0, LSE -inf
    out, out_lse = nan64(device, (t, h, d)), nan64(device, (t, h))
    got = outcome(device, lambda: attnmerge.merge(*(device.put(x) for x in (o_a, lse_a, o_b, lse_b)), out=out,
                                                  out_lse=out_lse), (out, out_lse))
    if got is not None:
        ref_o, ref_lse = reference_merge(o_a, lse_a, o_b, lse_b)
        close(got[0], ref_o, "out")
        close(got[1], ref_lse, "out_lse")


def test_merge_with_a_sink_a_tokens_and_mixed_bases(rng, device):
    t, h, d, a_tokens = 9, 3, 40, 6
    o_a, o_b, sink = o64(rng, (a_tokens, h, d)), o64(rng, (t, h, d)), lse64(rng, (h,))
    lse_a, lse_b = lse64(rng, (a_tokens, h)), lse64(rng, (t, h))
    out, out_lse = nan64(device, (t, h, d)), nan64(device, (t, h))
    got = outcome(device, lambda: attnmerge.merge(
        *(device.put(x) for x in (o_a, lse_a, o_b, lse_b)), out=out, out_lse=out_lse, a_tokens=a_tokens,
        sink=device.put(sink), base=(2, "e"), out_base=2), (out, out_lse))
    if got is not None:
        # a's LSE in base 2, b's and the sink's in a's (the inputs' base, base 2); the merged LSE in base 2
        ref_o, ref_lse = reference_merge(o_a, lse_a * LN2, o_b, lse_b, a_tokens=a_tokens, sink=sink * LN2)
        close(got[0], ref_o, "out")
        close(got[1], ref_lse / LN2, "out_lse")


def test_merge_inplace_with_a_mask(rng, device):
    t, h, d = 11, 4, 24
    o, o_other = o64(rng, (t, h, d)), o64(rng, (t, h, d))
    lse, lse_other = lse64(rng, (t, h)), lse64(rng, (t, h))
    mask = rng.random(t) < 0.5
    x, x_lse = device.put(o), device.put(lse)
    if device.on_gpu:
        with pytest.raises(TypeError, match=REFUSAL):
            attnmerge.merge_inplace(x, x_lse, device.put(o_other), device.put(lse_other), mask=device.put(mask))
        assert np.array_equal(device.get(x), o) and np.array_equal(device.get(x_lse), lse), "o or lse changed"
        return
    attnmerge.merge_inplace(x, x_lse, device.put(o_other), device.put(lse_other), mask=device.put(mask))
    ref_o, ref_lse = reference_merge(o, lse, o_other, lse_other)
    close(device.get(x), np.where(mask[:, None, None], ref_o, o), "o")
    close(device.get(x_lse), np.where(mask[:, None], ref_lse, lse), "lse")


@pytest.mark.parametrize("states", [2, 5])  # two: the two-way merge's loop
def test_merge_states_with_a_sink(rng, device, states):
    t, h, d = 13, 3, 48
    o, lse, sink = o64(rng, (t, states, h, d)), lse64(rng, (t, states, h)), lse64(rng, (h,))
    out, out_lse = nan64(device, (t, h, d)), nan64(device, (t, h))
    got = outcome(device, lambda: attnmerge.merge_states(device.put(o), device.put(lse), out=out, out_lse=out_lse,
                                                         sink=device.put(sink)), (out, out_lse))
    if got is not None:
        ref_o, ref_lse = reference_merge_stacked(o, lse, sink=sink)
        close(got[0], ref_o, "out")
        close(got[1], ref_lse, "out_lse")


def test_merge_varlen(rng, device):
    indptr = np.array([0, 3, 3, 7, 10], np.int64)  # an empty row among them
    h, d = 2, 32
    o, lse = o64(rng, (10, h, d)), lse64(rng, (10, h))
    out, out_lse = nan64(device, (4, h, d)), nan64(device, (4, h))
    got = outcome(device, lambda: attnmerge.merge_varlen(device.put(o), device.put(lse), device.put(indptr), out=out,
                                                         out_lse=out_lse), (out, out_lse))
    if got is not None:
        ref_o, ref_lse = reference_merge_varlen(o, lse, indptr)
        close(got[0], ref_o, "out")
        close(got[1], ref_lse, "out_lse")


def test_merge_share(rng, device):
    t, s, h, d, index = 7, 4, 3, 16, 2
    o, lse = o64(rng, (t, h, d)), lse64(rng, (t, s, h))
    out, out_lse = nan64(device, (t, h, d)), nan64(device, (t, h))
    got = outcome(device, lambda: attnmerge.merge_share(device.put(o), device.put(lse), index, out=out,
                                                        out_lse=out_lse), (out, out_lse))
    if got is not None:
        ref_o, ref_lse = reference_merge_share(o, lse, index)
        close(got[0], ref_o, "out")
        close(got[1], ref_lse, "out_lse")


# --------------------------------------------------------------------------------------------------
# the backward


@pytest.mark.parametrize("axis", (0, 1))
def test_merge_states_of_softmax_statistics_and_empty_shards(rng, device, axis):
    """(max, sum) statistics of float64 (the sums' dtype the maxima's) and a valid mask: LSE = max +
    log(sum) taken in float64, sum 0 and valid 0 empty whatever the state holds."""
    t, s, h, d = 9, 4, 3, 40
    shape = (s, t, h) if axis == 0 else (t, s, h)
    o = o64(rng, shape[:2] + (h, d))
    m, total = lse64(rng, shape), rng.uniform(1.0, 40.0, shape) + 1e-9 * rng.standard_normal(shape)
    valid = (rng.random((t, s)) < 0.75).astype(np.uint8)
    total.reshape(-1)[::7] = 0.0
    lse = np.where(total == 0, -np.inf, m + np.log(np.where(total == 0, 1.0, total)))
    lse = np.where((valid.T[:, :, None] if axis == 0 else valid[:, :, None]) == 0, -np.inf, lse)
    m[total == 0] = np.nan
    out, out_lse = nan64(device, (t, h, d)), nan64(device, (t, h))
    got = outcome(device, lambda: attnmerge.merge_states(device.put(o), (device.put(m), device.put(total)),
                                                         states_axis=axis, valid=device.put(valid), out=out,
                                                         out_lse=out_lse), (out, out_lse))
    if got is not None:
        want = reference_merge_stacked(o, lse, states_axis=axis)
        close(got[0], want[0], "out")
        close(got[1], want[1], "out_lse")


@pytest.mark.parametrize("states", [2, 5])
def test_merge_states_backward(rng, device, states):
    t, h, d = 6, 3, 40
    o, lse = o64(rng, (t, states, h, d)), lse64(rng, (t, states, h))
    lse[0, 0, 0] = -np.inf  # an empty part: zero gradients
    out, out_lse = reference_merge_stacked(o, lse)
    grad_out, grad_out_lse = o64(rng, (t, h, d)), lse64(rng, (t, h), 1.0)
    grad_o, grad_lse = nan64(device, o.shape), nan64(device, lse.shape)
    got = outcome(device, lambda: attnmerge.merge_states_backward(
        *(device.put(x) for x in (grad_out, grad_out_lse, out, out_lse, o, lse)), grad_o=grad_o, grad_lse=grad_lse),
        (grad_o, grad_lse))
    if got is not None:
        ref = reference_merge_states_backward(np.swapaxes(o, 0, 1), np.swapaxes(lse, 0, 1), out, out_lse, grad_out,
                                              grad_out_lse)
        close(got[0], np.swapaxes(ref[0], 0, 1), "grad_o")
        close(got[1], np.swapaxes(ref[1], 0, 1), "grad_lse")


def test_merge_backward_in_base_2(rng, device):
    t, h, d = 8, 2, 24
    o_a, o_b, lse_a, lse_b = o64(rng, (t, h, d)), o64(rng, (t, h, d)), lse64(rng, (t, h)), lse64(rng, (t, h))
    out, out_lse = reference_merge(o_a, lse_a * LN2, o_b, lse_b * LN2)
    out_lse = out_lse / LN2
    grad_out, grad_out_lse = o64(rng, (t, h, d)), lse64(rng, (t, h), 1.0)
    grads = [nan64(device, x.shape) for x in (o_a, lse_a, o_b, lse_b)]
    got = outcome(device, lambda: attnmerge.merge_backward(
        *(device.put(x) for x in (grad_out, grad_out_lse, out, out_lse, o_a, lse_a, o_b, lse_b)), grad_o_a=grads[0],
        grad_lse_a=grads[1], grad_o_b=grads[2], grad_lse_b=grads[3], base=2), grads)
    if got is not None:
        ref = reference_merge_states_backward(np.stack([o_a, o_b]), np.stack([lse_a, lse_b]), out, out_lse, grad_out,
                                              grad_out_lse, base=2)
        for k, name in enumerate(("grad_o_a", "grad_lse_a", "grad_o_b", "grad_lse_b")):
            close(got[k], ref[k % 2][k // 2], name)


def test_merge_varlen_backward(rng, device):
    indptr = np.array([1, 4, 4, 6], np.int64)  # states 0 and 6 in no row: zero gradients
    h, d = 2, 16
    o, lse = o64(rng, (7, h, d)), lse64(rng, (7, h))
    out, out_lse = reference_merge_varlen(o, lse, indptr)
    grad_out, grad_out_lse = o64(rng, (3, h, d)), lse64(rng, (3, h), 1.0)
    grad_o, grad_lse = nan64(device, o.shape), nan64(device, lse.shape)
    got = outcome(device, lambda: attnmerge.merge_varlen_backward(
        *(device.put(x) for x in (grad_out, grad_out_lse, out, out_lse, o, lse, indptr)), grad_o=grad_o,
        grad_lse=grad_lse), (grad_o, grad_lse))
    if got is not None:
        want_o, want_lse = np.zeros(o.shape), np.zeros(lse.shape)
        for r in range(3):
            lo, hi = indptr[r], indptr[r + 1]
            g = reference_merge_states_backward(o[lo:hi, None], lse[lo:hi, None], out[r:r + 1], out_lse[r:r + 1],
                                                grad_out[r:r + 1], grad_out_lse[r:r + 1])
            want_o[lo:hi], want_lse[lo:hi] = g[0][:, 0], g[1][:, 0]
        close(got[0], want_o, "grad_o")
        close(got[1], want_lse, "grad_lse")


def test_torch_gradcheck_in_float64_without_warnings():
    """The standard torch.autograd.gradcheck, float64 and default tolerances, of the library's own
    forward and backward on torch CPU tensors (a torch.autograd.Function local to the test): no
    warning, every gradient within gradcheck's tolerances of finite differences."""
    torch = pytest.importorskip("torch")
    import warnings

    class MergeStates(torch.autograd.Function):
        @staticmethod
        def forward(ctx, o, lse):
            out, out_lse = torch.empty_like(o[:, 0]), torch.empty_like(lse[:, 0])
            attnmerge.merge_states(o.detach(), lse.detach(), out=out, out_lse=out_lse)
            ctx.save_for_backward(o, lse, out, out_lse)
            return out, out_lse

        @staticmethod
        def backward(ctx, grad_out, grad_out_lse):
            o, lse, out, out_lse = ctx.saved_tensors
            grad_o, grad_lse = torch.empty_like(o), torch.empty_like(lse)
            attnmerge.merge_states_backward(grad_out.contiguous(), grad_out_lse.contiguous(), out, out_lse,
                                            o.detach(), lse.detach(), grad_o=grad_o, grad_lse=grad_lse)
            return grad_o, grad_lse

    gen = torch.Generator().manual_seed(0)
    o = torch.randn(3, 4, 2, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    lse = (2 * torch.randn(3, 4, 2, dtype=torch.float64, generator=gen)).requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.autograd.gradcheck(MergeStates.apply, (o, lse))


# --------------------------------------------------------------------------------------------------
# the Python layer's outputs


def test_allocated_float64_outputs_are_float64(rng):
    o_a, o_b, lse_a, lse_b = o64(rng, (5, 2, 8)), o64(rng, (5, 2, 8)), lse64(rng, (5, 2)), lse64(rng, (5, 2))
    out, out_lse = attnmerge.merge(o_a, lse_a, o_b, lse_b)
    ref_o, ref_lse = reference_merge(o_a, lse_a, o_b, lse_b)
    close(out, ref_o, "out")
    close(out_lse, ref_lse, "out_lse")


def test_attnmerge_jax_takes_float64_under_x64_with_float64_gradients(rng):
    """Under jax_enable_x64 a float64 call runs the CPU path in float64, forward and gradients."""
    jax = pytest.importorskip("jax")
    try:
        import attnmerge.jax as amj
    except ImportError as e:
        pytest.skip(f"attnmerge.jax: {e}")
    from jax.test_util import check_grads
    enable_x64 = jax.enable_x64 if hasattr(jax, "enable_x64") else __import__("jax.experimental").experimental.enable_x64
    o_a, o_b, lse_a, lse_b = o64(rng, (5, 2, 8)), o64(rng, (5, 2, 8)), lse64(rng, (5, 2)), lse64(rng, (5, 2))
    cpu = jax.devices("cpu")[0]
    with enable_x64(True), jax.default_device(cpu):  # check_grads' perturbed arguments stay on the CPU too
        jnp = jax.numpy
        args = [jax.device_put(jnp.asarray(x), cpu) for x in (o_a, lse_a, o_b, lse_b)]
        out, out_lse = amj.merge(*args)
        assert out.dtype == jnp.float64 and out_lse.dtype == jnp.float64
        ref_o, ref_lse = reference_merge(o_a, lse_a, o_b, lse_b)
        close(np.asarray(out), ref_o, "out")
        close(np.asarray(out_lse), ref_lse, "out_lse")
        check_grads(lambda *x: amj.merge(*x)[0], args, order=1, modes=["rev"])
