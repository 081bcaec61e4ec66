"""The training data: text as ids, split train / validation, cut into deterministic batches.

By default the text is the Python standard library's own ``*.py`` sources, found beside
the running interpreter (``sysconfig.get_paths()["stdlib"]``): present on every machine,
nothing to download. ``DataConfig(path=...)`` takes a text file, a JSON-lines file (a
``"text"`` field a line), a folder of both, or a token file written by ``python -m
raggedfsdp tokenize`` (memory-mapped; [Note: token file format] in ``tokens.py``).
By default the ids are bytes, 0..255 (a model's larger vocabulary simply has unused ids);
``DataConfig(tokenizer=DIR)`` encodes the text with a local ``tokenizer.json`` instead.

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
import json
import os
import stat
import sysconfig
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from raggedfsdp.train.tokens import is_token_file, load_tokenizer, read_token_file, split_point

__all__ = [
    "BYTE_VOCAB",
    "DataConfig",
    "Document",
    "TextCorpus",
    "batches",
    "data_files",
    "get_batch",
    "is_val",
    "iter_documents",
    "load_corpus",
    "stdlib_dir",
]

BYTE_VOCAB = 256  # token ids are bytes
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where the text comes from, how much of it to use, and how it becomes ids.

    Args:
        path: a text file, a JSON-lines file (``*.jsonl`` or ``*.json``, any case: one
            JSON object a line, its text in the ``"text"`` field), a token file (``python
            -m raggedfsdp tokenize``; see [Note: token file format] in ``tokens.py``), a
            pipe (read once, held in memory), or a folder of text and JSON-lines files
            (hidden files skipped); None: the standard library's ``*.py`` sources.
            Default None.
        max_bytes: read at most this many bytes of text (documents in order, the last one
            cut); None: all of it. A token file is mapped whole. Default 8 MiB.
        val_fraction: share of the documents held out for validation, in (0, 1).
            Default 0.1.
        tokenizer: a folder holding a ``tokenizer.json`` (or that file); None: byte-level
            ids. Default None.
    """

    path: str | None = None
    max_bytes: int | None = 8 << 20
    val_fraction: float = 0.1
    tokenizer: str | None = None

    def __post_init__(self) -> None:
        if self.max_bytes is not None:
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
    """Loaded ids, split.

    Args:
        train: training ids, 1-D (uint8 bytes; uint16 or uint32 from a tokenizer).
        val: validation ids, 1-D, the same dtype.
        source: where they came from (a path), for logs.
        n_files: how many files were read.
        vocab_size: every id is below it. Default 256 (bytes).
        tokenizer: what made the ids: ``"bytes"``, a ``tokenizer.json`` path, or
            ``"token file"``. Default ``"bytes"``.
    """

    train: Tensor  # 1-D ids
    val: Tensor  # 1-D ids
    source: str
    n_files: int
    vocab_size: int = BYTE_VOCAB
    tokenizer: str = "bytes"

    @property
    def unit(self) -> str:
        """What an id is, for messages: ``"bytes"`` or ``"tokens"``."""
        return "bytes" if self.tokenizer == "bytes" else "tokens"

    def split(self, name: str) -> Tensor:
        """``"train"`` or ``"val"`` ids."""
        if name not in ("train", "val"):
            raise ValueError(f"TextCorpus.split: name must be 'train' or 'val', got {name!r}")
        return self.train if name == "train" else self.val


class Document(NamedTuple):
    """One document of a corpus: a text file, or one record of a JSON-lines file.

    Args:
        key: its name (a relative path; ``path:line`` for a record), which decides its split.
        text: its bytes (UTF-8 for a tokenizer).
        file: the index of the file it came from.
        size: bytes of input it stands for (a record's whole line), for progress.
    """

    key: str
    text: bytes
    file: int
    size: int


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


_PIPES: dict[str, bytes] = {}  # a pipe's bytes, read once: see is_pipe


def is_pipe(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a pipe or another file that is not a regular file or a folder (a
    FIFO, ``<(command)``'s ``/dev/fd/N``, a character device): its bytes can be read once.
    Decided without opening it (opening a FIFO with no writer waits for one)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))


