"""attnmerge.compat.sglang: SGLang's signatures and conventions (on the CPU; the last test on every device).

merge_state(prefix_output, prefix_lse, suffix_output, suffix_lse, output=None, output_lse=None)
    -> (output, output_lse)                  sglang.srt.layers.attention.merge_state
merge_state_v2(v_a, s_a, v_b, s_b, v_merged=None, s_merged=None) -> (v_merged, s_merged)
                                             sgl_kernel.merge_state_v2

Natural log, LSE laid out [tokens, heads]; given outputs are written and returned, missing ones
allocated in the caller's library (O in the dtype of the first state, LSE float32).
"""

from __future__ import annotations

import numpy as np
import pytest

from attnmerge.compat import sglang
from oracle import (
    DTYPES,
    assert_merge_matches,
    nan_array,
    np_dtype,
    random_pair,
    reference_merge,
    to_f64,
)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fn", [sglang.merge_state, sglang.merge_state_v2], ids=["merge_state", "merge_state_v2"])
def test_natural_log_into_new_arrays(rng, fn, dtype):
    a_o, a_l, b_o, b_l = random_pair(rng, 33, 4, 128, dtype)
    out, out_lse = fn(a_o, a_l, b_o, b_l)
    assert isinstance(out, np.ndarray) and out.dtype == np_dtype(dtype) and out.shape == a_o.shape
    assert out_lse.dtype == np.float32 and out_lse.shape == a_l.shape
    assert_merge_matches(out, out_lse, reference_merge(a_o, a_l, b_o, b_l), dtype)
    assert np.abs(to_f64(out_lse) - reference_merge(a_o, a_l, b_o, b_l, base=2)[1]).max() > 1e-3  # not base 2


def test_given_outputs_are_written_and_returned_positionally_or_by_keyword(rng):
    a_o, a_l, b_o, b_l = random_pair(rng, 33, 4, 128, "bfloat16")
    output, output_lse = nan_array(a_o.shape, a_o.dtype), nan_array(a_l.shape)
    res = sglang.merge_state(a_o, a_l, b_o, b_l, output, output_lse)
    assert res[0] is output and res[1] is output_lse
    assert_merge_matches(output, output_lse, reference_merge(a_o, a_l, b_o, b_l), "bfloat16")
    v_merged = nan_array(a_o.shape, a_o.dtype)
    res = sglang.merge_state_v2(v_a=a_o, s_a=a_l, v_b=b_o, s_b=b_l, v_merged=v_merged)
    assert res[0] is v_merged and res[1].shape == a_l.shape
    assert_merge_matches(v_merged, res[1], reference_merge(a_o, a_l, b_o, b_l), "bfloat16")


def test_errors_name_sglangs_arguments(rng):
    a_o, a_l, b_o, b_l = random_pair(rng, 5, 3, 8, "float32")
    with pytest.raises(ValueError) as info:
        sglang.merge_state(a_o, a_l, b_o, b_l[:-1])
    assert str(info.value).startswith("suffix_lse: expected shape [5, 3]"), str(info.value)
    with pytest.raises(TypeError) as info:
        sglang.merge_state_v2(a_o, a_l.astype(np.float16), b_o, b_l)
    assert str(info.value).startswith("s_a: expected"), str(info.value)
    with pytest.raises(ValueError) as info:
        sglang.merge_state(a_o, a_l, b_o, b_l, output=np.zeros((5, 3, 9), np.float32))
    assert str(info.value).startswith("output: expected shape [5, 3, 8]"), str(info.value)


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_function_on_every_device(rng, device, dtype):
    """Both functions on the `device` fixture's arrays (NumPy on the CPU, torch on CUDA): the
    caller's library and device, the oracle's values."""
    a_o, a_l, b_o, b_l = random_pair(rng, 33, 4, 128, dtype)
    out, out_lse = sglang.merge_state(*(device.put(x) for x in (a_o, a_l, b_o, b_l)))
    assert device.is_mine(out) and device.is_mine(out_lse) and out.dtype == device.dtype(dtype)
    assert_merge_matches(device.get(out), device.get(out_lse), reference_merge(a_o, a_l, b_o, b_l), dtype)
    v, s = device.nan(a_o.shape, dtype), device.nan(a_l.shape)
    res = sglang.merge_state_v2(*(device.put(x) for x in (a_o, a_l, b_o, b_l)), v, s)
    assert res[0] is v and res[1] is s
    assert_merge_matches(device.get(v), device.get(s), reference_merge(a_o, a_l, b_o, b_l), dtype)
