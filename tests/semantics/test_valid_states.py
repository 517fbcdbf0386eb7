"""Empty states from device memory: every merge takes `valid`, which says per (token, state) whether
the state holds keys (vLLM's interleaved context-parallel KV sharding, where a rank may hold none of
a sequence's keys: mask_dcp_empty_shards_), against the oracle, on every device.

    merge(..., valid=[tokens, 2]), merge_inplace(..., valid=[tokens, 2]),
    merge_states(..., valid=[tokens, S]), merge_share(..., valid=[tokens, S]),
    merge_varlen(..., valid=[total])

uint8 or bool (a mask), int32 or int64 (a count of keys, such as per-rank KV lengths), any strides;
[tokens, S] whatever states_axis.  A state whose entry is 0 weighs nothing, whatever its O and LSE
hold (NaN and garbage never reach the result: oracle.valid_lse); a row with no state left gets O = 0
and LSE = -inf (the sink, with one).  The kernels read it on the device: nothing is synchronized
with the host, so that one captured CUDA graph serves every batch (the graph test below).  Shapes
and dtypes are checked like any argument's (tests/errors/bad_inputs.py); the GPU kernels' paths in
test_forward_kernel_emulated.py.
"""

from __future__ import annotations

import numpy as np
import pytest

import attnmerge
import devices
from oracle import (DTYPES, assert_merge_matches, random_lse, random_o, random_stacked, reference_merge,
                    reference_merge_share, reference_merge_stacked, reference_merge_varlen, stats_lse, strided_view,
                    valid_lse)

VALID_DTYPES = ("uint8", "bool", "int32", "int64")


def valid_of(rng, shape, dtype="uint8", empty=0.3):
    """A random valid array: about `empty` of its entries 0; counts (int32, int64) of 1 to 100 keys
    elsewhere."""
    keys = np.where(rng.random(shape) < empty, 0, rng.integers(1, 100, shape))
    return (keys != 0) if dtype == "bool" else keys.astype(dtype)


def poisoned_where_empty(o, lse, empty, garbage=np.nan):
    """The states `empty` says hold no keys get NaN O and `garbage` LSEs (never to be read)."""
    o[empty] = np.nan
    lse[empty] = garbage


def interleaved_lengths(seq_lens, ranks, interleave=1):
    """Each rank's number of keys of each sequence under an interleaved KV sharding ([seqs, ranks]):
    blocks of `interleave` keys dealt to the ranks in turn (vLLM's DCP), so a short sequence leaves
    ranks with none."""
    seq_lens = np.asarray(seq_lens)
    base = seq_lens // (interleave * ranks) * interleave
    rest = seq_lens - base * ranks
    extra = np.clip(rest[:, None] - np.arange(ranks)[None] * interleave, 0, interleave)
    return (base[:, None] + extra).astype(np.int32)


# --------------------------------------------------------------------------------------------------
# merge_states and merge_share: valid [tokens, S]


@pytest.mark.parametrize("valid_dtype", VALID_DTYPES)
@pytest.mark.parametrize("states_axis", (0, 1, 2))
@pytest.mark.parametrize("s", (1, 2, 3, 8, 64))
def test_merge_states_skips_the_states_without_keys(rng, device, s, states_axis, valid_dtype):
    t, h, d = 13, 3, 40
    o, lse = random_stacked(rng, t, s, h, d, states_axis=states_axis)
    valid = valid_of(rng, (t, s), valid_dtype)
    valid[0] = 0  # a row with no state left: O = 0, LSE = -inf
    empty = np.moveaxis(np.broadcast_to((valid == 0)[:, :, None], (t, s, h)), 1, states_axis)
    ref = reference_merge_stacked(o, valid_lse(lse, ~empty), states_axis=states_axis)
    poisoned_where_empty(o, lse, empty)
    out, out_lse = attnmerge.merge_states(device.put(o), device.put(lse), valid=device.put(valid),
                                          states_axis=states_axis)
    out, out_lse = device.get(out), device.get(out_lse)
    assert_merge_matches(out, out_lse, ref, "float32")
    assert (out[0] == 0).all() and (out_lse[0] == -np.inf).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("s", (16, 64, 128))
