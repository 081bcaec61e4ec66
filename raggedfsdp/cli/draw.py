"""Draw one BufferLayout: ranks as rows, tensors as coloured spans, padding hatched."""

from __future__ import annotations

from pathlib import Path

from raggedfsdp.planner import BufferLayout


def draw_layout(
    layout: BufferLayout, path: str | Path, *, title: str = "", max_ranks: int = 32
) -> int:
    """Write a PNG of ``layout``'s first ``max_ranks`` ranks; return how many were drawn.

    Args:
        layout: the layout to draw.
        path: the PNG file to write.
        title: the figure title. Default: the layout's summary.
        max_ranks: ranks drawn (the first ones). Default 32.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    ranks = min(layout.world_size, max_ranks)
    S = layout.shard_size
    cmap = plt.get_cmap("tab20")
    colour = {t.name: cmap(i % 20) for i, t in enumerate(layout.tensors)}
    fig, ax = plt.subplots(figsize=(11, 1.2 + 0.28 * ranks))
    for r in range(ranks):
        ax.barh(r, S, left=0, height=0.8, color="white", hatch="///", edgecolor="0.6", lw=0)
        for name in layout.rank_tensors(r):
            lo, hi = layout.shard_range(name, r)
            t = layout[name]
            ax.barh(r, hi - lo, left=lo, height=0.8, color=colour[name], lw=0)
            if t.members > 1:  # member gaps: hatch them
                start = t.offset
                for i in range(t.members - 1):
                    g0 = start + i * t.member_stride + t.member_numel
                    g1 = g0 + t.member_gap
                    lo2, hi2 = max(g0, r * S), min(g1, (r + 1) * S)
                    if lo2 < hi2:
                        ax.barh(
                            r,
                            hi2 - lo2,
                            left=lo2 - r * S,
                            height=0.8,
                            color="white",
                            hatch="///",
                            edgecolor="0.6",
                            lw=0,
                        )
    ax.set_ylim(ranks - 0.5, -0.5)
    ax.set_xlim(0, S)
    ax.set_ylabel("rank")
    ax.set_xlabel(f"element within the rank's shard (S = {S:,})")
    shown = list(colour.items())[:20]
    handles = [Patch(color=c, label=n) for n, c in shown]
    handles.append(Patch(facecolor="white", hatch="///", edgecolor="0.6", label="padding"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7)
    more = f" (first {ranks} of {layout.world_size} ranks)" if ranks < layout.world_size else ""
    ax.set_title((title or layout.describe()) + more, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return ranks
