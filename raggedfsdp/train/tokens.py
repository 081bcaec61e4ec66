"""Tokenizers and token files: how text becomes the ids a model reads.

Two tokenizers answer the same three questions (``vocab_size``, ``digest``, ``encode``):
``ByteTokenizer``, the default, whose ids are the bytes of the text (0..255), and
``FileTokenizer``, a local ``tokenizer.json`` read by Hugging Face's ``tokenizers``
library (``load_tokenizer(DIR)``; nothing is downloaded). ``tokenizers`` belongs to the
application's extra and is imported only when a tokenizer file is loaded.

[Note: token file format]
``python -m raggedfsdp tokenize`` writes the ids of a corpus, already split, to one file
that training memory-maps (nothing is read until a batch needs it). A 128-byte header,
then the ids, little-endian::

    offset  bytes  field
         0      8  magic       b"\\x89RAGTOK\\0" (its first byte is not text)
         8      4  version     uint32, 1
        12      4  reserved    0
        16      8  dtype       ASCII, NUL-padded: uint8, uint16 or uint32
        24      8  count       uint64: ids in the file
        32      8  val_start   uint64: training is ids [0, val_start), validation
                               [val_start, count)
        40      8  vocab_size  uint64: every id is < vocab_size
        48      8  documents   uint64: files and JSON-lines records tokenized
        56      8  reserved    0
        64     32  tokenizer   sha256 of the tokenizer.json that made the ids; zeros:
                               byte-level
        96     32  checksum    sha256(sha256(the ids) + the header's first 96 bytes)
       128  count x itemsize   the ids

The dtype is the smallest of uint8 / uint16 / uint32 that holds ``vocab_size - 1``. A
reader checks the magic, the version, the dtype (another one, say int64 or float32, is
refused), that the file is exactly ``128 + count x itemsize`` bytes long, the checksum,
and that every id is below ``vocab_size``. A header edited to stay self-consistent (a
uint16 file relabelled uint32 with its count halved, a lowered vocabulary, a moved
``val_start``), a flipped byte of the ids or a truncated file is refused, naming the
file, rather than read as other ids or failing later with an ``IndexError`` in a rank.
Writing checks the ids too: an id at or above the vocabulary (a tokenizer whose
post-processor adds one) is refused, never wrapped into the dtype's range.
"""

from __future__ import annotations

import hashlib
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "BYTE_TOKENIZER",
    "ByteTokenizer",
    "FileTokenizer",
    "TOKEN_DTYPES",
    "TokenFile",
    "TokenFileWriter",
    "check_ids",
    "is_token_file",
    "load_tokenizer",
    "read_token_file",
    "tokenizer_file",
    "split_point",
    "token_dtype",
]

MAGIC = b"\x89RAGTOK\x00"
VERSION = 2  # 1: no checksum
HEADER_BYTES = 128
_HEADER = struct.Struct("<8sII8sQQQQQ32s32s")  # see [Note: token file format]
assert _HEADER.size == HEADER_BYTES
TOKEN_DTYPES = ("uint8", "uint16", "uint32")
_NO_TOKENIZER = bytes(32)  # the header's tokenizer field of byte-level ids
_CHECKED = 96  # the header's bytes covered by its checksum (all but the checksum)
_FIX = "write it again with python -m raggedfsdp tokenize"


def _checksum(ids_digest: bytes, header: bytes) -> bytes:
    """The header's checksum field: see [Note: token file format]."""
    return hashlib.sha256(ids_digest + header[:_CHECKED]).digest()


