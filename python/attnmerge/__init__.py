"""attnmerge: merge partial attention states (O, LSE) on CUDA GPUs and CPUs.

A partial state is an output O, shape [tokens, heads, head_size], and its log-sum-exp LSE, float32
[tokens, heads], over one part of the keys.  Merging gives the attention over all of them:
per (token, head) row, m = max lse_i, w_i = exp(lse_i - m), W = sum w_i,
O = sum (w_i / W) O_i, LSE = m + log W.  +inf LSE marks an empty part; all parts empty give
O = 0 and LSE = -inf; a part of weight zero is never read; a NaN LSE makes its row NaN.

Ops: merge (two states), merge_inplace (into the first, optionally masked), merge_states (S
stacked states in one pass), merge_varlen (a per-row number of states given by indptr) and
merge_share (one state's share of a merge, for context parallelism's reduce-scatter); the
gradients of merge, merge_states and merge_varlen: merge_backward, merge_states_backward and
merge_varlen_backward.  Arrays come from PyTorch, CuPy, JAX, Numba or NumPy (or as raw pointers:
`attnmerge.raw`); the vLLM, FlashInfer and SGLang conventions live in `attnmerge.compat`.  With torch
imported (before or after attnmerge), the ops are also registered as torch.ops.attnmerge.*, which
these functions become under torch.compile and torch.export (attnmerge._torch_ops).
"""
from __future__ import annotations

from . import _C, _torch_hook, raw  # noqa: F401 - attnmerge.raw after `import attnmerge`
from ._build import build_info, cmake_dir, include_dir, last_launch, library_path
from .exchange import Exchange, SymmetricExchange, exchange_pad_bytes
from ._merge import (merge, merge_backward, merge_inplace, merge_share, merge_states, merge_states_backward,
                     merge_varlen, merge_varlen_backward)

_torch_hook.install()  # torch.ops.attnmerge.*, when torch is (or gets) imported

__version__ = _C.version_string()
__all__ = ["merge", "merge_inplace", "merge_states", "merge_varlen", "merge_share", "merge_backward",
           "merge_states_backward", "merge_varlen_backward", "Exchange", "SymmetricExchange", "exchange_pad_bytes",
           "build_info", "last_launch", "cmake_dir", "include_dir",
           "library_path", "__version__"]
