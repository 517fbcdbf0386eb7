"""The one runner of the bad-input table (tests/errors/bad_inputs.py): every row through every layer it
names (the Python entry point on NumPy arrays and on the `cuda` device's, the C ABI over the same
arrays, or the row's own raw or C descriptors).  Each must
  - raise the row's ValueError / TypeError (Python) or return its non-zero status (C),
  - with a message that names what the row says (attnmerge_last_error() for C), and
  - change no byte of any array it was given: every output starts poisoned (NaN), and every buffer's
    bytes are compared before and after.
"""

from __future__ import annotations

import numpy as np
import pytest

import attnmerge
import c_abi
import devices
from attnmerge import raw
from attnmerge.compat import flashinfer as fi
from attnmerge.compat import vllm
from attnmerge._call import OPS, SUMS
from bad_inputs import ROWS, Bad, OnHost, baseline, names, raw_descriptors
from oracle import all_nan, nan_array

PY_OPS = {
    "merge": lambda a, kw: attnmerge.merge(a["o_a"], a["lse_a"], a["o_b"], a["lse_b"], out=a["out"],
                                           out_lse=a["out_lse"], **kw),
    "merge_inplace": lambda a, kw: attnmerge.merge_inplace(a["o"], a["lse"], a["o_other"], a["lse_other"],
                                                           mask=a["mask"], **kw),
    "merge_states": lambda a, kw: attnmerge.merge_states(a["o"], a["lse"], out=a["out"], out_lse=a["out_lse"], **kw),
    "merge_varlen": lambda a, kw: attnmerge.merge_varlen(a["o"], a["lse"], a["indptr"], out=a["out"],
                                                         out_lse=a["out_lse"], **kw),
    "merge_share": lambda a, kw: attnmerge.merge_share(a["o"], a["lse"], a["index"], out=a["out"],
                                                       out_lse=a["out_lse"], **kw),
    "merge_states_backward": lambda a, kw: attnmerge.merge_states_backward(
        a["grad_out"], a["grad_out_lse"], a["out"], a["out_lse"], a["o"], a["lse"], grad_o=a["grad_o"],
        grad_lse=a["grad_lse"], **kw),
    "vllm": lambda a, kw: vllm.merge_attn_states(a["output"], a["prefix_output"], a["prefix_lse"], a["suffix_output"],
                                                 a["suffix_lse"], a["output_lse"], **kw),
    "fi.merge_state": lambda a, kw: fi.merge_state(a["v_a"], a["s_a"], a["v_b"], a["s_b"], **kw),
    "fi.merge_state_in_place": lambda a, kw: fi.merge_state_in_place(a["v"], a["s"], a["v_other"], a["s_other"],
                                                                     mask=a["mask"], **kw),
    "fi.merge_states": lambda a, kw: fi.merge_states(a["v"], a["s"], **kw),
    "fi.variable_length_merge_states": lambda a, kw: fi.variable_length_merge_states(a["v"], a["s"], a["indptr"], **kw),
    "raw.merge": lambda a, kw: raw.merge(**a, **kw),
}

C_OPS = {
    "merge": lambda t, o: c_abi.merge(t["out"], t["out_lse"], t["o_a"], t["lse_a"], t["o_b"], t["lse_b"], o),
    "merge_inplace": lambda t, o: c_abi.merge_inplace(t["o"], t["lse"], t["o_other"], t["lse_other"], t["mask"], o),
    "merge_states": lambda t, o: c_abi.merge_states(t["out"], t["out_lse"], t["o"], t["lse"], o),
    "merge_varlen": lambda t, o: c_abi.merge_varlen(t["out"], t["out_lse"], t["o"], t["lse"], t["indptr"], o),
    "merge_share": lambda t, o: c_abi.merge_share(t["out"], t["out_lse"], t["o"], t["lse"], t["index"], o),
    "merge_states_backward": lambda t, o: c_abi.merge_states_backward(
        t["grad_o"], t["grad_lse"], t["grad_out"], t["grad_out_lse"], t["out"], t["out_lse"], t["o"], t["lse"], o),
}

