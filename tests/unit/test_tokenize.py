"""Tokenizers, token files and ``python -m raggedfsdp tokenize``; the data ``train`` refuses
before any rank starts. The tokenizers are trained here on the default text (the standard
library's sources), in a fraction of a second: nothing is downloaded."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from raggedfsdp.cli import tokenize as tokenize_command
from raggedfsdp.cli import train as train_command
from raggedfsdp.train.data import DataConfig, is_val, iter_documents, load_corpus
from raggedfsdp.train.tokens import (
    HEADER_BYTES,
    TokenFileWriter,
    is_token_file,
    load_tokenizer,
    read_token_file,
)

tokenizers = pytest.importorskip("tokenizers")

SMALL_VOCAB = 500  # fits the tiny models' 1001
LARGE_VOCAB = 1500  # does not


def train_bpe(directory: Path, vocab_size: int, max_bytes: int = 200_000) -> Path:
    """A byte-level BPE tokenizer trained on the default text, saved as
    ``directory/tokenizer.json``; returns ``directory``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    docs = iter_documents(DataConfig(max_bytes=max_bytes))
    texts = [d.text.decode("utf-8", "replace") for d in docs]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    return directory


def write_jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts)))
    return path


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Path:
    return train_bpe(tmp_path_factory.mktemp("tok"), SMALL_VOCAB)


@pytest.fixture(scope="module")
def big_tok(tmp_path_factory) -> Path:
    return train_bpe(tmp_path_factory.mktemp("big_tok"), LARGE_VOCAB, max_bytes=400_000)


def _decode(tok: Path, ids: torch.Tensor) -> str:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tok / "tokenizer.json")).decode(ids.tolist())


def _tokenize(*argv: str) -> None:
    assert tokenize_command.main([*argv, "--no-progress"]) == 0


# ---- the tokenizer and the token file ----------------------------------------------------------
def test_a_tokenizer_file_encodes_as_tokenizers_does(tok):
    tokenizer = load_tokenizer(str(tok))
    assert tokenizer.vocab_size == SMALL_VOCAB
    assert load_tokenizer(str(tok / "tokenizer.json")).digest == tokenizer.digest
    text = "def f(x):\n    return x + 1  # é\n"
    ids = tokenizer.encode([text.encode(), b"", text.encode()])
    assert ids.dtype == np.uint16
    one = tokenizers.Tokenizer.from_file(str(tok / "tokenizer.json")).encode(text).ids
    assert ids.tolist() == one + one
    assert len(one) < len(text.encode())  # merges happened
    assert load_tokenizer(None).encode([b"ab", b"c"]).tolist() == [97, 98, 99]


def test_a_token_file_round_trips_and_is_mapped(tmp_path, tok):
    tokenizer = load_tokenizer(str(tok))
    path = tmp_path / "x.tok"
    with TokenFileWriter(path, tokenizer, val_fraction=0.5) as w:
        w.write(np.array([1, 2, 3]), val=False)
        w.write(np.array([7, 8]), val=True)
        w.write(np.array([4]), val=False, documents=2)
    assert w.val_start == 4 and is_token_file(path) and not is_token_file(tmp_path)
    assert path.stat().st_size == HEADER_BYTES + 6 * 2  # uint16 ids
    t = read_token_file(path)
    assert t.train.tolist() == [1, 2, 3, 4] and t.val.tolist() == [7, 8]
    assert t.train.dtype == torch.uint16
    assert (t.vocab_size, t.documents, t.tokenizer) == (SMALL_VOCAB, 4, tokenizer.digest)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.tok"]  # no temporary left
    # every id on one side: the last val_fraction is validation
    with TokenFileWriter(path, load_tokenizer(None), val_fraction=0.25) as w:
        w.write(np.arange(8), val=True)
    t = read_token_file(path)
    assert (t.train.tolist(), t.val.tolist(), t.train.dtype) == (
        [0, 1, 2, 3, 4, 5],
        [6, 7],
        torch.uint8,
    )


