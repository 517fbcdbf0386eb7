"""What GPU calls launch (cpp/include/attnmerge/plan.h) at and around the plan's switch points,
and that each kernel gives the oracle's results, bit-identical from run to run.

`attnmerge.last_launch()` reports what the thread's last op enqueued.  The plan's promises (grid
limits, kStates groups, in-place rows, index width, the golden choices) are test_plan_promises.py's
on the CPU; here the GPU's own SM count decides, so these tests hold the choices the plan makes
for any GPU: a two-state merge takes a two-way kernel, the states kernel only with 16-byte accesses
and its block whole rows of `groups` groups (a power of two), a decode-sized N-way merge of many
states the states kernel and a long one the rows kernel, an in-place merge one launch unless a
row spans blocks.  The GPU tests carry the `gpu` marker; the first test runs everywhere.
"""

from __future__ import annotations

import numpy as np
import pytest

import attnmerge
from oracle import (
    assert_group_fp8_close,
    assert_merge_matches,
    fp8_dtype,
    random_lse,
    random_o,
    random_stacked,
    reference_merge,
    reference_merge_stacked,
    reference_merge_varlen,
    to_f64,
)


def test_a_host_call_launches_nothing(rng):
    o, lse = random_stacked(rng, 3, 64, 2, 16, "float32")
    attnmerge.merge_states(o, lse)
    info = attnmerge.last_launch()
    assert info["kernel"] == "none" and info["launches"] == 0


@pytest.fixture(scope="module")
def torch():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA GPU")
    return torch


def put(torch, x: np.ndarray):
    if x.dtype.name == "bfloat16":
        return torch.from_numpy(x.astype(np.float32)).cuda().to(torch.bfloat16)
    return torch.from_numpy(np.array(x, copy=True, order="C")).cuda()


def get(torch, t) -> np.ndarray:
    torch.cuda.synchronize(t.device)
    if t.dtype == torch.float8_e4m3fn:  # NumPy has no FP8 of its own: ml_dtypes' view of the bytes
        return t.cpu().contiguous().view(torch.uint8).numpy().view(fp8_dtype())
    return t.float().cpu().numpy() if t.dtype == torch.bfloat16 else t.cpu().numpy()


def nan_out(torch, shape, dtype):
    return torch.full(shape, float("nan"), device="cuda", dtype=getattr(torch, dtype))


ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


def widest_vec(head_size, *dtypes):
    """The C ABI's vector width for contiguous tensors: 16 bytes of the widest dtype, halved until
    head_size allows it."""
    vec = 16 // max(ITEMSIZE[d] for d in dtypes)
    while head_size % vec:
        vec //= 2
    return vec


def assert_states_launch(info, packs):
    """A states-kernel launch: groups a power of two, its blocks whole rows of `packs` x groups."""
    assert info["state_groups"] in (2, 4, 8, 16) and info["block"][:2] == (packs, info["state_groups"]), info


# The switch points of the N-way merge: S = 1 and 2 (rows; S = 2 the two-way kernel), 8 / 9 (the
# first split), 16 / 17, 64 / 65 (16 groups of one chunk of 4, then a second chunk for the first
# group), 255 / 256 / 257 (four chunks a group, then a fifth), at head sizes whose packs allow the
# states kernel (128) or not (67: vectors of 1 element).
SWITCH_S = (1, 2, 8, 9, 16, 17, 64, 65, 255, 256, 257)


