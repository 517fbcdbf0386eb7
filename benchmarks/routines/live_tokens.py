"""Serving at a capacity: a call sized for CAPACITY tokens that reads the live count from device
memory (num_tokens=, what a CUDA graph captured once replays at every batch), against the call
sized for the live tokens alone, per op, at 1, 17 and 256 live tokens of a capacity of 256: bf16
states of 32 heads x 128; merge_states and merge_share over 16 states, merge_varlen 16 a row.
The target (issue 38): the capacity's call at most the sized call + 0.3 us.  Each op runs plain and
with batch_invariant=True, and each pair is checked first: the capacity call's live rows are the
sized call's bits, which batch_invariant promises for every op (a failure), and a plain call only
where the plan's kernel for the live size is the capacity's (a difference reported).  CUDA graph replay (the count
written before the timing, read at every replay), input sets rotated past L2, the median of 3
alternations."""
import attnmerge
from attnmerge.bench.timing import input_sets

HEADS, HEAD_SIZE, CAPACITY, STATES = 32, 128, 256, 16
LIVE = (1, 17, 256)
OPS = ("merge", "merge_inplace", "merge_states", "merge_varlen", "merge_share")
TARGET_US = 0.3


def make(torch, op, device):
    """(inputs at the capacity, outputs at the capacity) of op: bf16 O, float32 LSEs."""
    t, h, d = CAPACITY, HEADS, HEAD_SIZE

    def o(*shape):
        return torch.randn(*shape, h, d, device=device, dtype=torch.bfloat16)

    def lse(*shape):
        return torch.randn(*shape, h, device=device)

    outputs = (torch.empty(t, h, d, device=device, dtype=torch.bfloat16), torch.empty(t, h, device=device))
    if op in ("merge", "merge_inplace"):
        return (o(t), lse(t), o(t), lse(t)), outputs
    if op == "merge_states":
        return (o(t, STATES), lse(t, STATES)), outputs
    if op == "merge_varlen":
        indptr = torch.arange(0, (t + 1) * STATES, STATES, device=device, dtype=torch.int32)
        return (o(t * STATES), lse(t * STATES), indptr), outputs
    return (o(t), lse(t, STATES)), outputs  # merge_share: this rank's O, every rank's LSE


def call(op, inputs, outputs, live, count=None, invariant=False):
    """op on the capacity's arrays with the live count read from `count`, or (count None) on the
    live tokens' slices; into outputs (their live rows); batch_invariant=invariant."""
    if count is not None:
        out, out_lse, kw = *outputs, dict(num_tokens=count, batch_invariant=invariant)
    else:
        out, out_lse, kw = outputs[0][:live], outputs[1][:live], dict(batch_invariant=invariant)
        # the first live rows: the variable-length merge's offsets (every state kept), else every array's
        inputs = (*inputs[:2], inputs[2][:live + 1]) if op == "merge_varlen" else tuple(x[:live] for x in inputs)
    if op == "merge":
        attnmerge.merge(*inputs, out=out, out_lse=out_lse, **kw)
    elif op == "merge_inplace":  # writes its first state: no outputs
        attnmerge.merge_inplace(*inputs, **kw)
    elif op == "merge_states":
        attnmerge.merge_states(*inputs, out=out, out_lse=out_lse, **kw)
    elif op == "merge_varlen":
        attnmerge.merge_varlen(*inputs, out=out, out_lse=out_lse, **kw)
    else:
        attnmerge.merge_share(*inputs, 3, out=out, out_lse=out_lse, **kw)


def agree(torch, op, inputs, outputs, live, count, invariant):
    """Whether the capacity call's live rows are the sized call's bits (the in-place merge: on
    copies of its state, each merged once)."""
    def written(count):
        """The live rows of what one call wrote, on fresh copies (its state, for the in-place merge;
        else outputs poisoned with NaN)."""
        ins = tuple(x.clone() for x in inputs) if op == "merge_inplace" else inputs
        outs = tuple(torch.full_like(x, float("nan")) for x in outputs)
        call(op, ins, outs, live, count, invariant)
        return tuple(x[:live] for x in (ins[:2] if op == "merge_inplace" else outs))

    def bits(x):
        return x.view(torch.int16 if x.dtype == torch.bfloat16 else torch.int32)

    return all(torch.equal(bits(g), bits(w)) for g, w in zip(written(count), written(None)))


def run(args, runner):
    torch = runner.torch
    rows, failed = [], 0
    for op, invariant, live in runner.cases([(op, inv, live) for op in OPS for inv in (False, True) for live in LIVE]):
        count = torch.tensor([live], dtype=torch.int32, device=runner.device)
        first = make(torch, op, runner.device)
        nbytes = sum(x.numel() * x.element_size() for x in (*first[0], *first[1]))
        sets = [first] + [make(torch, op, runner.device) for _ in range((runner.count or input_sets(nbytes)) - 1)]
        ok = agree(torch, op, *sets[0], live, count, invariant)
        failed += invariant and not ok

        def capacity(inputs, outputs):
            call(op, inputs, outputs, live, count, invariant)

        def sized(inputs, outputs):
            call(op, inputs, outputs, live, None, invariant)

        cap_us, sized_us = runner.time((capacity, sized), sets)
        rows.append(dict(op=op, batch_invariant=invariant, capacity=CAPACITY, live=live, heads=HEADS, head_size=HEAD_SIZE, capacity_us=cap_us,
                         sized_us=sized_us, over_us=cap_us - sized_us, within_target=cap_us - sized_us <= TARGET_US,
                         bits_agree=ok))
        differ = "" if ok else "; the live rows DIFFER" if invariant else "; the live rows differ (another kernel)"
        print(f"{op + (' invariant' if invariant else ''):<23} {live:>3} of {CAPACITY} live: capacity {cap_us:.2f} us, "
              f"sized {sized_us:.2f} us, +{cap_us - sized_us:.2f} us (target +{TARGET_US}){differ}", flush=True)
    return dict(routine="live_tokens", rows=rows, failed=failed)
