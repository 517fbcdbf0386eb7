"""attnmerge for JAX: the merges as XLA FFI custom calls (``jax.ffi``), traceable and usable under
``jax.jit``, on the GPU (on the stream XLA gives the call) and on the CPU.

    import jax, attnmerge.jax
    out, out_lse = jax.jit(attnmerge.jax.merge)(o_a, lse_a, o_b, lse_b)

Importing this module registers the FFI targets ``attnmerge_merge`` and ``attnmerge_merge_states``
for the CUDA and CPU platforms.  Arguments are checked by libattnmerge when the call runs (under
``jax.jit``: when the compiled function runs); its message, naming the argument, comes back in
the error XLA raises.  Under ``jax.vmap`` the call runs once per batch element.
"""
from __future__ import annotations

import ctypes
import os
from typing import Any

import jax
import jax.numpy as jnp

from . import _XLA_HOW, _XLA_LIB
from ._merge import lse_flags
from ._types import Base

__all__ = ["merge", "merge_states"]


def _register():
    if not os.path.exists(_XLA_LIB):
        raise ImportError(f"attnmerge.jax: this attnmerge was built without the JAX extension ({_XLA_LIB} "
                          f"is missing); to get it, {_XLA_HOW}")
    lib = ctypes.CDLL(_XLA_LIB)
    for op in ("merge", "merge_states"):
        for platform, suffix in (("CUDA", "cuda"), ("cpu", "host")):
            handler = getattr(lib, f"attnmerge_xla_{op}_{suffix}")
            jax.ffi.register_ffi_target(f"attnmerge_{op}", jax.ffi.pycapsule(handler), platform=platform)
    return lib


_lib = _register()


def _base2(base: Base) -> bool:
    return lse_flags(base) != 0  # raises ValueError naming `base`


def _out_dtype(out_dtype, like):
    return like.dtype if out_dtype is None else jnp.dtype(out_dtype)


def merge(o_a: jax.Array, lse_a: jax.Array, o_b: jax.Array, lse_b: jax.Array, *, base: Base = "e",
          out_dtype: Any = None) -> tuple[jax.Array, jax.Array]:
    """Merge two attention states: (out, out_lse) = merge((o_a, lse_a), (o_b, lse_b)).

    o_a, o_b: [tokens, heads, head_size] float32, float16 or bfloat16 (one dtype).
    lse_a, lse_b: float32 [tokens, heads], natural log (base="e") or base 2 (base=2).
    out_dtype: the dtype of out (default that of o_b): float32, float16, bfloat16 or
        float8_e4m3fn (unscaled).
    Returns (out [tokens, heads, head_size], out_lse float32 [tokens, heads], in the input's base).
    """
    out = jax.ShapeDtypeStruct(jnp.shape(o_b), _out_dtype(out_dtype, o_b))
    out_lse = jax.ShapeDtypeStruct(jnp.shape(lse_b), jnp.float32)
    call = jax.ffi.ffi_call("attnmerge_merge", (out, out_lse), vmap_method="sequential")
    merged, merged_lse = call(o_a, lse_a, o_b, lse_b, base2=_base2(base))
    return merged, merged_lse


def merge_states(o: jax.Array, lse: jax.Array, *, base: Base = "e", out_dtype: Any = None) -> tuple[jax.Array, jax.Array]:
    """Merge S states in one pass, each input read once.

    o: [tokens, S, heads, head_size] float32, float16 or bfloat16; lse: float32 [tokens, S, heads]
    (FlashInfer's layout; an all-gather's [S, tokens, ...] is ``jnp.swapaxes(x, 0, 1)`` of it).
    Returns (out [tokens, heads, head_size], out_lse float32 [tokens, heads]); S = 0 gives O = 0 and
    LSE = -inf.
    """
    shape = jnp.shape(o)
    if len(shape) != 4:
        raise ValueError(f"o: expected 4 dimensions, got {len(shape)} (shape {list(shape)})")
    out = jax.ShapeDtypeStruct((shape[0], shape[2], shape[3]), _out_dtype(out_dtype, o))
    out_lse = jax.ShapeDtypeStruct((shape[0], shape[2]), jnp.float32)
    call = jax.ffi.ffi_call("attnmerge_merge_states", (out, out_lse), vmap_method="sequential")
    merged, merged_lse = call(o, lse, base2=_base2(base))
    return merged, merged_lse
