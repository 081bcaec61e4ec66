"""One rank of ``python -m raggedfsdp train`` (started by torchrun; see ``cli.train``).

Writes, on rank 0, ``metrics.jsonl`` (one line per step, plus validation lines),
``summary.json`` (throughput, memory, communication, copies, padding of the run)
and ``loss.png``, each whole or not at all ([Note: run files are whole] in ``rundir``);
every rank writes its shards of the checkpoints under ``ckpt/``.
The arguments come from the launcher, already checked, in ``RAGGEDFSDP_TRAIN_ARGS``.

[Note: non-finite steps]
A diverged run must neither train on nor overwrite its good checkpoints. Each step
already all-reduces its loss for the log and reads it on the host; one more element
rides along, this rank's "some gradient is nan or inf" flag (computed on the device,
no sync), so every rank learns in the same collective and the same host read whether
any rank saw a non-finite loss or gradient, and all stop together with one message
naming the step, before that step's state is saved. ``checkpoint.save`` itself
refuses a non-finite state (the parameters after the update may overflow although
the loss and gradients were finite), so no path writes one.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import distributed_c10d
from torch.distributed.tensor import DTensor

from raggedfsdp.models import get_config
from raggedfsdp.models.hf import build_hf_model, hf_blocks, is_hf_model, logits_of, materialize_hf
from raggedfsdp.models.parallelize import build_mesh, parallelize
from raggedfsdp.models.transformer import Transformer, lm_loss
from raggedfsdp.tools.profiling import measure_step
from raggedfsdp.train.checks import MeshSpec, parse_train_mesh
from raggedfsdp.train.data import DataConfig, TextCorpus, get_batch, load_corpus
from raggedfsdp.train.devices import backend_for, rank_device
from raggedfsdp.train.guard import (
    ARGS_ENV,
    TrainError,
    Where,
    collective_failure,
    die_with_launcher,
    exit_code,
)
from raggedfsdp.train.guard import report as report_error
from raggedfsdp.train.policy import block_policy
from raggedfsdp.train.report import plot_losses
from raggedfsdp.train.rundir import CKPT, METRICS, MetricsLog, trim_metrics, write_atomic


def _shard(model: nn.Module, args, spec: MeshSpec, mesh) -> dict[str, tuple]:
    """``parallelize`` the model by ``--backend`` with the train flags' ``fully_shard``
    arguments, in place; returns ``parallelize``'s ``{fqn: (shape, ranks)}``."""
    raf = args.reshard_after_forward.lower()
    raf = {"auto": None, "true": True, "false": False}[raf] if not raf.isdigit() else int(raf)
    if args.backend == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        kw = dict(reshard_after_forward=raf)
    else:
        from raggedfsdp import MixedPrecisionPolicy, fully_shard

        policy = block_policy(args, model, spec.shard)  # the shard group's ranks
        gaps = {"off": False, "on": True, "always": "always"}[args.member_gaps]
        kw = dict(
            reshard_after_forward=raf,
            block_policy=policy,
            max_buffers=args.max_buffers,
            member_gaps=gaps,
        )
    if args.bf16:
        kw["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    blocks = hf_blocks(model) if is_hf_model(args.model) else None  # None: the Transformer's
    return parallelize(model, mesh, spec, fully_shard=fully_shard, blocks=blocks, **kw)


def _decay_groups(params, weight_decay: float, **hyper) -> list[dict]:
    """Matrices with weight decay, vectors (norms, biases) without; empty groups left out."""
    decay = [p for p in params if p.dim() >= 2]
    rest = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay, **hyper}]
    groups.append({"params": rest, "weight_decay": 0.0, **hyper})
    return [g for g in groups if g["params"]]


