"""merge_states with and without a sink (bf16 O [tokens, S, 32, 128]): what attention sinks cost
where they are given.  CUDA graph replay, input sets rotated past L2, the median of 3 alternations."""
import attnmerge

from .common import stacked_sets

HEADS, HEAD_SIZE = 32, 128
CASES = [(16, 16), (16, 64), (16, 128), (128, 16), (128, 64), (8192, 2), (8192, 4), (8192, 64)]  # (tokens, S)


def run(args, runner):
    torch = runner.torch
    rows = []
    for tokens, states in runner.cases(CASES):
        sets = stacked_sets(torch, tokens, states, HEADS, HEAD_SIZE, runner.device, runner.count)
        sink = torch.randn(HEADS, device=runner.device)

        def plain(o, lse, out, out_lse):
            attnmerge.merge_states(o, lse, out=out, out_lse=out_lse)

        def sunk(o, lse, out, out_lse):
            attnmerge.merge_states(o, lse, out=out, out_lse=out_lse, sink=sink)

        a, b = runner.time((plain, sunk), sets)
        rows.append(dict(tokens=tokens, states=states, plain_us=a, sink_us=b))
        print(f"{tokens} tokens, S = {states}: no sink {a:.2f} us, a sink {b:.2f} us, ratio {b / a:.3f}", flush=True)
    return rows
