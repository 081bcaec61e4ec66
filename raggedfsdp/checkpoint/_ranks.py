"""The ranks a checkpoint is written by, and how an error on one of them reaches all.

[Note: errors reach every rank]
``save`` and ``load`` alternate local work (collect the state, hash files, write the
marker) with collectives. An exception that one rank raises between two collectives
would leave the others blocked in the next one until the process-group timeout. So
every local phase runs under ``try``, and its outcome goes through one collective
(``Ranks.exchange``) before anything else: if any rank failed, every rank raises the
lowest failing rank's exception (the failing rank its own object, with its traceback;
the others a copy, with a note naming the rank). An exception that does not pickle
travels as a ``RuntimeError`` carrying its type and text. DCP's own ``save`` / ``load``
already gather their ranks' exceptions into one ``CheckpointException`` raised on
every rank.
"""

from __future__ import annotations

import contextlib
import pickle
import warnings

import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["Ranks", "default_group", "portable", "quiet", "side_group"]


def portable(error: BaseException) -> BaseException:
    """``error`` itself if it survives pickling, else a ``RuntimeError`` with its type and text."""
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")
    return error


class Ranks:
    """The ranks a checkpoint is written by: a process group, or one process without one."""

    def __init__(self, group):
        self.group = group
        self.dist = group is not None
        self.rank = dist.get_rank(group) if self.dist else 0
        self.world = dist.get_world_size(group) if self.dist else 1

    def all_gather(self, obj) -> list:
        if not self.dist:
            return [obj]
        out = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def exchange(self, value, error: BaseException | None = None) -> list:
        """Every rank's ``value``; raises on every rank if any rank passed an ``error``.

        See [Note: errors reach every rank].

        Args:
            value: what this rank contributes (picklable); ignored when ``error`` is set.
            error: the exception this rank's local phase raised, or None.

        Returns:
            The values of all ranks, in rank order.
        """
        sent = (None, portable(error)) if error is not None else (value, None)
        gathered = self.all_gather(sent) if self.dist else [sent]
        failed = [(r, e) for r, (_, e) in enumerate(gathered) if e is not None]
        if failed:
            first_rank, first = failed[0]
            if first_rank == self.rank:
                assert error is not None  # this rank's own
                raise error
            if self.world > 1:
                first.add_note(f"(raised on rank {first_rank} of {self.world}: on every rank)")
            if error is not None:
                raise first from error
            raise first
        return [v for v, _ in gathered]

    def agree(self, error: BaseException | None) -> None:
        """Raise the first failing rank's error on every rank (``exchange`` without values)."""
        self.exchange(None, error)

    def barrier(self) -> None:
        if self.dist:
            dist.barrier(group=self.group)


@contextlib.contextmanager
def quiet(ranks: Ranks):
    """Silence DCP's warning that one process without a process group is one process."""
    if ranks.dist:
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def default_group(model: nn.Module, process_group):
    """Every rank of the model's device mesh (the root mesh of its first DTensor: a
    ``(dp, tp)`` mesh's tp ranks save and load with the dp ranks), else the default
    group, else None."""
    if process_group is not None:
        return process_group
    if not dist.is_initialized():
        return None
    for p in model.parameters():
        if isinstance(p, DTensor):
            return _mesh_group(p.device_mesh._get_root_mesh())
    return dist.group.WORLD


_MESH_GROUPS: dict = {}


def _mesh_group(mesh):
    """Every rank of ``mesh`` (a 2-D HSDP mesh too: its replicas save and load together)."""
    if mesh.ndim == 1:
        return mesh.get_group(0)
    ranks = tuple(mesh.mesh.flatten().tolist())
    if sorted(ranks) == list(range(dist.get_world_size())):
        return dist.group.WORLD
    if ranks not in _MESH_GROUPS:
        _MESH_GROUPS[ranks] = dist.new_group(list(ranks), use_local_synchronization=True)
    return _MESH_GROUPS[ranks]


_SIDE_GROUPS: dict = {}


def side_group(group):
    """A gloo group with ``group``'s ranks, for an async save's collectives.

    The background thread must not share a group with training collectives: two
    threads issuing collectives on one group can pair them differently on each rank.
    """
    if group is None:
        return None
    if group not in _SIDE_GROUPS:
        ranks = dist.get_process_group_ranks(group)
        _SIDE_GROUPS[group] = dist.new_group(ranks, backend="gloo", use_local_synchronization=True)
    return _SIDE_GROUPS[group]
