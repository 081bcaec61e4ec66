"""Composed meshes: raggedfsdp vs torch's FSDP2 on 1-D FSDP, HSDP, FSDP x TP and FSDP x EP.

    .venv/bin/python benchmarks/composition.py                          # 4 gloo ranks, both models
    .venv/bin/python benchmarks/composition.py --steps 2 --warmup 1 --models moe-tiny \
        --meshes fsdp hsdp fsdp_ep  # smoke run (the tiny models' 3 heads do not split over tp 2)

Each rank builds every model twice from the same seed, once sharded by
``raggedfsdp.fully_shard`` and once by ``torch.distributed.fsdp.fully_shard``, on each
of four meshes of the 4 gloo ranks (the same mesh object for both systems):

- ``fsdp``: 1-D, ``(shard 4)``; each transformer block, then the root.
- ``hsdp``: 2-D, ``(replicate 2, shard 2)``; each block, then the root, on the 2-D mesh.
- ``fsdp_tp``: 2-D, ``(dp 2, tp 2)``; each block ``parallelize_module``'d on ``tp``
  (``ColwiseParallel`` on ``attention.wq/wk/wv`` and, dense model only,
  ``feed_forward.w1/w3``; ``RowwiseParallel`` on ``attention.wo`` and
  ``feed_forward.w2``; the MoE model's experts stay data-parallel), then
  ``fully_shard(block, mesh=mesh["dp"])``, then the root on ``mesh["dp"]``.
- ``fsdp_ep``: 2-D, ``(dp_mod_ep 2, ep 2)``, MoE models only (a dense model is skipped);
  built as ``tests/dist/test_ep.py`` and torchtitan do: ``dp = mesh._flatten("dp")`` (all 4
  ranks); in each MoE block ``expert_parallel(block.moe, mesh["ep"])`` (the stacked
  experts ``Shard(0)`` over ``ep``, tokens exchanged by all-to-alls), then
  ``fully_shard(block.moe.experts, mesh=mesh["dp_mod_ep"])`` with a gradient divide factor
  of 4 and sum reduction; then ``fully_shard(block, mesh=dp)`` for every block and the
  root on ``dp``.

Every data-parallel coordinate takes its own rows of the same global batch (the two
tp ranks of one dp coordinate the same rows; on ``fsdp_ep`` all 4 ranks are
data-parallel). The two systems alternate in blocks of
``--block`` steps (ABBA order). Measured per system and mesh:

- step time: forward, backward, ``opt.step()``, ``opt.zero_grad()`` between two
  barriers; the median and the ratio raggedfsdp / FSDP2, the ratio per round, and the
  CPU time of a step summed over the ranks' processes;
- collectives per step by kind and by mesh dimension: ``raggedfsdp.tools.profiling.CommCounter``
  subclassed to record each collective's process group, matched to the mesh
  dimension whose group has the same ranks (``dp`` on ``fsdp_ep``: the flattened 4-rank
  group; ``world``: all 4 ranks, on another 2-D mesh);
  bytes are an all-gather's output and any other collective's input, per rank;
- peak memory per rank over one step (``MemTracker`` via
  ``raggedfsdp.tools.profiling.peak_memory``, each system's persistent storages tracked);
- the per-step losses of the two systems (max abs difference).

No gradient clipping (torch's ``clip_grad_norm_`` refuses FSDP2 x TP's mixed meshes).
Writes ``benchmarks/results/composition.md`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import os

import _ab  # beside this script, so on sys.path
import torch
import torch.distributed as dist
from _ab import SYSTEMS, StepRun, loss_diff_row, ratio_cell
from _common import ANALYSIS, header
from torch.distributed.distributed_c10d import _resolve_process_group

from raggedfsdp.tools.profiling import CommCounter
from raggedfsdp.train.report import mib

MESHES = ("fsdp", "hsdp", "fsdp_tp", "fsdp_ep")
MESH_LABELS = {
    "fsdp": "FSDP (shard 4)",
    "hsdp": "HSDP (replicate 2, shard 2)",
    "fsdp_tp": "FSDP x TP (dp 2, tp 2)",
    "fsdp_ep": "FSDP x EP (dp_mod_ep 2, ep 2)",
}
MESH_NAMES = {
    "hsdp": ("replicate", "shard"),
    "fsdp_tp": ("dp", "tp"),
    "fsdp_ep": ("dp_mod_ep", "ep"),
}


# ---- meshes and models --------------------------------------------------------------------------
def make_mesh(kind: str, world: int):
    """The device mesh of ``kind`` over ``world`` ranks (2-D ones are 2 x world/2)."""
    from torch.distributed.tensor import init_device_mesh

    if kind == "fsdp":
        return init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    return init_device_mesh("cpu", (2, world // 2), mesh_dim_names=MESH_NAMES[kind])


def runs_on(model_name: str, kind: str) -> bool:
    """Whether the mesh ``kind`` applies to the model: expert parallelism needs experts."""
    from raggedfsdp.models import get_config

    return kind != "fsdp_ep" or get_config(model_name).n_experts > 0


def tp_plan(model_name: str) -> dict:
    """The tensor-parallel plan of one block: attention always, the dense FFN if dense."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(),
    }
    if model_name.startswith("moe"):  # the experts (and the dense first block) stay data-parallel
        return plan
    return plan | {
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(),
    }


