"""SGLang's merge functions, signatures and conventions kept: natural-log LSE laid out [tokens, heads];
results written into the given outputs, else allocated in the caller's array library (O in the
dtype of the first state, LSE float32), and returned."""
from __future__ import annotations

from .. import _merge
from .._types import Array

_PREFIX_SUFFIX = {"out": "output", "out_lse": "output_lse", "o_a": "prefix_output", "lse_a": "prefix_lse",
                  "o_b": "suffix_output", "lse_b": "suffix_lse"}
_V_S = {"out": "v_merged", "out_lse": "s_merged", "o_a": "v_a", "lse_a": "s_a", "o_b": "v_b", "lse_b": "s_b"}


def merge_state(prefix_output: Array, prefix_lse: Array, suffix_output: Array, suffix_lse: Array,
                output: Array | None = None, output_lse: Array | None = None) -> tuple[Array, Array]:
    """(output, output_lse) = merge of the prefix and suffix states: SGLang's
    sglang.srt.layers.attention.merge_state (which dispatches to sgl_kernel.merge_state_v2 or its
    Triton kernel).  *_output [tokens, heads, head_size] float32, float16 or bfloat16; *_lse
    float32 [tokens, heads], natural log.  Unlike SGLang, LSEs of another dtype are refused by name
    rather than converted."""
    return _merge.merge(prefix_output, prefix_lse, suffix_output, suffix_lse, out=output, out_lse=output_lse,
                        _names=_PREFIX_SUFFIX)


def merge_state_v2(v_a: Array, s_a: Array, v_b: Array, s_b: Array, v_merged: Array | None = None,
                   s_merged: Array | None = None) -> tuple[Array, Array]:
    """sgl_kernel.merge_state_v2: merge_state under sgl_kernel's names."""
    return _merge.merge(v_a, s_a, v_b, s_b, out=v_merged, out_lse=s_merged, _names=_V_S)
