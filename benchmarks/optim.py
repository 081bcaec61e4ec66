"""Structure-aware optimizers: distributed Muon against its baseline and peers, in one run.

    .venv/bin/python benchmarks/optim.py            # every section (~5 min on 2 idle cores)
    .venv/bin/python benchmarks/optim.py --quick    # smoke run: small model, few steps
    .venv/bin/python benchmarks/optim.py --cells llama-small:4 --skip-adamw8bit  # shorter

Most of the time goes to the peers (torch.optim.Muon on FSDP2 takes seconds per step;
muon-fsdp2 compiles its Newton-Schulz for about a minute in every cell) and to bf16
matmuls, which are slow on this CPU.

Writes ``benchmarks/results/optim.md`` (or ``--out``). Sections:

1. **Muon step** (per model and world size, gloo ranks on CPU, 1 thread each): every
   system trains the same model on the same batches; its optimizer step alone is
   timed between barriers (the slowest rank; median over the timed steps, after one
   untimed step). Systems:

   - raggedfsdp ``fully_shard`` + ``raggedfsdp.optim.Muon`` (NS of each matrix on a
     FLOP-balanced root, async all-to-all rounds), with the default block policy and
     with ``muon_block_policy`` (whole matrices on one rank where cheap);
   - the baseline: the same with ``distributed="replicated"`` (every rank gathers every
     matrix and runs every Newton-Schulz);
   - FSDP2 + ``torch.optim.Muon`` (+ ``torch.optim.AdamW`` for the rest): DTensor runs
     its Newton-Schulz on ``Shard(0)`` pieces, with hidden collectives;
   - FSDP2 + the ``muon-fsdp2`` package (gathers each matrix to rank ``index % world``
     with ``torch.distributed.gather``; its NS is ``torch.compile``d).

   Measured: step time; collectives per step (``raggedfsdp.tools.profiling.CommCounter``;
   for muon-fsdp2, whose compiled NS refuses a dispatch mode, by wrapping its
   ``gather`` / ``scatter``); bytes sent per step summed over ranks (all-to-all: its
   input; all-gather: ``(w - 1) x`` input; all-reduce: ``2 (w - 1) / w x`` input, a
   ring; gather / scatter: the pieces that leave their rank); optimizer state bytes
   per parameter (every state tensor but ``step``, summed over ranks); for
   raggedfsdp's Muon the Newton-Schulz work per rank (planned FLOPs and measured
   thread CPU time: the load balance) and the matrices that moved no byte.
2. **Whole-matrix block policy on the catalogue**: how many Muon matrices are held
   whole by one rank (no communication) with 1-row blocks and with the policy, and
   the padding either costs, per model and FSDP size (planner only, no tensors).
3. **Convergence**: Muon vs AdamW, 300 steps on the demo corpus.
4. **8-bit AdamW**: ``benchmarks/_adamw8bit_bench.py``'s section (its own peers:
   torchao's ``AdamW8bit`` and bitsandbytes' ``Adam8bit`` on FSDP2).

Each measurement runs in its own process group (a subprocess spawning the ranks), so
a peer that crashes its ranks (gloo aborts the process) is recorded, not fatal.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _adamw8bit_bench  # beside this script, so on sys.path
from _common import (
    ANALYSIS,
    RESULTS,
    ROOT,
    Setup,
    gather_objects,
    header,
    optimizer_steps,
    run_ranks,
    state_tensors,
    train_and_validate,
    write_results,
)

BATCH, SEQ = 8, 32  # Muon step cells: the optimizer is what is timed
MUON = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True)
ADAMW = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
OURS = ("muon", "muon_whole", "muon_replicated")  # keys of SETUPS; the peers':
TORCH, MUON_FSDP2 = "torch_muon", "muon_fsdp2"
CELLS = (("llama-small", 2), ("llama-small", 4), ("moe-small", 4))
CONV_BATCH, CONV_SEQ = 16, 64


# ---- inside a rank -----------------------------------------------------------------------------
def _ours_adamw(model) -> list:
    import raggedfsdp

    return [raggedfsdp.optim.AdamW(model.parameters(), **ADAMW)]


def _ours_muon(distributed: str):
    """``optimizers(model)``: raggedfsdp's Muon (AdamW for the rest), ``distributed`` mode."""

    def optimizers(model) -> list:
        from raggedfsdp.optim import Muon, muon_param_groups

        return [Muon(muon_param_groups(model, **ADAMW), **MUON, distributed=distributed)]

    return optimizers


