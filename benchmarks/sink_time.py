"""merge_states with and without a sink on a GPU (bf16 O [tokens, S, 32, 128]): what attention
sinks cost where they are given.  CUDA graph replay, input sets rotated past L2, the median of 3
alternations.  Needs PyTorch with CUDA.

    python benchmarks/sink_time.py
"""

import torch

import attnmerge
from attnmerge.bench.timing import alternated_graph_us, stacked_sets

HEADS, HEAD_SIZE = 32, 128
CASES = [(16, 16), (16, 64), (16, 128), (128, 16), (128, 64), (8192, 2), (8192, 4), (8192, 64)]  # (tokens, S)


def main():
    for tokens, states in CASES:
        sets = stacked_sets(torch, tokens, states, HEADS, HEAD_SIZE)
        sink = torch.randn(HEADS, device="cuda")

        def plain(o, lse, out, out_lse):
            attnmerge.merge_states(o, lse, out=out, out_lse=out_lse)

        def sunk(o, lse, out, out_lse):
            attnmerge.merge_states(o, lse, out=out, out_lse=out_lse, sink=sink)

        a, b = alternated_graph_us(torch, (plain, sunk), sets)
        print(f"{tokens} tokens, S = {states}: no sink {a:.2f} us, a sink {b:.2f} us, ratio {b / a:.3f}", flush=True)


if __name__ == "__main__":
    main()
