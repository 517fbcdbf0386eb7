"""vLLM's merge_attn_states, signature and conventions kept: natural-log LSE laid out
[heads, tokens], results written into `output` (and `output_lse` unless it is None)."""
from __future__ import annotations

from .. import _C, _roads
from .._call import OPS, options
from .._types import Array

_NAMES = {"out": "output", "out_lse": "output_lse", "o_a": "prefix_output", "lse_a": "prefix_lse",
          "o_b": "suffix_output", "lse_b": "suffix_lse", "a_tokens": "prefill_tokens_with_context"}
_MERGE = OPS["merge"]


def merge_attn_states(output: Array, prefix_output: Array, prefix_lse: Array, suffix_output: Array,
                      suffix_lse: Array, output_lse: Array | None = None,
                      prefill_tokens_with_context: int | None = None, output_scale: Array | None = None) -> None:
    """vLLM's merge_attn_states: output = merge of the prefix and suffix states; returns None.

    The order of vLLM's Python functions (``vllm.v1.attention.ops.merge_attn_states``,
    ``vllm._custom_ops.merge_attn_states``, the Triton op), positional or by keyword; the compiled
    op's order is :func:`merge_attn_states_op`'s.  Runs on the current PyTorch stream for torch
    tensors (else as :func:`attnmerge.merge`).

    Parameters
    ----------
    output : array
        [tokens, heads, head_size]: where the merged output goes.
    prefix_output, suffix_output : array
        [tokens, heads, head_size], float32, float16 or bfloat16.
    prefix_lse, suffix_lse : array
        float32 [heads, tokens], natural log.
    output_lse : array, optional
        float32 [heads, tokens]: where the merged LSE goes; None: not written.
    prefill_tokens_with_context : int, optional
        Rows at or past it take the suffix state alone, and prefix_* need only that many tokens.
        Unlike vLLM, such a row whose suffix is empty (LSE +-inf) gets O = 0 and LSE = -inf, where
        vLLM copies the suffix (O as it is, LSE +inf).
    output_scale : array, optional
        With an FP8 (float8_e4m3fn) output, output = merged / output_scale, saturating; a
        one-element float32 tensor, read on the device.

    Raises
    ------
    ValueError, TypeError
        As :func:`attnmerge.merge`, in vLLM's argument names.

    Examples
    --------
    >>> import numpy as np
    >>> from attnmerge.compat.vllm import merge_attn_states
    >>> rng = np.random.default_rng(0)
    >>> p, s = rng.standard_normal((2, 4, 3, 64), dtype=np.float32)
    >>> p_lse, s_lse = rng.standard_normal((2, 3, 4), dtype=np.float32)  # [heads, tokens]
    >>> output = np.empty_like(p)
    >>> merge_attn_states(output, p, p_lse, s, s_lse)
    """
    if output is None:  # vLLM writes into a given output; nothing is allocated
        raise TypeError("output: expected an array, got NoneType")
    # The C ABI's [heads, tokens] LSE flag: its messages give the LSEs' shapes as vLLM lays them out.
    opt = options(_MERGE, return_lse=False, output_scale=output_scale, a_tokens=prefill_tokens_with_context,
                  names=_NAMES, flags=_C.LSE_HEADS_FIRST)
    _roads.run(_MERGE, (prefix_output, prefix_lse, suffix_output, suffix_lse), output, output_lse, opt)
    return None


def merge_attn_states_op(output: Array, output_lse: Array | None, prefix_output: Array, prefix_lse: Array,
                         suffix_output: Array, suffix_lse: Array, prefill_tokens_with_context: int | None = None,
                         output_scale: Array | None = None) -> None:
    """vLLM's compiled op, ``torch.ops._C.merge_attn_states``, in its order: output and output_lse first.

    The same call as :func:`merge_attn_states`, whose parameters it takes.

    Examples
    --------
    >>> import numpy as np
    >>> from attnmerge.compat.vllm import merge_attn_states_op
    >>> rng = np.random.default_rng(0)
    >>> p, s = rng.standard_normal((2, 4, 3, 64), dtype=np.float32)
    >>> p_lse, s_lse = rng.standard_normal((2, 3, 4), dtype=np.float32)
    >>> output, output_lse = np.empty_like(p), np.empty_like(p_lse)
    >>> merge_attn_states_op(output, output_lse, p, p_lse, s, s_lse)
    >>> bool(np.allclose(output_lse, np.logaddexp(p_lse, s_lse)))
    True
    """
    return merge_attn_states(output, prefix_output, prefix_lse, suffix_output, suffix_lse, output_lse,
                             prefill_tokens_with_context, output_scale)
