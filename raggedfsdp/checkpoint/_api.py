"""``save`` and ``load``: sharded checkpoints over torch.distributed.checkpoint.

See [Note: commit protocol] (``_files``) for the directory layout and crash safety,
and [Note: checkpoint keys] (``_state``) for what is saved.
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.tensor import DTensor

from raggedfsdp.checkpoint import _files, _state
from raggedfsdp.checkpoint._files import CorruptCheckpointError

__all__ = ["SaveHandle", "latest_checkpoint", "load", "save"]

STRUCTURE = "train_state.pt"
_DCP_METADATA = ".metadata"

# Called with the name of each step of a save ("tmp_created", "data_written",
# "marker_written", "committed", "cleanup"); tests set it to kill the process there.
_fault_hook = None


def _fault_point(name: str) -> None:
    if _fault_hook is not None:
        _fault_hook(name)


# ---- process groups -----------------------------------------------------------------------
class _Ranks:
    """The ranks a checkpoint is written by: a process group, or one process without one."""

    def __init__(self, group):
        self.group = group
        self.dist = group is not None
        self.rank = dist.get_rank(group) if self.dist else 0
        self.world = dist.get_world_size(group) if self.dist else 1

    def all_gather(self, obj) -> list:
        if not self.dist:
            return [obj]
        out = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast(self, obj):
        """Rank 0's ``obj`` on every rank."""
        if not self.dist:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0), group=self.group)
        return box[0]

    def agree(self, error: Exception | None) -> None:
        """Raise the first rank's error on every rank (so no rank is left in a collective)."""
        errors = [e for e in self.all_gather(error) if e is not None]
        if errors:
            raise errors[0]

    def barrier(self) -> None:
        if self.dist:
            dist.barrier(group=self.group)


@contextlib.contextmanager
def _quiet(ranks: _Ranks):
    """Silence DCP's warning that one process without a process group is one process."""
    if ranks.dist:
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _default_group(model: nn.Module, process_group):
    """The group of the model's mesh (its first DTensor), else the default group, else None."""
    if process_group is not None:
        return process_group
    if not dist.is_initialized():
        return None
    for p in model.parameters():
        if isinstance(p, DTensor):
            return p.device_mesh.get_group(0)
    return dist.group.WORLD


_SIDE_GROUPS: dict = {}


def _side_group(group):
    """A gloo group with ``group``'s ranks, for an async save's collectives.

    The background thread must not share a group with training collectives: two
    threads issuing collectives on one group can pair them differently on each rank.
    """
    if group is None:
        return None
    if group not in _SIDE_GROUPS:
        ranks = dist.get_process_group_ranks(group)
        _SIDE_GROUPS[group] = dist.new_group(ranks, backend="gloo", use_local_synchronization=True)
    return _SIDE_GROUPS[group]


# ---- save ---------------------------------------------------------------------------------
class SaveHandle:
    """A save in progress (``async_save=True``) or done; ``wait()`` blocks until committed.

    Attributes:
        step: the step being saved.
        path: the directory the checkpoint has once committed.
    """

    def __init__(self, step: int, path: Path):
        self.step = step
        self.path = path
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def done(self) -> bool:
        """True when the save has finished (committed, or failed: ``wait`` raises)."""
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> Path:
        """Block until the checkpoint is committed; return its directory.

        Raises:
            RuntimeError: the save failed (the previous checkpoint stays the latest).
        """
        global _pending
        if self._thread is not None:
            self._thread.join()
        if _pending is self:
            _pending = None
        if self._error is not None:
            raise RuntimeError(
                f"save: the checkpoint of step {self.step} was not written "
                f"({type(self._error).__name__}: {self._error}); the previous checkpoint is "
                "still the latest"
            ) from self._error
        return self.path


_pending: SaveHandle | None = None


def _wait_pending() -> None:
    if _pending is not None:
        _pending.wait()