def build(system: str, model_name: str, kind: str, mesh, args) -> torch.nn.Module:
    """A model sharded by ``system`` on ``mesh`` as the mesh ``kind`` composes it."""
    from torch.distributed.tensor.parallel import parallelize_module

    from raggedfsdp.models import Transformer, get_config

    if system == "raggedfsdp":
        from raggedfsdp import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    from raggedfsdp.models.transformer import expert_parallel

    model = Transformer(get_config(model_name), max_seq_len=args.seq, seed=args.seed)
    if kind == "fsdp_ep":
        fsdp_mesh = mesh._flatten("dp")  # all data-parallel ranks (torchtitan's dp_shard)
    else:
        fsdp_mesh = mesh["dp"] if kind == "fsdp_tp" else mesh
    for block in model.transformer_blocks():
        if kind == "fsdp_tp":
            parallelize_module(block, mesh["tp"], tp_plan(model_name))
        if kind == "fsdp_ep" and block.is_moe:
            expert_parallel(block.moe, mesh["ep"])
            fully_shard(block.moe.experts, mesh=mesh["dp_mod_ep"])
            # the experts' gradients sum the tokens of every ep rank: divide by all of them
            # (a sum, then the division: FSDP2's pre-multiplied sum does not run on gloo)
            block.moe.experts.set_gradient_divide_factor(args.world)
            block.moe.experts.set_force_sum_reduction_for_comms(True)
        fully_shard(block, mesh=fsdp_mesh)
    fully_shard(model, mesh=fsdp_mesh)
    return model


def data_coordinate(kind: str, mesh, rank: int, world: int) -> tuple[int, int]:
    """``(index, count)`` of this rank's data-parallel coordinate: whose rows it takes."""
    if kind == "fsdp_tp":
        return mesh["dp"].get_local_rank(), mesh["dp"].size()
    return rank, world  # every rank is data-parallel on the 1-D, HSDP and EP meshes