def _optimizer(model: nn.Module, args) -> torch.optim.Optimizer:
    """The optimizer of ``--optim``; its block policy is ``_policy.block_policy``."""
    groups = _decay_groups(list(model.parameters()), args.weight_decay)
    if args.optim == "adamw":
        return torch.optim.AdamW(groups, lr=args.lr, weight_decay=args.weight_decay, foreach=True)
    if args.optim == "sgd":
        return torch.optim.SGD(model.parameters(), lr=args.lr)
    from raggedfsdp.optim import AdamW, AdamW8bit, Muon, Shampoo, muon_param_groups

    if args.optim in ("muon", "shampoo"):  # matrices to it; embeddings, head, vectors to AdamW
        flag, split = f"use_{args.optim}", []
        for g in muon_param_groups(model, lr=args.lr):
            if g.pop("use_muon"):
                split.append({**g, flag: True, "weight_decay": args.weight_decay})
            else:
                hyper = {k: v for k, v in g.items() if k not in ("params", "weight_decay")}
                split += [
                    {**d, flag: False}
                    for d in _decay_groups(g["params"], args.weight_decay, **hyper)
                ]
        if args.optim == "muon":
            return Muon(split, lr=args.lr, weight_decay=args.weight_decay)
        return Shampoo(
            split,
            lr=args.lr,
            weight_decay=args.weight_decay,
            block_size=args.shampoo_block_size,
            row_block=args.shampoo_row_block,
            precondition_frequency=args.precondition_frequency,
            start_preconditioning_step=args.start_preconditioning_step,
            grafting=None if args.shampoo_grafting == "none" else args.shampoo_grafting,
            root_dtype=getattr(torch, args.shampoo_root_dtype),
        )
    flat = {"flat-adamw": AdamW, "adamw8bit": AdamW8bit}[args.optim]
    return flat(groups, lr=args.lr, weight_decay=args.weight_decay)


SHAMPOO_MODES = {
    "communication-free": "every Shampoo block whole on one rank: the step sends nothing",
    "owner": "blocks cut across ranks are preconditioned on owner ranks: two all-to-alls a step",
    "mixed": "some shard groups communication-free, others with owner ranks",
}


def _shampoo_mode(opt) -> str | None:
    """The mode Shampoo picked from the layout (None for another optimizer)."""
    from raggedfsdp.optim import Shampoo

    if not isinstance(opt, Shampoo):
        return None
    modes = set(opt.modes().values())
    return modes.pop() if len(modes) == 1 else "mixed"


def _lr_lambda(args):
    def f(step: int) -> float:
        if step < args.warmup:
            return (step + 1) / args.warmup
        t = (step - args.warmup) / max(1, args.steps - args.warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))

    return f


def layout_figures(model: nn.Module, backend: str, split: dict[str, tuple]) -> dict:
    """``padding_ratio``: padded elements / parameter elements of the communication
    buffers (this rank's TP / EP coordinate: the tensors ``fully_shard`` laid out);
    ``buffers`` and ``gapped_stacks``: this rank's buffers and the stacks laid out with
    member gaps in them; ``grads_in_params_buffers``: the buffers whose last backward
    wrote the gradients over the parameters, and ``grad_storage_reasons`` why the others
    did not (``None`` for FSDP2, which has no buffers).

    Args:
        model: the sharded model.
        backend: ``"raggedfsdp"`` or ``"fsdp2"``.
        split: ``_shard``'s ``{fqn: (shape, ranks)}``.
    """
    if backend == "fsdp2":  # per-parameter dim-0 chunks, each padded to ceil(rows / m)
        pad = total = 0
        for shape, m in split.values():
            numel, rows = math.prod(shape), shape[0] if shape else 1
            pad += (math.ceil(rows / m) * m - rows) * (numel // rows)
            total += numel
        return {
            "padding_ratio": pad / total,
            "buffers": None,
            "gapped_stacks": None,
            "grads_in_params_buffers": None,
            "grad_storage_reasons": None,
        }
    from raggedfsdp.fsdp import buffers_of

    bufs = buffers_of(model)
    layouts = [buf.layout for buf in bufs]
    reasons: dict[str, int] = {}
    for buf in bufs:
        if buf.grad_storage_reason is not None:
            reasons[buf.grad_storage_reason] = reasons.get(buf.grad_storage_reason, 0) + 1
    return {
        "padding_ratio": sum(lay.padding for lay in layouts)
        / sum(lay.total_numel for lay in layouts),
        "buffers": len(layouts),
        "gapped_stacks": sum(t.members > 1 for lay in layouts for t in lay.tensors),
        "grads_in_params_buffers": sum(bool(buf.grads_in_params_ran) for buf in bufs),
        "grad_storage_reasons": reasons,
    }


def _clip(model, args, spec: MeshSpec) -> None:
    if not args.clip:
        return
    if args.backend == "raggedfsdp":
        from raggedfsdp import clip_grad_norm_

        clip_grad_norm_(model.parameters(), args.clip)
    elif spec.tp > 1 or spec.ep > 1:
        _clip_through_full_tensors(model.parameters(), args.clip)
    else:
        nn.utils.clip_grad_norm_(model.parameters(), args.clip)


@torch.no_grad()
def _clip_through_full_tensors(params, max_norm: float) -> torch.Tensor:
    """FSDP2 under TP / EP: torch's ``clip_grad_norm_`` refuses gradients on different
    meshes (a block's (dp, tp) against the root's dp), so the norm goes through full
    tensors (an all-gather of every gradient: a demo's cost, not a large run's)."""
    grads = [p.grad for p in params if p.grad is not None]
    # torch warns at every (_StridedShard, Shard) gather that it takes two all-gathers
    log = logging.getLogger("torch.distributed.tensor._redistribute")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        full = [g.full_tensor() if isinstance(g, DTensor) else g for g in grads]
    finally:
        log.setLevel(level)
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in full]))
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:  # one mesh per foreach call: a loop
        g.mul_(coef)
    return total


