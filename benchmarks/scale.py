"""Real model shapes at 64 to 8192 ranks, simulated: peak memory per rank, raggedfsdp vs FSDP2.

    .venv/bin/python benchmarks/scale.py                       # the table (see --help)
    .venv/bin/python benchmarks/scale.py --models llama3-70b --worlds 64 --layers 2  # smoke

Each row is one rank (rank 0) of a ``world``-rank job running one training step of a
catalogue model cut to K transformer blocks (embeddings and head included), simulated
by ``raggedfsdp.simulate`` in this process: fake tensors, torch's fake process group,
``MemTracker``; bf16 compute with fp32 master weights and fp32 gradient reduction,
``torch.optim.AdamW``, batch 1 x 4096 tokens, activation checkpointing per block, one
warm-up step first. Then ``fully_shard`` of whole models (every block, on ``meta``) is
timed at 16,384 ranks. Writes ``benchmarks/results/scale.md`` and its plots; each
simulation's result is cached in ``--raw`` (JSON lines), so an interrupted run resumes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from _common import ANALYSIS, RESULTS, header, write_results  # beside this script

from raggedfsdp.simulate import ROLES, SimConfig, simulate, time_fully_shard

SYSTEMS = ("raggedfsdp", "fsdp2")
ROLE_NAMES = {
    "sharded_params": "sharded params",
    "unsharded_params": "unsharded params",
    "comm_buffers": "comm buffers",
    "sharded_grads": "sharded grads",
    "unsharded_grads": "unsharded grads",
    "optimizer": "optimizer",
    "activations": "activations",
    "temporaries": "bw temporaries",
}


def gib(n: float) -> str:
    return f"{n / 2**30:,.2f}"


def _key(model: str, world: int, layers: int, system: str) -> str:
    return f"{model}|{world}|{layers}|{system}"


def run_all(args) -> dict[str, dict]:
    """Every simulation of the sweep, from the cache where it ran before."""
    done: dict[str, dict] = {}
    if args.raw.exists():
        for line in args.raw.read_text().splitlines():
            r = json.loads(line)
            c = r["config"]
            done[_key(c["model"], c["world"], c["layers"], c["system"])] = r
    for model in args.models:
        for layers in args.layers:
            for world in args.worlds:
                for system in SYSTEMS:
                    key = _key(model, world, layers, system)
                    if key in done:
                        continue
                    cfg = SimConfig(
                        model=model, world=world, layers=layers, system=system, seq=args.seq
                    )
                    t0 = time.perf_counter()
                    try:
                        r = simulate(cfg)
                    except Exception as e:  # a failure is a result too: say it in the table
                        r = {"config": vars(cfg) | {}, "error": f"{type(e).__name__}: {e}"}
                        r["config"] = {
                            "model": model, "world": world, "layers": layers, "system": system
                        }  # fmt: skip
                    r["seconds"] = time.perf_counter() - t0
                    print(f"{key}: {r.get('peak', {}).get('total', r.get('error'))}", flush=True)
                    done[key] = r
                    with args.raw.open("a") as f:
                        f.write(json.dumps(r) + "\n")
    return done


def _get(done, model, world, layers, system):
    return done.get(_key(model, world, layers, system))


def table(done: dict, args) -> list[str]:
    """Peak per rank, the ratio, and the by-role breakdown at each system's peak."""
    lines = [
        "| model | K | ranks | peak raggedfsdp (GiB) | peak FSDP2 (GiB) | ratio | "
        + " | ".join(f"{ROLE_NAMES[r]} R / F" for r in ROLES)
        + " |",
        "|---|---:|---:|---:|---:|---:|" + "---:|" * len(ROLES),
    ]
    for model in args.models:
        for layers in args.layers:
            for world in args.worlds:
                a, b = (_get(done, model, world, layers, s) for s in SYSTEMS)
                if a is None or b is None:
                    continue
                if "error" in a or "error" in b:
                    err = a.get("error") or b.get("error")
                    lines.append(f"| {model} | {layers} | {world} | failed: {err} |")
                    continue
                pa, pb = a["peak"]["total"], b["peak"]["total"]
                cells = [f"{gib(a['roles'][r])} / {gib(b['roles'][r])}" for r in ROLES]
                lines.append(
                    f"| {model} | {layers} | {world} | {gib(pa)} | {gib(pb)} | {pa / pb:.3f} | "
                    + " | ".join(cells)
                    + " |"
                )
    return lines


def per_block(done: dict, args) -> list[str]:
    """What one more block costs at the peak: (peak at K2 - peak at K1) / (K2 - K1)."""
    if len(args.layers) < 2:
        return []
    k1, k2 = min(args.layers), max(args.layers)
    lines = [
        f"Per block: (peak at K={k2} - peak at K={k1}) / {k2 - k1}, GiB per rank.",
        "",
        "| model | ranks | raggedfsdp | FSDP2 | ratio |",
        "|---|---:|---:|---:|---:|",
    ]
    for model in args.models:
        for world in args.worlds:
            rs = [[_get(done, model, world, k, s) for k in (k1, k2)] for s in SYSTEMS]
            if any(r is None or "error" in r for pair in rs for r in pair):
                continue
            d = [(p[1]["peak"]["total"] - p[0]["peak"]["total"]) / (k2 - k1) for p in rs]
            ratio = f"{d[0] / d[1]:.3f}" if d[1] else "-"
            lines.append(f"| {model} | {world} | {gib(d[0])} | {gib(d[1])} | {ratio} |")
    return lines


