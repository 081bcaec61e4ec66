"""``python -m raggedfsdp train --mesh replicate=2,shard=2`` end to end (4 gloo ranks
forked by ``tests.harness.train_cli``): HSDP gives the per-step losses of the 4-rank 1-D
FSDP run, through a checkpoint saved and resumed on the HSDP mesh, and its measured step
all-reduces one shard of gradients per group over the replicate dim (see [Note: HSDP in
the plan])."""

from __future__ import annotations

import json
from pathlib import Path

from raggedfsdp.models import get_config
from raggedfsdp.models.transformer import Transformer
from tests.harness import train_cli

COMMON = [
    "--model", "moe-tiny", "--nproc", "4", "--steps", "4", "--batch-size", "8",
    "--seq-len", "16", "--max-bytes", "300000", "--val-every", "2", "--val-batches", "1",
    "--no-progress", "--no-plot",
]  # fmt: skip
HSDP = ["--mesh", "replicate=2,shard=2"]


def _train(out: Path, *extra: str) -> None:
    train_cli([*COMMON, "--out", str(out), *extra])


def _records(out: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows}


def test_hsdp_train_equals_fsdp_and_resumes(tmp_path):
    flat, hsdp = tmp_path / "flat", tmp_path / "hsdp"
    _train(flat)
    _train(hsdp, *HSDP, "--ckpt-every", "100", "--stop-after", "2")  # a job that ends at step 2
    assert sorted(_records(hsdp)) == [0, 1]
    _train(hsdp, *HSDP, "--ckpt-every", "100", "--resume")  # resumed on the HSDP mesh
    a, b = _records(flat), _records(hsdp)
    assert sorted(b) == list(range(4))
    for step in range(4):
        for key in ("loss", "val_loss") if step in (1, 3) else ("loss",):
            assert abs(a[step][key] - b[step][key]) <= 1e-5, (step, key, a[step], b[step])
    s_flat = json.loads((flat / "summary.json").read_text())
    s_hsdp = json.loads((hsdp / "summary.json").read_text())
    assert (s_flat["mesh"], s_hsdp["mesh"]) == (None, "replicate=2,shard=2")
    # The measured step all-reduces, over the replicate dim, each group's reduced shard
    # gradients (S elements: half the reduce-scatter's 2 S input; 3 groups: two blocks and
    # the root) and the got-a-gradient flags (one byte per parameter; see fsdp/_state.py).
    flags = len(list(Transformer(get_config("moe-tiny"), max_seq_len=16).parameters()))
    assert s_hsdp["all_reduce_count"] - s_flat["all_reduce_count"] in (3, 4)
    extra = s_hsdp["all_reduce_bytes"] - s_flat["all_reduce_bytes"]
    assert 0 <= extra - s_hsdp["reduce_scatter_bytes"] // 2 <= flags
    assert s_hsdp["copied_bytes_fsdp"] == 0  # fp32: nothing copied around collectives
