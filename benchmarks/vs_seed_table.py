"""The README's performance table from the JSON of `python benchmarks/run.py vs_seed --json F`.

    python benchmarks/vs_seed_table.py benchmarks/results/h200-vs-seed.json
"""

import json
import sys

SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def main(path: str) -> None:
    with open(path) as f:
        run = json.load(f)
    print(f"{run['device']}, roofline {run['roofline_GBps']:.0f} GB/s")
    print("| tokens x heads x head_size, dtype | MB moved | seed us | attnmerge us | seed / attnmerge "
          "| % roofline | eager us: seed | attnmerge |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in run["rows"]:
        mb = r["MB"]
        mb_text = f"{mb:.2f}" if mb < 0.1 else f"{mb:.1f}" if mb < 50 else f"{mb:.0f}"
        roof = r["ours_roof_pct"]
        roof_text = f"{roof:.1f}" if roof < 10 else f"{roof:.0f}"
        print(f"| {r['tokens']} x {r['heads']} x {r['head_size']} {SHORT.get(r['dtype'], r['dtype'])} | {mb_text} "
              f"| {r['seed_graph_us']:.2f} | {r['ours_graph_us']:.2f} | {r['seed_graph_us'] / r['ours_graph_us']:.3f} "
              f"| {roof_text} | {r['seed_eager_us']:.2f} | {r['ours_eager_us']:.2f} |")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/h200-vs-seed.json")
