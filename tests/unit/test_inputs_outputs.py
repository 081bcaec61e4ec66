"""What ``tokenize``, ``train`` and ``export`` read and write: nothing a user owns is an
output, one writer per output, no temporary file is ever input, ids are checked against
their dtype and vocabulary, JSON is parsed, pipes are read once or refused, a tokenizer
that cannot encode is named ([Note: a command holds its output] in
``raggedfsdp/train/outputs.py``, [Note: token file format] in ``raggedfsdp/train/tokens.py``).
"""

from __future__ import annotations

import json
import os
import re
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from raggedfsdp.cli import tokenize as tokenize_command
from raggedfsdp.cli import train as train_command
from raggedfsdp.train.data import DataConfig, iter_documents, load_corpus
from raggedfsdp.train.outputs import OutputLock
from raggedfsdp.train.tokens import TokenFileWriter, load_tokenizer, read_token_file
from tests.unit.test_tokenize import SMALL_VOCAB, train_bpe, write_jsonl

pytest.importorskip("tokenizers")

TEXT = "def f(x):\n    return x + 1\n" * 40
TRAIN = [
    "--model", "llama-tiny", "--nproc", "1", "--batch-size", "2", "--seq-len", "8",
    "--max-bytes", "100000", "--no-progress", "--no-plot",
]  # fmt: skip


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Path:
    return train_bpe(tmp_path_factory.mktemp("tok"), SMALL_VOCAB, max_bytes=60_000)


