"""What a ``raggedfsdp.tools.simulate`` result reads as: the memory trackers' cross-check,
the memory timeline plot, and one row of a sweep (both systems side by side). Shared by
``python -m raggedfsdp simulate`` and ``benchmarks/scale.py``."""

from __future__ import annotations

from typing import Any

from raggedfsdp.tools.simulate import ROLES

__all__ = ["ROLE_COLORS", "cross_check", "mesh_text", "plot_timeline", "sweep_row"]


def mesh_text(mesh: dict[str, int] | None, world: int) -> str:
    """``mesh replicate=R x shard=S`` (HSDP) or ``N ranks`` (a 1-D mesh)."""
    return (
        f"mesh replicate={mesh['replicate']} x shard={mesh['shard']}" if mesh else f"{world} ranks"
    )


def cross_check(r: dict[str, Any]) -> float | None:
    """FSDPMemTracker's peak relative to MemTracker's, minus 1 (None if it did not run)."""
    fmt = r.get("fsdp_mem_tracker") or {}
    if "peak" not in fmt or not r["peak"].get("total"):
        return None
    return fmt["peak"].get("total", 0) / r["peak"]["total"] - 1


ROLE_COLORS = {
    "sharded_params": "#4c72b0",
    "unsharded_params": "#8fb0e0",
    "comm_buffers": "#dd8452",
    "sharded_grads": "#55a868",
    "unsharded_grads": "#a6d9a0",
    "optimizer": "#8172b3",
    "activations": "#c44e52",
    "temporaries": "#f0a0a0",
}


def plot_timeline(results: list[dict[str, Any]], path: str) -> None:
    """Allocated bytes by role over the measured step's ops, one panel per result (same
    y-scale), stacked; the phases and the peak marked. Needs matplotlib (the ``train``
    extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    top = max(r["peak"].get("total", 0) for r in results)
    unit, scale = ("GiB", 2**30) if top >= 2**30 else ("MiB", 2**20)
    fig, axes = plt.subplots(
        1, len(results), figsize=(6.5 * len(results), 4.2), sharey=True, squeeze=False
    )
    for ax, r in zip(axes[0], results):
        t = r["timeline"]
        ax.stackplot(
            t["at"],
            [[b / scale for b in t["roles"][role]] for role in ROLES],
            labels=[role.replace("_", " ") for role in ROLES],
            colors=[ROLE_COLORS[role] for role in ROLES],
            step="post",
        )
        for phase, op in t["phases"].items():
            right = op > 0.8 * t["ops"]  # a label near the end goes on the line's left
            ax.axvline(op, color="0.3", lw=0.8, ls=":")
            ax.annotate(phase, (op, 1), xycoords=("data", "axes fraction"), fontsize=8,
                        xytext=(-2 if right else 2, -10), textcoords="offset points",
                        ha="right" if right else "left")  # fmt: skip
        peak = r["peak"].get("total", 0) / scale
        ax.axhline(peak, color="k", lw=0.6)
        ax.set_title(f"{r['config']['system']}: peak {peak:,.2f} {unit}", fontsize=10)
        ax.set_xlabel(f"op of the measured step (of {t['ops']:,})")
        ax.set_xlim(0, max(t["ops"] - 1, 1))
    axes[0][0].set_ylabel(f"allocated per rank ({unit})")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles[::-1], labels[::-1], loc="center right", fontsize=8)
    c = results[0]["config"]
    fig.suptitle(
        f"{c['model']}, {c['layers']} blocks, rank {c['rank']} of {c['world']} "
        f"({mesh_text(results[0]['mesh'], c['world'])}), batch {c['batch']} x {c['seq']}",
        fontsize=11,
    )
    fig.tight_layout(rect=(0, 0, 0.86, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _gathered(r: dict[str, Any]) -> int:
    """Bytes all-gathered on this rank in the measured step: the outputs, padding included."""
    return r["comm"].get("all_gather", [0, 0, 0])[2]


def sweep_row(ours: dict[str, Any], fsdp2: dict[str, Any]) -> dict[str, Any]:
    """One world size of a sweep: raggedfsdp's and FSDP2's ``simulate`` results of the same
    configuration, side by side.

    Returns:
        ``model``, ``world``, ``layers``, ``params`` (elements), and for each system
        (``_raggedfsdp``, ``_fsdp2``): ``peak`` (bytes per rank over the whole step),
        ``gathered`` (bytes all-gathered per step, padding included) and ``padding``
        (padding elements over parameter elements); ``peak_ratio`` and
        ``gathered_ratio`` (raggedfsdp / FSDP2).

    Raises:
        ValueError: the results are not raggedfsdp's and FSDP2's of one configuration.
    """
    a, b = ours["config"], fsdp2["config"]
    if (a["system"], b["system"]) != ("raggedfsdp", "fsdp2") or {**a, "system": 0} != {
        **b,
        "system": 0,
    }:
        raise ValueError(
            "sweep_row: pass raggedfsdp's result, then FSDP2's, of the same configuration; "
            f"got {a['system']} then {b['system']}, configs differing in "
            f"{sorted(k for k in a if a[k] != b.get(k) and k != 'system')}"
        )
    row: dict[str, Any] = {
        "model": a["model"],
        "world": a["world"],
        "layers": a["layers"],
        "params": ours["params"],
    }
    for name, r in (("raggedfsdp", ours), ("fsdp2", fsdp2)):
        row[f"peak_{name}"] = r["peak"].get("total", 0)
        row[f"gathered_{name}"] = _gathered(r)
        row[f"padding_{name}"] = r["layout"]["padding_elems"] / max(r["layout"]["numel"], 1)
    for what in ("peak", "gathered"):
        theirs = row[f"{what}_fsdp2"]
        row[f"{what}_ratio"] = row[f"{what}_raggedfsdp"] / theirs if theirs else None
    return row
