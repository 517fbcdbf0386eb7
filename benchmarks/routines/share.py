"""merge_share: one rank's share of the merge of S states (bf16 O [tokens, 32, 128], LSEs an
all-gather's [S, tokens, 32]), against a two-way merge of the same rows (two O read, one written)
and the streaming floor (2.04 us + bytes / 4.37 TB/s).  CUDA graph replay, input sets rotated past
L2, the median of 3 alternations."""
import attnmerge
from attnmerge.bench.timing import input_sets

from .floor import floor_us

HEADS, HEAD_SIZE = 32, 128
CASES = [(1, 8), (16, 8), (16, 64), (128, 8), (2048, 8), (8192, 4)]  # (tokens, S)


def run(args, runner):
    torch, device = runner.torch, runner.device
    rows = []
    for tokens, states in runner.cases(CASES):
        # one O read and one written, S LSEs read and one written
        nbytes = tokens * HEADS * HEAD_SIZE * 2 * 2 + tokens * (states + 1) * HEADS * 4
        sets = []
        for _ in range(runner.count or input_sets(nbytes)):
            o = torch.randn(tokens, HEADS, HEAD_SIZE, device=device, dtype=torch.bfloat16)
            lse = torch.randn(states, tokens, HEADS, device=device)
            sets.append((o, lse, torch.empty_like(o), torch.empty(tokens, HEADS, device=device)))

        def share(o, lse, out, out_lse):
            attnmerge.merge_share(o, lse, states - 1, out=out, out_lse=out_lse, states_axis=0)

        def pair(o, lse, out, out_lse):
            attnmerge.merge(o, lse[0], o, lse[-1], out=out, out_lse=out_lse)

        a, b = runner.time((share, pair), sets)
        floor = floor_us(nbytes)
        rows.append(dict(tokens=tokens, states=states, bytes=nbytes, share_us=a, two_way_us=b, floor_us=floor))
        print(f"{tokens} tokens, S = {states}: merge_share {a:.2f} us, two-way merge {b:.2f} us, "
              f"floor {floor:.2f} us ({nbytes / 1e6:.2f} MB)", flush=True)
    return rows
