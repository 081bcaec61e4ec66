"""The demo dataset: bytes of text, split train / validation, cut into deterministic batches.

By default the text is the Python standard library's own ``*.py`` sources, found beside
the running interpreter (``sysconfig.get_paths()["stdlib"]``): present on every machine,
nothing to download. ``DataConfig(path=...)`` takes any text file or folder instead.
Tokens are bytes: ids 0..255 (a model's larger vocabulary simply has unused ids).

[Note: world-size-invariant batches]
The global batch of step ``k`` is a function of ``(seed, k, batch_size, seq_len)`` only:
``batch_size`` window starts are drawn from a generator seeded by ``(seed, k)``, and rank
``r`` of ``m`` takes rows ``[r * b, (r + 1) * b)`` with ``b = batch_size / m``::

    global batch (8 rows)   | 0 1 2 3 4 5 6 7 |
    world size 1            | rank 0          |
    world size 2            | rank 0 | rank 1 |
    world size 4            | r0 | r1 | r2 | r3 |

so the rows of all ranks, concatenated, are the same global batch for every world size:
a run on m ranks sees exactly the data of a single-process run (the parity tests rely on
it). No iterator state exists: resuming at step k just asks for step k.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

__all__ = [
    "BYTE_VOCAB",
    "DataConfig",
    "TextCorpus",
    "batches",
    "get_batch",
    "load_corpus",
    "stdlib_dir",
]

BYTE_VOCAB = 256  # token ids are bytes
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where the text comes from and how much of it to use.

    Args:
        path: a text file or a folder of text files; None: the standard library's
            ``*.py`` sources. Default None.
        max_bytes: read at most this many bytes (files in sorted order, the last one
            cut). Default 8 MiB.
        val_fraction: share of the bytes held out for validation, in (0, 1). Default 0.1.
    """

    path: str | None = None
    max_bytes: int = 8 << 20
    val_fraction: float = 0.1

    def __post_init__(self) -> None:
        if isinstance(self.max_bytes, bool) or not isinstance(self.max_bytes, int):
            raise ValueError(f"DataConfig: max_bytes must be an int, got {self.max_bytes!r}")
        if self.max_bytes < 2:
            raise ValueError(
                f"DataConfig: max_bytes must be >= 2 (one byte for each split), "
                f"got {self.max_bytes}"
            )
        if not 0.0 < self.val_fraction < 1.0:
            raise ValueError(f"DataConfig: val_fraction must be in (0, 1), got {self.val_fraction}")


@dataclass(frozen=True, kw_only=True, eq=False)
class TextCorpus:
    """Loaded bytes, split.

    Args:
        train: training bytes, 1-D uint8.
        val: validation bytes, 1-D uint8.
        source: where they came from (a path), for logs.
        n_files: how many files were read.
    """

    train: Tensor  # 1-D uint8
    val: Tensor  # 1-D uint8
    source: str
    n_files: int

    def split(self, name: str) -> Tensor:
        """``"train"`` or ``"val"`` bytes."""
        if name not in ("train", "val"):
            raise ValueError(f"TextCorpus.split: name must be 'train' or 'val', got {name!r}")
        return self.train if name == "train" else self.val


def stdlib_dir() -> Path:
    """The standard library folder of the running interpreter."""
    return Path(sysconfig.get_paths()["stdlib"])


def _list_files(root: Path, *, python_only: bool) -> list[Path]:
    """Files under ``root`` sorted by relative POSIX path; skips hidden, caches, site-packages."""
    found: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS and not d.startswith(".")]
        for f in filenames:
            if f.startswith(".") or (python_only and not f.endswith(".py")):
                continue
            p = Path(dirpath, f)
            if p.is_file():
                found.append((p.relative_to(root).as_posix(), p))
    return [p for _, p in sorted(found)]


def _read(path: Path, limit: int) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(limit)
    except OSError as e:
        raise ValueError(
            f"data: cannot read {str(path)!r} ({e.strerror or e}); pass a readable text file "
            f"or folder"
        ) from None


def _is_val(rel: str, val_fraction: float) -> bool:
    """A file's split, from the hash of its relative path (stable across machines and runs)."""
    h = int.from_bytes(hashlib.sha256(rel.encode()).digest()[:8], "little")
    return h / 2**64 < val_fraction


