"""merge_states on the layouts an exchange leaves, against the stacked layout at the same states:
bf16 O of cp states, [tokens, 32, D] each, merged into one [tokens, 32, D].

    stacked      [T, cp, H, D] and [T, cp, H]      (states_axis=1, FlashInfer's: the baseline)
    cp_first     [cp, T, H, D] and [cp, T, H]      (0: an all-gather's or all_to_all_single's)
    heads_first  [T, H, cp, D] and [T, H, cp]      (2: an all-to-all that lands by heads)
    records_d8   [cp, T, H, D + 8] records, the float32 LSE bit-cast into lanes D and D + 1, 6 lanes
                 of padding: rows 16-byte aligned (one all-to-all moves O and LSE together)
    records_d2   [cp, T, H, D + 2] records, the LSE in the 2 lanes after D (vLLM's packing): rows
                 only 4-byte aligned, so the merge reads them 2 lanes at a time

each passed as views, never copied (the records as o = buf[..., :D] and lse = buf[..., D:D + 2]
viewed as float32).  The target: every layout but records_d2 within 3% of the stacked one (the
ratio is layout / stacked); records_d2 is reported as what it costs.  Each layout's result is
checked first against a float32 merge of the stacked states (the first 256 tokens).  CUDA graph
replay, input sets rotated past L2, the median of 3 alternations."""
import statistics

import attnmerge

from .common import forms_against_first

HEADS = 32
TARGET = 1.03  # a layout's time over the stacked layout's, at most (records_d2 aside)
LAYOUTS = ("stacked", "cp_first", "heads_first", "records_d8", "records_d2")
CHECKED_TOKENS = 256


def ints(text):
    return tuple(int(x) for x in text.split(","))


def add_arguments(p):
    p.add_argument("--tokens", type=ints, default=(8, 64, 512, 8192), help="tokens (default 8,64,512,8192)")
    p.add_argument("--cp", type=ints, default=(2, 4, 8), help="states, the context-parallel size (default 2,4,8)")
    p.add_argument("--head-sizes", type=ints, default=(128, 512), help="head sizes (default 128,512)")


def records(torch, o, lse, extra_lanes):
    """[cp, T, H, D + extra_lanes] records of the states o [cp, T, H, D], lse [cp, T, H], and the
    views merge_states reads: (buffer, o view, lse view)."""
    d = o.shape[-1]
    buf = torch.zeros(*o.shape[:-1], d + extra_lanes, dtype=o.dtype, device=o.device)
    buf[..., :d] = o
    lse_view = buf[..., d:d + 2].view(torch.float32)[..., 0]
    lse_view.copy_(lse)
    return buf, buf[..., :d], lse_view


def make_set(torch, device, tokens, cp, head_size):
    """One input set: every layout's (o, lse, states_axis) over the same states, and the outputs."""
    o = torch.randn(cp, tokens, HEADS, head_size, device=device, dtype=torch.bfloat16)
    lse = torch.randn(cp, tokens, HEADS, device=device) * 3
    heads_first = (o.permute(1, 2, 0, 3).contiguous(), lse.permute(1, 2, 0).contiguous())
    d8, d2 = records(torch, o, lse, 8), records(torch, o, lse, 2)
    inputs = {
        "stacked": (o.transpose(0, 1).contiguous(), lse.transpose(0, 1).contiguous(), 1),
        "cp_first": (o, lse, 0),
        "heads_first": (*heads_first, 2),
        "records_d8": (d8[1], d8[2], 0),
        "records_d2": (d2[1], d2[2], 0),
    }
    outs = {name: (torch.empty(tokens, HEADS, head_size, device=device, dtype=torch.bfloat16),
                   torch.empty(tokens, HEADS, device=device)) for name in LAYOUTS}
    return inputs, outs, (o, lse)


def merge(inputs, outs, name):
    o, lse, axis = inputs[name]
    attnmerge.merge_states(o, lse, out=outs[name][0], out_lse=outs[name][1], states_axis=axis)


def error(torch, states, out, out_lse):
    """The largest |out - ref| and |out_lse - ref| over the first CHECKED_TOKENS tokens, ref a
    float32 merge of the states [cp, T, H, D]."""
    o, lse = (x[:, :CHECKED_TOKENS].float() for x in states)
    ref_lse = torch.logsumexp(lse, 0)
    ref = ((lse - ref_lse).exp()[..., None] * o).sum(0)
    n = ref.shape[0]
    return (float((out[:n].float() - ref).abs().max()), float((out_lse[:n] - ref_lse).abs().max()))


def run(args, runner):
    torch = runner.torch
    cases = [(t, cp, d) for d in args.head_sizes for cp in args.cp for t in args.tokens]
    rows, failed = forms_against_first(
        runner, cases, HEADS, LAYOUTS, lambda t, cp, d: make_set(torch, runner.device, t, cp, d),
        lambda inputs, name: merge(*inputs[:2], name),
        lambda inputs, name: error(torch, inputs[2], *inputs[1][name]))
    over = [(r["tokens"], r["cp"], r["head_size"], name) for r in rows for name in LAYOUTS[1:-1]
            if r[f"{name}_ratio"] > TARGET]
    print(f"layouts: {len(rows)} cases, {len(over)} layout timings past {TARGET}x the stacked one"
          + (f" ({', '.join(f'{n} at {t}x{c}x{d}' for t, c, d, n in over)})" if over else "")
          + f"; records_d2 median {statistics.median(r['records_d2_ratio'] for r in rows):.3f}x; {failed} failed")
    return dict(routine="layouts", rows=rows, failed=failed)

