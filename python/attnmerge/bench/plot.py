"""The sweep's plot: GB/s against bytes moved, one line per (implementation, op)."""
from __future__ import annotations

import sys

def plot(result, path):
    """A PNG of GB/s against bytes moved at `path`: a line per (implementation, op), torch.add moving
    the same bytes, the roofline.  Returns the lines' labels (None without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("bench: matplotlib is not installed: no plot", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(8, 5))
    for impl, op in sorted({(r["impl"], r["op"]) for r in result["rows"]}):
        pts = sorted((r["bytes"], r["GBps"]) for r in result["rows"]
                     if r["impl"] == impl and r["op"] == op and "GBps" in r)
        if pts:
            ax.plot([p[0] / 1e6 for p in pts], [p[1] for p in pts], "o-" if op == "merge" else "s--",
                    label=f"{impl}, {op}")
    # What a plain streaming kernel reaches at each size: torch.add moving the same bytes.
    same = sorted({(r["bytes"], r["bytes"] / r["add_us"] / 1e3) for r in result["rows"] if r.get("add_us")})
    if same:
        ax.plot([p[0] / 1e6 for p in same], [p[1] for p in same], ":", color="gray",
                label="torch.add moving the same bytes")
    if "roofline_GBps" in result:
        ax.axhline(result["roofline_GBps"], color="gray", linestyle="--", label="roofline (torch.add)")
    ax.set_xscale("log")
    ax.set_xlabel("MB moved")
    ax.set_ylabel("GB/s")
    ax.set_title(f"attnmerge on {result['device']}")
    ax.legend()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    print(f"bench: plot written to {path}")
    return [line.get_label() for line in ax.get_lines()]


