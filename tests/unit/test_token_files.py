"""The token-file reader against edited files ([Note: token file format] in
``raggedfsdp/train/tokens.py``): a valid file round-trips; any edit of its header or ids is
refused by ``read_token_file`` (which ``train`` runs before a rank starts) or reads as the
same ids; nothing else (an ``IndexError``, a wrong split) ever comes out."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from raggedfsdp.train.tokens import HEADER_BYTES, TokenFileWriter, read_token_file


class _Tokenizer:
    """What the writer reads of a tokenizer."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.digest = bytes(range(32))
        self.name = f"a {vocab_size}-id tokenizer"


def _write(path: Path, vocab: int, train: np.ndarray, val: np.ndarray) -> None:
    with TokenFileWriter(path, _Tokenizer(vocab), val_fraction=0.25) as w:
        w.write(train, val=False)
        w.write(val, val=True)


@st.composite
def _files(draw):
    vocab = draw(st.sampled_from([2, 255, 256, 257, 65_536, 65_537, 1 << 20]))
    ids = st.integers(0, vocab - 1)
    train = draw(st.lists(ids, min_size=1, max_size=40))
    val = draw(st.lists(ids, min_size=1, max_size=20))
    return vocab, np.array(train, dtype=np.int64), np.array(val, dtype=np.int64)


_SETTINGS = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@_SETTINGS
@given(_files())
def test_a_valid_file_round_trips(tmp_path, case):
    vocab, train, val = case
    path = tmp_path / "x.tok"
    _write(path, vocab, train, val)
    t = read_token_file(path)
    assert t.train.tolist() == train.tolist() and t.val.tolist() == val.tolist()
    assert t.vocab_size == vocab and t.documents == 2 and t.tokenizer == bytes(range(32))


@_SETTINGS
@given(_files(), st.data())
def test_an_edited_file_is_refused_or_reads_the_same_ids(tmp_path, case, data):
    vocab, train, val = case
    path = tmp_path / "x.tok"
    _write(path, vocab, train, val)
    good = path.read_bytes()
    edits = data.draw(
        st.lists(
            st.tuples(st.integers(0, len(good) - 1), st.integers(0, 255)), min_size=1, max_size=4
        )
    )
    raw = bytearray(good)
    for offset, value in edits:
        raw[offset] = value
    cut = data.draw(st.sampled_from([len(raw), len(raw) - 1, HEADER_BYTES]))
    path.write_bytes(bytes(raw[:cut]))
    try:
        t = read_token_file(path)
    except ValueError as e:
        assert f"'{path}'" in str(e) and "tokenize" in str(e)  # names the file and the fix
        return
    assert bytes(raw[:cut]) == good  # only an edit that changed nothing reads
    assert t.train.tolist() == train.tolist() and t.val.tolist() == val.tolist()


def test_a_self_consistent_header_edit_is_refused(tmp_path):
    """uint16 relabelled uint32 with the count halved; the vocabulary lowered below the
    ids; val_start moved: each header agrees with the file's length."""
    path = tmp_path / "x.tok"
    _write(path, 500, np.arange(300) % 500, np.arange(100) % 500)
    good = path.read_bytes()
    count = 400

    def patched(offset: int, raw: bytes) -> None:
        data = bytearray(good)
        data[offset : offset + len(raw)] = raw
        path.write_bytes(bytes(data))

    def refused(match: str) -> None:
        with pytest.raises(ValueError, match=match):
            read_token_file(path)

    data = bytearray(good)
    data[16:24] = b"uint32\0\0"
    data[24:32] = struct.pack("<Q", count // 2)
    data[32:40] = struct.pack("<Q", 150)
    data[40:48] = struct.pack("<Q", 1 << 32)
    path.write_bytes(bytes(data))
    refused(r"'.*x.tok' does not match its checksum: its header or its ids were changed")
    patched(40, struct.pack("<Q", 200))  # ids up to 499
    refused(r"does not match its checksum")
    patched(32, struct.pack("<Q", 10))  # another split
    refused(r"does not match its checksum")
    patched(HEADER_BYTES + 2, b"\xff")  # an id
    refused(r"does not match its checksum")
    path.write_bytes(good)
    t = read_token_file(path)
    assert t.train.tolist() == list(range(300)) and t.train.dtype == torch.uint16
