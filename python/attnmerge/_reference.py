"""A float64 NumPy reference of the merge, written from the formula; the self-test's oracle."""
import numpy as np


def merge_reference(o_a, lse_a, o_b, lse_b, base="e"):
    """(O, LSE) in float64 for O [tokens, heads, D] and LSE [tokens, heads] of two states."""
    lse = np.stack([np.asarray(lse_a, np.float64), np.asarray(lse_b, np.float64)])
    o = np.stack([np.asarray(o_a, np.float64), np.asarray(o_b, np.float64)])
    lse = np.where(lse == np.inf, -np.inf, lse)
    exp, log = (np.exp2, np.log2) if base == 2 else (np.exp, np.log)
    m = lse.max(axis=0)
    live = np.isfinite(m)
    m_safe = np.where(live, m, 0.0)
    w = np.where(np.isneginf(lse), 0.0, exp(lse - m_safe))
    total = w.sum(axis=0)
    scale = np.where(total > 0, w / np.where(total > 0, total, 1.0), 0.0)
    out = np.where(scale[..., None] > 0, o * scale[..., None], 0.0).sum(axis=0)
    out_lse = np.where(total > 0, m_safe + log(np.where(total > 0, total, 1.0)), -np.inf)
    nan = np.isnan(lse).any(axis=0)
    out[nan] = np.nan
    out_lse[nan] = np.nan
    return out, out_lse
