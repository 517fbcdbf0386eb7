"""merge_states of an all-gather's [cp, T, H, D] states given as LSEs (the baseline), as (max, sum)
softmax statistics (TensorRT-LLM's Helix: [cp, T, H, 2] float32 read as two strided views), with a
valid mask of empty shards (int32 KV lengths [T, cp], vLLM's), and both: bf16 O of cp states,
[tokens, 32, D] each, merged into one [tokens, 32, D].  The ratio is form / LSEs at the same O;
the forms read 4 (a sum) or 4 / H (a length) more bytes per row and state, and take each state's
LSE one at a time (merge_kernels.cuh: StateRead::kSettled).  Each form's result is checked first
against a float32 merge of the states as the form gives them (the first 256 tokens).  CUDA graph
replay, input sets rotated past L2, the median of 3 alternations."""
import statistics

import attnmerge
from .common import forms_against_first
from .layouts import add_arguments  # noqa: F401  (the same cases: --tokens, --cp, --head-sizes)

HEADS = 32
FORMS = ("lse", "stats", "valid", "stats_valid")
CHECKED_TOKENS = 256


def make_set(torch, device, tokens, cp, head_size):
    """One input set: every form's (lse argument, valid) over the same O, and the outputs.  A
    quarter of the (token, state) pairs are empty shards (length 0) in the forms with valid."""
    o = torch.randn(cp, tokens, HEADS, head_size, device=device, dtype=torch.bfloat16)
    lse = torch.randn(cp, tokens, HEADS, device=device) * 3
    stats = torch.empty(cp, tokens, HEADS, 2, device=device)
    stats[..., 1] = torch.rand(cp, tokens, HEADS, device=device) * 30 + 1
    stats[..., 0] = lse - stats[..., 1].log()  # the same LSEs as statistics
    lengths = (torch.rand(tokens, cp, device=device) * 100).int() * (torch.rand(tokens, cp, device=device) > 0.25)
    pair = (stats[..., 0], stats[..., 1])
    inputs = {"lse": (lse, None), "stats": (pair, None), "valid": (lse, lengths), "stats_valid": (pair, lengths)}
    outs = {name: (torch.empty(tokens, HEADS, head_size, device=device, dtype=torch.bfloat16),
                   torch.empty(tokens, HEADS, device=device)) for name in FORMS}
    return o, inputs, outs, (o, lse, lengths)


def merge(o, inputs, outs, name):
    lse, valid = inputs[name]
    attnmerge.merge_states(o, lse, out=outs[name][0], out_lse=outs[name][1], states_axis=0, valid=valid)


def error(torch, states, name, out, out_lse):
    """The largest |out - ref| and |out_lse - ref| over the first CHECKED_TOKENS tokens, ref a
    float32 merge of the states [cp, T, H, D] (the empty shards left out where the form has valid)."""
    o, lse, lengths = (x[:, :CHECKED_TOKENS] if x.dim() > 2 else x[:CHECKED_TOKENS] for x in states)
    o, lse = o.float(), lse.clone()
    if "valid" in name:
        lse[(lengths == 0).T] = -float("inf")
    ref_lse = torch.logsumexp(lse, 0)
    w = torch.nan_to_num((lse - ref_lse).exp(), nan=0.0)
    ref = (w[..., None] * o).sum(0)
    n = ref.shape[0]
    fin = torch.isfinite(ref_lse)
    return (float((out[:n].float() - ref).abs().max()), float((out_lse[:n] - ref_lse)[fin].abs().max()))


def run(args, runner):
    torch = runner.torch
    cases = [(t, cp, d) for d in args.head_sizes for cp in args.cp for t in args.tokens]
    rows, failed = forms_against_first(
        runner, cases, HEADS, FORMS, lambda t, cp, d: make_set(torch, runner.device, t, cp, d),
        lambda inputs, name: merge(*inputs[:3], name),
        lambda inputs, name: error(torch, inputs[3], name, *inputs[2][name]))
    print(f"state_forms: {len(rows)} cases; median ratios "
          + ", ".join(f"{n} {statistics.median(r[f'{n}_ratio'] for r in rows):.3f}x" for n in FORMS[1:])
          + f"; {failed} failed")
    return dict(routine="state_forms", rows=rows, failed=failed)
