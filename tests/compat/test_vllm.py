"""attnmerge.compat.vllm.merge_attn_states: vLLM's signature and conventions (on the CPU, NumPy; the last
test on every device).

merge_attn_states(output, prefix_output, prefix_lse, suffix_output, suffix_lse, output_lse=None,
                  prefill_tokens_with_context=None, output_scale=None)
writes into output (and output_lse unless None); natural log; every LSE laid out [heads, tokens];
rows at or past prefill_tokens_with_context take the suffix state unchanged (an empty suffix there gives
O = 0, LSE = -inf, where vLLM copies it).
"""

from __future__ import annotations

import numpy as np
import pytest

from attnmerge.compat.vllm import merge_attn_states, merge_attn_states_op
from oracle import (
    DTYPES,
    all_nan,
    assert_lse_close,
    assert_merge_matches,
    assert_o_close,
    nan_array,
    random_lse,
    random_o,
    reference_merge,
    to_f64,
)


def vllm_inputs(rng, tokens=33, heads=4, head_size=128, dtype="float16"):
    """prefix/suffix outputs [T, H, D] and LSEs [H, T], as vLLM lays them out."""
    return dict(
        prefix_output=random_o(rng, (tokens, heads, head_size), dtype),
        prefix_lse=random_lse(rng, (heads, tokens)),
        suffix_output=random_o(rng, (tokens, heads, head_size), dtype),
        suffix_lse=random_lse(rng, (heads, tokens)),
    )