def _grads_finite(model: nn.Module, device) -> torch.Tensor:
    """0-d bool: every gradient this rank holds is finite (no host sync)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flags = [torch.isfinite(g.to_local() if isinstance(g, DTensor) else g).all() for g in grads]
    return torch.stack(flags).all() if flags else torch.ones((), dtype=torch.bool, device=device)


def _on(device: torch.device, batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """The batch (made on the CPU) on the rank's device."""
    return tuple(t.to(device) for t in batch)


def _finite_or_none(value):
    """JSON has no nan / inf: a non-finite number is written as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite_or_none(v) for k, v in value.items()}
    return value


def _dumps(record: dict, **kw) -> str:
    return json.dumps(_finite_or_none(record), allow_nan=False, **kw)


def _checkpoint_error(err: Exception, what: str) -> Exception:
    """An error of ``checkpoint.save`` / ``load``, raised alike on every rank: printed once.

    A collective that timed out is this rank's own failure and keeps its own report.
    """
    if collective_failure(err):
        return err
    return TrainError(f"{what}: {err}")


def _diverged(step: int, loss: float, grads_bad: bool, ckpt_root: Path) -> TrainError:
    from raggedfsdp.checkpoint import latest_checkpoint

    what = f"the loss is {loss}" if not math.isfinite(loss) else "a gradient holds nan or inf"
    latest = latest_checkpoint(ckpt_root)
    kept = (
        f"the last checkpoint, '{latest}', holds finite values"
        if latest is not None
        else "no checkpoint was saved (--ckpt-every)"
    )
    return TrainError(
        f"step {step}: {what}: the run diverged and stopped; the state of this step was not "
        f"saved, {kept}. Start again with a lower --lr or a --clip (--overwrite, or another --out)"
    )


@dataclass
class _Rank:
    """What every phase of this rank's training reads: the arguments, its place, its model."""

    args: argparse.Namespace
    where: Where
    device: torch.device
    rank: int
    world: int
    spec: MeshSpec
    corpus: TextCorpus
    model: nn.Module
    split: dict[str, tuple]  # _shard's {fqn: (shape, ranks)}
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LambdaLR
    shampoo_mode: str | None
    out: Path
    ckpt_root: Path


def _train(args, where: Where, device: torch.device) -> int:
    """This rank's job: set up, resume, train, measure a step and summarise; 0 when done."""
    run = _set_up(args, where, device)
    start = _resume(run) if args.resume else 0
    log = MetricsLog(run.out / METRICS, append=args.resume) if run.rank == 0 else None
    end = min(args.steps, start + args.stop_after) if args.stop_after else args.steps
    times, loss = _train_steps(run, start, end, log)
    _finish(run, end, times, loss, log)
    dist.destroy_process_group()
    return 0


