"""``python -m raggedfsdp train``: what the launcher checks before a rank starts and what it
says after one fails, with no rank started (the ranks are a stub, or torchrun's failure
is made up).

- a step that cannot fit in this machine's memory is refused; the estimate accepts every
  run the tests and the demo make;
- a rank killed by a signal is named as such; the launcher's last line says what the
  checkpoints on disk are (none, the newest complete, the newest damaged);
- ``--resume`` refuses a damaged newest checkpoint; ``--resume-from DIR`` is checked, and
  moves the newer checkpoints and the later metrics aside (nothing lost);
- run files are written whole or not at all (``summary.json``, ``metrics.jsonl``);
- an unwritable ``--out``, or too little free space for a checkpoint, is refused.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
from collections import namedtuple
from pathlib import Path

import pytest
from torch import nn

from raggedfsdp import checkpoint
from raggedfsdp.cli.train import build_parser, main, torchrun_launch
from raggedfsdp.train import resources
from raggedfsdp.train.checks import parse_train_mesh
from raggedfsdp.train.report import read_metrics
from raggedfsdp.train.rundir import MetricsLog, latest_step, write_atomic

COMMON = [
    "--model", "llama-tiny", "--nproc", "2", "--batch-size", "4", "--seq-len", "16",
    "--max-bytes", "100000", "--val-every", "0", "--no-progress", "--no-plot",
]  # fmt: skip
GiB = 1 << 30


def _no_ranks(args):
    raise AssertionError(f"ranks were started (--out {args.out})")


def _refused(argv: list[str], match: str, capsys) -> str:
    """The launcher refuses ``argv`` before any rank starts: exit code 2 and the message."""
    with pytest.raises(SystemExit) as exit_:
        main([*COMMON, *argv], launch=_no_ranks)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert re.search(match, err), err
    return err


def _args(*argv: str):
    return build_parser().parse_args([*COMMON, *argv])


# ---- memory --------------------------------------------------------------------------------
def test_a_step_that_cannot_fit_in_memory_is_refused_before_any_spawn(tmp_path, capsys):
    out = tmp_path / "out"
    _refused(
        ["--batch-size", "100000000", "--out", str(out)],
        r"train: --batch-size 100000000 \(50000000 rows of --seq-len 16 on each of --nproc 2 "
        r"ranks\) needs about [\d,.]+ TiB of memory for a training step on this machine "
        r"\(estimate: .*logits [\d,.]+ TiB.*\), more than its [\d,.]+ GiB \(.*\); lower "
        r"--batch-size \(at most \d+ fits by this estimate\) or --seq-len, or spread the "
        r"ranks over more machines \(--nnodes\)",
        capsys,
    )
    assert not out.exists()  # nothing written


def test_too_many_ranks_for_the_memory_names_nproc(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(resources, "memory_limit", lambda: (4 * GiB, "a 4 GiB test limit"))
    _refused(
        ["--nproc", "64", "--batch-size", "64", "--out", str(tmp_path / "out")],
        r"--nproc 64 ranks\) needs about [\d,.]+ GiB .*more than its 4.0 GiB \(a 4 GiB test "
        r"limit\); start fewer ranks \(--nproc\)",
        capsys,
    )


@pytest.mark.parametrize(
    "argv",
    [
        ["--model", "llama-tiny", "--nproc", "4", "--batch-size", "16", "--seq-len", "64"],
        ["--model", "moe-tiny", "--nproc", "4", "--batch-size", "16", "--seq-len", "64"],
        ["--model", "moe-small", "--nproc", "4", "--batch-size", "16", "--seq-len", "64", "--bf16"],
        ["--model", "llama-small", "--nproc", "4", "--batch-size", "16", "--mesh", "tp=2"],
        ["--model", "moe-small", "--nproc", "4", "--batch-size", "16", "--mesh", "ep=2"],
        ["--model", "llama-tiny", "--nproc", "4", "--mesh", "replicate=2,shard=2"],
    ],
    ids=["demo", "moe-tiny", "moe-small-bf16", "tp", "ep", "hsdp"],
)
def test_the_estimate_accepts_the_runs_the_tests_and_the_demo_make(argv):
    args = build_parser().parse_args(argv)
    estimate = resources.estimate_step_memory(args, parse_train_mesh(args.mesh, args.nproc))
    assert estimate.machine < 2 * GiB, estimate  # any machine that runs the suite has more


def test_the_estimate_grows_with_the_batch_and_names_the_largest_that_fits():
    args = _args("--batch-size", "4")
    mesh = parse_train_mesh(None, 2)
    small = resources.estimate_step_memory(args, mesh)
    args.batch_size = 4000
    large = resources.estimate_step_memory(args, mesh)
    # activations and logits are per token: 1000x the rows, 1000x the bytes
    assert large.activations == 1000 * small.activations
    assert large.logits == 1000 * small.logits
    assert large.states == small.states and large.runtime == small.runtime
    assert large.machine == 2 * large.per_rank
    limit = 8 * GiB
    most = resources.largest_batch(args, mesh, limit)
    assert most % 2 == 0
    args.batch_size = most
    assert resources.estimate_step_memory(args, mesh).machine <= limit
    args.batch_size = most + 2
    assert resources.estimate_step_memory(args, mesh).machine > limit


def test_the_memory_limit_is_the_smaller_of_the_machine_and_its_cgroup(tmp_path):
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    unlimited, capped = tmp_path / "max", tmp_path / "capped"
    unlimited.write_text("max\n")
    capped.write_text(f"{GiB}\n")
    assert resources.memory_limit([unlimited, tmp_path / "absent"])[0] == physical
    limit, where = resources.memory_limit([unlimited, capped])
    assert limit == min(GiB, physical)
    assert "cgroup" in where if GiB < physical else "physical" in where


# ---- a rank that fails, and the checkpoints it leaves ------------------------------------
def _torchrun_fails(monkeypatch, exitcode: int, rank: int = 1) -> None:
    """torchrun reports that ``rank`` ended with ``exitcode`` (negative: a signal)."""
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    def run(config):
        failure = ProcessFailure(local_rank=rank, pid=4321, exitcode=exitcode, error_file="")
        raise ChildFailedError("raggedfsdp.train.loop", {rank: failure})

    monkeypatch.setattr(torchrun, "run", run)
    for name in ("RAGGEDFSDP_TRAIN_ARGS", "RAGGEDFSDP_LAUNCHER_PID", "OMP_NUM_THREADS"):
        monkeypatch.setenv(name, "1")  # restored after the test


def _save(root: Path, *steps: int) -> None:
    net = nn.Linear(4, 4)
    for step in steps:
        checkpoint.save(root, net, step=step, keep_last=None)


def _damage(directory: Path) -> None:
    data = next(directory.glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    data.write_bytes(bytes(raw))


@pytest.mark.parametrize(
    "exitcode, saved, match",
    [
        (
            -9,
            "none",
            r"train: failed: rank 1 was killed by signal 9 \(SIGKILL\): most often the kernel's "
            r"out-of-memory killer; see `dmesg`\. No checkpoint was saved \(--ckpt-every 0\)",
        ),
        (
            -15,
            "complete",
            r"train: failed: rank 1 was killed by signal 15 \(SIGTERM\): stopped from outside "
            r"\(a job scheduler, kill\)\. The newest checkpoint, '.*step_00000002' \(step 2\), "
            r"is complete: --resume continues from it",
        ),
        (
            1,
            "damaged",
            r"train: failed: rank 1 exited with code 1 \(its message is above\)\. The newest "
            r"checkpoint, '.*step_00000002', is damaged \(file '.*' does not match its "
            r"recorded sha256 \(corrupted\)\): pass --resume-from '.*step_00000001' to "
            r"continue from step 1",
        ),
    ],
)
def test_the_launchers_last_line_says_how_the_rank_ended_and_what_is_saved(
    exitcode, saved, match, tmp_path, capsys, monkeypatch
):
    out = tmp_path / "out"
    out.mkdir()
    if saved != "none":
        _save(out / "ckpt", 1, 2)
    if saved == "damaged":
        _damage(out / "ckpt" / "step_00000002")
    _torchrun_fails(monkeypatch, exitcode)
    assert torchrun_launch(_args("--out", str(out))) == 1
    err = capsys.readouterr().err
    assert re.search(match, err), err
    if saved == "none":
        assert "/ckpt" not in err and "above" not in err, err  # no folder, no message


# ---- --resume, --resume-from ---------------------------------------------------------------
def _job(saves: list[int], logged: int):
    """A stand-in for the ranks of one job: checkpoints and metrics records."""

    def launch(args) -> int:
        out = Path(args.out)
        _save(out / "ckpt", *saves)
        with open(out / "metrics.jsonl", "a") as f:
            for step in range(logged):
                f.write(json.dumps({"step": step, "loss": 5.0 - step}) + "\n")
        return 0

    return launch


def _steps(path: Path) -> list[int]:
    return [r["step"] for r in read_metrics(path)]


def _run_with_four_checkpoints(tmp_path) -> tuple[Path, list[str]]:
    out = tmp_path / "out"
    run = [*COMMON, "--out", str(out), "--steps", "6", "--ckpt-every", "1"]
    assert main(run, launch=_job([1, 2, 3, 4], logged=4)) == 0
    return out, run


def test_resume_refuses_a_damaged_newest_checkpoint_before_any_spawn(tmp_path, capsys):
    out, run = _run_with_four_checkpoints(tmp_path)
    _damage(out / "ckpt" / "step_00000004")
    _refused(
        [*run[len(COMMON) :], "--resume"],
        r"train: --resume: the newest checkpoint of the run, '.*step_00000004', is damaged "
        r"\(file '.*' does not match its recorded sha256 \(corrupted\)\); nothing was started\. "
        r"Pass --resume-from '.*step_00000003' to continue from step 3",
        capsys,
    )
    assert _steps(out / "metrics.jsonl") == [0, 1, 2, 3]  # untouched


def test_resume_from_moves_the_newer_checkpoints_and_the_later_metrics_aside(tmp_path, capsys):
    out, run = _run_with_four_checkpoints(tmp_path)
    _damage(out / "ckpt" / "step_00000004")
    started = []
    target = out / "ckpt" / "step_00000002"
    assert main([*run, "--resume-from", str(target)], launch=lambda a: started.append(a) or 0) == 0
    err = capsys.readouterr().err
    aside = out / "superseded" / "job_2"
    assert re.search(
        r"train: --resume-from step 2: moved the newer checkpoints step_00000003, "
        r"step_00000004 \(damaged: .*\) and the metrics of steps 2-3 to '.*superseded/job_2'",
        err,
    ), err
    (args,) = started
    assert args.resume and Path(args.resume_from) == target
    assert sorted(p.name for p in (out / "ckpt").iterdir()) == ["step_00000001", "step_00000002"]
    assert sorted(p.name for p in aside.iterdir()) == [
        "metrics.jsonl",
        "step_00000003",
        "step_00000004",
    ]
    assert _steps(out / "metrics.jsonl") == [0, 1]
    assert _steps(aside / "metrics.jsonl") == [2, 3]
    assert json.loads((out / "run.json").read_text())["jobs"][-1]["superseded"] == str(aside)
    assert latest_step(out) == 2  # what a later --resume starts from


@pytest.mark.parametrize(
    "where, extra, match",
    [
        (
            "missing",
            [],
            r"--resume-from '.*step_00000009' is not a complete checkpoint: it does not exist",
        ),
        (
            "elsewhere",
            [],
            r"--resume-from '.*other/step_00000001' is not a checkpoint of the run in --out "
            r"'.*out' \(those are the step_XXXXXXXX folders in '.*out/ckpt': step_00000001, "
            r"step_00000002, step_00000003, step_00000004\); pass one of them",
        ),
        (
            "damaged",
            [],
            r"--resume-from '.*step_00000002' is damaged \(file .* does not match its recorded "
            r"sha256 \(corrupted\)\); pass an earlier complete checkpoint: '.*step_00000001'",
        ),
        ("finished", ["--steps", "2"], r"--resume-from: that checkpoint is step 2, --steps is 2"),
        ("overwrite", ["--overwrite"], r"--resume-from continues the run in --out, --overwrite"),
    ],
)
def test_resume_from_is_checked_before_any_spawn(where, extra, match, tmp_path, capsys):
    out, run = _run_with_four_checkpoints(tmp_path)
    target = out / "ckpt" / "step_00000002"
    if where == "missing":
        target = target.with_name("step_00000009")
    elif where == "elsewhere":
        target = tmp_path / "other" / "step_00000001"
        shutil.copytree(out / "ckpt" / "step_00000001", target)
    elif where == "damaged":
        _damage(target)
    before = sorted(p.name for p in (out / "ckpt").iterdir())
    _refused([*run[len(COMMON) :], "--resume-from", str(target), *extra], match, capsys)
    assert sorted(p.name for p in (out / "ckpt").iterdir()) == before
    assert not (out / "superseded").exists()


# ---- run files: whole or not at all -----------------------------------------------------------
def test_a_run_file_is_replaced_whole_or_left_as_it_was(tmp_path, monkeypatch):
    path = tmp_path / "summary.json"
    write_atomic(path, '{"old": 1}')

    def full(fd):  # a delayed allocation fails at the flush to the disk
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match=r"summary.json was not written \(No space left on device\)"):
        write_atomic(path, '{"new": 2}')
    assert json.loads(path.read_text()) == {"old": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]  # no temporary left


def test_a_metrics_record_is_appended_whole_or_not_at_all(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(path, append=False)
    log.append({"step": 0, "loss": 1.0})
    real = os.write
    calls = []

    def fills_up(fd, data):  # half of the record lands, then the disk is full
        calls.append(len(data))
        if len(calls) == 1:
            return real(fd, data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", fills_up)
    with pytest.raises(OSError, match=r"the record of step 1 was not written to metrics.jsonl"):
        log.append({"step": 1, "loss": 0.5})
    monkeypatch.setattr(os, "write", real)
    log.close()
    assert path.read_text() == '{"step": 0, "loss": 1.0}\n'  # the torn half is cut off


def test_read_metrics_skips_a_torn_last_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0, "loss": 1.0}\n{"step": 1, "lo')  # a job killed mid-write
    assert read_metrics(path) == [{"step": 0, "loss": 1.0}]


# ---- the run folder: writable, room for a checkpoint ------------------------------------------
def _deny_creating_in(monkeypatch, folder: Path, code: int) -> None:
    """Creating a file in ``folder`` fails with ``code`` (a read-only folder for root too)."""
    real = os.open

    def open_(path, flags, *args, **kwargs):
        if flags & os.O_CREAT and Path(path).parent == folder:
            raise OSError(code, os.strerror(code), str(path))
        return real(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", open_)


@pytest.mark.parametrize(
    "case, code, match",
    [
        ("out", errno.EACCES, r"--out '.*out' is not writable \(Permission denied\)"),
        ("out", errno.EROFS, r"--out '.*out' is not writable \(Read-only file system\)"),
        (
            "parent",
            errno.EACCES,
            r"--out '.*parent/out' cannot be created: '.*parent' is not writable \(Permission "
            r"denied\)",
        ),
    ],
)
def test_an_unwritable_out_is_refused_before_any_spawn(
    case, code, match, tmp_path, capsys, monkeypatch
):
    parent = tmp_path / "parent"
    parent.mkdir()
    out = parent / "out"
    if case == "out":
        out.mkdir()
    _deny_creating_in(monkeypatch, out if case == "out" else parent, code)
    _refused(["--out", str(out)], match + r"; pass an --out you can write to", capsys)
    assert list(parent.iterdir()) == ([out] if case == "out" else [])
    if case == "out":
        assert list(out.iterdir()) == []


@pytest.mark.skipif(
    os.geteuid() == 0,
    reason="root writes into a 0o555 folder anyway; the injected variant above covers it",
)
def test_a_read_only_out_is_refused_before_any_spawn(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    out.chmod(0o555)
    try:
        _refused(
            ["--out", str(out)], r"--out '.*out' is not writable \(Permission denied\)", capsys
        )
    finally:
        out.chmod(0o755)


def test_an_unwritable_checkpoint_folder_is_refused_before_any_spawn(tmp_path, capsys, monkeypatch):
    out, run = _run_with_four_checkpoints(tmp_path)
    _deny_creating_in(monkeypatch, out / "ckpt", errno.EACCES)
    _refused(
        [*run[len(COMMON) :], "--resume"],
        r"the checkpoint folder '.*out/ckpt' is not writable \(Permission denied\); make it "
        r"writable to continue the run there",
        capsys,
    )


_Usage = namedtuple("_Usage", "total used free")


def test_too_little_space_for_a_checkpoint_is_refused_before_any_spawn(
    tmp_path, capsys, monkeypatch
):
    monkeypatch.setattr(shutil, "disk_usage", lambda path: _Usage(10 << 20, 9 << 20, 1 << 20))
    out = tmp_path / "out"
    _refused(
        ["--out", str(out), "--ckpt-every", "1"],
        r"train: --ckpt-every 1: a checkpoint of llama-tiny with --optim adamw takes about "
        r"4.5 MiB \(391,584 parameters x 12 bytes: the parameters and the optimizer's "
        r"states\), but the filesystem of --out '.*out' has 1.0 MiB free; free some space, "
        r"pass another --out, or --ckpt-every 0",
        capsys,
    )
    assert not out.exists()


def test_the_space_check_counts_this_machines_share_of_a_checkpoint(tmp_path, monkeypatch):
    free = {"bytes": 3 << 20}
    monkeypatch.setattr(shutil, "disk_usage", lambda path: _Usage(1 << 40, 0, free["bytes"]))
    mesh = parse_train_mesh(None, 2)
    one = _args("--out", str(tmp_path), "--ckpt-every", "1")
    with pytest.raises(ValueError, match="has 3.0 MiB free"):
        resources.check_storage(one, mesh)
    # node 0 of 2 writes half of the checkpoint (its 2 of the 4 ranks' shards)
    two = _args("--out", str(tmp_path), "--ckpt-every", "1", "--nnodes", "2")
    two.rdzv_endpoint = "node0:29400"
    resources.check_storage(two, parse_train_mesh(None, 4))
    # no checkpoint, no space needed
    resources.check_storage(_args("--out", str(tmp_path)), mesh)
    free["bytes"] = 5 << 20
    resources.check_storage(one, mesh)


# ---- which rank the launcher names -------------------------------------------------------------
def _failures(codes: dict[int, int], stamp: float = 1000.0) -> dict:
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    found = {}
    for rank, code in codes.items():
        found[rank] = ProcessFailure(local_rank=rank, pid=4000 + rank, exitcode=code, error_file="")
        found[rank].timestamp = int(stamp)  # torchrun's clock: whole seconds
    return found


@pytest.mark.parametrize(
    "codes, match",
    [
        # kill -9 of rank 1: rank 0 fails at once on the reset connection, in the same second
        ({0: 1, 1: -9}, r"rank 1 was killed by signal 9 \(SIGKILL\).* \(1 other rank failed"),
        ({0: 3, 1: -9}, r"rank 1 was killed by signal 9 \(SIGKILL\)"),
        ({0: 3, 1: 1, 2: 3}, r"rank 1 exited with code 1 \(its message is above\) \(2 other"),
        ({0: 3}, r"rank 0 lost a peer in a collective \(a rank stopped or died without a word"),
        # a stopped rank 1: rank 0 times out, then torchrun's teardown SIGTERMs rank 1
        ({0: 3, 1: -15}, r"rank 0 lost a peer in a collective"),
    ],
)
def test_the_launcher_names_the_rank_that_failed_first_and_how(codes, match, tmp_path, capsys,
                                                              monkeypatch):  # fmt: skip
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    def run(config):
        raise ChildFailedError("raggedfsdp.train.loop", _failures(codes))

    monkeypatch.setattr(torchrun, "run", run)
    for name in ("RAGGEDFSDP_TRAIN_ARGS", "RAGGEDFSDP_LAUNCHER_PID", "OMP_NUM_THREADS"):
        monkeypatch.setenv(name, "1")
    assert torchrun_launch(_args("--out", str(tmp_path / "out"))) == 1
    err = capsys.readouterr().err
    assert re.search(r"train: failed: " + match, err), err


def test_a_rank_that_lost_its_peer_says_so_not_a_timeout(capsys):
    from raggedfsdp.train.guard import PEER_LOST_EXIT, Where, exit_code, report

    where = Where()
    where.at("forward", 3)
    lost = RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection reset by peer")
    report(lost, 0, where, 300.0)
    err = capsys.readouterr().err
    assert re.search(r"train: rank 0: step 3, forward: a collective on the process group lost "
                     r"its connection to a peer \(RuntimeError: .*Connection reset by peer\): a "
                     r"rank of that group died; the launcher's last line names the first that "
                     r"ended, and how", err), err  # fmt: skip
    assert "--timeout" not in err
    assert exit_code(lost) == PEER_LOST_EXIT and exit_code(ValueError("x")) == 1
    report(RuntimeError("Timed out waiting 5000ms for recv"), 1, where, 5.0)
    assert "got no answer within --timeout 5 s" in capsys.readouterr().err