def reference(x, prefill_tokens_with_context=None):
    return reference_merge(
        x["prefix_output"], x["prefix_lse"].T, x["suffix_output"], x["suffix_lse"].T,
        a_tokens=prefill_tokens_with_context,
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size", [64, 80, 128])
def test_merges_into_output_and_output_lse(rng, dtype, head_size):
    x = vllm_inputs(rng, head_size=head_size, dtype=dtype)
    t, h, d = x["prefix_output"].shape
    output = nan_array((t, h, d), dtype)
    output_lse = nan_array((h, t))
    merge_attn_states(output, **x, output_lse=output_lse)
    ref_o, ref_lse = reference(x)
    assert_o_close(output, ref_o, dtype, "output")
    assert_lse_close(output_lse.T, ref_lse, "output_lse")


def test_arguments_are_positional_in_vllm_order(rng):
    x = vllm_inputs(rng)
    output = nan_array(x["prefix_output"].shape, "float16")
    output_lse = nan_array(x["prefix_lse"].shape)
    merge_attn_states(output, x["prefix_output"], x["prefix_lse"], x["suffix_output"], x["suffix_lse"], output_lse)
    assert_merge_matches(output, output_lse.T, reference(x), "float16", "output")


@pytest.mark.parametrize("dtype", DTYPES)
def test_output_lse_may_be_none(rng, dtype):
    x = vllm_inputs(rng, dtype=dtype)
    output = nan_array(x["prefix_output"].shape, dtype)
    merge_attn_states(output, **x, output_lse=None)
    assert_o_close(output, reference(x)[0], dtype, "output")


@pytest.mark.parametrize("k", [0, 1, 17, 33])
def test_rows_at_or_past_prefill_tokens_with_context_take_the_suffix(rng, k):
    x = vllm_inputs(rng, tokens=33, dtype="bfloat16")
    x["prefix_output"][k:] = np.nan  # never read past k
    x["prefix_lse"][:, k:] = np.nan
    output = nan_array(x["prefix_output"].shape, "bfloat16")
    output_lse = nan_array(x["prefix_lse"].shape)
    merge_attn_states(output, **x, output_lse=output_lse, prefill_tokens_with_context=k)
    assert_merge_matches(output, output_lse.T, reference(x, k), "bfloat16", "output")
    assert np.array_equal(to_f64(output[k:]), to_f64(x["suffix_output"][k:]))
    assert np.array_equal(output_lse[:, k:], x["suffix_lse"][:, k:])


def test_prefill_tokens_with_context_none_merges_every_row(rng):
    x = vllm_inputs(rng)
    output = nan_array(x["prefix_output"].shape, "float16")
    output_lse = nan_array(x["prefix_lse"].shape)
    merge_attn_states(output, **x, output_lse=output_lse, prefill_tokens_with_context=None)
    assert_merge_matches(output, output_lse.T, reference(x), "float16", "output")


def test_empty_and_nan_rows_follow_the_semantics(rng):
    x = vllm_inputs(rng, tokens=20, heads=3, head_size=64, dtype="float32")
    x["prefix_lse"][0, 2] = np.inf  # empty prefix: the suffix
    x["prefix_output"][2, 0] = np.nan
    x["suffix_lse"][1, 4] = np.inf  # empty suffix: the prefix
    x["suffix_output"][4, 1] = np.nan
    x["prefix_lse"][2, 6] = np.inf  # both empty: 0, -inf
    x["suffix_lse"][2, 6] = np.inf
    x["prefix_output"][6, 2] = np.nan
    x["suffix_output"][6, 2] = np.nan
    x["suffix_lse"][0, 9] = np.nan  # NaN row
    output = nan_array(x["prefix_output"].shape, "float32")
    output_lse = nan_array(x["prefix_lse"].shape)
    merge_attn_states(output, **x, output_lse=output_lse)
    assert_merge_matches(output, output_lse.T, reference(x), "float32", "output")
    assert np.all(output[6, 2] == 0.0) and output_lse[2, 6] == -np.inf
    assert np.all(np.isnan(output[9, 0])) and np.isnan(output_lse[0, 9])
    assert np.isnan(output).sum() == output.shape[2]


def test_output_may_be_a_strided_slice(rng):
    """vLLM passes views of a larger buffer; strides are honoured."""
    x = vllm_inputs(rng, tokens=16, heads=4, head_size=64, dtype="float16")
    buf = nan_array((16, 4, 96), "float16")
    output = buf[:, :, 16:80]
    lse_buf = nan_array((4, 40))
    output_lse = lse_buf[:, :16]
    merge_attn_states(output, **x, output_lse=output_lse)
    assert_merge_matches(output, output_lse.T, reference(x), "float16", "output")
    assert all_nan(buf[:, :, :16]) and all_nan(buf[:, :, 80:]) and all_nan(lse_buf[:, 16:])


def test_zero_tokens(rng):
    x = vllm_inputs(rng, tokens=0)
    output = nan_array((0, 4, 128), "float16")
    merge_attn_states(output, **x, output_lse=nan_array((4, 0)))


# --------------------------------------------------------------------------------------------------
# called exactly as vLLM's own code calls it


def test_the_signature_is_that_of_vllms_python_functions():
    import inspect

    params = inspect.signature(merge_attn_states).parameters
    assert list(params) == ["output", "prefix_output", "prefix_lse", "suffix_output", "suffix_lse", "output_lse",
                            "prefill_tokens_with_context", "output_scale"]
    assert [p.default for p in params.values()][5:] == [None, None, None]
    assert all(p.default is inspect.Parameter.empty for p in list(params.values())[:5])


def test_as_cascade_attention_calls_it_five_positional_arguments_returning_none(rng):
    """vllm/v1/attention/backends/flash_attn.py: merge_attn_states(output, prefix_output, prefix_lse,
    suffix_output, suffix_lse)."""
    x = vllm_inputs(rng, dtype="bfloat16")
    output = nan_array(x["prefix_output"].shape, "bfloat16")
    assert merge_attn_states(output, x["prefix_output"], x["prefix_lse"], x["suffix_output"], x["suffix_lse"]) is None
    assert_o_close(output, reference(x)[0], "bfloat16", "output")


def test_as_the_dispatcher_calls_it_six_positional_arguments(rng):
    """vllm/v1/attention/ops/merge_attn_states.py: (output, prefix_output, prefix_lse, suffix_output,
    suffix_lse, output_lse)."""
    x = vllm_inputs(rng, dtype="float32")
    output, output_lse = nan_array(x["prefix_output"].shape, "float32"), nan_array(x["prefix_lse"].shape)
    assert merge_attn_states(output, x["prefix_output"], x["prefix_lse"], x["suffix_output"], x["suffix_lse"],
                             output_lse) is None
    assert_merge_matches(output, output_lse.T, reference(x), "float32", "output")


@pytest.mark.parametrize("with_lse", [True, False])
def test_merge_attn_states_op_takes_the_compiled_ops_order(rng, with_lse):
    """torch.ops._C.merge_attn_states' order (output, output_lse, prefix_output, prefix_lse,
    suffix_output, suffix_lse, prefill_tokens_with_context, output_scale): a function of its own
    name, merge_attn_states_op."""
    x = vllm_inputs(rng, tokens=20, dtype="float32")
    output = nan_array(x["prefix_output"].shape, "float32")
    output_lse = nan_array(x["prefix_lse"].shape) if with_lse else None
    assert merge_attn_states_op(output, output_lse, x["prefix_output"], x["prefix_lse"], x["suffix_output"],
                                x["suffix_lse"], 12) is None
    ref = reference(x, 12)
    assert_o_close(output, ref[0], "float32", "output")
    if with_lse:
        assert_lse_close(output_lse.T, ref[1], "output_lse")


def test_as_mla_chunked_prefill_calls_it_by_keyword(rng):
    """vLLM's MLA prefill: merge_attn_states(output=, prefix_output=, prefix_lse=, suffix_output=,
    suffix_lse=, prefill_tokens_with_context=), no output_lse."""
    x = vllm_inputs(rng, tokens=24, dtype="float16")
    output = nan_array(x["prefix_output"].shape, "float16")
    merge_attn_states(output=output, prefix_output=x["prefix_output"], prefix_lse=x["prefix_lse"],
                      suffix_output=x["suffix_output"], suffix_lse=x["suffix_lse"], prefill_tokens_with_context=10)
    assert_o_close(output, reference(x, 10)[0], "float16", "output")


def test_a_row_past_prefill_tokens_with_context_whose_suffix_is_empty_is_zero_and_minus_inf(rng):
    """Where vLLM copies the suffix (O as it is, LSE +inf), attnmerge follows its semantics: an
    all-empty row is O = 0, LSE = -inf."""
    x = vllm_inputs(rng, tokens=8, heads=2, head_size=16, dtype="float32")
    x["suffix_lse"][1, 6] = np.inf
    output, output_lse = nan_array(x["prefix_output"].shape, "float32"), nan_array(x["prefix_lse"].shape)
    merge_attn_states(output, x["prefix_output"], x["prefix_lse"], x["suffix_output"], x["suffix_lse"], output_lse, 4)
    assert np.all(output[6, 1] == 0) and output_lse[1, 6] == -np.inf


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [None, 0, 30, 77])
def test_on_every_device_with_and_without_output_lse(rng, device, dtype, k):
    """On the device fixture's arrays (NumPy on the CPU, torch on CUDA), an empty part among the
    rows; without output_lse the same output."""
    t, h, d = 77, 8, 128
    x = vllm_inputs(rng, t, h, d, dtype)
    x["prefix_lse"][1, 3] = np.inf
    dx = {k_: device.put(v) for k_, v in x.items()}
    output, output_lse = device.nan((t, h, d), dtype), device.nan((h, t))
    merge_attn_states(output, **dx, output_lse=output_lse, prefill_tokens_with_context=k)
    output, output_lse = device.get(output), device.get(output_lse)
    assert_merge_matches(output, output_lse.T, reference(x, k), dtype, "output")
    output2 = device.nan((t, h, d), dtype)
    merge_attn_states(output2, **dx, output_lse=None, prefill_tokens_with_context=k)
    assert np.array_equal(device.get(output2).view(np.uint8), output.view(np.uint8))