def _read_pipe(path: Path) -> bytes:
    """All of a pipe's bytes, read once (a second call returns the same bytes).

    Raises:
        ValueError: a FIFO no program writes (it would wait forever), or an unreadable one.
    """
    key = str(path)
    if key in _PIPES:
        return _PIPES[key]
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # never waits for a writer
    except OSError as e:
        raise ValueError(
            f"data: cannot read {key!r} ({e.strerror or e}); pass a readable file"
        ) from None
    try:
        first = b""
        for _ in range(20):  # a writer that has opened the FIFO but not yet written
            try:
                first = os.read(fd, 1 << 16)
                break
            except BlockingIOError:
                time.sleep(0.05)
        else:
            first = None
        if first == b"" and stat.S_ISFIFO(os.fstat(fd).st_mode):
            raise ValueError(
                f"data: {key!r} is a pipe (FIFO) that no program is writing (or an empty one): "
                "reading it would wait forever; start the program that writes it first, or "
                "pass a file"
            )
        os.set_blocking(fd, True)
        chunks = [first] if first else []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
    finally:
        os.close(fd)
    _PIPES[key] = data = b"".join(chunks)
    return data


def _read(path: Path, limit: int | None) -> bytes:
    try:
        if is_pipe(path):
            data = _read_pipe(path)
            return data if limit is None else data[:limit]
        with open(path, "rb") as f:
            return f.read(-1 if limit is None else limit)
    except OSError as e:
        raise ValueError(
            f"data: cannot read {str(path)!r} ({e.strerror or e}); pass a readable text file "
            f"or folder"
        ) from None


def head(path: str | os.PathLike, size: int = 8192) -> bytes:
    """The first ``size`` bytes of an input file (of a pipe: of what it gave, read once)."""
    return _read(Path(path), size)


def is_json(path: str | os.PathLike) -> bool:
    """Whether a file's name says JSON (``*.json``, ``*.jsonl``, any case): it is parsed,
    never read as text."""
    return Path(path).suffix.lower() in (".json", ".jsonl")


def is_val(key: str, val_fraction: float) -> bool:
    """A document's split, from the hash of its key (stable across machines and runs)."""
    h = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little")
    return h / 2**64 < val_fraction


def data_files(config: DataConfig) -> tuple[Path, list[Path]]:
    """``(root, files)``: the folder (or file) of ``config.path`` and the files read from
    it, in order.

    Raises:
        ValueError: the path does not exist.
    """
    if config.path is None:
        return stdlib_dir(), _list_files(stdlib_dir(), python_only=True)
    root = Path(config.path)
    if root.is_dir():
        return root, _list_files(root, python_only=False)
    if root.exists():
        return root, [root]
    raise ValueError(
        f"data: {config.path!r} does not exist; pass a text file or a folder of them, a "
        f"JSON-lines file or a token file (or no path for the standard library's sources)"
    )


_RECORD = 'one object a line, such as {"text": "..."}'


def _text_of(record, where: str, path: Path) -> str:
    text = record.get("text") if isinstance(record, dict) else None
    if not isinstance(text, str):
        raise ValueError(
            f"data: {where} of '{path}' has no string \"text\" field; a JSON-lines file holds "
            f"{_RECORD} (a *.json file: that, or one JSON list of such objects)"
        )
    return text


