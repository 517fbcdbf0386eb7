"""Launch options that change how a merge is launched, never what it computes.

- Programmatic dependent launch (`pdl=True`, ATTNMERGE_PDL in options.flags): on sm_90 and newer the
  kernel may be scheduled while the previous kernel on the stream still runs and waits for it before
  reading; elsewhere (older GPUs, the CPU) it is ignored.  Every op takes it.
- ATTNMERGE_DEVICE_KNOWN (attnmerge_tensor.flags): the caller vouches for the tensor's device, so
  the library skips its pointer query; the binding sets it for arrays whose framework named their
  device (DLPack).  Every other check still applies.
"""

from __future__ import annotations

import numpy as np
import pytest

import attnmerge
import c_abi
from oracle import assert_merge_matches, nan_array, random_state, reference_merge


def _states(rng, tokens=23, heads=4, head_size=64, dtype="float32"):
    o_a, lse_a = random_state(rng, tokens, heads, head_size, dtype, 3.0)
    o_b, lse_b = random_state(rng, tokens, heads, head_size, dtype, 3.0)
    return o_a, lse_a, o_b, lse_b


# --------------------------------------------------------------------------------------------------
# on the CPU: accepted by every op, nothing changes


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_pdl_is_accepted_and_ignored_on_the_cpu(rng, dtype):
    o_a, lse_a, o_b, lse_b = _states(rng, dtype=dtype)
    plain, plain_lse = attnmerge.merge(o_a, lse_a, o_b, lse_b)
    out, out_lse = nan_array(o_a.shape, dtype), nan_array(lse_a.shape)
    attnmerge.merge(o_a, lse_a, o_b, lse_b, out=out, out_lse=out_lse, pdl=True)
    assert np.array_equal(out.view(np.uint8), plain.view(np.uint8)) and np.array_equal(out_lse, plain_lse)
    assert_merge_matches(out, out_lse, reference_merge(o_a, lse_a, o_b, lse_b), dtype)


def test_pdl_with_the_n_way_varlen_and_in_place_merges_on_the_cpu(rng):
    o = rng.standard_normal((9, 3, 4, 32)).astype(np.float32)
    lse = (3 * rng.standard_normal((9, 3, 4))).astype(np.float32)
    want = attnmerge.merge_states(o, lse)
    got = attnmerge.merge_states(o, lse, pdl=True)
    assert all(np.array_equal(w, g) for w, g in zip(want, got))
    flat_o, flat_lse = o.reshape(27, 4, 32), lse.reshape(27, 4)
    indptr = np.array([0, 2, 2, 9, 27], dtype=np.int32)
    want = attnmerge.merge_varlen(flat_o, flat_lse, indptr)
    got = attnmerge.merge_varlen(flat_o, flat_lse, indptr, pdl=True)
    assert all(np.array_equal(w, g) for w, g in zip(want, got))
    o_a, lse_a, o_b, lse_b = _states(rng)
    ref = reference_merge(o_a, lse_a, o_b, lse_b)
    attnmerge.merge_inplace(o_a, lse_a, o_b, lse_b, pdl=True)
    assert_merge_matches(o_a, lse_a, ref, "float32")


@pytest.mark.parametrize("op", ["merge", "inplace", "states", "varlen"])
def test_the_c_abi_takes_the_pdl_flag_for_every_op(rng, op):
    o_a, lse_a, o_b, lse_b = _states(rng, tokens=5, heads=2, head_size=16)
    opts = c_abi.options(flags=c_abi.PDL)
    out, out_lse = nan_array(o_a.shape), nan_array(lse_a.shape)
    T = c_abi.tensor_from
    if op == "merge":
        status = c_abi.merge(T(out), T(out_lse), T(o_a), T(lse_a), T(o_b), T(lse_b), opts)
        ref = reference_merge(o_a, lse_a, o_b, lse_b)
    elif op == "inplace":
        ref = reference_merge(o_a, lse_a, o_b, lse_b)
        out, out_lse = o_a, lse_a
        status = c_abi.merge_inplace(T(o_a), T(lse_a), T(o_b), T(lse_b), None, opts)
    elif op == "states":
        o, lse = np.stack([o_a, o_b], axis=1), np.stack([lse_a, lse_b], axis=1)
        status = c_abi.merge_states(T(out), T(out_lse), T(o), T(lse), opts)
        ref = reference_merge(o_a, lse_a, o_b, lse_b)
    else:
        o = np.stack([o_a, o_b], axis=1).reshape(10, 2, 16)
        lse = np.stack([lse_a, lse_b], axis=1).reshape(10, 2)
        indptr = np.arange(0, 11, 2, dtype=np.int64)
        status = c_abi.merge_varlen(T(out), T(out_lse), T(o), T(lse), T(indptr), opts)
        ref = reference_merge(o_a, lse_a, o_b, lse_b)
    assert status == c_abi.SUCCESS, c_abi.last_error()
    assert_merge_matches(out, out_lse, ref, "float32")


def test_an_unknown_option_flag_is_still_refused(rng):
    o_a, lse_a, o_b, lse_b = _states(rng, tokens=3, heads=2, head_size=8)
    out, out_lse = nan_array(o_a.shape), nan_array(lse_a.shape)
    T = c_abi.tensor_from
    status = c_abi.merge(T(out), T(out_lse), T(o_a), T(lse_a), T(o_b), T(lse_b), c_abi.options(flags=1 << 8))
    assert status == c_abi.ERROR_VALUE and "options.flags" in c_abi.last_error()
    assert np.isnan(out).all() and np.isnan(out_lse).all()


