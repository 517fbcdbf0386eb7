"""vLLM's merge_attn_states, signature and conventions kept: natural-log LSE laid out
[heads, tokens], results written into `output` (and `output_lse` unless it is None)."""
from __future__ import annotations

from .. import _C, _merge
from .._types import Array
from .._merge import a_tokens_arg, output_scale_arg

_NAMES = {"out": "output", "out_lse": "output_lse", "o_a": "prefix_output", "lse_a": "prefix_lse",
          "o_b": "suffix_output", "lse_b": "suffix_lse", "a_tokens": "prefill_tokens_with_context"}


def merge_attn_states(output: Array, prefix_output: Array, prefix_lse: Array, suffix_output: Array,
                      suffix_lse: Array, output_lse: Array | None = None,
                      prefill_tokens_with_context: int | None = None, output_scale: Array | None = None) -> None:
    """output [tokens, heads, head_size] = merge of prefix and suffix states; returns None.

    The order of vLLM's Python functions (vllm.v1.attention.ops.merge_attn_states,
    vllm._custom_ops.merge_attn_states, the Triton op), positional or by keyword.
    prefix_output, suffix_output: [tokens, heads, head_size], float32, float16 or bfloat16.
    prefix_lse, suffix_lse, output_lse: float32 [heads, tokens], natural log; output_lse may be None.
    prefill_tokens_with_context: rows at or past it take the suffix state alone, and prefix_*
        need only that many tokens.  Unlike vLLM, such a row whose suffix is empty (LSE +-inf)
        gets O = 0 and LSE = -inf, where vLLM copies the suffix (O as it is, LSE +inf).
    output_scale: with an FP8 (float8_e4m3fn) output, output = merged / output_scale, saturating;
        a one-element float32 tensor, read on the device (no host synchronization).
    Runs on the current PyTorch stream for torch tensors (else as attnmerge.merge).

    Also taken positionally in the order of vLLM's compiled op (torch.ops._C.merge_attn_states:
    output, output_lse, prefix_output, prefix_lse, suffix_output, suffix_lse, ...), which the seed
    kernel and its harness use: recognised by its second argument, an LSE (2-D) or None where this
    order has prefix_output (3-D).
    """
    if prefix_output is None or getattr(prefix_output, "ndim", 3) == 2:
        (output_lse, prefix_output, prefix_lse, suffix_output, suffix_lse) = (
            prefix_output, prefix_lse, suffix_output, suffix_lse, output_lse)
    if _merge._takes is not None and _merge._takes(prefix_output, prefix_lse, suffix_output, suffix_lse):
        # traced or differentiated: through torch.ops.attnmerge, the [heads, tokens] LSEs as views
        _merge.merge(prefix_output, prefix_lse.T, suffix_output, suffix_lse.T, out=output,
                     out_lse=None if output_lse is None else output_lse.T, return_lse=False,
                     output_scale=output_scale, a_tokens=prefill_tokens_with_context, _names=_NAMES)
        return None
    # The binding directly, with the C ABI's [heads, tokens] LSE flag: its messages then give the
    # LSEs' shapes as vLLM lays them out.
    a_tokens = a_tokens_arg(prefill_tokens_with_context, _NAMES["a_tokens"])
    _C.merge(output, output_lse, prefix_output, prefix_lse, suffix_output, suffix_lse, _C.LSE_HEADS_FIRST, a_tokens,
             output_scale_arg(output_scale), None, _NAMES)
    return None