def check_ids(ids: np.ndarray, vocab_size: int, what: str, fix: str) -> None:
    """Refuse ids outside ``[0, vocab_size)`` (they would wrap in the file's dtype, or index
    past the embedding in a rank), naming the largest, ``what`` made them, and ``fix``."""
    if ids.size == 0:
        return
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= vocab_size:
        bad = high if high >= vocab_size else low
        raise ValueError(
            f"{what} gives id {bad:,}, outside its vocabulary of {vocab_size:,} ids "
            f"(0..{vocab_size - 1:,}); {fix}"
        )


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds ids ``0 .. vocab_size - 1``."""
    for name in TOKEN_DTYPES:
        if vocab_size - 1 <= np.iinfo(name).max:
            return np.dtype(name)
    raise ValueError(
        f"token file: a vocabulary of {vocab_size} ids does not fit uint32; use a smaller tokenizer"
    )


def split_point(count: int, val_fraction: float) -> int:
    """Where a stream of ``count >= 2`` ids is cut when its documents did not split:
    the last ``val_fraction`` is validation, at least one id on each side."""
    return min(max(1, round(count * (1 - val_fraction))), count - 1)


# ---- tokenizers ---------------------------------------------------------------------------
class ByteTokenizer:
    """Byte-level ids: the text's bytes, 0..255. The default."""

    vocab_size = 256
    digest = _NO_TOKENIZER
    name = "bytes"

    def encode(self, texts: list[bytes]) -> np.ndarray:
        """The ids of ``texts``, one after the other: 1-D uint8."""
        return np.frombuffer(b"".join(texts), dtype=np.uint8).copy()


BYTE_TOKENIZER = ByteTokenizer()


class FileTokenizer:
    """A local ``tokenizer.json`` (Hugging Face ``tokenizers``).

    Args:
        path: the ``tokenizer.json`` file.

    Attributes:
        vocab_size: one more than the largest id it can give (added tokens included).
        digest: sha256 of the file, 32 bytes; a token file records the one that made it.
        name: the path, for messages.
    """

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer

        raw = path.read_bytes()
        try:
            self._tokenizer = Tokenizer.from_str(raw.decode("utf-8"))
        except Exception as e:  # the Rust side raises its own exception type
            raise ValueError(
                f"tokenizer: '{path}' is not a tokenizers file ({e}); pass a folder holding "
                "a tokenizer.json saved by tokenizers' Tokenizer.save or save_pretrained"
            ) from None
        vocab = self._tokenizer.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values(), default=-1) + 1
        self.digest = hashlib.sha256(raw).digest()
        self.name = str(path)

    def encode(self, texts: list[bytes]) -> np.ndarray:
        """The ids of ``texts`` (UTF-8; a bad byte reads as U+FFFD), each encoded as the
        tokenizer encodes a document (its special tokens included), one after the other."""
        if not texts:
            return np.zeros(0, dtype=token_dtype(self.vocab_size))
        try:
            encodings = self._tokenizer.encode_batch([t.decode("utf-8", "replace") for t in texts])
        except Exception as e:  # the Rust side raises its own exception type
            raise ValueError(
                f"tokenizer: '{self.name}' cannot encode the text ({e}); a tokenizer must "
                "encode any text: give its model an unknown token (unk_token), or use a "
                "byte-level tokenizer (BPE with a ByteLevel pre-tokenizer)"
            ) from None
        count = sum(len(e) for e in encodings)
        ids = np.fromiter((i for e in encodings for i in e.ids), dtype=np.int64, count=count)
        check_ids(
            ids,
            self.vocab_size,
            f"tokenizer: '{self.name}'",
            "its post-processor or added tokens name an id its vocabulary lacks: add that "
            "token to the vocabulary, or fix the template",
        )
        return ids.astype(token_dtype(self.vocab_size))


def tokenizer_file(path: str | os.PathLike) -> Path:
    """The ``tokenizer.json`` that ``--tokenizer path`` names (a folder holding it, or it)."""
    where = Path(path)
    return where / "tokenizer.json" if where.is_dir() else where


def load_tokenizer(path: str | None) -> ByteTokenizer | FileTokenizer:
    """The tokenizer in ``path``: a folder holding ``tokenizer.json``, or that file.

    Args:
        path: the folder or file; None: byte-level ids.

    Raises:
        ValueError: no such path, no ``tokenizer.json`` in it, a file ``tokenizers``
            cannot read, or ``tokenizers`` not installed.
    """
    if path is None:
        return BYTE_TOKENIZER
    where = Path(path)
    file = tokenizer_file(path)
    if not file.is_file():
        what = "holds no tokenizer.json" if where.is_dir() else "does not exist"
        raise ValueError(
            f"tokenizer: --tokenizer '{path}' {what}; pass a folder with a tokenizer.json "
            "(tokenizers' Tokenizer.save, or a Hugging Face model's save_pretrained), or "
            "leave --tokenizer out for byte-level ids"
        )
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        raise ValueError(
            "tokenizer: --tokenizer needs the tokenizers package, which is not installed; "
            "install the application's extra (pip install 'raggedfsdp[train]') or leave "
            "--tokenizer out for byte-level ids"
        ) from None
    return FileTokenizer(file)


