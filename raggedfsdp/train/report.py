"""What the application shows of a run: metrics files, loss curves, bytes and ratios.

``python -m raggedfsdp train`` writes ``metrics.jsonl`` (``read_metrics`` reads it back)
and ``loss.png`` (``plot_losses``); the demo and the benchmarks print bytes in MiB
(``mib``) and compare two systems as ratios measured in the same run (``ratio``).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

__all__ = ["mib", "plot_losses", "ratio", "read_metrics"]


def mib(nbytes: float, digits: int = 3) -> str:
    """``nbytes`` in MiB, with thousands separators: ``mib(3 << 20) == "3.000"``."""
    return f"{nbytes / 2**20:,.{digits}f}"


def ratio(a: float, b: float) -> float:
    """``a / b`` for comparing two measurements: ``0 / 0`` is 1 (the same), ``a / 0`` is inf."""
    if b:
        return a / b
    return 1.0 if not a else math.inf


def read_metrics(path: str | Path) -> list[dict]:
    """The records of a ``metrics.jsonl`` (one per step, validation lines included).

    A last line without its newline that does not parse is the record a killed job was
    writing: it is skipped. Any other line that does not parse raises ``ValueError``.
    """
    text = Path(path).read_text()
    lines = text.splitlines()
    records = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except ValueError:
            if i == len(lines) - 1 and not text.endswith("\n"):
                break  # torn by a job killed while writing it
            raise
    return records


def plot_losses(runs: dict[str, Path], png: Path, title: str) -> None:
    """Train (and validation) loss curves of several runs in one PNG (needs matplotlib).

    Args:
        runs: ``{label: path of the run's metrics.jsonl}``.
        png: the file to write.
        title: the plot's title.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    styles = ["-", "--", ":", "-."]
    for (name, path), style in zip(runs.items(), styles):
        rows = read_metrics(path)
        ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], style, label=f"{name} train")
        val = [r for r in rows if "val_loss" in r]
        if val:
            ax.plot(
                [r["step"] for r in val],
                [r["val_loss"] for r in val],
                "o" + style,
                label=f"{name} val",
            )
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / byte)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    png = Path(png)
    from raggedfsdp.checkpoint.files import staging_path

    part = staging_path(png)  # whole or not at all: a full disk leaves no half PNG
    try:
        fig.savefig(part, dpi=110, format="png")
        os.replace(part, png)
    finally:
        plt.close(fig)
        part.unlink(missing_ok=True)
