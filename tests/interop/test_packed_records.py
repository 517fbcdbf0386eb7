"""Packed records: a row's O and its float32 LSE in one buffer, so that one all-to-all moves both
(docs/context-parallel.md, "Packed records").  merge_states takes the one buffer as two strided
views, ``o = records[..., :D]`` and ``lse = records[..., D:D + 4 / itemsize].view(float32)[..., 0]``,
on every device and with the states' axis at 0, 1 or 2 (the receive buffers of an all-to-all),
and gives the float64 oracle's merge; the padding is never read (it holds NaN here).

Two packings: "aligned", D + 16 / itemsize lanes (D + 8 for 16-bit O: every row 16-byte aligned
where D * itemsize is), and "tight", D + 4 / itemsize (vLLM's D + 2 for 16-bit O, no padding):
its rows are not 16-byte aligned, so the GPU reads them with narrower vector accesses than the
aligned packing's (attnmerge.last_launch()["vec"]), and the results are the same.
"""
from __future__ import annotations

import numpy as np
import pytest

import attnmerge
from oracle import assert_merge_matches, nan_array, np_dtype, random_lse, random_o, reference_merge_stacked

S, T, H, D = 3, 5, 4, 64
PACKINGS = {"aligned": 16, "tight": 4}  # the bytes that follow a row's O: its LSE, then the padding


def stacked_shape(states_axis):
    """The states' shape without head_size, the states' axis at states_axis."""
    shape = [T, H]
    shape.insert(states_axis, S)
    return tuple(shape)


def records_of(o, lse, tail_bytes):
    """NumPy records [..., D + tail_bytes / itemsize] of o's dtype: O, the LSE's bits in the lanes
    after it, NaN in the rest."""
    records = nan_array(o.shape[:-1] + (D + tail_bytes // o.itemsize,), o.dtype)
    records[..., :D] = o
    records[..., D:D + 4 // o.itemsize].view(np.float32)[..., 0] = lse
    return records


def on_device(device, records):
    """The records on the device, bit for bit (moved as integers: a bit-cast LSE lane may be a NaN
    pattern of O's dtype, which a conversion could change)."""
    bits = device.put(records.view(f"int{8 * records.itemsize}"))
    return bits.view(device.dtype(records.dtype.name))


def views(device, records, itemsize):
    """(o, lse): the two strided views of the one buffer that merge_states reads."""
    lse_lanes = records[..., D:D + 4 // itemsize]
    return records[..., :D], lse_lanes.view(device.dtype("float32"))[..., 0]


@pytest.mark.parametrize("states_axis", [0, 1, 2])
@pytest.mark.parametrize("packing", list(PACKINGS))
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_merge_states_reads_packed_records_as_two_views(device, rng, dtype, packing, states_axis):
    shape = stacked_shape(states_axis)
    o, lse = random_o(rng, shape + (D,), dtype), random_lse(rng, shape)
    lse[(slice(None),) * states_axis + (1,)] = -np.inf  # state 1 empty in every row
    token_2 = [slice(None)] * 3
    token_2[1 if states_axis == 0 else 0] = 2
    lse[tuple(token_2)] = -np.inf  # every state of token 2 empty: O = 0, LSE = -inf
    records = on_device(device, records_of(o, lse, PACKINGS[packing]))
    o_view, lse_view = views(device, records, np_dtype(dtype).itemsize)
    out, out_lse = device.nan((T, H, D), dtype), device.nan((T, H))
    attnmerge.merge_states(o_view, lse_view, states_axis=states_axis, out=out, out_lse=out_lse)
    assert_merge_matches(device.get(out), device.get(out_lse), reference_merge_stacked(o, lse, states_axis=states_axis),
                         dtype)
    if device.on_gpu:
        widest = 16 // np_dtype(dtype).itemsize
        vec = attnmerge.last_launch()["vec"]
        assert vec == widest if packing == "aligned" else vec < widest, (packing, vec)
