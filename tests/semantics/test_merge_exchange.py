"""attnmerge_merge_exchange: what each rank of an exchange merges, against the oracle, on every device.

Every rank p of a context-parallel group holds a partial state O_p [tokens, heads, head_size],
LSE_p [tokens, heads]; rank r's exchange reads its slice (a range of heads, or of tokens) of every
rank's state where it lies and writes their merge (the N-way merge's formula and semantics, the
states in rank order, each head's sink where given) into its own output.  Here the ranks are
simulated in one process (tests/exchange_ranks.py): threads on the host, streams on one GPU.  On
the host a rank's rows are bit for bit those of attnmerge_merge_states over the gathered states.
The protocol (epochs, reuse, timeouts, CUDA graphs): test_exchange_protocol.py; bad arguments:
tests/errors/test_exchange_inputs.py; the GPU kernel's logic on the CPU:
test_exchange_kernel_emulated.py.
"""

from __future__ import annotations

import numpy as np
import pytest

import c_abi
import devices
from devices import pointer
from exchange_ranks import Ranks, descriptor
from oracle import (DTYPES, assert_fp8_close, assert_lse_close, assert_merge_matches, fp8_dtype, nan_array, random_lse,
                    random_o, reference_merge_states, sink_state, stats_lse, valid_lse)


def states(rng, world, tokens, heads, head_size, dtype="float32"):
    return ([random_o(rng, (tokens, heads, head_size), dtype) for _ in range(world)],
            [random_lse(rng, (tokens, heads)) for _ in range(world)])