def _records(path: Path, data: bytes, rel: str, file: int) -> Iterator[Document]:
    """The records of a JSON-lines file: each line an object with a string ``"text"``. A
    ``*.json`` file may also be one JSON document: a list of such objects, or one."""
    if path.suffix.lower() == ".json":
        try:
            whole = json.loads(data)
        except ValueError:
            whole = None  # JSON-lines under a .json name
        if isinstance(whole, (list, dict)):
            records = whole if isinstance(whole, list) else [whole]
            for number, record in enumerate(records, start=1):
                text = _text_of(record, f"record {number}", path)
                size = len(data) // len(records)  # each record's share, for progress
                yield Document(f"{rel}:{number}", text.encode("utf-8"), file, size)
            return
    for number, line in enumerate(data.splitlines(keepends=True), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as e:
            raise ValueError(
                f"data: line {number} of '{path}' is not JSON ({e}); a JSON-lines file holds "
                f"{_RECORD}"
            ) from None
        text = _text_of(record, f"line {number}", path)
        yield Document(f"{rel}:{number}", text.encode("utf-8"), file, len(line))


def iter_documents(config: DataConfig) -> Iterator[Document]:
    """The documents of ``config``, in order, until ``max_bytes`` bytes of text.

    A JSON file (``is_json``) gives one document per record, any other file one document; a
    binary file (NUL bytes) inside a folder is skipped. Token files are not documents:
    ``load_corpus`` maps them.

    Raises:
        ValueError: a path that does not exist or cannot be read, a bad JSON-lines record.
    """
    root, files = data_files(config)
    left = config.max_bytes
    for index, p in enumerate(files):
        if left is not None and left <= 0:
            break
        rel = p.relative_to(root).as_posix() if root.is_dir() else p.name
        if is_json(p):
            data = _read(p, None)
            if root.is_dir() and b"\0" in data[:8192]:
                continue  # a binary file inside a user's folder
            for doc in _records(p, data, rel, index):
                if left is not None and len(doc.text) >= left:
                    yield doc._replace(text=doc.text[:left])
                    return
                yield doc
                left = None if left is None else left - len(doc.text)
            continue
        data = _read(p, left)
        if config.path is not None and root.is_dir() and b"\0" in data[:8192]:
            continue  # a binary file inside a user's folder
        yield Document(rel, data, index, len(data))
        left = None if left is None else left - len(data)


def _token_corpus(config: DataConfig) -> TextCorpus:
    """A token file's ids, mapped; checked against ``config.tokenizer`` if one is given."""
    tokens = read_token_file(config.path)
    if config.tokenizer is not None:
        tokenizer = load_tokenizer(config.tokenizer)
        if tokenizer.digest != tokens.tokenizer:
            made = "byte-level" if not any(tokens.tokenizer) else "another tokenizer's"
            raise ValueError(
                f"data: --data '{config.path}' holds {made} ids, not those of --tokenizer "
                f"'{config.tokenizer}'; drop --tokenizer (a token file needs none), or "
                f"tokenize the text again with it (python -m raggedfsdp tokenize)"
            )
    return TextCorpus(
        train=tokens.train,
        val=tokens.val,
        source=str(config.path),
        n_files=1,
        vocab_size=tokens.vocab_size,
        tokenizer="token file",
    )


def load_corpus(config: DataConfig | None = None) -> TextCorpus:
    """Read the text of ``config``, split it deterministically into train and validation,
    and turn it into ids (or map a token file, already split).

    Documents (``iter_documents``) are read in order until ``max_bytes``; each goes to
    validation or training by the hash of its key. If that leaves a side empty (one file,
    or few), the last ``val_fraction`` of the ids is validation instead. Each side is
    its documents' ids, one after the other (bytes, or ``config.tokenizer``'s ids).

    Args:
        config: what to read. Default ``DataConfig()`` (the standard library, bytes).

    Returns:
        The split ids.

    Raises:
        ValueError: a path that does not exist or cannot be read, no text in it, a bad
            JSON-lines record, a bad token file or tokenizer.
    """
    config = config or DataConfig()
    if config.path is not None and is_token_file(config.path):
        return _token_corpus(config)
    tokenizer = load_tokenizer(config.tokenizer)
    root, _ = data_files(config)
    docs = list(iter_documents(config))
    total = sum(len(d.text) for d in docs)
    if total < 2:
        raise ValueError(
            f"data: {str(root)!r} holds {total} bytes of text (at least 2 needed, one per "
            f"split); pass a non-empty text file or folder"
        )
    sides = [[d.text for d in docs if is_val(d.key, config.val_fraction) == v] for v in (0, 1)]
    train, val = (tokenizer.encode(texts) for texts in sides)
    if not val.size or not train.size:  # too few documents to split by document: cut the ids
        everything = np.concatenate([train, val])
        if everything.size < 2:
            raise ValueError(
                f"data: the text of {str(root)!r} gives {everything.size} tokens (at least 2 "
                "needed, one per split); give more text"
            )
        cut = split_point(everything.size, config.val_fraction)
        train, val = everything[:cut], everything[cut:]
    return TextCorpus(
        train=torch.from_numpy(train),
        val=torch.from_numpy(val),
        source=str(root),
        n_files=len({d.file for d in docs}),
        vocab_size=tokenizer.vocab_size,
        tokenizer=tokenizer.name,
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
        data: 1-D ids, any integer dtype (``corpus.train`` or ``corpus.val``).
        seed: the data seed.
        step: the step index (>= 0).
        batch_size: the global batch size (rows over all ranks), divisible by ``world_size``.
        seq_len: tokens per row.
        rank: this rank, in ``[0, world_size)``. Default 0.
        world_size: ranks sharing the global batch. Default 1.

    Returns:
        ``(inputs, targets)``, each int64 ``(batch_size // world_size, seq_len)``; targets
        are the inputs shifted by one id.

    Raises:
        ValueError: a bad size, rank, or data shorter than ``seq_len + 1`` ids.
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
        unit = "bytes" if data.dtype == torch.uint8 else "tokens"
        raise ValueError(
            f"get_batch: data has {data.numel()} {unit}, fewer than seq_len + 1 = {seq_len + 1}; "
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