def _usage_error(main, argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    return capsys.readouterr().err


def _no_ranks(args):
    raise AssertionError(f"ranks were started (--out {args.out})")


def _train_refused(argv: list[str], capsys) -> str:
    return _usage_error(lambda a: train_command.main(a, launch=_no_ranks), [*TRAIN, *argv], capsys)


def _corpus(folder: Path, n: int = 6) -> Path:
    folder.mkdir()
    for i in range(n):
        (folder / f"f{i}.py").write_text(TEXT.replace("1", str(i)))
    return folder


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


# ---- data lost ----------------------------------------------------------------------------------
def test_an_input_is_never_an_output(tmp_path, capsys):
    """tokenize X --out X --overwrite, an --out inside a folder input (tokenize and train):
    refused before anything is written, the input as it was."""
    text = tmp_path / "a.txt"
    text.write_text(TEXT)
    err = _usage_error(
        tokenize_command.main,
        [str(text), "--out", str(text), "--overwrite", "--no-progress"],
        capsys,
    )
    assert re.search(r"--out '.*a.txt' is the input input '.*a.txt' itself: writing it would "
                     r"destroy the input; pass another --out", err), err  # fmt: skip
    assert text.read_text() == TEXT
    corpus = _corpus(tmp_path / "corpus")
    before = _snapshot(corpus)
    err = _usage_error(
        tokenize_command.main,
        [str(corpus), "--out", str(corpus / "x.tok"), "--no-progress"],
        capsys,
    )
    assert re.search(r"--out '.*x.tok' is inside the input folder input '.*corpus': the next "
                     r"read of that folder would take it in", err), err  # fmt: skip
    err = _train_refused(["--data", str(corpus), "--out", str(corpus / "run")], capsys)
    assert re.search(r"train: --out '.*run' is inside the input folder --data", err), err
    assert _snapshot(corpus) == before


def test_two_tokenize_on_one_out_one_is_refused_nothing_lost(tmp_path, tok, capsys, monkeypatch):
    """While one tokenize writes --out, a second one on it is refused (naming the first's
    pid); the first's file is whole; neither leaves a temporary or lock file."""
    src = tmp_path / "a.txt"
    src.write_text(TEXT * 5)
    out = tmp_path / "a.tok"
    inside, go_on = threading.Event(), threading.Event()
    real = tokenize_command.tokenize

    def slow(*args, **kwargs):  # the first job pauses while it writes, holding --out
        inside.set()
        assert go_on.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(tokenize_command, "tokenize", slow)
    argv = [str(src), "--out", str(out), "--tokenizer", str(tok), "--overwrite", "--no-progress"]
    first = threading.Thread(target=tokenize_command.main, args=(argv,))
    first.start()
    assert inside.wait(30)
    monkeypatch.setattr(tokenize_command, "tokenize", real)
    err = _usage_error(tokenize_command.main, argv, capsys)
    assert re.search(rf"another live process \(pid {os.getpid()}\) is writing --out '.*a.tok'; "
                     r"wait for it to end, or pass another --out", err), err  # fmt: skip
    go_on.set()
    first.join(30)
    t = read_token_file(out)
    want = load_corpus(DataConfig(path=str(src), tokenizer=str(tok)))
    assert torch.equal(t.train, want.train) and torch.equal(t.val, want.val)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.tok", "a.txt"]


def test_a_held_output_lock_is_taken_over_once_released(tmp_path):
    """The lock file is removed on release; a second holder then takes a fresh one."""
    out = tmp_path / "x.tok"
    with OutputLock(out, who="tokenize"):
        with pytest.raises(ValueError, match=r"another live process \(pid \d+\) is writing"):
            OutputLock(out, who="tokenize").acquire()
    assert not any(tmp_path.iterdir())
    with OutputLock(out, who="tokenize"):
        pass
    with pytest.raises(
        ValueError,
        match=r"tokenize: cannot write beside --out '.*x.tok' \(.*: "
        r"'.*missing/.x.tok.lock'\); pass a --out in a folder you can write",
    ):
        OutputLock(tmp_path / "missing" / "x.tok", who="tokenize").acquire()


# ---- silently wrong -----------------------------------------------------------------------------
def test_a_writers_temporaries_are_never_documents(tmp_path):
    """A tokenize killed half-way leaves only hidden files, which no folder reader takes."""
    corpus = _corpus(tmp_path / "corpus")
    before = load_corpus(DataConfig(path=str(corpus)))
    writer = TokenFileWriter(corpus / "x.tok", load_tokenizer(None), val_fraction=0.1)
    writer.write(np.frombuffer(TEXT.encode(), dtype=np.uint8), val=False)
    writer.write(np.frombuffer(TEXT.encode(), dtype=np.uint8), val=True)
    writer._train.flush(), writer._val.flush()  # as a killed job leaves them
    leftovers = sorted(p.name for p in corpus.iterdir() if not p.name.startswith("f"))
    assert leftovers and all(name.startswith(".") for name in leftovers), leftovers
    after = load_corpus(DataConfig(path=str(corpus)))
    assert torch.equal(after.train, before.train) and torch.equal(after.val, before.val)
    writer.abort()


def _template_tokenizer(src: Path, dst: Path, special_id: int) -> Path:
    """``src``'s tokenizer with a post-processor that appends id ``special_id``."""
    from tokenizers import Tokenizer, processors

    t = Tokenizer.from_file(str(src / "tokenizer.json"))
    t.post_processor = processors.TemplateProcessing(
        single="$A [END]", special_tokens=[("[END]", special_id)]
    )
    dst.mkdir()
    t.save(str(dst / "tokenizer.json"))
    return dst


def test_an_id_outside_the_vocabulary_is_refused_never_wrapped(tmp_path, tok, capsys):
    """A post-processor adding id 70,000 to a 500-id vocabulary: tokenize and train refuse
    it by name (it used to be stored as 70,000 mod 65,536 = 4,464)."""
    bad = _template_tokenizer(tok, tmp_path / "bad", 70_000)
    src = tmp_path / "a.txt"
    src.write_text(TEXT)
    message = (
        r"tokenizer: '.*bad/tokenizer.json' gives id 70,000, outside its vocabulary of 500 ids "
        r"\(0..499\); its post-processor or added tokens name an id its vocabulary lacks"
    )
    out = tmp_path / "a.tok"
    err = _usage_error(
        tokenize_command.main,
        [str(src), "--out", str(out), "--tokenizer", str(bad), "--no-progress"],
        capsys,
    )
    assert re.search(message, err), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "bad"]
    err = _train_refused(
        ["--data", str(src), "--tokenizer", str(bad), "--out", str(tmp_path / "run")], capsys
    )
    assert re.search(message, err), err
    assert not (tmp_path / "run").exists()
    with pytest.raises(ValueError, match=r"tokenize: 'bytes' gives id 256, outside its vocab"):
        with TokenFileWriter(out, load_tokenizer(None), val_fraction=0.1) as w:
            w.write(np.array([1, 256]), val=False)


@pytest.mark.parametrize("name", ["docs.json", "docs.JSONL", "docs.Json"])
def test_json_under_any_name_is_parsed(tmp_path, tok, name):
    """``*.json`` and ``*.JSONL`` are JSON-lines, never text: train and tokenize read the
    records' text (a ``*.json`` file may also be one JSON list of records)."""
    texts = [f"record {i}: x = {i}\n" * 3 for i in range(20)]
    reference = write_jsonl(tmp_path / "ref.jsonl", texts)
    path = tmp_path / name
    path.write_bytes(reference.read_bytes())
    docs = [d.text.decode() for d in iter_documents(DataConfig(path=str(path)))]
    assert docs == texts
    if name.endswith(".json"):
        path.write_text(json.dumps([{"text": t} for t in texts]))
        assert [d.text.decode() for d in iter_documents(DataConfig(path=str(path)))] == texts
        path.write_text(json.dumps({"txt": "a"}))
        with pytest.raises(ValueError, match=r'record 1 of .*docs.json\' has no string "text"'):
            list(iter_documents(DataConfig(path=str(path))))


