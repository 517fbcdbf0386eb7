"""Block-scaled outputs (bf16 states, 32 heads, head size 128): each fused format against the same
merge into bf16 followed by the quantization a user would otherwise launch (the format's quantizer
written in torch, as one kernel that torch.compile fuses: read bf16, write the values and scales):

    merge(..., block_format="mxfp8")            E4M3 and a UE8M0 scale per 32, fused
    merge(..., block_format="nvfp4")            two E2M1 per byte and an E4M3 scale per 16, fused
    merge(...); quant(out)                      into bf16, then the compiled quantizer

for the two-way merge at 1 to 8192 tokens (row-major and swizzled scales) and for merge_states at
decode (16 tokens, 64 states).  Before timing, the fused call's values and scales are checked
bit for bit against the separate quantizer's, on the same inputs with every state but the first
empty (whose merge is the first state exactly, whatever the kernel's arithmetic).  At 8192
tokens each fused call's share of the roofline (torch.add on bf16) for the bytes it moves is
printed.  CUDA graph replay, input sets rotated past L2, the median of 3 alternations."""
import torch

import attnmerge
from attnmerge.bench.sweep import roofline_gbps

from .common import pair_sets, stacked_sets

HEADS, HEAD_SIZE = 32, 128
PAIR_TOKENS = (1, 8, 32, 128, 512, 2048, 8192)
STATES_CASES = [(16, 64)]  # (tokens, S)
FORMATS = ("mxfp8", "nvfp4")
E8M0_RCP_BIAS = 254  # 1 / 2^(byte - 127) = 2^(127 - byte): the float32 exponent field 254 - byte


def mx_quant(x):
    """MXFP8 of x [tokens, heads, head_size]: (E4M3 values, UE8M0 bytes [tokens, heads * D / 32]),
    the OCP rule (2^(floor(log2 amax) - 8)), as torchao's to_mx computes it."""
    g = x.float().reshape(x.shape[0], -1, 32)
    amax = g.abs().amax(-1, keepdim=True)
    e = (amax.view(torch.int32) >> 23) & 0xFF
    byte = torch.where(torch.isfinite(amax), (e - 8).clamp(min=0), 255)
    rcp = ((E8M0_RCP_BIAS - byte) << 23).view(torch.float32)
    values = (g * rcp).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)  # saturating, as the references
    return values.reshape(x.shape), byte.to(torch.uint8).squeeze(-1)


def nvfp4_quant(x):
    """NVFP4 of x (global scale 1): (bytes of two E2M1 values [tokens, heads, head_size / 2], E4M3
    scales [tokens, heads * D / 16]), as torchao's nvfp4_quantize computes them."""
    g = x.float().reshape(x.shape[0], -1, 16)
    scale = (g.abs().amax(-1, keepdim=True) / 6.0).clamp(2.0**-6, 448.0).to(torch.float8_e4m3fn)
    q = g * (1.0 / scale.float())
    a = q.abs().clamp(max=6.0)
    code = sum((a > t).to(torch.uint8) if i % 2 == 0 else (a >= t).to(torch.uint8)
               for i, t in enumerate((0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)))
    code = code | ((q.view(torch.int32) >> 28) & 8).to(torch.uint8)
    code = code.reshape(x.shape[0], -1)
    packed = (code[:, 0::2] | (code[:, 1::2] << 4)).reshape(x.shape[0], x.shape[1], -1)
    return packed, scale.view(torch.uint8).squeeze(-1)


QUANT = {"mxfp8": mx_quant, "nvfp4": nvfp4_quant}


def compiled(runner):
    """({format: its quantizer as one compiled kernel}, how), or the eager chains and why."""
    if runner.check_cpu:
        return dict(QUANT), "eager (--check-cpu)"
    try:
        quants = {k: torch.compile(f, dynamic=False) for k, f in QUANT.items()}
        for f in quants.values():
            f(torch.randn(2, HEADS, HEAD_SIZE, device="cuda", dtype=torch.bfloat16))
        return quants, "compiled"
    except Exception as e:  # no Triton
        return dict(QUANT), f"eager ({type(e).__name__})"


def check(fmt, fused, passed):
    """The fused call's (values, row-major scales) against the separate quantizer's of the state it
    passed through: the same bytes."""
    values, scales = QUANT[fmt](passed)
    assert torch.equal(fused[1].reshape(scales.shape).view(torch.uint8), scales.view(torch.uint8)), \
        f"{fmt}: the fused scales differ from the separate quantization's"
    assert torch.equal(fused[0].view(torch.uint8), values.view(torch.uint8)), \
        f"{fmt}: the fused values differ from the separate quantization's"


