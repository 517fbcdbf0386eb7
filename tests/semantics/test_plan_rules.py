"""The launch plan itself (cpp/include/attnmerge/plan.h, host-only C++), on the CPU: every rule of
plan_spec.py over a grid of shapes and GPUs, through tests/native/plan_probe.cpp built against the
installed headers with the machine's C++ compiler.  No GPU needed: CI runs these."""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess

import pytest

import attnmerge
from plan_spec import (
    BLOCK_THREADS,
    INDEX32_LIMIT,
    MIN_BLOCK_THREADS,
    PAIR_BLOCK_THREADS,
    STATE_BLOCK,
    STATE_THREADS_PER_SM,
    chunk_for,
    groups_for,
    pair_block_threads,
    states_rows_limit,
)

PROBE = os.path.join(os.path.dirname(__file__), "..", "native", "plan_probe.cpp")
FIELDS = ("strategy", "chunk", "groups", "launches", "plain", "fused_lse", "index32",
          "gx", "gy", "gz", "bx", "by", "bz", "smem", "flat", "lane_lse", "vec", "stream")


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler on PATH")
    exe = tmp_path_factory.mktemp("probe") / "plan_probe"
    build = subprocess.run([cxx, "-std=c++17", "-O1", "-I", attnmerge.include_dir(), PROBE, "-o", str(exe)],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stderr

    def plans(calls):
        text = "".join(" ".join(str(x) for x in call) + "\n" for call in calls)
        run = subprocess.run([str(exe)], input=text, capture_output=True, text=True, timeout=60)
        assert run.returncode == 0, run.stdout + run.stderr
        out = []
        for line in run.stdout.splitlines():
            values = line.split()
            out.append({k: (v if k == "strategy" else int(v)) for k, v in zip(FIELDS, values)})
        assert len(out) == len(calls)
        return out

    return plans


SMS = (132, 108, 16, 0)  # an H200, an A100, a small GPU, unknown
HEADS = 32


def n_way_calls(op):
    # flags: x where each vector access is 16 bytes (8 16-bit or 4 float32 elements), - where not;
    # q per-group FP8 outputs
    for tokens, states, (head_size, vec, flags), sms in itertools.product(
            (1, 3, 16, 128, 256, 1024, 8192), (0, 1, 3, 4, 5, 8, 9, 16, 17, 64, 65, 255, 256, 257),
            ((128, 8, "x"), (128, 8, "-"), (128, 4, "x"), (128, 4, "-"), (64, 8, "x"), (256, 8, "x"), (67, 1, "-"),
             (80, 8, "x"), (2048, 8, "x"), (128, 8, "xq"), (128, 4, "xq"), (256, 8, "xq"), (128, 8, "q")), SMS):
        total = tokens * states if op == "range" else states
        yield (op, tokens, HEADS, head_size, total, vec, sms, flags)


@pytest.mark.parametrize("op", ["stack", "range"])
def test_n_way_strategy_groups_and_chunk(probe, op):
    calls = list(n_way_calls(op))
    for call, plan in zip(calls, probe(calls)):
        _, tokens, heads, head_size, total, vec, sms, flags = call
        states = total if op == "stack" else -(-total // tokens)
        packs, rows = head_size // vec, tokens * heads
        index32 = (total if op == "range" else tokens * max(states, 1)) * heads * head_size < INDEX32_LIMIT
        groups = groups_for(states, packs, rows, sms, 16 if "x" in flags else 0) if index32 else 1
        if groups > 1:
            assert (plan["strategy"], plan["groups"]) == ("states", groups), call
            assert (plan["bx"], plan["by"]) == (packs, groups), call
            per_block = plan["bx"] * plan["by"] * plan["bz"]
            assert per_block <= STATE_BLOCK and plan["gx"] * plan["bz"] >= rows > (plan["gx"] - 1) * plan["bz"], call
            amax_slots = packs if "q" in flags else 0  # per-group FP8: an amax slot a pack
            assert plan["smem"] == plan["bz"] * (groups * (2 + packs * vec) + amax_slots) * 4, call
            assert plan["chunk"] == 4, call  # the states kernel keeps 4 states a thread in flight
        else:
            assert (plan["strategy"], plan["groups"], plan["chunk"]) == ("rows", 1, chunk_for(states)), call
            assert plan["bx"] * plan["by"] <= BLOCK_THREADS, call
        assert (plan["launches"], plan["index32"]) == (1, int(index32)), call


def test_states_kernel_only_with_32_bit_offsets(probe):
    # 16 tokens of 16384 states: more than 2^30 elements, so 64-bit offsets and the rows kernel
    calls = [("stack", 16, 32, 128, 16384, 8, 132, "x"), ("stack", 16, 32, 128, 8192, 8, 132, "x")]
    big, small = probe(calls)
    assert 16 * 16384 * 32 * 128 >= INDEX32_LIMIT > 16 * 8192 * 32 * 128
    assert (big["strategy"], big["index32"]) == ("rows", 0)
    assert (small["strategy"], small["index32"]) == ("states", 1)


def test_states_kernel_only_with_16_byte_accesses(probe):
    # the same call with and without 16-byte vector accesses (x), and with 8-element ones of 16 bytes
    # (16-bit) or of 32 (no such access: float32 would take 4 elements)
    calls = [("stack", 16, 32, 128, 64, 8, 132, "x"), ("stack", 16, 32, 128, 64, 8, 132, "-"),
             ("stack", 16, 32, 128, 64, 2, 132, "-")]
    assert [p["strategy"] for p in probe(calls)] == ["states", "rows", "rows"]


def test_more_states_split_into_more_groups_until_the_gpu_is_full(probe):
    calls = [("stack", 16, 32, 128, s, 8, 132, "x") for s in (9, 12, 16, 32, 64, 128, 256)]
    groups = [p["groups"] for p in probe(calls)]
    # the fewest that leave at most 4 states a group, at most 16; at 64 states, 16 groups of one
    # chunk would fill more than half the GPU (16 x 32 x 16 x 16 threads): 8 of two chunks
    assert groups == [4, 4, 4, 8, 8, 16, 16]
    # the same halving at its edge: 16 x 32 x 16 x 8 = 65536 threads, half the GPU at 128 SMs
    edge = [p["groups"] for p in probe([("stack", 16, 32, 128, 32, 8, sms, "x") for sms in (128, 127)])]
    assert edge == [8, 4]
    # float32 (4 elements a pack): 32 packs a row, so at most 8 groups in a block of 256
    assert [p["groups"] for p in probe([("stack", 16, 32, 128, 256, 4, 132, "x")])] == [8]
    # as rows grow the groups halve, so that the launch fits 132 SMs x STATE_THREADS_PER_SM threads
    capacity = 132 * STATE_THREADS_PER_SM
    for groups in (16, 8, 4, 2):
        last = capacity // (4 * 16 * groups)  # tokens of 4 heads x 16 packs whose G groups just fit
        at, past = probe([("stack", last, 4, 128, 256, 8, 132, "x"), ("stack", last + 1, 4, 128, 256, 8, 132, "x")])
        assert (at["strategy"], at["groups"]) == ("states", groups), groups
        assert (past["strategy"], past["groups"]) == (("states", groups // 2) if groups > 2 else ("states", 2)), groups
    # only where one thread a pack fits the GPU at once: `edge` tokens x 4 heads x 16 packs just do
    # (two groups, two waves), one token more not, nor 512 x 32 heads; rows of at most 16 states
    # only where two threads a pack fit (`edge // 2` tokens)
    edge = capacity // (4 * 16)
    assert edge * 4 == states_rows_limit(64, 16, 132) == 2 * states_rows_limit(16, 16, 132)
    calls = [("stack", edge, 4, 128, 64, 8, 132, "x"), ("stack", edge + 1, 4, 128, 64, 8, 132, "x"),
             ("stack", 512, 32, 128, 64, 8, 132, "x"), ("stack", edge // 2, 4, 128, 16, 8, 132, "x"),
             ("stack", edge // 2 + 1, 4, 128, 16, 8, 132, "x")]
    assert [(p["strategy"], p["groups"]) for p in probe(calls)] == [("states", 2), ("rows", 1), ("rows", 1),
                                                                   ("states", 2), ("rows", 1)]


@pytest.mark.parametrize("sms", SMS)
def test_two_state_kernels(probe, sms):
    # the plain kernel unless masked (m), a_tokens (a), or tiled: [heads, tokens] LSEs (t) from 64 tokens
    flag_sets = ("-", "m", "a", "t", "p")
    for tokens, (head_size, vec) in itertools.product((1, 16, 63, 64, 512, 8192), ((128, 8), (64, 8), (67, 1))):
        calls = [("pair", tokens, HEADS, head_size, 2, vec, sms, f) for f in flag_sets]
        calls.append(("inplace", tokens, HEADS, head_size, 2, vec, sms, "-"))
        calls.append(("inplace", tokens, HEADS, head_size, 2, vec, sms, "m"))
        calls.append(("inplace", tokens, HEADS, head_size, 2, vec, sms, "s"))
        plans = probe(calls)
        for flags, plan in zip(flag_sets, plans):
            plain = flags in ("-", "p") or (flags == "t" and tokens < 64)
            assert (plan["plain"], plan["fused_lse"], plan["launches"]) == (int(plain), 0, 1), (flags, tokens)
        # in place: one launch; rows of at most 32 packs in warps (a warp barrier before the LSE
        # is stored), wider ones with a block barrier; the plain source, rows flat, wherever the
        # rows are in warps
        lanes = int(head_size // vec <= 32)
        for plan, plain, lane_lse in zip(plans[-3:], (lanes,) * 3, (lanes,) * 3):
            assert (plan["plain"], plan["fused_lse"], plan["launches"]) == (plain, 1, 1), tokens
            assert (plan["flat"], plan["lane_lse"]) == (plain, lane_lse), tokens
        for flags, plan in zip(flag_sets, plans[:-3]):  # dense views: the plain kernel takes its rows flat
            assert plan["flat"] == int(plan["plain"] == 1 and flags != "t"), (flags, tokens, head_size)
        # the probe's calls move 2^40 bytes, or 1 MB where small (s): blocks up to pair_block_threads
        for flags, plan in zip(flag_sets + ("-", "m", "s"), plans):
            widest = pair_block_threads(1 << 20 if "s" in flags else 1 << 40, plan["fused_lse"] == 1,
                                        "m" in flags)
            threads = plan["bx"] * plan["by"]
            assert MIN_BLOCK_THREADS <= threads <= widest or plan["bx"] == head_size // vec < MIN_BLOCK_THREADS
            assert plan["gy"] == 1


def test_rows_flat_only_where_every_view_is_dense_and_steps_alike(probe):
    # a gap between tokens (g), [heads, tokens] LSEs (t, below the tiles' 64 tokens) or an output
    # whose rows step unlike the inputs' (w: dense, heads twice as far apart) keep the row split:
    # flat rows share one offset a thread across a, b and the output
    dense, gapped, heads_major, wide_out = probe([("pair", 16, HEADS, 128, 2, 8, 132, f) for f in "-gtw"])
    assert (dense["plain"], dense["flat"]) == (1, 1)
    assert (gapped["plain"], gapped["flat"]) == (1, 0)
    assert (heads_major["plain"], heads_major["flat"]) == (1, 0)
    assert (wide_out["plain"], wide_out["flat"]) == (1, 0)


def test_two_state_threads_take_two_accesses_only_in_large_masked_in_place_merges(probe):
    # x: 16-byte accesses; a thread takes two side by side only in an in-place merge with a mask (m)
    # of 16 MB or more (not s) whose rows have an even number of accesses (128, not 72, elements)
    calls = [("inplace", 16, HEADS, 128, 2, 8, 132, "mx"), ("inplace", 16, HEADS, 72, 2, 8, 132, "mx"),
             ("inplace", 16, HEADS, 128, 2, 8, 132, "msx"), ("inplace", 16, HEADS, 128, 2, 8, 132, "x"),
             ("inplace", 16, HEADS, 128, 2, 8, 132, "m"), ("pair", 16, HEADS, 128, 2, 8, 132, "mx"),
             ("stack", 16, HEADS, 128, 4, 8, 132, "x")]
    plans = probe(calls)
    assert [p["vec"] for p in plans] == [16, 8, 8, 8, 8, 8, 8]
    assert [p["bx"] for p in plans[:2]] == [8, 16]  # a row of 128 in 8 threads, of 72 in 9 padded to 16


def test_in_place_rows_in_warps_take_power_of_two_lanes(probe):
    # small (s) or masked (m) calls, packs of 16, 10 and 32 (8 elements a pack), 33 (one element): a
    # row's lanes padded to a power of two up to a warp, aligned in it; wider rows take a block
    # barrier instead; large unmasked calls (below) in warps too, in blocks of 512 threads
    plans = probe([("inplace", 37, 3, head_size, 2, vec, 132, m) for head_size, vec in ((128, 8), (80, 8), (256, 8), (33, 1))
                   for m in "sm"])
    for plan, lanes in zip(plans, (16, 16, 16, 16, 32, 32, 0, 0)):
        assert (plan["lane_lse"], plan["fused_lse"], plan["launches"], plan["gy"]) == (int(lanes > 0), 1, 1, 1)
        if lanes:
            assert plan["bx"] == lanes and (plan["bx"] * plan["by"]) % 32 == 0
    assert plans[-1]["bx"] == 33  # a barrier block holds whole rows
    large = probe([("inplace", 4096, 32, 128, 2, 8, 132, "-")])[0]
    assert (large["lane_lse"], large["fused_lse"], large["launches"], large["bx"], large["by"]) == (1, 1, 1, 16, 32)
    masked = probe([("inplace", 4096, 32, 128, 2, 8, 132, "m")])[0]
    assert (masked["lane_lse"], masked["bx"] * masked["by"]) == (1, PAIR_BLOCK_THREADS)


def test_in_place_rows_wider_than_a_block_take_two_launches(probe):
    # head sizes of 2 and 1 blocks' packs (8 elements a pack)
    wide, fits = probe([("inplace", 37, 3, 16 * PAIR_BLOCK_THREADS, 2, 8, 132),
                        ("inplace", 37, 3, 8 * PAIR_BLOCK_THREADS, 2, 8, 132)])
    assert (wide["fused_lse"], wide["launches"], wide["gy"]) == (0, 2, 2)
    assert (fits["fused_lse"], fits["launches"], fits["gy"]) == (1, 1, 1)


def test_evict_first_accesses_by_size(probe):
    """Evict-first O accesses: two-way merges, in place or not, under 8 MB (with vLLM's [heads,
    tokens] LSEs in tiles of tokens: 16 MB), N-way merges under 16 MB or, of more states than a
    chunk, under 512 MB, variable-length merges always."""
    def stream(op, states, mb, flags="x"):
        return probe([(op, 512, 32, 128, states, 8, 132, flags, mb)])[0]["stream"]

    assert [stream("pair", 2, mb) for mb in (7.9, 8, 12.8)] == [1, 0, 0]
    assert [stream("pair", 2, mb, "xt") for mb in (12.8, 15.9, 16)] == [1, 1, 0]  # 512 tokens: tiled
    assert [stream("inplace", 2, mb) for mb in (7.9, 8, 12.8)] == [1, 0, 0]
    assert [stream("inplace", 2, mb, "xm") for mb in (7.9, 8)] == [1, 0]
    assert [stream("inplace", 2, mb, "xt") for mb in (12.8, 15.9, 16)] == [1, 1, 0]
    assert [stream("stack", 4, mb) for mb in (15.9, 16)] == [1, 0]
    assert [stream("stack", 64, mb) for mb in (511, 512)] == [1, 0]
    assert [stream("range", 64, mb) for mb in (16, 4096)] == [1, 1]