def load_corpus(config: DataConfig | None = None) -> TextCorpus:
    """Read the text of ``config`` and split it deterministically into train and validation.

    Files are read in sorted order until ``max_bytes``; each goes to validation or
    training by the hash of its relative path. If that leaves a side empty (one file, or
    few), the last ``val_fraction`` of the bytes is validation instead.

    Args:
        config: what to read. Default ``DataConfig()`` (the standard library).

    Returns:
        The split bytes.

    Raises:
        ValueError: a path that does not exist or cannot be read, or no text in it.
    """
    config = config or DataConfig()
    if config.path is None:
        root, files = stdlib_dir(), _list_files(stdlib_dir(), python_only=True)
    else:
        root = Path(config.path)
        if root.is_dir():
            files = _list_files(root, python_only=False)
        elif root.exists():
            files = [root]
        else:
            raise ValueError(
                f"data: {config.path!r} does not exist; pass a text file or a folder of text "
                f"files (or no path for the standard library's sources)"
            )

    chunks: list[tuple[str, bytes]] = []  # (relative path, bytes)
    left = config.max_bytes
    for p in files:
        if left <= 0:
            break
        data = _read(p, left)
        if config.path is not None and root.is_dir() and b"\0" in data[:8192]:
            continue  # a binary file inside a user's folder
        rel = p.relative_to(root).as_posix() if root.is_dir() else p.name
        chunks.append((rel, data))
        left -= len(data)
    total = sum(len(d) for _, d in chunks)
    if total < 2:
        raise ValueError(
            f"data: {str(root)!r} holds {total} bytes of text (at least 2 needed, one per "
            f"split); pass a non-empty text file or folder"
        )

    val = b"".join(d for rel, d in chunks if _is_val(rel, config.val_fraction))
    train = b"".join(d for rel, d in chunks if not _is_val(rel, config.val_fraction))
    if not val or not train:  # too few files to split by file: split the bytes
        everything = b"".join(d for _, d in chunks)
        cut = min(max(1, round(len(everything) * (1 - config.val_fraction))), total - 1)
        train, val = everything[:cut], everything[cut:]
    return TextCorpus(
        train=torch.frombuffer(bytearray(train), dtype=torch.uint8),
        val=torch.frombuffer(bytearray(val), dtype=torch.uint8),
        source=str(root),
        n_files=len(chunks),
    )


def _generator(seed: int, step: int) -> torch.Generator:
    digest = hashlib.sha256(f"raggedfsdp.data:{seed}:{step}".encode()).digest()
    return torch.Generator(device="cpu").manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def get_batch(
    data: Tensor,
    *,
    seed: int,
    step: int,
    batch_size: int,
    seq_len: int,
    rank: int = 0,
    world_size: int = 1,
) -> tuple[Tensor, Tensor]:
    """This rank's rows of the global batch of ``step``. See [Note: world-size-invariant batches].

    Args:
        data: 1-D uint8 bytes (``corpus.train`` or ``corpus.val``).
        seed: the data seed.
        step: the step index (>= 0).
        batch_size: the global batch size (rows over all ranks), divisible by ``world_size``.
        seq_len: tokens per row.
        rank: this rank, in ``[0, world_size)``. Default 0.
        world_size: ranks sharing the global batch. Default 1.

    Returns:
        ``(inputs, targets)``, each int64 ``(batch_size // world_size, seq_len)``; targets
        are the inputs shifted by one byte.

    Raises:
        ValueError: a bad size, rank, or data shorter than ``seq_len + 1`` bytes.
    """
    for name, value in (
        ("batch_size", batch_size),
        ("seq_len", seq_len),
        ("world_size", world_size),
    ):
        if value < 1:
            raise ValueError(f"get_batch: {name} must be >= 1, got {value}")
    if step < 0:
        raise ValueError(f"get_batch: step must be >= 0, got {step}")
    if batch_size % world_size:
        raise ValueError(
            f"get_batch: global batch_size {batch_size} is not divisible by world_size "
            f"{world_size}; use a batch size that is a multiple of the number of ranks"
        )
    if not 0 <= rank < world_size:
        raise ValueError(f"get_batch: rank must be in [0, {world_size}), got {rank}")
    if data.dim() != 1 or data.numel() < seq_len + 1:
        raise ValueError(
            f"get_batch: data has {data.numel()} bytes, fewer than seq_len + 1 = {seq_len + 1}; "
            f"lower seq_len or give more text"
        )
    # The whole global batch's starts are drawn on every rank (on the CPU, whatever device
    # is ambient, so the batch is the same everywhere); then this rank's rows.
    starts = torch.randint(
        0, data.numel() - seq_len, (batch_size,), generator=_generator(seed, step), device="cpu"
    )  # (batch_size,)
    rows = batch_size // world_size
    starts = starts[rank * rows : (rank + 1) * rows]
    idx = starts[:, None] + torch.arange(seq_len + 1, device="cpu")  # (rows, seq_len + 1)
    window = data[idx.to(data.device)].long()
    return window[:, :-1], window[:, 1:]


def batches(
    data: Tensor, *, start_step: int = 0, num_steps: int | None = None, **rows: int
) -> Iterator[tuple[Tensor, Tensor]]:
    """``get_batch`` for steps ``start_step, start_step + 1, ...`` (``num_steps`` of them).

    Args:
        data: as for ``get_batch``.
        start_step: the first step (resume here). Default 0.
        num_steps: how many batches; None: no end. Default None.
        **rows: ``seed``, ``batch_size``, ``seq_len``, ``rank``, ``world_size``: as for
            ``get_batch``.
    """
    end = None if num_steps is None else start_step + num_steps
    steps = itertools.count(start_step) if end is None else range(start_step, end)
    for step in steps:
        yield get_batch(data, step=step, **rows)