def test_decode_shapes_with_empty_shards(rng, device, s, dtype):
    """Few rows, many states (on the GPU the state-parallel kernel), empty states holding garbage
    (NaN, +inf, huge LSEs that would take all the weight), and a sink."""
    t, h, d = 16, 32, 128
    o, lse = random_stacked(rng, t, s, h, d, dtype=dtype)
    valid = valid_of(rng, (t, s), "int32", empty=0.5)
    empty = np.broadcast_to((valid == 0)[:, :, None], lse.shape)
    sink = random_lse(rng, (h,))
    ref = reference_merge_stacked(o, valid_lse(lse, ~empty), sink=sink)
    lse[empty] = rng.choice([np.nan, np.inf, 1e30], size=int(empty.sum()))
    o[np.broadcast_to(empty[..., None], o.shape)] = np.nan
    out, out_lse = attnmerge.merge_states(device.put(o), device.put(lse), valid=device.put(valid),
                                          sink=device.put(sink))
    assert_merge_matches(device.get(out), device.get(out_lse), ref, dtype)


@pytest.mark.parametrize("layout", ("transposed", "token_step"))
def test_valid_has_strides_of_its_own(rng, device, layout):
    """[tokens, S] read through its strides: stored [S, tokens] (an all-gather's order), or every
    other token of a larger buffer (the rest of it 0: a read outside the view would empty a state)."""
    t, s, h, d = 24, 5, 4, 64
    o, lse = random_stacked(rng, t, s, h, d)
    valid = valid_of(rng, (t, s))
    order, steps = ((1, 0), None) if layout == "transposed" else (None, {0: 2})
    view, buf = strided_view(valid, order=order, steps=steps, fill=0)
    ref = reference_merge_stacked(o, valid_lse(lse, valid[:, :, None]))
    out, out_lse = attnmerge.merge_states(device.put(o), device.put(lse), valid=device.strided(view, buf)[0])
    assert_merge_matches(device.get(out), device.get(out_lse), ref, "float32")


def test_one_row_of_valid_for_every_token(rng):
    """A stride of 0: every token's states alike (NumPy's broadcast view, on the host)."""
    t, s, h, d = 6, 3, 2, 16
    o, lse = random_stacked(rng, t, s, h, d)
    valid = np.broadcast_to(np.array([[1, 0, 1]], np.uint8), (t, s))
    out, out_lse = attnmerge.merge_states(o, lse, valid=valid)
    assert_merge_matches(out, out_lse, reference_merge_stacked(o, valid_lse(lse, valid[:, :, None])), "float32")


def test_vllm_interleaved_kv_lengths_as_they_are(rng, device):
    """vLLM's decode context parallelism: the all-gathered states [cp, tokens, heads, ...] of 4
    ranks, each rank holding blocks of 2 of every sequence's keys in turn, so short sequences leave
    ranks empty (their LSE whatever the attention kernel left: NaN here); the per-rank KV lengths
    [tokens, cp] as valid, int32, no mask made of them."""
    cp, h, d = 4, 8, 128
    seq_lens = np.array([1, 2, 3, 5, 8, 9, 100, 0])
    lens = interleaved_lengths(seq_lens, cp, interleave=2)
    t = len(seq_lens)
    o, lse = random_stacked(rng, t, cp, h, d, states_axis=0)
    empty = np.broadcast_to((lens == 0).T[:, :, None], lse.shape)
    ref = reference_merge_stacked(o, valid_lse(lse, ~empty), states_axis=0)
    lse[empty] = np.nan
    o[np.broadcast_to(empty[..., None], o.shape)] = np.nan
    out, out_lse = attnmerge.merge_states(device.put(o), device.put(lse), states_axis=0, valid=device.put(lens))
    out, out_lse = device.get(out), device.get(out_lse)
    assert_merge_matches(out, out_lse, ref, "float32")
    assert (out[-1] == 0).all() and (out_lse[-1] == -np.inf).all()  # a padding token: no keys anywhere


