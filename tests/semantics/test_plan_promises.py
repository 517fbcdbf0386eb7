"""What the launch plan (cpp/include/attnmerge/plan.h, host-only C++) promises, on the CPU, over a
grid of calls (ops, dtypes, shapes, layouts, sizes moved) and GPUs (SM counts): every launch fits
the GPU's limits and its kernel's, covers every row and pack, kStates groups are a power of two, an
in-place merge's rows lie in one warp or one block or take a second launch, 32-bit offsets only where
every offset fits in 30 bits, and every plan names a kernel the library compiles (may_plan).
That each variant merges right is test_forward_kernel_emulated.py's.  The plan's tuning is free to
change: the golden table at the end states the intended choice for a few calls, so that a
retuning touches plan.h and that table only.  Built from tests/native/plan_probe.cpp against the
installed headers with the machine's C++ compiler; no GPU needed."""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess

import pytest

import attnmerge

PROBE = os.path.join(os.path.dirname(__file__), "..", "native", "plan_probe.cpp")
FIELDS = ("variant", "strategy", "chunk", "groups", "launches", "index32", "vec", "evict_first", "tile_shift",
          "compiled", "access", "bound", "gx", "gy", "gz", "bx", "by", "bz", "smem",
          "lgx", "lgy", "lgz", "lbx", "lby", "lbz")