def details(done: dict, args) -> list[str]:
    """Collectives, padding, allocations and times of every simulation."""
    lines = [
        "| model | K | ranks | system | all-gather: n, GiB out | reduce-scatter: n, GiB in | "
        "all-reduce: n, bytes | padding (elements, % of params) | allocations "
        "(distinct sizes) | fully_shard (s) | warm-up step (s) | measured step (s) |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for model in args.models:
        for layers in args.layers:
            for world in args.worlds:
                for s in SYSTEMS:
                    r = _get(done, model, world, layers, s)
                    if r is None or "error" in r:
                        continue
                    ag = r["comm"].get("all_gather", [0, 0, 0])
                    rs = r["comm"].get("reduce_scatter", [0, 0, 0])
                    ar = r["comm"].get("all_reduce", [0, 0, 0])
                    pad = r["layout"]["padding_elems"]
                    lines.append(
                        f"| {model} | {layers} | {world} | {s} | {ag[0]}, {gib(ag[2])} | "
                        f"{rs[0]}, {gib(rs[1])} | {ar[0]}, {ar[1]:,} | "
                        f"{pad:,} ({100 * pad / r['params']:.2f}%) | {r['allocations']:,} "
                        f"({r['distinct_sizes']}) | {r['shard_s']:.2f} | {r['warmup_s']:.1f} | "
                        f"{r['step_s']:.1f} |"
                    )
    return lines


def plot(done: dict, args, path: Path) -> bool:
    """Peak per rank against ranks, one panel per model, both systems, largest K."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    k = max(args.layers)
    fig, axes = plt.subplots(1, len(args.models), figsize=(4.5 * len(args.models), 3.6))
    axes = axes if len(args.models) > 1 else [axes]
    for ax, model in zip(axes, args.models):
        for s, style in zip(SYSTEMS, ("o-", "s--")):
            pts = [
                (w, r["peak"]["total"] / 2**30)
                for w in args.worlds
                if (r := _get(done, model, w, k, s)) is not None and "error" not in r
            ]
            if pts:
                ax.plot(*zip(*pts), style, label=s)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{model}, K={k}")
        ax.set_xlabel("ranks")
        ax.set_ylabel("simulated peak per rank (GiB)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def report(done: dict, shard_times: list, args, command: str, seconds: float) -> str:
    lines = header("Real shapes at scale, simulated: raggedfsdp vs FSDP2", command, seconds)
    lines += [
        f"Configuration: rank 0 of a `world`-rank job, simulated in one process by "
        f"`raggedfsdp.simulate` (fake tensors, torch's fake process group, MemTracker): "
        f"catalogue models cut to K transformer blocks (embeddings and head kept), "
        f"`fully_shard` on each block then the root, defaults otherwise (blocks reshard "
        f"after forward, the root does not), bf16 compute with fp32 master weights and "
        f"fp32 gradient reduction, `torch.optim.AdamW` (foreach), batch 1 x {args.seq} "
        f"tokens, activation checkpointing per block (`checkpoint_wrapper`), one warm-up "
        f"step, then one measured step (forward, backward, `opt.step()`). Memory is "
        f"*simulated allocated bytes per rank* (no allocator rounding, no cache, no "
        f"fragmentation), not reserved memory on a device. MoE layers route evenly; "
        f"GPT-OSS runs with torchtitan's unfused experts (see `raggedfsdp/simulate.py`).",
        "",
        "## Peak memory per rank",
        "",
        "GiB. R / F: raggedfsdp / FSDP2, bytes by role at each system's own peak "
        "(they add up to the peak).",
        "",
        *table(done, args),
        "",
        *per_block(done, args),
        "",
        "![peak per rank](scale.png)",
        "",
        ANALYSIS,
        "",
        "## Collectives, padding, allocations, times",
        "",
        "Per step on rank 0. All-gather bytes are outputs, reduce-scatter bytes inputs "
        "(whole buffers, padding included).",
        "",
        *details(done, args),
        "",
        "## fully_shard of whole models",
        "",
        "Every block and the root, on `meta`, over a fake process group; planning included. "
        "Objects: Python objects the garbage collector sees after it, minus before.",
        "",
        "| model | blocks | ranks | system | seconds | objects kept |",
        "|---|---:|---:|---|---:|---:|",
    ]
    for t in shard_times:
        if "error" in t:
            lines.append(f"| {t['model']} | | {t['world']} | {t['system']} | {t['error']} | |")
            continue
        lines.append(
            f"| {t['model']} | {t['blocks']} | {t['world']:,} | {t['system']} | "
            f"{t['seconds']:.2f} | {t['gc_objects']:,} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["llama3-70b", "gpt-oss-120b"])
    p.add_argument("--worlds", nargs="+", type=int, default=[64, 256, 1024, 8192])
    p.add_argument("--layers", nargs="+", type=int, default=[2, 4], help="K values")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--shard-world", type=int, default=16384)
    p.add_argument("--shard-models", nargs="*", default=None, help="default: --models")
    p.add_argument("--raw", type=Path, default=Path("/tmp/raggedfsdp_scale.jsonl"))
    p.add_argument("--out", type=Path, default=RESULTS / "scale.md")
    args = p.parse_args(argv)
    command = " ".join([".venv/bin/python", "benchmarks/scale.py", *sys.argv[1:]])
    print(command, flush=True)
    t0 = time.perf_counter()
    done = run_all(args)
    shard_times = []
    for model in args.models if args.shard_models is None else args.shard_models:
        for system in SYSTEMS:
            try:
                shard_times.append(time_fully_shard(model, args.shard_world, system))
            except Exception as e:
                shard_times.append(
                    {"model": model, "world": args.shard_world, "system": system,
                     "error": f"{type(e).__name__}: {e}"}
                )  # fmt: skip
            print(shard_times[-1], flush=True)
    plot(done, args, args.out.with_suffix(".png"))
    write_results(args.out, report(done, shard_times, args, command, time.perf_counter() - t0))
    print(args.out.read_text())


if __name__ == "__main__":
    main()