def _whole_matrices(model, world: int):
    from raggedfsdp.optim import muon_block_policy

    return muon_block_policy(model, world)


def _split_muon(model) -> tuple[list, list]:
    """(the parameters Muon steps, the rest), as ``default_use_muon`` splits them."""
    from raggedfsdp.optim.muon import default_use_muon

    mu = [p for n, p in model.named_parameters() if default_use_muon(n, p)]
    return mu, [p for n, p in model.named_parameters() if not default_use_muon(n, p)]


def _torch_muon(model) -> list:
    import torch

    mu, other = _split_muon(model)
    return [torch.optim.Muon(mu, **MUON), torch.optim.AdamW(other, **ADAMW)]


def _muon_fsdp2(model) -> list:
    import muon_fsdp2

    mu, other = _split_muon(model)
    muon = dict(params=mu, use_muon=True, rms_scale=False, ns_steps=5, **MUON)
    adamw = dict(params=other, use_muon=False, **ADAMW)
    return [muon_fsdp2.Muon([muon, adamw])]


SETUPS = {  # jobs and results name a setup by its key; the tables print its label
    "muon": Setup(label="raggedfsdp Muon", optimizers=_ours_muon("root")),
    "muon_whole": Setup(
        label="raggedfsdp Muon + whole-matrix policy",
        optimizers=_ours_muon("root"),
        block_policy=_whole_matrices,
    ),
    "muon_replicated": Setup(label="baseline: replicated NS", optimizers=_ours_muon("replicated")),
    "torch_muon": Setup(label="FSDP2 + torch.optim.Muon", optimizers=_torch_muon, system="fsdp2"),
    "muon_fsdp2": Setup(label="FSDP2 + muon-fsdp2", optimizers=_muon_fsdp2, system="fsdp2"),
    "adamw": Setup(label="raggedfsdp AdamW", optimizers=_ours_adamw),
}


def _build(system: str, model_name: str, mesh):
    """The model sharded as setup ``system`` (a key of ``SETUPS``) shards it, and its
    optimizers."""
    return SETUPS[system].build(model_name, mesh, max_seq_len=max(SEQ, CONV_SEQ))


def _state_bytes(opts) -> int:
    """Bytes of every optimizer state tensor but ``step``, on this rank."""
    return sum(
        t.numel() * t.element_size()
        for opt in opts
        for state in opt.state.values()
        for t in state_tensors(state)
    )


class _PieceCounter:
    """Counts muon-fsdp2's ``gather`` / ``scatter`` (its compiled NS refuses dispatch modes)."""

    def __init__(self, module, rank: int):
        self.module, self.rank, self.calls, self.sent = module, rank, {}, 0
        self.orig = {n: getattr(module, n) for n in ("gather", "scatter")}

    def __enter__(self):
        def gather(tensor, gather_list=None, *args, group_dst=None, **kw):
            self.calls["gather"] = self.calls.get("gather", 0) + 1
            if self.rank != group_dst:
                self.sent += tensor.numel() * tensor.element_size()
            return self.orig["gather"](tensor, gather_list, *args, group_dst=group_dst, **kw)

        def scatter(tensor, scatter_list=None, *args, **kw):
            self.calls["scatter"] = self.calls.get("scatter", 0) + 1
            if scatter_list:
                self.sent += sum(t.numel() * t.element_size() for t in scatter_list[1:])
            return self.orig["scatter"](tensor, scatter_list, *args, **kw)

        self.module.gather, self.module.scatter = gather, scatter
        return self

    def __exit__(self, *exc):
        for n, f in self.orig.items():
            setattr(self.module, n, f)


def _sent_bytes(summary: dict, world: int) -> float:
    """Bytes this rank sends in ``CommCounter`` collectives (see the module docstring)."""
    sent = 0.0
    for kind, s in summary.items():
        if kind == "all_to_all":
            sent += s.input_bytes
        elif kind == "all_gather":
            sent += (world - 1) * s.input_bytes
        elif kind == "all_reduce":
            sent += 2 * (world - 1) / world * s.input_bytes
        else:
            sent += s.input_bytes
    return sent