# ---- token files --------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True, eq=False)
class TokenFile:
    """A token file, memory-mapped. See [Note: token file format].

    Args:
        train: the training ids, 1-D (the file's dtype).
        val: the validation ids, 1-D.
        vocab_size: every id is below it.
        documents: documents tokenized into it.
        tokenizer: sha256 of the tokenizer that made it; 32 zero bytes: byte-level.
    """

    train: Tensor  # 1-D, val_start ids
    val: Tensor  # 1-D, count - val_start ids
    vocab_size: int
    documents: int
    tokenizer: bytes


def is_token_file(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a regular file that starts with the token files' magic (a pipe
    is never opened here: reading it would take its bytes)."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return False
        with open(path, "rb") as f:
            return f.read(len(MAGIC)) == MAGIC
    except OSError:
        return False


def _ids_digest(ids: np.ndarray) -> bytes:
    h = hashlib.sha256()
    raw = ids.view(np.uint8)
    for start in range(0, raw.size, 1 << 24):
        h.update(raw[start : start + (1 << 24)])
    return h.digest()


def read_token_file(path: str | os.PathLike) -> TokenFile:
    """Memory-map a token file (copy on write: the file itself is never changed), after
    checking it whole: see [Note: token file format]. Reads the file once.

    Raises:
        ValueError: not a token file, another version, a dtype other than uint8 / uint16 /
            uint32, a length that is not the header's count of that dtype (another dtype,
            or truncated), a header that contradicts itself, a checksum that does not
            match (an edited header or damaged ids), or an id outside the vocabulary.
    """
    path = Path(path)
    fix = _FIX
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(HEADER_BYTES)
    if len(head) < HEADER_BYTES or head[: len(MAGIC)] != MAGIC:
        raise ValueError(f"token file: '{path}' is not a raggedfsdp token file; {fix}")
    magic, version, _, dtype, count, val_start, vocab, docs, _, digest, checksum = _HEADER.unpack(
        head
    )
    if version != VERSION:
        raise ValueError(
            f"token file: '{path}' is of version {version}; this raggedfsdp reads version "
            f"{VERSION}; {fix}"
        )
    dtype = dtype.rstrip(b"\0").decode("ascii", "replace")
    if dtype not in TOKEN_DTYPES:
        raise ValueError(
            f"token file: '{path}' holds {dtype} ids; expected one of "
            f"{', '.join(TOKEN_DTYPES)}; {fix}"
        )
    itemsize = np.dtype(dtype).itemsize
    if size != HEADER_BYTES + count * itemsize:
        raise ValueError(
            f"token file: '{path}' is {size} bytes, but its header says {count} {dtype} ids "
            f"({HEADER_BYTES + count * itemsize} bytes with the header): ids of another dtype, "
            f"or a truncated file; {fix}"
        )
    if val_start > count or vocab < 1 or vocab - 1 > np.iinfo(dtype).max:
        raise ValueError(
            f"token file: '{path}' has a damaged header (val_start {val_start}, count {count}, "
            f"vocab_size {vocab}, dtype {dtype}); {fix}"
        )
    little = np.dtype(dtype).newbyteorder("<")
    if count:
        ids = np.memmap(path, dtype=little, mode="c", offset=HEADER_BYTES, shape=(count,))
    else:  # numpy cannot map zero bytes
        ids = np.zeros(0, dtype=little)
    if _checksum(_ids_digest(ids), head) != checksum:
        raise ValueError(
            f"token file: '{path}' does not match its checksum: its header or its ids were "
            f"changed after it was written (an edit, a damaged disk); {fix}"
        )
    check_ids(ids, vocab, f"token file: '{path}'", fix)
    if not ids.dtype.isnative:  # a big-endian machine reads a copy
        ids = ids.astype(ids.dtype.newbyteorder("="))
    ids = torch.from_numpy(ids)  # 1-D, count ids
    return TokenFile(
        train=ids[:val_start],
        val=ids[val_start:],
        vocab_size=vocab,
        documents=docs,
        tokenizer=digest,
    )