def save(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    step: int,
    extra=None,
    keep_last: int | None = 3,
    async_save: bool = False,
    process_group=None,
) -> SaveHandle:
    """Save a sharded checkpoint of ``model`` (and ``optimizer``) as ``path/step_XXXXXXXX``.

    Every rank writes only the shards it holds (no rank gathers a whole tensor). The
    checkpoint becomes visible by one atomic rename once complete, so a save killed at
    any point leaves the previous checkpoint the latest (see [Note: commit protocol]).
    Collective: every rank of the model's mesh calls it with the same arguments.

    Args:
        path: the root directory of the run's checkpoints (created if needed).
        model: the model, sharded by ``fully_shard`` or not.
        optimizer: its optimizer (any ``torch.optim.Optimizer`` over the model's
            parameters, including raggedfsdp's). Default None.
        step: the training step the state belongs to; names the directory.
        extra: user state returned by ``load`` (data position, RNG states): tensors,
            numbers, strings, None, and lists / tuples / dicts of them. Rank 0's is
            kept. Default None.
        keep_last: after committing, delete all but the newest ``keep_last``
            checkpoints under ``path``; None keeps all. Default 3.
        async_save: copy the state to CPU now and write it in a background thread,
            so training continues; the returned handle's ``wait()`` blocks until the
            checkpoint is committed. A later ``save`` or ``load`` waits for it first.
            Default False.
        process_group: the ranks that save. Default: the group of the model's mesh.

    Returns:
        A ``SaveHandle`` (already done unless ``async_save``).

    Raises:
        ValueError: a bad ``step`` or ``keep_last``, a checkpoint of ``step`` that
            already exists, an ``extra`` that cannot be read back safely, an optimizer
            over parameters that are not the model's.
        RuntimeError: from ``wait()``: the save failed.
    """
    _wait_pending()
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"save: step must be an int >= 0, got {step!r}")
    if keep_last is not None and (
        isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1
    ):
        raise ValueError(
            f"save: keep_last must be an int >= 1 or None (keep all), got {keep_last!r}"
        )
    ranks = _Ranks(_default_group(model, process_group))
    root = Path(path)
    error = None
    try:
        live = _state.collect(model, optimizer, "save")
        structure = _state.structure_bytes(live.structure(step, extra), "save")
        if ranks.rank == 0 and _files.step_dir(root, step).exists():
            raise ValueError(
                f"save: a checkpoint of step {step} already exists at "
                f"'{_files.step_dir(root, step)}'; save under another step or delete it first"
            )
    except (ValueError, NotImplementedError) as err:
        error = err
    ranks.agree(error)
    tensors = live.tensors()
    handle = SaveHandle(step, _files.step_dir(root, step))
    if not async_save:
        _write(root, step, tensors, structure, keep_last, ranks)
        return handle
    job_ranks = _Ranks(_side_group(ranks.group))
    tensors = _state.snapshot(tensors)  # synchronous: later steps cannot leak in

    def run():
        try:
            _write(root, step, tensors, structure, keep_last, job_ranks)
        except BaseException as err:  # reported by wait()
            handle._error = err

    global _pending
    handle._thread = threading.Thread(target=run, name=f"raggedfsdp-save-{step}")
    _pending = handle
    handle._thread.start()
    return handle


def _write(root: Path, step: int, tensors, structure: bytes, keep_last, ranks) -> None:
    """Write, checksum, mark, commit and clean up (see [Note: commit protocol])."""
    tmp, final = _files.tmp_dir(root, step), _files.step_dir(root, step)
    error = None
    if ranks.rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                _files.remove(tmp)  # a killed save of this step
            tmp.mkdir()
            _files.write_file(tmp / STRUCTURE, structure)
        except OSError as err:
            error = err
    ranks.agree(error)
    _fault_point("tmp_created")
    with _quiet(ranks):
        metadata = dcp.save(
            tensors,
            storage_writer=FileSystemWriter(tmp, sync_files=True),
            process_group=ranks.group,
            no_dist=not ranks.dist,
        )
    _fault_point("data_written")
    # Every rank hashes a share of the data files; rank 0 records them all in the marker.
    data_files = sorted({info.relative_path for info in metadata.storage_data.values()})
    try:
        mine = {n: _files.file_digest(tmp / n) for n in data_files[ranks.rank :: ranks.world]}
    except OSError as err:  # sent to rank 0, which fails the save on every rank
        mine = err
    if ranks.dist:
        gathered = [None] * ranks.world if ranks.rank == 0 else None
        dist.gather_object(
            mine, gathered, dst=dist.get_global_rank(ranks.group, 0), group=ranks.group
        )
    else:
        gathered = [mine]
    status = None
    if ranks.rank == 0:
        try:
            failed = [part for part in gathered if isinstance(part, Exception)]
            if failed:
                raise failed[0]
            files = {name: d for part in gathered for name, d in part.items()}
            for name in (_DCP_METADATA, STRUCTURE):
                files[name] = _files.file_digest(tmp / name)
            marker = _files.marker_bytes(step, ranks.world, files)
            _files.write_file(tmp / _files.MARKER, marker)
            _fault_point("marker_written")
            _files.commit(tmp, final)
        except OSError as err:
            status = err
    status = ranks.broadcast(status)
    if status is not None:
        raise status
    _fault_point("committed")
    if ranks.rank == 0:
        try:
            _cleanup(root, keep_last)
        except OSError as err:  # the checkpoint is committed; old ones stay for the next save
            warnings.warn(
                f"save: could not delete old checkpoints under '{root}': {err}", stacklevel=2
            )


