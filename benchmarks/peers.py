"""Peers: raggedfsdp against FSDP2, FSDP1, DeepSpeed ZeRO-3 and Megatron-FSDP, in one run.

    make bench-peers                                   # builds .venv-peers, then runs this
    .venv-peers/bin/python benchmarks/peers.py         # every system installed there
    .venv/bin/python benchmarks/peers.py               # raggedfsdp, FSDP2, FSDP1 only
    .venv/bin/python benchmarks/peers.py --quick       # smoke run: one cell, few steps

Every system trains the same model (``Transformer(config, seed=0)``, built on CPU) on
the same global batches (``raggedfsdp.train.data.get_batch``) with the same optimizer
(``torch.optim.AdamW``, one group, constant learning rate, no clipping), sharded per
transformer block and then at the root:

- ``raggedfsdp``: ``raggedfsdp.fully_shard`` (blocks of 1 row, as ``train`` does);
- ``fsdp2``: ``torch.distributed.fsdp.fully_shard``;
- ``fsdp1``: ``FullyShardedDataParallel(use_orig_params=True)`` with a
  ``ModuleWrapPolicy`` on ``TransformerBlock`` (FULL_SHARD, defaults otherwise);
- ``deepspeed``: ``deepspeed.initialize`` with ZeRO stage 3, fp32, on the CPU
  accelerator (``DS_ACCELERATOR=cpu``) over the same gloo process group, configured
  as a per-block ZeRO-3 (see [Note: DeepSpeed as a per-block ZeRO-3]);
- ``megatron-fsdp``: ``megatron_fsdp.fully_shard`` (ZeRO-3 strategy).

A system that fails while it is being set up is not tried again; its error goes into
the report.

Each (model, world size) cell runs every system once per round, each run a fresh
``torchrun`` job, the order rotated from one round to the next, so that the load of the
machine falls on all systems alike. Measured per run (see ``measure``):

- tokens/s: global tokens per step / median step time (a step is forward, backward,
  optimizer step, zero_grad, between two barriers), pooled over the rounds;
- tokens per CPU-second: the same with the CPU time the ranks' processes spent in the
  step (all their threads, summed over the ranks): the work a step costs, which the
  load that other processes put on the machine changes far less than the wall time;
- communicated bytes per step per rank (``raggedfsdp.tools.profiling.CommCounter``, through
  ``raggedfsdp.tools.profiling.measure_step``, as ``train`` reports them): all-gather outputs
  plus reduce-scatter and all-reduce inputs;
- copied bytes per step (``CopyCounter``): every copy-like op of the step, and the
  part beyond the copies the unsharded model makes itself in the same step;
- peak memory: ``MemTracker`` over one step with the model, the optimizer and every
  storage the system keeps (its buffers, DeepSpeed's flat partitions) tracked from
  the start; the largest rank;
- the per-step losses (they must agree across systems: same init, same data).

[Note: DeepSpeed as a per-block ZeRO-3]
DeepSpeed's defaults do not shard these small models the way the FSDPs do, so four
settings make it comparable (the rest are its defaults):
- ``stage3_param_persistence_threshold=0``: by default parameters under 100k elements
  stay replicated, which is nearly every parameter of a small model;
- ``reduce_bucket_size`` and ``stage3_prefetch_bucket_size`` = the largest FSDP unit
  (a transformer block, or the root's own parameters): by default 5e8 and 5e7
  elements, one bucket for the whole model, which makes ZeRO-3 allocate a 2 GB
  gradient bucket (measured) and gather everything at once;
- ``stage3_max_reuse_distance=0`` and ``stage3_max_live_parameters`` = 2 units: by
  default (1e9) no parameter is ever released within a step;
- ``gradient_clipping=0``: DeepSpeed 0.19 clips at norm 1.0 unless told otherwise
  (``engine.gradient_clipping()`` reads 1.0); the other systems do not clip, and with
  the clip the losses part from step 2 on.
Its trace-based prefetcher still keeps some parameters gathered from forward into
backward; the report shows how many bytes it gathers per step.

Writes ``benchmarks/results/peers.md`` and ``benchmarks/results/peers.png`` (or under
``--out``); the runs' raw JSON goes to ``out/peers/``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

from _common import (  # beside this script, so on sys.path
    RESULTS,
    ROOT,
    fsdp2_padding,
    fsdp2_params,
    git_state,
    persistent_storages,
    ragged_padding,
    shard,
    write_results,
)
from _peers_report import plot, report

SYSTEMS = ("raggedfsdp", "fsdp2", "fsdp1", "deepspeed", "megatron-fsdp")
# The package each system needs beyond torch (absent: torch itself).
PACKAGES = {"deepspeed": "deepspeed", "megatron-fsdp": "megatron_fsdp"}


# ================================================================================================
# One run: a torchrun job that trains one model with one system (``--worker SPEC``)
# ================================================================================================
class Trainer:
    """One model sharded by one system, with its optimizer and its training step.

    Attributes:
        module: the model as the system wraps it (what ``measure`` looks at).
        opt: the ``torch.optim.Optimizer`` that updates the sharded parameters.
        keep: tensors the system keeps between steps that ``module`` and ``opt`` do not
            expose (buffers resized to 0 between uses, flat partitions): MemTracker
            tracks them from the start.
        padding: elements the system adds to shard the parameters (all ranks).
    """

    def __init__(self, system: str, model, mesh, spec: dict):
        import torch

        self.system = system
        self.world = mesh.size()
        self.keep: list = []
        self.padding_groups: dict[str, int] = {}  # group (module FQN) -> padding elements
        self.padding = 0
        build = getattr(self, "_" + system.replace("-", "_"))
        build(model, mesh, spec)
        self.padding = self.padding or sum(self.padding_groups.values())
        assert isinstance(self.opt, torch.optim.Optimizer)

    # ---- the systems --------------------------------------------------------------------
    def _raggedfsdp(self, model, mesh, spec) -> None:
        from raggedfsdp import BlockPolicy

        shard(model, mesh, "raggedfsdp", block_policy=BlockPolicy(rows=1))
        self.module, self.opt = model, _adamw(model.parameters(), spec)
        self.padding_groups = ragged_padding(model)
        self.keep = persistent_storages(model, "raggedfsdp")

    def _fsdp2(self, model, mesh, spec) -> None:
        shard(model, mesh, "fsdp2")
        self.module, self.opt = model, _adamw(model.parameters(), spec)
        groups = fsdp2_params(model)
        self.padding_groups = {name: fsdp2_padding(ps, self.world) for name, ps in groups.items()}
        self.keep = persistent_storages(model, "fsdp2")

    def _fsdp1(self, model, mesh, spec) -> None:
        import torch
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import ShardingStrategy
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        from raggedfsdp.models.transformer import TransformerBlock

        wrapped = FSDP(
            model,
            auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}),
            sharding_strategy=ShardingStrategy.FULL_SHARD,
            use_orig_params=True,
            device_id=torch.device("cpu"),
        )
        self.module, self.opt = wrapped, _adamw(wrapped.parameters(), spec)
        handles = [m._handle for m in FSDP.fsdp_modules(wrapped) if m._handle is not None]
        self.padding = sum(
            h.flat_param._sharded_size.numel() * self.world - sum(h.flat_param._numels)
            for h in handles
        )
        self.keep = [t for h in handles for t in (h.flat_param, *_tensors_held(h.flat_param, 1))]

    def _deepspeed(self, model, mesh, spec) -> None:
        import logging

        import deepspeed

        deepspeed.utils.logger.setLevel(logging.WARNING)
        # See [Note: DeepSpeed as a per-block ZeRO-3].
        blocks = [sum(p.numel() for p in b.parameters()) for b in model.transformer_blocks()]
        unit = max(*blocks, sum(p.numel() for p in model.parameters()) - sum(blocks))
        zero = {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "stage3_max_reuse_distance": 0,
            "stage3_max_live_parameters": 2 * unit,
            "stage3_prefetch_bucket_size": unit,
            "reduce_bucket_size": unit,
        }
        config = {
            "train_micro_batch_size_per_gpu": spec["batch_size"] // self.world,
            "gradient_accumulation_steps": 1,
            "zero_optimization": zero,
            "gradient_clipping": 0.0,  # DeepSpeed clips at 1.0 by default; the others do not
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 1 << 30,
        }
        deepspeed.init_distributed(dist_backend="gloo")
        engine, zero_opt, _, _ = deepspeed.initialize(
            model=model, optimizer=_adamw(model.parameters(), spec), config=config
        )
        self.module, self.engine, self.opt = engine, engine, zero_opt.optimizer
        params = list(engine.module.parameters())
        self.padding = sum(p.ds_tensor.numel() * self.world - p.ds_numel for p in params)
        self.keep = [p.ds_tensor for p in params] + _tensors_held(zero_opt, depth=2)

    def _megatron_fsdp(self, model, mesh, spec) -> None:
        import megatron_fsdp
        import torch
        from torch.distributed.device_mesh import init_device_mesh

        from raggedfsdp.models.transformer import TransformerBlock

        named = init_device_mesh("cpu", (self.world,), mesh_dim_names=("dp",))
        wrapped, opt = megatron_fsdp.fully_shard(
            model,
            _adamw(model.parameters(), spec),
            device_mesh=named,
            dp_shard_dim="dp",
            fsdp_unit_modules=[TransformerBlock],
            zero_dp_strategy=3,
            device=torch.device("cpu"),
        )
        self.module, self.opt = wrapped, opt

    # ---- a training step ----------------------------------------------------------------
    def step(self, x, y):
        """Forward, backward, optimizer step, zero_grad; returns the detached local loss."""
        from raggedfsdp.models.transformer import lm_loss

        if self.system == "deepspeed":
            loss = lm_loss(self.engine(x), y)
            self.engine.backward(loss)
            self.engine.step()  # the optimizer step and zero_grad
            return loss.detach()
        loss = lm_loss(self.module(x), y)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        return loss.detach()


def _adamw(params, spec: dict):
    import torch

    return torch.optim.AdamW(params, lr=spec["lr"], weight_decay=0.1, foreach=True)


def _tensors_held(obj, depth: int) -> list:
    """The tensors ``obj`` holds in its attributes, in lists, tuples and dicts ``depth`` deep."""
    import torch

    found, seen = [], set()

    def walk(value, level: int) -> None:
        if isinstance(value, torch.Tensor):
            if id(value) not in seen:
                seen.add(id(value))
                found.append(value)
        elif level > 0 and isinstance(value, (list, tuple)):
            for v in value:
                walk(v, level - 1)
        elif level > 0 and isinstance(value, dict):
            for v in value.values():
                walk(v, level - 1)

    for value in vars(obj).values():
        walk(value, depth)
    return found


def _leaf_safe_tracker():
    """``MemTracker`` that installs gradient hooks only on leaf parameters.

    FSDP1 with ``use_orig_params=True`` swaps a module's parameters for non-leaf views
    of its flat parameter during forward, where ``MemTracker`` would register a
    post-accumulate-grad hook and fail. Those views' gradients flow into the flat
    parameter, whose storages are tracked anyway (``Trainer.keep``).
    """
    from torch.distributed._tools.mem_tracker import MemTracker

    class LeafSafeMemTracker(MemTracker):
        def _track_module_params_and_buffers(self, module, install_grad_hooks=True):
            leaves = all(p.is_leaf for p in module.parameters())
            return super()._track_module_params_and_buffers(module, install_grad_hooks and leaves)

    return LeafSafeMemTracker()


def measure(trainer: Trainer, step_fn, own_copies: int) -> dict:
    """Communication, copies and peak memory of one step of ``trainer`` on this rank.

    Comms and copies come from ``raggedfsdp.tools.profiling.measure_step`` (as ``train``
    reports them), whose memory figure tracks the model only; the peak reported here
    tracks the optimizer and the system's own storages (``trainer.keep``) from the start
    too, which DeepSpeed needs (its parameters are empty placeholders between uses).

    Args:
        trainer: the system under test.
        step_fn: runs one training step (the same batch each call).
        own_copies: bytes the unsharded model copies itself in that step.
    """
    from raggedfsdp.tools.profiling import measure_step, peak_memory

    backend = trainer.system if trainer.system in ("raggedfsdp", "fsdp2") else None
    tracker = _leaf_safe_tracker if trainer.system == "fsdp1" else None
    out = measure_step(trainer.module, step_fn, backend, tracker=tracker)
    out["peak_memory_bytes_model_only"] = out.pop("peak_memory_bytes")
    out["copied_bytes_beyond_model"] = out["copied_bytes_total"] - own_copies
    if backend is None:  # measure_step attributes copies to raggedfsdp's and FSDP2's only
        out["copied_bytes_fsdp"] = out["copied_bytes_beyond_model"]
    tracked = (trainer.module, trainer.opt, *trainer.keep)
    out["peak_memory_bytes"] = peak_memory(step_fn, *tracked, tracker=_leaf_safe_tracker)["Total"]
    return out


def _model(spec: dict):
    """The run's model, unsharded (every system starts from the same one)."""
    from raggedfsdp.models import Transformer, get_config

    return Transformer(get_config(spec["model"]), max_seq_len=spec["seq_len"], seed=spec["seed"])