# ---- collectives by mesh dimension ----------------------------------------------------------
class DimCommCounter(CommCounter):
    """``CommCounter`` that also records each collective's process group, by mesh dimension.

    Args:
        dims: ``{frozenset of global ranks: name}`` of the mesh's dimension groups
            that contain this rank; a group matching none is named ``"world"`` if it
            holds every rank, else by its ranks.
    """

    def __init__(self, dims: dict[frozenset[int], str]):
        super().__init__()
        self.dims = dims
        self.dim_of_event: list[str] = []  # parallel to self.events

    def _event(self, func, args, kwargs, out):
        event = super()._event(func, args, kwargs, out)
        self.dim_of_event.append(self._dim(func, args, kwargs))
        return event

    def _dim(self, func, args, kwargs) -> str:
        group = None
        for i, arg in enumerate(func._schema.arguments):
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            if isinstance(value, torch.ScriptObject) and "ProcessGroup" in str(arg.type):
                group = dist.ProcessGroup.unbox(value)  # c10d ops
            elif arg.name == "group_name" and isinstance(value, str):
                group = _resolve_process_group(value)  # functional collectives (DTensor's)
        if group is None:
            return "unknown"
        ranks = frozenset(dist.get_process_group_ranks(group))
        if ranks in self.dims:
            return self.dims[ranks]
        return "world" if len(ranks) == dist.get_world_size() else f"ranks {sorted(ranks)}"

    def by_dim(self) -> dict[str, dict[str, list[int]]]:
        """``{dim: {kind: [count, input bytes, output bytes]}}``."""
        out: dict[str, dict[str, list[int]]] = {}
        for e, dim in zip(self.events, self.dim_of_event):
            c, i, o = out.setdefault(dim, {}).get(e.kind, (0, 0, 0))
            out[dim][e.kind] = [c + 1, i + e.input_bytes, o + e.output_bytes]
        return out


def mesh_dims(mesh, kind: str) -> dict[frozenset[int], str]:
    """``{ranks of this rank's group along a dimension: the dimension's name}``.

    On ``fsdp_ep`` the flattened ``dp`` (all 4 ranks) is a dimension too. Dimensions whose
    groups hold the same ranks (none on the 2 x 2 meshes: ``dp_mod_ep`` is {0, 2} or
    {1, 3}, ``ep`` {0, 1} or {2, 3}) share one name, ``"a = b"``, rather than one hiding
    the other.
    """
    groups = {name: mesh.get_group(name) for name in mesh.mesh_dim_names}
    if kind == "fsdp_ep":
        groups["dp"] = mesh._flatten("dp").get_group()
    dims: dict[frozenset[int], str] = {}
    for name, group in groups.items():
        ranks = frozenset(dist.get_process_group_ranks(group))
        dims[ranks] = f"{dims[ranks]} = {name}" if ranks in dims else name
    return dims


# ---- one system on one mesh -----------------------------------------------------------------
class Run(StepRun):
    """One model sharded by one system on one mesh, with torch's AdamW."""

    def __init__(self, system: str, model_name: str, kind: str, mesh, args, rank, world, data):
        self.kind, self.mesh = kind, mesh
        model = build(system, model_name, kind, mesh, args)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
        coord = data_coordinate(kind, mesh, rank, world)
        super().__init__(system, model, opt, data, args, coord=coord, world=world)

    def count_step(self) -> dict:
        comms = DimCommCounter(mesh_dims(self.mesh, self.kind))
        self.step(around=lambda: comms)
        return comms.by_dim()


def _rank_main(rank: int, world: int, save, args) -> None:
    from raggedfsdp.train.data import DataConfig, load_corpus

    data = load_corpus(DataConfig(max_bytes=1 << 20)).train
    meshes = {kind: make_mesh(kind, world) for kind in args.meshes}
    results: dict = {}
    for model_name in args.models:
        for kind, mesh in meshes.items():
            if not runs_on(model_name, kind):
                continue  # the report names what was skipped
            if rank == 0:
                print(f"{model_name} on {kind}", flush=True)
            runs = {s: Run(s, model_name, kind, mesh, args, rank, world, data) for s in SYSTEMS}
            _ab.alternate(runs, warmup=args.warmup, steps=args.steps, block=args.block)
            comms = {s: runs[s].count_step() for s in SYSTEMS}
            memory = {s: runs[s].memory_step() for s in SYSTEMS}
            results.setdefault(model_name, {})[kind] = {
                "params": sum(p.numel() for p in runs["fsdp2"].model.parameters()),
                **_ab.timing_results(runs, memory),
                "comm": comms,
            }
            del runs
            save(results)  # what finished survives a later crash


