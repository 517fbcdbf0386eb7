"""PyTorch CPU tensors: the CPU path through the DLPack exchange API (no GPU needed; skipped
without torch).  Outputs are allocated as torch CPU tensors."""

from __future__ import annotations

import numpy as np
import pytest

import attnmerge
from oracle import (
    DTYPES,
    assert_fp8_close,
    assert_merge_matches,
    assert_lse_close,
    assert_o_close,
    fp8_dtype,
    nan_array,
    random_lse,
    random_pair,
    random_stacked,
    random_state,
    reference_merge,
    reference_merge_stacked,
    reference_merge_varlen,
)

torch = pytest.importorskip("torch")


def put(x: np.ndarray):
    if x.dtype.name == "bfloat16":
        return torch.from_numpy(x.astype(np.float32)).to(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(x))


def get(t) -> np.ndarray:
    return t.float().numpy() if t.dtype == torch.bfloat16 else t.numpy()


def host_inputs(rng, tokens=29, heads=4, head_size=72, dtype="float32"):
    return random_pair(rng, tokens, heads, head_size, dtype)


@pytest.mark.parametrize("out_dtype", DTYPES)
@pytest.mark.parametrize("in_dtype", DTYPES)
def test_every_dtype_pair_allocated_as_torch_cpu_tensors(rng, in_dtype, out_dtype):
    h = host_inputs(rng, dtype=in_dtype)
    out, out_lse = attnmerge.merge(*[put(x) for x in h], out_dtype=out_dtype)
    assert isinstance(out, torch.Tensor) and out.device.type == "cpu"
    assert out.dtype == getattr(torch, out_dtype) and out_lse.dtype == torch.float32
    assert_merge_matches(get(out), get(out_lse), reference_merge(*h), out_dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_into_given_strided_outputs(rng, dtype):
    h = host_inputs(rng, head_size=100, dtype=dtype)
    out_buf = put(nan_array((29, 4, 128), dtype))
    out = out_buf[:, :, 8:108]
    out_lse_ht = put(nan_array((4, 29)))
    lse_a_ht = put(np.ascontiguousarray(h[1].T))
    res, res_lse = attnmerge.merge(put(h[0]), lse_a_ht.T, put(h[2]), put(h[3]), out=out, out_lse=out_lse_ht.T)
    assert res is out
    assert_merge_matches(get(out), get(out_lse_ht).T, reference_merge(*h), dtype)
    assert torch.isnan(out_buf[:, :, :8].float()).all() and torch.isnan(out_buf[:, :, 108:].float()).all()


def test_torch_dtype_as_out_dtype(rng):
    h = host_inputs(rng)
    out, _ = attnmerge.merge(*[put(x) for x in h], out_dtype=torch.float16)
    assert out.dtype == torch.float16
    assert_o_close(get(out), reference_merge(*h)[0], "float16")


def test_semantics_rows(rng):
    o_a, lse_a, o_b, lse_b = host_inputs(rng, tokens=12)
    lse_a[0] = np.inf
    o_a[0] = np.nan
    lse_a[1] = lse_b[1] = -np.inf
    lse_b[2, 1] = np.nan
    out, out_lse = attnmerge.merge(put(o_a), put(lse_a), put(o_b), put(lse_b), base=2, a_tokens=10)
    assert_merge_matches(get(out), get(out_lse), reference_merge(o_a, lse_a, o_b, lse_b, base=2, a_tokens=10),
                         "float32")


def test_vllm_compat_on_torch_cpu(rng):
    from attnmerge.compat.vllm import merge_attn_states

    t, h, d = 21, 4, 64
    po, pl = put(random_state(rng, t, h, d, "bfloat16")[0]), put(random_lse(rng, (h, t)))
    so, sl = put(random_state(rng, t, h, d, "bfloat16")[0]), put(random_lse(rng, (h, t)))
    output = put(nan_array((t, h, d), "bfloat16"))
    output_lse = put(nan_array((h, t)))
    merge_attn_states(output, po, pl, so, sl, output_lse, prefill_tokens_with_context=15)
    ref = reference_merge(get(po), get(pl).T, get(so), get(sl).T, a_tokens=15)
    assert_merge_matches(get(output), get(output_lse).T, ref, "bfloat16", "output")


def test_torch_and_numpy_may_mix_on_the_cpu(rng):
    """Host arrays of two libraries are all on one device, the host."""
    h = host_inputs(rng)
    out, out_lse = attnmerge.merge(put(h[0]), h[1], put(h[2]), h[3])

    def anyget(x):
        return get(x) if isinstance(x, torch.Tensor) else np.asarray(x)

    assert_merge_matches(anyget(out), anyget(out_lse), reference_merge(*h), "float32")


def test_merge_states_in_the_all_gather_layout(rng):
    o, lse = random_stacked(rng, 13, 4, 3, 64, states_axis=0)
    out, out_lse = attnmerge.merge_states(torch.from_numpy(o), torch.from_numpy(lse), states_axis=0)
    assert isinstance(out, torch.Tensor) and isinstance(out_lse, torch.Tensor)
    assert out.shape == (13, 3, 64) and out_lse.shape == (13, 3)
    assert_merge_matches(out.numpy(), out_lse.numpy(), reference_merge_stacked(o, lse, states_axis=0), "float32")


def test_merge_states_of_bfloat16_views(rng):
    o, lse = random_stacked(rng, 13, 3, 4, 72, states_axis=1)
    ot = torch.from_numpy(np.ascontiguousarray(np.moveaxis(o, 1, 0))).to(torch.bfloat16)  # [S, T, H, D]
    o_bf = ot.float().numpy()
    out = torch.full((13, 4, 80), float("nan"), dtype=torch.bfloat16)[:, :, 8:]
    out_lse = torch.full((4, 13), float("nan"))
    attnmerge.merge_states(ot.transpose(0, 1), torch.from_numpy(lse), out=out, out_lse=out_lse.T)
    ref = reference_merge_stacked(o_bf, np.moveaxis(lse, 1, 0), states_axis=0)
    assert_merge_matches(out.float().numpy(), out_lse.T.numpy(), ref, "bfloat16")


def test_merge_inplace_with_a_mask(rng):
    o, lse = random_state(rng, 17, 4, 64)
    o2, lse2 = random_state(rng, 17, 4, 64)
    ref = reference_merge(o, lse, o2, lse2)
    to, tl = torch.from_numpy(o.copy()), torch.from_numpy(lse.copy())
    mask = torch.ones(17, dtype=torch.bool)
    mask[3] = False
    res, res_lse = attnmerge.merge_inplace(to, tl, torch.from_numpy(o2), torch.from_numpy(lse2), mask=mask)
    assert res is to and res_lse is tl
    on = mask.numpy()
    assert np.array_equal(to.numpy()[3], o[3]) and np.array_equal(tl.numpy()[3], lse[3])
    assert_o_close(to.numpy()[on], ref[0][on], "float32", "o")
    assert_lse_close(tl.numpy()[on], ref[1][on], "lse")


def test_merge_varlen_allocates_torch_cpu_tensors(rng):
    indptr = np.array([0, 2, 2, 5], np.int64)
    o, lse = random_state(rng, 5, 3, 40)
    out, out_lse = attnmerge.merge_varlen(torch.from_numpy(o), torch.from_numpy(lse), torch.from_numpy(indptr))
    assert isinstance(out, torch.Tensor) and out.shape == (3, 3, 40)
    assert_merge_matches(out.numpy(), out_lse.numpy(), reference_merge_varlen(o, lse, indptr), "float32")


def test_a_float8_output_and_a_scale_tensor(rng):
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("this torch has no float8_e4m3fn")
    o_a, lse_a = random_state(rng, 12, 3, 64)
    o_b, lse_b = random_state(rng, 12, 3, 64)
    t = [torch.from_numpy(x) for x in (o_a, lse_a, o_b, lse_b)]
    out, out_lse = attnmerge.merge(*t, out_dtype=torch.float8_e4m3fn, output_scale=torch.tensor([0.5]))
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float8_e4m3fn
    ref_o, ref_lse = reference_merge(o_a, lse_a, o_b, lse_b)
    assert_fp8_close(out.view(torch.uint8).numpy().view(fp8_dtype()), ref_o, 0.5)
    given = torch.full((12, 3, 64), float("nan")).to(torch.float8_e4m3fn)
    attnmerge.merge(*t, out=given)
    assert_fp8_close(given.view(torch.uint8).numpy().view(fp8_dtype()), ref_o, 1.0)
