"""The report of ``benchmarks/peers.py``: summaries, ratio, goal and raw tables, plot.

Everything here reads the runs' results (``peers.run_cells``); nothing runs a system.
The page holds tables; what they mean is its hand-written ``## Analysis``, which a
re-run keeps (``peers.py --report-from RECORD`` rewrites the page of a finished run).
"""

from __future__ import annotations

import os
import re
import statistics
import textwrap
from pathlib import Path

from _common import ANALYSIS, header, version

from raggedfsdp.train.report import mib, ratio

LABELS = {
    "raggedfsdp": "raggedfsdp",
    "fsdp2": "FSDP2",
    "fsdp1": "FSDP1",
    "deepspeed": "DeepSpeed ZeRO-3",
    "megatron-fsdp": "Megatron-FSDP",
}
DENSE, MOE = "llama", "moe"


def summarize(runs: list[dict], tokens_per_step: int) -> dict | None:
    """One system in one cell: timing pooled over its rounds, counts from its first run."""
    ok = [r for r in runs if r["ok"]]
    if not ok:
        return None
    first = ok[0]
    kinds = sorted(k.removesuffix("_count") for k in first if k.endswith("_count"))
    comm = {kind: first[f"{kind}_bytes"] for kind in kinds}
    steady = [
        all(r.get(f"{kind}_bytes") == comm[kind] for kind in kinds)
        and r["copied_bytes_total"] == first["copied_bytes_total"]
        for r in ok
    ]
    return {
        "rounds": len(ok),
        "tokens_per_s": tokens_per_step / statistics.median(t for r in ok for t in r["step_s"]),
        "round_tokens_per_s": [tokens_per_step / statistics.median(r["step_s"]) for r in ok],
        "tokens_per_cpu_s": tokens_per_step / statistics.median(c for r in ok for c in r["cpu_s"]),
        "round_tokens_per_cpu_s": [tokens_per_step / statistics.median(r["cpu_s"]) for r in ok],
        "comm_bytes": sum(comm.values()),
        "comm": comm,
        "comm_counts": {kind: first[f"{kind}_count"] for kind in kinds},
        "peak_memory": max(r["peak_memory_bytes_max_rank"] for r in ok),
        "copied_total": first["copied_bytes_total"],
        "copied_beyond": first["copied_bytes_beyond_model"],
        "copies_by_op": first["copies_by_op"],
        "padding": first["padding"],
        "padding_groups": first.get("padding_groups", {}),
        "n_params": first["n_params"],
        "losses": first["losses"],
        "counts_repeat": all(steady),
    }


# ---- the report -------------------------------------------------------------------------------
METRICS = (  # (key, column title, higher is better)
    ("tokens_per_s", "tokens/s", True),
    ("tokens_per_cpu_s", "tokens per CPU-second", True),
    ("peak_memory", "peak memory", False),
    ("comm_bytes", "communicated bytes", False),
    ("copied_total", "copied bytes", False),
)
GOALS = {DENSE: 1.05, MOE: 1.2}  # raggedfsdp tokens/s / FSDP2 tokens/s, at least
MEMORY_GOAL = 0.85  # raggedfsdp peak memory / FSDP2's, at most


def _family(model: str) -> str:
    return MOE if model.startswith(MOE) else DENSE


def ratios_table(table: dict, systems: list[str]) -> list[str]:
    lines = [
        "| model | ranks | system | " + " | ".join(t for _, t, _ in METRICS) + " |",
        "|---|---:|---|" + "---:|" * len(METRICS),
    ]
    for model, cells in table.items():
        for world, row in cells.items():
            ours = row.get("raggedfsdp")
            for system in systems:
                theirs = row.get(system)
                if theirs is None or ours is None:
                    continue
                vals = [f"{ratio(theirs[k], ours[k]):.2f}" for k, _, _ in METRICS]
                lines.append(f"| {model} | {world} | {LABELS[system]} | " + " | ".join(vals) + " |")
    return lines


