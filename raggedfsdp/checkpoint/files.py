"""The on-disk protocol of a checkpoint directory: names, marker, checksums, commit, cleanup.

Pure Python (no process group, no torch): every function here runs on one process.

[Note: commit protocol]
A root directory holds one subdirectory per checkpoint::

    root/
      step_00000100/            complete: it holds checkpoint.json
        checkpoint.json         the marker: step, world size, size + sha256 of every file
        .metadata               DCP's metadata (written by DCP's coordinator)
        __0_0.distcp ...        DCP's data, one file per rank
        train_state.pt          step, user extras, optimizer structure (rank 0)
      .step_00000200.tmp/       a save in progress (or killed): never loaded
      .step_00000050.trash/     a checkpoint being deleted: never loaded

A save writes everything into ``.step_X.tmp``, then the marker (written to a
temporary name, fsynced, renamed), then renames the directory to ``step_X`` and
fsyncs the root: ``rename`` is atomic, so a reader sees either no ``step_X`` or a
complete one, whenever the save is killed. Deleting goes the other way: rename to
``.step_X.trash`` first (atomic: the checkpoint is gone for readers), then remove
the files. Only names matching ``step_<digits>`` that hold a marker are checkpoints;
the marker's checksums let ``load`` detect a file corrupted or truncated later.

Rank 0 holds an exclusive ``flock`` on the root directory from the creation of the
``.tmp`` directory to the end of the cleanup (``RootLock``). A second live job that
saves into the same root is refused instead of deleting the first one's ``.tmp``
directory, and the cleanup only ever removes left-overs of dead jobs: any ``.tmp``
directory it finds while holding the lock belongs to a save that is no longer running
(the kernel releases the lock of a killed process).

A root never holds a checkpoint newer than the one being saved: ``save`` refuses a
step lower than the newest one there (another run's, or a later point of this one),
since ``load`` would pick that one. So "newest" by step is the order of the run's own
saves, and ``keep_last`` deletes only its older checkpoints.

A reader that must not lose the checkpoint it picked (``python -m raggedfsdp export``
while the run trains and prunes) holds a shared ``flock`` on the checkpoint directory
(``hold``, ``checkpoint.hold_checkpoint``) from picking it to the end of its read. The
cleanup deletes a checkpoint only if it can lock it exclusively, and renames it out of
sight while locked, so a reader either holds a complete checkpoint or sees that it is
gone and picks again; a held checkpoint is deleted by the first save after its reader
ends.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import socket
import warnings
from collections.abc import Callable
from pathlib import Path

__all__ = [
    "MARKER",
    "CorruptCheckpointError",
    "DirectoryLock",
    "RootLock",
    "fault_point",
    "flock_directory",
    "fsync_dir",
    "check_space",
    "hold",
    "remove_unheld",
    "disk_full",
    "checkpoints",
    "commit",
    "describe",
    "file_digest",
    "read_marker",
    "replace_file",
    "remove",
    "space_report",
    "resolve",
    "staging_path",
    "step_dir",
    "stale_dirs",
    "tmp_dir",
    "verify",
    "write_file",
]

MARKER = "checkpoint.json"
FORMAT = "raggedfsdp-checkpoint/1"
_STEP_RE = re.compile(r"step_(\d+)")
_CHUNK = 4 << 20  # bytes read at a time when hashing


# Called with the name of each step of a save ("tmp_created", "data_written",
# "marker_written", "committed", "cleanup"); a crash test sets it to kill the process
# there. None in normal use.
fault_hook = None


def fault_point(name: str) -> None:
    """A named step of a save: calls ``fault_hook(name)`` when one is set."""
    if fault_hook is not None:
        fault_hook(name)


class CorruptCheckpointError(ValueError):
    """A checkpoint file is missing, truncated or does not match its recorded checksum."""


# ---- names --------------------------------------------------------------------------------
def step_dir(root: str | os.PathLike, step: int) -> Path:
    """``root/step_XXXXXXXX``: where the checkpoint of ``step`` lives once complete."""
    return Path(root) / f"step_{step:08d}"


def tmp_dir(root: str | os.PathLike, step: int) -> Path:
    """``root/.step_XXXXXXXX.tmp``: where the checkpoint of ``step`` is written."""
    return Path(root) / f".step_{step:08d}.tmp"


def _trash_dir(path: Path) -> Path:
    return path.with_name(f".{path.name}.trash")


# ---- files --------------------------------------------------------------------------------
def fsync_dir(path: Path) -> None:
    """Make the entries of directory ``path`` durable (a rename or a new file in it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def staging_path(path: Path, kind: str = "part") -> Path:
    """Where ``path`` is written before it is renamed into place: a hidden name beside it,
    unique to this process (``.NAME.PID.KIND``). Hidden, so that no reader of a folder
    (``train --data DIR``, ``tokenize DIR``) ever takes a half-written file as input."""
    path = Path(path)
    return path.with_name(f".{path.name}.{os.getpid()}.{kind}")


def replace_file(path: Path, data: bytes) -> None:
    """Replace ``path`` by ``data`` atomically: written to ``staging_path(path)`` and
    fsynced, then renamed over ``path`` (a crash leaves the old file or the new one, never
    a mix). The rename is durable once the directory is fsynced (``fsync_dir``)."""
    part = staging_path(path)
    with open(part, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, path)


def write_file(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` durably and atomically (temporary name, fsync, rename)."""
    replace_file(path, data)
    fsync_dir(path.parent)


def file_digest(path: Path) -> dict:
    """``{"size": bytes, "sha256": hex}`` of the file at ``path``."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return {"size": size, "sha256": h.hexdigest()}


def verify(directory: Path, files: dict[str, dict], names) -> str | None:
    """Check ``names`` in ``directory`` against their recorded ``files`` digests.

    Returns:
        None if every file matches, else a sentence naming the first bad file.
    """
    for name in names:
        path = directory / name
        expected = files[name]
        if not path.is_file():
            return f"file {name!r} is missing"
        size = path.stat().st_size
        if size != expected["size"]:
            recorded = expected["size"]
            return f"file {name!r} has {size} bytes, the marker recorded {recorded} (truncated?)"
        if file_digest(path)["sha256"] != expected["sha256"]:
            return f"file {name!r} does not match its recorded sha256 (corrupted)"
    return None


# ---- marker -------------------------------------------------------------------------------
def marker_bytes(step: int, world_size: int, files: dict[str, dict]) -> bytes:
    record = {"format": FORMAT, "step": step, "world_size": world_size, "files": files}
    return json.dumps(record, indent=1, sort_keys=True).encode()


def read_marker(directory: Path) -> dict | None:
    """The marker of ``directory``, or None if it has none (not a complete checkpoint).

    Raises:
        CorruptCheckpointError: the marker exists but is not a valid record.
    """
    path = directory / MARKER
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_bytes())
        ok = record.get("format") == FORMAT and isinstance(record.get("step"), int)
        ok = ok and isinstance(record.get("files"), dict)
    except (ValueError, UnicodeDecodeError, AttributeError):
        ok = False
    if not ok:
        raise CorruptCheckpointError(
            f"checkpoint '{directory}': its marker {MARKER} is not a valid {FORMAT} record "
            "(corrupted); load an earlier checkpoint by passing its directory"
        )
    return record


# ---- discovery ----------------------------------------------------------------------------
def checkpoints(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """The complete checkpoints under ``root`` as ``(step, path)``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = _STEP_RE.fullmatch(entry.name)
        if match and (entry / MARKER).is_file():
            found.append((int(match.group(1)), entry))
    return sorted(found)


def resolve(path: str | os.PathLike) -> tuple[int, Path]:
    """The checkpoint ``path`` names: itself if complete, else the latest one under it.

    Raises:
        ValueError: ``path`` is neither a complete checkpoint nor a directory holding one.
        CorruptCheckpointError: the chosen checkpoint's marker is unreadable.
    """
    path = Path(path)
    record = read_marker(path) if path.is_dir() else None
    if record is not None:
        return record["step"], path
    found = checkpoints(path)
    if found:
        step, latest = found[-1]
        read_marker(latest)  # raises if corrupted: never fall back silently
        return step, latest
    raise ValueError(
        f"load: no complete checkpoint at '{path}': {describe(path)}; pass a directory "
        f"written by raggedfsdp.checkpoint.save (or the root holding its step_XXXXXXXX "
        f"directories)"
    )


def describe(path: Path) -> str:
    """Why ``path`` holds no complete checkpoint, in a few words."""
    if not path.exists():
        return "it does not exist"
    if not path.is_dir():
        return "it is not a directory"
    if _STEP_RE.fullmatch(path.name) or path.name.endswith(".tmp"):
        return f"it has no {MARKER} (an interrupted save?)"
    partial = sorted(e.name for e in path.iterdir() if e.name.endswith(".tmp"))
    if partial:
        return f"it holds only interrupted saves {partial[:3]}"
    return "it holds no step_XXXXXXXX directory"


def stale_dirs(root: Path) -> list[Path]:
    """Left-overs of killed saves and deletions under ``root`` (``.tmp`` / ``.trash``)."""
    if not root.is_dir():
        return []
    return sorted(
        e
        for e in root.iterdir()
        if e.is_dir() and e.name.startswith(".step_") and e.name.endswith((".tmp", ".trash"))
    )


# ---- commit and delete --------------------------------------------------------------------
def commit(tmp: Path, final: Path) -> None:
    """Make the checkpoint in ``tmp`` visible as ``final``: one atomic rename, then fsync."""
    os.rename(tmp, final)
    fsync_dir(final.parent)


def remove(path: Path, hook=None) -> None:
    """Delete a checkpoint or left-over directory: rename it out of sight, then remove it."""
    if not path.name.endswith((".tmp", ".trash")):
        trash = _trash_dir(path)
        if trash.exists():
            shutil.rmtree(trash)
        os.rename(path, trash)
        fsync_dir(path.parent)
        path = trash
        if hook is not None:
            hook("cleanup")
    shutil.rmtree(path)


# ---- one writer per root ------------------------------------------------------------------
def flock_directory(path: Path, unsupported: Callable[[str], None]) -> int | None:
    """An exclusive, non-blocking ``flock`` on the directory ``path`` itself (so no lock
    file is left behind): the file descriptor that holds it until closed.

    A filesystem without ``flock`` on directories (some network filesystems): calls
    ``unsupported(reason)`` and returns None (the caller goes on unlocked).

    Raises:
        BlockingIOError: another live process holds the lock.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        os.close(fd)
        if err.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
            raise BlockingIOError(err.errno, f"'{path}' is locked by another process") from None
        unsupported(err.strerror or str(err))
        return None
    return fd


class DirectoryLock:
    """An exclusive ``flock`` on a directory (``flock_directory``), held from ``acquire``
    to ``release``, or as a context manager. A subclass says what the two failures mean:
    ``busy()`` is the error raised when another live process holds the lock,
    ``unlocked(reason)`` is told when the filesystem cannot lock (and the caller goes on
    unlocked)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._fd: int | None = None

    def acquire(self) -> None:
        try:
            self._fd = flock_directory(self.path, self.unlocked)
        except BlockingIOError:
            raise self.busy() from None

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the lock
            self._fd = None

    def __enter__(self) -> DirectoryLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def busy(self) -> Exception:
        raise NotImplementedError

    def unlocked(self, reason: str) -> None:
        pass


class RootLock(DirectoryLock):
    """An exclusive ``flock`` on the root directory while a save writes, commits, cleans up.

    See [Note: commit protocol]. Used as a context manager by rank 0. The directory
    itself is locked, so no lock file is left behind. A filesystem without ``flock``
    on directories (some network filesystems) saves unlocked, with a warning.

    Raises:
        ValueError: another live process holds the lock.
    """

    _warned = False

    def busy(self) -> Exception:
        return ValueError(
            f"save: another live process is saving into '{self.path}'; give each job "
            "its own checkpoint directory (or wait for that one to end)"
        )

    def unlocked(self, reason: str) -> None:
        if not RootLock._warned:
            RootLock._warned = True
            warnings.warn(
                f"save: '{self.path}' cannot be locked ({reason}); two jobs saving "
                "into it at once would not be detected",
                stacklevel=5,
            )


# ---- a reader holds the checkpoint it reads -----------------------------------------------
def hold(path: Path) -> int | None:
    """A shared ``flock`` on the checkpoint directory ``path``: the file descriptor that
    holds it until closed, or None if ``path`` is no longer a complete checkpoint (a save's
    cleanup deleted it since it was picked). Waits while a cleanup is deleting it.

    A save's cleanup deletes only checkpoints it can lock exclusively (``remove_unheld``),
    so a held checkpoint outlives ``keep_last`` until the next save after its reader ends.
    See [Note: commit protocol].
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
    except OSError:
        pass  # a filesystem without flock: read unheld (a cleanup may still delete it)
    try:
        here = os.path.samestat(os.fstat(fd), os.stat(path)) and (path / MARKER).is_file()
    except OSError:
        here = False
    if not here:
        os.close(fd)
        return None
    return fd


def remove_unheld(path: Path, hook=None) -> bool:
    """``remove`` a checkpoint unless a reader ``hold``s it; whether it was removed."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                return False  # a reader holds it: the next save's cleanup removes it
        remove(path, hook=hook)  # renamed out of sight while locked: a new reader misses it
        return True
    finally:
        os.close(fd)


# ---- free space ---------------------------------------------------------------------------
def _existing(path: Path) -> Path:
    path = Path(os.path.abspath(path))
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _mount_point(path: Path) -> Path:
    while not os.path.ismount(path) and path != path.parent:
        path = path.parent
    return path


def space_report(root: Path, nbytes: int) -> dict:
    """What one rank needs and sees: ``nbytes`` to write under ``root``, and its filesystem.

    Returns:
        ``{"host", "device", "mount", "free", "needed"}`` (``device`` identifies the
        filesystem on that host).
    """
    where = _existing(root)
    return {
        "host": socket.gethostname(),
        "device": os.stat(where).st_dev,
        "mount": str(_mount_point(where)),
        "free": shutil.disk_usage(where).free,
        "needed": int(nbytes),
    }


# Room left beyond the tensors' bytes: DCP's metadata, the marker, pickling overhead.
_SPACE_MARGIN = 1.01
_SPACE_SLACK = 1 << 20


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def check_space(root: Path, reports: list[dict]) -> None:
    """Raise if a filesystem lacks room for what the ranks writing to it need.

    The same ``reports`` (every rank's ``space_report``) give the same answer on
    every rank, so all raise or none does.

    Raises:
        OSError: ``ENOSPC``, naming the filesystem, its free bytes and the bytes needed.
    """
    by_fs: dict[tuple, list[dict]] = {}
    for report in reports:
        by_fs.setdefault((report["host"], report["device"]), []).append(report)
    for (host, _), same in by_fs.items():
        needed = sum(r["needed"] for r in same) * _SPACE_MARGIN + _SPACE_SLACK
        free = min(r["free"] for r in same)
        if free < needed:
            raise OSError(
                errno.ENOSPC,
                f"save: not enough space for the checkpoint under '{root}': the filesystem "
                f"mounted at '{same[0]['mount']}' on {host} has {_mib(free)} free, this "
                f"checkpoint needs about {_mib(needed)} ({len(same)} rank(s) write there); "
                "free some space (delete old checkpoints, lower keep_last) or save elsewhere. "
                "Nothing was written",
            )


def disk_full(error: BaseException, root: Path, needed: int) -> OSError | None:
    """An ``OSError`` naming the full filesystem if ``error`` (or its causes) is ENOSPC.

    torch's writers report a full disk as a ``RuntimeError`` of its zip writer
    (``enforce fail at inline_container.cc ... file write failed``); DCP wraps every
    rank's error in a ``CheckpointException``. Both are searched.
    """
    seen: set[int] = set()
    todo: list[BaseException | None] = [error]
    while todo:
        err = todo.pop()
        if err is None or id(err) in seen:
            continue
        seen.add(id(err))
        text = str(err)
        full = isinstance(err, OSError) and err.errno == errno.ENOSPC
        full = full or "No space left on device" in text
        if not full and ("inline_container" in text or "write failed" in text):
            full = shutil.disk_usage(_existing(root)).free < needed * _SPACE_MARGIN
        if full:
            where = _existing(root)
            free = shutil.disk_usage(where).free
            return OSError(
                errno.ENOSPC,
                f"save: the filesystem mounted at '{_mount_point(where)}' on "
                f"{socket.gethostname()} is full ({_mib(free)} free; this rank's share of the "
                f"checkpoint is about {_mib(needed)}): the checkpoint under '{root}' was not "
                "written and the previous one is still the latest; free some space or save "
                "elsewhere",
            )
        todo += [err.__cause__, err.__context__]
        failures = getattr(err, "failures", None)  # DCP's CheckpointException
        if isinstance(failures, dict):  # rank -> (exception, stack summary)
            for failure in failures.values():
                todo.append(failure[0] if isinstance(failure, tuple) else failure)
    return None
