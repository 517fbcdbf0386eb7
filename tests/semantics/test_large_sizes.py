"""Sizes at the library's limits give the oracle's results: element offsets past 2**31 (the two-way
merge) and past 2**30 (the N-way and variable-length merges), where the GPU kernels switch to 64-bit
offsets, and the largest head size, which fills the GPU grid's y extent.

The 64-bit-offset cases need many GiB of GPU memory: they take the `cuda` device of the device fixture
(tests/devices.py; marked `gpu`) and skip without the memory.  The largest head size runs on every
device.
"""

from __future__ import annotations

import pytest

import attnmerge
import devices
from oracle import (
    assert_merge_matches,
    nan_array,
    random_state,
    reference_merge,
    reference_merge_stacked,
    reference_merge_varlen,
)


def free_gpu_memory(torch, gib):
    free, _ = torch.cuda.mem_get_info()
    if free < gib << 30:
        pytest.skip(f"needs {gib} GiB of free GPU memory")


@pytest.mark.parametrize("device", devices.CUDA_ONLY, indirect=True)
def test_more_than_2_31_elements_use_64_bit_offsets(device):
    """2**17 + 3 tokens x 128 heads x 128 (float16): element offsets past 2**31; checked at both ends."""
    device.gpu_only()
    torch = device.torch
    free_gpu_memory(torch, 24)
    t, h, d = 2**17 + 3, 128, 128
    gen = torch.Generator(device="cuda").manual_seed(1)
    o_a = torch.randn(t, h, d, device="cuda", dtype=torch.float16, generator=gen)
    o_b = torch.randn(t, h, d, device="cuda", dtype=torch.float16, generator=gen)
    lse_a = 3 * torch.randn(h, t, device="cuda", generator=gen)  # [heads, tokens]: large LSE strides too
    lse_b = 3 * torch.randn(t, h, device="cuda", generator=gen)
    out, out_lse = attnmerge.merge(o_a, lse_a.T, o_b, lse_b)
    torch.cuda.synchronize()
    for rows in (slice(0, 4), slice(t - 4, t)):
        ref = reference_merge(
            o_a[rows].cpu().numpy(), lse_a.T[rows].cpu().numpy(), o_b[rows].cpu().numpy(), lse_b[rows].cpu().numpy()
        )
        assert_merge_matches(out[rows].cpu().numpy(), out_lse[rows].cpu().numpy(), ref, "float16")
    del o_a, o_b, out
    torch.cuda.empty_cache()


@pytest.mark.parametrize("device", devices.CUDA_ONLY, indirect=True)
def test_the_n_way_and_varlen_merges_past_2_30_elements_use_64_bit_offsets(device):
    """The N-way and variable-length kernels switch to 64-bit offsets past 2**30 elements per array
    (2**14 + 1 tokens x 4 states x 128 heads x 128, float16); rows checked at both ends."""
    device.gpu_only()
    torch = device.torch
    free_gpu_memory(torch, 12)
    t, s, h, d = 2**14 + 1, 4, 128, 128
    gen = torch.Generator(device="cuda").manual_seed(2)
    o = torch.randn(t, s, h, d, device="cuda", dtype=torch.float16, generator=gen)
    lse = 3 * torch.randn(t, s, h, device="cuda", generator=gen)
    out, out_lse = attnmerge.merge_states(o, lse)
    indptr = torch.arange(0, t * s + 1, s, device="cuda", dtype=torch.int64)  # the same rows, flat
    out_v, out_lse_v = attnmerge.merge_varlen(o.view(t * s, h, d), lse.view(t * s, h), indptr)
    torch.cuda.synchronize()
    for rows in (slice(0, 2), slice(t - 2, t)):
        ref = reference_merge_stacked(o[rows].cpu().numpy(), lse[rows].cpu().numpy())
        assert_merge_matches(out[rows].cpu().numpy(), out_lse[rows].cpu().numpy(), ref, "float16")
        first, last = rows.start * s, rows.stop * s  # the flat states of these rows
        ref_v = reference_merge_varlen(
            o.view(t * s, h, d)[first:last].cpu().numpy(),
            lse.view(t * s, h)[first:last].cpu().numpy(),
            indptr[rows.start : rows.stop + 1].cpu().numpy() - first,
        )
        assert_merge_matches(out_v[rows].cpu().numpy(), out_lse_v[rows].cpu().numpy(), ref_v, "float16")
    del o, out, out_v
    torch.cuda.empty_cache()


def test_the_largest_head_size(rng, device):
    """head_size = 65535 x 256, the largest the library takes, with one element per GPU thread (the
    views start one element past a 16-byte boundary): the head_size axis fills the grid's y extent
    exactly.  One more is refused."""
    d = 65535 * 256
    h = (*random_state(rng, 1, 1, d + 1, "float16"), *random_state(rng, 1, 1, d + 1, "float16"))
    o_a, lse_a, o_b, lse_b = [device.put(x) for x in h]
    np_out = nan_array((1, 1, d + 1), "float16")
    out, out_buf = device.strided(np_out[:, :, 1:], np_out)
    out_lse = device.nan((1, 1))
    attnmerge.merge(o_a[:, :, 1:], lse_a, o_b[:, :, 1:], lse_b, out=out, out_lse=out_lse)
    ref = reference_merge(h[0][:, :, 1:], h[1], h[2][:, :, 1:], h[3])
    got, clean = device.readback(np_out[:, :, 1:], np_out, out, out_buf)
    assert_merge_matches(got, device.get(out_lse), ref, "float16")
    assert clean, "wrote outside the out view"
    with pytest.raises(ValueError, match="head_size"):
        attnmerge.merge(*[device.put(x) for x in h])