def _set_up(args, where: Where, device: torch.device) -> _Rank:
    """This rank's mesh, data, sharded model, optimizer and learning-rate schedule."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    out = Path(args.out)
    spec = parse_train_mesh(args.mesh, world)  # checked by the launcher
    mesh = build_mesh(spec, device.type)
    # HSDP's collectives cross both mesh dims: name every rank's group on a timeout
    where.mesh_group = where.group = mesh.get_group(0) if mesh.ndim == 1 else dist.group.WORLD
    corpus = load_corpus(
        DataConfig(path=args.data, max_bytes=args.max_bytes, tokenizer=args.tokenizer)
    )
    model, split = _build_model(args, spec, mesh, device)
    where.watch(model)
    opt = _optimizer(model, args)
    shampoo_mode = _shampoo_mode(opt)
    if rank == 0 and shampoo_mode is not None:
        print(f"train: --optim shampoo in the {shampoo_mode} mode ({SHAMPOO_MODES[shampoo_mode]})")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(args))
    return _Rank(
        args=args,
        where=where,
        device=device,
        rank=rank,
        world=world,
        spec=spec,
        corpus=corpus,
        model=model,
        split=split,
        opt=opt,
        sched=sched,
        shampoo_mode=shampoo_mode,
        out=out,
        ckpt_root=out / CKPT,
    )


def _build_model(args, spec: MeshSpec, mesh, device: torch.device) -> tuple[nn.Module, dict]:
    """The model of ``--model`` on ``device``, sharded; with ``_shard``'s split."""
    if is_hf_model(args.model):
        # Built on meta and sharded, then each rank reads its own rows of the weights (or
        # draws a seeded init; on --resume the checkpoint fills it): raggedfsdp.models.hf
        model = build_hf_model(args.model)
        split = _shard(model, args, spec, mesh)
        weights = "none" if args.resume else "auto"
        materialize_hf(model, args.model, device=device, seed=args.seed, weights=weights)
    else:
        model = Transformer(get_config(args.model), max_seq_len=args.seq_len, seed=args.seed)
        model.to(device)  # built on the CPU (the seed's values on any device), trained here
        split = _shard(model, args, spec, mesh)
    return model, split


def _resume(run: _Rank) -> int:
    """Load the checkpoint to resume, catch the schedule up, trim the metrics; the next step."""
    from raggedfsdp import checkpoint as ckpt

    run.where.at("loading the checkpoint")
    # --resume-from names its checkpoint; --resume loads the newest (both checked
    # complete and intact by the launcher)
    source = run.args.resume_from or run.ckpt_root
    try:
        start, _ = ckpt.load(source, run.model, run.opt)
    except Exception as err:
        raise _checkpoint_error(err, f"--resume: the checkpoint in '{source}'") from err
    with warnings.catch_warnings():  # the schedule catches up: no optimizer step is due
        warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step", UserWarning)
        for _ in range(start):
            run.sched.step()
    if run.rank == 0:
        trim_metrics(run.out / METRICS, start)
    return start


def _batch(run: _Rank, step: int, split: str = "train") -> tuple[torch.Tensor, ...]:
    """This rank's rows of ``step``'s batch of the ``split`` data, on its device."""
    args = run.args
    data = run.corpus.train if split == "train" else run.corpus.val
    return _on(
        run.device,
        get_batch(
            data,
            seed=args.seed if split == "train" else args.seed + 1,
            step=step,
            batch_size=args.batch_size,
            seq_len=args.seq_len,
            rank=run.spec.data_rank(run.rank),  # tp ranks share their data rank's rows
            world_size=run.spec.data_ranks,
        ),
    )


