"""The gradient formulas the frameworks compute themselves, in their own array namespace (torch or
jax.numpy): the sinks' (which have no backward kernel: a reduction per head), merge_share's
(elementwise work over its one O) and softmax statistics' (the backward kernels take LSEs).  The
merges' own gradients are libattnmerge's backward."""
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


def _ln(base):
    return math.log(2.0) if base in (2, "2") else 1.0


def stats_lse(xp, lse, total, valid, base):
    """An LSE argument as the forward merge read it, for its backward (which takes LSEs), in the
    array namespace `xp`: with softmax sums `total` (None: `lse` is an LSE) max + log(sum) in base
    `base`, -inf where the sum is 0; -inf where `valid` (a bool array broadcast against lse; None:
    every state) is False.  An empty part gets zero gradients from the backward, whatever it held."""
    if total is not None:
        log = xp.log(xp.where(total == 0, xp.ones_like(total), total)) / _ln(base)
        lse = xp.where(total == 0, xp.full_like(lse, -math.inf), lse + log)
    if valid is not None:
        lse = xp.where(valid, lse, xp.full_like(lse, -math.inf))
    return lse


def stats_gradient(xp, grad_lse, total, base):
    """The gradient of softmax sums `total` from that of the LSE stats_lse made of them (the max's
    is that LSE's own): d sum = d lse / (sum ln(b)), 0 where d lse is (an empty part, a state not
    valid, a sum of 0)."""
    zero = grad_lse == 0
    return xp.where(zero, xp.zeros_like(grad_lse), grad_lse / (xp.where(zero, xp.ones_like(total), total) * _ln(base)))
