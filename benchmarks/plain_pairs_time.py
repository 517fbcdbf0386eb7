"""Which (input, output) dtype pairs earn the plain two-way kernels (PlainPairSource) on a GPU: the
two-way merge of 32 heads x 128 for each pair, the plan's plain kernel against the general one
(PairSource) that the same call takes with its merged LSE in another base (out_base=2: the general
kernel's instructions, which multiply every LSE by a factor whatever it is), at decode and long
sizes.  CUDA graph replay, input sets rotated past L2, the median of 3 alternations; ratios above 1
mean the plain kernel is faster.  A pair without plain kernels (not in kPlainPairs, plan.h) says
so: add it there and rebuild to time it.  Needs PyTorch with CUDA.

    python benchmarks/plain_pairs_time.py
"""

import torch

import attnmerge
from attnmerge.bench.timing import alternated_graph_us, input_sets

HEADS, HEAD_SIZE = 32, 128
TOKENS = (1, 16, 512, 8192)
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "float8_e4m3fn": torch.float8_e4m3fn}
PAIRS = [("bfloat16", "bfloat16"), ("float16", "float16"), ("float32", "float32"), ("float32", "bfloat16"),
         ("float32", "float16"), ("bfloat16", "float32"), ("float16", "float32"), ("bfloat16", "float16"),
         ("float16", "bfloat16"), ("bfloat16", "float8_e4m3fn"), ("float16", "float8_e4m3fn"),
         ("float32", "float8_e4m3fn")]


def sets(tokens, t_in, t_out):
    shape = (tokens, HEADS, HEAD_SIZE)
    nbytes = tokens * HEADS * HEAD_SIZE * (2 * t_in.itemsize + t_out.itemsize)
    return [(torch.randn(shape, device="cuda").to(t_in), torch.randn(tokens, HEADS, device="cuda"),
             torch.randn(shape, device="cuda").to(t_in), torch.randn(tokens, HEADS, device="cuda"),
             torch.empty(shape, device="cuda", dtype=t_out), torch.empty(tokens, HEADS, device="cuda"))
            for _ in range(input_sets(nbytes))]


def main():
    print(f"{'in -> out':30} " + " ".join(f"{t:>22}" for t in TOKENS))
    print(f"{'':30} " + " ".join(f"{'plain  general  ratio':>22}" for _ in TOKENS))
    for name_in, name_out in PAIRS:
        cells = []
        for tokens in TOKENS:
            s = sets(tokens, DTYPES[name_in], DTYPES[name_out])

            def plain(o_a, lse_a, o_b, lse_b, out, out_lse):
                attnmerge.merge(o_a, lse_a, o_b, lse_b, out=out, out_lse=out_lse)

            def general(o_a, lse_a, o_b, lse_b, out, out_lse):
                attnmerge.merge(o_a, lse_a, o_b, lse_b, out=out, out_lse=out_lse, out_base=2)

            plain(*s[0])
            if attnmerge.last_launch()["kernel"] != "rows_plain":  # a pair not in plan.h's kPlainPairs
                cells.append("no plain kernel")
                continue
            general(*s[0])
            assert attnmerge.last_launch()["kernel"] == "rows", attnmerge.last_launch()
            a, b = alternated_graph_us(torch, (plain, general), s)
            cells.append(f"{a:6.2f} {b:7.2f} {b / a:6.3f}")
        print(f"{name_in + ' -> ' + name_out:30} " + " ".join(f"{c:>22}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
