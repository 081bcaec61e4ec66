"""Nothing lost, nothing silent, through ``python -m raggedfsdp train`` on 2 gloo ranks.

Five jobs (spawning is the slow part), each showing several guarantees of
``docs/reliability.md``; the optimizer of each is a different ``--optim`` value, so every
value trains a few steps here (``flat-adamw``: ``test_train.py``)::

    sgd        a job killed with its launcher (kill -9): its ranks die too; the folder is
               the run's (another run refused, a changed trajectory refused, a live job
               refused); --resume continues it with each step logged once
    adamw8bit  --overwrite replaces that run; a tiny validation split with --val-every 0
    adamw      a diverging run stops at the step it diverges, before saving it
    muon       a stopped rank: the other one names the collective and the group
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from raggedfsdp import checkpoint
from raggedfsdp.models import get_config
from raggedfsdp.models.transformer import Transformer
from raggedfsdp.cli.train import main

COMMON = [
    "--model", "llama-tiny", "--nproc", "2", "--batch-size", "4", "--seq-len", "16",
    "--max-bytes", "300000", "--val-every", "0", "--val-batches", "1", "--no-progress",
    "--no-plot",
]  # fmt: skip
LIMIT = 300  # seconds any one job or wait may take on a busy machine


def _cmd(out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "raggedfsdp", "train", *COMMON, "--out", str(out), *extra]


def _run(out: Path, *extra: str, code: int = 0) -> str:
    done = subprocess.run(_cmd(out, *extra), capture_output=True, text=True, timeout=LIMIT)
    text = done.stdout + done.stderr
    assert done.returncode == code, text[-4000:]
    return text


class _Job:
    """A job in the background, its output collected line by line."""

    def __init__(self, out: Path, *extra: str, env: dict | None = None):
        self.proc = subprocess.Popen(
            _cmd(out, *extra), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)

    def wait_for(self, condition, what: str, limit: float = LIMIT) -> None:
        """Until ``condition()``; fails at once if the job ends first."""

        def met():
            if condition():
                return True
            assert self.proc.poll() is None, f"the job ended before {what}:\n{self.text()}"
            return False

        _wait(met, what, limit)

    def text(self) -> str:
        return "".join(self.lines)

    def ranks(self) -> list[int]:
        """The pids of the ranks: the launcher's children."""
        kids = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    stat = (entry / "stat").read_text()
                except OSError:
                    continue
                if int(stat.rpartition(")")[2].split()[1]) == self.proc.pid:
                    kids.append(int(entry.name))
        return kids

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=60)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _wait(condition, what: str, limit: float = LIMIT):
    deadline = time.monotonic() + limit
    while not condition():
        assert time.monotonic() < deadline, f"waited {limit:.0f} s for {what}"
        time.sleep(0.1)


def _metrics(out: Path) -> list[dict]:
    def refuse(name):  # a bare NaN / Infinity is not JSON
        raise AssertionError(f"metrics hold {name}")

    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line, parse_constant=refuse) for line in lines if line.strip()]


def _refused(argv: list[str], match: str, capsys) -> None:
    """The launcher's own checks (no rank started): exit code 2 and the message."""
    with pytest.raises(SystemExit) as exit_:
        main([*COMMON, *argv])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert re.search(match, err), err


def _saved(out: Path) -> list[str]:
    """Everything under ``out/ckpt`` (checkpoints, and debris, if any)."""
    root = out / "ckpt"
    return sorted(p.name for p in root.iterdir()) if root.is_dir() else []


def _names(*steps: int) -> list[str]:
    return [f"step_{s:08d}" for s in steps]


# ---- items 1, 6 (launcher killed), 5 (sgd, adamw8bit), 7 (--val-every 0) ---------------
# The launcher is killed at the worst instruction for the metrics: the first after a
# checkpoint lands (CI met it by chance: the resumed run logged steps 0, 2, 3, 4). Rank 0,
# the one that logs, kills it right after the save of step 2; every rank leaves its pid.
_KILL_LAUNCHER_AFTER_SAVE = """
import os, signal
from pathlib import Path
if "RANK" in os.environ:
    Path(__file__).with_name(f"rank{os.environ['RANK']}.pid").write_text(str(os.getpid()))
if os.environ.get("RANK") == "0":
    from raggedfsdp import checkpoint
    _save = checkpoint.save
    def save(*args, step, **kwargs):
        _save(*args, step=step, **kwargs)
        if step == 2:
            os.kill(int(os.environ["RAGGEDFSDP_LAUNCHER_PID"]), signal.SIGKILL)
    checkpoint.save = save
"""