# ---- report ----------------------------------------------------------------------------------
def _r(a: float, b: float, digits: int = 3) -> str:
    return ratio_cell(a, b, digits) if b else "-"  # "-": FSDP2 has none


def _size(nbytes: int) -> str:
    """MiB, or bytes when under a KiB (a few-byte flag all-reduce)."""
    return f"{nbytes} B" if 0 < nbytes < 1024 else mib(nbytes)


def _bytes(stats: list[int], kind: str) -> int:
    """The bytes that count for ``kind``: an all-gather's output, any other's input."""
    return stats[2] if kind == "all_gather" else stats[1]


def _dims(r: dict) -> list[str]:
    return sorted({d for s in SYSTEMS for d in r["comm"][s]})


def _summary_rows(r: dict, args) -> list[tuple[str, str, str, str]]:
    """(metric, raggedfsdp, FSDP2, ratio raggedfsdp / FSDP2), formatted."""
    rows = _ab.time_rows(r, args.block)
    for dim in _dims(r):
        kinds = sorted({k for s in SYSTEMS for k in r["comm"][s].get(dim, {})})
        for kind in kinds:
            (ca, a), (cb, b) = (
                (v[0], _bytes(v, kind))
                for v in (r["comm"][s].get(dim, {}).get(kind, [0, 0, 0]) for s in SYSTEMS)
            )
            rows.append(
                (f"`{dim}`: {kind}, count / MiB", f"{ca} / {_size(a)}", f"{cb} / {_size(b)}",
                 _r(a, b, 4))
            )  # fmt: skip
        a, b = (sum(_bytes(v, k) for k, v in r["comm"][s].get(dim, {}).items()) for s in SYSTEMS)
        rows.append((f"`{dim}`: all collectives (MiB)", mib(a), mib(b), _r(a, b, 4)))
    pa, pb = (max(r["peak_per_rank"][s]) for s in SYSTEMS)
    rows.append(("peak memory, max over ranks (MiB)", mib(pa), mib(pb), _r(pa, pb)))
    rows.append(loss_diff_row(r))
    return rows


def _raw_numbers(name: str, kind: str, r: dict) -> list[str]:
    lines = [f"### {name}, {MESH_LABELS[kind]} ({r['params']:,} parameters)", ""]
    lines += _ab.time_lines(r)
    lines += ["", "Collectives per step, rank 0 (count, input bytes, output bytes):", ""]
    lines += ["| mesh dim | kind | raggedfsdp | FSDP2 |", "|---|---|---|---|"]
    for dim in _dims(r):
        for k in sorted({k for s in SYSTEMS for k in r["comm"][s].get(dim, {})}):
            cells = [
                ", ".join(f"{v:,}" for v in r["comm"][s].get(dim, {}).get(k, [0, 0, 0]))
                for s in SYSTEMS
            ]
            lines.append(f"| {dim} | {k} | {cells[0]} | {cells[1]} |")
    return [*lines, *_ab.memory_lines(r), *_ab.loss_lines(r), ""]


