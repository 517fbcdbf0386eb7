"""FlashInfer's merge functions, signatures and conventions kept: base-2 LSE (log2-sum-exp2),
laid out [tokens, heads]; new arrays are allocated in the caller's array library."""
from __future__ import annotations

from .. import _merge
from .._types import Array

_PAIR = {"o_a": "v_a", "lse_a": "s_a", "o_b": "v_b", "lse_b": "s_b"}
_INPLACE = {"o": "v", "lse": "s", "o_other": "v_other", "lse_other": "s_other"}
_STATES = {"o": "v", "lse": "s"}


def merge_state(v_a: Array, s_a: Array, v_b: Array, s_b: Array) -> tuple[Array, Array]:
    """(v, s) = merge of two states: v_* [tokens, heads, D], s_* float32 [tokens, heads], base 2."""
    return _merge.merge(v_a, s_a, v_b, s_b, base=2, _names=_PAIR)


def merge_state_in_place(v: Array, s: Array, v_other: Array, s_other: Array, mask: Array | None = None) -> None:
    """(v, s) <- merge((v, s), (v_other, s_other)); rows of tokens whose mask (uint8 or bool
    [tokens]) is 0 are left untouched.  Base 2."""
    _merge.merge_inplace(v, s, v_other, s_other, mask=mask, base=2, _names=_INPLACE)


def merge_states(v: Array, s: Array) -> tuple[Array, Array]:
    """(v, s) = merge of S states: v [tokens, S, heads, D], s float32 [tokens, S, heads], base 2."""
    return _merge.merge_states(v, s, base=2, _names=_STATES)


def variable_length_merge_states(v: Array, s: Array, indptr: Array) -> tuple[Array, Array]:
    """(v, s) with row r the merge of states indptr[r] .. indptr[r+1]-1 of v [total_states, heads, D],
    s float32 [total_states, heads]; indptr int32 or int64 [rows + 1].  Base 2."""
    return _merge.merge_varlen(v, s, indptr, base=2, _names=_STATES)