def test_a_run_owns_its_folder(tmp_path, capsys):
    out = tmp_path / "run"
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(_KILL_LAUNCHER_AFTER_SAVE)
    path = os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")])
    sgd = ["--optim", "sgd", "--ckpt-every", "2", "--keep-last", "2"]
    job = _Job(out, *sgd, "--steps", "100000", env={**os.environ, "PYTHONPATH": path})
    ranks = []
    try:
        assert job.proc.wait(timeout=LIMIT) == -signal.SIGKILL, job.text()
        ranks = [int(p.read_text()) for p in sorted(hook.glob("rank*.pid"))]
        assert len(ranks) == 2, job.text()
        _wait(lambda: not any(_alive(r) for r in ranks), "the ranks to exit", 30)
    finally:
        for pid in [r for r in ranks if _alive(r)]:
            os.kill(pid, signal.SIGKILL)
        job.kill()
    assert _saved(out) == _names(2)  # the job died right after its first save
    saved = 2
    run_id = json.loads((out / "run.json").read_text())["run_id"]

    # Nothing of the run is touched by a job that would change it.
    where = ["--out", str(out)]
    _refused(
        [*where, "--optim", "adamw8bit"],
        rf"--out '.*run' is not empty: it holds another run: run {run_id} \(llama-tiny, --optim "
        r"sgd, --seed 0, started .*\). Pass --resume to continue that run, --overwrite",
        capsys,
    )
    _refused(
        [*where, *sgd, "--resume", "--seed", "1", "--lr", "0.1"],
        r"--resume would change the trajectory of run .*: --lr 0.1 \(the run: 0.003\); --seed 1 "
        r"\(the run: 0\)\. Resume with the run's values",
        capsys,
    )
    fd = os.open(out, os.O_RDONLY)  # as a live job holds it
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        _refused([*where, *sgd, "--resume"], r"another live job is writing --out '.*run'", capsys)
    finally:
        os.close(fd)
    assert _saved(out)[-1] == _names(saved)[0]

    # --resume continues it (a longer --steps is compatible); each step is logged once.
    end = saved + 3
    _run(out, *sgd, "--steps", str(end), "--resume")
    assert [r["step"] for r in _metrics(out)] == list(range(end))
    assert _saved(out) == _names(end - 1, end)  # keep_last=2 of the run's own saves, no debris
    _refused(
        [*where, *sgd, "--steps", str(end), "--resume"],
        rf"the run has finished: its latest checkpoint is step {end}, --steps is {end}; pass a",
        capsys,
    )

    # --overwrite replaces it; a validation split too small for a sequence is fine
    # when nothing validates (--val-every 0: no final validation either).
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("hello world, " * 12)  # 156 bytes: 16 of them for validation
    _run(out, "--overwrite", "--optim", "adamw8bit", "--steps", "3", "--data", str(tiny))
    assert [r["step"] for r in _metrics(out)] == [0, 1, 2]
    assert _saved(out) == []
    assert json.loads((out / "run.json").read_text())["run_id"] != run_id
    assert json.loads((out / "summary.json").read_text())["optim"] == "adamw8bit"
    _refused(
        [*where, "--optim", "adamw8bit", "--steps", "3", "--data", str(tiny), "--resume"],
        r"--resume: '.*ckpt' holds no complete checkpoint, nothing to resume",
        capsys,
    )


# ---- item 2 (and 5: adamw) ---------------------------------------------------------------
def test_a_diverging_run_stops_before_saving_the_bad_state(tmp_path):
    out = tmp_path / "run"
    text = _run(
        out, "--optim", "adamw", "--lr", "1e30", "--warmup", "1", "--steps", "6",
        "--ckpt-every", "1", "--keep-last", "10", code=1,
    )  # fmt: skip
    found = re.search(
        r"train: step (\d+): (the loss is (nan|inf)|a gradient holds nan or inf): the run diverged "
        r"and stopped; the state of this step was not saved, the last checkpoint, '(.*)', holds "
        r"finite values",
        text,
    )
    assert found, text[-4000:]
    step = int(found.group(1))
    assert step >= 1 and "Traceback" not in text, text[-4000:]
    assert re.search(r"train: failed: rank \d exited with code 1", text), text[-4000:]
    records = _metrics(out)  # valid JSON: no bare NaN
    assert [r["step"] for r in records] == list(range(step + 1))
    assert records[-1]["non_finite"] is True
    assert not (out / "summary.json").exists()
    assert _saved(out) == _names(*range(1, step + 1))  # every finite state, none after
    assert Path(found.group(4)).name == f"step_{step:08d}"
    model = Transformer(get_config("llama-tiny"), max_seq_len=16, seed=1)
    assert checkpoint.load(out / "ckpt", model)[0] == step
    assert all(torch.isfinite(p).all() for p in model.parameters())


# ---- item 6 (and 5: muon) ----------------------------------------------------------------
def test_a_stopped_rank_ends_the_job_naming_the_collective(tmp_path):
    out = tmp_path / "run"
    job = _Job(out, "--optim", "muon", "--steps", "100000", "--timeout", "5")
    try:
        log = out / "metrics.jsonl"
        job.wait_for(lambda: log.exists() and log.read_text().count("\n") >= 2, "two steps")
        ranks = job.ranks()
        assert len(ranks) == 2, job.text()
        os.kill(ranks[1], signal.SIGSTOP)
        job.wait_for(lambda: "got no answer" in job.text(), "the timeout message", 120)
        message = next(line for line in job.lines if "got no answer" in line)
        assert re.search(
            r"train: rank [01]: step \d+, .+: a collective on (the default|a) process group "
            r"\(ranks 0-1, gloo\) got no answer within --timeout 5 s \(RuntimeError: .*\)\. A "
            r"rank of that group is stopped, hung or dead",
            message,
        ), message
        os.kill(ranks[1], signal.SIGCONT)  # the launcher's SIGTERM is waiting for it
        assert job.proc.wait(timeout=120) == 1
        assert re.search(r"train: failed: rank \d (exited with code|lost a peer in a collective)",
                         job.text()), job.text()  # fmt: skip
    finally:
        for pid in job.ranks():
            os.kill(pid, signal.SIGKILL)
        job.kill()