def test_json_in_a_folder_and_in_tokenize_is_parsed(tmp_path, tok):
    folder = tmp_path / "d"
    folder.mkdir()
    texts = [f"print({i})\n" * 4 for i in range(12)]
    (folder / "A.JSONL").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    out = tmp_path / "d.tok"
    assert tokenize_command.main([str(folder), "--out", str(out), "--no-progress"]) == 0
    t = read_token_file(out)
    joined = bytes(torch.cat([t.train, t.val]).numpy()).decode()
    assert "{" not in joined and sorted(joined.split("print")) == sorted(
        "".join(texts).split("print")
    )


def test_a_tokenizer_that_cannot_encode_is_named(tmp_path, capsys):
    """A WordLevel model without an unknown token meets a word it lacks."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    t = Tokenizer(models.WordLevel({"def": 0, "f": 1}))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    (tmp_path / "wl").mkdir()
    t.save(str(tmp_path / "wl" / "tokenizer.json"))
    src = tmp_path / "a.txt"
    src.write_text(TEXT)
    message = (
        r"tokenizer: '.*wl/tokenizer.json' cannot encode the text \(.*\); a tokenizer must "
        r"encode any text: give its model an unknown token \(unk_token\)"
    )
    err = _usage_error(
        tokenize_command.main,
        [str(src), "--out", str(tmp_path / "a.tok"), "--tokenizer", str(tmp_path / "wl"),
         "--no-progress"],
        capsys,
    )  # fmt: skip
    assert re.search(message, err), err
    err = _train_refused(
        ["--data", str(src), "--tokenizer", str(tmp_path / "wl"), "--out", str(tmp_path / "r")],
        capsys,
    )
    assert re.search(message, err), err


# ---- pipes --------------------------------------------------------------------------------------
def test_a_fifo_without_a_writer_is_refused_at_once(tmp_path, capsys):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    err = _usage_error(
        tokenize_command.main, [str(fifo), "--out", str(tmp_path / "x.tok"), "--no-progress"],
        capsys,
    )  # fmt: skip
    assert re.search(r"is a pipe \(FIFO\) that no program is writing \(or an empty one\): "
                     r"reading it would wait forever", err), err  # fmt: skip
    err = _train_refused(["--data", str(fifo), "--out", str(tmp_path / "run")], capsys)
    assert re.search(r"--data '.*fifo' is a pipe \(a FIFO, or <\(command\)\), which can be read "
                     r"once, but the launcher and every rank read --data", err), err  # fmt: skip
    assert not (tmp_path / "run").exists() and not (tmp_path / "x.tok").exists()


def test_a_pipe_is_tokenized_whole_as_its_file_would_be(tmp_path):
    """``tokenize <(cat a.txt)``: the pipe is read once, every byte of it."""
    src = tmp_path / "a.txt"
    src.write_text(TEXT * 30)  # more than a pipe's buffer
    read, write = os.pipe()

    def feed():
        with os.fdopen(write, "wb") as f:
            f.write(src.read_bytes())

    feeder = threading.Thread(target=feed)
    feeder.start()
    try:
        argv = [f"/dev/fd/{read}", "--out", str(tmp_path / "p.tok"), "--no-progress"]
        assert tokenize_command.main(argv) == 0
    finally:
        feeder.join(30)
        os.close(read)
    assert tokenize_command.main([str(src), "--out", str(tmp_path / "f.tok"), "--no-progress"]) == 0
    a, b = read_token_file(tmp_path / "p.tok"), read_token_file(tmp_path / "f.tok")
    assert torch.equal(a.train, b.train) and torch.equal(a.val, b.val)
    assert a.train.numel() + a.val.numel() == len(TEXT) * 30


# ---- the run's arguments ----------------------------------------------------------------------
def test_resume_without_the_runs_tokenizer_names_it(tmp_path, tok, capsys):
    src = write_jsonl(tmp_path / "d.jsonl", [TEXT] * 20)
    out = tmp_path / "run"
    argv = ["--data", str(src), "--out", str(out)]
    assert train_command.main([*TRAIN, *argv, "--tokenizer", str(tok)], launch=lambda a: 0) == 0
    err = _train_refused([*argv, "--resume"], capsys)
    assert re.search(rf"--resume would change the trajectory of run .*: --tokenizer None \(the "
                     rf"run: '{re.escape(str(tok))}'\)", err), err  # fmt: skip
