"""Per-group FP8 outputs (bf16 states, 32 heads, head size 128, groups of 128): what a merge that
writes FP8 and its group scales costs against the same merge into bf16, and against that merge
followed by the quantization an engine would otherwise launch (vLLM's per_token_group_quant_fp8, as
one kernel that torch.compile fuses: read bf16, write FP8 and scales):

    merge(...)                                  into bf16
    merge(..., group_size=128)                  FP8 and scales, fused (kRows or, at decode, kStates)
    merge(...); quant(out)                      into bf16, then a fused group quantization

The same for merge_states at decode (16 tokens, 64 states: the state-parallel kernel) and for long
inputs (8192 tokens, 4 states).  Before timing, the fused call's scales are checked against the
separate quantization's.  CUDA graph replay, input sets rotated past L2, the median of 3
alternations.  Needs Triton for torch.compile; without it the quantization runs eagerly, several
kernels, and the line says so."""
import torch

import attnmerge

from .common import pair_sets, stacked_sets

HEADS, HEAD_SIZE, GROUP = 32, 128, 128
FP8 = torch.float8_e4m3fn
PAIR_TOKENS = (1, 16, 512, 8192)
STATES_CASES = [(16, 64), (8192, 4)]  # (tokens, S)


def group_quant(x):
    """per_token_group_quant_fp8 of x [tokens, heads, head_size]: (FP8 values, float32 scales
    [tokens, heads, head_size / GROUP]), scale = max(amax, 1e-10) / 448."""
    g = x.float().unflatten(-1, (-1, GROUP))
    scale = g.abs().amax(-1, keepdim=True).clamp(min=1e-10) / 448.0
    return (g * (1.0 / scale)).clamp(-448.0, 448.0).to(FP8).flatten(-2), scale.squeeze(-1)


def compiled_quant(runner):
    """(the quantization as one compiled kernel, "compiled"), or its eager chain and why: no Triton,
    or under --check-cpu (no compile there)."""
    if runner.check_cpu:
        return group_quant, "eager (--check-cpu)"
    try:
        quant = torch.compile(group_quant, dynamic=False)
        quant(torch.randn(2, HEADS, HEAD_SIZE, device="cuda", dtype=torch.bfloat16))
        return quant, "compiled"
    except Exception as e:  # no Triton: the eager chain of kernels
        return group_quant, f"eager ({type(e).__name__})"


def check(fused_scales, out):
    """The fused call's scales are the separate quantization's, but for out's rounding to bf16."""
    _, scales = group_quant(out)
    torch.testing.assert_close(fused_scales, scales, rtol=2**-7, atol=0)  # out: the merge rounded to bf16


def pairs(runner, quant, how):
    device = runner.device
    rows = []
    for tokens in runner.cases(PAIR_TOKENS):
        sets = [(*s, torch.empty(tokens, HEADS, HEAD_SIZE, device=device, dtype=FP8),
                 torch.empty(tokens, HEADS, HEAD_SIZE // GROUP, device=device))
                for s in pair_sets(torch, tokens, HEADS, HEAD_SIZE, device, runner.count)]
        o_a, lse_a, o_b, lse_b, out, out_lse, q, scales = sets[0]
        attnmerge.merge(o_a, lse_a, o_b, lse_b, out=out, out_lse=out_lse)
        attnmerge.merge(o_a, lse_a, o_b, lse_b, out=q, out_lse=out_lse, group_scales=scales, group_size=GROUP)
        check(scales, out)

        def bf16(o_a, lse_a, o_b, lse_b, out, out_lse, q, scales):
            attnmerge.merge(o_a, lse_a, o_b, lse_b, out=out, out_lse=out_lse)

        def fused(o_a, lse_a, o_b, lse_b, out, out_lse, q, scales):
            attnmerge.merge(o_a, lse_a, o_b, lse_b, out=q, out_lse=out_lse, group_scales=scales, group_size=GROUP)

        def separate(o_a, lse_a, o_b, lse_b, out, out_lse, q, scales):
            attnmerge.merge(o_a, lse_a, o_b, lse_b, out=out, out_lse=out_lse)
            quant(out)

        a, b, c = runner.time((bf16, fused, separate), sets)
        rows.append(dict(op="merge", tokens=tokens, bf16_us=a, group_fp8_us=b, bf16_then_quant_us=c, quant=how))
        print(f"merge {tokens} tokens: bf16 {a:.2f} us, per-group FP8 {b:.2f} us ({b / a:.3f}x), bf16 then a "
              f"{how} quantization {c:.2f} us ({c / b:.3f}x the fused call)", flush=True)
    return rows


def states(runner, quant, how):
    device = runner.device
    rows = []
    for tokens, s in runner.cases(STATES_CASES):
        sets = [(o, lse, out, out_lse, torch.empty(tokens, HEADS, HEAD_SIZE, device=device, dtype=FP8),
                 torch.empty(tokens, HEADS, HEAD_SIZE // GROUP, device=device))
                for o, lse, out, out_lse in stacked_sets(torch, tokens, s, HEADS, HEAD_SIZE, device, runner.count)]
        o, lse, out, out_lse, q, scales = sets[0]
        attnmerge.merge_states(o, lse, out=out, out_lse=out_lse)
        kernel = attnmerge.last_launch()["kernel"]
        attnmerge.merge_states(o, lse, out=q, out_lse=out_lse, group_scales=scales, group_size=GROUP)
        assert attnmerge.last_launch()["kernel"] == kernel  # groups change no choice of the plan
        check(scales, out)

        def bf16(o, lse, out, out_lse, q, scales):
            attnmerge.merge_states(o, lse, out=out, out_lse=out_lse)

        def fused(o, lse, out, out_lse, q, scales):
            attnmerge.merge_states(o, lse, out=q, out_lse=out_lse, group_scales=scales, group_size=GROUP)

        def separate(o, lse, out, out_lse, q, scales):
            attnmerge.merge_states(o, lse, out=out, out_lse=out_lse)
            quant(out)

        a, b, c = runner.time((bf16, fused, separate), sets)
        rows.append(dict(op="merge_states", tokens=tokens, states=s, kernel=kernel, bf16_us=a, group_fp8_us=b,
                         bf16_then_quant_us=c, quant=how))
        print(f"merge_states {tokens} tokens, S = {s} ({kernel}): bf16 {a:.2f} us, per-group FP8 {b:.2f} us "
              f"({b / a:.3f}x), bf16 then a {how} quantization {c:.2f} us ({c / b:.3f}x the fused call)", flush=True)
    return rows


def run(args, runner):
    quant, how = compiled_quant(runner)
    return pairs(runner, quant, how) + states(runner, quant, how)