def report(results: dict, args, command: str, seconds: float, load: list) -> str:
    """The page: configuration, the summary table, the analysis (kept), the raw numbers."""
    lines = header("Composed meshes: raggedfsdp vs FSDP2 on FSDP, HSDP, FSDP x TP and FSDP x EP",
                   command, seconds)  # fmt: skip
    skipped = (
        [m for m in args.models if not runs_on(m, "fsdp_ep")] if "fsdp_ep" in args.meshes else []
    )
    skip_note = f" ({', '.join(skipped)}: no experts, skipped on FSDP x EP)" if skipped else ""
    lines += [
        f"Configuration: {args.world} gloo ranks on {os.cpu_count()} CPU cores (1 thread each), "
        f"fp32, torch AdamW (lr {args.lr}, weight decay 0.1), no gradient clipping, global batch "
        f"{args.batch} x {args.seq} tokens (rows split over the data-parallel coordinates: 4 on "
        f"FSDP, HSDP and FSDP x EP, 2 on FSDP x TP, where both tp ranks of a dp coordinate take "
        f"the same rows), seed {args.seed}. Meshes: FSDP `(shard 4)`; HSDP "
        f"`(replicate 2, shard 2)`, `fully_shard(block, mesh=mesh)` per block then the root; "
        f"FSDP x TP `(dp 2, tp 2)`, per block `parallelize_module(block, mesh['tp'], plan)` "
        f"(ColwiseParallel on attention.wq/wk/wv and, llama only, feed_forward.w1/w3; "
        f"RowwiseParallel on attention.wo and, llama only, feed_forward.w2; the MoE model's FFNs "
        f"and experts stay data-parallel) then `fully_shard(block, mesh=mesh['dp'])`, then the "
        f"root on `mesh['dp']`; FSDP x EP `(dp_mod_ep 2, ep 2)`, MoE models only{skip_note}, "
        f"built as `tests/dist/test_ep.py` and torchtitan do: `dp = mesh._flatten('dp')` (all 4 "
        f"ranks); in each MoE block `expert_parallel(block.moe, mesh['ep'])` (the stacked "
        f"experts split over ep, tokens exchanged by all-to-alls), then "
        f"`fully_shard(block.moe.experts, mesh=mesh['dp_mod_ep'])` with "
        f"`set_gradient_divide_factor({args.world})` and "
        f"`set_force_sum_reduction_for_comms(True)`; then `fully_shard(block, mesh=dp)` for "
        f"every block and the root on `dp`. The catalogue configs' 6 query and 2 key/value "
        f"heads split over tp 2 as they are. Both systems use the same mesh object, defaults "
        f"otherwise. {args.warmup} warm-up steps each, then {args.steps} timed steps each in "
        f"blocks of {args.block}, alternating ABBA; then one step under the per-dimension "
        f"CommCounter and one under MemTracker for each. Bytes are rank 0's per step (an "
        f"all-gather's output, any other collective's input); `world` is a collective over all "
        f"4 ranks on the HSDP and TP meshes; on FSDP x EP the 4-rank group is `dp`. A step is "
        f"forward, backward, `opt.step()`, `opt.zero_grad()`, timed between two barriers. Load "
        f"average (1 min) before / after the run: {load[0]:.2f} / {load[1]:.2f}.",
        "",
        "## Summary",
        "",
        "| model | mesh | metric | raggedfsdp | FSDP2 | ratio |",
        "|---|---|---|---:|---:|---:|",
    ]
    for name, by_mesh in results.items():
        for kind, r in by_mesh.items():
            for label, a, b, rat in _summary_rows(r, args):
                lines.append(f"| {name} | {kind} | {label} | {a} | {b} | {rat} |")
    lines += ["", ANALYSIS, "", "## Raw numbers", ""]
    for name, by_mesh in results.items():
        for kind, r in by_mesh.items():
            lines += _raw_numbers(name, kind, r)
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _ab.add_arguments(parser, steps=10, block=2, per="mesh", page="composition.md")
    parser.add_argument("--meshes", nargs="+", choices=MESHES, default=list(MESHES))
    args = parser.parse_args(argv)
    if args.world % 2 or args.batch % args.world:
        parser.error(f"--world must be even and divide --batch, got {args.world}, {args.batch}")
    if "fsdp_tp" in args.meshes:
        from raggedfsdp.models import get_config

        tp = args.world // 2
        configs = [get_config(m) for m in args.models]
        if bad := [c.name for c in configs if c.n_heads % tp or c.n_kv_heads % tp]:
            parser.error(
                f"--meshes fsdp_tp splits the attention heads over tp {tp}, but {', '.join(bad)} "
                f"have query / key-value heads that tp {tp} does not divide; drop fsdp_tp from "
                "--meshes or choose other --models"
            )
    _ab.run_page("composition.py", _rank_main, args, report)


if __name__ == "__main__":
    main()