def moved_bytes(tokens, fmt, states=2):
    """Bytes a fused call moves: the states' O (bf16) and LSEs, the values and scales written."""
    n = tokens * HEADS * HEAD_SIZE
    out = n if fmt == "mxfp8" else n // 2
    return states * (2 * n + 4 * tokens * HEADS) + out + n // (32 if fmt == "mxfp8" else 16) + 4 * tokens * HEADS


def pairs(runner, quants, how, roof):
    device = runner.device
    rows = []
    for tokens in runner.cases(PAIR_TOKENS):
        for fmt in FORMATS:
            for layout in ("row_major", "swizzled"):
                sets = [(*s, attnmerge.merge(*s[:4], block_format=fmt, scale_layout=layout)[::2])
                        for s in pair_sets(torch, tokens, HEADS, HEAD_SIZE, device, runner.count)]
                o_a, lse_a, o_b, lse_b = sets[0][:4]
                if layout == "row_major":
                    empty = torch.full_like(lse_b, float("-inf"))
                    check(fmt, attnmerge.merge(o_a, lse_a, o_b, empty, block_format=fmt)[::2], o_a)
                quant = quants[fmt]

                def bf16(o_a, lse_a, o_b, lse_b, out, out_lse, qs):
                    attnmerge.merge(o_a, lse_a, o_b, lse_b, out=out, out_lse=out_lse)

                def fused(o_a, lse_a, o_b, lse_b, out, out_lse, qs, fmt=fmt, layout=layout):
                    attnmerge.merge(o_a, lse_a, o_b, lse_b, out=qs[0], out_lse=out_lse, group_scales=qs[1],
                                    block_format=fmt, scale_layout=layout)

                def separate(o_a, lse_a, o_b, lse_b, out, out_lse, qs, quant=quant):
                    attnmerge.merge(o_a, lse_a, o_b, lse_b, out=out, out_lse=out_lse)
                    quant(out)

                a, b, c = runner.time((bf16, fused, separate), sets)
                share = moved_bytes(tokens, fmt) / b / 1e3 / roof if roof else float("nan")
                rows.append(dict(op="merge", tokens=tokens, format=fmt, layout=layout, bf16_us=a, fused_us=b,
                                 bf16_then_quant_us=c, quant=how, roofline_share=share))
                print(f"merge {tokens} tokens {fmt} {layout}: bf16 {a:.2f} us, fused {b:.2f} us, bf16 then a {how} "
                      f"quantization {c:.2f} us ({c / b:.2f}x the fused call)"
                      + (f"; fused at {share:.1%} of the roofline" if tokens == PAIR_TOKENS[-1] else ""), flush=True)
    return rows


def states(runner, quants, how):
    device = runner.device
    rows = []
    for tokens, s in runner.cases(STATES_CASES):
        for fmt in FORMATS:
            sets = [(o, lse, out, out_lse, attnmerge.merge_states(o, lse, block_format=fmt)[::2])
                    for o, lse, out, out_lse in stacked_sets(torch, tokens, s, HEADS, HEAD_SIZE, device, runner.count)]
            o, lse = sets[0][:2]
            first = torch.full_like(lse, float("-inf"))
            first[:, 0] = lse[:, 0]
            check(fmt, attnmerge.merge_states(o, first, block_format=fmt)[::2], o[:, 0])
            quant = quants[fmt]

            def bf16(o, lse, out, out_lse, qs):
                attnmerge.merge_states(o, lse, out=out, out_lse=out_lse)

            def fused(o, lse, out, out_lse, qs, fmt=fmt):
                attnmerge.merge_states(o, lse, out=qs[0], out_lse=out_lse, group_scales=qs[1], block_format=fmt)

            def separate(o, lse, out, out_lse, qs, quant=quant):
                attnmerge.merge_states(o, lse, out=out, out_lse=out_lse)
                quant(out)

            a, b, c = runner.time((bf16, fused, separate), sets)
            rows.append(dict(op="merge_states", tokens=tokens, states=s, format=fmt, bf16_us=a, fused_us=b,
                             bf16_then_quant_us=c, quant=how))
            print(f"merge_states {tokens} tokens, S = {s} {fmt}: bf16 {a:.2f} us, fused {b:.2f} us, bf16 then a "
                  f"{how} quantization {c:.2f} us ({c / b:.2f}x the fused call)", flush=True)
    return rows


def run(args, runner):
    quants, how = compiled(runner)
    roof = None if runner.check_cpu else roofline_gbps(torch)
    if roof:
        print(f"{torch.cuda.get_device_name()}: roofline (torch.add bf16) {roof:.0f} GB/s", flush=True)
    return pairs(runner, quants, how, roof) + states(runner, quants, how)