STATUS_OF = {TypeError: c_abi.ERROR_TYPE, ValueError: c_abi.ERROR_VALUE}


def c_options(kw, sums=None):
    """The C ABI's options of the Python options a row gives (those it has a form for), and the
    softmax sums of its LSE arguments given as (max, sum) tuples ({"sum_a": Tensor, ...})."""
    if not kw and not sums:
        return None
    flags, a_tokens, scale, ptr, group, tensors = 0, 0, 0.0, None, 0, dict(sums or {})
    for k, v in kw.items():
        if k == "block_format":
            flags |= {"mxfp8": c_abi.BLOCK_MXFP8, "nvfp4": c_abi.BLOCK_NVFP4}[v]
        elif k == "scale_layout":
            flags |= {"row_major": 0, "swizzled": c_abi.SCALE_SWIZZLED}[v]
        elif k == "scale_rounding":
            flags |= {"floor": 0, "rceil": c_abi.SCALE_RCEIL}[v]
        elif k in ("sink", "valid", "group_scales", "num_tokens"):
            tensors[k] = c_abi.tensor_from(v)
        elif k == "group_size":
            group = v
        elif k == "a_tokens" and isinstance(v, np.ndarray):  # read on the device
            tensors["a_tokens_tensor"] = c_abi.tensor_from(v)
        elif k == "a_tokens":
            flags, a_tokens = flags | c_abi.A_TOKENS, v
        elif k == "output_scale" and isinstance(v, np.ndarray):
            ptr = v.ctypes.data
        elif k == "output_scale":
            scale = float(v)
        else:
            raise AssertionError(f"the option {k}={v!r} has no C ABI form: the row cannot run on the c layer")
    return c_abi.options(flags=flags, a_tokens=a_tokens, output_scale=scale, output_scale_ptr=ptr, group_size=group,
                         **tensors)


def c_arguments(op, a):
    """The C ABI's descriptors of a row's arguments, an LSE argument given as softmax statistics (a
    (max, sum) tuple) as its max, its sum the options' sum_a or sum_b (attnmerge._call.SUMS, in the
    order of the op's LSE arguments)."""
    t, sums = {}, {}
    lses = [OPS[op].inputs[i] for i in OPS[op].lses] if op in OPS else []
    for k, v in a.items():
        if isinstance(v, tuple):
            t[k] = c_abi.tensor_from(v[0])
            sums[SUMS[lses.index(k)]] = c_abi.tensor_from(v[1])
        else:
            t[k] = c_abi.tensor_from(v) if isinstance(v, np.ndarray) else v
    return t, sums


def snapshot(arrays):
    return [np.array(x, copy=True).tobytes() for x in arrays]


def host_arrays(a):
    seen, out = set(), []
    for x in [*a.values(), *a.options.values(), *a.arrays.values(), *a.extra]:
        for y in (x if isinstance(x, tuple) else (x.array,) if isinstance(x, OnHost) else (x,)):
            if isinstance(y, np.ndarray) and id(y) not in seen:
                seen.add(id(y))
                out.append(y)
    return out


def on_device(device, v):
    """A row's argument on the `cuda` layer's device: each array of a (max, sum) tuple too, but an
    OnHost one, which stays in host memory."""
    if isinstance(v, tuple):
        return tuple(on_device(device, x) for x in v)
    if isinstance(v, OnHost):
        return v.array
    return device.put(v) if isinstance(v, np.ndarray) else v


