"""``python -m raggedfsdp train --mesh replicate=2,shard=2`` end to end (4 gloo ranks
forked by ``tests.harness.train_cli``): HSDP gives the per-step losses and validation
losses of the 4-rank 1-D FSDP run within the bound derived from that run's own
sensitivity (a rerun with nudged gradients; [Note: derived tolerances] in
``tests/numerics.py``: the two meshes sum gradients in another order), a job resumed on
the HSDP mesh from its step-2 checkpoint (``--resume-from``) redoes its steps 2 and 3
bit for bit, and its measured step all-reduces one shard of gradients per group over
the replicate dim (see [Note: HSDP in the plan])."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from raggedfsdp.models import get_config
from raggedfsdp.models.transformer import Transformer
from tests.harness import train_cli
from tests.numerics import Reference, assert_losses_match, from_runs

pytestmark = pytest.mark.numerics
COMMON = [
    "--model", "moe-tiny", "--nproc", "4", "--steps", "4", "--batch-size", "8",
    "--seq-len", "16", "--max-bytes", "300000", "--val-every", "2", "--val-batches", "1",
    "--no-progress", "--no-plot",
]  # fmt: skip
HSDP = ["--mesh", "replicate=2,shard=2"]


TOKENS = 8 * 16  # a step's loss (and a validation batch's) is a mean over batch x seq-len
KEYS = ("loss", "val_loss")


def _train(out: Path, *extra: str, nudge_seed: int | None = None) -> None:
    train_cli([*COMMON, "--out", str(out), *extra], nudge_seed=nudge_seed)


def _records(out: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows}


def series(records: dict[int, dict]) -> dict[str, list[float]]:
    """A run's records (``_records``) as per-step series: each of ``KEYS`` at the steps
    that log it."""
    return {k: [records[s][k] for s in sorted(records) if k in records[s]] for k in KEYS}


def assert_records_match(got: dict[int, dict], ref: Reference, *, world: int, what: str):
    """``got``'s losses and validation losses lie within the derived bound of ``ref``."""
    for key, values in series(got).items():
        assert_losses_match(values, ref, world=world, tokens=TOKENS, what=what, series=key)


def test_hsdp_train_equals_fsdp_and_resumes(tmp_path):
    flat, nudged, hsdp = tmp_path / "flat", tmp_path / "nudged", tmp_path / "hsdp"
    _train(flat)
    _train(nudged, nudge_seed=1)  # the reference's own sensitivity: one nudged run
    ref = from_runs(series(_records(flat)), [series(_records(nudged))])
    _train(hsdp, *HSDP, "--ckpt-every", "2")  # checkpoints at steps 2 and 4
    b = _records(hsdp)
    assert sorted(b) == list(range(4)) and [s for s in b if "val_loss" in b[s]] == [1, 3]
    assert_records_match(b, ref, world=4, what="HSDP vs 1-D FSDP: ")
    # A job resumed on the HSDP mesh from step 2 (the first job's later records moved
    # aside): the same mesh and layout do the same arithmetic, so the same bits.
    _train(hsdp, *HSDP, "--ckpt-every", "2", "--resume-from", str(hsdp / "ckpt" / "step_00000002"))
    c, aside = _records(hsdp), _records(hsdp / "superseded" / "job_2")
    assert sorted(c) == list(range(4)) and aside == {s: b[s] for s in (2, 3)}
    assert [c[s] for s in (0, 1)] == [b[s] for s in (0, 1)]  # kept, timings too: not rerun
    for step in (2, 3):
        assert {k: c[step].get(k) for k in KEYS} == {k: b[step].get(k) for k in KEYS}, step
    s_flat = json.loads((flat / "summary.json").read_text())
    s_hsdp = json.loads((hsdp / "summary.json").read_text())
    assert (s_flat["mesh"], s_hsdp["mesh"]) == (None, "replicate=2,shard=2")
    # The measured step all-reduces, over the replicate dim, each group's reduced shard
    # gradients (S elements: half the reduce-scatter's 2 S input; 3 groups: two blocks and
    # the root), and nothing else.
    assert s_hsdp["all_reduce_count"] - s_flat["all_reduce_count"] == 3
    extra = s_hsdp["all_reduce_bytes"] - s_flat["all_reduce_bytes"]
    assert extra == s_hsdp["reduce_scatter_bytes"] // 2
    assert s_hsdp["copied_bytes_fsdp"] == 0  # fp32: nothing copied around collectives
