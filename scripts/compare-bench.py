"""Two runs of `python -m attnmerge bench --json F` side by side (say the CUDA 12 and the CUDA 13
build on one GPU): attnmerge's graph-replay time per row of each, their ratio, and the geometric
mean per op.  Above 1, the second run is faster.

    python scripts/compare-bench.py cu13.json cu12.json
"""

from __future__ import annotations

import json
import math
import sys
from collections import defaultdict

KEY = ("op", "tokens", "heads", "head_size", "dtype", "states")


def rows(path):
    with open(path) as f:
        data = json.load(f)
    return data.get("device", "?"), {tuple(r.get(k) for k in KEY): r["graph_us"] for r in data["rows"]
                                     if r.get("impl") == "attnmerge" and r.get("graph_us")}


def main(argv):
    if len(argv) != 2:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    (dev_a, a), (dev_b, b) = rows(argv[0]), rows(argv[1])
    print(f"{argv[0]} ({dev_a}) against {argv[1]} ({dev_b}): attnmerge graph us")
    print("| op | tokens x heads x head_size, dtype, states | first us | second us | first / second |")
    print("| --- | --- | ---: | ---: | ---: |")
    logs = defaultdict(list)
    for key in sorted(set(a) & set(b), key=str):
        op, t, h, d, dtype, s = key
        ratio = a[key] / b[key]
        logs[op].append(math.log(ratio))
        print(f"| {op} | {t} x {h} x {d} {dtype}, S={s} | {a[key]:.2f} | {b[key]:.2f} | {ratio:.3f} |")
    for op, values in sorted(logs.items()):
        print(f"{op}: geometric mean {math.exp(sum(values) / len(values)):.3f} over {len(values)} rows, "
              f"min {math.exp(min(values)):.3f}, max {math.exp(max(values)):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
