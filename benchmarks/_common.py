"""What the benchmarks share: the results page, and the training harness around raggedfsdp.

A script imports it as ``import _common`` (it sits beside them, so it is on ``sys.path``
when a script runs). Two parts:

- **Results pages** (``benchmarks/results/<topic>.md``): ``header`` (title, command,
  versions, commit), ``write_results`` (generated tables around a hand-written
  ``## Analysis`` that a rewrite keeps). The numbers are tables; what they mean is
  written by a person who read them.
- **Harness**: ``shard`` (each transformer block, then the root, by raggedfsdp or by
  torch's FSDP2), ``run_ranks`` (gloo ranks in one spawn), the padding each system adds,
  optimizer state bytes, and a training run with a validation loss.
- **Optimizer comparisons**: ``Setup`` (one system of a comparison, kept in a dict by an
  identifier; its label is what the tables print) and ``optimizer_steps`` (the optimizer
  step alone, timed between barriers).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from raggedfsdp.models.parallelize import parallelize

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


# ================================================================================================
# Results pages
# ================================================================================================
ANALYSIS = "## Analysis"
PLACEHOLDER = (
    "_Not written yet: read the tables, then say here what they show and why. "
    "The script keeps this section when it rewrites the page._"
)


def git_state() -> str:
    """The commit, and the package's files that differ from it (a run's exact code)."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "--", "raggedfsdp"],
            cwd=ROOT, capture_output=True, text=True,
        ).stdout.split("\n")  # fmt: skip
    except OSError:
        return "an unknown commit (no git)"
    changed = sorted(line[3:] for line in dirty if line.strip())
    return f"commit {head}" + (
        f", with uncommitted changes to {', '.join(f'`{c}`' for c in changed)}" if changed else ""
    )


def version(package: str) -> str:
    """The installed version of a distribution, or ``"not installed"``."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def versions(*packages: str) -> str:
    """``Python 3.11.7, torch 2.13.0+cpu, deepspeed not installed``: the installed versions."""
    return ", ".join(
        [f"Python {platform.python_version()}"] + [f"{p} {version(p)}" for p in packages]
    )


def header(
    title: str,
    command: str,
    seconds: float,
    packages=("torch",),
    note: str = "",
    git: str | None = None,
) -> list[str]:
    """The lines that open a results page: title, command, versions and commit.

    Args:
        title: the page's title.
        command: the command line that made the page.
        seconds: how long it ran.
        packages: the distributions whose versions matter. Default torch.
        note: appended to the command's line (e.g. ", of which 9 s warm-up").
        git: the code's state (``git_state()`` of the run); default: now.
    """
    return [
        f"# {title}",
        "",
        f"Command: `{command}` (took {seconds:.0f} s{note}).",
        "",
        f"Versions: {versions(*packages)}; {platform.platform()}, {os.cpu_count()} CPUs; "
        f"raggedfsdp at {git or git_state()}.",
        "",
    ]


def _section(lines: list[str], heading: str) -> tuple[int, int] | None:
    """``(heading line, next level-2 heading or the end)``, or None."""
    if heading not in lines:
        return None
    start = lines.index(heading)
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    return start, end


def write_results(path: str | Path, text: str) -> None:
    """Write a results page, keeping the hand-written analysis of the page it replaces.

    ``text`` is the generated page: header and tables, with an empty ``## Analysis``
    section where the analysis goes. The analysis of the page at ``path`` (its lines
    from ``## Analysis`` to the next ``## `` heading) is put there; a new page gets a
    placeholder asking for one.
    """
    path = Path(path)
    lines = text.rstrip("\n").split("\n")
    where = _section(lines, ANALYSIS)
    if where is None:
        raise ValueError(f"write_results: the page for {path} has no {ANALYSIS!r} heading")
    body = [PLACEHOLDER]
    if path.exists():
        old = path.read_text().rstrip("\n").split("\n")
        if (kept := _section(old, ANALYSIS)) is not None:
            body = old[kept[0] + 1 : kept[1]]
            while body and not body[0].strip():
                body.pop(0)
            while body and not body[-1].strip():
                body.pop()
            body = body or [PLACEHOLDER]
    if body != [PLACEHOLDER]:
        print(f"{path}: its {ANALYSIS} was kept; check it against the new numbers")
    start, end = where
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join([*lines[: start + 1], "", *body, "", *lines[end:]]) + "\n")


# ================================================================================================
# The training harness
# ================================================================================================
def shard(model, mesh, system: str = "raggedfsdp", **kwargs) -> None:
    """``fully_shard`` each transformer block, then the root, as ``system`` does it
    (``raggedfsdp.models.parallelize``).

    Args:
        model: a ``raggedfsdp.models.Transformer``.
        mesh: the 1-D device mesh.
        system: ``"raggedfsdp"`` or ``"fsdp2"`` (``torch.distributed.fsdp``).
        **kwargs: passed to every ``fully_shard`` call.
    """
    if system == "raggedfsdp":
        from raggedfsdp import fully_shard
    elif system == "fsdp2":
        from torch.distributed.fsdp import fully_shard
    else:
        raise ValueError(f"shard: system must be 'raggedfsdp' or 'fsdp2', got {system!r}")
    parallelize(model, mesh, fully_shard=fully_shard, **kwargs)


def ragged_groups(model) -> dict[str, list]:
    """``{group: its buffers}`` of raggedfsdp in ``model``, each buffer once.

    A group is named by the module ``fully_shard`` was applied to (``"root"`` for
    ``model`` itself).
    """
    from raggedfsdp.fsdp import buffer_of

    groups: dict[str, dict[int, Any]] = {}
    for fqn, param in model.named_parameters():
        if (found := buffer_of(param)) is not None:
            buf, piece = found
            name = fqn[: len(fqn) - len(piece.fqn)].rstrip(".") or "root"
            groups.setdefault(name, {})[id(buf)] = buf
    return {name: list(bufs.values()) for name, bufs in groups.items()}


def ragged_padding(model) -> dict[str, int]:
    """``{group: padding elements}`` of raggedfsdp's buffers in ``model`` (``ragged_groups``;
    a group's padding sums its buffers')."""
    return {
        name: sum(buf.layout.padding for buf in bufs) for name, bufs in ragged_groups(model).items()
    }


def fsdp2_params(model) -> dict[str, list]:
    """``{group: its FSDPParams}`` of torch's FSDP2 in ``model`` (``"root"`` for ``model``)."""
    return {
        name or "root": [p for g in m._get_fsdp_state()._fsdp_param_groups for p in g.fsdp_params]
        for name, m in model.named_modules()
        if hasattr(m, "_get_fsdp_state")
    }


