"""Block-scaled outputs (block_format="mxfp8" or "nvfp4", scale_layout=, scale_rounding=) of merge,
merge_states, merge_varlen and merge_share, on every device.

The rules are the formats' reference quantizers', bit for bit (oracle.mx_reference,
oracle.nvfp4_reference, oracle.swizzle: written from the rules, and held to torchao's quantizers
where those run): a merge whose second state is empty passes its first through unchanged (weight
1), so that its quantized output is the quantizer's of those very float32 values, compared bit for
bit; a merge of live states is compared with the quantizer of its float64 merge: the same scales
and NVFP4 codes but where the float64 value lies at a rounding's edge (oracle.assert_block_close),
MXFP8's values within one E4M3 step.  The LSE is the merge's as ever.  NaN rows get
NaN scales (MXFP8: 255 and NaN values; NVFP4: 0x7F, values 0x3); an all-empty row is zeros, with
the least scale (MXFP8: byte 0; NVFP4: 2^-6).
"""

from __future__ import annotations

import numpy as np
import pytest

import attnmerge
from oracle import (
    as_bytes,
    assert_block_close,
    assert_lse_close,
    fp8_dtype,
    mx_reference,
    nvfp4_reference,
    random_lse,
    random_o,
    random_stacked,
    random_state,
    reference_merge,
    reference_merge_share,
    reference_merge_stacked,
    reference_merge_varlen,
    swizzle,
)

# (block_format, scale_rounding, global scale): the formats' variants
FORMATS = [("mxfp8", "floor", None), ("mxfp8", "rceil", None), ("nvfp4", "floor", None), ("nvfp4", "floor", 0.37)]
FORMAT_IDS = ["mxfp8", "mxfp8-rceil", "nvfp4", "nvfp4-global"]
LAYOUTS = ["row_major", "swizzled"]


def put(device, *xs):
    return [device.put(x) for x in xs]


def quantized(x, fmt, rounding, g):
    """The reference's (values as bytes, scales as bytes) of float32 x [..., D]."""
    if fmt == "mxfp8":
        v, s = mx_reference(x, rounding)
        return v.view(np.uint8), s
    v, s = nvfp4_reference(x, 1.0 if g is None else g)
    return v, s.view(np.uint8)


def kwargs_of(fmt, rounding, g, layout="row_major"):
    kw = dict(block_format=fmt, scale_layout=layout)
    if rounding != "floor":
        kw["scale_rounding"] = rounding
    if g is not None:
        kw["output_scale"] = g
    return kw


def poisoned(device, shape, dtype):
    """A device array of 0xFF bytes: NaN as float32 and FP8 E4M3, for NVFP4 -6 in both nibbles, for
    UE8M0 the NaN scale."""
    dt = np.dtype(dtype) if dtype != "float8_e4m3fn" else fp8_dtype()
    return device.put(np.full(int(np.prod(shape)) * dt.itemsize, 0xFF, np.uint8).view(dt).reshape(shape))


