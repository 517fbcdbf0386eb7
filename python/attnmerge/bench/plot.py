"""The sweep's plot: GB/s against bytes moved, one line per (implementation, op, dtype)."""
from __future__ import annotations

import sys

def plot(result, path):
    """A PNG of GB/s against bytes moved at `path`: a line per (implementation, op) and, where the
    result holds several dtypes, per dtype; the reference that moves the same bytes (torch.add on the
    GPU, np.add on float32 on the CPU); the roofline.  Returns the lines' labels (None without
    matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("bench: matplotlib is not installed: no plot", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(8, 5))
    rows = result["rows"]
    several = len({r.get("dtype") for r in rows}) > 1  # else one line per (implementation, op)
    lines = sorted({(r["impl"], r["op"], r.get("dtype") if several else None) for r in rows}, key=str)
    for impl, op, dtype in lines:
        pts = sorted((r["bytes"], r["GBps"]) for r in rows
                     if (r["impl"], r["op"], r.get("dtype") if several else None) == (impl, op, dtype) and "GBps" in r)
        if pts:
            ax.plot([p[0] / 1e6 for p in pts], [p[1] for p in pts], "o-" if op == "merge" else "s--",
                    label=", ".join(x for x in (impl, op, dtype) if x))
    # What a plain streaming kernel reaches at each size: torch.add moving the same bytes.
    same = sorted({(r["bytes"], r["bytes"] / r["add_us"] / 1e3) for r in rows if r.get("add_us")})
    if same:
        ax.plot([p[0] / 1e6 for p in same], [p[1] for p in same], ":", color="gray",
                label="torch.add moving the same bytes")
    # The CPU's: np.add on float32 arrays of each shape, 2 reads and 1 write.
    np_add = sorted({(r["np_add_bytes"], r["np_add_GBps"]) for r in rows if r.get("np_add_bytes")})
    if np_add:
        ax.plot([p[0] / 1e6 for p in np_add], [p[1] for p in np_add], ":", color="gray",
                label="np.add on float32 (2 reads, 1 write)")
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