def persistent_storages(model, system: str) -> list:
    """Storages a system allocated at ``fully_shard`` time and resizes afterwards (what a
    memory tracker must see from the start): raggedfsdp's buffer storages, FSDP2's
    all-gather outputs."""
    if system == "raggedfsdp":
        from raggedfsdp.fsdp import buffers_of

        return [t for buf in buffers_of(model) for t in buf.storages()]
    return [
        t for params in fsdp2_params(model).values() for p in params for t in p.all_gather_outputs
    ]


def fsdp2_padding(params, world: int) -> int:
    """Elements FSDP2 adds to shard ``params`` (each padded on dim 0 to a multiple of world)."""
    return sum(p.padded_sharded_param_size.numel() * world - p._orig_size.numel() for p in params)


def state_tensors(state: dict) -> list:
    """The plain tensors that hold an optimizer state (all but ``step``; DTensors and
    tensor subclasses such as torchao's 8-bit states opened)."""
    import torch
    from torch.distributed.tensor import DTensor

    def inner(t: torch.Tensor) -> list[torch.Tensor]:
        if isinstance(t, DTensor):
            return inner(t._local_tensor)
        if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
            names, _ = t.__tensor_flatten__()
            return [x for n in names for x in inner(getattr(t, n))]
        return [t]

    return [x for k, v in state.items() if k != "step" and torch.is_tensor(v) for x in inner(v)]


