"""The GPU merges' logic, on the CPU: tests/native/forward_emulator.cpp runs the library's plan
(plan_merge), launcher (launch_merge) and kernels (attnmerge/merge_kernels.cuh, the installed
header) as host C++, each block's threads as fibers that meet at the kernels' barriers, in the
orders it sets (tests/emulators.py).  Every strategy the plan has is reached here by the facts of
a call (CallFacts: the SM count, the bytes moved, the largest offset, the forced groups), and each
is held to the float64 oracle with the GPU tests' tolerances: the two-way merge (flat, plain,
with a_tokens, tiled rows, FP8 outputs), the in-place merge (rows in warps, in a block, over
blocks; masked), the N-way and variable-length merges (rows of one chunk and of many, kStates of
each group count; empty and NaN states inside a split row; attention sinks, empty, NaN and strided
ones among them), and a state's share of the N-way merge (kRows whatever groups are asked for).  Inputs sit in NaN-filled buffers
that end at an unreadable page (or begin after one): a read outside a view poisons the result or
ends the process, a write outside it is caught; a masked-out token's pages are unreadable for the
whole call (it reads its mask byte alone).  Results must be bit-identical whatever the order of the
threads.  (What it cannot check: the device's instructions, vector accesses and
approximations; the `gpu` tests and compute-sanitizer do.)
"""

from __future__ import annotations

import ctypes
import mmap
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from emulators import CODES, ORDERS, build, check, compiled_types, launches, order, pointers, widest_vec
from attnmerge._call import base_flags, lse_bases
from oracle import (assert_block_close, assert_fp8_close, assert_group_fp8_close, assert_lse_close, assert_merge_matches, clamp_indptr, fp8_dtype, nan_array,
                    natural, outside_view_is_nan, random_lse, random_o, rebased, reference_merge,
                    reference_merge_ranges, reference_merge_share, reference_merge_stacked, reference_merge_varlen,
                    stats_lse, strided_view, to_f64, valid_lse)
from test_backward import layouts
from test_merge_varlen import BAD_INDPTR

LARGE = 1 << 40  # bytes: a call past every size rule of the plan
FAR = 1 << 31  # a largest offset past 32-bit indexing
PLAN_FIELDS = ("variant", "chunk", "groups", "launches", "index32", "vec", "evict_first", "tile_shift", "pdl")
PLAIN = ("rows_plain", "rows_plain_flat", "inplace_plain_flat")  # the variants of the plain two-way kernels
PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(None)


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    return build("forward_emulator.cpp", tmp_path_factory)


def variants(emu) -> list[str]:
    """The names of plan.h's Variant values, in order."""
    emu.emulate_variant_name.restype = ctypes.c_char_p
    names = []
    while (name := emu.emulate_variant_name(len(names))) is not None:
        names.append(name.decode())
    return names


def plan(emu) -> dict:
    """The last call's plan, its variant by name."""
    fields = (ctypes.c_int64 * len(PLAN_FIELDS))()
    emu.emulate_plan(fields)
    got = dict(zip(PLAN_FIELDS, fields))
    got["variant"] = variants(emu)[got["variant"]]
    return got