@pytest.mark.parametrize("states_axis", (0, 1, 2))
def test_merge_share_with_empty_shards(rng, device, states_axis):
    """Each rank's share with the same valid states: an empty rank's share is 0 whatever its O holds,
    and the shares sum to merge_states."""
    s, t, h, d = 4, 10, 3, 64
    o_all, lse = random_stacked(rng, t, s, h, d, states_axis=states_axis)
    valid = valid_of(rng, (t, s), "bool")
    valid[1] = False
    empty = np.moveaxis(np.broadcast_to(~valid[:, :, None], (t, s, h)), 1, states_axis)
    masked = valid_lse(lse, ~empty)
    lse[empty] = np.nan
    o_states = np.moveaxis(o_all, states_axis, 0)
    whole = np.zeros((t, h, d))
    for i in range(s):
        own = np.ascontiguousarray(o_states[i])
        ref = reference_merge_share(own, masked, i, states_axis=states_axis)
        own[~valid[:, i]] = np.nan  # an empty state's own O: never read
        out, out_lse = attnmerge.merge_share(device.put(own), device.put(lse), i, states_axis=states_axis,
                                             valid=device.put(valid))
        assert_merge_matches(device.get(out), device.get(out_lse), ref, "float32")
        whole += device.get(out)
    assert_merge_matches(whole, None, reference_merge_stacked(o_all, masked, states_axis=states_axis), "float32")


# --------------------------------------------------------------------------------------------------
# merge and merge_inplace: valid [tokens, 2]; merge_varlen: valid [total]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("option", ("plain", "a_tokens", "sink", "stats"))
def test_merge_skips_the_states_without_keys(rng, device, option, dtype):
    """The two-way merge: valid [tokens, 2] (a's, b's), with a_tokens, a sink, and states given as
    softmax statistics."""
    t, h, d = 70, 4, 64
    o_a, lse_a = random_o(rng, (t, h, d), dtype), random_lse(rng, (t, h))
    o_b, lse_b = random_o(rng, (t, h, d), dtype), random_lse(rng, (t, h))
    valid = valid_of(rng, (t, 2), "uint8")
    valid[:3] = [[0, 1], [1, 0], [0, 0]]
    kw, ref_kw = {}, {}
    if option == "a_tokens":
        kw["a_tokens"] = ref_kw["a_tokens"] = 40
    elif option == "sink":
        ref_kw["sink"] = random_lse(rng, (h,))
        kw["sink"] = device.put(ref_kw["sink"])
    ref = reference_merge(o_a, valid_lse(lse_a, valid[:, :1]), o_b, valid_lse(lse_b, valid[:, 1:]), **ref_kw)
    args_a, args_b = lse_a, lse_b
    if option == "stats":
        args_a, args_b = (lse_a, np.ones_like(lse_a)), (lse_b, np.ones_like(lse_b))
    for x, lse, col in ((o_a, lse_a, 0), (o_b, lse_b, 1)):
        x[valid[:, col] == 0] = np.nan
        lse[valid[:, col] == 0] = np.nan
    out, out_lse = attnmerge.merge(device.put(o_a), devices.put_lse(device, args_a), device.put(o_b),
                                   devices.put_lse(device, args_b),
                                   valid=device.put(valid), **kw)
    assert_merge_matches(device.get(out), device.get(out_lse), ref, dtype)


