"""``python -m raggedfsdp train`` on 2 gloo ranks when the disk fills up and when the newest
checkpoint is damaged: the files on disk stay whole and every message matches them.

The launcher's checks and messages without ranks: ``tests/unit/test_train_guards.py``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from tests.harness import train_cli

COMMON = [
    "--model", "llama-tiny", "--nproc", "2", "--batch-size", "4", "--seq-len", "16",
    "--max-bytes", "300000", "--val-every", "0", "--val-batches", "1", "--no-progress",
    "--no-plot",
]  # fmt: skip
LIMIT = 300  # seconds a job may take on a busy machine

# The disk is full for the files the job creates after training: each is created (as on
# a real full disk) but no byte can be written to it. Ranks and launcher load this hook.
_DISK_FULL_AFTER_TRAINING = """
import builtins, errno, io, os
_OUT = os.environ["TEST_FULL_OUT"]
_open = io.open

class _Full:
    def __init__(self, f):
        self._f = f
    def write(self, data):
        raise OSError(errno.ENOSPC, "No space left on device")
    def __getattr__(self, name):
        return getattr(self._f, name)
    def __enter__(self):
        return self
    def __exit__(self, *exc):
        self._f.close()

def open(file, mode="r", *args, **kwargs):
    f = _open(file, mode, *args, **kwargs)
    path = os.path.realpath(os.fspath(file)) if not isinstance(file, int) else ""
    if path.startswith(_OUT) and "summary.json" in os.path.basename(path) and (
        set(mode) & set("wxa")
    ):
        return _Full(f)
    return f

builtins.open = io.open = open
"""


def _metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_full_disk_leaves_whole_files_and_true_messages(tmp_path):
    out = tmp_path / "run"
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(_DISK_FULL_AFTER_TRAINING)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")]),
        "TEST_FULL_OUT": os.path.realpath(out),
    }
    cmd = [sys.executable, "-m", "raggedfsdp", "train", *COMMON, "--out", str(out)]
    done = subprocess.run(
        [*cmd, "--steps", "3"], capture_output=True, text=True, timeout=LIMIT, env=env
    )
    text = done.stdout + done.stderr
    assert done.returncode == 1, text[-4000:]
    # summary.json is valid JSON or absent; metrics.jsonl holds every step, whole
    assert sorted(p.name for p in out.iterdir()) == ["metrics.jsonl", "run.json"], text[-4000:]
    assert [r["step"] for r in _metrics(out / "metrics.jsonl")] == [0, 1, 2]
    # the rank names what it was doing after step 2 (the last), not a step 3 or 4
    assert re.search(
        r"train: rank 0: after step 2 \(the job's last\), writing summary.json: .*summary.json was not "
        r"written \(No space left on device\)",
        text,
    ), text[-4000:]
    assert not re.search(r"step [34]\b", text), text[-4000:]
    # the launcher's last line: no checkpoint, and no folder that does not exist
    last = text.strip().splitlines()[-1]
    assert re.search(
        r"^train: failed: rank 0 exited with code 1 \(its message is above\)\. No checkpoint "
        r"was saved \(--ckpt-every 0\)",
        last,
    ), text[-4000:]
    assert "/ckpt" not in last  # a folder that does not exist


def test_resume_from_an_earlier_checkpoint_when_the_newest_is_damaged(tmp_path, capsys):
    out = tmp_path / "run"
    run = [*COMMON, "--out", str(out), "--steps", "5", "--ckpt-every", "1", "--keep-last", "10"]
    train_cli([*run, "--stop-after", "4"])  # steps 0-3, checkpoints of steps 1-4
    newest = out / "ckpt" / "step_00000004"
    data = next(newest.glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    data.write_bytes(bytes(raw))

    train_cli([*run, "--resume-from", str(out / "ckpt" / "step_00000002")])  # steps 2-4
    err = capsys.readouterr().err
    aside = out / "superseded" / "job_2"
    assert re.search(r"moved the newer checkpoints step_00000003, step_00000004 \(damaged", err)
    rows = _metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]  # every step once
    superseded = _metrics(aside / "metrics.jsonl")
    assert [r["step"] for r in superseded] == [2, 3]  # the first job's, kept
    for old in superseded:  # the same trajectory from the same state: the same bits
        assert old["loss"] == rows[old["step"]]["loss"], (old, rows)
    saved = sorted(p.name for p in (out / "ckpt").iterdir())
    assert saved == [f"step_{s:08d}" for s in range(1, 6)]
    assert sorted(p.name for p in aside.iterdir()) == [
        "metrics.jsonl",
        "step_00000003",
        "step_00000004",
    ]
