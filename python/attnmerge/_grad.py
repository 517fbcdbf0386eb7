"""The gradient formulas the frameworks compute themselves, in their own array namespace (torch or
jax.numpy): the sinks' (which have no backward kernel: a reduction per head) and merge_share's
(elementwise work over its one O).  The merges' own gradients are libattnmerge's backward."""
from __future__ import annotations

import math


def sink_gradient(xp, sink, out, out_lse, grad_out, grad_out_lse, base):
    """The gradient of a merge's sinks [heads], in the array namespace `xp`, every array float32
    (the caller's to convert).  The sink is a state whose O is 0, so per row b^(sink - LSE) (dLSE -
    ln(b) <dO, O>), summed over the rows of each head; zero where the sink is empty (+-inf) or of no
    weight, whatever dO holds.  out [rows, heads, head_size], out_lse [rows, heads]: the forward's
    results; grad_out_lse may be None (0); base "e", 2 or "2".  The states' gradients need nothing
    of the sink: out and out_lse count it."""
    ln_b = math.log(2.0) if base in (2, "2") else 1.0
    p = xp.exp((sink - out_lse) * ln_b)
    p = xp.where(xp.isinf(sink), xp.zeros_like(p), p)
    row = -ln_b * (grad_out * out).sum(-1)
    if grad_out_lse is not None:
        row = row + grad_out_lse
    return xp.where(p != 0, p * row, xp.zeros_like(p)).sum(0)


def share_gradient(xp, o, lse, index, out_lse, grad_out, grad_out_lse, base, states_axis):
    """The gradients (of o, of lse) of merge_share, in the array namespace `xp`, every array float32
    (the caller's to convert).  With p_i = b^(lse_i - LSE) and g = ln(b) p_index <dO, o> per row:
    do = p_index dO, dlse_i = p_i (dLSE - g), plus g for i = index; zero for a state of no weight (an
    empty one, or any of an all-empty row), whatever dO and its O hold.  o and lse as the forward
    took them (lse with its states at `states_axis`), out_lse [tokens, heads]: the forward's merged
    LSE; grad_out_lse may be None (0); base "e", 2 or "2".  A sink's gradient is sink_gradient's."""
    ln_b = math.log(2.0) if base in (2, "2") else 1.0
    move = getattr(xp, "movedim", None) or xp.moveaxis  # torch's moveaxis has no vmap rule of its own
    lse = move(lse, states_axis, 1)  # [tokens, S, heads]
    p = xp.exp((lse - out_lse[:, None]) * ln_b)
    p = xp.where(xp.isinf(lse), xp.zeros_like(p), p)
    p_own = p[:, index]
    g = xp.where(p_own != 0, ln_b * p_own * (grad_out * o).sum(-1), xp.zeros_like(p_own))
    row = -g if grad_out_lse is None else grad_out_lse - g
    grad_lse = xp.where(p != 0, p * row[:, None], xp.zeros_like(p))
    grad_lse = xp.concatenate([grad_lse[:, :index], grad_lse[:, index:index + 1] + g[:, None],
                               grad_lse[:, index + 1:]], axis=1)
    grad_o = xp.where(p_own[..., None] != 0, p_own[..., None] * grad_out, xp.zeros_like(grad_out))
    return grad_o, move(grad_lse, 1, states_axis)
