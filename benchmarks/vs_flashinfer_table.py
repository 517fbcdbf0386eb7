"""The README's vs-FlashInfer table from the JSON of `python benchmarks/run.py vs_flashinfer --json F` (op
names attnmerge's; runs of the earlier harness, which used FlashInfer's, render alike).

    python benchmarks/vs_flashinfer_table.py benchmarks/results/h200-vs-flashinfer.json
"""

import json
import math
import sys

OPS = {"merge_state": "merge", "merge_state_in_place": "merge_inplace", "merge_states": "merge_states",
       "variable_length_merge_states": "merge_varlen"}


def rows(run):
    """(op, case, MB, attnmerge us, FlashInfer us or None, floor us) per case, in the run's order."""
    for r in run["rows"]:
        am = r["impls"].get("attnmerge", {}).get("us")
        fi = r["impls"].get("flashinfer_cuda", {}).get("us")
        if am is not None:
            yield OPS.get(r["op"], r["op"]), r["case"], r["bytes"] / 1e6, am, fi, r["floor_us"]


def main(path: str) -> None:
    with open(path) as f:
        run = json.load(f)
    meta = run["meta"]
    print(f"{meta['device']}, {meta['flashinfer']}, roofline {meta['roofline_GBps']:.0f} GB/s, floor "
          f"{meta['floor']['us']} us + bytes / {meta['floor']['TBps']} TB/s")
    print("| op | case | MB | attnmerge us | FlashInfer us | FlashInfer / attnmerge | attnmerge / floor |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    ratios = {}
    for op, case, mb, am, fi, floor in rows(run):
        mb_text = f"{mb:.2f}" if mb < 0.1 else f"{mb:.1f}" if mb < 50 else f"{mb:.0f}"
        fi_text, ratio_text = "-", "-"
        if fi is not None:
            fi_text, ratio_text = f"{fi:.2f}", f"{fi / am:.2f}"
            ratios.setdefault(op, []).append(fi / am)
        print(f"| {op} | {case} | {mb_text} | {am:.2f} | {fi_text} | {ratio_text} | {am / floor:.2f} |")
    for op, xs in ratios.items():
        gmean = math.exp(sum(math.log(x) for x in xs) / len(xs))
        print(f"{op}: geometric mean {gmean:.2f}x over {len(xs)} cases, min {min(xs):.2f}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/h200-vs-flashinfer.json")
