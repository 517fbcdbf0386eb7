"""vLLM's merge_attn_states, signature and conventions kept: natural-log LSE laid out
[heads, tokens], results written into `output` (and `output_lse` unless it is None)."""
from __future__ import annotations

from .. import _C
from .._arrays import default_stream
from .._types import Array
from .._merge import a_tokens_arg
from . import renamed

_NAMES = {"out": "output", "out_lse": "output_lse", "o_a": "prefix_output", "lse_a": "prefix_lse",
          "o_b": "suffix_output", "lse_b": "suffix_lse", "a_tokens": "prefill_tokens_with_context"}


def merge_attn_states(output: Array, output_lse: Array | None, prefix_output: Array, prefix_lse: Array,
                      suffix_output: Array, suffix_lse: Array, prefill_tokens_with_context: int | None = None,
                      output_scale: Array | None = None) -> None:
    """output [tokens, heads, head_size] = merge of prefix and suffix states.

    prefix_output, suffix_output: [tokens, heads, head_size], float32, float16 or bfloat16.
    prefix_lse, suffix_lse, output_lse: float32 [heads, tokens], natural log; output_lse may be None.
    prefill_tokens_with_context: rows at or past it take the suffix state unchanged.
    output_scale: with an FP8 (float8_e4m3fn) output, output = merged / output_scale, saturating;
        a one-element float32 tensor, read on the device (no host synchronization).
    Runs on the current PyTorch stream for torch tensors (else as attnmerge.merge).
    """
    try:
        a_tokens = a_tokens_arg(prefill_tokens_with_context, "prefill_tokens_with_context")
        _C.merge(output, output_lse, prefix_output, prefix_lse, suffix_output, suffix_lse, _C.LSE_HEADS_FIRST,
                 a_tokens, output_scale, default_stream(suffix_output))
    except (ValueError, TypeError) as e:
        raise renamed(e, _NAMES) from None