class TokenFileWriter:
    """Write a token file as documents come: training ids go to the file, validation ids
    to a second one, appended at ``close``; the file appears whole or not at all. Both
    are written under hidden names unique to this process (``staging_path``), which no
    folder reader takes as input: see [Note: a command holds its output] in
    ``raggedfsdp/train/outputs.py``.

    Args:
        path: the token file.
        tokenizer: what made the ids (its ``vocab_size``, ``digest`` and ``name``).
        val_fraction: the share of ids that is validation when the documents put all of
            theirs on one side (``split_point``).

    Example::

        with TokenFileWriter(path, tok, val_fraction=0.1) as w:
            w.write(tok.encode([text]), val=False)
    """

    def __init__(self, path: str | os.PathLike, tokenizer, *, val_fraction: float) -> None:
        from raggedfsdp.checkpoint.files import staging_path

        self.path = Path(path)
        self.vocab_size = tokenizer.vocab_size
        self.digest = tokenizer.digest
        self.source = getattr(tokenizer, "name", "the tokenizer")
        self.dtype = token_dtype(self.vocab_size).newbyteorder("<")
        self.val_fraction = val_fraction
        self.counts = [0, 0]  # training, validation ids
        self.documents = 0
        self.val_start: int | None = None  # set by close
        self._train_path = staging_path(self.path, "tmp")
        self._val_path = staging_path(self.path, "val.tmp")
        self._hash = hashlib.sha256()  # of the ids, in the file's order
        self._train = open(self._train_path, "wb")
        self._val = open(self._val_path, "wb")
        self._train.write(bytes(HEADER_BYTES))  # filled in at close

    def write(self, ids: np.ndarray, *, val: bool, documents: int = 1) -> None:
        """Append ``ids`` (1-D) of ``documents`` documents to one split.

        Raises:
            ValueError: an id outside ``[0, vocab_size)`` (it would wrap in the dtype).
        """
        check_ids(
            np.asarray(ids),
            self.vocab_size,
            f"tokenize: '{self.source}'",
            "its ids must lie below its vocabulary: fix the tokenizer",
        )
        raw = ids.astype(self.dtype, copy=False).tobytes()
        if not val:
            self._hash.update(raw)
        (self._val if val else self._train).write(raw)
        self.counts[val] += ids.size
        self.documents += documents

    def close(self) -> int:
        """Finish the file; returns its ``val_start`` (also ``self.val_start``).

        Raises:
            ValueError: fewer than 2 ids in all (one is needed in each split).
        """
        try:
            self._val.close()
            with open(self._val_path, "rb") as f:
                while chunk := f.read(1 << 24):
                    self._train.write(chunk)
                    self._hash.update(chunk)
            train, val = self.counts
            count = train + val
            if count < 2:
                raise ValueError(
                    f"tokenize: the input holds {count} ids (at least 2 needed, one per "
                    "split); give more text"
                )
            val_start = train if train and val else split_point(count, self.val_fraction)
            fields = [
                MAGIC,
                VERSION,
                0,
                self.dtype.name.encode(),
                count,
                val_start,
                self.vocab_size,
                self.documents,
                0,
                self.digest,
            ]
            header = _HEADER.pack(*fields, bytes(32))
            header = _HEADER.pack(*fields, _checksum(self._hash.digest(), header))
            self._train.seek(0)
            self._train.write(header)
            self._train.flush()
            os.fsync(self._train.fileno())
            self._train.close()
            os.replace(self._train_path, self.path)
            self.val_start = val_start
            return val_start
        finally:
            self.abort()

    def abort(self) -> None:
        """Drop what was written (nothing of ``path`` is left unless ``close`` finished)."""
        for f in (self._train, self._val):
            f.close()
        for p in (self._train_path, self._val_path):
            p.unlink(missing_ok=True)

    def __enter__(self) -> TokenFileWriter:
        return self

    def __exit__(self, kind, *_) -> None:
        if kind is None:
            self.close()
        else:
            self.abort()
