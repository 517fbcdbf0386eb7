"""Which (input, output) dtype pairs earn the plain two-way kernels (PlainPairSource): the two-way
merge of 32 heads x 128 for each pair, the plan's plain kernel against the general one (PairSource)
that the same call takes with its merged LSE in another base (out_base=2: the general kernel's
instructions, which multiply every LSE by a factor whatever it is), at decode and long sizes.  CUDA
graph replay, input sets rotated past L2, the median of 3 alternations; ratios above 1 mean the
plain kernel is faster.  A pair without plain kernels (not in kPlainPairs, plan.h) says so: add it
there and rebuild to time it."""
import attnmerge
from attnmerge.bench.timing import input_sets

HEADS, HEAD_SIZE = 32, 128
TOKENS = (1, 16, 512, 8192)
PAIRS = [("bfloat16", "bfloat16"), ("float16", "float16"), ("float32", "float32"), ("float32", "bfloat16"),
         ("float32", "float16"), ("bfloat16", "float32"), ("float16", "float32"), ("bfloat16", "float16"),
         ("float16", "bfloat16"), ("bfloat16", "float8_e4m3fn"), ("float16", "float8_e4m3fn"),
         ("float32", "float8_e4m3fn")]


def sets(runner, tokens, t_in, t_out):
    torch, device = runner.torch, runner.device
    shape = (tokens, HEADS, HEAD_SIZE)
    nbytes = tokens * HEADS * HEAD_SIZE * (2 * t_in.itemsize + t_out.itemsize)
    return [(torch.randn(shape, device=device).to(t_in), torch.randn(tokens, HEADS, device=device),
             torch.randn(shape, device=device).to(t_in), torch.randn(tokens, HEADS, device=device),
             torch.empty(shape, device=device, dtype=t_out), torch.empty(tokens, HEADS, device=device))
            for _ in range(runner.count or input_sets(nbytes))]


def launched(runner, kernel):
    """The plan ran `kernel` (on the GPU; the CPU path launches none)."""
    if runner.device == "cuda":
        assert attnmerge.last_launch()["kernel"] == kernel, attnmerge.last_launch()


def run(args, runner):
    torch = runner.torch
    tokens_list = runner.cases(TOKENS)
    rows = []
    print(f"{'in -> out':30} " + " ".join(f"{t:>22}" for t in tokens_list))
    print(f"{'':30} " + " ".join(f"{'plain  general  ratio':>22}" for _ in tokens_list))
    for name_in, name_out in PAIRS:
        cells = []
        for tokens in tokens_list:
            s = sets(runner, tokens, getattr(torch, name_in), getattr(torch, name_out))

            def plain(o_a, lse_a, o_b, lse_b, out, out_lse):
                attnmerge.merge(o_a, lse_a, o_b, lse_b, out=out, out_lse=out_lse)

            def general(o_a, lse_a, o_b, lse_b, out, out_lse):
                attnmerge.merge(o_a, lse_a, o_b, lse_b, out=out, out_lse=out_lse, out_base=2)

            plain(*s[0])
            if runner.device == "cuda" and attnmerge.last_launch()["kernel"] != "rows_plain":
                cells.append("no plain kernel")  # a pair not in plan.h's kPlainPairs
                continue
            general(*s[0])
            launched(runner, "rows")
            a, b = runner.time((plain, general), s)
            rows.append(dict(dtype_in=name_in, dtype_out=name_out, tokens=tokens, plain_us=a, general_us=b))
            cells.append(f"{a:6.2f} {b:7.2f} {b / a:6.3f}")
        print(f"{name_in + ' -> ' + name_out:30} " + " ".join(f"{c:>22}" for c in cells), flush=True)
    return rows