def goals_table(table: dict) -> list[str]:
    """raggedfsdp / FSDP2 per cell, against the goals."""
    lines = [
        "| model | ranks | tokens/s (goal) | tokens per CPU-second (same goal) "
        f"| peak memory (goal <= {MEMORY_GOAL}) | communicated bytes (goal <= 1) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for model, cells in table.items():
        goal = GOALS[_family(model)]
        for world, row in cells.items():
            ours, theirs = row.get("raggedfsdp"), row.get("fsdp2")
            if ours is None or theirs is None:
                continue
            t = ratio(ours["tokens_per_s"], theirs["tokens_per_s"])
            u = ratio(ours["tokens_per_cpu_s"], theirs["tokens_per_cpu_s"])
            m = ratio(ours["peak_memory"], theirs["peak_memory"])
            c = ratio(ours["comm_bytes"], theirs["comm_bytes"])
            checks = [(t, t >= goal, 3), (u, u >= goal, 3), (m, m <= MEMORY_GOAL, 3)]
            checks.append((c, c <= 1.0, 4))
            cols = [f"{v:.{d}f} {'met' if met else '**not met**'}" for v, met, d in checks]
            cols[0] += f" (>= {goal})"
            lines.append(f"| {model} | {world} | " + " | ".join(cols) + " |")
    return lines


def raw_tables(table: dict, systems: list[str], args) -> list[str]:
    out = []
    head = (
        "| system | tokens/s (per round) | tokens per CPU-s | all-gather MiB (calls) "
        "| reduce-scatter MiB (calls) | all-reduce B (calls) | gathered / param bytes "
        "| copied MiB (beyond the model's own) | peak memory MiB | padding (elements) "
        "| loss at step 1 |"
    )
    for model, cells in table.items():
        for world, row in cells.items():
            any_row = next(iter(row.values()), None)
            if any_row is None:
                continue
            n = any_row["n_params"]
            out += ["", f"### {model}, {world} ranks ({n:,} parameters, {4 * n:,} B in fp32)", ""]
            out += [head, "|---|" + "---:|" * 10]
            for system in systems:
                s = row.get(system)
                if s is None:
                    continue
                comm, calls = s["comm"], s["comm_counts"]
                rounds = ", ".join(f"{v:,.0f}" for v in s["round_tokens_per_s"])
                cols = [
                    f"{s['tokens_per_s']:,.0f} ({rounds})",
                    f"{s['tokens_per_cpu_s']:,.0f}",
                    f"{mib(comm.get('all_gather', 0))} ({calls.get('all_gather', 0)})",
                    f"{mib(comm.get('reduce_scatter', 0))} ({calls.get('reduce_scatter', 0)})",
                    f"{comm.get('all_reduce', 0):,} ({calls.get('all_reduce', 0)})",
                    f"{comm.get('all_gather', 0) / (4 * n):.3f}",
                    f"{mib(s['copied_total'])} ({mib(s['copied_beyond'])})",
                    mib(s["peak_memory"]),
                    f"{s['padding']:,}",
                    f"{s['losses'][0]:.6f}",
                ]
                out.append(f"| {LABELS[system]} | " + " | ".join(cols) + " |")
    return out


def loss_table(table: dict, systems: list[str]) -> list[str]:
    """Per model: how far apart the runs' step-1 losses are (same init, same data), and
    each peer's largest |loss - raggedfsdp's| over all steps and cells."""
    peers = [s for s in systems if s != "raggedfsdp"]
    lines = [
        "| model | step 1: max - min over all runs | "
        + " | ".join(f"{LABELS[s]}: max abs diff to raggedfsdp" for s in peers)
        + " |",
        "|---|---:|" + "---:|" * len(peers),
    ]
    for model, cells in table.items():
        first = [s["losses"][0] for row in cells.values() for s in row.values()]
        gaps = {}
        for row in cells.values():
            ours = row.get("raggedfsdp")
            for system, s in row.items():
                if ours is not None and system != "raggedfsdp":
                    gap = max(abs(a - b) for a, b in zip(ours["losses"], s["losses"]))
                    gaps[system] = max(gaps.get(system, 0.0), gap)
        cols = [f"{gaps[s]:.2e}" if s in gaps else "-" for s in peers]
        spread = f"{max(first) - min(first):.2e}" if first else "-"
        lines.append(f"| {model} | {spread} | " + " | ".join(cols) + " |")
    return lines


def plot(table: dict, systems: list[str], skipped: dict, png: Path, title: str) -> None:
    """Each peer's metrics as ratios to raggedfsdp's, one panel per metric, bars per cell."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = [(m, w) for m, by_world in table.items() for w in by_world]
    peers = [s for s in systems if s != "raggedfsdp" and any(s in table[m][w] for m, w in cells)]
    width = 0.8 / max(1, len(peers))
    fig, axes = plt.subplots(2, 3, figsize=(18, 8))
    axes.flat[-1].axis("off")
    absent = [
        f"{LABELS[s]}: {re.sub(r' [(][^)]*[)]', '', why, count=1)[:160]}"
        for s, why in skipped.items()
    ]
    if absent:
        wrapped = "\n\n".join(textwrap.fill(a, 48) for a in absent)
        axes.flat[-1].text(0, 1, "Not measured:\n\n" + wrapped, va="top", fontsize=9)
    for ax, (key, name, higher) in zip(axes.flat, METRICS):
        for i, system in enumerate(peers):
            xs, ys = [], []
            for j, (m, w) in enumerate(cells):
                row = table[m][w]
                if system in row and "raggedfsdp" in row:
                    xs.append(j + (i - (len(peers) - 1) / 2) * width)
                    ys.append(ratio(row[system][key], row["raggedfsdp"][key]))
            ax.bar(xs, ys, width, label=LABELS[system])
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(cells)), [f"{m}\n{w} ranks" for m, w in cells], fontsize=8)
        better = "above 1: the peer is faster" if higher else "above 1: the peer uses more"
        ax.set_title(f"{name}, peer / raggedfsdp\n({better})", fontsize=10)
        if key == "copied_total":
            ax.set_yscale("log")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    axes.flat[-1].legend(handles, labels, loc="lower left", fontsize=10)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def _where(result: dict) -> str:
    """`` at package/file.py:N in fn: `code` ``: the peer's own frame that raised."""
    frames = re.findall(
        r'File "([^"]+)", line (\d+), in (\S+)\n\s+(.+)', result.get("traceback", "")
    )
    own = [f for f in frames if "site-packages/" in f[0] and "site-packages/torch/" not in f[0]]
    if not own:
        return ""
    path, line, fn, code = own[-1]
    return f", raised at {path.split('site-packages/')[-1]}:{line} in `{fn}`: `{code.strip()}`"


def system_lines(results: dict, skipped: dict, systems: list[str]) -> list[str]:
    lines = ["| system | version | runs | status |", "|---|---|---:|---|"]
    for system in systems:
        runs = [r for cells in results.values() for row in cells.values() for r in row[system]]
        ok = sum(r["ok"] for r in runs)
        package = {"deepspeed": "deepspeed", "megatron-fsdp": "megatron-fsdp"}.get(system, "torch")
        shown = "this repository" if system == "raggedfsdp" else version(package)
        failed = [r for r in runs if not r["ok"]]
        if system in skipped:
            status = skipped[system] + "".join(_where(r) for r in failed[:1])
        elif failed:
            status = (
                "; ".join(
                    f"{r['model']} x{r['world']}: {r['error']}" for r in failed if "model" in r
                )
                or failed[0]["error"]
            )
        else:
            status = "ran in every cell and round"
        status = status.replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {LABELS[system]} | {shown} | {ok} of {len(runs)} | {status} |")
    return lines


def report(results, skipped, systems, args, run: dict) -> tuple[str, dict]:
    """The Markdown page (its ``## Analysis`` empty) and the per-cell summaries of a run.

    Args:
        results, skipped: as ``run_cells`` returns them.
        systems: the systems asked for, in order.
        args: the run's arguments.
        run: ``command``, ``seconds``, ``load`` (before, after) and ``git`` of the run;
            ``report_from`` when the page is rewritten from a saved record.
    """
    tokens = args.batch_size * args.seq_len
    table = {
        model: {
            world: {s: v for s in systems if (v := summarize(row[s], tokens)) is not None}
            for world, row in cells.items()
        }
        for model, cells in results.items()
    }
    warm = getattr(args, "deepspeed_warmup_s", None)
    note = f", of which {warm:.0f} s the untimed DeepSpeed warm-up run" if warm else ""
    lines = header(
        "Peers: raggedfsdp against FSDP2, FSDP1, DeepSpeed ZeRO-3 and Megatron-FSDP",
        run["command"],
        run["seconds"],
        packages=("torch", "deepspeed", "megatron-fsdp"),
        note=note,
        git=run["git"],
    )
    if run.get("report_from"):
        lines += [f"Written from that run's record by `--report-from {run['report_from']}`.", ""]
    lines += [
        f"Configuration: models {', '.join(args.models)} at {', '.join(map(str, args.worlds))} "
        f"gloo ranks on {os.cpu_count()} CPU cores (1 thread each), fp32; global batch "
        f"{args.batch_size} x {args.seq_len} tokens (rows split over the ranks), "
        f"`raggedfsdp.train.data.get_batch` on the standard library's sources, seed "
        f"{args.seed}; `Transformer(config, seed={args.seed})` built on CPU; "
        f"`torch.optim.AdamW(lr={args.lr}, weight_decay=0.1)`, one group, no clipping; each "
        f"run {args.warmup} untimed then {args.steps} timed steps (a step between two "
        f"barriers), then one step under the counters and two under MemTracker; "
        f"{args.rounds} rounds per cell, the systems' order rotated each round. Sharding as "
        "described in `benchmarks/peers.py`: per transformer block, then the root, for "
        f"every system. Load average (1 min) before / after the run: {run['load'][0]:.1f} / "
        f"{run['load'][1]:.1f}.",
        "",
        ANALYSIS,
        "",
        "## Systems",
        "",
        *system_lines(results, skipped, systems),
        "",
        "## Ratios to raggedfsdp",
        "",
        "Each peer's value divided by raggedfsdp's in the same cell (tokens/s below 1: the "
        "peer is slower; bytes and memory above 1: the peer uses more). Communicated bytes: "
        "all-gather outputs plus reduce-scatter and all-reduce inputs, per rank per step. "
        "Copied bytes: every copy-like op of a step (`CopyCounter`, top level), the model's "
        "own copies included. Peak memory: the largest rank's.",
        "",
        *ratios_table(table, systems),
        "",
        "## Goals (raggedfsdp / FSDP2)",
        "",
        *goals_table(table),
        "",
        "## Losses",
        "",
        *loss_table(table, systems),
        "",
        "## Raw numbers",
        "",
        "Per rank 0 per step unless said otherwise (peak memory: the largest rank). "
        "*gathered / param bytes*: all-gather output bytes over the model's fp32 bytes, the "
        "number of times the step gathers the whole model. Copied: all copy-like ops, and in "
        "brackets the part beyond the copies that the unsharded model makes itself in the "
        "same step on the same rows.",
        *raw_tables(table, systems, args),
        "",
        "## How the counters see each peer",
        "",
        *counter_tables(table, systems),
    ]
    return "\n".join(lines) + "\n", table


def shape_facts(model: str) -> dict[str, int]:
    """Parameter counts of ``model``: all, in the transformer blocks, at the root."""
    import torch

    from raggedfsdp.models import Transformer, get_config

    with torch.device("meta"):  # shapes only
        m = Transformer(get_config(model))
    total = sum(p.numel() for p in m.parameters())
    blocks = sum(p.numel() for b in m.transformer_blocks() for p in b.parameters())
    return {"total": total, "blocks": blocks, "root": total - blocks}


def _span(values: list[float], fmt: str = "{:.3f}") -> str:
    lo, hi = fmt.format(min(values)), fmt.format(max(values))
    return lo if lo == hi else f"{lo}-{hi}"


def counter_tables(table: dict, systems: list[str]) -> list[str]:
    """The bytes each peer's collectives move against what a step must move, and its copies."""
    facts = {model: shape_facts(model) for model in table}
    expected = ", ".join(
        f"{m} {(2 * f['blocks'] + f['root']) / f['total']:.3f}" for m, f in facts.items()
    )
    out = [
        "`CommCounter` and `CopyCounter` are `TorchDispatchMode`s: they see every op that "
        "reaches the dispatcher, the c10d collectives included, whichever library calls "
        "them. A collective that went around them (a C++ path of a peer's own) would show "
        "as fewer bytes than a step must move: every parameter is gathered at least once "
        "per step and every gradient reduced once. Gathering every block twice (forward, "
        f"backward) and the root once, with no padding, gives ({expected}) times the "
        "model's bytes.",
        "",
        "| system | all-gather output / model bytes | reduce-scatter input / model bytes "
        "| all-reduce: bytes in calls |",
        "|---|---:|---:|---|",
    ]
    for system in systems:
        rows = [row[system] for cells in table.values() for row in cells.values() if system in row]
        if not rows:
            continue
        gathered = [s["comm"].get("all_gather", 0) / (4 * s["n_params"]) for s in rows]
        scattered = [s["comm"].get("reduce_scatter", 0) / (4 * s["n_params"]) for s in rows]
        reduces = sorted(
            {(s["comm"].get("all_reduce", 0), s["comm_counts"].get("all_reduce", 0)) for s in rows}
        )
        reduced = ", ".join(f"{b} B in {c}" for b, c in reduces if b) or "none"
        out.append(f"| {LABELS[system]} | {_span(gathered)} | {_span(scattered)} | {reduced} |")
    out += [
        "",
        "Copies by op, per rank per step, in the first cell where each system ran (the "
        "model's own copies, the same in every system, included):",
        "",
        "| system | copy-like ops: calls / bytes |",
        "|---|---|",
    ]
    for system in systems:
        rows = [row[system] for cells in table.values() for row in cells.values() if system in row]
        if rows:
            ops = rows[0]["copies_by_op"]
            text = "; ".join(f"`{op}` {c} / {b:,}" for op, (c, b) in ops.items())
            out.append(f"| {LABELS[system]} | {text} |")
    return out
