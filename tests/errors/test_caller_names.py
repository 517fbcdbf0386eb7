"""The caller's names of an op's arguments (issue 15, item 6).

A caller may tell the C ABI what it calls each argument (attnmerge_options.arg_names); every message of the call then names the argument as the caller
does, worded by the library itself, and with no names every message is the library's own.  The
compat layers hand their names down this way (the binding's `names`), so a vLLM or FlashInfer
caller reads its own argument names; no message is rewritten after the fact.

Each case below gives the message without names and with them, in full: the names replace the
arguments' names and nothing else.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import c_abi
from attnmerge import _C, raw
from attnmerge._call import Options
from attnmerge.compat import flashinfer, vllm

T, H, D = 5, 3, 8  # tokens, heads, head_size of the C ABI cases

VLLM = {"out": "output", "out_lse": "output_lse", "o_a": "prefix_output", "lse_a": "prefix_lse",
        "o_b": "suffix_output", "lse_b": "suffix_lse", "a_tokens": "prefill_tokens_with_context"}


def rand(shape, dtype=np.float32):
    return (np.random.default_rng(sum(shape)).random(shape, dtype=np.float32) + 0.5).astype(dtype)


def nan(shape, dtype=np.float32):
    return np.full(shape, np.nan, dtype)


# ---- the C ABI ----------------------------------------------------------------------------------


def pair_args(**replace):
    """The descriptors of a valid two-way merge over host arrays, and the arrays (kept alive with
    them), some replaced: by a NumPy array, (an array, tensor_from's keywords), a descriptor of
    memory kept elsewhere, or None."""
    arrays = dict(out=nan((T, H, D)), out_lse=nan((T, H)), o_a=rand((T, H, D)), lse_a=rand((T, H)),
                  o_b=rand((T, H, D)), lse_b=rand((T, H)))
    arrays.update(replace)
    descs = {}
    for k, v in arrays.items():
        if isinstance(v, tuple):
            arrays[k], kw = v
            descs[k] = c_abi.tensor_from(arrays[k], **kw)
        else:
            descs[k] = v if v is None or isinstance(v, c_abi.Tensor) else c_abi.tensor_from(v)
    return descs, arrays


def merge(opts, **replace):
    """(status, message, the output arrays) of a two-way merge with `replace`d arguments."""
    descs, arrays = pair_args(**replace)
    status = c_abi.merge(*descs.values(), opts)
    return status, c_abi.last_error(), [arrays[k] for k in ("out", "out_lse") if isinstance(arrays[k], np.ndarray)]


def shifted(base, offset, shape):
    """A view of `base`'s memory `offset` elements in, of `shape` (contiguous), as a descriptor."""
    strides = np.cumprod((1,) + shape[:0:-1])[::-1].tolist()
    return c_abi.tensor(base.ctypes.data + offset * base.itemsize, shape, strides, c_abi.FLOAT32)


BUFFER = nan((2 * T, H, D))  # out overlapping o_a: both views of it, one token apart


def _case(id, names, build, plain, named):
    return pytest.param(names, build, plain, named, id=id)


# (names, build: opts -> (status, message, outputs), the message without names, with them)
C_CASES = [
    _case("dtype", VLLM,
          lambda o: merge(o, o_a=(rand((T, H, D)), dict(dtype=c_abi.INT32))),
          "o_a: expected dtype float32, float16, bfloat16 or float64, got int32",
          "prefix_output: expected dtype float32, float16, bfloat16 or float64, got int32"),
    _case("dtype-of-another", VLLM, lambda o: merge(o, o_b=rand((T, H, D), np.float16)),
          "o_b: expected the dtype of o_a (float32), got float16",
          "suffix_output: expected the dtype of prefix_output (float32), got float16"),
    _case("shape", VLLM, lambda o: merge(o, lse_b=rand((T, H + 1))),
          "lse_b: expected shape [5, 3] (the number of heads of o_a, lse_a and o_b), got [5, 4]",
          "suffix_lse: expected shape [5, 3] (the number of heads of prefix_output, prefix_lse and suffix_output), "
          "got [5, 4]"),
    _case("optional-argument", VLLM, lambda o: merge(o, out_lse=nan((H, T))),
          "out_lse: expected shape [5, 3] (the sizes of o_b, shape [5, 3, 8]), got [3, 5]",
          "output_lse: expected shape [5, 3] (the sizes of suffix_output, shape [5, 3, 8]), got [3, 5]"),
    _case("null-tensor", VLLM, lambda o: merge(o, lse_a=None),
          "lse_a: expected an array, got NULL", "prefix_lse: expected an array, got NULL"),
    _case("head-size-stride", VLLM, lambda o: merge(o, o_a=rand((T, H, 2 * D))[:, :, ::2]),
          "o_a: expected a unit stride on the head_size axis, got stride 2",
          "prefix_output: expected a unit stride on the head_size axis, got stride 2"),
    _case("head-size-equation", VLLM, lambda o: merge(o, o_a=rand((T, H, 0)), o_b=rand((T, H, 0)), out=nan((T, H, 0))),
          "o_b: expected a head_size from 1 to 16776960, got 0",
          "suffix_output: expected a head_size from 1 to 16776960, got 0"),
    _case("output-overlaps-itself", VLLM,
          lambda o: merge(o, out=c_abi.tensor(BUFFER.ctypes.data, (T, H, D), (0, D, 1), c_abi.FLOAT32)),
          "out: expected an output whose elements do not overlap, got stride 0 on an axis of size 5 (shape [5, 3, 8])",
          "output: expected an output whose elements do not overlap, got stride 0 on an axis of size 5 "
          "(shape [5, 3, 8])"),
    _case("aliasing", VLLM,
          lambda o: merge(o, out=shifted(BUFFER, H * D, (T, H, D)), o_a=shifted(BUFFER, 0, (T, H, D))),
          "out: expected memory disjoint from o_a (or the very same view), got overlapping ranges",
          "output: expected memory disjoint from prefix_output (or the very same view), got overlapping ranges"),
    _case("read-only-output", VLLM, lambda o: merge(o, out=(nan((T, H, D)), dict(flags=c_abi.READ_ONLY))),
          "out: expected a writable tensor, got a read-only one",
          "output: expected a writable tensor, got a read-only one"),
    _case("device-mismatch", VLLM, lambda o: merge(o, o_b=(rand((T, H, D)), dict(device=0))),
          "o_b: expected the device of out (-1), got device 0 (-1 is the host)",
          "suffix_output: expected the device of output (-1), got device 0 (-1 is the host)"),
    _case("a_tokens-option", VLLM, lambda o: merge(_a_tokens(o, T + 1)),
          "a_tokens: expected 0 to the 5 tokens of o_b, got 6",
          "prefill_tokens_with_context: expected 0 to the 5 tokens of suffix_output, got 6"),
    _case("a_tokens-shape", VLLM, lambda o: merge(_a_tokens(o, 4), o_a=rand((2, H, D)), lse_a=rand((2, H))),
          "o_a: expected at least 4 tokens (a_tokens), 3 heads and the head_size of o_b, got shape [2, 3, 8]",
          "prefix_output: expected at least 4 tokens (prefill_tokens_with_context), 3 heads and the head_size of "
          "suffix_output, got shape [2, 3, 8]"),
    _case("output_scale-option", {"output_scale": "scale"}, lambda o: merge(_scale(o, 2.0)),
          "output_scale: expected none (or 1) for a float32 output, got 2",
          "scale: expected none (or 1) for a float32 output, got 2"),
]


def _a_tokens(opts, a_tokens):
    opts.flags |= c_abi.A_TOKENS
    opts.a_tokens = a_tokens
    return opts


def _scale(opts, scale):
    opts.output_scale = scale
    return opts


def _varlen(opts, indptr):
    o, lse = rand((10, H, D)), rand((10, H))
    out, out_lse = nan((len(indptr) - 1, H, D)), nan((len(indptr) - 1, H))
    t = c_abi.tensor_from
    status = c_abi.merge_varlen(t(out), t(out_lse), t(o), t(lse), t(np.array(indptr, np.int32)), opts)
    return status, c_abi.last_error(), [out, out_lse]


def _inplace(opts, mask):
    o, lse = nan((T, H, D)), nan((T, H))
    t = c_abi.tensor_from
    status = c_abi.merge_inplace(t(o), t(lse), t(rand((T, H, D))), t(rand((T, H))), t(mask), opts)
    return status, c_abi.last_error(), [o, lse]


def _backward(opts):
    f32, f16 = rand((T, H, D)), rand((T, H, D), np.float16)
    grads = dict(grad_o_a=nan((T, H, D)), grad_lse_a=nan((T, H)), grad_o_b=nan((T, H, D)), grad_lse_b=nan((T, H)))
    t = c_abi.tensor_from
    status = c_abi.merge_backward(*map(t, grads.values()), t(f16), None, t(f32), t(rand((T, H))), t(f32),
                                  t(rand((T, H))), t(f32), t(rand((T, H))), opts)
    return status, c_abi.last_error(), list(grads.values())


C_CASES += [
    _case("indptr-names-o-too", {"o": "v", "indptr": "offsets"}, lambda o: _varlen(o, [0, 3, 2, 10]),
          "indptr: expected non-decreasing offsets from 0 or more up to the 10 states of o, got indptr[2] = 2 "
          "(decreasing)",
          "offsets: expected non-decreasing offsets from 0 or more up to the 10 states of v, got offsets[2] = 2 "
          "(decreasing)"),
    _case("inplace-mask", {"mask": "keep", "o_other": "v_other"}, lambda o: _inplace(o, np.ones(T, np.float32)),
          "mask: expected dtype uint8 or bool, got float32", "keep: expected dtype uint8 or bool, got float32"),
    _case("backward", {"grad_out": "dy", "out": "y"}, _backward,
          "grad_out: expected the dtype of out (float32), got float16",
          "dy: expected the dtype of y (float32), got float16"),
]


@pytest.mark.parametrize("names,build,plain,named", C_CASES)
def test_every_kind_of_message_names_the_argument_as_the_caller_does(names, build, plain, named):
    for opts, expected in ((c_abi.options(), plain), (c_abi.options(arg_names=names), named)):
        status, message, outputs = build(opts)
        assert status in (c_abi.ERROR_VALUE, c_abi.ERROR_TYPE) and message == expected
        assert all(np.isnan(x).all() for x in outputs), "written before the error"


def test_a_gpu_call_names_its_first_tensor_as_the_caller_does():
    """Every tensor said to be on device 0 (host memory in truth): without a GPU the call has no
    device, with one the pointer check refuses host memory; either way the caller's name."""
    arrays = pair_args()[1]
    status = c_abi.merge(*(c_abi.tensor_from(v, device=0) for v in arrays.values()), c_abi.options(arg_names=VLLM))
    message = c_abi.last_error()
    assert status in (c_abi.ERROR_NO_DEVICE, c_abi.ERROR_VALUE)
    assert message.startswith("output: "), message


def test_names_the_op_does_not_have_are_ignored_and_no_other_word_changes():
    """Only arguments are looked up: an unknown argument, another op's (indptr), and words of the
    message itself ("expected", "shape", "sizes") leave it as the library words it."""
    names = {"o_A": "x", "indptr": "offsets", "expected": "wanted", "shape": "form", "sizes": "lengths"}
    _, plain, _ = merge(c_abi.options(), lse_b=rand((T, H + 1)))
    status, message, _ = merge(c_abi.options(arg_names=names), lse_b=rand((T, H + 1)))
    assert status == c_abi.ERROR_VALUE and message == plain


def test_a_message_that_names_no_argument_is_unchanged():
    names = dict(VLLM, options="opts", flags="f")
    status, message, _ = merge(c_abi.options(flags=1 << 20, arg_names=names))
    assert status == c_abi.ERROR_VALUE
    assert message == "options.flags: expected flags within 0x3fff for this op, got 0x100000"


def test_the_first_entry_for_an_argument_is_the_one_used():
    status, message, _ = merge(c_abi.options(arg_names=[("o_b", "first"), ("o_b", "second")]),
                               o_b=rand((T, H, D), np.float16))
    assert status == c_abi.ERROR_TYPE and message == "first: expected the dtype of o_a (float32), got float16"


def test_names_change_no_result():
    results = []
    for opts in (c_abi.options(), c_abi.options(arg_names=VLLM)):
        status, message, outputs = merge(opts)
        assert status == c_abi.SUCCESS and message == "" and np.isfinite(outputs[0]).all()
        results.append(outputs)
    for named, plain in zip(*results):
        np.testing.assert_array_equal(named, plain)


def test_an_empty_table_may_be_null():
    opts = c_abi.options(arg_names=[])
    opts.arg_names = None
    assert merge(opts)[0] == c_abi.SUCCESS


def _table(entries, count=None, null_table=False):
    opts = c_abi.options(arg_names=entries)
    if count is not None:
        opts.num_arg_names = count
    if null_table:
        opts.arg_names = None
    return opts


@pytest.mark.parametrize("opts,message", [
    pytest.param(_table([], count=-1), "options.num_arg_names: expected a count >= 0, got -1", id="negative-count"),
    pytest.param(_table([], count=2, null_table=True), "options.arg_names: expected 2 entries, got NULL",
                 id="null-table"),
    pytest.param(_table([("o_a", "prefix_output"), (None, "x")]),
                 "options.arg_names[1].arg: expected a non-empty string, got NULL", id="null-arg"),
    pytest.param(_table([("o_a", None)]), "options.arg_names[0].name: expected a non-empty string, got NULL",
                 id="null-name"),
    pytest.param(_table([("o_a", "")]), 'options.arg_names[0].name: expected a non-empty string, got ""',
                 id="empty-name"),
    pytest.param(_table([("", "x")]), 'options.arg_names[0].arg: expected a non-empty string, got ""', id="empty-arg"),
])
def test_a_malformed_table_is_refused_before_any_other_check(opts, message):
    """Before the tensors: here lse_a is NULL too, and the table is what the message is about."""
    status, got, outputs = merge(opts, lse_a=None)
    assert status == c_abi.ERROR_VALUE and got == message
    assert all(np.isnan(x).all() for x in outputs)


# ---- struct_size: the layouts the library reads ------------------------------------------------

NOW = ctypes.sizeof(c_abi.Options)


def test_the_baseline_layouts_size_is_the_headers():
    """0.2.0's attnmerge_options, the baseline: 120 bytes on 64-bit platforms (the ctypes binding's
    layout, which must be the header's)."""
    if ctypes.sizeof(ctypes.c_void_p) == 8:
        assert NOW == 120


@pytest.mark.parametrize("struct_size", [0, NOW])
def test_names_are_read_with_0_or_the_baseline_size(struct_size):
    """0 names the baseline layout: zero-initialized options with names set read them."""
    opts = c_abi.options(arg_names=VLLM)
    opts.struct_size = struct_size
    status, message, _ = merge(opts, o_b=rand((T, H, D), np.float16))
    assert status == c_abi.ERROR_TYPE and message.startswith("suffix_output: ")


# The sizes of layouts that existed only between commits of 0.2.0 (without arg_names, without sink,
# without group_scales, without the softmax sums and valid, without num_tokens, without
# a_tokens_tensor): no release had them, so no caller is built against them.
@pytest.mark.parametrize("struct_size", [1, 40, 56, 64, 80, 104, 112, NOW - 4, NOW + 8, 2**32 - 1])
def test_any_other_struct_size_is_refused(struct_size):
    opts = c_abi.options(arg_names=VLLM)
    opts.struct_size = struct_size
    status, message, outputs = merge(opts)
    assert status == c_abi.ERROR_VALUE and message == (
        f"options.struct_size: expected 0 or {NOW} (sizeof(attnmerge_options) of attnmerge 0.2.0), got {struct_size}")
    assert all(np.isnan(x).all() for x in outputs)


_BASELINE_CALLER = textwrap.dedent("""
    import ctypes, mmap, sys
    import numpy as np
    import c_abi
    from test_caller_names import merge, rand, T, H, D

    # The baseline layout as the last bytes of a page whose next page cannot be read: a library that
    # read past the caller's struct would crash here.
    page = mmap.PAGESIZE
    region = mmap.mmap(-1, 2 * page)
    base = ctypes.addressof(ctypes.c_char.from_buffer(region))
    libc = ctypes.CDLL(None)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    assert libc.mprotect(base + page, page, 0) == 0  # PROT_NONE
    size = ctypes.sizeof(c_abi.Options)
    opts = c_abi.Options.from_address(base + page - size)
    names = (c_abi.ArgName * 1)(c_abi.ArgName(b"o_b", b"suffix_output"))
    sink_data = np.zeros(H + 1, np.float32)
    sink = c_abi.tensor_from(sink_data)
    for struct_size in (0, size):
        ctypes.memset(ctypes.addressof(opts), 0, size)
        opts.struct_size = struct_size
        ptr = ctypes.cast(ctypes.pointer(opts), c_abi.OptionsP)
        assert merge(ptr)[0] == c_abi.SUCCESS
        # every field of it read: the names, the sink (a wrong one refused), the group size
        opts.arg_names, opts.num_arg_names = ctypes.cast(names, ctypes.POINTER(c_abi.ArgName)), 1
        status, message, _ = merge(ptr, o_b=rand((T, H, D), np.float16))
        assert message == "suffix_output: expected the dtype of o_a (float32), got float16", message
        opts.sink = ctypes.pointer(sink)
        status, message, _ = merge(ptr)
        assert message.startswith(f"sink: expected shape [{H}]"), message
        opts.sink, opts.group_size = None, 8
        status, message, _ = merge(ptr)
        assert message == "group_size: expected 0 without group_scales, got 8", message
    print("read within the baseline layout")
""")


def test_a_callers_options_are_read_whole_and_never_past_their_end():
    here = os.path.dirname(__file__)  # this module, and tests/ for c_abi
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([here, os.path.dirname(here), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", _BASELINE_CALLER], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0 and "read within the baseline layout" in r.stdout, (r.returncode, r.stdout, r.stderr[-2000:])


# ---- the binding's table -------------------------------------------------------------------------


def _binding_merge(names):
    a = pair_args()[1]
    _C.merge(a["out"], a["out_lse"], a["o_a"], a["lse_a"], a["o_b"], a["lse_b"], Options(names=names))


@pytest.mark.parametrize("names,exc,message", [
    pytest.param([("o_a", "x")], TypeError, "names: expected None or a dict, got list", id="not-a-dict"),
    pytest.param({"o_a": 3}, TypeError, "names: expected a dict of str to str, got 'o_a': 3", id="not-a-str"),
    pytest.param({f"a{i}": "x" for i in range(17)}, ValueError, "names: expected at most 16 entries, got 17",
                 id="too-many"),
])
def test_the_binding_refuses_a_table_it_cannot_pass_down(names, exc, message):
    with pytest.raises(exc) as info:
        _binding_merge(names)
    assert str(info.value) == message


def test_the_binding_words_its_own_messages_from_the_same_table():
    """A dtype the library has no code for is the binding's to refuse: named from the table too."""
    a = pair_args()[1]
    with pytest.raises(TypeError) as info:
        _C.merge(a["out"], a["out_lse"], np.ones((T, H, D), np.int16), a["lse_a"], a["o_b"], a["lse_b"],
                 Options(names=VLLM))
    assert str(info.value) == "prefix_output: expected dtype float32, float16, bfloat16 or float64, got int16"


# ---- the compat layers, through their public calls -------------------------------------------------

VT, VH, VD = 33, 4, 128  # vLLM: LSEs [heads, tokens]


def vllm_args(**replace):
    args = dict(output=nan((VT, VH, VD), np.float16), prefix_output=rand((VT, VH, VD), np.float16),
                prefix_lse=rand((VH, VT)), suffix_output=rand((VT, VH, VD), np.float16), suffix_lse=rand((VH, VT)),
                output_lse=nan((VH, VT)))
    args.update(replace)
    return args


def _vllm_overlap():
    buffer = nan((VT + 1, VH, VD), np.float16)
    return dict(output=buffer[1:], prefix_output=buffer[:-1])


def _read_only(x):
    x.flags.writeable = False
    return x


@pytest.mark.parametrize("args,kw,exc,message", [
    pytest.param(vllm_args(suffix_output=rand((VT, VH, VD))), {}, TypeError,
                 "suffix_output: expected the dtype of prefix_output (float16), got float32", id="dtype-of-another"),
    pytest.param(vllm_args(prefix_output=np.ones((VT, VH, VD), np.int16)), {}, TypeError,
                 "prefix_output: expected dtype float32, float16, bfloat16 or float64, got int16", id="binding-dtype"),
    pytest.param(vllm_args(prefix_output=rand((VT, VH, VD), np.float64)), {}, TypeError,
                 "prefix_output: expected dtype float32, float16 or bfloat16 (a call's O and LSE are float64 all or "
                 "none, and suffix_output is float16), got float64", id="float64-among-float16"),
    pytest.param(vllm_args(suffix_lse=rand((VH, 5))), {}, ValueError,
                 "suffix_lse: expected shape [4, 33] (the number of tokens of prefix_output, prefix_lse and "
                 "suffix_output), got [4, 5]",
                 id="shape-in-vllms-layout"),
    pytest.param(vllm_args(output_lse=nan((VT, VH))), {}, ValueError,
                 "output_lse: expected shape [4, 33] (the sizes of suffix_output, shape [33, 4, 128]), got [33, 4]",
                 id="optional-output"),
    pytest.param(vllm_args(prefix_output=rand((VT, VH, 2 * VD), np.float16)[:, :, ::2]), {}, ValueError,
                 "prefix_output: expected a unit stride on the head_size axis, got stride 2", id="stride"),
    pytest.param(vllm_args(**_vllm_overlap()), {}, ValueError,
                 "output: expected memory disjoint from prefix_output (or the very same view), got overlapping ranges",
                 id="aliasing"),
    pytest.param(vllm_args(output=_read_only(nan((VT, VH, VD), np.float16))), {}, ValueError,
                 "output: expected a writable tensor, got a read-only one", id="read-only"),
    pytest.param(vllm_args(), dict(prefill_tokens_with_context=34), ValueError,
                 "prefill_tokens_with_context: expected 0 to the 33 tokens of suffix_output, got 34", id="a_tokens"),
    pytest.param(vllm_args(prefix_output=rand((10, VH, VD), np.float16), prefix_lse=rand((VH, 10))),
                 dict(prefill_tokens_with_context=20), ValueError,
                 "prefix_output: expected at least 20 tokens (prefill_tokens_with_context), 4 heads and the head_size "
                 "of suffix_output, got shape [10, 4, 128]", id="a_tokens-shape"),
    pytest.param(vllm_args(), dict(output_scale=np.ones(1, np.float32)), ValueError,
                 "output_scale: expected none for a float16 output, got a scale in memory",
                 id="a-name-vllm-shares-is-unchanged"),
])
def test_vllm_messages_name_vllms_arguments(args, kw, exc, message):
    with pytest.raises(exc) as info:
        vllm.merge_attn_states(**args, **kw)
    assert str(info.value) == message
    assert np.isnan(args["output"]).all() and np.isnan(args["output_lse"]).all()


FT = 6


def _fi(fn, *args, **kw):
    with pytest.raises((TypeError, ValueError)) as info:
        fn(*args, **kw)
    return str(info.value)


def test_flashinfer_merge_state_names_v_a_and_v_b():
    assert _fi(flashinfer.merge_state, rand((FT, H, D), np.float16), rand((FT, H)), rand((FT, H, D)),
               rand((FT, H))) == "v_b: expected the dtype of v_a (float16), got float32"


def test_flashinfer_merge_state_in_place_names_v_other_for_the_mask():
    v, s = nan((FT, H, D)), nan((FT, H))
    message = _fi(flashinfer.merge_state_in_place, v, s, rand((FT, H, D)), rand((FT, H)), mask=np.ones(4, np.uint8))
    assert message == "mask: expected shape [6] (the number of tokens of v, s, v_other and s_other), got [4]"
    assert np.isnan(v).all() and np.isnan(s).all()


def test_flashinfer_merge_state_in_place_names_a_read_only_v():
    message = _fi(flashinfer.merge_state_in_place, _read_only(nan((FT, H, D))), nan((FT, H)), rand((FT, H, D)),
                  rand((FT, H)))
    assert message == "v: expected a writable tensor, got a read-only one"


def test_flashinfer_merge_states_names_s_and_v():
    assert _fi(flashinfer.merge_states, rand((FT, 2, H, D)), rand((FT, 3, H))) == (
        "v and s: expected the same number of states, got 2 (v, shape [6, 2, 3, 8]) and 3 (s, shape [6, 3, 3])")


def test_flashinfer_variable_length_merge_states_names_v_in_the_indptr_message():
    message = _fi(flashinfer.variable_length_merge_states, rand((10, H, D)), rand((10, H)),
                  np.array([0, 3, 2, 10], np.int32))
    assert message == ("indptr: expected non-decreasing offsets from 0 or more up to the 10 states of v, got "
                       "indptr[2] = 2 (decreasing)")


def test_the_raw_layer_passes_no_names_and_its_messages_name_its_own_arguments():
    out, out_lse = nan((T, H, D)), nan((T, H))
    o, lse = rand((T, H, D)), rand((T, H))
    od = lambda x: (x.ctypes.data, "float32", H * D, D)  # noqa: E731
    ld = lambda x: (x.ctypes.data, H, 1)  # noqa: E731
    with pytest.raises(ValueError) as info:
        raw.merge(tokens=T, heads=H, head_size=D, out=od(out), out_lse=ld(out_lse), o_a=od(o), lse_a=ld(lse),
                  o_b=od(o), lse_b=ld(lse), device="cpu", a_tokens=T + 1)
    assert str(info.value) == "a_tokens: expected 0 to the 5 tokens of o_b, got 6"
    assert np.isnan(out).all()