def _batch(spec: dict, data, step: int):
    """This rank's rows of the run's global batch of ``step``."""
    import torch.distributed as dist

    from raggedfsdp.train import get_batch

    rank, world = dist.get_rank(), dist.get_world_size()
    rows = dict(batch_size=spec["batch_size"], seq_len=spec["seq_len"], rank=rank, world_size=world)
    return get_batch(data, seed=spec["seed"], step=step, **rows)


def model_copies(spec: dict, data, step: int) -> int:
    """Bytes the unsharded model copies in one step of this rank's batch (no FSDP at all)."""
    from raggedfsdp.models import lm_loss
    from raggedfsdp.tools.profiling import CopyCounter

    model = _model(spec)
    opt = _adamw(model.parameters(), spec)

    def one_step() -> None:  # as the systems' steps do: the batch is made inside
        x, y = _batch(spec, data, step)
        lm_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    one_step()  # creates AdamW's state, as the systems' warm-up steps do
    with CopyCounter() as copies:
        one_step()
    return copies.total_bytes()


def worker(spec_path: str) -> int:
    """One rank of one run: train, measure, and (rank 0) write the result JSON."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import init_device_mesh

    from raggedfsdp.train.data import DataConfig, load_corpus

    spec = json.loads(Path(spec_path).read_text())
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    result: dict = {"system": spec["system"], "model": spec["model"], "world": world}
    stage = "setup"  # where an error arose: "setup" (sharding, wrapping) or "train"
    try:
        data = load_corpus(DataConfig(max_bytes=spec["max_bytes"])).train
        steps = spec["warmup"] + spec["steps"]
        own = model_copies(spec, data, steps)
        model = _model(spec)
        n_params = sum(p.numel() for p in model.parameters())
        trainer = Trainer(spec["system"], model, init_device_mesh("cpu", (world,)), spec)
        stage = "train"

        def one_step(step: int):
            return trainer.step(*_batch(spec, data, step))

        losses, times, cpu = [], [], []
        for step in range(steps):
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            losses.append(one_step(step))
            dist.barrier()
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)  # this process, all its threads
        mean_losses = torch.stack(losses)  # (steps,), this rank's
        dist.all_reduce(mean_losses)
        cpu_s = torch.tensor(cpu, dtype=torch.float64)  # (steps,), summed over ranks below
        dist.all_reduce(cpu_s)
        measured = measure(trainer, lambda: one_step(steps), own)
        everyone = [None] * world
        dist.all_gather_object(everyone, measured)
        result.update(
            ok=True,
            n_params=n_params,
            padding=trainer.padding,
            padding_groups=trainer.padding_groups,
            losses=(mean_losses / world).tolist(),
            step_s=times[spec["warmup"] :],
            cpu_s=cpu_s.tolist()[spec["warmup"] :],
            **measured,
            peak_memory_bytes_max_rank=max(m["peak_memory_bytes"] for m in everyone),
            peak_memory_bytes_model_only_max_rank=max(
                m["peak_memory_bytes_model_only"] for m in everyone
            ),
        )
    except Exception as e:  # a peer that cannot run here: its error is the result
        result.update(ok=False, stage=stage, error=f"{type(e).__name__}: {e}".strip())
        result["traceback"] = traceback.format_exc(limit=-6)
        if rank == 0:
            print(result["traceback"], file=sys.stderr)
    if rank == 0:
        Path(spec["result"]).write_text(json.dumps(result, indent=1))
    if result.get("ok"):
        dist.destroy_process_group()
    return 0


# ================================================================================================
# The comparison: runs interleaved over the systems, then the report
# ================================================================================================


def unavailable(system: str) -> str | None:
    """Why ``system`` cannot be tried with this interpreter; None when it can."""
    package = PACKAGES.get(system)
    if package is None or importlib.util.find_spec(package) is not None:
        return None
    why = f"not installed in {sys.prefix} (`make bench-peers` installs it into .venv-peers)"
    log = Path(sys.prefix) / f"install-{system}.log"  # written by `make bench-peers`
    if log.exists():
        errors = [line for line in log.read_text().splitlines() if "ERROR" in line]
        why += f"; its install failed: {(errors or ['see ' + str(log)])[-1].strip()}"
    return why


def launch(spec: dict, runs: Path, name: str, timeout: float) -> dict:
    """Run one ``torchrun`` job of ``worker`` and return its result (or why there is none)."""
    paths = {kind: runs / f"{name}{kind}" for kind in (".spec.json", ".json", ".log")}
    paths[".json"].unlink(missing_ok=True)
    paths[".spec.json"].write_text(json.dumps({**spec, "result": str(paths[".json"])}, indent=1))
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    env["PYTHONWARNINGS"] = "ignore::FutureWarning"  # torch's deprecation notes, once per call
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc-per-node={spec['world']}", __file__, "--worker", str(paths[".spec.json"])]
    t0 = time.perf_counter()
    with open(paths[".log"], "w") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True
        )
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)  # the job's own process group: torchrun and its ranks
            proc.wait()
            code = f"killed after {timeout:.0f} s"
    if paths[".json"].exists():
        result = json.loads(paths[".json"].read_text())
    else:
        lines = paths[".log"].read_text().strip().splitlines() or [""]
        result = {"ok": False, "stage": "launch", "error": f"no result ({code}): {lines[-1]}"}
    result["wall_s"] = time.perf_counter() - t0
    return result


def run_cells(args, systems: list[str]) -> tuple[dict, dict]:
    """Every (model, world size) cell, ``args.rounds`` rounds of every system each.

    Returns ``(results, skipped)``: ``results[model][world][system]`` is the list of the
    runs' results; ``skipped[system]`` says why a system was not run (not installed, or
    failed while being set up: it is not tried again).
    """
    runs = Path(args.runs)
    runs.mkdir(parents=True, exist_ok=True)
    skipped = {s: why for s in systems if (why := unavailable(s))}
    base = {
        k: getattr(args, k)
        for k in ("batch_size", "seq_len", "lr", "seed", "max_bytes", "warmup", "steps")
    }
    if "deepspeed" in systems and "deepspeed" not in skipped:
        # DeepSpeed builds its C++ add-ons on its first run (minutes, then cached): not timed.
        print("DeepSpeed warm-up run (builds its add-ons the first time) ...", flush=True)
        spec = {**base, "system": "deepspeed", "model": args.models[0], "world": 2}
        warm = launch({**spec, "warmup": 0, "steps": 1}, runs, "deepspeed-warmup", args.timeout)
        args.deepspeed_warmup_s = warm["wall_s"]
    results: dict = {}
    total = len(args.models) * len(args.worlds) * args.rounds * len(systems)
    done = 0
    for model in args.models:
        for world in args.worlds:
            cell = results.setdefault(model, {}).setdefault(world, {s: [] for s in systems})
            for r in range(args.rounds):
                k = r % len(systems)  # rotate the order from round to round
                for system in systems[k:] + systems[:k]:
                    done += 1
                    if system in skipped or any(not x["ok"] for x in cell[system]):
                        continue
                    name = f"{model}-w{world}-{system}-r{r}"
                    spec = {**base, "system": system, "model": model, "world": world}
                    res = launch(spec, runs, name, args.timeout)
                    cell[system].append(res)
                    if res["ok"]:
                        tok = args.batch_size * args.seq_len / statistics.median(res["step_s"])
                        what = f"{tok:,.0f} tokens/s, step-1 loss {res['losses'][0]:.6f}"
                    else:
                        what = f"FAILED ({res.get('stage')}): {res['error'][:160]}"
                        if res.get("stage") == "setup":
                            skipped[system] = f"failed while being set up ({name}): {res['error']}"
                    print(f"[{done}/{total}] {name}: {what} ({res['wall_s']:.0f} s)", flush=True)
    return results, skipped


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(
        prog="benchmarks/peers.py",
        description="Train the same models with raggedfsdp and its peers, interleaved, and "
        "report each peer's throughput, memory, communication and copies as ratios to "
        "raggedfsdp's.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--models", default="llama-tiny,moe-tiny", help="comma-separated")
    p.add_argument("--worlds", default="2,3,4", help="comma-separated world sizes")
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated")
    p.add_argument("--rounds", type=int, default=2, help="runs of each system per cell")
    p.add_argument("--steps", type=int, default=30, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--batch-size", type=int, default=12, help="global batch (rows)")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per row")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    p.add_argument("--seed", type=int, default=0, help="init and data seed")
    p.add_argument("--max-bytes", type=int, default=1 << 20, help="bytes of text to load")
    p.add_argument("--timeout", type=float, default=600, help="seconds per run before killing")
    p.add_argument("--runs", default="out/peers", help="folder for each run's JSON and log")
    p.add_argument("--out", default=str(RESULTS / "peers.md"), help="report (a .png beside it)")
    p.add_argument("--quick", action="store_true", help="smoke run: one cell, few steps")
    p.add_argument("--report-from", help="write the report from a run's record.json, not run")
    args = p.parse_args(argv)
    if args.worker:
        return worker(args.worker)
    if args.quick:
        args.models, args.worlds, args.rounds, args.steps, args.warmup = "llama-tiny", "2", 1, 3, 1
        if args.out == str(RESULTS / "peers.md"):
            args.out = "out/peers-quick/peers.md"
        if args.runs == "out/peers":
            args.runs = "out/peers-quick"
    args.models = args.models.split(",")
    args.worlds = [int(w) for w in args.worlds.split(",")]
    systems = args.systems.split(",")
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown:
        p.error(f"--systems: unknown {', '.join(unknown)}; choose from {', '.join(SYSTEMS)}")
    if "raggedfsdp" not in systems:
        p.error(f"--systems must include raggedfsdp (every ratio is to it); got {args.systems}")
    for w in args.worlds:
        if args.batch_size % w:
            p.error(f"--batch-size {args.batch_size} is not divisible by world size {w}")
    exe = os.path.relpath(sys.executable, ROOT) if sys.prefix.startswith(str(ROOT)) else "python"
    if args.report_from:  # rebuild the report from a finished run's record
        record = json.loads(Path(args.report_from).read_text())
        for key in ("models", "worlds", "rounds", "steps", "warmup", "batch_size", "seq_len"):
            setattr(args, key, record["args"][key])
        for key in ("lr", "seed", "deepspeed_warmup_s"):
            setattr(args, key, record["args"].get(key))
        results = {
            m: {int(w): row for w, row in cells.items()} for m, cells in record["results"].items()
        }
        skipped, systems = record["skipped"], record["systems"]
        run = {k: record[k] for k in ("command", "seconds", "load", "git")}
        run["report_from"] = args.report_from
    else:
        run = {"command": " ".join([exe, "benchmarks/peers.py", *argv]), "git": git_state()}
        t0, load = time.perf_counter(), [os.getloadavg()[0]]
        results, skipped = run_cells(args, systems)
        run.update(seconds=time.perf_counter() - t0, load=[*load, os.getloadavg()[0]])
        record = {**run, "systems": systems, "skipped": skipped, "args": vars(args)}
        record["results"] = results
        (Path(args.runs) / "record.json").write_text(json.dumps(record, indent=1))
    text, table = report(results, skipped, systems, args, run)
    out = Path(args.out)
    write_results(out, text)
    Path(args.runs).mkdir(parents=True, exist_ok=True)
    (Path(args.runs) / "summary.json").write_text(json.dumps(table, indent=1))
    cells = f"{', '.join(args.models)} at {', '.join(map(str, args.worlds))} gloo ranks"
    plot(table, systems, skipped, out.with_suffix(".png"), f"Peers against raggedfsdp: {cells}")
    print(out.read_text())
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
