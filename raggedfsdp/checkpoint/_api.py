"""``save`` and ``load``: sharded checkpoints over torch.distributed.checkpoint.

See [Note: commit protocol] (``files``) for the directory layout and crash safety,
[Note: checkpoint keys] (``_state``) for what is saved, and [Note: errors reach every
rank] (``_ranks``) for how a failure on one rank is raised on all of them.
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

import raggedfsdp.checkpoint._state as _state
from raggedfsdp.checkpoint import files
from raggedfsdp.checkpoint._ranks import Ranks, default_group, quiet, side_group
from raggedfsdp.checkpoint.files import CorruptCheckpointError

__all__ = [
    "SaveHandle",
    "hold_checkpoint",
    "latest_checkpoint",
    "list_checkpoints",
    "load",
    "save",
    "verify_checkpoint",
]

STRUCTURE = "train_state.pt"
_DCP_METADATA = ".metadata"


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
    allow_nonfinite: bool = False,
    process_group=None,
) -> SaveHandle:
    """Save a sharded checkpoint of ``model`` (and ``optimizer``) as ``path/step_XXXXXXXX``.

    Every rank writes only the shards it holds (no rank gathers a whole tensor). The
    checkpoint becomes visible by one atomic rename once complete, so a save killed at
    any point leaves the previous checkpoint the latest (see [Note: commit protocol]).
    Everything that can be checked is checked before the first byte is written (the
    arguments, ``extra``, finite values, a newer checkpoint in ``path``, free space),
    and an error on any rank is raised on every rank (see [Note: errors reach every
    rank]). Collective: every rank of the model's mesh calls it with the same arguments.

    Args:
        path: the root directory of the run's checkpoints (created if needed).
        model: the model, sharded by ``fully_shard`` or not.
        optimizer: its optimizer (any ``torch.optim.Optimizer`` over the model's
            parameters, including raggedfsdp's). Default None.
        step: the training step the state belongs to; names the directory. No
            checkpoint of a later step may exist under ``path``.
        extra: user state returned by ``load`` (data position, RNG states): tensors,
            numbers, strings, None, and lists / tuples / dicts of them. Rank 0's is
            kept. Default None.
        keep_last: after committing, delete all but the newest ``keep_last``
            checkpoints under ``path``; None keeps all. Default 3.
        async_save: copy the state to CPU now and write it in a background thread,
            so training continues; the returned handle's ``wait()`` blocks until the
            checkpoint is committed. A later ``save`` or ``load`` waits for it first.
            Default False.
        allow_nonfinite: save tensors holding nan or inf. Default False: such a state
            is refused, so a diverged run never replaces its last good checkpoint.
        process_group: the ranks that save. Default: the group of the model's mesh.

    Returns:
        A ``SaveHandle`` (already done unless ``async_save``).

    Raises:
        ValueError: a bad ``step`` or ``keep_last``; a checkpoint of ``step``, or of a
            later step, already under ``path``; an ``extra`` that cannot be read back
            safely; an optimizer over parameters that are not the model's; a tensor
            holding nan or inf (naming it); another live process saving into ``path``.
        OSError: ``ENOSPC``: the filesystem lacks the room the checkpoint needs
            (naming it, its free space and the space needed).
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
    ranks = Ranks(default_group(model, process_group))
    root = Path(path)
    error = report = None
    try:
        live = _state.collect(model, optimizer, "save")
        structure = _state.structure_bytes(live.structure(step, extra), "save")
        tensors = live.tensors()
        if not allow_nonfinite and (bad := _state.first_nonfinite(tensors)) is not None:
            raise ValueError(
                f"save: {bad!r} holds nan or inf on rank {ranks.rank} (the run diverged?); "
                f"nothing was written, the previous checkpoint is still the latest; pass "
                "allow_nonfinite=True to save it anyway"
            )
        if ranks.rank == 0:
            _check_step(root, step)
        report = files.space_report(root, _state.local_nbytes(tensors))
    except Exception as err:  # every rank raises it: see [Note: errors reach every rank]
        error = err
    files.check_space(root, ranks.exchange(report, error))
    assert report is not None  # exchange() raised otherwise
    handle = SaveHandle(step, files.step_dir(root, step))
    if not async_save:
        _write(root, step, tensors, structure, keep_last, ranks, report["needed"])
        return handle
    job_ranks = Ranks(side_group(ranks.group))
    tensors = _state.snapshot(tensors)  # synchronous: later steps cannot leak in

    def run():
        try:
            _write(root, step, tensors, structure, keep_last, job_ranks, report["needed"])
        except BaseException as err:  # reported by wait()
            handle._error = err

    global _pending
    handle._thread = threading.Thread(target=run, name=f"raggedfsdp-save-{step}")
    _pending = handle
    handle._thread.start()
    return handle


def _check_step(root: Path, step: int) -> None:
    """Rank 0: no checkpoint of ``step`` or of a later step under ``root``."""
    if files.step_dir(root, step).exists():
        raise ValueError(
            f"save: a checkpoint of step {step} already exists at "
            f"'{files.step_dir(root, step)}'; save under another step or delete it first"
        )
    newer = [s for s, _ in files.checkpoints(root) if s > step]
    if newer:
        raise ValueError(
            f"save: '{root}' holds a checkpoint of step {newer[-1]}, later than step {step}: "
            "another run's, or a later point of this one, which load would pick over this "
            "one (and keep_last would count as newer); save into another directory, or "
            "delete the later checkpoints first"
        )


def _write(root: Path, step: int, tensors, structure: bytes, keep_last, ranks, nbytes) -> None:
    """Lock, write, checksum, mark, commit and clean up (see [Note: commit protocol])."""
    tmp, final = files.tmp_dir(root, step), files.step_dir(root, step)
    with contextlib.ExitStack() as held:  # rank 0 holds the root's lock until the end
        error = None
        if ranks.rank == 0:
            try:
                root.mkdir(parents=True, exist_ok=True)
                held.enter_context(files.RootLock(root))
                if tmp.exists():
                    files.remove(tmp)  # a killed save of this step: its job holds no lock
                tmp.mkdir()
                files.write_file(tmp / STRUCTURE, structure)
            except Exception as err:
                error = err
        ranks.agree(error)
        _write_locked(root, step, tmp, final, tensors, keep_last, ranks, nbytes)


def _write_locked(root, step, tmp, final, tensors, keep_last, ranks, nbytes) -> None:
    """``_write`` once ``tmp`` exists: data, checksums, marker, commit, cleanup."""
    files.fault_point("tmp_created")
    try:
        with quiet(ranks):
            metadata = dcp.save(
                tensors,
                storage_writer=FileSystemWriter(tmp, sync_files=True),
                process_group=ranks.group,
                no_dist=not ranks.dist,
            )
    except (Exception, CheckpointException) as err:  # raised on every rank by DCP
        if ranks.rank == 0:
            with contextlib.suppress(OSError):
                files.remove(tmp)  # free what was written: the disk may be full
        full = files.disk_full(err, root, nbytes)
        if full is not None:
            raise full from err
        raise
    files.fault_point("data_written")
    # Every rank hashes a share of the data files; rank 0 records them all in the marker.
    data_files = sorted({info.relative_path for info in metadata.storage_data.values()})
    try:
        mine = {n: files.file_digest(tmp / n) for n in data_files[ranks.rank :: ranks.world]}
        error = None
    except Exception as err:
        mine, error = None, err
    parts = ranks.exchange(mine, error)
    status = None
    if ranks.rank == 0:
        try:
            digests = {name: d for part in parts for name, d in part.items()}
            for name in (_DCP_METADATA, STRUCTURE):
                digests[name] = files.file_digest(tmp / name)
            marker = files.marker_bytes(step, ranks.world, digests)
            files.write_file(tmp / files.MARKER, marker)
            files.fault_point("marker_written")
            files.commit(tmp, final)
        except Exception as err:
            status = err
    ranks.agree(status)
    files.fault_point("committed")
    if ranks.rank == 0:
        try:
            _cleanup(root, keep_last, step)
        except OSError as err:  # the checkpoint is committed; old ones stay for the next save
            warnings.warn(
                f"save: could not delete old checkpoints under '{root}': {err}", stacklevel=2
            )


def _cleanup(root: Path, keep_last: int | None, step: int) -> None:
    """Rank 0, after the commit, holding the root's lock: drop left-overs of dead jobs, then
    all but the newest ``keep_last`` of the run's checkpoints (never the one of ``step``)."""
    for stale in files.stale_dirs(root):
        files.remove(stale)
    if keep_last is None:
        return
    found = [(s, p) for s, p in files.checkpoints(root) if s <= step]
    for s, old in found[: max(0, len(found) - keep_last)]:
        if s != step:
            files.remove_unheld(old, hook=files.fault_point)  # a reader's stays: hold_checkpoint


@contextlib.contextmanager
def hold_checkpoint(path: str | os.PathLike) -> Iterator[tuple[int, Path]]:
    """Hold a checkpoint while this process reads it: a ``save`` into its root (another
    job's, with ``keep_last``) does not delete it meanwhile. On this process alone.

    Args:
        path: a checkpoint directory, or a root of ``save`` (its newest complete
            checkpoint is held; if a cleanup deletes it while it is picked, the newest
            again).

    Yields:
        ``(step, directory)`` of the held checkpoint.

    Raises:
        ValueError: no complete checkpoint at ``path``.
    """
    for _ in range(100):  # each retry follows a checkpoint deleted as it was picked
        step, chosen = files.resolve(path)
        fd = files.hold(chosen)
        if fd is not None:
            break
    else:
        raise ValueError(
            f"hold_checkpoint: the checkpoints of '{path}' were deleted as fast as they were "
            "picked; pass one that is not being deleted"
        )
    try:
        yield step, chosen
    finally:
        os.close(fd)


def latest_checkpoint(path: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under ``path`` (a root of ``save``), or None."""
    found = files.checkpoints(path)
    return found[-1][1] if found else None


def list_checkpoints(path: str | os.PathLike) -> list[tuple[int, Path]]:
    """The complete checkpoints under ``path`` (a root of ``save``) as ``(step, directory)``,
    oldest first: the committed ones, each holding its marker (``verify_checkpoint``
    checks their files)."""
    return files.checkpoints(path)


def verify_checkpoint(path: str | os.PathLike) -> str | None:
    """What ``load`` checks of a checkpoint before reading it, on this process alone.

    Reads every file of the checkpoint (its size and sha256 against the marker), so it
    costs a read of the checkpoint; no process group is needed.

    Args:
        path: a checkpoint directory (``root/step_XXXXXXXX``).

    Returns:
        None if ``path`` is a complete checkpoint whose files all match their recorded
        sizes and checksums; else what is wrong, in a few words ("it does not exist",
        "it has no checkpoint.json (an interrupted save?)", "file '__0_0.distcp' does
        not match its recorded sha256 (corrupted)", ...).
    """
    directory = Path(path)
    try:
        record = files.read_marker(directory) if directory.is_dir() else None
    except CorruptCheckpointError:
        return f"its marker {files.MARKER} is not a valid record (corrupted)"
    if record is None:
        return files.describe(directory)
    return files.verify(directory, record["files"], sorted(record["files"]))


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
    and shape fits, the optimizer is of the class that saved it), then the state is
    read into fresh tensors and copied in, so on any such error the model and
    optimizer are untouched. An error on any rank is raised on every rank (see
    [Note: errors reach every rank]). Collective, like ``save``.

    Args:
        path: a checkpoint directory, or a root of ``save``: its newest complete
            checkpoint is loaded.
        model: the model, with the same FQNs and shapes as the saved one.
        optimizer: the optimizer to restore (its state and param-group
            hyperparameters), of the class that saved it or a subclass. Default None:
            the model only.
        verify: check every file's checksum before reading. Default True.
        process_group: the ranks that load. Default: the group of the model's mesh.

    Returns:
        ``(step, extra)``: the step and the extras given to ``save``.

    Raises:
        ValueError: no complete checkpoint at ``path``, or it does not fit: missing or
            unexpected keys, shape / dtype mismatches (naming the first FQNs), an
            optimizer of another class.
        CorruptCheckpointError: a file is missing, truncated or corrupted.
    """
    _wait_pending()
    ranks = Ranks(default_group(model, process_group))
    found = error = None
    if ranks.rank == 0:
        try:
            found = files.resolve(path)
        except Exception as err:  # CorruptCheckpointError too
            error = err
    _, directory = ranks.exchange(found, error)[0]

    # 1. the marker and the small files every rank reads
    error = None
    try:
        record = files.read_marker(directory)
        assert record is not None  # resolve() chose a checkpoint with a marker
        problem = files.verify(directory, record["files"], [_DCP_METADATA, STRUCTURE])
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
    except Exception as err:
        error = err
    ranks.agree(error)
    assert record is not None  # agree() raised otherwise

    # 2. every data file against its checksum, a share per rank
    error = None
    if verify:
        try:
            data = sorted(n for n in record["files"] if n not in (_DCP_METADATA, STRUCTURE))
            problem = files.verify(directory, record["files"], data[ranks.rank :: ranks.world])
            if problem:
                raise CorruptCheckpointError(_corrupt(directory, problem))
        except Exception as err:
            error = err
    ranks.agree(error)

    # 3. a fresh optimizer whose state layout only it knows creates its state first
    loading_optim = optimizer is not None
    if loading_optim:
        _prime(directory, model, optimizer, live, structure, metadata, ranks)
        live = _state.collect(model, optimizer, "load")

    # 4. read into fresh tensors; then the optimizer, then the model (each all or none)
    error = None
    try:
        staged = _state.stage(live, structure, metadata, loading_optim)
    except Exception as err:
        error = err
    ranks.agree(error)
    with quiet(ranks):
        dcp.load(
            staged,
            storage_reader=FileSystemReader(directory),
            process_group=ranks.group,
            no_dist=not ranks.dist,
        )
    error = None
    try:
        if optimizer is not None:  # loading_optim
            optimizer.load_state_dict(_state.optimizer_state_dict(live, structure, staged))
    except Exception as err:
        error = err
    ranks.agree(error)
    error = None
    try:
        _state.copy_into(live, staged)
    except Exception as err:
        error = err
    ranks.agree(error)
    return structure["step"], structure["extra"]


def _prime(directory, model, optimizer, live, structure, metadata, ranks) -> None:
    """Let a fresh optimizer create the state whose layout only it knows; undo on a misfit."""
    error = None
    primed = []
    try:
        primed = [live.params[f] for f in _state.needs_priming(live, structure, metadata)]
        if primed:
            _state.prime(optimizer, primed)
            problems = _state.check_against(
                _state.collect(model, optimizer, "load"), structure, metadata, True
            )
            if problems:
                raise ValueError(
                    f"load: checkpoint '{directory}' does not fit the optimizer: "
                    + "; ".join(problems)
                    + ". Nothing was loaded."
                )
    except Exception as err:
        for p in primed:
            optimizer.state.pop(p, None)  # as it was: no state
        error = err
    ranks.agree(error)


def _corrupt(directory: Path, problem: str) -> str:
    return (
        f"load: checkpoint '{directory}' is damaged: {problem}; nothing was loaded. "
        "Load an earlier checkpoint by passing its directory"
    )
