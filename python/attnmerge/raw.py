"""The raw layer: merge buffers given as integer pointers, strides and dtype names, for callers
that manage memory themselves (C extensions, custom allocators, CUDA Python)."""
from __future__ import annotations

from typing import Literal, Tuple

from . import _C
from ._call import OPS, options
from ._types import Base, PairBase

# (ptr, dtype name, stride_token, stride_head) and (ptr, stride_0, stride_1), strides in elements.
ODesc = Tuple[int, str, int, int]
LseDesc = Tuple[int, int, int]


def merge(*, tokens: int, heads: int, head_size: int, out: ODesc, o_a: ODesc, lse_a: LseDesc, o_b: ODesc,
          lse_b: LseDesc, out_lse: LseDesc | None = None, device: Literal["cpu"] | int, stream: int = 0,
          base: PairBase = "e", out_base: Base | None = None, a_tokens: int | None = None,
          lse_heads_first: bool = False, pdl: bool = False, check_pointers: bool = True) -> None:
    """Two-way merge over raw pointers.

    out, o_a, o_b: (ptr, dtype, stride_token, stride_head) with dtype "float32", "float16" or
        "bfloat16" ("float8_e4m3fn" for out too), strides in elements; head_size is contiguous.  o_a
        has a_tokens tokens when a_tokens is given (see attnmerge.merge), else `tokens`.
    lse_a, lse_b, out_lse: (ptr, stride_0, stride_1), float32, laid out [tokens, heads], or
        [heads, tokens] with lse_heads_first=True; out_lse may be None.
    device: "cpu" for host memory, else the CUDA device ordinal that owns every pointer.
    stream: a cudaStream_t as an int (0: the legacy default stream); ignored on the CPU.
    base: "e" or 2, or (lse_a's, lse_b's); out_base: out_lse's (None: lse_a's).  pdl: programmatic
        dependent launch (see attnmerge.merge).
    check_pointers: ask CUDA where each pointer lives before the merge (an error for memory of
        another device, or device memory handed to the CPU path); False trusts `device` and skips
        one query per pointer (~0.1 us each), for callers that know where their buffers are.
    """
    opt = options(OPS["merge"], base=base, out_base=out_base, a_tokens=a_tokens, pdl=pdl,
                  flags=_C.LSE_HEADS_FIRST if lse_heads_first else 0)
    if device == "cpu":
        dev = -1
    elif isinstance(device, int) and not isinstance(device, bool) and device >= 0:
        dev = device
    else:
        raise ValueError(f"device: expected 'cpu' or a CUDA device ordinal >= 0, got {device!r}")
    _C.merge_raw(tokens, heads, head_size, out, out_lse, o_a, lse_a, o_b, lse_b, opt, dev, stream, not check_pointers)