def _cleanup(root: Path, keep_last: int | None) -> None:
    """Rank 0, after the commit: keep the newest ``keep_last``, drop left-overs."""
    for stale in _files.stale_dirs(root):
        _files.remove(stale)
    if keep_last is None:
        return
    found = _files.checkpoints(root)
    for _, old in found[: max(0, len(found) - keep_last)]:
        _files.remove(old, hook=_fault_point)


def latest_checkpoint(path: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under ``path`` (a root of ``save``), or None."""
    found = _files.checkpoints(path)
    return found[-1][1] if found else None


# ---- load ---------------------------------------------------------------------------------
def load(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    verify: bool = True,
    process_group=None,
):
    """Load a checkpoint into ``model`` (and ``optimizer``) in place, resharding as needed.

    The checkpoint may come from another world size or block policy: every rank reads
    the boxes that overlap its own shards. Everything is checked before anything is
    changed (the checkpoint is complete, its files match their checksums, every key
    and shape fits), then the state is read into fresh tensors and copied in, so on
    any error the model and optimizer are untouched. Collective, like ``save``.

    Args:
        path: a checkpoint directory, or a root of ``save``: its newest complete
            checkpoint is loaded.
        model: the model, with the same FQNs and shapes as the saved one.
        optimizer: the optimizer to restore (its state and param-group
            hyperparameters). Default None: the model only.
        verify: check every file's checksum before reading. Default True.
        process_group: the ranks that load. Default: the group of the model's mesh.

    Returns:
        ``(step, extra)``: the step and the extras given to ``save``.

    Raises:
        ValueError: no complete checkpoint at ``path``, or it does not fit: missing or
            unexpected keys, shape / dtype mismatches (naming the first FQNs).
        CorruptCheckpointError: a file is missing, truncated or corrupted.
    """
    _wait_pending()
    ranks = _Ranks(_default_group(model, process_group))
    found = None
    if ranks.rank == 0:
        try:
            found = _files.resolve(path)
        except ValueError as err:  # CorruptCheckpointError too
            found = err
    found = ranks.broadcast(found)
    if isinstance(found, Exception):
        raise found
    _, directory = found

    # 1. the marker and the small files every rank reads
    error = None
    try:
        record = _files.read_marker(directory)
        problem = _files.verify(directory, record["files"], [_DCP_METADATA, STRUCTURE])
        if problem:
            raise CorruptCheckpointError(_corrupt(directory, problem))
        structure = _state.read_structure((directory / STRUCTURE).read_bytes())
        metadata = FileSystemReader(directory).read_metadata()
        live = _state.collect(model, optimizer, "load")
        problems = _state.check_against(live, structure, metadata, optimizer is not None)
        if problems:
            raise ValueError(
                f"load: checkpoint '{directory}' does not fit the model"
                f"{' and optimizer' if optimizer is not None else ''}: "
                + "; ".join(problems)
                + ". Nothing was loaded."
            )
    except (ValueError, NotImplementedError) as err:
        error = err
    ranks.agree(error)

    # 2. every data file against its checksum, a share per rank
    error = None
    if verify:
        data = sorted(n for n in record["files"] if n not in (_DCP_METADATA, STRUCTURE))
        problem = _files.verify(directory, record["files"], data[ranks.rank :: ranks.world])
        if problem:
            error = CorruptCheckpointError(_corrupt(directory, problem))
    ranks.agree(error)

    # 3. a fresh optimizer whose state layout only it knows creates its state first
    loading_optim = optimizer is not None
    primed = []
    if loading_optim:
        primed = [live.params[f] for f in _state.needs_priming(live, structure, metadata)]
    if primed:
        _state.prime(optimizer, primed)
        error = None
        live = _state.collect(model, optimizer, "load")
        problems = _state.check_against(live, structure, metadata, True)
        if problems:
            for p in primed:
                optimizer.state.pop(p, None)  # as it was: no state
            error = ValueError(
                f"load: checkpoint '{directory}' does not fit the optimizer: "
                + "; ".join(problems)
                + ". Nothing was loaded."
            )
        ranks.agree(error)

    # 4. read into fresh tensors, then copy in
    staged = _state.stage(live, structure, metadata, loading_optim)
    with _quiet(ranks):
        dcp.load(
            staged,
            storage_reader=FileSystemReader(directory),
            process_group=ranks.group,
            no_dist=not ranks.dist,
        )
    _state.copy_into(live, staged)
    if loading_optim:
        optimizer.load_state_dict(_state.optimizer_state_dict(live, structure, staged))
    return structure["step"], structure["extra"]


def _corrupt(directory: Path, problem: str) -> str:
    return (
        f"load: checkpoint '{directory}' is damaged: {problem}; nothing was loaded. "
        "Load an earlier checkpoint by passing its directory"
    )
