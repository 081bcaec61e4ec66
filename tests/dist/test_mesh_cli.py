"""``python -m raggedfsdp train --mesh dp=2,tp=2`` and ``--mesh ep=2`` end to end (4
gloo ranks forked by ``tests.harness.train_cli``; moe-small: 6 query / 2 key-value heads
split over tp 2, its dense first block's feed-forward too; 6 experts split over ep 2).
One job trains two steps on the FSDP x TP mesh and saves; a second resumes that
checkpoint on the FSDP x EP mesh, its experts laid out with member gaps (the checkpoint
reshards across meshes and layouts). Every step's loss and validation loss lies within
a bound of the 4-rank 1-D FSDP run's (fp32, AdamW, clipping on), derived from that run's
own sensitivity: a rerun with nudged gradients ([Note: derived tolerances] in
``tests/numerics.py``). See [Note: mesh specs] in ``raggedfsdp/models/parallelize.py``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.dist.test_hsdp_cli import assert_records_match, series
from tests.harness import train_cli
from tests.numerics import from_runs

pytestmark = pytest.mark.numerics

COMMON = [
    "--model", "moe-small", "--nproc", "4", "--steps", "4", "--batch-size", "8",
    "--seq-len", "16", "--max-bytes", "300000", "--val-every", "2", "--val-batches", "1",
    "--no-progress", "--no-plot",
]  # fmt: skip


def _train(out: Path, *extra: str, nudge_seed: int | None = None) -> dict:
    train_cli([*COMMON, "--out", str(out), *extra], nudge_seed=nudge_seed)
    return json.loads((out / "summary.json").read_text())


def _records(out: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows}


def test_tp_then_ep_train_equals_fsdp_and_resumes_across_meshes(tmp_path):
    flat, nudged, mesh = tmp_path / "flat", tmp_path / "nudged", tmp_path / "mesh"
    s_flat = _train(flat)
    _train(nudged, nudge_seed=1)  # the reference's own sensitivity: one nudged run
    ref = from_runs(series(_records(flat)), [series(_records(nudged))])
    s_tp = _train(mesh, "--mesh", "tp=2", "--ckpt-every", "100", "--stop-after", "2")
    assert sorted(_records(mesh)) == [0, 1]
    # the EP job lays its experts out with member gaps, each group in at most 2 buffers
    gapped = ["--member-gaps", "always", "--max-buffers", "2"]
    s_ep = _train(mesh, "--mesh", "ep=2", "--ckpt-every", "100", "--resume", *gapped)
    b = _records(mesh)
    assert sorted(b) == list(range(4)) and [s for s in b if "val_loss" in b[s]] == [1, 3]
    assert_records_match(b, ref, world=4, what="TP (steps 0-1), EP (2-3) vs 1-D FSDP: ")
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
        # no hook reads a parameter in backward: every buffer wrote gradients in place
        assert (s["grads_in_params_buffers"], s["grad_storage_reasons"]) == (s["buffers"], {})
