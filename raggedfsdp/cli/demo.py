"""``python -m raggedfsdp demo``: the same training run with raggedfsdp and with FSDP2.

Trains the tiny LLaMA-style model on 4 gloo ranks twice (same seed, same data, fp32
by default), once per backend, through ``python -m raggedfsdp train``; then prints
one side-by-side table (throughput, peak memory, bytes communicated and copied per
step, padding) and writes both loss curves into one PNG.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

from raggedfsdp.train.report import mib, plot_losses, ratio, read_metrics

BACKENDS = ("raggedfsdp", "fsdp2")


def _mib(n: float) -> str:
    return f"{mib(n, 2)} MiB"


def _ratio(ours: float, theirs: float) -> str:
    r = ratio(ours, theirs)
    return f"{r:.2f}x" if math.isfinite(r) else "-"


ROWS = [
    # (label, summary key, format, higher is better)
    ("tokens / s", "tokens_per_s", lambda v: f"{v:,.0f}", True),
    ("median step time", "median_step_s", lambda v: f"{v * 1e3:,.1f} ms", False),
    ("peak memory (max rank)", "peak_memory_bytes_max_rank", _mib, False),
    ("all-gathered / step / rank", "all_gather_bytes", _mib, False),
    ("reduce-scattered / step / rank", "reduce_scatter_bytes", _mib, False),
    ("copied around collectives / step", "copied_bytes_fsdp", _mib, False),
    ("copied in all / step (model too)", "copied_bytes_total", _mib, False),
    ("padding", "padding_ratio", lambda v: f"{v * 100:.3f} %", False),
    ("final train loss", "final_loss", lambda v: f"{v:.4f}", False),
]


def table(summaries: dict[str, dict]) -> str:
    ours, theirs = summaries["raggedfsdp"], summaries["fsdp2"]
    head = f"| {'':34} | {'raggedfsdp':>16} | {'FSDP2':>16} | {'ratio':>7} |"
    lines = [head, "|" + "|".join("-" * (w + 2) for w in (34, 16, 16, 7)) + "|"]
    for label, key, fmt, _ in ROWS:
        a, b = ours.get(key, 0.0), theirs.get(key, 0.0)
        lines.append(f"| {label:34} | {fmt(a):>16} | {fmt(b):>16} | {_ratio(a, b):>7} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="python -m raggedfsdp demo",
        description="Train with raggedfsdp and with torch's FSDP2 on the same seed and data, "
        "then compare them side by side. Extra options go to `python -m raggedfsdp train`.",
    )
    p.add_argument("--out", default="out/demo", help="output directory (default out/demo)")
    p.add_argument("--steps", type=int, default=150, help="training steps (default 150)")
    args, extra = p.parse_known_args(argv)
    out = Path(args.out)
    common = ["--model", "llama-tiny", "--nproc", "4", "--steps", str(args.steps), *extra]
    for backend in BACKENDS:
        print(f"== training with {backend} ==", flush=True)
        cmd = [sys.executable, "-m", "raggedfsdp", "train", *common]
        cmd += ["--backend", backend, "--out", str(out / backend), "--no-plot"]
        subprocess.run(cmd, check=True)
    summaries = {b: json.loads((out / b / "summary.json").read_text()) for b in BACKENDS}
    curves = {b: read_metrics(out / b / "metrics.jsonl") for b in BACKENDS}
    gap = max(abs(x["loss"] - y["loss"]) for x, y in zip(curves["raggedfsdp"], curves["fsdp2"]))
    png = out / "loss.png"
    plot_losses({b: out / b / "metrics.jsonl" for b in BACKENDS}, png, "llama-tiny, 4 ranks")
    s = summaries["raggedfsdp"]
    print(f"\nllama-tiny, {s['world']} gloo ranks, {s['steps']} steps, optimizer {s['optim']}")
    print(table(summaries))
    print(f"\nlargest per-step loss difference between the two runs: {gap:.2e}")
    print(f"loss curves: {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