def test_merge_inplace_skips_the_states_without_keys(rng, device):
    """The ring form: (o, lse) an accumulator, each step's state from a peer; valid [tokens, 2] (the
    accumulator's, the peer's): an empty accumulator takes the peer's state, an empty peer leaves
    the accumulator as it was (its values merged with nothing), both empty give O = 0, LSE = -inf;
    rows the mask leaves alone stay untouched."""
    t, h, d = 12, 3, 64
    o, lse = random_o(rng, (t, h, d)), random_lse(rng, (t, h))
    o_other, lse_other = random_o(rng, (t, h, d)), random_lse(rng, (t, h))
    valid = np.array([[1, 1], [0, 1], [1, 0], [0, 0]] * 3, np.uint8)
    mask = np.ones(t, np.uint8)
    mask[-1] = 0
    ref_o, ref_lse = reference_merge(o, valid_lse(lse, valid[:, :1]), o_other, valid_lse(lse_other, valid[:, 1:]))
    ref_o[-1], ref_lse[-1] = o[-1], lse[-1]
    o[valid[:, 0] == 0] = np.nan
    lse[valid[:, 0] == 0] = np.nan
    o[-1], lse[-1] = ref_o[-1], ref_lse[-1]
    o_other[valid[:, 1] == 0] = np.nan
    do, dl = device.put(o), device.put(lse)
    attnmerge.merge_inplace(do, dl, device.put(o_other), device.put(lse_other), mask=device.put(mask),
                            valid=device.put(valid))
    assert_merge_matches(device.get(do), device.get(dl), (ref_o, ref_lse), "float32")


def test_merge_varlen_skips_the_states_without_keys(rng, device):
    indptr = np.array([0, 2, 2, 5, 13, 40], np.int64)
    o, lse = random_o(rng, (40, 4, 64)), random_lse(rng, (40, 4))
    valid = valid_of(rng, (40,), "int64")
    valid[:2] = 0  # row 0: every state empty
    ref = reference_merge_varlen(o, valid_lse(lse, valid[:, None]), indptr)
    o[valid == 0], lse[valid == 0] = np.nan, np.nan
    total = np.ones_like(lse)
    out, out_lse = attnmerge.merge_varlen(device.put(o), (device.put(lse), device.put(total)), device.put(indptr),
                                          valid=device.put(valid))
    out, out_lse = device.get(out), device.get(out_lse)
    assert_merge_matches(out, out_lse, ref, "float32")
    assert (out[0] == 0).all() and (out_lse[0] == -np.inf).all()


def test_valid_and_softmax_statistics_together(rng, device):
    """An empty state given as statistics: neither its max nor its sum is taken (a sum of NaN)."""
    t, s, h, d = 9, 6, 2, 32
    o, m = random_stacked(rng, t, s, h, d)
    total = rng.uniform(1.0, 10.0, m.shape).astype(np.float32)
    valid = valid_of(rng, (t, s))
    ref = reference_merge_stacked(o, valid_lse(stats_lse(m, total), valid[:, :, None]))
    total[valid == 0] = np.nan
    out, out_lse = attnmerge.merge_states(device.put(o), (device.put(m), device.put(total)), valid=device.put(valid))
    assert_merge_matches(device.get(out), device.get(out_lse), ref, "float32")


# --------------------------------------------------------------------------------------------------
# CUDA graphs: the lengths are read when the graph runs


@pytest.mark.parametrize("device", devices.CUDA_ONLY, indirect=True)
def test_one_captured_graph_follows_the_lengths_in_memory(rng, device):
    """A merge captured once in a CUDA graph reads valid when replayed: new lengths written into the
    same buffer change which states count, with no host synchronization and no recapture."""
    device.gpu_only()
    torch = pytest.importorskip("torch")
    t, s, h, d = 8, 4, 4, 64
    o, lse = random_stacked(rng, t, s, h, d)
    do, dl = device.put(o), device.put(lse)
    lens = device.put(np.ones((t, s), np.int32))
    out, out_lse = device.nan((t, h, d)), device.nan((t, h))
    attnmerge.merge_states(do, dl, out=out, out_lse=out_lse, valid=lens)  # warm up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        attnmerge.merge_states(do, dl, out=out, out_lse=out_lse, valid=lens)
    for _ in range(3):
        new = interleaved_lengths(rng.integers(0, 6, t), s).astype(np.int32)
        lens.copy_(torch.from_numpy(new))
        graph.replay()
        torch.cuda.synchronize()
        ref = reference_merge_stacked(o, valid_lse(lse, new[:, :, None]))
        assert_merge_matches(device.get(out), device.get(out_lse), ref, "float32")
