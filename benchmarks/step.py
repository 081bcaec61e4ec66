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
- collectives per step (``raggedfsdp.tools.profiling.CommCounter``): count and bytes per
  kind; an all-gather's output and a reduce-scatter's input are whole buffers, so
  they include the padding;
- copies per step (``raggedfsdp.tools.profiling.CopyCounter``): every copy-like op, and the
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
import os

import _ab  # beside this script, so on sys.path
import torch
from _ab import SYSTEMS, StepRun, loss_diff_row, ratio_cell
from _common import (
    ANALYSIS,
    fsdp2_padding,
    fsdp2_params,
    header,
    ragged_groups,
    ragged_padding,
    shard,
)
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass_type

from raggedfsdp.fsdp import buffers_of
from raggedfsdp.tools.profiling import CommCounter, CopyCounter, buffer_storages
from raggedfsdp.train.report import mib

RS_OP = "c10d._reduce_scatter_base_.default"  # gloo copies into this op's output on wait


# ---- one system: a sharded model, its optimizer, its steps ---------------------------------
def _shard_kwargs(system: str, args) -> dict:
    """``fully_shard`` keywords of ``--reshard-after-forward`` and ``--mp``, for ``system``."""
    kwargs = {"reshard_after_forward": args.reshard_after_forward}
    if args.mp == "bf16":
        if system == "raggedfsdp":
            from raggedfsdp import MixedPrecisionPolicy
        else:
            from torch.distributed.fsdp import MixedPrecisionPolicy
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    return kwargs


class Run(StepRun):
    """One model sharded by one system on all ranks (1-D), with ``--optim``."""

    def __init__(self, system: str, model_name: str, args, rank: int, world: int, data):
        from torch.distributed.tensor import init_device_mesh

        from raggedfsdp.models import Transformer, get_config

        model = Transformer(get_config(model_name), max_seq_len=args.seq, seed=args.seed)
        self.n_params = sum(p.numel() for p in model.parameters())
        shard(model, init_device_mesh("cpu", (world,)), system, **_shard_kwargs(system, args))
        if args.optim == "adamw":
            opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
        else:
            opt = torch.optim.SGD(model.parameters(), lr=args.lr)
        super().__init__(system, model, opt, data, args, coord=(rank, world), world=world)

    # ---- what the system keeps ------------------------------------------------------------
    def padding(self) -> int:
        """Elements added to shard the parameters, summed over the groups."""
        if self.system == "raggedfsdp":
            return sum(ragged_padding(self.model).values())
        return sum(fsdp2_padding(ps, self.world) for ps in fsdp2_params(self.model).values())

    def fsdp_copies(self, copies) -> list:
        """The copies this system makes of parameter or gradient data (not gloo's own)."""
        if self.system == "raggedfsdp":
            return [e for e in copies.touching(buffer_storages(self.model)) if e.within != RS_OP]
        return [e for e in copies.top_level() if e.op.startswith("fsdp.")]


# ---- measurements ------------------------------------------------------------------------------
@contextlib.contextmanager
def _both(first, second):
    with first, second:
        yield


def count_step(run: Run) -> dict:
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


def memory_step(run: Run) -> tuple[dict, dict]:
    """Peak memory of one step by ``MemTracker`` category (``StepRun.memory_step``), and
    what each FSDP group held at that moment (``_PeakGroups``)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    at_peak = _PeakGroups(run)

    class Tracker(MemTracker):  # reports its running total to at_peak after every op
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = super().__torch_dispatch__(func, types, args, kwargs)
            if out is not NotImplemented:
                at_peak.sample(self, func)
            return out

    return run.memory_step(tracker=Tracker), at_peak.result()


def _nbytes(tensors) -> int:
    """Bytes of the distinct storages of ``tensors`` (0 for a freed one)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(n for ptr, n in storages.items() if ptr)