def _one_step(run: _Rank, step: int, after: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Train on ``step``'s batch; its loss (detached) and whether this rank's grads were finite."""

    # after: a step measured after training (its batch is step's), named by it
    def at(phase):
        if after is None:
            run.where.at(phase, step)
        else:
            run.where.at(f"{after}, a measured step's {phase}")

    at("forward")
    x, y = _batch(run, step)
    loss = lm_loss(logits_of(run.model(x)), y)
    at("backward (gradient reduce-scatter)")
    loss.backward()
    finite = _grads_finite(run.model, loss.device)
    at("gradient clipping (norm all-reduce)")
    _clip(run.model, run.args, run.spec)
    at("optimizer step")
    run.opt.step()
    run.opt.zero_grad()
    run.sched.step()
    return loss.detach(), finite


def _mean(value: torch.Tensor, world: int) -> float:
    """The mean of ``value`` over all ranks (the same over the data ranks; see below)."""
    # A mean over all ranks is the mean over the data ranks: the tp ranks of one data
    # rank hold the same loss, as many times each.
    value = value.clone()
    dist.all_reduce(value)
    return value.item() / world


def _train_steps(
    run: _Rank, start: int, end: int, log: MetricsLog | None
) -> tuple[list[float], float]:
    """Train steps ``start`` to ``end - 1``, logged and checkpointed; their times, the last loss."""
    args, rank = run.args, run.rank
    bar = None
    if rank == 0 and not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=args.steps, initial=start, desc=f"{args.backend} {args.model}")
    tokens = args.batch_size * args.seq_len
    times = []
    loss = math.nan
    for step in range(start, end):
        t0 = time.perf_counter()
        local_loss, finite = _one_step(run, step)
        loss, bad = _step_loss(run, step, local_loss, finite)
        dt = time.perf_counter() - t0
        times.append(dt)
        record = {"step": step, "loss": loss, "lr": run.sched.get_last_lr()[0], "step_time": dt}
        record["tokens_per_s"] = tokens / dt
        if bad or not math.isfinite(loss):
            if rank == 0:
                log.append(_finite_or_none({**record, "non_finite": True}))
                log.close()
            raise _diverged(step, loss, bad, run.ckpt_root)
        if args.val_every and ((step + 1) % args.val_every == 0 or step + 1 == args.steps):
            record["val_loss"] = _validation_loss(run, step)
        # The step's record is on disk before its checkpoint: a job killed right after the
        # save must not resume past a step it never logged.
        if rank == 0:
            run.where.at(f"writing its record to {METRICS}", step)
            log.append(_finite_or_none(record))
            if bar is not None:
                bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens / dt:,.0f}")
                bar.update(1)
        if args.ckpt_every and ((step + 1) % args.ckpt_every == 0 or step + 1 == end):
            _save_checkpoint(run, step, log)
    if bar is not None:
        bar.close()
    return times, loss


def _step_loss(
    run: _Rank, step: int, local_loss: torch.Tensor, finite: torch.Tensor
) -> tuple[float, bool]:
    """The step's loss, averaged over the ranks, and whether any rank's was not finite."""
    # See [Note: non-finite steps]: the flag rides in the loss all-reduce.
    run.where.at("the loss all-reduce", step, group=dist.group.WORLD)
    stats = torch.stack([local_loss.float(), (~finite).float()])
    dist.all_reduce(stats)
    loss_sum, bad = stats.tolist()
    return loss_sum / run.world, bool(bad)


def _validation_loss(run: _Rank, step: int) -> float:
    """The loss on ``--val-batches`` validation batches after ``step``, over all ranks."""
    run.where.at("validation forward", step)
    with torch.no_grad():
        vals = [
            lm_loss(logits_of(run.model(x)), y)
            for x, y in (_batch(run, i, "val") for i in range(run.args.val_batches))
        ]
    run.where.at("the validation loss all-reduce", step, group=dist.group.WORLD)
    return _mean(torch.stack(vals).mean(), run.world)


def _save_checkpoint(run: _Rank, step: int, log: MetricsLog | None) -> None:
    """Save the state after ``step`` (its records durable first), keeping ``--keep-last``."""
    from raggedfsdp import checkpoint as ckpt

    run.where.at("checkpoint save", step)
    if run.rank == 0:
        log.sync()  # the records of its steps are durable before the checkpoint
    try:
        ckpt.save(run.ckpt_root, run.model, run.opt, step=step + 1, keep_last=run.args.keep_last)
    except Exception as err:
        raise _checkpoint_error(err, f"step {step}: the checkpoint was not saved") from err


def _finish(run: _Rank, end: int, times: list[float], loss: float, log: MetricsLog | None) -> None:
    """Measure a step after training; rank 0 writes summary.json and loss.png."""
    args, device = run.args, run.device
    # The training steps' peak (the extra measured steps below track memory themselves).
    reserved = torch.accelerator.max_memory_reserved(device) if device.type != "cpu" else None
    # Extra steps after training, counted (comms, copies) and tracked (memory): the
    # counters slow a step down, so none of the timed steps is measured. One plain step
    # first, so the measured one starts where a training step does (after a backward,
    # not after the no-grad validation forward, which leaves FSDP2's root unsharded).
    after = f"after step {end - 1} (the job's last)"
    _one_step(run, args.steps, after)
    run.where.at(f"{after}, measuring a step")
    measured = measure_step(run.model, lambda: _one_step(run, args.steps + 1, after), args.backend)
    measured["max_memory_reserved_bytes"] = reserved  # None on the CPU
    summary = _summary(run, times, loss, measured)
    run.where.at(f"{after}, gathering the summary", group=dist.group.WORLD)
    gathered = [None] * run.world
    dist.all_gather_object(gathered, measured)
    if run.rank == 0:
        summary["peak_memory_bytes_max_rank"] = max(g.get("peak_memory_bytes", 0) for g in gathered)
        if reserved is not None:
            summary["max_memory_reserved_bytes_max_rank"] = max(
                g["max_memory_reserved_bytes"] for g in gathered
            )
        run.where.at(f"{after}, writing summary.json")
        write_atomic(run.out / "summary.json", _dumps(summary, indent=1))
        log.close()
        if not args.no_plot:
            run.where.at(f"{after}, plotting loss.png")
            plot_losses({args.backend: run.out / METRICS}, run.out / "loss.png", args.model)


def _summary(run: _Rank, times: list[float], loss: float, measured: dict) -> dict:
    """This rank's summary.json: the run, its steady step time, its layout, the measured step."""
    args = run.args
    tokens = args.batch_size * args.seq_len
    steady = times[min(5, len(times) - 1) :] or times
    return {
        "backend": args.backend,
        "model": args.model,
        "world": run.world,
        "device": run.device.type,
        "process_group_backend": dist.get_backend(),
        "mesh": run.spec.text,
        "mesh_dims": run.spec.dims,
        "optim": args.optim,
        **({"shampoo_mode": run.shampoo_mode} if run.shampoo_mode is not None else {}),
        "steps": args.steps,
        "median_step_s": statistics.median(steady),
        "tokens_per_s": tokens / statistics.median(steady),
        **layout_figures(run.model, args.backend, run.split),
        "final_loss": loss,
        **measured,
    }


def main() -> int:
    """Run this rank; return its exit code (see [Note: how a rank fails] in ``guard``)."""
    die_with_launcher()
    args = argparse.Namespace(**json.loads(os.environ[ARGS_ENV]))
    where = Where()
    timeout = timedelta(seconds=args.timeout)
    # Groups made later without a timeout (fully_shard's post-forward groups, a separate
    # reduce-scatter group) take torch's default (30 min for gloo), not the one given
    # here: make --timeout that default too.
    distributed_c10d.default_pg_timeout = distributed_c10d.default_pg_nccl_timeout = timeout
    # One rank per device, with torch's backend for it: [Note: train devices] in devices.py
    device = rank_device(getattr(args, "device", "cpu"))
    device_id = device if device.type != "cpu" else None
    dist.init_process_group(backend_for(device.type), timeout=timeout, device_id=device_id)
    try:
        return _train(args, where, device)
    except Exception as err:
        report_error(err, dist.get_rank(), where, args.timeout)
        return exit_code(err)


if __name__ == "__main__":
    code = main()
    # Leave without interpreter teardown: gloo's worker threads may still hold work
    # objects whose tensors need the GIL, and finalization then aborts the process
    # (SIGABRT, "terminate called without an active exception"; pytorch/pytorch#179291).
    # Everything is written and the process group destroyed by now (or, after a
    # failure, cannot be: a peer may be gone).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
