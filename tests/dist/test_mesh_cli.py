"""``python -m raggedfsdp train --mesh dp=2,tp=2`` and ``--mesh ep=2`` end to end (4
gloo ranks forked by ``tests.harness.train_cli``; moe-small: 6 query / 2 key-value heads
split over tp 2, its dense first block's feed-forward too; 6 experts split over ep 2).
One job trains two steps on the FSDP x TP mesh and saves; a second resumes that
checkpoint on the FSDP x EP mesh, its experts laid out with member gaps (the checkpoint
reshards across meshes and layouts). Every step's
loss and validation loss equals the 4-rank 1-D FSDP run's within 1e-5 (fp32, AdamW,
clipping on). See [Note: train meshes] in ``raggedfsdp/train/_checks.py``."""

from __future__ import annotations

import json
from pathlib import Path

from tests.harness import train_cli

COMMON = [
    "--model", "moe-small", "--nproc", "4", "--steps", "4", "--batch-size", "8",
    "--seq-len", "16", "--max-bytes", "300000", "--val-every", "2", "--val-batches", "1",
    "--no-progress", "--no-plot",
]  # fmt: skip


def _train(out: Path, *extra: str) -> dict:
    train_cli([*COMMON, "--out", str(out), *extra])
    return json.loads((out / "summary.json").read_text())


def _records(out: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows}


def test_tp_then_ep_train_equals_fsdp_and_resumes_across_meshes(tmp_path):
    flat, mesh = tmp_path / "flat", tmp_path / "mesh"
    s_flat = _train(flat)
    s_tp = _train(mesh, "--mesh", "tp=2", "--ckpt-every", "100", "--stop-after", "2")
    assert sorted(_records(mesh)) == [0, 1]
    # the EP job lays its experts out with member gaps, each group in at most 2 buffers
    gapped = ["--member-gaps", "always", "--max-buffers", "2"]
    s_ep = _train(mesh, "--mesh", "ep=2", "--ckpt-every", "100", "--resume", *gapped)
    a, b = _records(flat), _records(mesh)
    assert sorted(b) == list(range(4))
    for step in range(4):
        for key in ("loss", "val_loss") if step in (1, 3) else ("loss",):
            assert abs(a[step][key] - b[step][key]) <= 1e-5, (step, key, a[step], b[step])
    assert (s_flat["mesh"], s_flat["mesh_dims"]) == (None, None)
    assert (s_tp["mesh"], s_tp["mesh_dims"]) == ("dp=2,tp=2", {"dp": 2, "tp": 2})
    assert (s_ep["mesh"], s_ep["mesh_dims"]) == ("dp=4,ep=2", {"dp_mod_ep": 2, "ep": 2})
    # moe-small: 3 MoE layers of 3 stacks, 3 experts each on an ep rank
    assert (s_flat["gapped_stacks"], s_tp["gapped_stacks"], s_ep["gapped_stacks"]) == (0, 0, 9)
    for s in (s_flat, s_tp):
        assert 0 <= s["padding_ratio"] < 0.01, s["padding_ratio"]
    assert 0 <= s_ep["padding_ratio"] < 0.05, s_ep["padding_ratio"]  # gaps forced: padding
    for s in (s_flat, s_tp, s_ep):
        assert s["copied_bytes_fsdp"] == 0  # fp32: nothing copied around collectives