class _PeakGroups:
    """What each group holds at the step's peak: ``{group: [unsharded params, unsharded
    gradients]}`` in bytes, the module and op at the peak, and the number of groups unsharded.

    raggedfsdp: the global parameter storage (the all-gather output, and in backward the
    gradients written over the parameters: [Note: gradients in place]; counted once, as
    parameters) and the flat gradient storage of each buffer, where one is allocated. FSDP2:
    the unsharded parameters plus an all-gather output in flight, the unsharded ``.grad``s;
    its reduce-scatter input (the gradients' copy, kept until the next reduce-scatter) is
    the row ``reduce-scatter input``. The rest of the peak (sharded parameters and
    gradients, optimizer states, activations, temporaries, raggedfsdp's cast for a reduce-
    scatter in another dtype) is the row ``other``.
    """

    def __init__(self, run: Run):
        self.run, self.best, self.at = run, -1, {}
        if run.system == "raggedfsdp":
            self.groups = ragged_groups(run.model)
        else:
            self.groups = {
                name or "root": m._get_fsdp_state()._fsdp_param_group
                for name, m in run.model.named_modules()
                if hasattr(m, "_get_fsdp_state") and m._get_fsdp_state()._fsdp_param_group
            }

    def _held(self) -> dict[str, list[int]]:
        held = {}
        if self.run.system == "raggedfsdp":
            for name, bufs in self.groups.items():
                held[name] = [
                    _nbytes(b.unsharded for b in bufs),
                    _nbytes(b.unsharded_grad for b in bufs),
                ]
            return held
        rs_inputs = [st.reduce_scatter_input for st in self._comm_ctx().reduce_scatter_states]
        for name, pg in self.groups.items():
            params = [t for p in pg.fsdp_params for t in p.all_gather_outputs]
            if pg._all_gather_result is not None:  # in flight: the all-gather output
                params.append(pg._all_gather_result.all_gather_output)
            grads = [
                p._unsharded_param.grad
                for p in pg.fsdp_params
                if getattr(p, "_unsharded_param", None) is not None
                and p._unsharded_param.grad is not None
            ]
            held[name] = [_nbytes(params), _nbytes(grads)]
        held["reduce-scatter input"] = [0, _nbytes(rs_inputs)]
        return held

    def _comm_ctx(self):
        return next(iter(self.groups.values())).comm_ctx  # one, shared by the groups

    def sample(self, tracker, func) -> None:
        snap = tracker.get_tracker_snapshot("current")
        total = max((by_kind.get("Total", 0) for by_kind in snap.values()), default=0)
        if total > self.best:
            parents = [p for p in tracker._mod_tracker.parents if p != "Global"]
            self.best = total
            self.at = {
                "total": int(total),
                "groups": self._held(),
                "module": max(parents, key=len, default="Global"),
                "op": str(func),
                "backward": bool(tracker._mod_tracker.is_bw),
            }

    def result(self) -> dict:
        at = self.at
        at["unsharded_groups"] = sum(1 for p, _ in at["groups"].values() if p)
        return at


class _MostAlive(TorchDispatchMode):
    """Samples ``measure()`` after every op run under it and keeps the largest value."""

    def __init__(self, measure):
        super().__init__()
        self.measure, self.most = measure, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(is_traceable_wrapper_subclass_type(t) for t in types):
            return NotImplemented  # DTensor: sample after its local ops
        out = func(*args, **(kwargs or {}))
        self.most = max(self.most, self.measure())
        return out


def unsharded_grads_step(run: Run) -> list[int]:
    """raggedfsdp only: ``[most bytes of unsharded gradients held at once, all groups]``.

    A diagnostic for the memory numbers: after every op of one step, the bytes of each
    buffer's storage that holds unsharded gradients, its gradient storage, or its
    unsharded parameter storage while gradients are written over the parameters
    ([Note: gradients in place]: those bytes are the parameters' too, counted once).
    """
    bufs = buffers_of(run.model)

    def held(b) -> int:
        own = b.unsharded_grad.untyped_storage().nbytes()
        return own or (b.unsharded.untyped_storage().nbytes() if b.unsharded_holds_grads else 0)

    alive = _MostAlive(lambda: sum(held(b) for b in bufs))
    run.step(around=lambda: alive)
    return [alive.most, sum(b.unsharded_nbytes for b in bufs)]


