"""Plot ``train`` runs' losses from their ``metrics.jsonl`` and print a loss table.

.venv/bin/python benchmarks/_shampoo_plot.py OUT.png NAME=RUN_DIR ...
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _losses(run: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r and "step" in r}


def main() -> None:
    out, runs = Path(sys.argv[1]), dict(a.split("=", 1) for a in sys.argv[2:])
    losses = {name: _losses(Path(d)) for name, d in runs.items()}
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, ls in losses.items():
        steps = sorted(ls)
        window = 10  # a trailing mean over 10 steps; the raw losses faint beneath
        smooth = [
            sum(ls[s] for s in steps[max(0, i - window + 1) : i + 1]) / min(i + 1, window)
            for i in range(len(steps))
        ]
        (line,) = ax.plot(steps, smooth, label=name)
        ax.plot(steps, [ls[s] for s in steps], color=line.get_color(), alpha=0.2, lw=0.7)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (10-step mean)")
    ax.set_title("llama-small, 2 ranks, batch 16 x 64")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print("| step | " + " | ".join(losses) + " |")
    print("| ---: |" + " ---: |" * len(losses))
    for s in (1, 10, 25, 50, 100, 150, 200, 250, 299):
        cells = [f"{ls[s]:.3f}" if s in ls else "-" for ls in losses.values()]
        print(f"| {s} | " + " | ".join(cells) + " |")
    cells = []
    for ls in losses.values():
        last = [ls[s] for s in sorted(ls)[-50:]]
        cells.append(f"{sum(last) / len(last):.3f}")
    print("| mean of the last 50 | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
