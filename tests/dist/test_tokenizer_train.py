"""``python -m raggedfsdp train --tokenizer DIR`` end to end on 2 gloo ranks (forked by
``tests.harness.train_cli``): a BPE tokenizer trained here on the default text, JSON-lines
data written here; the loss falls, and the token file ``tokenize`` writes of the same data
trains to the same losses, bit for bit (the same ids, ranks and arithmetic)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from raggedfsdp.cli import tokenize as tokenize_command
from raggedfsdp.train.data import DataConfig, iter_documents
from tests.harness import train_cli
from tests.unit.test_tokenize import train_bpe, write_jsonl

pytest.importorskip("tokenizers")

COMMON = [
    "--model", "llama-tiny", "--nproc", "2", "--steps", "12", "--batch-size", "8",
    "--seq-len", "32", "--lr", "1e-2", "--warmup", "2", "--val-every", "6",
    "--val-batches", "1", "--no-progress", "--no-plot",
]  # fmt: skip


def _losses(out: Path) -> list[float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in sorted(rows, key=lambda r: r["step"])]


def test_train_with_a_tokenizer_on_jsonl_and_on_its_token_file(tmp_path):
    tok = train_bpe(tmp_path / "tok", 500)
    # paragraphs of the standard library's sources, one record each
    text = b"".join(d.text for d in iter_documents(DataConfig(max_bytes=150_000))).decode()
    paragraphs = [p for p in text.split("\n\n") if p.strip()]
    data = write_jsonl(tmp_path / "data.jsonl", paragraphs)

    train_cli([*COMMON, "--tokenizer", str(tok), "--data", str(data), "--out", str(tmp_path / "a")])
    losses = _losses(tmp_path / "a")
    assert len(losses) == 12
    first, last = sum(losses[:2]) / 2, sum(losses[-2:]) / 2
    assert last < first - 1.0, losses  # from about ln(1001) = 6.9

    tokens = tmp_path / "data.tok"
    assert tokenize_command.main([str(data), "--tokenizer", str(tok), "--out", str(tokens),
                                  "--max-bytes", str(8 << 20), "--no-progress"]) == 0  # fmt: skip
    train_cli([*COMMON, "--data", str(tokens), "--out", str(tmp_path / "b")])
    assert _losses(tmp_path / "b") == losses  # bit for bit
