"""``python -m raggedfsdp train`` end to end (2 gloo ranks, forked by
``tests.harness.train_cli``): a run split in two jobs by a checkpoint gives the
per-step losses and validation losses of the run in one job, bit for bit: the same
ranks and layout do the same arithmetic, so any difference is a lost or changed bit of
state (see [Note: derived tolerances] in ``tests/numerics.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.harness import train_cli

pytestmark = pytest.mark.numerics  # bit for bit on any kernels: `make test-numerics` too

COMMON = [
    "--model", "moe-tiny", "--nproc", "2", "--steps", "6", "--batch-size", "4",
    "--seq-len", "16", "--max-bytes", "300000", "--val-every", "3", "--val-batches", "1",
    "--optim", "flat-adamw", "--no-progress", "--no-plot",
]  # fmt: skip


def _train(out: Path, *extra: str) -> None:
    train_cli([*COMMON, "--out", str(out), *extra])


def _losses(out: Path) -> dict[int, tuple[float, float | None]]:
    """step -> (loss, validation loss or None)."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: (r["loss"], r.get("val_loss")) for r in rows}


def test_resume_gives_the_uninterrupted_losses(tmp_path):
    whole, split = tmp_path / "whole", tmp_path / "split"
    _train(whole)
    _train(split, "--ckpt-every", "100", "--stop-after", "3")  # a job that ends at step 3
    assert sorted(_losses(split)) == [0, 1, 2]
    _train(split, "--ckpt-every", "100", "--resume")
    a, b = _losses(whole), _losses(split)
    assert sorted(b) == list(range(6))
    assert [a[s][1] is not None for s in range(6)] == [False, False, True] * 2
    for step in range(6):
        assert a[step] == b[step], (step, a, b)  # bit for bit (JSON keeps every bit)
    summary = json.loads((whole / "summary.json").read_text())
    for key in ("tokens_per_s", "peak_memory_bytes_max_rank", "all_gather_bytes", "padding_ratio"):
        assert summary[key] > 0, key
    assert summary["copied_bytes_fsdp"] == 0  # fp32: nothing copied around collectives