def max_over_ranks(x: float) -> float:
    """The largest ``x`` of all ranks."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def mean_over_ranks(value) -> float:
    """The mean of a scalar tensor over the ranks."""
    import torch.distributed as dist

    value = value.detach().clone()
    dist.all_reduce(value)
    return value.item() / dist.get_world_size()


def gather_objects(obj) -> list:
    """``obj`` of every rank, in rank order."""
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def train_and_validate(model, opts, corpus, *, steps: int, batch_size: int, seq_len: int):
    """Train ``steps`` steps on the corpus, then a validation loss (this rank's rows).

    Every rank takes its rows of the same global batches (``get_batch``, seed 0; the
    validation batches: seed 1 on ``corpus.val``).

    Returns:
        ``losses`` (per step, the mean over ranks), ``final`` (the mean of the last 20),
        ``val`` (the mean over 8 batches) and ``seconds`` (the training steps' wall time).
    """
    import torch
    import torch.distributed as dist

    from raggedfsdp.models import lm_loss
    from raggedfsdp.train import get_batch

    rank, world = dist.get_rank(), dist.get_world_size()
    rows = dict(batch_size=batch_size, seq_len=seq_len, rank=rank, world_size=world)
    losses = []
    t0 = time.perf_counter()
    for step in range(steps):
        x, y = get_batch(corpus.train, seed=0, step=step, **rows)
        loss = lm_loss(model(x), y)
        loss.backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
        losses.append(mean_over_ranks(loss))
    seconds = time.perf_counter() - t0
    with torch.no_grad():
        val = [
            mean_over_ranks(lm_loss(model(x), y))
            for x, y in (get_batch(corpus.val, seed=1, step=i, **rows) for i in range(8))
        ]
    return {
        "losses": losses,
        "final": statistics.mean(losses[-20:]),
        "val": statistics.mean(val),
        "seconds": seconds,
    }


# ================================================================================================
# Optimizer comparisons
# ================================================================================================
@dataclass(frozen=True, kw_only=True)
class Setup:
    """One system of an optimizer comparison: how the model is sharded, what steps it.

    A script keeps its setups in a dict keyed by an identifier (``SETUPS["adamw8bit"]``);
    jobs and results name a setup by its key, and only the tables print its label.

    Args:
        label: the name the tables print.
        optimizers: ``optimizers(model)`` -> the optimizers, in the order they step.
        system: ``"raggedfsdp"`` or ``"fsdp2"`` (see ``shard``). Default raggedfsdp.
        block_policy: ``block_policy(model, world)`` -> raggedfsdp's block policy
            (raggedfsdp only). Default None: ``fully_shard``'s default.
    """

    label: str
    optimizers: Callable[[Any], list]
    system: str = "raggedfsdp"
    block_policy: Callable[[Any, int], Any] | None = None

    def __post_init__(self):
        if self.system not in ("raggedfsdp", "fsdp2"):
            raise ValueError(
                f"Setup {self.label!r}: system must be 'raggedfsdp' or 'fsdp2', got {self.system!r}"
            )
        if self.block_policy is not None and self.system != "raggedfsdp":
            raise ValueError(
                f"Setup {self.label!r}: a block_policy is raggedfsdp's; drop it for {self.system}"
            )

    def build(self, model_name: str, mesh, max_seq_len: int) -> tuple[Any, list]:
        """The catalogue model ``model_name`` (seed 0), sharded over the 1-D ``mesh`` as
        this setup shards it, and its optimizers."""
        from raggedfsdp.models import Transformer, get_config

        model = Transformer(get_config(model_name), max_seq_len=max_seq_len, seed=0)
        if self.system == "raggedfsdp":
            policy = self.block_policy and self.block_policy(model, mesh.size(0))
            shard(model, mesh, "raggedfsdp", block_policy=policy)
        else:
            shard(model, mesh, "fsdp2")
        return model, self.optimizers(model)


def optimizer_steps(
    model,
    opts: list,
    data,
    steps: int,
    *,
    batch_size: int,
    seq_len: int,
    around: Callable[[int], Any] | None = None,
    after: Callable[[int], None] | None = None,
) -> tuple[list[float], list[float]]:
    """Train ``steps`` steps, timing the optimizer step alone.

    Each step: this rank's rows of global batch ``step`` (``get_batch``, seed 0), forward
    and backward untimed, a barrier, then ``step()`` of every optimizer timed, then
    ``zero_grad()``.

    Args:
        model: the sharded model.
        opts: its optimizers.
        data: the training bytes (1-D token tensor).
        steps: how many steps.
        batch_size: global batch (rows, split over the ranks).
        seq_len: tokens per row.
        around: ``around(step)`` -> a context manager around the optimizer steps (a
            counter); default none.
        after: ``after(step)`` runs after the optimizer steps, before ``zero_grad()``.

    Returns:
        ``(wall, cpu)`` per step: the slowest rank's wall seconds and this rank's process
        CPU seconds (gloo's threads included).
    """
    import contextlib

    import torch.distributed as dist

    from raggedfsdp.models import lm_loss
    from raggedfsdp.train import get_batch

    rows = dict(batch_size=batch_size, seq_len=seq_len)
    rows.update(rank=dist.get_rank(), world_size=dist.get_world_size())
    wall, cpu = [], []
    for step in range(steps):
        x, y = get_batch(data, seed=0, step=step, **rows)
        lm_loss(model(x), y).backward()
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        with around(step) if around else contextlib.nullcontext():
            for opt in opts:
                opt.step()
        cpu.append(time.process_time() - c0)
        wall.append(max_over_ranks(time.perf_counter() - t0))
        if after:
            after(step)
        for opt in opts:
            opt.zero_grad()
    return wall, cpu


def _rank_entry(rank: int, world: int, fn, init_file: str, out_file: str, args: tuple) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)

    def save(result) -> None:
        if rank == 0:
            Path(out_file).write_text(json.dumps(result))

    try:
        fn(rank, world, save, *args)
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable[..., None], world: int, *args: Any, out: str | None = None) -> Any:
    """Run ``fn(rank, world, save, *args)`` on ``world`` gloo ranks (1 thread each), spawned.

    ``save(result)`` writes a JSON-able result on rank 0 (a later call replaces it, so
    what was saved before a crash survives in ``out``). Returns the last saved result.

    Args:
        fn: a module-level function (it is pickled into the ranks).
        world: ranks.
        *args: passed to ``fn``.
        out: the file ``save`` writes; default a temporary one.
    """
    import torch.multiprocessing as mp

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        out = out or os.path.join(tmp, "result.json")
        init_file = os.path.join(tmp, "rendezvous")
        mp.spawn(_rank_entry, args=(world, fn, init_file, out, args), nprocs=world)
        return json.loads(Path(out).read_text())