def run(row: Bad, layer: str, rng):
    """Calls the broken entry point on the layer; returns (the error or status, the message)."""
    a = baseline(row.op, rng)
    if row.op.startswith("raw."):
        a = raw_descriptors(a)
        row.change(a)
    elif row.op.startswith("c."):
        a.arrays = {k: v for k, v in a.items() if isinstance(v, np.ndarray)}
        for k in list(a):
            a[k] = c_abi.tensor_from(a[k]) if isinstance(a[k], np.ndarray) else a[k]  # merge_share's index: as is
        row.change(a)
    else:
        row.change(a)
    arrays = host_arrays(a)
    before = snapshot(arrays)

    if layer == "cuda":
        device = devices.get("cuda")
        placed = {k: on_device(device, v) for k, v in a.items()}
        kw = {k: on_device(device, v) for k, v in a.options.items()}
        with pytest.raises(row.error) as info:
            PY_OPS[row.op](placed, kw)
        after = {k: device.get(v).tobytes() for k, v in placed.items() if k in a and isinstance(a[k], np.ndarray)}
        for k, v in a.items():
            if isinstance(v, np.ndarray):
                assert after[k] == np.array(v, copy=True).tobytes(), f"{k} changed although the call failed"
        return str(info.value)

    if layer == "c" or row.op.startswith("c."):
        if row.op == "c.stream_synchronize":
            status = c_abi.load().attnmerge_stream_synchronize(a.options["device"], None)
            expect = row.error
        elif row.op.startswith("c."):
            status = C_OPS[row.op[2:]](a, a.options.get("opts"))
            expect = row.error
        else:
            t, sums = c_arguments(row.op, a)
            assert all(v is None or isinstance(v, (c_abi.Tensor, int)) for v in t.values()), \
                f"{row.id}: an argument that is no array (or merge_share's int index) cannot be a C descriptor"
            status = C_OPS[row.op](t, c_options(a.options, sums))
            errors = row.error if isinstance(row.error, tuple) else (row.error,)
            expect = row.c_error if row.c_error is not None else tuple(STATUS_OF[e] for e in errors)
        msg = c_abi.last_error()
        expect = expect if isinstance(expect, tuple) else (expect,)
        assert status in expect, f"status {status}, expected {expect}; message {msg!r}"
    else:
        with pytest.raises(row.error) as info:
            PY_OPS[row.op](a, a.options)
        msg = str(info.value)
    for i, (b, x) in enumerate(zip(before, snapshot(arrays))):
        assert x == b, f"array #{i} changed although the call failed ({msg!r})"
    return msg


def check_message(row: Bad, msg: str):
    assert msg, "an error without a message"
    for w in row.words:
        assert names(w, msg), f"{w!r} is not named in the message {msg!r}"
    for w in row.absent:
        assert not names(w, msg), f"{w!r} should not be in the message {msg!r}"
    for c in row.contains:
        assert c in msg, f"{c!r} is not in the message {msg!r}"
    if row.starts is not None:
        assert msg.startswith(row.starts), f"the message {msg!r} does not start with {row.starts!r}"
    if row.exact is not None:
        assert msg == row.exact, f"the message {msg!r} is not {row.exact!r}"
    if row.check is not None:
        row.check(msg)


def params():
    for row in ROWS:
        for layer in row.layers:
            marks = list(row.marks) + (list(devices.CUDA.marks) if layer == "cuda" else [])
            yield pytest.param(row, layer, id=f"{row.id}-{layer}", marks=marks)


@pytest.mark.parametrize("row,layer", list(params()))
def test_bad_input(rng, row: Bad, layer: str):
    check_message(row, run(row, layer, rng))


def test_the_table_is_large_enough_and_its_ids_unique():
    ids = [r.id for r in ROWS]
    assert len(ids) == len(set(ids)), sorted({i for i in ids if ids.count(i) > 1})
    assert len(ids) >= 250
    assert {r.op.split(".")[0] for r in ROWS} >= {"merge", "merge_inplace", "merge_states", "merge_varlen", "merge_share",
                                                  "merge_states_backward", "vllm", "fi", "raw", "c"}
    assert sum("cuda" in r.layers for r in ROWS) >= 60 and sum("c" in r.layers for r in ROWS) >= 100


def test_every_row_states_what_its_message_must_say():
    for r in ROWS:
        assert r.words or r.starts or r.exact or r.contains, f"{r.id}: no rule for its message"
        assert set(r.layers) <= {"cpu", "cuda", "c", "raw"}, r.id


def test_poisoned_output_is_all_nan_before_the_call():
    # guards the "nothing is written" checks of NaN-poisoned outputs
    assert all_nan(nan_array((3, 2, 4), "bfloat16")) and all_nan(nan_array((3, 2), "float32"))
    assert nan_array((1,), "bfloat16").dtype.name == "bfloat16"