def test_device_known_host_tensors_merge_on_the_cpu(rng):
    o_a, lse_a, o_b, lse_b = _states(rng)
    out, out_lse = nan_array(o_a.shape), nan_array(lse_a.shape)
    known = [c_abi.tensor_from(x, flags=c_abi.DEVICE_KNOWN) for x in (out, out_lse, o_a, lse_a, o_b, lse_b)]
    assert c_abi.merge(*known) == c_abi.SUCCESS, c_abi.last_error()
    assert_merge_matches(out, out_lse, reference_merge(o_a, lse_a, o_b, lse_b), "float32")


def test_device_known_skips_no_other_check(rng):
    """Read-only outputs, a second device, unknown flags: refused as without it, nothing written."""
    o_a, lse_a, o_b, lse_b = _states(rng, tokens=4, heads=2, head_size=8)
    out, out_lse = nan_array(o_a.shape), nan_array(lse_a.shape)
    K = c_abi.DEVICE_KNOWN
    T = c_abi.tensor_from
    cases = {
        "out": (T(out, flags=K | c_abi.READ_ONLY), T(out_lse, flags=K), T(o_a, flags=K)),
        "o_a": (T(out, flags=K), T(out_lse, flags=K), T(o_a, flags=K, device=0)),
    }
    for name, (t_out, t_lse, t_a) in cases.items():
        status = c_abi.merge(t_out, t_lse, t_a, T(lse_a, flags=K), T(o_b, flags=K), T(lse_b, flags=K))
        assert status == c_abi.ERROR_VALUE, name
        assert name in c_abi.last_error()
    status = c_abi.merge(T(out, flags=4), T(out_lse), T(o_a), T(lse_a), T(o_b), T(lse_b))
    assert status == c_abi.ERROR_VALUE and "out: expected flags" in c_abi.last_error()
    assert np.isnan(out).all() and np.isnan(out_lse).all()


# --------------------------------------------------------------------------------------------------
# on the GPU


def _torch():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA GPU")
    return torch


def _chain(steps, o0, lse0, others, pdl):
    """x_{k+1} = merge(x_k, other_k): each merge reads what the one before it wrote."""
    o, lse = o0.clone(), lse0.clone()
    outs = []
    for o_k, lse_k in others[:steps]:
        o, lse = attnmerge.merge(o, lse, o_k, lse_k, pdl=pdl)
        outs.append((o, lse))
    return outs


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 16, 4096])
def test_a_chain_of_dependent_merges_with_pdl_gives_the_plain_bits(tokens):
    """Each kernel triggers its dependents at its start, so a missing wait would read unfinished
    rows of the merge before it (4096 tokens: many waves)."""
    torch = _torch()
    g = torch.Generator(device="cuda").manual_seed(tokens)
    shape = (tokens, 32, 128)
    o0 = torch.randn(shape, device="cuda", generator=g, dtype=torch.bfloat16)
    lse0 = 3 * torch.randn(shape[:2], device="cuda", generator=g)
    others = [(torch.randn(shape, device="cuda", generator=g, dtype=torch.bfloat16),
               3 * torch.randn(shape[:2], device="cuda", generator=g)) for _ in range(8)]
    plain = _chain(8, o0, lse0, others, pdl=False)
    with_pdl = _chain(8, o0, lse0, others, pdl=True)
    torch.cuda.synchronize()
    for (p, pl), (q, ql) in zip(plain, with_pdl):
        assert torch.equal(p.view(torch.int16), q.view(torch.int16)) and torch.equal(pl, ql)


@pytest.mark.gpu
def test_pdl_merges_captured_in_a_cuda_graph():
    torch = _torch()
    shape = (64, 8, 128)
    g = torch.Generator(device="cuda").manual_seed(7)
    a = [torch.randn(shape, device="cuda", generator=g) for _ in range(3)]
    la = [3 * torch.randn(shape[:2], device="cuda", generator=g) for _ in range(3)]
    mid, mid_lse = torch.empty_like(a[0]), torch.empty_like(la[0])
    out, out_lse = torch.empty_like(a[0]), torch.empty_like(la[0])

    def step():
        attnmerge.merge(a[0], la[0], a[1], la[1], out=mid, out_lse=mid_lse, pdl=True)
        attnmerge.merge(mid, mid_lse, a[2], la[2], out=out, out_lse=out_lse, pdl=True)
        attnmerge.merge_states(torch.stack([out, a[0]], 1), torch.stack([out_lse, la[0]], 1), out=mid,
                               out_lse=mid_lse, pdl=True)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    host = [x.cpu().numpy() for x in a], [x.cpu().numpy() for x in la]
    for _ in range(2):
        mid.fill_(float("nan"))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        o1, l1 = reference_merge(host[0][0], host[1][0], host[0][1], host[1][1])
        o2, l2 = reference_merge(o1, l1, host[0][2], host[1][2])
        o3, l3 = reference_merge(o2, l2, host[0][0], host[1][0])
        assert_merge_matches(mid.cpu().numpy(), mid_lse.cpu().numpy(), (o3, l3), "float32")


@pytest.mark.gpu
def test_device_known_on_the_gpu_still_refuses_a_device_mismatch():
    """A framework's tensors carry DEVICE_KNOWN; their devices must still agree."""
    torch = _torch()
    x = torch.randn(4, 2, 8, device="cuda")
    lse = torch.randn(4, 2, device="cuda")
    out = torch.full_like(x, float("nan"))
    with pytest.raises(ValueError, match="lse_b"):
        attnmerge.merge(x, lse, x, lse.cpu(), out=out)
    assert torch.isnan(out).all()