def _measure(system: str, job: dict, mesh, rank: int, world: int, data) -> dict:
    import torch
    import torch.distributed as dist

    from raggedfsdp.tools.profiling import CommCounter

    model, opts = _build(system, job["model"], mesh)
    counting = job["steps"] + 1  # step 0 untimed (compiles, plans); the last counted
    counters, ours = [], []

    def count(step: int):
        if step != counting:
            return contextlib.nullcontext()
        if system == MUON_FSDP2:
            import muon_fsdp2

            counters.append(_PieceCounter(muon_fsdp2, rank))
        else:
            counters.append(CommCounter())
        return counters[-1]

    def read_own_counts(step: int) -> None:
        if hasattr(opts[0], "last_step") and 0 < step < counting:
            s = opts[0].last_step
            ours.append((s.ns_cpu_seconds, s.ns_seconds, s.wait_seconds, s.bytes_sent))

    times, cpus = optimizer_steps(  # cpus: this rank's process CPU time (gloo threads too)
        model, opts, data, counting + 1, batch_size=BATCH, seq_len=SEQ,
        around=count, after=read_own_counts,
    )  # fmt: skip
    times, cpus, (counter,) = times[:-1], cpus[:-1], counters
    if isinstance(counter, _PieceCounter):
        comm, sent = dict(counter.calls), float(counter.sent)
    else:
        summary = counter.summary()
        comm = {k: v.count for k, v in summary.items()}
        sent = _sent_bytes(summary, world)
    totals = torch.tensor([_state_bytes(opts), sent, *cpus[1:]], dtype=torch.float64)
    dist.all_reduce(totals)
    out = {
        "step_ms": 1e3 * statistics.median(times[1:]),
        "cpu_s": statistics.median(totals[2:].tolist()),
        "first_step_s": times[0],
        "state_bytes_per_param": totals[0].item() / sum(p.numel() for p in model.parameters()),
        "collectives": comm,
        "sent_bytes": totals[1].item(),
    }
    if ours:
        s = opts[0].last_step
        per_rank = gather_objects([statistics.median(v) for v in zip(*ours)])
        out.update(
            ns_cpu_s=[r[0] for r in per_rank],
            ns_wall_s=[r[1] for r in per_rank],
            wait_s=[r[2] for r in per_rank],
            exact_sent_bytes=sum(r[3] for r in per_rank),
            ns_flops=s.ns_flops_per_rank,
            matrices=s.matrices,
            comm_free=s.comm_free,
        )
    return out


def _rank_main(rank: int, world: int, save, job: dict) -> None:
    import torch.distributed as dist
    from torch.distributed.tensor import init_device_mesh

    from raggedfsdp.train.data import load_corpus

    mesh = init_device_mesh("cpu", (world,))
    corpus = load_corpus()
    results = {}
    for system in job["systems"]:
        if job["kind"] == "converge":
            model, opts = _build(system, job["model"], mesh)
            rows = dict(batch_size=CONV_BATCH, seq_len=CONV_SEQ)
            results[system] = train_and_validate(model, opts, corpus, steps=job["steps"], **rows)
        else:
            try:
                results[system] = _measure(system, job, mesh, rank, world, corpus.train)
            except Exception as e:  # a peer that refuses the model fails on every rank alike
                line = next((s for s in str(e).splitlines() if s.strip()), "")
                results[system] = {"error": f"{type(e).__name__}: {line}"}
        dist.barrier()
        save(results)  # what is done survives a crash
    results["_corpus"] = f"{corpus.source} ({corpus.train.numel():,} training bytes)"
    save(results)
    dist.barrier()