def outputs(device, fmt, layout, shape):
    """out, out_lse and the scales of a call whose merge has `shape` [rows, heads, head_size], given
    to the call poisoned."""
    rows, h, d = shape
    block = 32 if fmt == "mxfp8" else 16
    if layout == "swizzled":
        scales = (-(-rows // 128), -(-h * d // block // 4), 512)
    else:
        scales = (rows, h, d // block)
    return dict(out=poisoned(device, (rows, h, d) if fmt == "mxfp8" else (rows, h, d // 2),
                             "float8_e4m3fn" if fmt == "mxfp8" else "uint8"),
                out_lse=poisoned(device, (rows, h), "float32"),
                group_scales=poisoned(device, scales, "uint8" if fmt == "mxfp8" else "float8_e4m3fn"))


def edge_values(rng, shape):
    """float32 values of every magnitude, with the rules' edges: all-zero blocks, ties of E2M1 and
    E4M3, blocks whose largest magnitude is a power of two or just past one, saturation."""
    x = rng.standard_normal(shape).astype(np.float32) * np.exp2(rng.integers(-30, 30, shape[:-1] + (1,)))
    x = x.astype(np.float32)
    flat = x.reshape(-1, shape[-1])
    flat[0, :32] = 0.0
    flat[1, :16] = np.float32(0.75) * np.array([1, -1] * 8, np.float32)  # E2M1 ties
    flat[1, 16:32] = [2.5, 6.0, 5.0, 3.5, 1.25, 1.75, 0.25, 0.5, -2.5, -5, 7.0, 448.0, 3.0, 0.1, 1e-3, 9.0]
    flat[2, :32] = np.float32(2.0 ** 7)  # amax a power of two
    flat[2, 0] = np.nextafter(np.float32(2.0 ** 7), np.float32(np.inf))
    flat[3, :32] = np.float32(448.0 * 2.0**-3)  # amax / 448 a power of two (RCEIL's edge)
    flat[4, :32] = rng.uniform(-1, 1, 32).astype(np.float32) * np.float32(1e-30)  # tiny, in normal range
    return x


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("fmt, rounding, g", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("in_dtype", ["float32", "bfloat16"])
def test_a_passed_through_state_is_quantized_bit_for_bit(rng, device, in_dtype, fmt, rounding, g, layout):
    """130 tokens (two tiles of rows, the second padded), 3 heads of 64: the swizzled tiles' padding
    columns and rows are zeros in a buffer poisoned before the call."""
    t, h, d = 130, 3, 64
    o_a = edge_values(rng, (t, h, d))
    if in_dtype == "bfloat16":
        o_a = o_a.astype(np.float32).astype(random_o(rng, (1,), "bfloat16").dtype)
    x = o_a.astype(np.float32)
    lse_a = random_lse(rng, (t, h))
    o_b, lse_b = random_o(rng, (t, h, d), in_dtype), np.full((t, h), -np.inf, np.float32)
    want_v, want_s = quantized(x, fmt, rounding, g)
    if layout == "swizzled":
        want_s = swizzle(want_s)
        buf = device.put(np.full(want_s.shape, 0xFF, np.uint8))
        scales = buf if fmt == "mxfp8" else (buf.view(fp8_dtype()) if device.name == "cpu" else
                                            buf.view(device.dtype("float8_e4m3fn")))
        kw = dict(group_scales=scales)
    else:
        kw = {}
    out, out_lse, got_s = attnmerge.merge(*put(device, o_a, lse_a, o_b, lse_b), **kwargs_of(fmt, rounding, g, layout),
                                          **kw)
    got_v, got_s = as_bytes(device.get(out)), as_bytes(device.get(got_s))
    assert got_v.shape == want_v.shape and got_s.shape == want_s.shape, (got_v.shape, got_s.shape)
    assert np.array_equal(got_s, want_s), np.argwhere(got_s != want_s)[:5]
    assert np.array_equal(got_v, want_v), np.argwhere(got_v != want_v)[:5]
    assert_lse_close(device.get(out_lse), lse_a)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("fmt, rounding, g", FORMATS, ids=FORMAT_IDS)
def test_the_reference_quantizers_give_the_same_bits(rng, device, fmt, rounding, g, layout):
    """torchao's pure-PyTorch quantizers (to_mx, nvfp4_quantize, to_blocked) on the passed-through
    values: scales and values bit for bit.  (torchao 0.18's own edges are left out: blocks below
    2^-119 and infinities, where its releases differ from the rules, which follow its newer code
    and TransformerEngine.)"""
    torch = pytest.importorskip("torch")
    mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    nv = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.utils import to_blocked

    t, h, d = 70, 2, 128
    x = (rng.standard_normal((t, h, d)) * np.exp2(rng.integers(-40, 40, (t, h, 1)))).astype(np.float32)
    x[1, 0, :32] = 0.0
    lse = random_lse(rng, (t, h))
    out, _, scales = attnmerge.merge(*put(device, x, lse, x, np.full((t, h), -np.inf, np.float32)),
                                     **kwargs_of(fmt, rounding, g, layout))
    flat = torch.from_numpy(x.reshape(t, h * d))
    if fmt == "mxfp8":
        mode = ScaleCalculationMode.RCEIL if rounding == "rceil" else ScaleCalculationMode.FLOOR
        ref_s, ref_v = mx.to_mx(flat, torch.float8_e4m3fn, 32, mode)
    else:
        ref_s, ref_v = nv.nvfp4_quantize(flat, per_tensor_scale=None if g is None else torch.tensor(g))
    ref_s = ref_s.view(torch.uint8).reshape(t, -1)
    if layout == "swizzled":
        ref_s = to_blocked(ref_s)
    assert np.array_equal(as_bytes(device.get(scales)).reshape(-1), ref_s.numpy().reshape(-1))
    assert np.array_equal(as_bytes(device.get(out)).reshape(-1), ref_v.view(torch.uint8).numpy().reshape(-1))


@pytest.mark.parametrize("fmt, rounding, g", FORMATS, ids=FORMAT_IDS)
def test_the_oracle_is_the_reference_quantizers(rng, fmt, rounding, g):
    """The oracle, written from the formats' rules, against torchao's quantizers on the edges of
    the rules (ties, powers of two, saturation, all-zero blocks) and its swizzle against to_blocked:
    the same bits, so that a test that holds the library to the oracle holds it to the references."""
    torch = pytest.importorskip("torch")
    mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    nv = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.utils import to_blocked

    x = edge_values(rng, (130, 3, 64)).reshape(130, 3 * 64)
    want_v, want_s = quantized(x, fmt, rounding, g)
    flat = torch.from_numpy(x)
    if fmt == "mxfp8":
        mode = ScaleCalculationMode.RCEIL if rounding == "rceil" else ScaleCalculationMode.FLOOR
        ref_s, ref_v = mx.to_mx(flat, torch.float8_e4m3fn, 32, mode)
    else:
        ref_s, ref_v = nv.nvfp4_quantize(flat, per_tensor_scale=None if g is None else torch.tensor(g))
    ref_s = ref_s.view(torch.uint8).reshape(130, -1)
    assert np.array_equal(want_s, ref_s.numpy()), np.argwhere(want_s != ref_s.numpy())[:5]
    ref_v = ref_v.view(torch.uint8).numpy()
    assert np.array_equal(want_v, ref_v), np.argwhere(want_v != ref_v)[:5]
    assert np.array_equal(swizzle(want_s).reshape(-1), to_blocked(ref_s).numpy().reshape(-1))


@pytest.mark.parametrize("fmt, rounding, g", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_merge(rng, device, fmt, rounding, g, layout):
    """Two live states, rows of every magnitude, a NaN row and an all-empty one."""
    o_a, lse_a = random_state(rng, 37, 4, 128, "bfloat16")
    o_b, lse_b = random_state(rng, 37, 4, 128, "bfloat16")
    o_a[:, :, :64] *= np.asarray(1000.0, o_a.dtype)
    lse_a[5, 2] = np.nan
    lse_a[6, 1] = lse_b[6, 1] = -np.inf
    ref_o, ref_lse = reference_merge(o_a, lse_a, o_b, lse_b)
    out, out_lse, scales = attnmerge.merge(*put(device, o_a, lse_a, o_b, lse_b), **kwargs_of(fmt, rounding, g, layout),
                                           **outputs(device, fmt, layout, ref_o.shape))
    assert_block_close(fmt, rounding, g, device.get(out), device.get(scales), ref_o, layout)
    assert_lse_close(device.get(out_lse), ref_lse)
    v, s = as_bytes(device.get(out)), as_bytes(device.get(scales))
    assert not v[6, 1].any()  # an all-empty row: zeros
    if layout == "row_major":
        assert np.all(s[6, 1] == (0 if fmt == "mxfp8" else 0x08))  # the least scale: 2^-127, or 2^-6
        assert np.all(s[5, 2] == (255 if fmt == "mxfp8" else 0x7F))  # a NaN row's: NaN


@pytest.mark.parametrize("fmt, rounding, g", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("states", [1, 3, 40])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_merge_states(rng, device, fmt, rounding, g, states, layout):
    """Decode shapes included (few rows, many states: on the GPU the states kernel, whose finishing
    threads meet in shared memory)."""
    o, lse = random_stacked(rng, 5, states, 8, 128, "bfloat16")
    lse[1, :, 2] = -np.inf
    sink = random_lse(rng, (8,))
    ref_o, ref_lse = reference_merge_stacked(o, lse, sink=sink)
    out, out_lse, scales = attnmerge.merge_states(*put(device, o, lse), sink=device.put(sink),
                                                  **kwargs_of(fmt, rounding, g, layout),
                                                  **outputs(device, fmt, layout, ref_o.shape))
    assert_block_close(fmt, rounding, g, device.get(out), device.get(scales), ref_o, layout)
    assert_lse_close(device.get(out_lse), ref_lse)


@pytest.mark.parametrize("fmt, rounding, g", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_merge_varlen(rng, device, fmt, rounding, g, layout):
    o, lse = random_state(rng, 23, 4, 96, "float16")
    indptr = np.array([0, 3, 3, 10, 23], np.int32)
    ref_o, ref_lse = reference_merge_varlen(o, lse, indptr)
    out, out_lse, scales = attnmerge.merge_varlen(*put(device, o, lse, indptr), **kwargs_of(fmt, rounding, g, layout),
                                                  **outputs(device, fmt, layout, ref_o.shape))
    assert_block_close(fmt, rounding, g, device.get(out), device.get(scales), ref_o, layout)
    assert_lse_close(device.get(out_lse), ref_lse)


@pytest.mark.parametrize("fmt, rounding, g", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_merge_share(rng, device, fmt, rounding, g, layout):
    o = random_o(rng, (11, 4, 128), "bfloat16")
    lse = random_lse(rng, (11, 6, 4))
    ref_o, ref_lse = reference_merge_share(o, lse, 2)
    out, out_lse, scales = attnmerge.merge_share(*put(device, o, lse), 2, **kwargs_of(fmt, rounding, g, layout),
                                                 **outputs(device, fmt, layout, ref_o.shape))
    assert_block_close(fmt, rounding, g, device.get(out), device.get(scales), ref_o, layout)
    assert_lse_close(device.get(out_lse), ref_lse)


def test_nvfp4_packs_the_even_element_in_the_low_nibble(device):
    """One block: 0.5 then -6 in the first byte (codes 0x1 and 0xF), the scale amax / 6 = 1."""
    x = np.zeros((1, 1, 16), np.float32)
    x[0, 0, :4] = [0.5, -6.0, 3.0, 1.0]
    out, _, scales = attnmerge.merge(*put(device, x, np.zeros((1, 1), np.float32), x,
                                          np.full((1, 1), -np.inf, np.float32)), block_format="nvfp4")
    assert as_bytes(device.get(out)).ravel()[:2].tolist() == [0xF1, 0x25]
    assert np.asarray(device.get(scales)).astype(np.float32).ravel().tolist() == [1.0]


def test_a_global_scale_in_memory_is_the_number(rng, device):
    """NVFP4's global scale as a one-element float32 array, read by the kernel: the same bits."""
    o_a, lse_a = random_state(rng, 9, 2, 64, "float32")
    o_b, lse_b = random_state(rng, 9, 2, 64, "float32")
    args = put(device, o_a, lse_a, o_b, lse_b)
    a = attnmerge.merge(*args, block_format="nvfp4", output_scale=0.01)
    b = attnmerge.merge(*args, block_format="nvfp4", output_scale=device.put(np.array([0.01], np.float32)))
    assert np.array_equal(as_bytes(device.get(a[0])), as_bytes(device.get(b[0])))
    assert np.array_equal(as_bytes(device.get(a[2])), as_bytes(device.get(b[2])))