def _rank_main(rank: int, world: int, save, args) -> None:
    from raggedfsdp.train.data import DataConfig, load_corpus

    data = load_corpus(DataConfig(max_bytes=1 << 20)).train
    results = {}
    for model_name in args.models:
        runs = {s: Run(s, model_name, args, rank, world, data) for s in SYSTEMS}
        _ab.alternate(runs, warmup=args.warmup, steps=args.steps, block=args.block)
        counts = {s: count_step(runs[s]) for s in SYSTEMS}
        memory, at_peak = {}, {}
        for s in SYSTEMS:
            memory[s], at_peak[s] = memory_step(runs[s])
        held = unsharded_grads_step(runs["raggedfsdp"])
        runs["fsdp2"].step()  # same data for both on every step
        bufs = buffers_of(runs["raggedfsdp"].model)
        results[model_name] = {
            "params": runs["raggedfsdp"].n_params,
            **_ab.timing_results(runs, memory),
            "padding": {s: runs[s].padding() for s in SYSTEMS},
            "padding_bound": sum(b.layout.lower_bound_padding for b in bufs),
            "counts": counts,
            "at_peak_rank0": at_peak,
            "ragged_unsharded_grads": held,
            "ragged_shard_grad_bytes": sum(b.layout.shard_size * b.dtype.itemsize for b in bufs),
        }
        del runs
    save(results)


# ---- report ------------------------------------------------------------------------------------
_r = ratio_cell


def _comm(c: dict, kind: str) -> tuple[int, int, int]:
    return tuple(c["comm"].get(kind, [0, 0, 0]))


def _summary_rows(r: dict, args) -> list[tuple[str, str, str, str]]:
    """(metric, raggedfsdp, FSDP2, ratio raggedfsdp / FSDP2), formatted."""
    ca, cb = r["counts"]["raggedfsdp"], r["counts"]["fsdp2"]
    rows = _ab.time_rows(r, args.block)
    for kind, i, what in (("all_gather", 2, "output"), ("reduce_scatter", 1, "input")):
        a, b = _comm(ca, kind)[i], _comm(cb, kind)[i]
        rows.append((f"{kind} bytes ({what}, MiB)", mib(a), mib(b), _r(a, b, 4)))
    for key, what in (("copy_fsdp", "FSDP copies"), ("copy_total", "all copies")):
        (na, a), (nb, b) = ca[key], cb[key]
        rows.append((f"{what}: count / MiB", f"{na} / {mib(a)}", f"{nb} / {mib(b)}", _r(a, b)))
    (na, a), (nb, b) = ca["copy_backend"], cb["copy_backend"]
    rows.append(
        ("gloo's copies into reduce-scatter outputs: count / MiB (in neither total)",
         f"{na} / {mib(a)}", f"{nb} / {mib(b)}", _r(a, b))
    )  # fmt: skip
    pa, pb = (max(r["peak_per_rank"][s]) for s in SYSTEMS)
    rows.append(("peak memory, max over ranks (MiB)", mib(pa), mib(pb), _r(pa, pb)))
    held, total = r["ragged_unsharded_grads"]
    label = "unsharded gradients (own storage or over the parameters): most at once / all (MiB)"
    rows.append((label, f"{mib(held)} / {mib(total)}", "", ""))
    rows.append(("shard gradient storage (MiB)", mib(r["ragged_shard_grad_bytes"]), "", ""))
    da, db = r["padding"]["raggedfsdp"], r["padding"]["fsdp2"]
    pct = [f"{d:,} ({100 * d / r['params']:.3f}%)" for d in (da, db)]
    rows.append(("padding, elements (% of params)", pct[0], pct[1], _r(da, db)))
    rows.append(
        ("padding, the planner's lower bound (elements)", f"{r['padding_bound']:,}", "", "")
    )
    rows.append(loss_diff_row(r))
    return rows


def _raw_numbers(name: str, r: dict) -> list[str]:
    lines = [f"### {name} ({r['params']:,} parameters)", "", *_ab.time_lines(r, spread=True)]
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
                ", ".join(f"{v:,}" for v in r["counts"][s][key].get(op, [0, 0])) for s in SYSTEMS
            ]
            lines.append(f"| {indent}{op} | {cells[0]} | {cells[1]} |")
    cells = [", ".join(f"{v:,}" for v in r["counts"][s]["copy_backend"]) for s in SYSTEMS]
    lines.append(f"| gloo's copy into a reduce-scatter output | {cells[0]} | {cells[1]} |")
    lines += _ab.memory_lines(r)
    lines += _at_peak_table(r)
    return [*lines, *_ab.loss_lines(r), ""]