def fenced(view: np.ndarray, buf: np.ndarray, tail: bool):
    """(view, buf) moved into memory that ends at an unreadable page (tail) or begins right after
    one, 16-byte aligned as before: a read past the buffer's end (or before its start) faults."""
    nbytes = buf.nbytes
    span = -(-(nbytes + 16) // PAGE) * PAGE
    m = mmap.mmap(-1, span + 2 * PAGE)
    base = ctypes.addressof(ctypes.c_char.from_buffer(m))
    for page in (base, base + span + PAGE):
        assert _libc.mprotect(ctypes.c_void_p(page), ctypes.c_size_t(PAGE), 0) == 0  # PROT_NONE
    start = PAGE + (span - -(-nbytes // 16) * 16 if tail else 0)
    new = np.frombuffer(m, np.uint8, nbytes, start).view(buf.dtype).reshape(buf.shape)
    new[...] = buf
    offset = view.__array_interface__["data"][0] - buf.__array_interface__["data"][0]
    moved = np.lib.stride_tricks.as_strided(new.reshape(-1).view(np.uint8)[offset:].view(buf.dtype),
                                            shape=view.shape, strides=view.strides)
    return moved, new


def placed(x: np.ndarray, layout: dict, tail: bool):
    """x in a strided buffer of `layout` (strided_view) filled with NaN (an integer array: with -1),
    fenced."""
    return fenced(*strided_view(x, **layout, fill=-1 if x.dtype.kind in "iu" else np.nan), tail)


def out_buffers(shape, dtype, layout, tail):
    return placed(nan_array(shape, dtype), layout, tail)


def fact_args(vec, widest_itemsize, sms=132, max_offset=1000, nbytes=1 << 20):
    """The facts arguments of an emulate_* call (CallFacts): elements an access and its bytes (of
    the widest O dtype), the SM count, the largest element offset, the bytes moved."""
    return [ctypes.c_int(vec), ctypes.c_int(vec * widest_itemsize), ctypes.c_int(sms), ctypes.c_int64(max_offset),
            ctypes.c_int64(nbytes)]


def facts(data, vec, itemsizes):
    """The SM count, bytes moved and largest offset the plan is asked for: the GPU's own or none,
    decode-sized or past every size rule, 32- or 64-bit offsets."""
    sms = data.draw(st.sampled_from((0, 4, 132)))
    nbytes = data.draw(st.sampled_from((1 << 20, 40 << 20, 200 << 20, LARGE)))
    far = data.draw(st.booleans())
    return fact_args(vec, max(itemsizes), sms, FAR if far else 1000, nbytes)


def head(sizes, in_dtype, out_dtype, base, fact):
    """The arguments every emulate_* call starts with: its sizes, dtypes, LSE bases and facts.  base:
    'e' or 2 for every LSE, or (a's, b's, the merged LSE's): the C ABI's flags for them."""
    flags = base_flags(lse_bases(base[:2], base[2], pair=True)) if isinstance(base, tuple) else int(base == 2)
    return [ctypes.c_int64(v) for v in sizes] + [CODES[in_dtype], CODES[out_dtype], flags, *fact]


# LSE bases drawn for a call: (a's, b's, the merged LSE's), mixed (attnmerge.h's mixed bases) or not;
# the in-place merge's LSE stays a's, the N-way, variable-length and share merges' states share one.
BASES = st.tuples(*(st.sampled_from(("e", 2)),) * 3)
IN_PLACE_BASES = BASES.map(lambda b: (b[0], b[1], b[0]))
STATES_BASES = BASES.map(lambda b: (b[0], b[0], b[2]))


def sink_args(data, rng, heads, tail):
    """A sink drawn for an N-way, variable-length or share merge: None, or float32 [heads] in a
    fenced buffer, some heads empty (-inf or +inf), NaN or 10 above the states (most of the weight;
    not more: a float32 LSE difference d is exact to d * 2^-24, so a weight 30 below the max holds
    only about 1e-6 of relative precision, float32's tolerance here); its fenced view (keep it
    alive: the pointer argument points into it) and the (pointer, stride) arguments."""
    if not data.draw(st.booleans()):
        return None, None, sink_pointer(None)
    sink = random_lse(rng, (heads,))
    for h in range(heads):
        sink[h] = data.draw(st.sampled_from((sink[h], sink[h], sink[h] + 10.0, -np.inf, np.inf, np.nan)))
    view, _ = placed(sink, data.draw(layouts(1, False)), tail)
    return sink, view, sink_pointer(view)


def sink_pointer(view):
    """The (pointer, stride) arguments of a sink view, or of none (the view must outlive the call)."""
    if view is None:
        return None, ctypes.c_int64(0)
    return ctypes.c_void_p(view.ctypes.data), ctypes.c_int64(view.strides[0] // view.itemsize)


def assert_out(out, out_lse, ref, out_dtype, inv_scale=1.0):
    """The oracle's tolerances; an FP8 output within one FP8 step of O / the output scale."""
    if out_dtype != "float8_e4m3fn":
        return assert_merge_matches(out, out_lse, ref, out_dtype)
    assert_fp8_close(out, ref[0], 1.0 / inv_scale)
    if out_lse is not None:
        assert_lse_close(out_lse, ref[1])


def enough_heads(heads, rows, head_size, out_dtype):
    """Heads enough for float32's relative L2 tolerance (1e-6), a statement about many elements: a
    lone element whose weighted parts cancel can miss it by a few float32 roundings.  At least 64
    elements an output row set (where it has rows)."""
    if out_dtype != "float32" or rows == 0:
        return heads
    return max(heads, -(-64 // (rows * head_size)))


def empties(rng, lse, o, share):
    """Some states empty (LSE -inf or +inf) with NaN O, never to be read."""
    empty = rng.random(lse.shape) < share
    lse[empty] = rng.choice([-np.inf, np.inf], size=int(empty.sum()))
    o[empty] = np.nan


def run_orders(emu, call, outputs, seed):
    """call() in each order of the threads: results bit-identical to the first."""
    first = None
    for how in ORDERS:
        for x in outputs:
            x[...] = np.nan
        order(emu, how, seed)
        check(emu, call())
        got = [np.array(x, copy=True).view(np.uint8) for x in outputs]
        if first is None:
            first = got
        else:
            for a, b in zip(first, got):
                np.testing.assert_array_equal(a, b, err_msg="results differ between orders of the threads")


# ---- the emulated runtime ------------------------------------------------------------------------


def test_the_runtime_shows_a_missing_barrier_and_refuses_one_never_met(emu):
    # 64 threads post their index and read their neighbour's: with a barrier between, every order
    # reads every neighbour's; without, the orders differ (what a missing barrier looks like)
    got = {}
    for barrier in (1, 0):
        for how in ORDERS:
            out = np.full(64, np.nan, np.float32)
            order(emu, how, 3)
            check(emu, emu.emulate_runtime_check(ctypes.c_void_p(out.ctypes.data), barrier))
            got[barrier, how] = out
    for how in ORDERS:
        np.testing.assert_array_equal(got[1, how], (np.arange(64) + 1) % 64)
    assert not all(np.array_equal(got[0, 0], got[0, how]) for how in ORDERS)
    for barrier, why in ((2, "cannot all be met"), (3, "ended before a __syncthreads")):
        out = np.zeros(64, np.float32)
        order(emu, 0)
        assert emu.emulate_runtime_check(ctypes.c_void_p(out.ctypes.data), barrier) != 0
        assert why in emu.emulate_error().decode()


def test_a_row_splits_into_token_and_head_by_the_kernels_division(emu):
    # row -> (token, head) as the kernels divide (a multiply-high by MergeShape's magic number, on
    # the host as on the device), against the row order's definition: untiled, row = token * heads
    # + head; tiled, row = (tile * heads + head) * 2^t + the token's place in its tile
    rng = np.random.default_rng(5)
    out = (ctypes.c_int64 * 2)()
    for heads in (1, 2, 3, 5, 7, 32, 40, 63, 64, 65, 96, 127, 1000, 4097, 65537, 1 << 20, (1 << 27) - 1):
        for t in (-1, 0, 3):
            group = heads << max(t, 0) if t >= 0 else heads
            tokens = ((1 << 31) - 1) // group // 8 * 8  # rows below 2^31, whole tiles
            if tokens == 0:
                continue
            rows = tokens * heads
            picks = [0, 1, group - 1, group, group + 1, rows - 1, rows - group] + list(rng.integers(0, rows, 40))
            for row in (int(r) for r in picks if 0 <= r < rows):
                if t < 0:
                    want = divmod(row, heads)
                else:
                    tile, within = divmod(row, group)
                    want = ((tile << t) + (within & ((1 << t) - 1)), within >> t)
                for index32 in (1, 0):
                    emu.emulate_split_row(ctypes.c_int64(tokens), ctypes.c_int64(heads), t, ctypes.c_int64(row),
                                          index32, out)
                    assert (out[0], out[1]) == want, (heads, t, row, index32)


# ---- the two-way merge ---------------------------------------------------------------------------


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_merge(emu, data):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    t, h = data.draw(st.integers(1, 70)), data.draw(st.integers(1, 3))
    d = data.draw(st.sampled_from((1, 6, 8, 40, 64, 128, 264)))
    in_dtype, out_dtype = data.draw(st.sampled_from(compiled_types(emu)))
    h = enough_heads(h, t, d, out_dtype)
    if out_dtype == "float8_e4m3fn":
        fp8_dtype()
    a_tokens = data.draw(st.sampled_from((t, t, 0, t // 2)))
    base = data.draw(BASES)  # mixed bases: not the plain kernels' case
    tail = data.draw(st.booleans())
    o_a, o_b = random_o(rng, (t, h, d), in_dtype), random_o(rng, (t, h, d), in_dtype)
    lse_a, lse_b = random_lse(rng, (t, h)), random_lse(rng, (t, h))
    empties(rng, lse_a, o_a, 0.2)
    empties(rng, lse_b, o_b, 0.1)
    # a sink (SinkPairSource): in a's base, empty and NaN heads among them, strided
    sink = data.draw(st.sampled_from((None, "some", "empty_or_nan")))
    if sink is not None:
        sink_buf = np.full(2 * h, np.nan, np.float32)
        sink_buf[::2] = random_lse(rng, (h,))
        if sink == "empty_or_nan":  # and head 0's last row of no states: O = 0, or NaN with a NaN sink
            sink_buf[0] = data.draw(st.sampled_from((-np.inf, np.inf, np.nan)))
            lse_a[-1, 0] = lse_b[-1, 0] = -np.inf
        sink = sink_buf[::2]
    ref = rebased(reference_merge(o_a, natural(lse_a, base[0]), o_b, natural(lse_b, base[1]), a_tokens=a_tokens,
                                  sink=None if sink is None else natural(sink, base[0])), base[2])
    dense = data.draw(st.booleans())  # the flat kernel's layout, else any
    lay = (lambda n: dict()) if dense else (lambda n: data.draw(layouts(n, n == 3)))
    va, _ = placed(o_a[:a_tokens], lay(3), tail)
    vla, _ = placed(lse_a[:a_tokens], lay(2), tail)
    vb, _ = placed(o_b, lay(3), tail)
    vlb, _ = placed(lse_b, lay(2), tail)
    out, obuf = out_buffers((t, h, d), out_dtype, lay(3), tail)
    with_lse = data.draw(st.booleans())
    out_lse, lbuf = out_buffers((t, h), "float32", lay(2), tail) if with_lse else (None, None)
    inv_scale = data.draw(st.sampled_from((1.0, 0.25))) if out_dtype == "float8_e4m3fn" else 1.0
    # the output scale as a number, or read from memory (not the plain kernels' case)
    scale = np.array([1.0 / inv_scale], np.float32) if data.draw(st.booleans()) else None
    vec = widest_vec(d, va, vb, out)
    fact = facts(data, vec, (va.itemsize, out.itemsize))
    tokens_inner = data.draw(st.booleans())  # tiled rows where the plan takes them
    pdl = data.draw(st.booleans())
    ptrs, strides = pointers(out, out_lse, va, vla, vb, vlb)
    if sink is not None:
        emu.emulate_pair_sink(ctypes.c_void_p(sink.ctypes.data), ctypes.c_int64(2))
    try:
        run_orders(emu, lambda: emu.emulate_merge(
            *head((t, a_tokens, h, d), in_dtype, out_dtype, base, fact), int(tokens_inner), int(pdl), 0,
            ctypes.c_float(1.0 if scale is not None else inv_scale), None if scale is None else ctypes.c_void_p(
                scale.ctypes.data), *ptrs, None, ctypes.c_int64(0)),
            [obuf] + ([lbuf] if with_lse else []), data.draw(st.integers(0, 1000)))
    finally:
        emu.emulate_pair_sink(None, ctypes.c_int64(0))
    assert_out(out, out_lse, ref, out_dtype, inv_scale)
    assert outside_view_is_nan(out, obuf) and (not with_lse or outside_view_is_nan(out_lse, lbuf))
    if base[1] != base[0] or base[2] != base[0] or sink is not None:  # PlainPairSource: one base, no sink
        assert plan(emu)["variant"] not in PLAIN


# ---- the in-place merge --------------------------------------------------------------------------


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_merge_inplace(emu, data):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    t, h = data.draw(st.integers(1, 40)), data.draw(st.integers(1, 3))
    # rows in warps (up to 32 packs, padded to a power of two), in one block, over blocks
    d = data.draw(st.sampled_from((1, 8, 24, 80, 128, 512, 2056)))
    dtype = data.draw(st.sampled_from(("float32", "float16", "bfloat16")))
    h = enough_heads(h, t, d, dtype)
    base, tail = data.draw(IN_PLACE_BASES), data.draw(st.booleans())
    o, o_other = random_o(rng, (t, h, d), dtype), random_o(rng, (t, h, d), dtype)
    lse, lse_other = random_lse(rng, (t, h)), random_lse(rng, (t, h))
    empties(rng, lse_other, o_other, 0.2)
    masked = data.draw(st.booleans())
    mask = (rng.random(t) < 0.5).astype(np.uint8) if masked else None
    ref_o, ref_lse = rebased(reference_merge(o, natural(lse, base[0]), o_other, natural(lse_other, base[1])), base[0])
    if masked:
        keep = mask == 0
        ref_o[keep], ref_lse[keep] = to_f64(o[keep]), to_f64(lse[keep])
    dense = data.draw(st.booleans())
    lay = (lambda n: dict()) if dense else (lambda n: data.draw(layouts(n, n == 3)))
    vo, bo = placed(o, lay(3), tail)
    vl, bl = placed(lse, lay(2), tail)
    vb, _ = placed(o_other, lay(3), tail)
    vlb, _ = placed(lse_other, lay(2), tail)
    step = data.draw(st.sampled_from((1, 3)))  # a mask byte every `step` bytes
    mask_buf = np.zeros(t * step, np.uint8)
    if masked:
        mask_buf[::step] = mask
    vm = fenced(mask_buf[::step], mask_buf, tail)[0]
    vec = widest_vec(d, vo, vb)
    fact = facts(data, vec, (vo.itemsize,))
    ptrs, strides = pointers(vo, vl, vo, vl, vb, vlb)
    order(emu, data.draw(st.sampled_from(ORDERS)), data.draw(st.integers(0, 1000)))
    check(emu, emu.emulate_merge(
        *head((t, t, h, d), dtype, dtype, base, fact), 0, 0, 1, ctypes.c_float(1.0), None, *ptrs,
        ctypes.c_void_p(vm.ctypes.data) if masked else None, ctypes.c_int64(step)))
    assert_merge_matches(vo, vl, (ref_o, ref_lse), dtype)
    assert outside_view_is_nan(vo, bo) and outside_view_is_nan(vl, bl)
    if base[1] != base[0]:  # PlainPairSource has one base
        assert plan(emu)["variant"] not in PLAIN


# ---- the N-way merge -----------------------------------------------------------------------------


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_merge_states(emu, data):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    t, h = data.draw(st.integers(0, 6)), data.draw(st.integers(1, 3))
    s = data.draw(st.sampled_from((0, 1, 3, 4, 5, 8, 9, 16, 17, 33, 64, 257)))
    d = data.draw(st.sampled_from((1, 8, 16, 40, 64, 128, 136)))
    in_dtype, out_dtype = data.draw(st.sampled_from(compiled_types(emu)))
    h = enough_heads(h, t, d, out_dtype)
    if out_dtype == "float8_e4m3fn":
        fp8_dtype()
    base, tail = data.draw(STATES_BASES), data.draw(st.booleans())
    o, lse = random_o(rng, (t, s, h, d), in_dtype), random_lse(rng, (t, s, h))
    empties(rng, lse, o, data.draw(st.sampled_from((0.0, 0.3, 1.0))))
    if t and s and data.draw(st.booleans()):  # a NaN LSE late in a row: the row is NaN
        lse[rng.integers(t), rng.integers(s), rng.integers(h)] = np.nan
    sink, _sink_alive, sink_ptr = sink_args(data, rng, h, tail)
    ref = rebased(reference_merge_stacked(o, natural(lse, base[0]), sink=natural(sink, base[0])), base[2])
    vo, _ = placed(o, data.draw(layouts(4, True)), tail)
    vl, _ = placed(lse, data.draw(layouts(3, False)), tail)
    out, obuf = out_buffers((t, h, d), out_dtype, data.draw(layouts(3, True)), tail)
    with_lse = data.draw(st.booleans())
    out_lse, lbuf = out_buffers((t, h), "float32", data.draw(layouts(2, False)), tail) if with_lse else (None, None)
    vec = widest_vec(d, vo, out)
    fact = facts(data, vec, (vo.itemsize, out.itemsize))
    groups = data.draw(st.sampled_from((0, 0, 1, 2, 4, 8, 16)))
    ptrs, strides = pointers(out, out_lse, vo, vl)
    run_orders(emu, lambda: emu.emulate_merge_states(
        *head((t, s, h, d), in_dtype, out_dtype, base, fact), groups, ctypes.c_float(1.0), *ptrs, *sink_ptr),
        [obuf] + ([lbuf] if with_lse else []), data.draw(st.integers(0, 1000)))
    assert_out(out, out_lse, ref, out_dtype)
    assert outside_view_is_nan(out, obuf) and (not with_lse or outside_view_is_nan(out_lse, lbuf))


# ---- a state's share of the N-way merge ----------------------------------------------------------


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_merge_share(emu, data):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    t, h = data.draw(st.integers(0, 6)), data.draw(st.integers(1, 3))
    s = data.draw(st.sampled_from((1, 2, 3, 4, 5, 8, 9, 17, 64)))
    index = data.draw(st.integers(0, s - 1))
    d = data.draw(st.sampled_from((1, 8, 16, 40, 64, 128, 136)))
    in_dtype, out_dtype = data.draw(st.sampled_from(compiled_types(emu)))
    h = enough_heads(h, t, d, out_dtype)
    if out_dtype == "float8_e4m3fn":
        fp8_dtype()
    base, tail = data.draw(STATES_BASES), data.draw(st.booleans())
    o, lse = random_o(rng, (t, h, d), in_dtype), random_lse(rng, (t, s, h))
    stacked = np.repeat(o[:, None], s, axis=1)  # empties() marks states and poisons their O: index's is o's
    empties(rng, lse, stacked, data.draw(st.sampled_from((0.0, 0.3, 1.0))))
    o = np.ascontiguousarray(stacked[:, index])
    if t and data.draw(st.booleans()):  # a NaN LSE of any state: the row is NaN
        lse[rng.integers(t), rng.integers(s), rng.integers(h)] = np.nan
    sink, _sink_alive, sink_ptr = sink_args(data, rng, h, tail)
    ref = rebased(reference_merge_share(o, natural(lse, base[0]), index, sink=natural(sink, base[0])), base[2])
    vo, _ = placed(o, data.draw(layouts(3, True)), tail)
    vl, _ = placed(lse, data.draw(layouts(3, False)), tail)
    out, obuf = out_buffers((t, h, d), out_dtype, data.draw(layouts(3, True)), tail)
    with_lse = data.draw(st.booleans())
    out_lse, lbuf = out_buffers((t, h), "float32", data.draw(layouts(2, False)), tail) if with_lse else (None, None)
    vec = widest_vec(d, vo, out)
    fact = facts(data, vec, (vo.itemsize, out.itemsize))
    groups = data.draw(st.sampled_from((0, 0, 1, 2, 16)))  # asked for groups, a share still takes kRows
    ptrs, strides = pointers(out, out_lse, vo, vl)
    run_orders(emu, lambda: emu.emulate_merge_share(
        *head((t, s, h, d), in_dtype, out_dtype, base, fact), groups, ctypes.c_float(1.0), *ptrs,
        ctypes.c_int64(index), *sink_ptr), [obuf] + ([lbuf] if with_lse else []), data.draw(st.integers(0, 1000)))
    assert t == 0 or plan(emu)["variant"] == "share"
    assert_out(out, out_lse, ref, out_dtype)
    assert outside_view_is_nan(out, obuf) and (not with_lse or outside_view_is_nan(out_lse, lbuf))


# ---- the variable-length merge -------------------------------------------------------------------


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_merge_varlen(emu, data):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    counts = data.draw(st.lists(st.sampled_from((0, 1, 2, 5, 9, 17, 40)), max_size=6))
    before, after = data.draw(st.integers(0, 3)), data.draw(st.integers(0, 3))
    indptr = np.concatenate([[before], before + np.cumsum(counts, dtype=np.int64)]).astype(np.int64)
    total, h = int(indptr[-1]) + after, data.draw(st.integers(1, 3))
    d = data.draw(st.sampled_from((2, 16, 40, 128)))
    in_dtype, out_dtype = data.draw(st.sampled_from(compiled_types(emu)))
    h = enough_heads(h, len(counts), d, out_dtype)
    if out_dtype == "float8_e4m3fn":
        fp8_dtype()
    base, tail = data.draw(STATES_BASES), data.draw(st.booleans())
    o, lse = random_o(rng, (total, h, d), in_dtype), random_lse(rng, (total, h))
    empties(rng, lse, o, 0.2)
    sink, _sink_alive, sink_ptr = sink_args(data, rng, h, tail)
    ref = rebased(reference_merge_varlen(o, natural(lse, base[0]), indptr, sink=natural(sink, base[0])), base[2])
    vo, _ = placed(o, data.draw(layouts(3, True)), tail)
    vl, _ = placed(lse, data.draw(layouts(2, False)), tail)
    rows = len(counts)
    out, obuf = out_buffers((rows, h, d), out_dtype, {}, tail)
    out_lse, lbuf = out_buffers((rows, h), "float32", {}, tail)
    ip_dtype = data.draw(st.sampled_from((np.int64, np.int32)))
    vi, _ = placed(indptr.astype(ip_dtype), data.draw(layouts(1, False)), tail)
    vec = widest_vec(d, vo, out)
    fact = facts(data, vec, (vo.itemsize, out.itemsize))
    groups = data.draw(st.sampled_from((0, 0, 1, 2, 4, 16)))
    ptrs, strides = pointers(out, out_lse, vo, vl)
    run_orders(emu, lambda: emu.emulate_merge_varlen(
        *head((rows, total, h, d), in_dtype, out_dtype, base, fact), groups, ctypes.c_float(1.0), *ptrs,
        ctypes.c_void_p(vi.ctypes.data), ctypes.c_int64(vi.strides[0] // vi.itemsize), int(ip_dtype == np.int64),
        *sink_ptr), [obuf, lbuf], data.draw(st.integers(0, 1000)))
    assert_out(out, out_lse, ref, out_dtype)
    assert outside_view_is_nan(out, obuf) and outside_view_is_nan(out_lse, lbuf)


# ---- every path of the plan ----------------------------------------------------------------------
# (op, tokens, states, heads, head_size, dtype, facts, plan fields expected): each variant of
# plan.h reached by the facts of a call, and merging right in every order of the threads.
# facts: sms, bytes, far (64-bit offsets), groups (N-way), layout ("dense", "wide": the output's
# heads twice head_size apart, "a": a_tokens < tokens), tokens_inner, mask, sink (N-way, varlen).
PATHS = {
    "two-way flat, evict-first": ("merge", 16, 2, 4, 128, "bfloat16", dict(sms=132, bytes=1 << 20),
                                  dict(variant="rows_plain_flat", evict_first=1, index32=1)),
    "two-way flat, blocks of 1024": ("merge", 64, 2, 4, 128, "bfloat16", dict(sms=0, bytes=LARGE),
                                     dict(variant="rows_plain_flat", evict_first=0)),
    "two-way plain, not flat": ("merge", 9, 2, 3, 64, "float32", dict(sms=132, bytes=1 << 20, layout="wide"),
                                dict(variant="rows_plain")),
    "two-way with a_tokens": ("merge", 9, 2, 3, 64, "float16", dict(sms=132, bytes=1 << 20, layout="a"),
                              dict(variant="rows")),
    "two-way tiled rows": ("merge", 70, 2, 3, 16, "float32", dict(sms=132, bytes=LARGE, tokens_inner=True),
                           dict(variant="rows", tile_shift=3)),
    "two-way 64-bit offsets": ("merge", 9, 2, 3, 40, "bfloat16", dict(sms=132, bytes=1 << 20, far=True),
                               dict(variant="rows_plain", index32=0)),
    "in place, rows in warps, flat": ("inplace", 12, 2, 3, 80, "bfloat16", dict(sms=132, bytes=1 << 20),
                                      dict(variant="inplace_plain_flat", launches=1)),
    "in place, rows in warps, flat, masked": ("inplace", 12, 2, 3, 128, "bfloat16",
                                              dict(sms=132, bytes=1 << 20, mask=True),
                                              dict(variant="inplace_plain_flat", launches=1)),
    "in place, rows in warps, strided": ("inplace", 12, 2, 3, 24, "float16", dict(sms=4, bytes=1 << 20, layout="wide"),
                                         dict(variant="inplace_warp")),
    "in place, rows in a block": ("inplace", 5, 2, 2, 512, "float32", dict(sms=132, bytes=1 << 20, mask=True),
                                  dict(variant="inplace_block", launches=1)),
    "in place, rows over blocks": ("inplace", 3, 2, 2, 2056, "float32", dict(sms=132, bytes=1 << 20),
                                   dict(variant="rows_lse_after", launches=2)),
    "in place, masked, two accesses a thread": ("inplace", 12, 2, 3, 128, "bfloat16",
                                                dict(sms=132, bytes=LARGE, mask=True), dict(vec=16, variant="inplace_plain_flat")),
    "N-way rows, 4 in flight": ("states", 7, 3, 3, 40, "float16", dict(sms=132, bytes=1 << 20),
                                dict(variant="rows", chunk=4)),
    "N-way rows, 8 in flight, long rows": ("states", 7, 37, 2, 64, "bfloat16", dict(sms=132, bytes=1 << 20, groups=1),
                                           dict(variant="rows", chunk=8)),
    "N-way rows, 64-bit offsets": ("states", 3, 20, 2, 16, "float32", dict(sms=132, bytes=1 << 20, far=True),
                                   dict(variant="rows", index32=0)),
    "N-way states, the plan's groups": ("states", 4, 64, 2, 128, "bfloat16", dict(sms=132, bytes=1 << 20),
                                        dict(variant="states", groups=16)),
    **{f"N-way states, {g} groups": ("states", 3, 41, 2, 64, "float32", dict(sms=132, bytes=1 << 20, groups=g),
                                     dict(variant="states", groups=g)) for g in (2, 4, 8, 16)},
    "N-way states, one pack a row, more rows than a block's z axis takes": (
        "states", 70, 9, 1, 4, "float32", dict(sms=0, bytes=1 << 20, groups=2), dict(variant="states", groups=2)),
    "varlen rows": ("varlen", 5, 9, 2, 16, "float16", dict(sms=0, bytes=1 << 20, groups=1), dict(variant="rows")),
    "varlen states": ("varlen", 5, 40, 2, 64, "bfloat16", dict(sms=132, bytes=1 << 20), dict(variant="states")),
    "N-way rows, two states and a sink": ("states", 6, 2, 3, 64, "bfloat16", dict(sms=132, bytes=1 << 20, sink=True),
                                          dict(variant="rows", chunk=4)),
    "N-way rows, 4 in flight, a sink": ("states", 7, 3, 3, 40, "float16", dict(sms=132, bytes=1 << 20, sink=True),
                                        dict(variant="rows", chunk=4)),
    "N-way rows, long rows, a sink": ("states", 7, 37, 2, 64, "bfloat16", dict(sms=132, bytes=1 << 20, groups=1,
                                                                                sink=True), dict(variant="rows", chunk=8)),
    "N-way states, a sink": ("states", 4, 64, 2, 128, "bfloat16", dict(sms=132, bytes=1 << 20, sink=True),
                             dict(variant="states", groups=16)),
    "varlen rows, a sink": ("varlen", 5, 9, 2, 16, "float16", dict(sms=0, bytes=1 << 20, groups=1, sink=True),
                            dict(variant="rows")),
    "varlen states, a sink": ("varlen", 5, 40, 2, 64, "bfloat16", dict(sms=132, bytes=1 << 20, sink=True),
                              dict(variant="states")),
    "share rows, 4 in flight": ("share", 6, 3, 3, 40, "float16", dict(sms=132, bytes=1 << 20),
                                dict(variant="share", chunk=4)),
    "share rows, long rows, a sink": ("share", 4, 37, 2, 64, "bfloat16", dict(sms=132, bytes=1 << 20, sink=True),
                                      dict(variant="share", chunk=8)),
    "share rows at decode, groups asked for": ("share", 2, 64, 2, 128, "bfloat16",
                                               dict(sms=132, bytes=1 << 20, groups=16), dict(variant="share", chunk=8)),
    "share rows, 64-bit offsets": ("share", 3, 20, 2, 16, "float32", dict(sms=132, bytes=1 << 20, far=True),
                                   dict(variant="share", index32=0)),
}


# The general kernel a plain path takes where the call has StateExtras (the plain kernels read LSEs
# alone: plan.h); a kRows path of 8 states in flight takes the kernel of 4 (takes_extras).
GENERAL = {"rows_plain_flat": "rows", "rows_plain": "rows", "inplace_plain_flat": "inplace_warp"}


class Extras:
    """A path's states with StateExtras (extras=True): every LSE argument given as softmax
    statistics (its values the maxima, a random sum beside each; the in-place merge's lse, the
    accumulator, stays an LSE) and a random valid array (uint8, int32 or int64; about one state in
    five empty, its O, max and sum NaN), each in a fenced strided buffer; `lse(x, ...)` is the LSE
    the oracle merges, and `set` hands the arrays to the emulator for the call that follows."""

    def __init__(self, on, rng, tail):
        self.on, self.rng, self.tail, self.sums, self.valid, self.alive = on, rng, tail, [None, None], None, []

    def states(self, shape):
        """valid for states of `shape` ([tokens, S], [tokens, 2] or [total])."""
        if not self.on:
            return None
        dtype = (np.uint8, np.int32, np.int64)[int(self.rng.integers(3))]
        keys = np.where(self.rng.random(shape) < 0.2, 0, self.rng.integers(1, 9, shape)).astype(dtype)
        self.valid, _ = placed(keys, dict(steps={0: 2}), self.tail)
        return keys

    def lse(self, which, m, o, empty=None):
        """The oracle's LSE of argument `which` (0: sum_a, 1: sum_b; None: stays an LSE) whose
        values `m` are the maxima, whose states `empty` (valid's entries broadcast) are poisoned."""
        if not self.on:
            return m
        lse = m
        if which is not None:
            total = self.rng.uniform(1.0, 20.0, m.shape).astype(np.float32)
            lse = stats_lse(m, total)
            if empty is not None:
                total[empty] = np.nan
            order = tuple(range(m.ndim))[::-1]  # the sum stored transposed: strides of its own
            self.sums[which], _ = placed(total, dict(order=order), self.tail)
        if empty is not None:
            lse = valid_lse(lse, ~empty)
            m[empty] = np.nan
            o[empty] = np.nan
        return lse

    def set(self, emu, op):
        if not self.on:
            return emu.emulate_extras(None, None, None, None, None, None, 0)
        strides = []
        for x in self.sums:
            if x is None:
                strides.append((None, None))
                continue
            st = [n // 4 for n in x.strides]
            full = {"states": st, "share": st}.get(op, [st[0], 0, st[1]])  # (token, state, head)
            keep = (ctypes.c_int64 * 3)(*full)
            self.alive.append(keep)
            strides.append((ctypes.c_void_p(x.ctypes.data), ctypes.cast(keep, ctypes.POINTER(ctypes.c_int64))))
        v = self.valid
        vs = (ctypes.c_int64 * 2)(*([n // v.itemsize for n in v.strides] + [0])[:2]) if v is not None else None
        self.alive.append(vs)
        emu.emulate_extras(*strides[0], *strides[1], None if v is None else ctypes.c_void_p(v.ctypes.data),
                           None if vs is None else ctypes.cast(vs, ctypes.POINTER(ctypes.c_int64)),
                           0 if v is None else v.itemsize)


@pytest.mark.parametrize("live", (False, True), ids=("every_token", "live_count"))
@pytest.mark.parametrize("extras", (False, True), ids=("lses", "stats_and_valid"))
@pytest.mark.parametrize("fenced_tail", (True, False))  # arrays end at an unreadable page, or start after one
@pytest.mark.parametrize("name", list(PATHS))
def test_every_path_of_the_plan(emu, rng, name, fenced_tail, extras, live):
    """Each path as planned, and with StateExtras (softmax statistics and valid states: the same
    path, a plain one taking its general kernel), merging right in every order of the threads.
    With a live count (num_tokens: half the tokens, int32 or int64) the same plan and launch, the
    live rows merged right and every row past the count left as it was, bit for bit."""
    op, t, s, h, d, dtype, f, want = PATHS[name]
    count = np.array([t // 2], np.int64 if len(name) % 2 else np.int32) if live else None
    layout = f.get("layout", "dense")
    far = FAR if f.get("far") else 1000
    ex = Extras(extras, rng, fenced_tail)
    if extras:  # the general kernels, and of kRows' those of kSmallChunk (takes_extras)
        want = dict(want, variant=GENERAL.get(want["variant"], want["variant"]))
        if want.get("chunk") == 8:
            want["chunk"] = 4

    def fact(*os):  # the case's facts, the vector width its O arrays allow
        return fact_args(widest_vec(d, *os), os[0].itemsize, f["sms"], far, f["bytes"])

    sink = sink_view = None
    if f.get("sink"):  # one head's sink above its states, the other's empty (a row of no states: LSE = sink)
        sink = np.array([3.0, -np.inf] + [0.5] * (h - 2), np.float32)
        sink_view, _ = placed(sink, dict(steps={0: 2}), fenced_tail)
    sink_ptr = sink_pointer(sink_view)

    if op in ("merge", "inplace"):
        o_a, o_b = random_o(rng, (t, h, d), dtype), random_o(rng, (t, h, d), dtype)
        lse_a, lse_b = random_lse(rng, (t, h)), random_lse(rng, (t, h))
        empties(rng, lse_b, o_b, 0.2)
        a_tokens = t - 2 if layout == "a" else t
        wide = dict(order=(0, 1, 2), steps={1: 2}) if layout == "wide" else {}
        mask = (rng.random(t) < 0.5).astype(np.uint8) if f.get("mask") else None
        valid = ex.states((t, 2))
        if mask is not None and valid is not None:
            valid[mask == 0] = 1  # a row the mask leaves alone keeps its own state, unpoisoned
        empty_a = None if valid is None else np.broadcast_to((valid[:, :1] == 0), (t, h)).copy()
        empty_b = None if valid is None else np.broadcast_to((valid[:, 1:] == 0), (t, h)).copy()
        ref_a = ex.lse(None if op == "inplace" else 0, lse_a, o_a, empty_a)
        ref_b = ex.lse(1, lse_b, o_b, empty_b)
        ref_o, ref_lse = reference_merge(o_a, ref_a, o_b, ref_b, a_tokens=a_tokens)
        if mask is not None:
            ref_o[mask == 0], ref_lse[mask == 0] = to_f64(o_a[mask == 0]), to_f64(lse_a[mask == 0])
        va, _ = placed(o_a[:a_tokens], wide if op == "inplace" else {}, fenced_tail)
        vla, _ = placed(lse_a[:a_tokens], {}, fenced_tail)
        vb, _ = placed(o_b, {}, fenced_tail)
        vlb, _ = placed(lse_b, {}, fenced_tail)
        if op == "inplace":
            out, out_lse = va, vla
        else:
            out, out_lse = out_buffers((t, h, d), dtype, wide, fenced_tail)[0], nan_array((t, h))
        vm = placed(mask, {}, fenced_tail)[0] if mask is not None else None
        ptrs, strides = pointers(out, out_lse, va, vla, vb, vlb)
        inputs = [np.array(x, copy=True) for x in (va, vla)]

        def call():
            if op == "inplace":  # each order starts from the same inputs
                va[...], vla[...] = inputs
            return emu.emulate_merge(*head((t, a_tokens, h, d), dtype, dtype, "e", fact(va, vb, out)),
                                     int(f.get("tokens_inner", False)), 1, int(op == "inplace"), ctypes.c_float(1.0),
                                     None, *ptrs, None if vm is None else ctypes.c_void_p(vm.ctypes.data),
                                     ctypes.c_int64(1))
    elif op == "states":
        o, lse = random_o(rng, (t, s, h, d), dtype), random_lse(rng, (t, s, h))
        empties(rng, lse, o, 0.2)
        lse[0, s - 1, 0] = np.nan  # a NaN late in a split row
        valid = ex.states((t, s))
        empty = None if valid is None else np.broadcast_to((valid == 0)[:, :, None], lse.shape).copy()
        ref_o, ref_lse = reference_merge_stacked(o, ex.lse(0, lse, o, empty), sink=sink)
        vo, _ = placed(o, dict(order=(1, 0, 2, 3)), fenced_tail)
        vl, _ = placed(lse, {}, fenced_tail)
        out, out_lse = out_buffers((t, h, d), dtype, {}, fenced_tail)[0], nan_array((t, h))
        ptrs, strides = pointers(out, out_lse, vo, vl)

        def call():
            return emu.emulate_merge_states(*head((t, s, h, d), dtype, dtype, "e", fact(vo, out)),
                                            f.get("groups", 0), ctypes.c_float(1.0), *ptrs, *sink_ptr)
    elif op == "share":
        index = s - 2  # a state late in the row: past the first chunk where s > 8
        o, lse = random_o(rng, (t, h, d), dtype), random_lse(rng, (t, s, h))
        lse[rng.random(lse.shape) < 0.2] = -np.inf  # empty states (index's too, sometimes)
        lse[0, s - 1, 0] = np.nan  # a NaN late in a row, in a state whose O is not given
        valid = ex.states((t, s))
        empty = None if valid is None else np.broadcast_to((valid == 0)[:, :, None], lse.shape).copy()
        o_states = np.repeat(o[:, None], s, axis=1)  # the poisoning of the own state's O lands in o
        ref_lse_in = ex.lse(0, lse, o_states, empty)
        o = np.ascontiguousarray(o_states[:, index])
        ref_o, ref_lse = reference_merge_share(o, ref_lse_in, index, sink=sink)
        vo, _ = placed(o, {}, fenced_tail)
        vl, _ = placed(lse, dict(order=(1, 0, 2)), fenced_tail)  # an all-gather's [S, tokens, heads]
        out, out_lse = out_buffers((t, h, d), dtype, {}, fenced_tail)[0], nan_array((t, h))
        ptrs, strides = pointers(out, out_lse, vo, vl)

        def call():
            return emu.emulate_merge_share(*head((t, s, h, d), dtype, dtype, "e", fact(vo, out)),
                                           f.get("groups", 0), ctypes.c_float(1.0), *ptrs, ctypes.c_int64(index),
                                           *sink_ptr)
    else:
        counts = [s, 0, 1, s + 3, 2][:t]
        indptr = np.concatenate([[1], 1 + np.cumsum(counts)]).astype(np.int64)
        total = int(indptr[-1]) + 2
        o, lse = random_o(rng, (total, h, d), dtype), random_lse(rng, (total, h))
        empties(rng, lse, o, 0.2)
        valid = ex.states((total,))
        empty = None if valid is None else np.broadcast_to((valid == 0)[:, None], lse.shape).copy()
        ref_o, ref_lse = reference_merge_varlen(o, ex.lse(0, lse, o, empty), indptr, sink=sink)
        vo, _ = placed(o, {}, fenced_tail)
        vl, _ = placed(lse, {}, fenced_tail)
        vi, _ = placed(indptr, {}, fenced_tail)
        out, out_lse = out_buffers((t, h, d), dtype, {}, fenced_tail)[0], nan_array((t, h))
        ptrs, strides = pointers(out, out_lse, vo, vl)

        def call():
            return emu.emulate_merge_varlen(*head((t, total, h, d), dtype, dtype, "e", fact(vo, out)),
                                            f.get("groups", 0), ctypes.c_float(1.0), *ptrs,
                                            ctypes.c_void_p(vi.ctypes.data), ctypes.c_int64(1), 1, *sink_ptr)
    ex.set(emu, op)
    emu.emulate_num_tokens(None if count is None else ctypes.c_void_p(count.ctypes.data), count is not None and
                           count.dtype == np.int64)
    try:
        run_orders(emu, call, [out, out_lse], seed=len(name))
    finally:
        Extras(False, rng, fenced_tail).set(emu, op)
        emu.emulate_num_tokens(None, 0)
    got = plan(emu)
    assert {k: got[k] for k in want} == want, f"{name}: planned {got}"
    assert len(launches(emu)) == got["launches"]
    n = t if count is None else int(count[0])
    assert_merge_matches(out[:n], out_lse[:n], (ref_o[:n], ref_lse[:n]), dtype)
    if count is not None:  # the rows past the count hold what they held: the NaN poison, or in place the inputs
        held = inputs if op == "inplace" else [np.full_like(out, np.nan), np.full_like(out_lse, np.nan)]
        for x, before in zip((out, out_lse), held):
            np.testing.assert_array_equal(np.asarray(x)[n:].view(np.uint8), before[n:].view(np.uint8),
                                          err_msg="a row past the live count was written")


def test_the_paths_reach_every_variant(emu):
    """Every variant of launch_merge; the exchange's kernel has its own launcher and emulator
    (test_exchange_kernel_emulated.py)."""
    reached = {want["variant"] for *_, want in PATHS.values()}
    assert reached == set(variants(emu)) - {"none", "exchange"}


@pytest.mark.parametrize("head_size", (128, 2056))  # rows in a warp, rows over blocks
def test_an_in_place_lse_beside_an_output_of_another_dtype_takes_two_launches(emu, rng, head_size):
    """out_lse is a's LSE but out is float32 from bfloat16 inputs: no in-place kernel is compiled
    for two dtypes (plan.h, may_plan), so the merge runs without the LSE and the LSEs follow."""
    t, h = 6, 3
    o_a, o_b = random_o(rng, (t, h, head_size), "bfloat16"), random_o(rng, (t, h, head_size), "bfloat16")
    lse_a, lse_b = random_lse(rng, (t, h)), random_lse(rng, (t, h))
    empties(rng, lse_b, o_b, 0.2)
    ref = reference_merge(o_a, lse_a, o_b, lse_b)
    va, _ = placed(o_a, {}, True)
    vla, _ = placed(lse_a, {}, True)
    vb, _ = placed(o_b, {}, True)
    vlb, _ = placed(lse_b, {}, True)
    out, obuf = out_buffers((t, h, head_size), "float32", {}, True)
    ptrs, _keep = pointers(out, vla, va, vla, vb, vlb)
    fact = fact_args(widest_vec(head_size, va, out), 4)
    order(emu, 2, 7)
    check(emu, emu.emulate_merge(*head((t, t, h, head_size), "bfloat16", "float32", "e", fact), 0, 0, 1,
                                 ctypes.c_float(1.0), None, *ptrs, None, ctypes.c_int64(0)))
    got = plan(emu)
    assert (got["variant"], got["launches"]) == ("rows_lse_after", 2), got
    assert_merge_matches(out, vla, ref, "float32")
    assert outside_view_is_nan(out, obuf)


@pytest.mark.parametrize("index_dtype", (np.int32, np.int64))
@pytest.mark.parametrize("case", list(BAD_INDPTR))
@pytest.mark.parametrize("groups", (1, 2))  # kRows, kStates
def test_a_bad_indptr_is_clamped(emu, rng, case, index_dtype, groups):
    """The GPU's answer to a bad indptr (the C ABI refuses one only on the CPU): row r takes states
    [clamp(indptr[r], 0, total), clamp(indptr[r+1], that, total)), with no read outside o and lse
    (fenced) and no write outside the output, on both strategies."""
    total, h, d = 10, 3, 64
    o, lse = random_o(rng, (total, h, d), "float32"), random_lse(rng, (total, h))
    indptr = np.array(BAD_INDPTR[case], np.int64).astype(index_dtype)
    rows = len(indptr) - 1
    ref = reference_merge_ranges(o, lse, clamp_indptr(indptr, total))
    for tail in (False, True):
        vo, _ = placed(o, {}, tail)
        vl, _ = placed(lse, {}, tail)
        vi, _ = placed(indptr, {}, tail)
        out, obuf = out_buffers((rows, h, d), "float32", dict(pad=2), tail)
        out_lse, lbuf = out_buffers((rows, h), "float32", dict(pad=1), tail)
        fact = fact_args(4, 4)
        ptrs, strides = pointers(out, out_lse, vo, vl)
        order(emu, 2, rows)
        check(emu, emu.emulate_merge_varlen(*head((rows, total, h, d), "float32", "float32", "e", fact), groups,
                                            ctypes.c_float(1.0), *ptrs, ctypes.c_void_p(vi.ctypes.data),
                                            ctypes.c_int64(1), int(index_dtype == np.int64), None, ctypes.c_int64(0)))
        assert plan(emu)["groups"] == groups
        assert_merge_matches(out, out_lse, ref, "float32")
        assert outside_view_is_nan(out, obuf) and outside_view_is_nan(out_lse, lbuf)


# ---- a masked row reads its mask byte and nothing else -------------------------------------------


def paged(x: np.ndarray, inner: tuple):
    """x [tokens, ...] with each token's elements on pages of their own (the view's inner strides
    `inner`, in elements; its token stride a whole number of pages), and a function that makes
    the pages of the tokens given unreadable, or readable again."""
    t = x.shape[0]
    extent = 1 + sum((n - 1) * s for n, s in zip(x.shape[1:], inner))
    pages = -(-extent * x.itemsize // PAGE)
    m = mmap.mmap(-1, max(1, t * pages) * PAGE)
    buf = np.frombuffer(m, np.uint8).view(x.dtype)
    view = np.lib.stride_tricks.as_strided(buf, shape=x.shape,
                                           strides=(pages * PAGE,) + tuple(s * x.itemsize for s in inner))
    view[...] = x
    base = ctypes.addressof(ctypes.c_char.from_buffer(m))

    def protect(tokens, readable=False):
        for i in tokens:
            at = ctypes.c_void_p(base + int(i) * pages * PAGE)
            assert _libc.mprotect(at, ctypes.c_size_t(pages * PAGE), 3 if readable else 0) == 0  # PROT_READ | WRITE

    return view, protect


# (heads, head_size, dtype, bytes, inner strides of O and LSE, plan fields): the in-place paths a mask takes
MASKED = {
    "rows in warps, flat": (16, 128, "bfloat16", 1 << 20, ((128, 1), (64,)), dict(variant="inplace_plain_flat", vec=8)),
    "rows in warps, flat, two accesses a thread": (16, 128, "bfloat16", LARGE, ((128, 1), (64,)),
                                                   dict(variant="inplace_plain_flat", vec=16)),
    "rows in warps": (2, 24, "float16", 1 << 20, ((40, 1), (1,)), dict(variant="inplace_warp")),
    "rows in a block": (2, 512, "float32", 1 << 20, ((512, 1), (1,)), dict(variant="inplace_block", launches=1)),
    "rows over blocks": (1, 2056, "float32", 1 << 20, ((2056, 1), (1,)), dict(variant="rows_lse_after", launches=2)),
}


def masked_call(emu, name: str) -> None:
    """The in-place merge of MASKED[name] with every page of a masked-out token's O and LSE, in both
    states, unreadable during the call; then its plan and results, held to the expected ones."""
    h, d, dtype, nbytes, (o_inner, l_inner), want = MASKED[name]
    rng = np.random.default_rng(len(name))
    t = 6
    mask = np.array([1, 0, 0, 1, 0, 1], np.uint8)
    o, o_other = random_o(rng, (t, h, d), dtype), random_o(rng, (t, h, d), dtype)
    lse, lse_other = random_lse(rng, (t, h)), random_lse(rng, (t, h))
    ref_o, ref_lse = reference_merge(o, lse, o_other, lse_other)
    ref_o[mask == 0], ref_lse[mask == 0] = to_f64(o[mask == 0]), to_f64(lse[mask == 0])
    arrays = [paged(o, o_inner), paged(lse, l_inner), paged(o_other, o_inner), paged(lse_other, l_inner)]
    vo, vl, vb, vlb = (a[0] for a in arrays)
    ptrs, strides = pointers(vo, vl, vo, vl, vb, vlb)
    vec = widest_vec(d, vo, vb)
    fact = fact_args(vec, vo.itemsize, nbytes=nbytes)
    masked_out = np.flatnonzero(mask == 0)
    for _, protect in arrays:
        protect(masked_out)
    order(emu, 0)
    status = emu.emulate_merge(*head((t, t, h, d), dtype, dtype, "e", fact), 0, 0, 1, ctypes.c_float(1.0), None,
                               *ptrs, ctypes.c_void_p(mask.ctypes.data), ctypes.c_int64(1))
    for _, protect in arrays:
        protect(masked_out, readable=True)
    check(emu, status)
    got = plan(emu)
    assert {k: got[k] for k in want} == want, got
    assert_merge_matches(vo, vl, (ref_o, ref_lse), dtype)


@pytest.mark.parametrize("name", list(MASKED))
def test_a_masked_row_reads_its_mask_byte_alone(emu, name):
    """A read of a masked-out row's O or LSE ends the call's process with SIGSEGV: masked_call runs
    in a process of its own (this file as a script)."""
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([here, os.path.dirname(here), os.environ.get("PYTHONPATH", "")]))
    child = subprocess.run([sys.executable, __file__, emu._name, name], env=env, capture_output=True, text=True,
                           timeout=300)
    assert child.returncode != -signal.SIGSEGV, f"{name}: the call read memory of a masked-out row"
    assert child.returncode == 0, child.stderr[-3000:]


if __name__ == "__main__":  # test_a_masked_row_reads_its_mask_byte_alone's process: emulator, case
    lib = ctypes.CDLL(sys.argv[1])
    lib.emulate_error.restype = ctypes.c_char_p
    masked_call(lib, sys.argv[2])


# ---- per-group FP8 outputs -----------------------------------------------------------------------


def fp8_states(rng, data, op, shape, tail):
    """Random bfloat16 states of `op` (shape: tokens, S, heads, head_size; some empty), placed in
    drawn layouts: (the float64 merge, the views the call reads, its O views, the call's shape for
    fp8_call, merge_share's index, merge_varlen's indptr)."""
    t, s, h, d = shape
    index = indptr = None
    if op == "merge":
        o, lse = random_o(rng, (2, t, h, d), "bfloat16"), random_lse(rng, (2, t, h))
        empties(rng, lse, o, data.draw(st.sampled_from((0.0, 0.3))))
        ref = reference_merge(o[0], lse[0], o[1], lse[1])[0]
        views = [placed(x, data.draw(layouts(x.ndim, x.ndim == 3)), tail)[0] for x in (o[0], lse[0], o[1], lse[1])]
        return ref, views, (views[0], views[2]), shape, index, indptr
    if op == "merge_varlen":
        indptr = np.sort(rng.integers(0, s * t + 1, t + 1)).astype(np.int64)
        indptr[0], total = 0, max(int(indptr[-1]), 1)
        o, lse = random_o(rng, (total, h, d), "bfloat16"), random_lse(rng, (total, h))
        ref = reference_merge_varlen(o, lse, indptr)[0]
        views = [placed(o, data.draw(layouts(3, True)), tail)[0], placed(lse, data.draw(layouts(2, False)), tail)[0]]
        return ref, views, views[:1], (t, total, h, d), index, indptr
    o, lse = random_o(rng, (t, s, h, d), "bfloat16"), random_lse(rng, (t, s, h))
    empties(rng, lse, o, data.draw(st.sampled_from((0.0, 0.3))))
    index = data.draw(st.integers(0, s - 1))
    if op == "merge_share":
        o = np.ascontiguousarray(o[:, index])
        ref = reference_merge_share(o, lse, index)[0]
    else:
        ref = reference_merge_stacked(o, lse)[0]
    views = [placed(o, data.draw(layouts(o.ndim, True)), tail)[0], placed(lse, data.draw(layouts(3, False)), tail)[0]]
    return ref, views, views[:1], shape, index, indptr


def fp8_call(emu, op, shape, fact, groups, ptrs, index, indptr):
    """The emulated call of `op` from bfloat16 states [tokens, S, heads, head_size] (merge's two
    states; merge_varlen's S: all its states, in the rows of indptr) into an FP8 out at ptrs (out,
    its LSE, the inputs), the scales set beforehand (emulate_group_scales, emulate_block_scales)."""
    t, s, h, d = shape
    one, none = ctypes.c_float(1.0), ctypes.c_int64(0)
    if op == "merge":
        return lambda: emu.emulate_merge(*head((t, t, h, d), "bfloat16", "float8_e4m3fn", "e", fact), 0, 0, 0, one,
                                         None, *ptrs, None, none)
    if op == "merge_varlen":
        return lambda: emu.emulate_merge_varlen(
            *head((len(indptr) - 1, s, h, d), "bfloat16", "float8_e4m3fn", "e", fact), groups, one, *ptrs,
            ctypes.c_void_p(indptr.ctypes.data), ctypes.c_int64(1), 1, None, none)
    args = head((t, s, h, d), "bfloat16", "float8_e4m3fn", "e", fact)
    if op == "merge_share":
        return lambda: emu.emulate_merge_share(*args, groups, one, *ptrs, ctypes.c_int64(index), None, none)
    return lambda: emu.emulate_merge_states(*args, groups, one, *ptrs, None, none)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_per_group_fp8_outputs(emu, data):
    """Each op into FP8 with per-group scales (OutView::group_scales): under kRows a group's lanes
    meet at its shuffles whatever the rows' place in their warps (heads of 1 to 16 packs, vectors of
    1 to 8 elements, rows past the block's packs); under kStates (the N-way and variable-length
    merges where groups of threads share a row's states) a group's finishing threads, in several
    warps, meet in shared memory; the scales in any layout."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    op = data.draw(st.sampled_from(("merge", "merge_states", "merge_share", "merge_varlen")))
    t, h = data.draw(st.integers(0, 5)), data.draw(st.integers(1, 3))
    d = data.draw(st.sampled_from((8, 16, 64, 128, 136, 256)))
    s = data.draw(st.sampled_from((1, 2, 5, 9, 40)))
    fp8_dtype()
    tail = data.draw(st.booleans())
    out, obuf = out_buffers((t, h, d), "float8_e4m3fn", data.draw(layouts(3, True)), tail)
    ref, views, o_views, shape, index, indptr = fp8_states(rng, data, op, (t, s, h, d), tail)
    vec = widest_vec(d, *o_views, out)
    group = data.draw(st.sampled_from([g for g in (8, 16, 32, 64, 128, 256) if d % g == 0 and g <= 32 * vec]))
    ue8m0 = data.draw(st.booleans())
    scales, sbuf = out_buffers((t, h, d // group), "float32", data.draw(layouts(3, False)), tail)
    (sptr, sstrides), _scales_alive = pointers(scales)
    emu.emulate_group_scales(sptr, sstrides, group, int(ue8m0))
    fact = facts(data, vec, (2, 1))
    groups = data.draw(st.sampled_from((0, 2, 16)))  # 2 and 16 ask for kStates
    ptrs, _keep = pointers(out, None, *views)
    try:
        run_orders(emu, fp8_call(emu, op, shape, fact, groups, ptrs, index, indptr),
                   [obuf, sbuf], data.draw(st.integers(0, 1000)))
    finally:
        emu.emulate_group_scales(None, None, 0, 0)
    if t:
        p = plan(emu)
        shared = op in ("merge_states", "merge_varlen") and p["index32"] and vec == 8  # kStates' conditions
        assert p["variant"] not in PLAIN and (groups == 0 or (p["variant"] == "states") == shared), p
    assert_group_fp8_close(out, scales, ref, group, ue8m0)
    assert outside_view_is_nan(out, obuf) and outside_view_is_nan(scales, sbuf)


# ---- block-scaled outputs ------------------------------------------------------------------------


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_block_scaled_outputs(emu, data):
    """Each op into MXFP8 (floor, RCEIL) or NVFP4, the scales at strides or in the swizzled 128 x 4
    tiles (OutView::block, swizzled_at): a block's lanes meet at its shuffles (kRows, the share) or
    its finishing threads in shared memory (kStates, which NVFP4 keeps to two values or more per
    finisher), the tiles' padding zeroed; every order of the threads gives the same bytes."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    op = data.draw(st.sampled_from(("merge", "merge_states", "merge_share", "merge_varlen")))
    block = data.draw(st.sampled_from((1, 2, 3)))  # BlockScales: MXFP8 floor, RCEIL, NVFP4
    fmt, rounding = ("nvfp4", "floor") if block == 3 else ("mxfp8", "rceil" if block == 2 else "floor")
    size = 16 if block == 3 else 32
    t, h = data.draw(st.integers(0, 5)), data.draw(st.integers(1, 3))
    d = data.draw(st.sampled_from([x for x in (32, 64, 96, 128, 256) if x % size == 0]))
    s = data.draw(st.sampled_from((1, 2, 5, 9, 40)))
    swizzled = data.draw(st.booleans())
    g = data.draw(st.sampled_from((1.0, 0.37))) if block == 3 else 1.0
    fp8 = fp8_dtype()
    tail = data.draw(st.booleans())
    out_shape = (t, h, d // 2) if block == 3 else (t, h, d)
    out, obuf = out_buffers(out_shape, fp8, {}, tail)  # bytes, poisoned 0x7f
    ref, views, o_views, shape, index, indptr = fp8_states(rng, data, op, (t, s, h, d), tail)
    vec = widest_vec(d, *o_views)
    if block == 3 and vec < 2:
        return  # refused by the C ABI (NVFP4 stores two values per byte)
    per_head = d // size
    scale_shape = (-(-t // 128), -(-h * per_head // 4), 512) if swizzled else (t, h, per_head)
    scales, sbuf = out_buffers(scale_shape, fp8, {} if swizzled else data.draw(layouts(3, False)), tail)
    (sptr, sstrides), _scales_alive = pointers(scales)
    emu.emulate_block_scales(sptr, sstrides, block, int(swizzled), per_head, ctypes.c_float(g))
    fact = facts(data, vec, (2, 1))
    groups = data.draw(st.sampled_from((0, 2, 16)))
    ptrs, _keep = pointers(out, None, *views)
    try:
        run_orders(emu, fp8_call(emu, op, shape, fact, groups, ptrs, index, indptr),
                   [obuf, sbuf], data.draw(st.integers(0, 1000)))
    finally:
        emu.emulate_group_scales(None, None, 0, 0)
    if t:
        p = plan(emu)
        assert p["variant"] not in PLAIN, p
        if block == 3 and p["variant"] == "states":
            assert p["groups"] <= vec // 2, p  # a finisher's values fill whole bytes
    assert_block_close(fmt, rounding, g if block == 3 else None, out, scales, ref,
                       "swizzled" if swizzled else "row_major")
    if swizzled and t:  # every byte of the tiles is written: none left at the poison's 0x7f but a NaN scale's
        real = np.zeros(scales.shape, bool)
        for r in range(t):
            for c in range(h * per_head):
                real[r // 128, c // 4, (r % 32) * 16 + (r // 32 % 4) * 4 + c % 4] = True
        b = scales.view(np.uint8)
        assert not (b[~real] != 0).any(), "a padding byte not zero"
    assert outside_view_is_nan(out, obuf) and outside_view_is_nan(scales, sbuf)


# ---- a_tokens read from memory --------------------------------------------------------------------


@pytest.mark.parametrize("wide", (False, True), ids=("int32", "int64"))
@pytest.mark.parametrize("fenced_tail", (True, False))
@pytest.mark.parametrize("layout", ("dense", "tiled"))
def test_a_tokens_from_memory(emu, rng, fenced_tail, wide, layout):
    """The two-way merge's a_tokens read by the kernel (the C ABI's a_tokens_tensor): the general
    kernel (a plain one would read every token of a), rows of tokens past the count take b alone
    and never read a, whose rows there are NaN; in every order of the threads."""
    t, h, d, k = (9, 3, 64, 4) if layout == "dense" else (70, 2, 16, 33)
    o_a, o_b = random_o(rng, (t, h, d), "float16"), random_o(rng, (t, h, d), "float16")
    lse_a, lse_b = random_lse(rng, (t, h)), random_lse(rng, (t, h))
    ref = reference_merge(o_a, lse_a, o_b, lse_b, a_tokens=k)
    o_a[k:], lse_a[k:] = np.nan, np.nan
    va, _ = placed(o_a, {}, fenced_tail)
    vla, _ = placed(lse_a, {}, fenced_tail)
    vb, _ = placed(o_b, {}, fenced_tail)
    vlb, _ = placed(lse_b, {}, fenced_tail)
    out, out_lse = out_buffers((t, h, d), "float16", {}, fenced_tail)[0], nan_array((t, h))
    ptrs, strides = pointers(out, out_lse, va, vla, vb, vlb)
    count = np.array([k], np.int64 if wide else np.int32)
    fact = fact_args(widest_vec(d, va, vb, out), 2, 132, 1000, LARGE if layout == "tiled" else 1 << 20)

    def call():
        return emu.emulate_merge(*head((t, t, h, d), "float16", "float16", "e", fact), int(layout == "tiled"), 1, 0,
                                 ctypes.c_float(1.0), None, *ptrs, None, ctypes.c_int64(1))
    emu.emulate_a_tokens(ctypes.c_void_p(count.ctypes.data), int(wide))
    try:
        run_orders(emu, call, [out, out_lse], seed=k)
    finally:
        emu.emulate_a_tokens(None, 0)
    got = plan(emu)
    assert got["variant"] == "rows" and got["tile_shift"] == (3 if layout == "tiled" else -1), got
    assert_merge_matches(out, out_lse, ref, "float16")
