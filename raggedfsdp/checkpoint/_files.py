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
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

__all__ = [
    "MARKER",
    "CorruptCheckpointError",
    "checkpoints",
    "commit",
    "describe",
    "file_digest",
    "read_marker",
    "remove",
    "resolve",
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
def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` durably and atomically (temporary name, fsync, rename)."""
    part = path.with_name(path.name + ".part")
    with open(part, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, path)
    _fsync_dir(path.parent)


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
    _fsync_dir(final.parent)


def remove(path: Path, hook=None) -> None:
    """Delete a checkpoint or left-over directory: rename it out of sight, then remove it."""
    if not path.name.endswith((".tmp", ".trash")):
        trash = _trash_dir(path)
        if trash.exists():
            shutil.rmtree(trash)
        os.rename(path, trash)
        _fsync_dir(path.parent)
        path = trash
        if hook is not None:
            hook("cleanup")
    shutil.rmtree(path)