def test_a_failed_write_leaves_nothing(tmp_path):
    path = tmp_path / "x.tok"
    with pytest.raises(ValueError, match=r"the input holds 1 ids \(at least 2 needed"):
        with TokenFileWriter(path, load_tokenizer(None), val_fraction=0.1) as w:
            w.write(np.array([5]), val=False)
    with pytest.raises(RuntimeError):
        with TokenFileWriter(path, load_tokenizer(None), val_fraction=0.1) as w:
            w.write(np.array([5, 6, 7]), val=False)
            raise RuntimeError
    assert list(tmp_path.iterdir()) == []


def _patch(path: Path, offset: int, raw: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(raw)


def test_a_token_file_of_another_dtype_is_refused(tmp_path):
    path = tmp_path / "x.tok"
    with TokenFileWriter(path, load_tokenizer(None), val_fraction=0.5) as w:
        w.write(np.arange(40), val=False)
    good = path.read_bytes()
    _patch(path, 16, b"int64\0\0\0")
    with pytest.raises(ValueError, match=r"holds int64 ids; expected one of uint8, uint16, uint32"):
        read_token_file(path)
    path.write_bytes(good)
    _patch(path, 16, b"uint16\0\0")  # the header says uint16, the ids are uint8
    fix = r"another dtype, or a truncated file; write it again with python -m raggedfsdp tokenize"
    with pytest.raises(ValueError, match=r"but its header says 40 uint16 ids .*" + fix):
        read_token_file(path)
    path.write_bytes(good[:-3])
    with pytest.raises(ValueError, match=r"is 165 bytes, but its header says 40 uint8 ids"):
        read_token_file(path)
    path.write_bytes(good)
    _patch(path, 8, struct.pack("<I", 9))
    with pytest.raises(ValueError, match=r"is of version 9; this raggedfsdp reads version 2"):
        read_token_file(path)


# ---- the tokenize command -------------------------------------------------------------------
def test_tokenize_a_text_file_gives_the_tokenizers_ids(tmp_path, tok):
    text = "".join(d.text.decode() for d in iter_documents(DataConfig(max_bytes=30_000)))
    (tmp_path / "a.txt").write_text(text)
    _tokenize(str(tmp_path / "a.txt"), "--tokenizer", str(tok), "--out", str(tmp_path / "a.tok"))
    t = read_token_file(tmp_path / "a.tok")
    ids = torch.cat([t.train, t.val])
    assert (
        ids.tolist() == tokenizers.Tokenizer.from_file(str(tok / "tokenizer.json")).encode(text).ids
    )
    assert t.val.numel() == round(ids.numel() * 0.1)  # one document: the last tenth
    assert _decode(tok, ids) == text


def test_tokenize_jsonl_splits_by_record(tmp_path, tok):
    texts = [f"record {i}: " + "x = [i * i for i in range(10)]\n" * (i % 3 + 1) for i in range(60)]
    src = write_jsonl(tmp_path / "docs.jsonl", texts)
    out = tmp_path / "docs.tok"
    _tokenize(str(src), "--tokenizer", str(tok), "--out", str(out), "--val-fraction", "0.2")
    t = read_token_file(out)
    val = [is_val(f"docs.jsonl:{i + 1}", 0.2) for i in range(60)]
    assert 0 < sum(val) < 60
    assert _decode(tok, t.train) == "".join(x for x, v in zip(texts, val) if not v)
    assert _decode(tok, t.val) == "".join(x for x, v in zip(texts, val) if v)
    assert t.documents == 60
    # train reads the same ids from the text itself, or from the token file
    for config in (
        DataConfig(path=str(src), tokenizer=str(tok), val_fraction=0.2),
        DataConfig(path=str(out)),
    ):
        corpus = load_corpus(config)
        assert torch.equal(corpus.train, t.train) and torch.equal(corpus.val, t.val)
        assert corpus.vocab_size == SMALL_VOCAB and corpus.unit == "tokens"


def test_tokenize_a_folder_as_train_reads_it(tmp_path, tok, capsys):
    folder = tmp_path / "corpus"
    (folder / "sub").mkdir(parents=True)
    for i in range(12):
        (folder / f"f{i:02d}.py").write_text(f"def f{i}(x):\n    return x * {i}\n" * 20)
    write_jsonl(folder / "sub" / "more.jsonl", [f"print({i})\n" * 5 for i in range(30)])
    (folder / "blob.bin").write_bytes(b"\0\1\2" * 100)  # binary: skipped
    out = tmp_path / "corpus.tok"
    assert tokenize_command.main([str(folder), "--tokenizer", str(tok), "--out", str(out)]) == 0
    printed = capsys.readouterr()
    assert "100%" in printed.err  # the progress bar ran to the end
    assert re.search(r"of 42 documents in 13 files to .*corpus\.tok", printed.out), printed.out
    text = load_corpus(DataConfig(path=str(folder), tokenizer=str(tok), max_bytes=None))
    mapped = load_corpus(DataConfig(path=str(out)))
    assert torch.equal(mapped.train, text.train) and torch.equal(mapped.val, text.val)
    assert text.n_files == 13 and text.val.numel() > 0
    # byte-level, the default: the bytes train reads
    _tokenize(str(folder), "--out", str(tmp_path / "bytes.tok"), "--max-bytes", "2000")
    t = read_token_file(tmp_path / "bytes.tok")
    ref = load_corpus(DataConfig(path=str(folder), max_bytes=2000))
    assert t.train.dtype == torch.uint8 and t.vocab_size == 256
    assert torch.equal(t.train, ref.train) and torch.equal(t.val, ref.val)


@pytest.mark.parametrize(
    "make, argv, match",
    [
        (lambda d: d / "missing.txt", [], r"'.*missing.txt' does not exist"),
        (lambda d: (d / "b.bin").write_bytes(b"\0" * 99) and d / "b.bin", [],
         r"is not text \(it holds NUL bytes"),
        (lambda d: write_jsonl(d / "e.jsonl", ["", ""]), [],
         r"the input holds 0 ids \(at least 2 needed, one per split\)"),
        (lambda d: (d / "j.jsonl").write_text('{"text": "a"}\n{"txt": "b"}\n') and d / "j.jsonl",
         [], r'line 2 of \'.*j.jsonl\' has no string "text" field'),
        (lambda d: (d / "j.jsonl").write_text('{"text": "a"}\nnot json\n') and d / "j.jsonl",
         [], r"line 2 of '.*j.jsonl' is not JSON"),
        (lambda d: (d / "t.txt").write_text("hello") and d / "t.txt", ["--val-fraction", "1"],
         r"--val-fraction must be in \(0, 1\), got 1.0"),
        (lambda d: (d / "t.txt").write_text("hello") and d / "t.txt",
         ["--tokenizer", "/nonexistent/tok"], r"--tokenizer '/nonexistent/tok' does not exist"),
    ],
)  # fmt: skip
def test_tokenize_refuses_bad_input_and_writes_nothing(make, argv, match, tmp_path, capsys):
    src = make(tmp_path)
    out = tmp_path / "out" / "x.tok"
    out.parent.mkdir()
    with pytest.raises(SystemExit) as exit_:
        tokenize_command.main([str(src), "--out", str(out), "--no-progress", *argv])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert re.search(match, err), err
    assert list(out.parent.iterdir()) == []


def test_tokenize_refuses_to_replace_a_file_or_read_a_token_file(tmp_path, capsys):
    (tmp_path / "t.txt").write_text("hello world")
    out = tmp_path / "x.tok"
    _tokenize(str(tmp_path / "t.txt"), "--out", str(out))
    for argv, match in (
        ([str(tmp_path / "t.txt"), "--out", str(out)], r"--out '.*x.tok' exists; pass --overwrite"),
        ([str(out), "--out", str(tmp_path / "y.tok")], r"is a token file already"),
    ):
        with pytest.raises(SystemExit):
            tokenize_command.main([*argv, "--no-progress"])
        assert re.search(match, capsys.readouterr().err)
    _tokenize(str(tmp_path / "t.txt"), "--out", str(out), "--overwrite")


# ---- what train refuses before a rank starts ------------------------------------------------
COMMON = [
    "--model", "llama-tiny", "--nproc", "2", "--batch-size", "4", "--seq-len", "16",
    "--max-bytes", "100000", "--no-progress", "--no-plot",
]  # fmt: skip


def _no_ranks(args):
    raise AssertionError(f"ranks were started (--out {args.out})")


def _refused(tmp_path: Path, argv: list[str], match: str, capsys) -> None:
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_:
        train_command.main([*COMMON, *argv, "--out", str(out)], launch=_no_ranks)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert re.search(match, err), err
    assert not out.exists()  # nothing written


def test_train_refuses_a_tokenizer_larger_than_the_model(tmp_path, big_tok, capsys):
    _refused(
        tmp_path,
        ["--tokenizer", str(big_tok)],
        rf"--tokenizer '.*' has a vocabulary of {LARGE_VOCAB} ids, more than the 1001 of "
        rf"--model llama-tiny's embedding; pass a model with a vocabulary of at least "
        rf"{LARGE_VOCAB}, or a tokenizer of at most 1001 ids",
        capsys,
    )


def test_train_refuses_a_token_file_larger_than_the_model(tmp_path, big_tok, capsys):
    src = write_jsonl(tmp_path / "d.jsonl", ["some text to encode, " * 50] * 20)
    _tokenize(str(src), "--tokenizer", str(big_tok), "--out", str(tmp_path / "d.tok"))
    _refused(
        tmp_path,
        ["--data", str(tmp_path / "d.tok")],
        rf"the token file --data '.*d.tok' has a vocabulary of {LARGE_VOCAB} ids, more than "
        r"the 1001 of --model llama-tiny's embedding",
        capsys,
    )


def test_train_refuses_bad_token_files_and_tokenizers(tmp_path, tok, big_tok, capsys):
    src = write_jsonl(tmp_path / "d.jsonl", ["x = 1\n" * 40] * 20)
    _tokenize(str(src), "--tokenizer", str(tok), "--out", str(tmp_path / "d.tok"))
    # a token file needs no tokenizer; another one is refused
    _refused(
        tmp_path,
        ["--data", str(tmp_path / "d.tok"), "--tokenizer", str(big_tok)],
        r"--data '.*d.tok' holds another tokenizer's ids, not those of --tokenizer",
        capsys,
    )
    good = (tmp_path / "d.tok").read_bytes()
    (tmp_path / "d.tok").write_bytes(good[:16] + b"float32\0" + good[24:])
    _refused(
        tmp_path,
        ["--data", str(tmp_path / "d.tok")],
        r"holds float32 ids; expected one of uint8, uint16, uint32",
        capsys,
    )
    _refused(
        tmp_path,
        ["--tokenizer", str(tmp_path)],
        r"--tokenizer '.*' holds no tokenizer.json; pass a folder with a tokenizer.json",
        capsys,
    )
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "tokenizer.json").write_text("{}")
    _refused(tmp_path, ["--tokenizer", str(tmp_path / "bad")], r"is not a tokenizers file", capsys)


def test_train_refuses_an_empty_split(tmp_path, tok, capsys):
    # a token file whose validation split is shorter than a sequence
    path = tmp_path / "short.tok"
    with TokenFileWriter(path, load_tokenizer(str(tok)), val_fraction=0.1) as w:
        w.write(np.arange(400), val=False)
        w.write(np.arange(5), val=True)
    _refused(
        tmp_path,
        ["--data", str(path)],
        r"the validation split of '.*short.tok' has 5 tokens, fewer than --seq-len \+ 1 = 17; "
        r".* or --val-every 0",
        capsys,
    )
    # JSON-lines whose records hold no text
    src = write_jsonl(tmp_path / "e.jsonl", ["", "", ""])
    _refused(tmp_path, ["--data", str(src)], r"'.*e.jsonl' holds 0 bytes of text", capsys)
    # a binary file names the token files it may have been meant as
    (tmp_path / "ids.bin").write_bytes(np.arange(300, dtype=np.uint16).tobytes())
    _refused(
        tmp_path,
        ["--data", str(tmp_path / "ids.bin")],
        r"is not text .* or a token file written by python -m raggedfsdp tokenize",
        capsys,
    )
