"""Mixed LSE bases (bf16, 32 heads, head size 128): what a call whose LSEs come in two bases costs
against one in a single base, and against converting the LSE first (a launch of its own):

    merge(..., base=2)                   one base: the plain two-way kernel
    merge(..., base=(2, "e"))            b's LSE converted as it is read: the general kernel
    lse_b * log2(e); merge(..., base=2)  the conversion a caller would launch without mixed bases
    merge_states(..., base=2) / (..., out_base="e")   the merged LSE converted as it is stored

CUDA graph replay, input sets rotated past L2, the median of 3 alternations."""
import math

import attnmerge

from .common import pair_sets, stacked_sets

HEADS, HEAD_SIZE = 32, 128
PAIR_TOKENS = (1, 16, 512, 8192)
STATES_CASES = [(16, 64), (8192, 4)]  # (tokens, S)


def pairs(runner):
    torch = runner.torch
    log2e = 1.0 / math.log(2.0)
    rows = []
    for tokens in runner.cases(PAIR_TOKENS):
        # and a buffer for lse_b converted
        sets = [(*s, torch.empty(tokens, HEADS, device=runner.device))
                for s in pair_sets(torch, tokens, HEADS, HEAD_SIZE, runner.device, runner.count)]

        def one(o_a, lse_a, o_b, lse_b, out, out_lse, conv):
            attnmerge.merge(o_a, lse_a, o_b, lse_b, out=out, out_lse=out_lse, base=2)

        def mixed(o_a, lse_a, o_b, lse_b, out, out_lse, conv):
            attnmerge.merge(o_a, lse_a, o_b, lse_b, out=out, out_lse=out_lse, base=(2, "e"))

        def converted(o_a, lse_a, o_b, lse_b, out, out_lse, conv):
            torch.mul(lse_b, log2e, out=conv)
            attnmerge.merge(o_a, lse_a, o_b, conv, out=out, out_lse=out_lse, base=2)

        a, b, c = runner.time((one, mixed, converted), sets)
        rows.append(dict(op="merge", tokens=tokens, one_base_us=a, mixed_us=b, converted_first_us=c))
        print(f"merge {tokens} tokens: one base {a:.2f} us, mixed {b:.2f} us ({b / a:.3f}x), converted first "
              f"{c:.2f} us ({c / a:.3f}x)", flush=True)
    return rows


def states(runner):
    torch = runner.torch
    rows = []
    for tokens, s in runner.cases(STATES_CASES):
        sets = stacked_sets(torch, tokens, s, HEADS, HEAD_SIZE, runner.device, runner.count)

        def one(o, lse, out, out_lse):
            attnmerge.merge_states(o, lse, out=out, out_lse=out_lse, base=2)

        def other_out(o, lse, out, out_lse):
            attnmerge.merge_states(o, lse, out=out, out_lse=out_lse, base=2, out_base="e")

        a, b = runner.time((one, other_out), sets)
        rows.append(dict(op="merge_states", tokens=tokens, states=s, one_base_us=a, out_base_e_us=b))
        print(f"merge_states {tokens} tokens, S = {s}: one base {a:.2f} us, out_base 'e' {b:.2f} us "
              f"({b / a:.3f}x)", flush=True)
    return rows


def run(args, runner):
    return pairs(runner) + states(runner)
