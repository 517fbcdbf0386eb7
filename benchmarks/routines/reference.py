"""The float64 references the peer comparisons check every implementation against before timing it,
written from the formula (for the states i of one (token, head) row: m = max_i lse_i,
w_i = base^(lse_i - m), W = sum_i w_i, O = sum_i (w_i / W) O_i, LSE = m + log_base W; a row of no
states, or of empty ones (LSE -inf, or +inf, which counts as empty), gives O = 0 and LSE = -inf),
and the errors and tolerances of a result against them."""
from __future__ import annotations

import math

import torch

# A unit in the last place of 1.0 in each output type: a merged O is rounded once to it.
ULP = {"bfloat16": 2.0**-7, "float16": 2.0**-10, "float32": 2.0**-23}
# Relative L2 tolerance of O by output type (the project's tests' tolerances).
RTOL = {"bfloat16": 8e-3, "float16": 1e-3, "float32": 1e-6}
# The LSE is float32 and may come from fast exp2/log2 approximations: relative to max(1, |LSE|).
LSE_RTOL = 1e-5


def merge(o, lse, base="e"):
    """(O [N, H, D], LSE [N, H]) in float64 of the merge of o [N, S, H, D] with lse [N, S, H]."""
    exp = torch.exp2 if base == 2 else torch.exp
    log = torch.log2 if base == 2 else torch.log
    lse = lse.double()
    lse = torch.where(lse == math.inf, -math.inf, lse)
    m = lse.amax(1) if lse.shape[1] else lse.new_full((lse.shape[0], lse.shape[2]), -math.inf)
    live = torch.isfinite(m)
    m_safe = torch.where(live, m, 0.0)
    w = exp(lse - m_safe[:, None])  # exactly 0 for an empty state
    total = w.sum(1)
    safe = torch.where(total > 0, total, 1.0)
    out = (w[..., None] * o.double()).sum(1) / safe[..., None]
    out = torch.where((total > 0)[..., None], out, 0.0)
    return out, torch.where(total > 0, m_safe + log(safe), -math.inf)


def merge_varlen(o, lse, indptr, rows, base="e"):
    """merge() of each of the first `rows` rows of a variable-length call: row r merges states
    indptr[r] .. indptr[r + 1] - 1 of o [total, H, D], lse [total, H]."""
    ip = indptr[: rows + 1].long().cpu()
    counts = (ip[1:] - ip[:-1]).tolist()
    width = max(counts + [0])
    # the rows padded to `width` states with empty ones (LSE -inf, O 0): merge() of the padding is
    # the merge of the row
    h, d = o.shape[1], o.shape[2]
    po = o.new_zeros(rows, width, h, d, dtype=torch.float64)
    pl = lse.new_full((rows, width, h), -math.inf, dtype=torch.float64)
    for r, (start, k) in enumerate(zip(ip[:-1].tolist(), counts)):
        po[r, :k] = o[start:start + k].double()
        pl[r, :k] = lse[start:start + k].double()
    return merge(po, pl, base)


def errors(o, lse, ref_o, ref_lse, dtype):
    """The errors of (o, lse) against the reference, and whether they are within the tolerances:
    O within 2 units in the last place of its type of the largest |O| (it is rounded once) and within
    the type's relative L2 tolerance; LSE within LSE_RTOL of max(1, |LSE|).  A NaN is an infinite error;
    equal infinities none."""
    o, lse = o.double(), lse.double()
    ref_o, ref_lse = ref_o.to(o.device), ref_lse.to(o.device)
    d_o = _diff(o, ref_o)
    d_lse = _diff(lse, ref_lse)
    o_max = ref_o.abs().max().item() if ref_o.numel() else 0.0
    finite = ref_lse[torch.isfinite(ref_lse)]
    lse_max = finite.abs().max().item() if finite.numel() else 0.0
    norm = ref_o.norm().item()
    rel = (o - ref_o).norm().item() / norm if norm > 0 else d_o
    e = dict(o_err=d_o, o_rel_l2=rel, lse_err=d_lse, tol_o=2 * ULP[dtype] * max(1.0, o_max),
             tol_rel_l2=RTOL[dtype], tol_lse=LSE_RTOL * max(1.0, lse_max))
    e["ok"] = e["o_err"] <= e["tol_o"] and rel <= e["tol_rel_l2"] and e["lse_err"] <= e["tol_lse"]
    return e


def _diff(x, ref):
    if x.numel() == 0:
        return 0.0
    d = torch.where(x == ref, 0.0, (x - ref).abs())
    return torch.where(torch.isnan(d), math.inf, d).max().item()

