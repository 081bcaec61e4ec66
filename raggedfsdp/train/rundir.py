"""The run folder (``--out``) of ``python -m raggedfsdp train``: who owns it, and what it holds.

[Note: a run owns its folder]
A run is one training trajectory: the arguments that decide its numbers (model,
optimizer and its hyperparameters, batch, data, its tokenizer and its bytes, seed,
precision). Its folder holds::

    out/
      run.json        the run id, its arguments, the sha256 of its data, one line per job
      metrics.jsonl   one record per step (validation included), rank 0
      summary.json    throughput, memory, communication of the last job
      loss.png        the loss curves
      ckpt/           the checkpoints (raggedfsdp.checkpoint)
      superseded/     job_N/: what job N's --resume-from moved aside (see below)

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
- ``--resume`` checks the newest checkpoint's files (sizes, sha256) before any rank
  starts; a damaged one is refused, naming the newest complete one before it.
- ``--resume-from DIR`` continues from any complete checkpoint of the run (a
  ``step_XXXXXXXX`` folder of its ``ckpt/``). The checkpoints newer than DIR and the
  metrics of the steps after it are moved to ``superseded/job_N/`` (N: this job's line
  in ``run.json``, which records the move): ``ckpt/`` then ends at DIR, so a later
  ``--resume`` (and ``checkpoint.save``, which refuses a root holding a later step)
  starts from this job's checkpoints, and nothing is deleted.

[Note: run files are whole]
``run.json`` and ``summary.json`` are replaced whole or not at all (``write_atomic``:
a temporary name, fsync, ``os.replace``, fsync of the folder); a full disk leaves the
previous file, or none, never a half one. ``metrics.jsonl`` is appended a record at a
time (``MetricsLog``): one ``write`` per line, cut back to the previous line if the
write fails half-way, and fsynced before each checkpoint is saved (a checkpoint is
never durable before the records of its steps). A job killed in the middle of a write
can still leave a torn last line: ``report.read_metrics`` skips it and a resume cuts
it (``trim_metrics``).

Everything here runs in the launcher before any rank starts, except ``trim_metrics``
and ``MetricsLog`` (rank 0).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import socket
import sys
import time
import uuid
from pathlib import Path

from raggedfsdp.checkpoint.files import DirectoryLock, fsync_dir, replace_file, staging_path

__all__ = [
    "CKPT",
    "OUTPUTS",
    "RUN_FILE",
    "SUPERSEDED",
    "TRAJECTORY",
    "MetricsLog",
    "OutLock",
    "check_out",
    "checkpoint_state",
    "data_digest",
    "latest_step",
    "prepare",
    "trim_metrics",
    "write_atomic",
]

RUN_FILE = "run.json"
FORMAT = "raggedfsdp-train-run/1"
CKPT = "ckpt"
SUPERSEDED = "superseded"
METRICS = "metrics.jsonl"
OUTPUTS = (CKPT, SUPERSEDED, METRICS, "summary.json", "loss.png", RUN_FILE, "args.json")
_STEP_DIR = re.compile(r"step_(\d+)")  # a checkpoint's folder: see [Note: commit protocol]
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
    "tokenizer",
    "max_bytes",
)
# and, under --optim shampoo, its settings (the state's shape follows the blocks)
SHAMPOO_TRAJECTORY = (
    "shampoo_block_size",
    "shampoo_row_block",
    "precondition_frequency",
    "start_preconditioning_step",
    "shampoo_grafting",
    "shampoo_root_dtype",
)


def _optim_trajectory(args: dict) -> tuple[str, ...]:
    return SHAMPOO_TRAJECTORY if args.get("optim") == "shampoo" else ()


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


def _newest_intact(out: Path, before: int | None = None) -> tuple[int, Path] | None:
    """The newest complete checkpoint of the run whose files check out (before step
    ``before``), or None. Reads the checkpoints it tries."""
    from raggedfsdp.checkpoint import list_checkpoints, verify_checkpoint

    for step, path in reversed(list_checkpoints(Path(out) / CKPT)):
        if (before is None or step < before) and verify_checkpoint(path) is None:
            return step, path
    return None


def checkpoint_state(args) -> str:
    """The run's checkpoints as they are on disk, in a sentence: the launcher's last words
    after a failed job. Reads (hashes) the newest checkpoint, and the ones before it when
    it is damaged."""
    from raggedfsdp.checkpoint import list_checkpoints, verify_checkpoint

    found = list_checkpoints(Path(args.out) / CKPT)
    if not found:
        return "No checkpoint was saved" + ("" if args.ckpt_every else " (--ckpt-every 0)")
    step, newest = found[-1]
    problem = verify_checkpoint(newest)
    if problem is None:
        then = (
            "--resume continues from it"
            if step < args.steps
            else f"it is the run's last step (--steps {args.steps})"
        )
        return f"The newest checkpoint, '{newest}' (step {step}), is complete: {then}"
    good = _newest_intact(Path(args.out), before=step)
    fix = (
        f"pass --resume-from '{good[1]}' to continue from step {good[0]}"
        if good
        else "no earlier checkpoint is complete: start again with --overwrite"
    )
    return f"The newest checkpoint, '{newest}', is damaged ({problem}): {fix}"


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
    if args.resume_from is not None and args.overwrite:
        raise ValueError("train: --resume-from continues the run in --out, --overwrite replaces "
                         "it; pass one of them")  # fmt: skip
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
        for k in (*TRAJECTORY, *_optim_trajectory(current), "data_sha256")
        if current.get(k) != saved.get(k)
    ]
    if changed:
        raise ValueError(
            f"train: --resume would change the trajectory of {_describe(run)}: "
            + "; ".join(changed)
            + ". Resume with the run's values, or start a new run (another --out, or "
            "--overwrite)"
        )
    if args.resume_from is not None:
        return _check_resume_from(args, out)
    step = latest_step(out)
    if step is None:
        raise ValueError(
            f"train: --resume: '{out / CKPT}' holds no complete checkpoint, nothing to resume; "
            "the run saved none (pass --ckpt-every K to save), or start again with --overwrite"
        )
    from raggedfsdp.checkpoint import latest_checkpoint, verify_checkpoint

    newest = latest_checkpoint(out / CKPT)
    problem = verify_checkpoint(newest)
    if problem is not None:
        good = _newest_intact(out, before=step)
        fix = (
            f"Pass --resume-from '{good[1]}' to continue from step {good[0]} (the newer "
            f"checkpoints are then moved aside, to '{out / SUPERSEDED}')"
            if good
            else "No earlier checkpoint is complete: start again with --overwrite"
        )
        raise ValueError(
            f"train: --resume: the newest checkpoint of the run, '{newest}', is damaged "
            f"({problem}); nothing was started. {fix}"
        )
    if step >= args.steps:
        raise ValueError(
            f"train: --resume: the run has finished: its latest checkpoint is step {step}, "
            f"--steps is {args.steps}; pass a larger --steps to train on"
        )
    return step


def _check_resume_from(args, out: Path) -> int:
    """``--resume-from``: a complete, intact checkpoint of the run in ``out``; its step."""
    from raggedfsdp.checkpoint import list_checkpoints, verify_checkpoint

    target, root = Path(args.resume_from), out / CKPT
    complete = list_checkpoints(root)
    if target.resolve().parent != root.resolve() or not _STEP_DIR.fullmatch(target.name):
        names = ", ".join(p.name for _, p in complete) or "none"
        raise ValueError(
            f"train: --resume-from '{target}' is not a checkpoint of the run in --out '{out}' "
            f"(those are the step_XXXXXXXX folders in '{root}': {names}); pass one of them, or "
            "the --out of the run that saved it"
        )
    step = int(_STEP_DIR.fullmatch(target.name).group(1))
    problem = verify_checkpoint(target)
    if problem is not None:
        if any(p.name == target.name for _, p in complete):
            good = _newest_intact(out, before=step)
            fix = (
                f"pass an earlier complete checkpoint: '{good[1]}'"
                if good
                else "no earlier checkpoint is complete: start again with --overwrite"
            )
            raise ValueError(f"train: --resume-from '{target}' is damaged ({problem}); {fix}")
        names = ", ".join(p.name for _, p in complete) or "none"
        raise ValueError(
            f"train: --resume-from '{target}' is not a complete checkpoint: {problem}; the "
            f"run's are {names} in '{root}'"
        )
    if step >= args.steps:
        raise ValueError(
            f"train: --resume-from: that checkpoint is step {step}, --steps is {args.steps}; "
            "pass a larger --steps to train on"
        )
    return step


class OutLock(DirectoryLock):
    """The launcher's exclusive ``flock`` on the run folder for the whole job.

    Raises:
        ValueError: another live job holds it.
    """

    def busy(self) -> Exception:
        job = ((_read_run(self.path) or {}).get("jobs") or [{}])[-1]
        return ValueError(
            f"train: another live job is writing --out '{self.path}' (pid {job.get('pid')} "
            f"on {job.get('host')}, started {job.get('started')}); wait for it to end, or "
            "pass another --out"
        )

    def unlocked(self, reason: str) -> None:
        print(
            f"train: warning: '{self.path}' cannot be locked ({reason}): a second "
            "job writing it at the same time would not be detected",
            file=sys.stderr,
        )


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
    if args.resume_from is not None:
        moved = _supersede(args, out / SUPERSEDED / _free_name(out, len(run["jobs"]) + 1))
        if moved is not None:
            job["superseded"] = str(moved)
    run["jobs"].append(job)
    write_atomic(out / RUN_FILE, json.dumps(run, indent=1))


def _free_name(out: Path, job: int) -> str:
    name, k = f"job_{job}", 1
    while (out / SUPERSEDED / name).exists():  # a run.json replaced by hand: keep both
        name, k = f"job_{job}.{k}", k + 1
    return name


def _supersede(args, aside: Path) -> Path | None:
    """``--resume-from``: move the checkpoints after it and the metrics of its step and
    later into ``aside`` (see [Note: a run owns its folder]); say so. None: nothing to move."""
    from raggedfsdp.checkpoint import verify_checkpoint

    out, target = Path(args.out), Path(args.resume_from)
    step = int(_STEP_DIR.fullmatch(target.name).group(1))
    newer = []
    for entry in (out / CKPT).iterdir():
        match = _STEP_DIR.fullmatch(entry.name)
        if match and int(match.group(1)) > step:
            newer.append((int(match.group(1)), entry))
    if not newer:
        return None  # the newest checkpoint: a plain --resume
    aside.mkdir(parents=True)
    keep, cut = _split_metrics(out / METRICS, step)
    if cut:  # aside first: a job killed in between leaves the records twice, not lost
        write_atomic(aside / METRICS, "".join(line + "\n" for line in cut))
        write_atomic(out / METRICS, "".join(line + "\n" for line in keep))
    described = []
    for _, path in sorted(newer):
        problem = verify_checkpoint(path)
        described.append(path.name + (f" (damaged: {problem})" if problem else ""))
        os.rename(path, aside / path.name)
    fsync_dir(out / CKPT)
    fsync_dir(aside)
    steps = sorted(json.loads(line)["step"] for line in cut)
    metrics = f" and the metrics of steps {steps[0]}-{steps[-1]}" if steps else ""
    print(
        f"train: --resume-from step {step}: moved the newer checkpoints {', '.join(described)}"
        f"{metrics} to '{aside}'; '{out / CKPT}' now ends at step {step}, so a later --resume "
        "continues this job; delete that folder once you no longer need it",
        file=sys.stderr,
    )
    return aside


def _split_metrics(path: Path, start: int) -> tuple[list[str], list[str]]:
    """The lines of ``path`` of steps before ``start``, and of ``start`` and later (lines
    that do not parse, blank or torn by a killed job, in neither)."""
    keep, cut = [], []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            (keep if record.get("step", -1) < start else cut).append(line)
    return keep, cut


def trim_metrics(path: Path, start: int) -> None:
    """Keep the records of steps before ``start`` (the ones the resumed job does not redo)."""
    if not path.is_file():
        return
    keep, _ = _split_metrics(path, start)
    write_atomic(path, "".join(line + "\n" for line in keep))


# ---- run files: see [Note: run files are whole] -------------------------------------------------
def write_atomic(path: Path, text: str | bytes) -> None:
    """Replace ``path`` by ``text`` whole, or leave it as it was.

    Raises:
        OSError: naming the file and why (a full disk: ``ENOSPC``); the temporary is gone.
    """
    path = Path(path)
    data = text.encode() if isinstance(text, str) else text
    try:
        replace_file(path, data)
    except OSError as err:
        with contextlib.suppress(OSError):
            staging_path(path).unlink()
        left = "the previous one is kept" if path.exists() else "no partial file is left"
        why = err.strerror or str(err)
        raise OSError(err.errno, f"{path.name} was not written ({why}): {left}", str(path)) from err
    fsync_dir(path.parent)


class MetricsLog:
    """``metrics.jsonl``, one whole line per record (rank 0). See [Note: run files are whole].

    Args:
        path: the file.
        append: continue it (``--resume``); False: start it empty.
    """

    def __init__(self, path: Path, *, append: bool):
        self.path = Path(path)
        flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC)
        self._fd = os.open(self.path, flags, 0o644)

    def append(self, record: dict) -> None:
        """Write ``record`` (JSON without nan or inf) as one line, or nothing.

        Raises:
            OSError: the line could not be written (the file is cut back to the lines
                before it), naming its step.
        """
        line = memoryview((json.dumps(record, allow_nan=False) + "\n").encode())
        end = os.lseek(self._fd, 0, os.SEEK_END)
        try:
            while line:
                line = line[os.write(self._fd, line) :]
        except OSError as err:
            os.ftruncate(self._fd, end)  # needs no space
            raise OSError(
                err.errno,
                f"the record of step {record.get('step')} was not written to {self.path.name} "
                f"({err.strerror or err}); the file holds the records before it, whole",
                str(self.path),
            ) from err

    def sync(self) -> None:
        """Make the records written so far durable (before a checkpoint that covers them)."""
        os.fsync(self._fd)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
