"""Training step: raggedfsdp vs torch's FSDP2, same model, seed and data, in one run.

    .venv/bin/python benchmarks/step.py                      # 4 gloo ranks, both models
    .venv/bin/python benchmarks/step.py --steps 4 --block 2 --models llama-tiny  # smoke run

Each rank builds every model twice from the same seed, once sharded by
``raggedfsdp.fully_shard`` and once by ``torch.distributed.fsdp.fully_shard`` (each
transformer block, then the root), and trains both on the same global batches. The
two systems alternate in blocks of ``--block`` steps (ABBA order), so that the load on
the machine falls on both alike. Measured:

- step time: one step (forward, backward, optimizer step, zero_grad) between two
  barriers; the median over the timed steps, the ratio raggedfsdp / FSDP2, and the
  ratio within each round (adjacent blocks); also the CPU time of a step summed over
  the ranks' processes, which other processes' load disturbs less;
- collectives per step (``raggedfsdp.profiling.CommCounter``): count and bytes per
  kind; an all-gather's output and a reduce-scatter's input are whole buffers, so
  they include the padding;
- copies per step (``raggedfsdp.profiling.CopyCounter``): every copy-like op, and the
  FSDP-attributable part: for raggedfsdp the copies that read or write a DBuffer
  storage, for FSDP2 its ``fsdp.*`` ops (copy-in, copy-out, reduce-scatter copy-in);
  gloo's own copy into each reduce-scatter output is counted apart, for both;
- peak memory per rank over one step (``torch.distributed._tools.mem_tracker.MemTracker``,
  with each system's persistent storages tracked from the start);
- padding: elements each system adds to shard the parameters (per group, summed);
- the per-step losses of the two systems (max abs difference).

Writes ``benchmarks/results/step.md`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

RESULTS = Path(__file__).resolve().parent / "results"
SYSTEMS = ("raggedfsdp", "fsdp2")
RS_OP = "c10d._reduce_scatter_base_.default"  # gloo copies into this op's output on wait


# ---- one system: a sharded model, its optimizer, its steps ---------------------------------
class Run:
    """One model sharded by one system, trained step by step on the shared data."""

    def __init__(self, system: str, model_name: str, args, rank: int, world: int, data):
        from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard
        from torch.distributed.tensor import init_device_mesh

        from raggedfsdp.fsdp import fully_shard
        from raggedfsdp.models import get_config
        from raggedfsdp.models.transformer import Transformer

        self.system, self.rank, self.world, self.data, self.args = system, rank, world, data, args
        shard = fully_shard if system == "raggedfsdp" else fsdp2_fully_shard
        mesh = init_device_mesh("cpu", (world,))
        model = Transformer(get_config(model_name), max_seq_len=args.seq, seed=args.seed)
        self.n_params = sum(p.numel() for p in model.parameters())
        for block in model.transformer_blocks():
            shard(block, mesh=mesh)
        shard(model, mesh=mesh)
        self.model = model
        if args.optim == "adamw":
            self.opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
        else:
            self.opt = torch.optim.SGD(model.parameters(), lr=args.lr)
        self.step_index = 0
        self.losses: list[float] = []
        self.times: list[float] = []  # wall seconds per timed step (barrier to barrier)
        self.cpu: list[float] = []  # CPU seconds of this rank per timed step

    def step(self, timed: bool = False, around=contextlib.nullcontext) -> None:
        """One training step; ``around()`` (a counter or tracker) wraps its compute only."""
        from raggedfsdp.models.transformer import lm_loss
        from raggedfsdp.train.data import get_batch

        x, y = get_batch(
            self.data, seed=self.args.seed, step=self.step_index, batch_size=self.args.batch,
            seq_len=self.args.seq, rank=self.rank, world_size=self.world,
        )  # fmt: skip
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        with around():
            loss = lm_loss(self.model(x), y)
            loss.backward()
            self.opt.step()
            self.opt.zero_grad()
        cpu = time.process_time() - c0  # this rank's threads (gloo's included), not others'
        dist.barrier()
        seconds = time.perf_counter() - t0
        if timed:
            self.times.append(seconds)
            self.cpu.append(cpu)
        loss = loss.detach()
        dist.all_reduce(loss)
        self.losses.append(loss.item() / self.world)
        self.step_index += 1

    # ---- what the system keeps ------------------------------------------------------------
    def persistent_storages(self) -> list[torch.Tensor]:
        """Storages the system allocated at ``fully_shard`` time and resizes later."""
        if self.system == "raggedfsdp":
            return [
                t
                for g in _ragged_groups(self.model)
                for t in (
                    g.dbuf.shard,
                    g.dbuf.shard_grad,
                    g.dbuf.global_params.tensor,
                    g.dbuf.global_grads.tensor,
                )
            ]
        return [
            t
            for g in _fsdp2_groups(self.model)
            for p in g.fsdp_params
            for t in p.all_gather_outputs
        ]

    def padding(self) -> int:
        """Elements added to shard the parameters, summed over the groups."""
        if self.system == "raggedfsdp":
            return sum(g.layout.padding for g in _ragged_groups(self.model))
        return sum(
            p.padded_sharded_param_size.numel() * self.world - p._orig_size.numel()
            for g in _fsdp2_groups(self.model)
            for p in g.fsdp_params
        )

    def fsdp_copies(self, copies) -> list:
        """The copies this system makes of parameter or gradient data (not gloo's own)."""
        if self.system == "raggedfsdp":
            from raggedfsdp.profiling import buffer_storages

            return [e for e in copies.touching(buffer_storages(self.model)) if e.within != RS_OP]
        return [e for e in copies.top_level() if e.op.startswith("fsdp.")]


def _ragged_groups(model):
    return [s.group for m in model.modules() if (s := vars(m).get("_raggedfsdp_state")) and s.group]


def _fsdp2_groups(model):
    return [
        g for m in model.modules() if hasattr(m, "_get_fsdp_state")
        for g in m._get_fsdp_state()._fsdp_param_groups
    ]  # fmt: skip


# ---- measurements ------------------------------------------------------------------------------
@contextlib.contextmanager
def _both(first, second):
    with first, second:
        yield


def count_step(run: Run) -> dict:
    from raggedfsdp.profiling import CommCounter, CopyCounter

    copies, comms = CopyCounter(), CommCounter()
    run.step(around=lambda: _both(copies, comms))
    fsdp = run.fsdp_copies(copies)
    backend = [e for e in copies.events if e.within == RS_OP]
    return {
        "comm": {k: list(v) for k, v in comms.summary().items()},
        "copies_by_op": {k: list(v) for k, v in copies.summary(copies.top_level()).items()},
        "copies_inner": {
            k: list(v)
            for k, v in copies.summary(
                [e for e in copies.events if e.within and e.within != RS_OP]
            ).items()
        },  # fmt: skip
        "copy_total": [len(copies.top_level()), copies.total_bytes()],
        "copy_fsdp": [len(fsdp), copies.total_bytes(fsdp)],
        "copy_backend": [len(backend), copies.total_bytes(backend)],
    }


def memory_step(run: Run) -> dict:
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(run.model, run.opt, *run.persistent_storages())
    run.step(around=lambda: tracker)
    peak = tracker.get_tracker_snapshot("peak")
    snap = peak[torch.device("cpu")] if torch.device("cpu") in peak else next(iter(peak.values()))
    return {str(k).removeprefix("_MemRefType."): int(v) for k, v in snap.items()}


def unsharded_grads_step(run: Run) -> list[int]:
    """raggedfsdp only: ``[most bytes of unsharded gradient buffers alive at once, all groups]``.

    A diagnostic for the memory numbers: sampled right after each group's post-backward
    (which starts its reduce-scatter) by shadowing the method on the group instances.
    """
    groups = _ragged_groups(run.model)
    most = [0]

    def live() -> int:
        return sum(g.dbuf.global_grads.tensor.untyped_storage().nbytes() for g in groups)

    def probe(group):
        method = group.post_backward

        def post_backward(reshard: bool) -> None:
            method(reshard)
            most[0] = max(most[0], live())

        return post_backward

    for g in groups:
        g.post_backward = probe(g)
    try:
        run.step()
    finally:
        for g in groups:
            del g.post_backward  # the class's method again
    return [most[0], sum(g.dbuf.global_grads._nbytes for g in groups)]


def _rank_main(rank: int, world: int, args, init_file: str, out_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        from raggedfsdp.train.data import DataConfig, load_corpus

        data = load_corpus(DataConfig(max_bytes=1 << 20)).train
        results = {}
        for model_name in args.models:
            runs = {s: Run(s, model_name, args, rank, world, data) for s in SYSTEMS}
            for _ in range(args.warmup):
                for s in SYSTEMS:
                    runs[s].step()
            for r in range(math.ceil(args.steps / args.block)):
                order = SYSTEMS if r % 2 == 0 else SYSTEMS[::-1]
                for s in order:
                    for _ in range(args.block):
                        runs[s].step(timed=True)
            counts = {s: count_step(runs[s]) for s in SYSTEMS}
            memory = {s: memory_step(runs[s]) for s in SYSTEMS}
            held = unsharded_grads_step(runs["raggedfsdp"])
            runs["fsdp2"].step()  # same data for both on every step
            peaks, cpus = [None] * world, [None] * world
            dist.all_gather_object(peaks, {s: memory[s]["Total"] for s in SYSTEMS})
            dist.all_gather_object(cpus, {s: runs[s].cpu for s in SYSTEMS})
            a, b = (runs[s].losses for s in SYSTEMS)
            results[model_name] = {
                "params": runs["raggedfsdp"].n_params,
                "losses": {s: runs[s].losses for s in SYSTEMS},
                "max_loss_diff": max(abs(x - y) for x, y in zip(a, b)),
                "times": {s: runs[s].times for s in SYSTEMS},
                "cpu": {s: [sum(c) for c in zip(*(p[s] for p in cpus))] for s in SYSTEMS},
                "padding": {s: runs[s].padding() for s in SYSTEMS},
                "padding_bound": sum(
                    g.layout.lower_bound_padding for g in _ragged_groups(runs["raggedfsdp"].model)
                ),
                "counts": counts,
                "memory_rank0": memory,
                "peak_per_rank": {s: [p[s] for p in peaks] for s in SYSTEMS},
                "ragged_unsharded_grads": held,
                "ragged_shard_grad_bytes": sum(
                    g.dbuf.shard_grad.numel() * g.dbuf.shard_grad.element_size()
                    for g in _ragged_groups(runs["raggedfsdp"].model)
                ),
            }
            del runs
        if rank == 0:
            Path(out_file).write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


# ---- report ------------------------------------------------------------------------------------
def _mib(n: float) -> str:
    return f"{n / 2**20:.3f}"


def _ratio(a: float, b: float, digits: int = 3) -> str:
    return f"{a / b:.{digits}f}" if b else ("-" if a == 0 else "inf")


def _comm(c: dict, kind: str) -> tuple[int, int, int]:
    return tuple(c["comm"].get(kind, [0, 0, 0]))


def _paired_ratios(r: dict, block: int) -> list[float]:
    """raggedfsdp / FSDP2 median step time of each round (the two adjacent blocks)."""
    a, b = r["times"]["raggedfsdp"], r["times"]["fsdp2"]
    return [
        statistics.median(a[i : i + block]) / statistics.median(b[i : i + block])
        for i in range(0, min(len(a), len(b)), block)
    ]


def _summary_rows(r: dict, args) -> list[tuple[str, str, str, str]]:
    """(metric, raggedfsdp, FSDP2, ratio raggedfsdp / FSDP2), formatted."""
    ca, cb = r["counts"]["raggedfsdp"], r["counts"]["fsdp2"]
    ta, tb = (statistics.median(r["times"][s]) * 1e3 for s in SYSTEMS)
    paired = _paired_ratios(r, args.block)
    rows = [
        ("step time, median (ms)", f"{ta:.1f}", f"{tb:.1f}", _ratio(ta, tb)),
        (
            f"step time ratio per round, median (min-max) of {len(paired)}",
            "",
            "",
            f"{statistics.median(paired):.3f} ({min(paired):.3f}-{max(paired):.3f})",
        ),
    ]
    ua, ub = (statistics.median(r["cpu"][s]) * 1e3 for s in SYSTEMS)
    rows.append(
        ("CPU time per step, all ranks, median (ms)", f"{ua:.1f}", f"{ub:.1f}", _ratio(ua, ub))
    )
    for kind, i, what in (("all_gather", 2, "output"), ("reduce_scatter", 1, "input")):
        a, b = _comm(ca, kind)[i], _comm(cb, kind)[i]
        rows.append((f"{kind} bytes ({what}, MiB)", _mib(a), _mib(b), _ratio(a, b, 4)))
    for key, what in (("copy_fsdp", "FSDP copies"), ("copy_total", "all copies")):
        (na, a), (nb, b) = ca[key], cb[key]
        rows.append(
            (f"{what}: count / MiB", f"{na} / {_mib(a)}", f"{nb} / {_mib(b)}", _ratio(a, b))
        )
    pa, pb = (max(r["peak_per_rank"][s]) for s in SYSTEMS)
    rows.append(("peak memory, max over ranks (MiB)", _mib(pa), _mib(pb), _ratio(pa, pb)))
    da, db = r["padding"]["raggedfsdp"], r["padding"]["fsdp2"]
    pct = [f"{d:,} ({100 * d / r['params']:.3f}%)" for d in (da, db)]
    rows.append(("padding, elements (% of params)", pct[0], pct[1], _ratio(da, db)))
    return rows


def _other_copies(ca: dict, cb: dict) -> str:
    """Compare the copies that are not FSDP2's ``fsdp.*`` ops (the model's, in both)."""
    a, b = ({k: v for k, v in c["copies_by_op"].items() if v[0]} for c in (ca, cb))
    a = {k: v for k, v in a.items() if not k.startswith("fsdp.")}
    b = {k: v for k, v in b.items() if not k.startswith("fsdp.")}
    differ = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
    text = f"The other copies ({', '.join(f'`{k}`' for k in sorted(a.keys() | b.keys()))}) "
    if not differ:
        return text + "are the model's own: the same ops and bytes in both."
    diffs = "; ".join(
        f"`{k}` {a.get(k, [0, 0])[0]} ({a.get(k, [0, 0])[1]:,} B) vs "
        f"{b.get(k, [0, 0])[0]} ({b.get(k, [0, 0])[1]:,} B)"
        for k in differ
    )
    return (
        text + f"are the model's own and the same in both except {diffs} (raggedfsdp's "
        "includes the cast of the few-byte flags of its end-of-backward all-reduce)."
    )


def _notes(results: dict, args) -> list[str]:
    from raggedfsdp.models import get_config

    out = []
    for name, r in results.items():
        ca, cb = r["counts"]["raggedfsdp"], r["counts"]["fsdp2"]
        top = cb["copies_by_op"]
        ag_in, ag_out = _comm(cb, "all_gather")[1:]
        rs_in = _comm(cb, "reduce_scatter")[1]
        copy_in, copy_out, rs_copy = (
            top.get(f"fsdp.{op}.default", [0, 0])
            for op in ("all_gather_copy_in", "split_with_sizes_copy", "chunk_cat")
        )
        same = lambda a, b: "equal to" if a == b else "not equal to"
        out.append(
            f"- **{name}, copies.** raggedfsdp: {ca['copy_fsdp'][0]} copies of parameter or "
            f"gradient data per step. FSDP2: {copy_in[0]} copy-ins ({copy_in[1]:,} B, "
            f"{same(copy_in[1], ag_in)} its all-gather input bytes), {copy_out[0]} copy-outs "
            f"({copy_out[1]:,} B, {same(copy_out[1], ag_out)} its all-gather output bytes) and "
            f"{rs_copy[0]} reduce-scatter copy-ins ({rs_copy[1]:,} B, {same(rs_copy[1], rs_in)} "
            f"its reduce-scatter input bytes). {_other_copies(ca, cb)} gloo copies each "
            f"reduce-scatter result into the output on wait: {ca['copy_backend'][0]} copies "
            f"({ca['copy_backend'][1]:,} B) for raggedfsdp, {cb['copy_backend'][0]} "
            f"({cb['copy_backend'][1]:,} B) for FSDP2, in neither total."
        )
        held, total = r["ragged_unsharded_grads"]
        pa, pb = (max(r["peak_per_rank"][s]) for s in SYSTEMS)
        ma, mb = r["memory_rank0"]["raggedfsdp"], r["memory_rank0"]["fsdp2"]
        parts = ", ".join(
            f"{k} {ma.get(k, 0) - mb.get(k, 0):+,}"
            for k in ma
            if k != "Total" and ma.get(k) != mb.get(k)
        )
        every = (
            " (every group's: none is freed before the end of backward)" if held == total else ""
        )
        out.append(
            f"- **{name}, memory.** Peak {_mib(pa)} MiB (raggedfsdp) vs {_mib(pb)} MiB (FSDP2), "
            f"ratio {_ratio(pa, pb)}; rank 0 at its peak, raggedfsdp minus FSDP2 by MemTracker "
            f"category (B): {parts}. raggedfsdp's shard gradient storage "
            f"({r['ragged_shard_grad_bytes']:,} B) is allocated for the whole run, where "
            f"FSDP2's sharded `.grad`s are freed by `zero_grad()` and do not exist early in "
            f"backward; raggedfsdp allocates each group's unsharded gradient buffer whole when "
            f"the group's backward begins (the root's, embedding included, at the very start), "
            f"where autograd allocates FSDP2's per parameter as each is computed; at most "
            f"{held:,} B of them were alive at once, of {total:,} B for all groups{every}."
        )
        da, db = r["padding"]["raggedfsdp"], r["padding"]["fsdp2"]
        config = get_config(name)
        up = lambda n: -(-n // args.world) * args.world
        examples = [f"vocab {config.vocab_size} -> {up(config.vocab_size)} rows"]
        if config.n_experts:
            examples.append(f"{config.n_experts} stacked experts -> {up(config.n_experts)}")
        out.append(
            f"- **{name}, padding and bytes.** raggedfsdp pads {da:,} elements, FSDP2 "
            f"{db:,}; an all-gather moves whole buffers, so the bytes follow (blocks twice per "
            f"step, forward and backward, the root once). FSDP2 pads each tensor's dim 0 to a "
            f"multiple of {args.world} ({'; '.join(examples)}); raggedfsdp pads once per group, "
            f"to whole rows (blocks of 1 row) and 128-byte shard starts, as its planner finds "
            f"(the planner's proven lower bound for these groups: {r['padding_bound']:,})."
        )
    ta = {n: statistics.median(r["times"]["raggedfsdp"]) for n, r in results.items()}
    tb = {n: statistics.median(r["times"]["fsdp2"]) for n, r in results.items()}
    out.append(
        "- **Step time.** Median ratios raggedfsdp / FSDP2: "
        + ", ".join(f"{n} {_ratio(ta[n], tb[n])}" for n in results)
        + "; per round (each system's median over its block of the round): "
        + ", ".join(
            f"{n} {min(p):.3f}-{max(p):.3f}"
            for n, p in ((n, _paired_ratios(r, args.block)) for n, r in results.items())
        )
        + ". CPU time per step (summed over the ranks' processes, gloo's threads included) "
        "is the work each system does, and is less sensitive to other processes' load. "
        + f"Here {args.world} ranks share {os.cpu_count()} cores and CPU tensors have no "
        "streams: FSDP2's copy-in, copy-out and per-parameter ops run on the thread that runs "
        "the model, and gloo's collective threads compete for the same cores, so every byte "
        "copied and every op launched is step time. The alternating blocks put the machine's "
        "load (other processes included, see the load averages) on both alike; compare ratios, "
        "not absolute times."
    )
    out.append(
        "- **Losses.** Max |difference| of the per-step losses: "
        + ", ".join(f"{n} {r['max_loss_diff']:.3g}" for n, r in results.items())
        + f" over {len(next(iter(results.values()))['losses']['raggedfsdp'])} steps each."
    )
    return out


def _git_state() -> str:
    """The commit, and the files of the package that differ from it (a run's exact code)."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "--", "raggedfsdp"],
            cwd=root, capture_output=True, text=True,
        ).stdout.split("\n")  # fmt: skip
    except OSError:
        return "an unknown commit (no git)"
    changed = sorted(line[3:] for line in dirty if line.strip())
    return f"commit {head}" + (
        f", with uncommitted changes to {', '.join(f'`{c}`' for c in changed)}" if changed else ""
    )


def report(results: dict, args, command: str, seconds: float, load: list) -> str:
    cpu = os.cpu_count()
    lines = [
        "# Training step: raggedfsdp vs FSDP2",
        "",
        f"Command: `{command}` (took {seconds:.0f} s).",
        "",
        f"Versions: Python {platform.python_version()}, torch {torch.__version__}; "
        f"{platform.platform()}, {cpu} CPUs. raggedfsdp at {_git_state()}.",
        "",
        f"Configuration: {args.world} gloo ranks on {cpu} CPU cores (1 thread each), fp32, "
        f"{args.optim} (lr {args.lr}), global batch {args.batch} x {args.seq} tokens "
        f"(rows split over ranks), seed {args.seed}; `fully_shard` on each transformer block, "
        f"then the root (reshard_after_forward=True, defaults otherwise) for both systems; "
        f"{args.warmup} warm-up steps each, then {args.steps} timed steps each in blocks of "
        f"{args.block}, alternating ABBA; then one step under CopyCounter + CommCounter and one "
        f"under MemTracker for each. Bytes are per rank per step. A step is forward, backward, "
        f"`opt.step()`, `opt.zero_grad()`, timed between two barriers. Load average (1 min) "
        f"before / after the run: {load[0]:.2f} / {load[1]:.2f}.",
        "",
        "## Summary",
        "",
        "| model | metric | raggedfsdp | FSDP2 | ratio |",
        "|---|---|---:|---:|---:|",
    ]
    for name, r in results.items():
        for label, a, b, ratio in _summary_rows(r, args):
            lines.append(f"| {name} | {label} | {a} | {b} | {ratio} |")
    lines += ["", *_notes(results, args), "", "## Raw numbers", ""]
    for name, r in results.items():
        lines += [f"### {name} ({r['params']:,} parameters)", ""]
        for s in SYSTEMS:
            t = r["times"][s]
            lines.append(
                f"- {s} step times (ms, in order): " + ", ".join(f"{x * 1e3:.1f}" for x in t)
            )
            lines.append(
                f"- {s} min / median / max (ms): {min(t) * 1e3:.1f} / "
                f"{statistics.median(t) * 1e3:.1f} / {max(t) * 1e3:.1f}"
            )
            lines.append(
                f"- {s} CPU time per step, all ranks (ms, in order): "
                + ", ".join(f"{x * 1e3:.1f}" for x in r["cpu"][s])
            )
        lines += ["", "Collectives per step (count, input bytes, output bytes):", ""]
        lines += ["| kind | raggedfsdp | FSDP2 |", "|---|---|---|"]
        kinds = sorted(set(r["counts"]["raggedfsdp"]["comm"]) | set(r["counts"]["fsdp2"]["comm"]))
        for kind in kinds:
            cells = [", ".join(f"{v:,}" for v in _comm(r["counts"][s], kind)) for s in SYSTEMS]
            lines.append(f"| {kind} | {cells[0]} | {cells[1]} |")
        lines += ["", "Copies per step (count, bytes written); indented: inside FSDP2's ops:", ""]
        lines += ["| op | raggedfsdp | FSDP2 |", "|---|---|---|"]
        for key, indent in (("copies_by_op", ""), ("copies_inner", "&nbsp;&nbsp;")):
            ops = sorted(set(r["counts"]["raggedfsdp"][key]) | set(r["counts"]["fsdp2"][key]))
            for op in ops:
                cells = [
                    ", ".join(f"{v:,}" for v in r["counts"][s][key].get(op, [0, 0]))
                    for s in SYSTEMS
                ]
                lines.append(f"| {indent}{op} | {cells[0]} | {cells[1]} |")
        cells = [", ".join(f"{v:,}" for v in r["counts"][s]["copy_backend"]) for s in SYSTEMS]
        lines.append(f"| gloo's copy into a reduce-scatter output | {cells[0]} | {cells[1]} |")
        lines += ["", "Peak memory (MemTracker, bytes):", ""]
        lines += ["| | raggedfsdp | FSDP2 |", "|---|---:|---:|"]
        for rk in range(len(r["peak_per_rank"]["raggedfsdp"])):
            a, b = (r["peak_per_rank"][s][rk] for s in SYSTEMS)
            lines.append(f"| rank {rk}, peak | {a:,} | {b:,} |")
        for key in r["memory_rank0"]["raggedfsdp"]:
            a, b = (r["memory_rank0"][s].get(key, 0) for s in SYSTEMS)
            lines.append(f"| rank 0 at its peak: {key} | {a:,} | {b:,} |")
        lines += ["", "Losses per step:", ""]
        for s in SYSTEMS:
            lines.append(f"- {s}: " + ", ".join(f"{x:.6f}" for x in r["losses"][s]))
        lines.append("")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4, help="gloo ranks (default 4)")
    parser.add_argument("--models", nargs="+", default=["llama-small", "moe-small"])
    parser.add_argument("--steps", type=int, default=40, help="timed steps per system and model")
    parser.add_argument("--block", type=int, default=4, help="steps per system before switching")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per system first")
    parser.add_argument("--batch", type=int, default=8, help="global batch (rows)")
    parser.add_argument("--seq", type=int, default=64, help="tokens per row")
    parser.add_argument("--optim", choices=["adamw", "sgd"], default="adamw")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS / "step.md")
    args = parser.parse_args(argv)
    if args.batch % args.world:
        parser.error(f"--batch {args.batch} must be a multiple of --world {args.world}")
    command = " ".join([".venv/bin/python", "benchmarks/step.py", *sys.argv[1:]])
    print(command, flush=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    t0, load = time.perf_counter(), [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as tmp:
        init_file, out_file = os.path.join(tmp, "rendezvous"), os.path.join(tmp, "results.json")
        mp.spawn(_rank_main, args=(args.world, args, init_file, out_file), nprocs=args.world)
        results = json.loads(Path(out_file).read_text())
    load.append(os.getloadavg()[0])
    text = report(results, args, command, time.perf_counter() - t0, load)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
