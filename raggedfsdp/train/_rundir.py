"""The run folder (``--out``) of ``python -m raggedfsdp train``: who owns it, and what it holds.

[Note: a run owns its folder]
A run is one training trajectory: the arguments that decide its numbers (model,
optimizer and its hyperparameters, batch, data and its bytes, seed, precision). Its
folder holds::

    out/
      run.json        the run id, its arguments, the sha256 of its data, one line per job
      metrics.jsonl   one record per step (validation included), rank 0
      summary.json    throughput, memory, communication of the last job
      loss.png        the loss curves
      ckpt/           the checkpoints (raggedfsdp.checkpoint)

- A new run (no ``--resume``) starts only in an empty or absent folder; a folder
  that holds anything else is refused (it is another run's, or not a run at all)
  unless ``--overwrite``, which deletes what a run writes (the names above) first.
- ``--resume`` continues the run whose ``run.json`` the folder holds: an argument
  of the trajectory that differs is an error naming each one; the others (``--steps``,
  the number of ranks, the block size, validation, checkpoint cadence, ...) may
  change. Resuming needs a checkpoint before ``--steps``.
- While a job runs, its launcher holds an exclusive ``flock`` on the folder: a second
  live job is refused (the kernel drops the lock of a killed job).
- On resume the metrics are cut back to the steps before the checkpoint, so the
  file reads as the uninterrupted run's.

Everything here runs in the launcher before any rank starts, except ``trim_metrics``
(rank 0, after loading the checkpoint).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import shutil
import socket
import sys
import time
import uuid
from pathlib import Path

__all__ = [
    "CKPT",
    "OUTPUTS",
    "RUN_FILE",
    "TRAJECTORY",
    "OutLock",
    "check_out",
    "data_digest",
    "latest_step",
    "prepare",
    "trim_metrics",
]

RUN_FILE = "run.json"
FORMAT = "raggedfsdp-train-run/1"
CKPT = "ckpt"
OUTPUTS = (CKPT, "metrics.jsonl", "summary.json", "loss.png", RUN_FILE, "args.json")
# The arguments that decide a run's numbers; a resume must not change them.
TRAJECTORY = (
    "model",
    "backend",
    "bf16",
    "optim",
    "lr",
    "weight_decay",
    "warmup",
    "clip",
    "batch_size",
    "seq_len",
    "seed",
    "data",
    "max_bytes",
)


def data_digest(corpus) -> str:
    """sha256 of the training and validation bytes: the same path may hold other text."""
    h = hashlib.sha256()
    h.update(corpus.train.numpy().tobytes())
    h.update(b"|")
    h.update(corpus.val.numpy().tobytes())
    return h.hexdigest()


def _read_run(out: Path) -> dict | None:
    path = out / RUN_FILE
    if not path.is_file():
        return None
    try:
        run = json.loads(path.read_text())
        if run.get("format") != FORMAT or not isinstance(run.get("args"), dict):
            raise ValueError
    except ValueError:
        raise ValueError(
            f"train: '{path}' is not a {FORMAT} record (damaged?); pass --overwrite to start a "
            "new run there, or another --out"
        ) from None
    return run


def latest_step(out: Path) -> int | None:
    """The step of the newest complete checkpoint of the run in ``out``, or None."""
    from raggedfsdp.checkpoint import latest_checkpoint

    found = latest_checkpoint(out / CKPT)
    return None if found is None else int(found.name.removeprefix("step_"))


def _describe(run: dict) -> str:
    args = run["args"]
    jobs = run.get("jobs") or [{}]
    return (
        f"run {run.get('run_id', '?')} ({args.get('model')}, --optim {args.get('optim')}, "
        f"--seed {args.get('seed')}, started {jobs[0].get('started', '?')})"
    )


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_out(args, digest: str) -> int:
    """Check that this job may write ``args.out``; read-only.

    Args:
        args: the checked arguments.
        digest: ``data_digest`` of the corpus this job would train on.

    Returns:
        The step the job starts at (0, or the latest checkpoint's on ``--resume``).

    Raises:
        ValueError: see [Note: a run owns its folder].
    """
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"train: --out '{out}' is a file, not a folder; pass a folder")
    if args.resume and args.overwrite:
        raise ValueError("train: --resume continues the run in --out, --overwrite replaces it; "
                         "pass one of them")  # fmt: skip
    if not args.resume:
        if out.is_dir() and any(out.iterdir()) and not args.overwrite:
            run = _read_run(out) if (out / RUN_FILE).is_file() else None
            what = f"another run: {_describe(run)}" if run else "files of something else"
            raise ValueError(
                f"train: --out '{out}' is not empty: it holds {what}. Pass --resume to continue "
                "that run, --overwrite to delete it and start this one, or another --out"
            )
        return 0
    run = _read_run(out) if out.is_dir() else None
    if run is None:
        raise ValueError(
            f"train: --resume: '{out}' holds no run ({RUN_FILE} is missing), nothing to resume; "
            "drop --resume to start one"
        )
    saved = run["args"]
    current = {**vars(args), "data_sha256": digest}
    saved = {**saved, "data_sha256": run.get("data_sha256")}
    changed = [
        f"{_flag(k) if k != 'data_sha256' else 'the bytes of --data'} "
        f"{current.get(k)!r} (the run: {saved.get(k)!r})"
        for k in (*TRAJECTORY, "data_sha256")
        if current.get(k) != saved.get(k)
    ]
    if changed:
        raise ValueError(
            f"train: --resume would change the trajectory of {_describe(run)}: "
            + "; ".join(changed)
            + ". Resume with the run's values, or start a new run (another --out, or "
            "--overwrite)"
        )
    step = latest_step(out)
    if step is None:
        raise ValueError(
            f"train: --resume: '{out / CKPT}' holds no complete checkpoint, nothing to resume; "
            "the run saved none (pass --ckpt-every K to save), or start again with --overwrite"
        )
    if step >= args.steps:
        raise ValueError(
            f"train: --resume: the run has finished: its latest checkpoint is step {step}, "
            f"--steps is {args.steps}; pass a larger --steps to train on"
        )
    return step


class OutLock:
    """The launcher's exclusive ``flock`` on the run folder for the whole job.

    Raises:
        ValueError: another live job holds it.
    """

    def __init__(self, out: Path):
        self.out = Path(out)
        self._fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self.out, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            os.close(fd)
            if err.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                print(
                    f"train: warning: '{self.out}' cannot be locked ({err.strerror}): a second "
                    "job writing it at the same time would not be detected",
                    file=sys.stderr,
                )
                return
            job = ((_read_run(self.out) or {}).get("jobs") or [{}])[-1]
            raise ValueError(
                f"train: another live job is writing --out '{self.out}' (pid {job.get('pid')} "
                f"on {job.get('host')}, started {job.get('started')}); wait for it to end, or "
                "pass another --out"
            ) from None
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the lock
            self._fd = None


def prepare(args, digest: str) -> None:
    """Make ``args.out`` this job's (holding its ``OutLock``): clear it on ``--overwrite``,
    write or extend ``run.json``."""
    out = Path(args.out)
    if args.overwrite:
        for name in OUTPUTS:
            path = out / name
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
    job = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "resume": bool(args.resume),
        "args": vars(args),
    }
    run = _read_run(out) if args.resume else None
    if run is None:
        run = {
            "format": FORMAT,
            "run_id": uuid.uuid4().hex,
            "args": vars(args),
            "data_sha256": digest,
            "jobs": [],
        }
    run["jobs"].append(job)
    tmp = out / (RUN_FILE + ".part")
    tmp.write_text(json.dumps(run, indent=1))
    os.replace(tmp, out / RUN_FILE)


def trim_metrics(path: Path, start: int) -> None:
    """Keep the records of steps before ``start`` (the ones the resumed job does not redo)."""
    if not path.is_file():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:  # blank, or torn by a job killed while writing it
            continue
        if record.get("step", -1) < start:
            keep.append(line)
    tmp = path.with_name(path.name + ".part")
    tmp.write_text("".join(line + "\n" for line in keep))
    os.replace(tmp, path)
