"""``python -m raggedfsdp tokenize``: text, a folder or JSON-lines into a token file.

Examples::

    python -m raggedfsdp tokenize corpus/ --tokenizer tok/ --out corpus.tok
    python -m raggedfsdp tokenize docs.jsonl --out docs.tok        # byte-level ids
    python -m raggedfsdp train --data corpus.tok --model llama-tiny

The input is read as ``train --data`` reads it (``raggedfsdp.train.data.iter_documents``:
a ``*.jsonl`` or ``*.json`` file gives one document per record, its ``"text"`` field), each document
goes to training or validation by the hash of its name, as in ``train``, and its ids are
streamed to the file, so memory holds one batch of documents at a time. The same input,
tokenizer and ``--max-bytes`` give the ids ``train --data INPUT --tokenizer DIR`` would
encode itself. The file's format: [Note: token file format] in ``raggedfsdp/train/tokens.py``.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

from raggedfsdp.train.data import DataConfig, data_files, head, is_json, is_val, iter_documents
from raggedfsdp.train.outputs import OutputLock, check_not_input
from raggedfsdp.train.tokens import (
    TokenFileWriter,
    is_token_file,
    load_tokenizer,
    tokenizer_file,
)

BATCH_BYTES = 1 << 20  # text encoded per call of the tokenizer


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m raggedfsdp tokenize",
        description='Encode text files, a folder or JSON-lines (a "text" field a line) into '
        "a memory-mapped token file for train --data, split into training and validation.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "input",
        help="a text file, a JSON-lines file (*.jsonl, *.json), a pipe (read once) or a folder "
        "of them",
    )
    p.add_argument("--out", required=True, help="the token file to write")
    p.add_argument(
        "--tokenizer",
        default=None,
        metavar="DIR",
        help="a folder holding a tokenizer.json (Hugging Face tokenizers); None: byte-level "
        "ids 0..255",
    )
    p.add_argument(
        "--max-bytes", type=int, default=None, help="bytes of text to read; None: all of it"
    )
    p.add_argument(
        "--val-fraction",
        type=float,
        default=0.1,
        help="share of the documents held out for validation (train --data reads 0.1)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def _check(args) -> DataConfig:
    """Everything that can be refused before a byte is written."""
    if is_token_file(args.input):
        raise ValueError(
            f"tokenize: '{args.input}' is a token file already; pass the text it came from"
        )
    if args.max_bytes is not None and args.max_bytes < 2:
        raise ValueError(f"tokenize: --max-bytes must be >= 2, got {args.max_bytes}")
    if not 0.0 < args.val_fraction < 1.0:
        raise ValueError(f"tokenize: --val-fraction must be in (0, 1), got {args.val_fraction}")
    source = Path(args.input)
    tokenizer = None if args.tokenizer is None else tokenizer_file(args.tokenizer)
    check_not_input(args.out, [("input", args.input), ("--tokenizer", tokenizer)], who="tokenize")
    _check_out(args)
    if not source.is_dir() and source.exists() and not is_json(source):
        if b"\0" in head(source):  # a pipe is read here, once
            raise ValueError(
                f"tokenize: '{source}' is not text (it holds NUL bytes: a binary file?); "
                "pass a text file, a JSON-lines file or a folder (whose binary files are "
                "skipped)"
            )
    if not args.no_progress and importlib.util.find_spec("tqdm") is None:
        raise ValueError(
            "tokenize: the progress bar needs tqdm, which is not installed; install the "
            "application's extra (pip install 'raggedfsdp[train]') or pass --no-progress"
        )
    config = DataConfig(
        path=args.input,
        max_bytes=args.max_bytes,
        val_fraction=args.val_fraction,
        tokenizer=args.tokenizer,
    )
    data_files(config)  # the input exists
    return config


def _check_out(args) -> None:
    out = Path(args.out)
    if out.is_dir():
        raise ValueError(f"tokenize: --out '{out}' is a folder; pass a file name")
    if out.exists() and not args.overwrite:
        raise ValueError(
            f"tokenize: --out '{out}' exists; pass --overwrite to replace it, or another --out"
        )
    if not out.parent.is_dir():
        raise ValueError(f"tokenize: the folder of --out '{out}' does not exist; create it")


def tokenize(config: DataConfig, out: str | Path, *, progress: bool = False) -> dict:
    """Encode ``config``'s documents into the token file ``out``.

    Args:
        config: the input, ``max_bytes``, ``val_fraction`` and tokenizer.
        out: the token file; written whole or not at all.
        progress: show a progress bar over the input's bytes. Default False.

    Returns:
        What was written: ``tokens``, ``train``, ``val``, ``documents``, ``files``,
        ``vocab_size``, ``dtype``.

    Raises:
        ValueError: a bad input or tokenizer, or fewer than 2 ids in all.
    """
    tokenizer = load_tokenizer(config.tokenizer)
    _, files = data_files(config)
    total = sum(p.stat().st_size for p in files)  # input bytes; the bar counts them read
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=total, unit="B", unit_scale=True, desc="tokenize", file=sys.stderr)
    seen_files: set[int] = set()
    pending: list[list[bytes]] = [[], []]  # training, validation texts not encoded yet
    pending_bytes = [0, 0]
    with TokenFileWriter(out, tokenizer, val_fraction=config.val_fraction) as writer:

        def flush(side: int) -> None:
            if pending[side]:
                ids = tokenizer.encode(pending[side])
                writer.write(ids, val=bool(side), documents=len(pending[side]))
                pending[side], pending_bytes[side] = [], 0

        for doc in iter_documents(config):
            seen_files.add(doc.file)
            side = int(is_val(doc.key, config.val_fraction))
            pending[side].append(doc.text)
            pending_bytes[side] += len(doc.text)
            if pending_bytes[side] >= BATCH_BYTES:
                flush(side)
            if bar is not None:
                bar.update(doc.size)
        flush(0)
        flush(1)
    if bar is not None:
        bar.update(bar.total - bar.n)  # what was not read: binary files, past --max-bytes
        bar.close()
    tokens = sum(writer.counts)
    return {
        "tokens": tokens,
        "train": writer.val_start,
        "val": tokens - writer.val_start,
        "documents": writer.documents,
        "files": len(seen_files),
        "vocab_size": tokenizer.vocab_size,
        "dtype": writer.dtype.name,
    }


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = _check(args)
        load_tokenizer(args.tokenizer)  # a bad tokenizer is refused before the bar starts
        # one writer per --out: see [Note: a command holds its output]
        with OutputLock(args.out, who="tokenize"):
            _check_out(args)  # again, holding it: another tokenize may have written it since
            done = tokenize(config, args.out, progress=not args.no_progress)
    except ValueError as e:
        parser.error(str(e))
    print(
        f"tokenize: wrote {done['tokens']:,} ids ({done['train']:,} training, {done['val']:,} "
        f"validation; {done['dtype']}, vocabulary {done['vocab_size']}) of {done['documents']:,} "
        f"documents in {done['files']} files to {args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