@pytest.mark.gpu
@pytest.mark.parametrize("dtypes", [("bfloat16", "bfloat16"), ("float32", "bfloat16"), ("float16", "float32")])
@pytest.mark.parametrize("head_size", (128, 67))
@pytest.mark.parametrize("s", SWITCH_S)
def test_merge_states_switch_points(rng, torch, s, head_size, dtypes):
    in_dtype, out_dtype = dtypes
    t, h = 5, 3
    o, lse = random_stacked(rng, t, s, h, head_size, in_dtype)
    out, out_lse = nan_out(torch, (t, h, head_size), out_dtype), nan_out(torch, (t, h), "float32")
    attnmerge.merge_states(put(torch, o), put(torch, lse), out=out, out_lse=out_lse)
    info = attnmerge.last_launch()
    vec = widest_vec(head_size, in_dtype, out_dtype)
    access = vec * max(ITEMSIZE[d] for d in dtypes)
    assert (info["vec"], info["launches"]) == (vec, 1)
    if s == 2:  # the two-way kernels, plain for the dtype pairs that have them
        assert info["kernel"] in ("rows_plain", "rows") and info["state_groups"] == 1, info
    elif info["kernel"] == "states":  # 16-byte accesses only
        assert access == 16 and s > 2, info
        assert_states_launch(info, head_size // vec)
    else:
        assert (info["kernel"], info["state_groups"]) == ("rows", 1), info
    first = (get(torch, out), get(torch, out_lse))
    assert_merge_matches(*first, reference_merge_stacked(o, lse), out_dtype)
    # Bit-identical from run to run.
    out.fill_(float("nan"))
    out_lse.fill_(float("nan"))
    attnmerge.merge_states(put(torch, o), put(torch, lse), out=out, out_lse=out_lse)
    again = (get(torch, out), get(torch, out_lse))
    assert all(np.array_equal(a, b, equal_nan=True) for a, b in zip(first, again))


@pytest.mark.gpu
@pytest.mark.parametrize("t, s, kernel", [(16, 64, "states"), (4096, 16, "rows")])
def test_merge_states_strategy_by_size(rng, torch, t, s, kernel):
    """A decode-sized N-way merge of many states shares each row among groups of threads (the states
    kernel); a long one, which fills any GPU with one thread per pack of a row, takes the rows
    kernel."""
    h, d = 4, 128
    o, lse = random_stacked(rng, t, s, h, d, "bfloat16")
    lse[rng.random(lse.shape) < 0.1] = -np.inf
    out, out_lse = nan_out(torch, (t, h, d), "bfloat16"), nan_out(torch, (t, h), "float32")
    attnmerge.merge_states(put(torch, o), put(torch, lse), out=out, out_lse=out_lse)
    info = attnmerge.last_launch()
    assert info["kernel"] == kernel, info
    if kernel == "states":
        assert_states_launch(info, d // 8)
    assert_merge_matches(get(torch, out), get(torch, out_lse), reference_merge_stacked(o, lse), "bfloat16")


@pytest.mark.gpu
@pytest.mark.parametrize("s", (3, 4, 5, 8, 12))
def test_merge_states_rows_kernels_of_4_and_8_states_in_flight(rng, torch, s):
    """Long inputs (the rows kernel): at most 4 states a row take the kernel of 4 in flight; more
    stream through the kernel of 8, a chunk ahead.  Empty parts carry NaN O: a last chunk's slots
    past the row's states are not loaded and keep the chunk before's packs, which must not leak."""
    o, lse = random_stacked(rng, 4096, s, 8, 64, "bfloat16")
    lse[rng.random(lse.shape) < 0.3] = -np.inf
    o[lse == -np.inf] = np.nan
    out, out_lse = attnmerge.merge_states(put(torch, o), put(torch, lse))
    assert attnmerge.last_launch()["kernel"] == "rows"
    assert_merge_matches(get(torch, out), get(torch, out_lse), reference_merge_stacked(o, lse), "bfloat16")


@pytest.mark.gpu
@pytest.mark.parametrize("s", (9, 64, 257))
def test_merge_states_empty_and_nan_states_inside_a_split_row(rng, torch, s):
    t, h, d = 12, 4, 128
    o, lse = random_stacked(rng, t, s, h, d, "bfloat16")
    empty = rng.random((t, s, h)) < 0.4
    lse[empty] = np.where(rng.random(int(empty.sum())) < 0.5, np.inf, -np.inf)
    o[empty] = np.nan  # empty parts are never read into the result
    lse[0] = -np.inf  # every part of token 0 empty: O = 0, LSE = -inf
    lse[1, :, 0] = np.inf
    lse[2, s - 1, 1] = np.nan  # a NaN LSE in the last group's last state: a NaN row
    lse[3, :, 2] = -np.inf
    lse[3, s // 2, 2] = np.nan  # NaN beats empty
    lse[4, 1:, 3] = lse[4, 0, 3] - 1000.0  # weights that underflow to 0: not read
    o[4, 1:, 3] = np.nan
    out, out_lse = attnmerge.merge_states(put(torch, o), put(torch, lse))
    assert attnmerge.last_launch()["kernel"] == "states"
    out, out_lse = get(torch, out), get(torch, out_lse)
    assert_merge_matches(out, out_lse, reference_merge_stacked(o, lse), "bfloat16")
    assert np.all(out[0] == 0) and np.all(out_lse[0] == -np.inf) and np.all(out[1, 0] == 0)
    assert np.all(np.isnan(out[2, 1])) and np.isnan(out_lse[2, 1]) and np.isnan(out_lse[3, 2])
    assert np.all(np.isfinite(out[4, 3]))


@pytest.mark.gpu
@pytest.mark.parametrize("states_axis", (0, 1))
def test_merge_states_split_rows_over_strided_inputs(rng, torch, states_axis):
    """The all-gather layout [S, tokens, heads, D] and a padded, sliced [tokens, S, heads, D]."""
    t, s, h, d = 7, 48, 4, 128
    o, lse = random_stacked(rng, t, s, h, d, "float16", states_axis)
    o_t, lse_t = put(torch, o), put(torch, lse)
    if states_axis == 1:  # every other head of a buffer twice as wide, head_size padded
        wide = torch.full((t, s, 2 * h, d + 8), float("nan"), device="cuda", dtype=torch.float16)
        wide[:, :, ::2, :d] = o_t
        o_t = wide[:, :, ::2, :d]
        lse_w = torch.full((t, s, 2 * h), float("nan"), device="cuda")
        lse_w[:, :, ::2] = lse_t
        lse_t = lse_w[:, :, ::2]
    out, out_lse = attnmerge.merge_states(o_t, lse_t, states_axis=states_axis)
    assert attnmerge.last_launch()["kernel"] == "states"
    assert_merge_matches(get(torch, out), get(torch, out_lse), reference_merge_stacked(o, lse, states_axis=states_axis),
                         "float16")


@pytest.mark.gpu
@pytest.mark.parametrize("counts", [[0, 1, 9, 64, 300, 0, 17], [8] * 40 + [0, 3], [2, 0, 1, 7]])
def test_merge_varlen_strategies(rng, torch, counts):
    """The mean states a row decides; rows of 0, 1, a few, and many more states than a split row
    holds in one chunk share a launch."""
    h, d = 4, 128
    indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    total = int(indptr[-1])
    o, lse = random_o(rng, (total, h, d), "bfloat16"), random_lse(rng, (total, h))
    lse[rng.random((total, h)) < 0.2] = -np.inf
    out, out_lse = attnmerge.merge_varlen(put(torch, o), put(torch, lse), put(torch, indptr))
    info = attnmerge.last_launch()
    if info["kernel"] == "states":
        assert_states_launch(info, d // 8)
    else:
        assert (info["kernel"], info["state_groups"]) == ("rows", 1), info
    assert_merge_matches(get(torch, out), get(torch, out_lse), reference_merge_varlen(o, lse, indptr), "bfloat16")


@pytest.mark.gpu
@pytest.mark.parametrize("ue8m0", (False, True), ids=("float", "ue8m0"))
@pytest.mark.parametrize("group", (8, 32, 128))
@pytest.mark.parametrize("in_dtype", ("bfloat16", "float32"))
def test_per_group_fp8_changes_no_choice(rng, torch, in_dtype, group, ue8m0):
    """A decode-sized N-way merge (16 tokens, 64 states) and variable-length merge with per-group
    FP8 outputs take the kernel and groups the same call takes without them (the states kernel: a
    group's finishing threads, in several warps, meet in shared memory), NaN and empty states inside
    the split rows; a merge of few states per row, the rows kernel."""
    t, s, h, d = 16, 64, 8, 128
    o, lse = random_stacked(rng, t, s, h, d, in_dtype)
    lse[rng.random(lse.shape) < 0.1] = -np.inf
    lse[3, 40, 2] = np.nan
    lse[5, :, 1] = -np.inf
    indptr = np.arange(0, t * s + 1, s, dtype=np.int32)
    flat = (o.reshape(t * s, h, d), lse.reshape(t * s, h))
    for call, ref in [
        (lambda **kw: attnmerge.merge_states(put(torch, o), put(torch, lse), **kw), reference_merge_stacked(o, lse)[0]),
        (lambda **kw: attnmerge.merge_varlen(*[put(torch, x) for x in (*flat, indptr)], **kw),
         reference_merge_varlen(*flat, indptr)[0]),
        (lambda **kw: attnmerge.merge_states(put(torch, o[:, :3]), put(torch, lse[:, :3]), **kw),
         reference_merge_stacked(o[:, :3], lse[:, :3])[0]),
    ]:
        call()
        without = attnmerge.last_launch()
        out, _, scales = call(group_size=group, scale_ue8m0=ue8m0)
        info = attnmerge.last_launch()
        assert (info["kernel"], info["state_groups"]) == (without["kernel"], without["state_groups"]), info
        torch.cuda.synchronize()
        assert_group_fp8_close(get(torch, out), get(torch, scales), ref, group, ue8m0)
    assert info["kernel"] == "rows"  # three states per row


@pytest.mark.gpu
@pytest.mark.parametrize("masked", (False, True))
@pytest.mark.parametrize("head_size", (80, 128, 512, 8192))  # rows in warps (80 padded), in a block, over blocks
def test_inplace_in_one_launch_unless_rows_span_blocks(rng, torch, head_size, masked):
    t, h = 37, 3
    o, lse = random_o(rng, (t, h, head_size), "bfloat16"), random_lse(rng, (t, h))
    o2, lse2 = random_o(rng, (t, h, head_size), "bfloat16"), random_lse(rng, (t, h))
    mask = (rng.random(t) < 0.5).astype(np.uint8)
    o_t, lse_t = put(torch, o), put(torch, lse)
    attnmerge.merge_inplace(o_t, lse_t, put(torch, o2), put(torch, lse2), mask=put(torch, mask) if masked else None)
    info = attnmerge.last_launch()
    spans = head_size == 8192  # 1024 packs per row: over more than one block
    assert (info["kernel"], info["launches"]) == (("rows", 2) if spans else ("rows_inplace", 1))
    ref_o, ref_lse = reference_merge(o, lse, o2, lse2)
    got_o, got_lse = get(torch, o_t), get(torch, lse_t)
    keep = mask == 0 if masked else np.zeros(t, dtype=bool)
    assert_merge_matches(got_o[~keep], got_lse[~keep], (ref_o[~keep], ref_lse[~keep]), "bfloat16")
    assert np.array_equal(got_o[keep], to_f64(o[keep])) and np.array_equal(got_lse[keep], lse[keep])


@pytest.mark.gpu
def test_two_way_kernels(rng, torch):
    t, h, d = 9, 4, 64
    o_a, lse_a = random_o(rng, (t, h, d), "float16"), random_lse(rng, (t, h))
    o_b, lse_b = random_o(rng, (t, h, d), "float16"), random_lse(rng, (t, h))
    args = [put(torch, x) for x in (o_a, lse_a, o_b, lse_b)]
    attnmerge.merge(*args)
    assert attnmerge.last_launch()["kernel"] == "rows_plain"
    attnmerge.merge(*args, a_tokens=5)
    assert attnmerge.last_launch()["kernel"] == "rows"
    sink = random_lse(rng, (h,))
    out, out_lse = attnmerge.merge(*args, sink=put(torch, sink))  # a sink: the general two-way kernel
    assert attnmerge.last_launch()["kernel"] == "rows"
    assert_merge_matches(get(torch, out), get(torch, out_lse), reference_merge(o_a, lse_a, o_b, lse_b, sink=sink),
                         "float16")
    attnmerge.merge(*args, out=args[0], out_lse=args[1])  # into o_a and lse_a: the in-place kernel
    assert (attnmerge.last_launch()["kernel"], attnmerge.last_launch()["launches"]) == ("rows_inplace", 1)
    assert_merge_matches(get(torch, args[0]), get(torch, args[1]), reference_merge(o_a, lse_a, o_b, lse_b), "float16")


@pytest.mark.gpu
@pytest.mark.parametrize("t, masked, vec", [(2048, True, 16), (2048, False, 8), (37, True, 8)])
def test_large_masked_in_place_merges_take_two_accesses_a_thread(rng, torch, t, masked, vec):
    # 2048 x 16 x 128 bfloat16 moves 24 MB: two 16-byte accesses a thread where masked
    h, d = 16, 128
    o, lse = random_o(rng, (t, h, d), "bfloat16"), random_lse(rng, (t, h))
    o2, lse2 = random_o(rng, (t, h, d), "bfloat16"), random_lse(rng, (t, h))
    mask = (rng.random(t) < 0.5).astype(np.uint8) if masked else np.ones(t, dtype=np.uint8)
    o_t, lse_t = put(torch, o), put(torch, lse)
    attnmerge.merge_inplace(o_t, lse_t, put(torch, o2), put(torch, lse2), mask=put(torch, mask) if masked else None)
    assert attnmerge.last_launch()["vec"] == vec
    ref_o, ref_lse = reference_merge(o, lse, o2, lse2)
    got_o, got_lse = get(torch, o_t), get(torch, lse_t)
    keep = mask == 0
    assert_merge_matches(got_o[~keep], got_lse[~keep], (ref_o[~keep], ref_lse[~keep]), "bfloat16")
    assert np.array_equal(got_o[keep], to_f64(o[keep])) and np.array_equal(got_lse[keep], lse[keep])


@pytest.mark.gpu
def test_pdl_is_planned_on_sm90_and_newer(rng, torch):
    o, lse = random_stacked(rng, 4, 32, 2, 128, "bfloat16")
    attnmerge.merge_states(put(torch, o), put(torch, lse), pdl=True)
    major = torch.cuda.get_device_capability()[0]
    assert attnmerge.last_launch()["pdl"] == (major >= 9)