SIZES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3": 1}
IN_DTYPES = ("float32", "float16", "bfloat16")
PAIRS = [(i, o) for i in IN_DTYPES for o in SIZES]
IN_PLACE = ("inplace_warp", "inplace_block", "inplace_plain_flat", "rows_lse_after")


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
        run = subprocess.run([str(exe)], input=text, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr
        out = [dict(zip(FIELDS, (v if i < 2 else int(v) for i, v in enumerate(line.split()))))
               for line in run.stdout.splitlines()]
        assert len(out) == len(calls)
        return out

    return plans


def vecs(head_size, in_dtype, out_dtype):
    """The widest vector width the C ABI may choose (16 bytes of the wider dtype, halved until
    head_size allows it), and 1 (a misaligned pointer)."""
    vec = 16 // max(SIZES[in_dtype], SIZES[out_dtype])
    while head_size % vec:
        vec //= 2
    return sorted({vec, 1})


FLAGS = {
    "pair": ("-", "s", "a", "t", "st", "g", "w", "k", "q", "f", "m"),
    "inplace": ("-", "m", "s", "ms", "g", "t", "f", "mf", "w"),
    "stack": ("-", "s", "q", "f", "k", "b"),
    "range": ("-", "s", "q", "f", "k", "b"),
    "share": ("-", "s", "f", "k", "b"),
}


def grid():
    """(op, in, out, tokens, heads, head_size, states, vec, sms, flags) over the grid."""
    for op, flags in FLAGS.items():
        pairs = PAIRS if op in ("pair", "inplace") else [("bfloat16", "bfloat16"), ("float32", "float32"),
                                                          ("float16", "float32"), ("bfloat16", "float8_e4m3")]
        states = (2,) if op in ("pair", "inplace") else (1, 3, 9, 64, 257)
        for (i, o), d, t, h, s, sms, f in itertools.product(
                pairs, (1, 8, 40, 67, 80, 128, 512, 2056, 8192), (0, 1, 16, 64, 513, 8192), (1, 32), states,
                (132, 16, 0), flags):
            if op == "range":
                s = t * s
            for v in vecs(d, i, o):
                yield (op, i, o, t, h, d, s, v, sms, f)


@pytest.fixture(scope="module")
def planned(probe):
    calls = list(grid())
    return list(zip(calls, probe(calls)))


def rows_of(call, plan):
    _, _, _, tokens, heads, *_ = call
    if plan["tile_shift"] >= 0:
        tile = 1 << plan["tile_shift"]
        tokens = -(-tokens // tile) * tile
    return tokens * heads


def test_no_rows_launch_nothing(planned):
    for call, plan in planned:
        assert (plan["variant"] == "none") == (call[3] * call[4] == 0), call
        assert (plan["launches"] == 0) == (plan["variant"] == "none"), call


def test_every_plan_names_a_kernel_the_library_compiles(planned):
    for call, plan in planned:
        assert plan["compiled"] == 1, (call, plan)
        in_place_variant = plan["variant"] in IN_PLACE
        assert in_place_variant == (call[0] == "inplace" and plan["variant"] != "none"), (call, plan)


def test_every_launch_fits_the_gpu_and_its_kernel(planned):
    for call, plan in planned:
        launches = [("g", "b")] + ([("lg", "lb")] if plan["launches"] == 2 else [])
        for g, b in launches[:plan["launches"]]:
            threads = plan[b + "x"] * plan[b + "y"] * plan[b + "z"]
            assert 1 <= threads <= plan["bound"] <= 1024 and plan[b + "z"] <= 64, (call, plan)
            assert plan[g + "x"] <= 2**31 - 1 and plan[g + "y"] <= 65535 and plan[g + "z"] <= 65535, (call, plan)
            assert min(plan[g + "x"], plan[g + "y"], plan[g + "z"]) >= 1, (call, plan)
        assert plan["smem"] <= 48 * 1024, (call, plan)


def test_every_row_and_pack_has_a_thread(planned):
    for call, plan in planned:
        if plan["variant"] == "none":
            continue
        rows, packs = rows_of(call, plan), call[5] // plan["vec"]
        assert call[5] % plan["vec"] == 0, (call, plan)
        if plan["variant"] == "states":
            assert (plan["bx"], plan["by"], plan["gy"], plan["gz"]) == (packs, plan["groups"], 1, 1), (call, plan)
            assert plan["gx"] * plan["bz"] >= rows, (call, plan)
            continue
        assert plan["gx"] * plan["gz"] * plan["by"] >= rows and plan["bz"] == 1, (call, plan)
        assert plan["gy"] * plan["bx"] >= packs, (call, plan)
        if plan["variant"] == "rows_plain_flat":  # one grid axis: a row's packs along the block's x alone
            assert (plan["gy"], plan["gz"]) == (1, 1) and plan["bx"] >= packs, (call, plan)
        if plan["launches"] == 2:  # the LSEs alone: one thread per row
            assert plan["lgx"] * plan["lgz"] * plan["lby"] >= rows and plan["lbx"] == 1, (call, plan)


def test_states_groups_are_a_power_of_two(planned):
    for call, plan in planned:
        if plan["variant"] == "states":
            assert plan["groups"] in (2, 4, 8, 16) and plan["chunk"] == 4 and plan["access"] == 16, (call, plan)
        else:
            assert plan["groups"] == 1, (call, plan)


def test_in_place_rows_lie_in_one_warp_or_one_block_or_take_a_second_launch(planned):
    for call, plan in planned:
        packs = call[5] // plan["vec"]
        v = plan["variant"]
        if v in ("inplace_warp", "inplace_plain_flat"):  # a row's lanes: aligned, a power of two, in one warp
            lanes = plan["bx"]
            assert lanes & (lanes - 1) == 0 and packs <= lanes <= 32 and plan["gy"] == 1, (call, plan)
        elif v == "inplace_block":
            assert plan["bx"] >= packs and plan["gy"] == 1, (call, plan)
        elif v == "rows_lse_after":
            assert plan["launches"] == 2, (call, plan)
        if plan["access"] > 16 and v != "none":  # two accesses per thread: a masked in-place merge only
            assert call[0] == "inplace" and "m" in call[9] and v in IN_PLACE, (call, plan)


def test_32_bit_offsets_only_where_every_offset_fits_in_30_bits(planned):
    for call, plan in planned:
        op, _, _, tokens, heads, head_size, states, _, _, flags = call
        largest = (states if op == "range" else tokens * max(states, 1)) * heads * head_size
        fits = largest < 1 << 30 and "f" not in flags
        assert plan["index32"] == int(fits), (call, plan)
        if plan["variant"] in ("states", "rows_plain_flat", "inplace_plain_flat"):
            assert plan["index32"] == 1, (call, plan)


# ---- the intended choices ------------------------------------------------------------------------
# (op, in, out, tokens, heads, head_size, states, vec, sms, flags, MB moved) -> the variant and the
# fields that say the intent.  Decode sizes take evict-first accesses and the plain kernels where
# the dtype pair has them; the N-way merge shares a decode row's states among groups of threads.
GOLDEN = [
    (("pair", "bfloat16", "bfloat16", 16, 32, 128, 2, 8, 132, "-", 1.5),
     dict(variant="rows_plain_flat", evict_first=1, vec=8, bx=16)),
    (("pair", "bfloat16", "bfloat16", 8192, 32, 128, 2, 8, 132, "-", 200),
     dict(variant="rows_plain_flat", evict_first=0, bx=16, by=64)),  # blocks of 1024 from 128 MB
    (("pair", "float16", "float8_e4m3", 16, 32, 128, 2, 8, 132, "-", 1), dict(variant="rows_plain_flat")),
    (("pair", "float32", "bfloat16", 16, 32, 128, 2, 4, 132, "-", 1), dict(variant="rows_plain_flat")),  # kPlainPairs
    (("pair", "float32", "float16", 16, 32, 128, 2, 4, 132, "-", 1), dict(variant="rows")),  # no plain kernel
    (("pair", "bfloat16", "bfloat16", 16, 32, 128, 2, 8, 132, "w", 1), dict(variant="rows_plain")),
    (("pair", "bfloat16", "bfloat16", 16, 32, 128, 2, 8, 132, "a", 1), dict(variant="rows")),
    (("pair", "bfloat16", "bfloat16", 16, 32, 128, 2, 8, 132, "k", 1), dict(variant="rows")),  # a sink
    (("pair", "bfloat16", "bfloat16", 512, 32, 128, 2, 8, 132, "t", 12), dict(variant="rows", tile_shift=3)),
    (("pair", "bfloat16", "bfloat16", 16, 32, 128, 2, 8, 132, "t", 1), dict(variant="rows_plain", tile_shift=-1)),
    (("inplace", "bfloat16", "bfloat16", 16, 32, 128, 2, 8, 132, "-", 1),
     dict(variant="inplace_plain_flat", evict_first=1, bx=16)),
    (("inplace", "bfloat16", "bfloat16", 2048, 16, 128, 2, 8, 132, "m", 24),
     dict(variant="inplace_plain_flat", vec=16, bx=8)),  # two accesses per thread: half the masked-out threads
    (("inplace", "float16", "float16", 16, 32, 40, 2, 8, 132, "g", 1), dict(variant="inplace_warp", bx=8)),
    (("inplace", "float32", "float32", 5, 2, 512, 2, 4, 132, "-", 1), dict(variant="inplace_block", bx=128)),
    (("inplace", "bfloat16", "bfloat16", 37, 3, 8192, 2, 8, 132, "-", 1), dict(variant="rows_lse_after", launches=2)),
    (("inplace", "bfloat16", "float32", 16, 32, 128, 2, 4, 132, "-", 1),
     dict(variant="rows_lse_after", launches=2)),  # an output of another dtype: no in-place kernel for it
    (("stack", "bfloat16", "bfloat16", 16, 32, 128, 3, 8, 132, "-", 1), dict(variant="rows", chunk=4)),
    (("stack", "bfloat16", "bfloat16", 4096, 32, 128, 12, 8, 132, "-", 900), dict(variant="rows", chunk=8)),
    (("stack", "bfloat16", "bfloat16", 16, 32, 128, 64, 8, 132, "-", 8), dict(variant="states", groups=8)),
    (("stack", "bfloat16", "bfloat16", 16, 32, 128, 256, 8, 132, "-", 32), dict(variant="states", groups=16)),
    (("stack", "bfloat16", "float8_e4m3", 16, 32, 128, 64, 8, 132, "q", 8), dict(variant="states", groups=8)),
    (("stack", "bfloat16", "bfloat16", 16, 32, 128, 64, 4, 132, "-", 8), dict(variant="rows")),  # 8-byte accesses
    (("stack", "bfloat16", "bfloat16", 16, 32, 128, 64, 8, 132, "f", 8), dict(variant="rows", index32=0)),
    (("range", "bfloat16", "bfloat16", 5, 32, 64, 200, 8, 132, "-", 1), dict(variant="states")),
    (("share", "bfloat16", "bfloat16", 2, 32, 128, 64, 8, 132, "-", 1), dict(variant="share", chunk=8)),
    (("share", "bfloat16", "bfloat16", 2, 32, 128, 3, 8, 132, "-", 1), dict(variant="share", chunk=4)),
]


def test_a_batch_invariant_plan_is_the_same_for_any_number_of_rows(planned):
    """ATTNMERGE_BATCH_INVARIANT: the N-way, variable-length and share merges keep the row kernel
    and one chunk of states whatever the rows and the GPU (a row's bits then follow from the row)."""
    seen = {}
    for call, plan in planned:
        op, in_dtype, out_dtype, tokens, heads, head_size, states, vec, sms, flags = call
        if "b" not in flags or plan["launches"] == 0:
            continue
        assert plan["variant"] != "states", (call, plan)
        key = (op, in_dtype, out_dtype, head_size, states if op != "range" else None, vec)
        seen.setdefault(key, set()).add((plan["variant"], plan["chunk"]))
    assert seen
    for key, choices in seen.items():
        assert len(choices) == 1, (key, choices)


def test_the_golden_choices(probe):
    calls = [call for call, _ in GOLDEN]
    for (call, want), plan in zip(GOLDEN, probe(calls)):
        assert {k: plan[k] for k in want} == want, (call, plan)