def even_slices(size, world):
    """(begin, extent) of each rank's slice of `size`: as even as it goes, the first ranks one more."""
    extents = [size // world + (r < size % world) for r in range(world)]
    return [(sum(extents[:r]), extents[r]) for r in range(world)]


def run(dev, o, lse, slice, *, out_dtype=None, opts=None, slices=None, with_lse=True, **ranks_kw):
    """Every rank's exchange into NaN-poisoned outputs: [(begin, extent, out, out_lse)] read back."""
    world = len(o)
    tokens, heads, head_size = o[0].shape
    size = heads if slice == c_abi.SLICE_HEADS else tokens
    slices = even_slices(size, world) if slices is None else slices
    shape = (lambda n: (tokens, n)) if slice == c_abi.SLICE_HEADS else (lambda n: (n, heads))
    outs = [dev.nan((*shape(n), head_size), out_dtype or o[0].dtype) for _, n in slices]
    out_lses = [dev.nan(shape(n)) if with_lse else None for _, n in slices]
    ranks = Ranks(dev, o, lse, **ranks_kw)
    result = ranks.step(outs, out_lses, slice, [b for b, _ in slices], opts=opts)
    for r in range(world):
        assert result[r][:2] == (c_abi.SUCCESS, c_abi.SUCCESS), (r, result[r])
        assert ranks.status(r)[0] == c_abi.SUCCESS
    return [(b, n, dev.get(outs[r]), dev.get(out_lses[r])) for r, (b, n) in enumerate(slices)]


def sliced(x, slice, begin, extent):
    return x[:, begin:begin + extent] if slice == c_abi.SLICE_HEADS else x[begin:begin + extent]


def reference(o, lse, slice, begin, extent, base="e", sink=None):
    """The oracle over every rank's rows of one slice (sink [heads of the slice])."""
    os = [sliced(x, slice, begin, extent) for x in o]
    ls = [sliced(x, slice, begin, extent) for x in lse]
    if sink is not None:
        so, sl = sink_state(sink, *os[0].shape[::2])
        os, ls = os + [so], ls + [sl]
    return reference_merge_states(os, ls, base=base)


def gathered(o, lse, slice, begin, extent, out_dtype=None, opts=None, sums=None, valid=None):
    """attnmerge_merge_states (the C ABI, on the host) over the states gathered, [S, tokens, heads, ...]
    passed as its permutation, with the ranks' sums gathered alike (options.sum_a) and valid [tokens of
    the slice, S] where given: what the exchange's rows are bit for bit on the host."""
    go = np.stack([sliced(x, slice, begin, extent) for x in o])
    gl = np.stack([sliced(x, slice, begin, extent) for x in lse])
    out = nan_array(go.shape[1:], out_dtype or go.dtype)
    out_lse = nan_array(gl.shape[1:])
    t = c_abi.tensor_from
    if sums is not None or valid is not None:
        gs = None if sums is None else np.stack([sliced(x, slice, begin, extent) for x in sums])
        opts.sum_a = None if gs is None else c_abi.ctypes.pointer(t(gs.transpose(1, 0, 2)))
        opts.valid = None if valid is None else c_abi.ctypes.pointer(t(valid))
        opts._kept = (gs, valid)
    status = c_abi.merge_states(t(out), t(out_lse), t(go.transpose(1, 0, 2, 3)), t(gl.transpose(1, 0, 2)), opts)
    assert status == c_abi.SUCCESS, c_abi.last_error()
    return out, out_lse


def assert_bits_equal(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert np.ascontiguousarray(a).view(np.uint8).tobytes() == np.ascontiguousarray(b).view(np.uint8).tobytes()


# --------------------------------------------------------------------------------------------------
# the formula, slice by slice


# Either way a rank's buffer may be written again (with _ALTERNATE no merge waits for another:
# what compute-sanitizer, which runs one kernel at a time, can check).
REUSES = pytest.mark.parametrize("reuse", (c_abi.WAIT_READERS, c_abi.ALTERNATE), ids=("wait_readers", "alternate"))


@REUSES
@pytest.mark.parametrize("slice", (c_abi.SLICE_HEADS, c_abi.SLICE_TOKENS), ids=("heads", "tokens"))
@pytest.mark.parametrize("world", (1, 2, 3, 4))
def test_every_rank_merges_every_ranks_rows_of_its_slice(rng, device, world, slice, reuse):
    o, lse = states(rng, world, 9, 8, 64)
    for begin, extent, out, out_lse in run(device, o, lse, slice, reuse=reuse):
        assert_merge_matches(out, out_lse, reference(o, lse, slice, begin, extent), "float32")


@REUSES
@pytest.mark.parametrize("dtype", DTYPES)
def test_dtypes_at_decode_shapes(rng, device, dtype, reuse):
    """Decode context parallelism's shapes: a few tokens, 32 heads of 128, 4 ranks, each its 8 heads."""
    o, lse = states(rng, 4, 8, 32, 128, dtype)
    for begin, extent, out, out_lse in run(device, o, lse, c_abi.SLICE_HEADS, reuse=reuse):
        assert_merge_matches(out, out_lse, reference(o, lse, c_abi.SLICE_HEADS, begin, extent), dtype)


@pytest.mark.parametrize("world", (9, 16))
def test_more_ranks_than_a_chunk_of_loads(rng, device, world):
    """Past 8 ranks a row's states come a chunk at a time on the GPU, against a running max."""
    o, lse = states(rng, world, 4, world, 32, "bfloat16")
    lse[world - 1][:] += 40.0  # the last chunk raises the max: what came before is rescaled
    for begin, extent, out, out_lse in run(device, o, lse, c_abi.SLICE_HEADS):
        assert_merge_matches(out, out_lse, reference(o, lse, c_abi.SLICE_HEADS, begin, extent), "bfloat16")


@pytest.mark.parametrize("head_size", (1, 12, 72, 512))
def test_head_sizes_and_unaligned_rows(rng, device, head_size):
    """Head sizes that 16-byte accesses do not divide take the one-element kernel."""
    o, lse = states(rng, 3, 5, 3, head_size, "bfloat16")
    for begin, extent, out, out_lse in run(device, o, lse, c_abi.SLICE_TOKENS):
        assert_merge_matches(out, out_lse, reference(o, lse, c_abi.SLICE_TOKENS, begin, extent), "bfloat16")


def test_uneven_slices_and_a_rank_with_none(rng, device):
    """5 heads over 3 ranks, one rank's slice empty: it merges nothing, and the exchange still completes
    (its peers wait for it to read their states)."""
    o, lse = states(rng, 3, 6, 5, 32)
    slices = [(0, 3), (3, 0), (3, 2)]
    for begin, extent, out, out_lse in run(device, o, lse, c_abi.SLICE_HEADS, slices=slices):
        assert out.shape == (6, extent, 32)
        if extent:
            assert_merge_matches(out, out_lse, reference(o, lse, c_abi.SLICE_HEADS, begin, extent), "float32")


def test_strided_states_and_outputs(rng, device):
    """Every rank's state laid out alike but not dense (heads padded, the LSE [heads, tokens] in memory),
    read through the strides; an output without its LSE."""
    world, tokens, heads, d = 3, 7, 4, 40
    o = [random_o(rng, (tokens, heads + 2, d + 8))[:, 1:heads + 1, :d] for _ in range(world)]
    lse = [random_lse(rng, (heads, tokens)).T for _ in range(world)]
    result = run(device, o, lse, c_abi.SLICE_TOKENS, with_lse=False)
    for begin, extent, out, out_lse in result:
        assert out_lse is None
        assert_merge_matches(out, None, reference(o, lse, c_abi.SLICE_TOKENS, begin, extent), "float32")


# --------------------------------------------------------------------------------------------------
# the merge's semantics and options


def test_empty_parts_nan_and_all_empty_rows(rng, device):
    """An empty part (LSE -inf, or +inf as FlashAttention-2 writes it) is not read (NaN in its O
    stays out); a NaN LSE makes its row NaN; a row of only empty parts is O = 0, LSE = -inf."""
    o, lse = states(rng, 4, 6, 4, 16)
    o[1][:] = np.nan
    lse[1][:] = -np.inf
    lse[2][0] = np.inf
    o[2][0] = np.nan
    lse[0][1, 2] = np.nan
    for r in range(4):
        lse[r][3] = -np.inf if r % 2 else np.inf
    for begin, extent, out, out_lse in run(device, o, lse, c_abi.SLICE_HEADS):
        assert_merge_matches(out, out_lse, reference(o, lse, c_abi.SLICE_HEADS, begin, extent), "float32")
        assert (out[3] == 0).all() and (out_lse[3] == -np.inf).all()
        assert not np.isnan(out[0]).any()
        if begin <= 2 < begin + extent:
            assert np.isnan(out[1, 2 - begin]).all() and np.isnan(out_lse[1, 2 - begin])


@pytest.mark.parametrize("base, out_base", (("e", None), (2, None), ("e", 2), (2, "e")))
def test_lse_bases(rng, device, base, out_base):
    o, lse = states(rng, 3, 5, 6, 32)
    flags = (c_abi.LSE_BASE2 if base == 2 else 0) | {None: 0, 2: c_abi.OUT_LSE_BASE2, "e": c_abi.OUT_LSE_BASE_E}[out_base]
    for begin, extent, out, out_lse in run(device, o, lse, c_abi.SLICE_HEADS, opts=c_abi.options(flags)):
        ref_o, ref_lse = reference(o, lse, c_abi.SLICE_HEADS, begin, extent, base=base)
        if out_base is not None and out_base != base:
            ref_lse = ref_lse * (np.log2(np.e) if out_base == 2 else np.log(2.0))
        assert_merge_matches(out, out_lse, (ref_o, ref_lse), "float32")


def test_a_sink_per_head_of_the_slice(rng, device):
    """options.sink [heads of out]: one more state of each row, output 0, in the LSE's base; each
    rank passes its own heads' sinks."""
    o, lse = states(rng, 2, 4, 6, 32, "float16")
    sink = random_lse(rng, (6,))
    slices = even_slices(6, 2)
    sinks = [device.put(sink[b:b + n]) for b, n in slices]
    opts = [c_abi.options(sink=descriptor(s, device_id(device))) for s in sinks]
    for begin, extent, out, out_lse in run(device, o, lse, c_abi.SLICE_HEADS, opts=opts, slices=slices):
        ref = reference(o, lse, c_abi.SLICE_HEADS, begin, extent, sink=sink[begin:begin + extent])
        assert_merge_matches(out, out_lse, ref, "float16")


@pytest.mark.parametrize("dtype, out_dtype", (("bfloat16", "float32"), ("float32", "bfloat16"), ("float16", "float16"),
                                              ("float32", "float16")))
def test_output_dtypes(rng, device, dtype, out_dtype):
    o, lse = states(rng, 3, 4, 6, 64, dtype)
    for begin, extent, out, out_lse in run(device, o, lse, c_abi.SLICE_HEADS, out_dtype=out_dtype):
        assert out.dtype.name == out_dtype
        assert_merge_matches(out, out_lse, reference(o, lse, c_abi.SLICE_HEADS, begin, extent), out_dtype)


@pytest.mark.parametrize("in_memory", (False, True), ids=("value", "pointer"))
def test_fp8_outputs_with_a_static_scale(rng, device, in_memory):
    """FP8 E4M3 outputs store value / output_scale, the scale a number or a float32 in the device's memory."""
    o, lse = states(rng, 2, 4, 4, 32, "bfloat16")
    dscale = device.put(np.array([0.25], np.float32))
    opts = c_abi.options(output_scale_ptr=pointer(dscale)) if in_memory else c_abi.options(output_scale=0.25)
    for begin, extent, out, out_lse in run(device, o, lse, c_abi.SLICE_HEADS, out_dtype=fp8_dtype(), opts=opts):
        ref_o, ref_lse = reference(o, lse, c_abi.SLICE_HEADS, begin, extent)
        assert_fp8_close(out, ref_o, scale=0.25)
        assert_lse_close(out_lse, ref_lse)


# --------------------------------------------------------------------------------------------------
# states as the engines leave them: softmax statistics, ranks with no keys


def softmax_states(rng, world, tokens, heads, head_size, dtype="float32"):
    """Every rank's O, running max and softmax sum (a few sums 0: empty parts, their max NaN)."""
    o, m = states(rng, world, tokens, heads, head_size, dtype)
    sums = [rng.uniform(0.25, 4.0, (tokens, heads)).astype(np.float32) for _ in range(world)]
    sums[0][1, :2] = 0.0
    m[0][1, :2] = np.nan  # the max of no scores
    return o, m, sums


def ranks_with_no_keys(rng, o, lse, tokens, world, kind):
    """valid [tokens, world] as `kind` (a uint8 mask, bool, or int32 / int64 KV lengths), some
    entries 0 (one token's every one), and the states those name poisoned with NaN."""
    held = rng.random((tokens, world)) < 0.7
    held[3] = False
    held[0, 0] = True
    lengths = np.where(held, rng.integers(1, 50, (tokens, world)), 0)
    valid = lengths.astype(kind) if kind != np.bool_ else held
    for p in range(world):
        o[p][~held[:, p]] = np.nan
        lse[p][~held[:, p]] = np.nan
    return valid


@pytest.mark.parametrize("slice", (c_abi.SLICE_HEADS, c_abi.SLICE_TOKENS), ids=("heads", "tokens"))
@pytest.mark.parametrize("world", (3, 10))
def test_softmax_statistics_of_every_rank(rng, device, world, slice):
    """exchange.sum: every rank's lse holds its running maxima, sum[p] its sums (laid out as the LSE):
    the state's LSE is max + log(sum), a sum of 0 an empty part whatever the max holds."""
    o, m, sums = softmax_states(rng, world, 10, 10, 32, "bfloat16")
    lse = [stats_lse(m[p], sums[p]) for p in range(world)]
    for begin, extent, out, out_lse in run(device, o, m, slice, sums=sums):
        assert_merge_matches(out, out_lse, reference(o, lse, slice, begin, extent), "bfloat16")


@pytest.mark.parametrize("kind", (np.uint8, np.bool_, np.int32, np.int64), ids=("mask", "bool", "int32", "int64"))
@pytest.mark.parametrize("slice", (c_abi.SLICE_HEADS, c_abi.SLICE_TOKENS), ids=("heads", "tokens"))
def test_ranks_with_no_keys_for_a_token(rng, device, slice, kind):
    """options.valid [tokens of out, world]: a rank whose entry is 0 weighs nothing, whatever its O
    and LSE hold; a token no rank holds keys for gets O = 0, LSE = -inf.  Each rank passes the
    entries of its own tokens (by heads: every token's)."""
    world, tokens, heads = 4, 8, 8
    o, lse = states(rng, world, tokens, heads, 32)
    valid = ranks_with_no_keys(rng, o, lse, tokens, world, kind)
    slices = even_slices(heads if slice == c_abi.SLICE_HEADS else tokens, world)
    mine = [valid if slice == c_abi.SLICE_HEADS else valid[b:b + n] for b, n in slices]
    puts = [device.put(np.ascontiguousarray(v)) for v in mine]
    opts = [c_abi.options(valid=descriptor(v, device_id(device))) for v in puts]
    want = [valid_lse(lse[p], valid[:, p, None]) for p in range(world)]
    for begin, extent, out, out_lse in run(device, o, lse, slice, opts=opts, slices=slices):
        assert_merge_matches(out, out_lse, reference(o, want, slice, begin, extent), "float32")
        if slice == c_abi.SLICE_HEADS:
            assert (out[3] == 0).all() and (out_lse[3] == -np.inf).all()


def test_statistics_valid_ranks_and_a_sink_together(rng, device):
    o, m, sums = softmax_states(rng, 3, 6, 6, 32, "float16")
    valid = ranks_with_no_keys(rng, o, m, 6, 3, np.int32)
    sink = random_lse(rng, (6,))
    slices = even_slices(6, 3)
    puts = [(device.put(sink[b:b + n]), device.put(valid)) for b, n in slices]
    opts = [c_abi.options(sink=descriptor(s, device_id(device)), valid=descriptor(v, device_id(device)))
            for s, v in puts]
    lse = [valid_lse(stats_lse(m[p], sums[p]), valid[:, p, None]) for p in range(3)]
    for begin, extent, out, out_lse in run(device, o, m, c_abi.SLICE_HEADS, opts=opts, slices=slices, sums=sums):
        ref = reference(o, lse, c_abi.SLICE_HEADS, begin, extent, sink=sink[begin:begin + extent])
        assert_merge_matches(out, out_lse, ref, "float16")


# --------------------------------------------------------------------------------------------------
# on the host: merge_states' rows, bit for bit


HOST_CASES = {
    "bf16 by heads": ("bfloat16", None, c_abi.SLICE_HEADS, 0, {}),
    "f32 by tokens": ("float32", None, c_abi.SLICE_TOKENS, 0, {}),
    "f32 into bf16, base 2 into base e": ("float32", "bfloat16", c_abi.SLICE_HEADS,
                                          c_abi.LSE_BASE2 | c_abi.OUT_LSE_BASE_E, {}),
    "f16 into fp8, scaled": ("float16", "float8_e4m3fn", c_abi.SLICE_TOKENS, 0, dict(output_scale=0.5)),
    "bf16 with a sink": ("bfloat16", None, c_abi.SLICE_HEADS, 0, dict(sink=True)),  # by heads: each slice its sinks
    "bf16 statistics by heads": ("bfloat16", None, c_abi.SLICE_HEADS, 0, dict(sums=True)),
    "f32 statistics, base 2, by tokens": ("float32", None, c_abi.SLICE_TOKENS, c_abi.LSE_BASE2, dict(sums=True)),
    "f16 valid by tokens": ("float16", None, c_abi.SLICE_TOKENS, 0, dict(valid=np.int32)),
    "bf16 statistics, valid and a sink": ("bfloat16", None, c_abi.SLICE_HEADS, 0,
                                          dict(sums=True, valid=np.uint8, sink=True)),
}


@pytest.mark.parametrize("name", list(HOST_CASES))
@pytest.mark.parametrize("world", (2, 5))
def test_on_the_host_bit_for_bit_merge_states_over_the_gathered_states(rng, name, world):
    dtype, out_dtype, slice, flags, extra = HOST_CASES[name]
    out_dtype = fp8_dtype() if out_dtype == "float8_e4m3fn" else out_dtype
    o, lse = states(rng, world, 11, 10, 48, dtype)
    lse[0][2, 3] = -np.inf
    lse[1][4] = np.inf
    o[1][4] = np.nan
    sink = random_lse(rng, (10,)) if extra.get("sink") else None
    sums = None
    if extra.get("sums"):
        sums = [rng.uniform(0.25, 4.0, (11, 10)).astype(np.float32) for _ in range(world)]
        sums[1][2] = 0.0  # empty whatever the max holds
        lse[1][2] = np.nan
    valid = None if "valid" not in extra else ranks_with_no_keys(rng, o, lse, 11, world, extra["valid"])
    slices = even_slices(10 if slice == c_abi.SLICE_HEADS else 11, world)
    mine = [None if valid is None else valid if slice == c_abi.SLICE_HEADS else valid[b:b + n] for b, n in slices]
    opts = [c_abi.options(flags, output_scale=extra.get("output_scale", 0.0),
                          sink=None if sink is None else c_abi.tensor_from(sink[b:b + n]),
                          valid=None if v is None else c_abi.tensor_from(v)) for (b, n), v in zip(slices, mine)]
    result = run(devices.get("cpu"), o, lse, slice, out_dtype=out_dtype, opts=opts, slices=slices, sums=sums)
    for (begin, extent, out, out_lse), rank_opts, v in zip(result, opts, mine):
        want_o, want_lse = gathered(o, lse, slice, begin, extent, out_dtype, rank_opts, sums, v)
        assert_bits_equal(out, want_o)
        assert_bits_equal(out_lse, want_lse)


def device_id(device):
    return device.torch.cuda.current_device() if getattr(device, "on_gpu", False) else c_abi.HOST


@pytest.mark.parametrize("device", devices.CUDA_ONLY, indirect=True)
@pytest.mark.parametrize("head_size, vec", ((128, 8), (12, 1)))
def test_the_launch_record_names_the_exchanges_kernel(rng, device, head_size, vec):
    """One launch of the exchange's kernel: 16-byte accesses where every rank's rows allow them."""
    device.gpu_only()
    o, lse = states(rng, 2, 3, 4, head_size, "bfloat16")
    ranks = Ranks(device, o, lse, reuse=c_abi.ALTERNATE)
    out, out_lse = device.nan((3, 2, head_size), "bfloat16"), device.nan((3, 2))
    assert ranks.publish(0) == ranks.publish(1) == c_abi.SUCCESS
    device.synchronize()
    assert ranks.merge(0, out, out_lse, c_abi.SLICE_HEADS, 0) == c_abi.SUCCESS
    info = c_abi.last_launch()
    assert (info.kernel, info.launches, info.vec, info.index_bits) == (c_abi.KERNEL_EXCHANGE, 1, vec, 64)
    device.synchronize()
    assert_merge_matches(device.get(out), device.get(out_lse), reference(o, lse, c_abi.SLICE_HEADS, 0, 2), "bfloat16")