# ---- the parent ---------------------------------------------------------------------------------
def _run_job(job: dict, timeout: float) -> dict:
    """Run one job in a fresh process group; a crash is recorded for the systems it left."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        cmd = [sys.executable, __file__, "--worker", json.dumps(job), "--worker-out", out]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
            failed = proc.returncode != 0
            why = _crash_reason(proc.stdout + proc.stderr) if failed else ""
        except subprocess.TimeoutExpired:
            failed, why = True, f"did not finish in {timeout:.0f} s"
        res = json.loads(Path(out).read_text()) if os.path.exists(out) else {}
    if failed:
        for system in job["systems"]:
            res.setdefault(system, {"error": f"the ranks crashed: {why}"})
    return res


def _crash_reason(text: str) -> str:
    lines = [s.strip() for s in text.splitlines() if s.strip()]
    for key in ("what():", "Error:", "Exception:"):
        hits = [s for s in lines if key in s and "ProcessExitedException" not in s]
        if hits:
            return hits[0][:300]
    return lines[-1][:300] if lines else "no output"


def _fmt_bytes(n: float) -> str:
    for unit, scale in (("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _muon_section(cells: dict, steps: int) -> list[str]:
    lines = [
        "## 1. Muon optimizer step",
        "",
        f"Each cell: one model, `w` gloo ranks (1 thread each), batches of {BATCH} x {SEQ} "
        f"tokens; Muon lr {MUON['lr']}, weight decay {MUON['weight_decay']}, momentum "
        f"{MUON['momentum']}, Nesterov, 5 NS steps; AdamW (the rest) lr {ADAMW['lr']}, "
        f"betas {ADAMW['betas']}. Step = `opt.step()` alone, the slowest rank, median of "
        f"{steps} timed steps after one untimed step; its CPU time (process, gloo's threads "
        "included) summed over ranks is the work, which other jobs on the machine do not "
        "inflate. Sent bytes: one step, summed over "
        "ranks (see the script's docstring for the per-collective rule). State: bytes of "
        "optimizer state per model parameter, summed over ranks.",
        "",
    ]
    for (model, world), res in cells.items():
        base = res.get(OURS[0], {}).get("step_ms")
        lines += [
            f"### `{model}`, {world} ranks",
            "",
            "| system | step (ms) | vs raggedfsdp Muon | step CPU s, all ranks | collectives / "
            "step | sent / step | state B/param | NS per rank: CPU s (FLOP share) | comm-free "
            "matrices |",
            "| --- | ---: | ---: | ---: | --- | ---: | ---: | --- | ---: |",
        ]
        for key, r in res.items():
            if key.startswith("_"):
                continue
            system = SETUPS[key].label
            if "error" in r:
                lines.append(f"| {system} | failed: {r['error']} | | | | | | | |")
                continue
            coll = ", ".join(f"{k} x{v}" for k, v in sorted(r["collectives"].items())) or "none"
            ratio = f"{r['step_ms'] / base:.2f}x" if base else "-"
            ns = free = "-"
            if "ns_cpu_s" in r:
                total = sum(r["ns_flops"]) or 1.0
                ns = ", ".join(
                    f"{c:.2f} ({100 * f / total:.0f}%)"
                    for c, f in zip(r["ns_cpu_s"], r["ns_flops"])
                )
                free = f"{r['comm_free']} / {r['matrices']}"
            lines.append(
                f"| {system} | {r['step_ms']:.0f} | {ratio} | {r['cpu_s']:.2f} | {coll} | "
                f"{_fmt_bytes(r['sent_bytes'])} | {r['state_bytes_per_param']:.2f} | {ns} | "
                f"{free} |"
            )
        ours = res.get(OURS[0], {})
        if "ns_cpu_s" in ours:
            cpu, flops = ours["ns_cpu_s"], ours["ns_flops"]
            lines += [
                "",
                "| raggedfsdp Muon | NS balance, slowest / mean rank: CPU time | planned FLOPs "
                "| bytes it counted itself | bytes CommCounter saw | waiting for communication, "
                "slowest rank (s) |",
                "| --- | ---: | ---: | ---: | ---: | ---: |",
                f"| per step | {max(cpu) / statistics.mean(cpu):.2f} | "
                f"{max(flops) / statistics.mean(flops):.2f} | "
                f"{_fmt_bytes(ours['exact_sent_bytes'])} | {_fmt_bytes(ours['sent_bytes'])} | "
                f"{max(ours['wait_s']):.3f} |",
            ]
        lines.append("")
    return lines


def _catalogue_section(worlds, budgets) -> list[str]:
    from raggedfsdp.models import get_config, param_groups
    from raggedfsdp.models.catalogue import REAL_MODELS
    from raggedfsdp.optim.muon import comm_free_matrices, default_use_muon, plan_whole_matrices
    from raggedfsdp.planner import TensorSpec

    head = " | ".join(f"whole, budget {100 * b:g}%: matrices / padding" for b in budgets)
    lines = [
        "## 2. Whole-matrix block policy on the catalogued models",
        "",
        "Planner only (bf16 buffers, 128-byte alignment, the model's `fully_shard` groups: "
        "embedding, each block, head). Muon matrices: `default_use_muon` (2-D hidden "
        "matrices, each member of an expert stack). *Comm-free*: held whole by one rank, so "
        "`Muon.step` moves no byte for it. Base: 1-row blocks. Policy: `plan_whole_matrices` "
        "(every matrix whole if the extra padding stays within the budget, else smallest "
        "first, never splitting a matrix that was whole by luck); budget = extra padding "
        "allowed per group, as a share of its elements.",
        "",
        f"| model | FSDP size | Muon matrices | comm-free, 1-row blocks / padding | {head} |",
        "| --- | ---: | ---: | ---: | " + " | ".join("---:" for _ in budgets) + " |",
    ]
    for name in REAL_MODELS:
        groups = param_groups(get_config(name))
        for world in worlds:
            totals = {b: [0, 0] for b in budgets}  # comm-free, padding
            base_free = base_pad = numel = matrices = 0
            cache: dict = {}
            for g in groups:
                key = tuple((p.shape, p.stack) for p in g.params)
                if key not in cache:
                    specs = [TensorSpec(name=p.fqn, shape=p.shape, stack=p.stack) for p in g.params]
                    members = {
                        p.fqn: (p.shape[0] if p.stack else 1)
                        for p in g.params
                        if default_use_muon(p.fqn, p)
                    }
                    row = {}
                    for b in budgets:
                        plan = plan_whole_matrices(
                            specs, world, list(members), max_extra_padding=b, dtype="bfloat16"
                        )
                        row[b] = (comm_free_matrices(plan.layout, members)[0], plan.layout.padding)
                    free, n = comm_free_matrices(plan.base, members)
                    cache[key] = (n, free, plan.base.padding, plan.base.total_numel, row)
                n, free, pad, size, row = cache[key]
                matrices, base_free, base_pad, numel = (
                    matrices + n,
                    base_free + free,
                    base_pad + pad,
                    numel + size,
                )
                for b in budgets:
                    totals[b][0] += row[b][0]
                    totals[b][1] += row[b][1]
            cols = " | ".join(
                f"{totals[b][0]:,} ({100 * totals[b][0] / matrices:.0f}%) / "
                f"{100 * totals[b][1] / numel:.3f}%"
                for b in budgets
            )
            lines.append(
                f"| {name} | {world} | {matrices:,} | {base_free:,} "
                f"({100 * base_free / matrices:.0f}%) / {100 * base_pad / numel:.3f}% | {cols} |"
            )
    lines.append("")
    return lines


def _convergence_section(res: dict, model: str, steps: int, world: int) -> list[str]:
    adamw, muon = res["adamw"], res["muon"]
    return [
        "## 3. Convergence: Muon vs AdamW",
        "",
        f"`{model}`, {steps} steps, {world} ranks, raggedfsdp `fully_shard`, batches of "
        f"{CONV_BATCH} x {CONV_SEQ} bytes of the demo corpus ({res['_corpus']}); same init, "
        f"same batches, constant learning rates. AdamW: `raggedfsdp.optim.AdamW` {ADAMW}. "
        f"Muon: `raggedfsdp.optim.Muon` {MUON} on the hidden matrices, AdamW as above on "
        "the rest. Final loss: mean training loss of the last 20 steps; validation: 8 "
        "fixed batches of the held-out split. Acceptance: Muon's final loss no worse than "
        "AdamW's.",
        "",
        "| optimizer | first loss | final loss | validation loss | wall time (s) |",
        "| --- | ---: | ---: | ---: | ---: |",
        *(
            f"| {name} | {r['losses'][0]:.4f} | {r['final']:.4f} | {r['val']:.4f} | "
            f"{r['seconds']:.0f} |"
            for name, r in (("AdamW", adamw), ("Muon", muon))
        ),
        "",
    ]


_ADAMW8BIT_RUNNER = """
import argparse, json, sys
sys.path[:0] = json.loads(sys.argv[2])
import _adamw8bit_bench
print(_adamw8bit_bench.run(argparse.Namespace(**json.loads(sys.argv[1]))))
"""


def _adamw8bit_section(args) -> list[str]:
    """helper module ``_adamw8bit_bench``'s section, run in its own process (with a timeout)."""
    title = "## 4. 8-bit AdamW"
    if args.skip_adamw8bit:
        return [title, "", "Skipped (`--skip-adamw8bit`).", ""]
    here = Path(__file__).resolve().parent
    options = {
        k: v
        for k, v in vars(args).items()
        if k.startswith("adamw8bit") or k in ("quick", "command")
    }
    cmd = [sys.executable, "-c", _ADAMW8BIT_RUNNER, json.dumps(options)]
    cmd.append(json.dumps([str(ROOT), str(here)]))
    timeout = min(args.timeout, 600.0)  # the section takes ~3 min; a blocked rank never ends
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return [title, "", f"Failed: did not finish in {timeout:.0f} s (a rank blocked?).", ""]
    text = (
        proc.stdout[proc.stdout.find("## 8-bit AdamW") :] if "## 8-bit AdamW" in proc.stdout else ""
    )
    if proc.returncode != 0 or not text:
        why = _crash_reason(proc.stdout + proc.stderr)
        return [title, "", f"Failed (exit {proc.returncode}): `{why}`.", ""]
    return [text.replace("## 8-bit AdamW", title, 1), ""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run, not the figures")
    parser.add_argument(
        "--cells",
        nargs="+",
        default=[f"{m}:{w}" for m, w in CELLS],
        help="Muon step cells, MODEL:WORLD (default: %(default)s)",
    )
    parser.add_argument("--steps", type=int, default=3, help="timed Muon steps per system")
    parser.add_argument("--conv-model", default="llama-tiny")
    parser.add_argument("--conv-steps", type=int, default=300)
    parser.add_argument("--conv-world", type=int, default=2)
    parser.add_argument("--catalogue-worlds", type=int, nargs="+", default=[8, 64, 256])
    parser.add_argument("--skip-muon", action="store_true")
    parser.add_argument("--skip-convergence", action="store_true")
    parser.add_argument("--skip-adamw8bit", action="store_true")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per job")
    parser.add_argument("--out", type=Path, default=RESULTS / "optim.md")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    _adamw8bit_bench.add_arguments(parser)
    args = parser.parse_args()
    if args.worker:
        job = json.loads(args.worker)
        run_ranks(_rank_main, job["world"], job, out=args.worker_out)
        return
    command = "python " + " ".join(sys.argv)
    args.command = command
    start = time.perf_counter()
    cells = [(c.split(":")[0], int(c.split(":")[1])) for c in args.cells]
    if args.quick:
        cells = [("llama-tiny", 2)]
    steps = 1 if args.quick else args.steps
    conv_steps = 20 if args.quick else args.conv_steps
    sections: list[str] = []

    def write(done: bool = False) -> None:
        """The results so far (a later section that crashes leaves the earlier ones)."""
        status = "" if done else ", incomplete: still running or stopped"
        packages = ("torch", "muon-fsdp2", "torchao", "bitsandbytes", "numpy")
        page = header(
            "Structure-aware optimizers: Muon (and 8-bit AdamW)",
            command,
            time.perf_counter() - start,
            packages=packages,
            note=status,
        )
        page += [
            "Peers installed with `pip install --no-deps muon-fsdp2 torchao bitsandbytes` "
            "(torch stays 2.13.0).",
            "",
            ANALYSIS,
            "",
            *sections,
        ]
        write_results(args.out, "\n".join(page))

    if not args.skip_muon:
        results = {}
        for model, world in cells:
            print(f"Muon step: {model}, {world} ranks", flush=True)
            job = dict(kind="step", model=model, world=world, steps=steps, systems=list(OURS))
            res = _run_job(job, args.timeout)
            for peer in (TORCH, MUON_FSDP2):
                print(f"  peer {peer}", flush=True)
                res.update(_run_job({**job, "systems": [peer]}, args.timeout))
            results[model, world] = res
        sections += _muon_section(results, steps)
        write()
    print("catalogue", flush=True)
    sections += _catalogue_section(args.catalogue_worlds, (0.0, 0.01))
    write()
    if not args.skip_convergence:
        print("convergence", flush=True)
        job = dict(
            kind="converge",
            model=args.conv_model,
            world=args.conv_world,
            steps=conv_steps,
            systems=["adamw", "muon"],
        )
        res = _run_job(job, args.timeout)
        sections += _convergence_section(res, args.conv_model, conv_steps, args.conv_world)
        write()
    print("8-bit AdamW", flush=True)
    sections += _adamw8bit_section(args)
    write(done=True)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
