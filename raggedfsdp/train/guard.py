"""What a rank of ``python -m raggedfsdp train`` does when things go wrong.

[Note: how a rank fails]
- **Its launcher dies** (``kill -9``): the rank is killed with it
  (``PR_SET_PDEATHSIG``, set at start-up; where that does not exist, a thread that
  watches the parent). Checkpoints are crash-safe, so nothing is lost but the steps
  since the last one.
- **A collective gets no answer** within ``--timeout`` (a rank stopped, hung or dead):
  gloo raises after the process-group timeout; the rank names where it was (step,
  phase, the module whose all-gather it was in) and the process group, then exits.
- **The run diverges** (a nan or inf loss or gradient, seen by every rank through the
  loss all-reduce it already makes): every rank raises the same ``TrainError``;
  rank 0 prints it.
- **An error every rank raises alike** (the checkpoint API's: see [Note: errors reach
  every rank]): rank 0 prints one line. Any other error: each rank prints its own,
  with the traceback of an unexpected one.

A rank then leaves with ``os._exit``: a process group whose peer is gone cannot be
destroyed cleanly. Its exit code is ``PEER_LOST_EXIT`` (3) when a collective failed for
want of a peer (timed out, or its connection reset by a peer that died), else 1. The
launcher reports the failure in one line, naming the rank that caused it: a rank killed
by a signal first (it says nothing itself), then one that failed on its own (exit code
1), and only then one that lost a peer; the earliest among equals.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
import traceback

import torch.distributed as dist
from torch import nn

__all__ = [
    "PEER_LOST_EXIT",
    "TrainError",
    "Where",
    "collective_failure",
    "die_with_launcher",
    "exit_code",
    "report",
]

ARGS_ENV = "RAGGEDFSDP_TRAIN_ARGS"  # the checked arguments, JSON, from the launcher
LAUNCHER_PID = "RAGGEDFSDP_LAUNCHER_PID"
_PR_SET_PDEATHSIG = 1
PEER_LOST_EXIT = 3  # a rank's exit code when a collective failed: a peer stopped or died
_TIMED_OUT = ("Timed out", "timed out", "timeout")
_CONNECTION_LOST = ("Connection closed by peer", "Connection reset by peer", "pair closure")
_COLLECTIVE_FAILED = _TIMED_OUT + _CONNECTION_LOST


class TrainError(Exception):
    """A failure every rank sees alike (``agreed``): only rank 0 prints it."""

    def __init__(self, message: str, *, agreed: bool = True):
        super().__init__(message)
        self.agreed = agreed


# ---- the launcher ----------------------------------------------------------------------
def die_with_launcher() -> None:
    """Be killed when the launcher (this process's parent) dies. See [Note: how a rank fails]."""
    launcher = os.environ.get(LAUNCHER_PID)
    if launcher is None:
        return  # not started by `python -m raggedfsdp train`
    launcher = int(launcher)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl")
    except (OSError, AttributeError):  # not Linux: watch the parent instead
        threading.Thread(target=_watch, args=(launcher,), daemon=True).start()
    if os.getppid() != launcher:  # it died before the signal was armed
        os._exit(1)


def _watch(launcher: int) -> None:
    while os.getppid() == launcher:
        time.sleep(1.0)
    os._exit(1)


# ---- where a rank is ---------------------------------------------------------------------
def _group_text(group) -> str:
    if group is None or not dist.is_initialized():
        return "the process group"
    ranks = dist.get_process_group_ranks(group)
    which = "the default process group" if group is dist.group.WORLD else "a process group"
    shown = f"{ranks[0]}-{ranks[-1]}" if ranks == list(range(ranks[0], ranks[-1] + 1)) else ranks
    return f"{which} (ranks {shown}, {dist.get_backend(group)})"


class Where:
    """Where this rank is: the step, the phase, the ``fully_shard`` module it is in.

    Args:
        mesh_group: the process group of the model's mesh (its all-gathers and
            reduce-scatters run there).
    """

    def __init__(self, mesh_group=None):
        self.step: int | None = None
        self.phase = "start-up"
        self.module: str | None = None
        self.group = mesh_group
        self.mesh_group = mesh_group

    def at(self, phase: str, step: int | None = None, *, group="mesh") -> None:
        """Enter ``phase`` of training step ``step`` (None: outside the training steps: the
        phase says where), whose collectives run on ``group``."""
        self.phase, self.module, self.step = phase, None, step
        self.group = self.mesh_group if group == "mesh" else group

    def watch(self, model: nn.Module) -> None:
        """Record the ``fully_shard`` module each forward enters (before its all-gather)."""
        from torch.distributed.fsdp import FSDPModule  # raggedfsdp's subclass it

        for name, module in model.named_modules():
            if isinstance(module, FSDPModule):
                label = name or "the root"

                def enter(_module, _args, label=label):
                    self.module = label

                module.register_forward_pre_hook(enter, prepend=True)

    def describe(self) -> str:
        where = f"step {self.step}, " if self.step is not None else ""
        where += self.phase
        if self.module is not None and self.phase.startswith(("forward", "validation")):
            where += f" of {self.module!r} (its parameters' all-gather)"
        return where


def collective_failure(err: BaseException, kinds: tuple[str, ...] = _COLLECTIVE_FAILED) -> bool:
    """Whether ``err`` (or what caused it) is a collective that failed for want of a peer:
    timed out, or (``kinds=_CONNECTION_LOST``) its connection to a peer lost."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, RuntimeError) and any(s in str(err) for s in kinds):
            return True
        err = err.__cause__ or err.__context__
    return False


def exit_code(err: BaseException) -> int:
    """A failed rank's exit code: ``PEER_LOST_EXIT`` when a collective failed for want of a
    peer (the launcher then names the peer that ended first), else 1."""
    return PEER_LOST_EXIT if collective_failure(err) else 1


# ---- the message -------------------------------------------------------------------------
def report(err: BaseException, rank: int, where: Where, timeout_s: float) -> None:
    """Print what went wrong on this rank, once per failure (see [Note: how a rank fails])."""
    if isinstance(err, TrainError) and err.agreed:
        if rank == 0:
            print(f"train: {err}", file=sys.stderr)
    elif collective_failure(err, _CONNECTION_LOST):
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        print(
            f"train: rank {rank}: {where.describe()}: a collective on {_group_text(where.group)} "
            f"lost its connection to a peer ({type(err).__name__}: {first}): a rank of that "
            "group died; the launcher's last line names the first that ended, and how",
            file=sys.stderr,
        )
    elif collective_failure(err):
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        print(
            f"train: rank {rank}: {where.describe()}: a collective on {_group_text(where.group)} "
            f"got no answer within --timeout {timeout_s:g} s ({type(err).__name__}: {first}). "
            "A rank of that group is stopped, hung or dead: see its own message; raise "
            "--timeout if a step can legitimately take longer",
            file=sys.stderr,
        )
    elif isinstance(err, (ValueError, NotImplementedError, OSError, TrainError)):
        print(f"train: rank {rank}: {where.describe()}: {err}", file=sys.stderr)
    else:  # a bug: the traceback helps
        print(f"train: rank {rank}: {where.describe()}: unexpected error", file=sys.stderr)
        traceback.print_exception(err, file=sys.stderr)
    with contextlib.suppress(Exception):
        sys.stderr.flush()