def _at_peak_table(r: dict) -> list[str]:
    """Rank 0 at each system's peak: where it was, and what each group held (MiB)."""
    at = r["at_peak_rank0"]
    lines = ["", "Rank 0 at the peak, by group (MiB: unsharded parameters / gradients):", ""]
    lines += ["| | raggedfsdp | FSDP2 |", "|---|---:|---:|"]
    for key, label in (("module", "module running"), ("op", "op")):
        lines.append(f"| {label} | {at['raggedfsdp'][key]} | {at['fsdp2'][key]} |")
    phases = ["backward" if at[s]["backward"] else "forward / optimizer" for s in SYSTEMS]
    lines.append(f"| phase | {phases[0]} | {phases[1]} |")
    counts = [at[s]["unsharded_groups"] for s in SYSTEMS]
    lines.append(f"| groups holding unsharded parameters | {counts[0]} | {counts[1]} |")
    names = list(dict.fromkeys([*at["raggedfsdp"]["groups"], *at["fsdp2"]["groups"]]))
    held = {s: [0, 0] for s in SYSTEMS}
    for name in names:
        cells = []
        for s in SYSTEMS:
            p, g = at[s]["groups"].get(name, [0, 0])
            held[s] = [held[s][0] + p, held[s][1] + g]
            cells.append(f"{mib(p)} / {mib(g)}" if name in at[s]["groups"] else "")
        lines.append(f"| {name} | {cells[0]} | {cells[1]} |")
    cells = [f"{mib(held[s][0])} / {mib(held[s][1])}" for s in SYSTEMS]
    lines.append(f"| all groups | {cells[0]} | {cells[1]} |")
    other = [mib(at[s]["total"] - sum(held[s])) for s in SYSTEMS]
    lines.append(f"| other (activations, optimizer, sharded, temps) | {other[0]} | {other[1]} |")
    lines.append(f"| peak | {mib(at['raggedfsdp']['total'])} | {mib(at['fsdp2']['total'])} |")
    return lines


def report(results: dict, args, command: str, seconds: float, load: list) -> str:
    """The page: configuration, the summary table, the analysis (kept), the raw numbers."""
    lines = header("Training step: raggedfsdp vs FSDP2", command, seconds)
    lines += [
        f"Configuration: {args.world} gloo ranks on {os.cpu_count()} CPU cores (1 thread each), "
        f"{'fp32' if args.mp == 'fp32' else 'bf16 parameters, fp32 reduce'}, "
        f"{args.optim} (lr {args.lr}), global batch {args.batch} x {args.seq} tokens "
        f"(rows split over ranks), seed {args.seed}; `fully_shard` on each transformer block, "
        f"then the root (reshard_after_forward={args.reshard_after_forward}, defaults otherwise) "
        f"for both systems; "
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
        for label, a, b, rat in _summary_rows(r, args):
            lines.append(f"| {name} | {label} | {a} | {b} | {rat} |")
    lines += ["", ANALYSIS, "", "## Raw numbers", ""]
    for name, r in results.items():
        lines += _raw_numbers(name, r)
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _ab.add_arguments(parser, steps=40, block=4, per="model", page="step.md")
    parser.add_argument("--optim", choices=["adamw", "sgd"], default="adamw")
    parser.add_argument(
        "--reshard-after-forward",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="fully_shard(reshard_after_forward=...) of the blocks and the root (default True)",
    )
    parser.add_argument(
        "--mp", choices=["fp32", "bf16"], default="fp32", help="bf16: param bf16, reduce fp32"
    )
    args = parser.parse_args(argv)
    if args.batch % args.world:
        parser.error(f"--batch {args.batch} must be a multiple of --world {args.world}")
    _ab.run_page("step.py", _rank_main, args, report)


if __name__ == "__main__":
    main()
