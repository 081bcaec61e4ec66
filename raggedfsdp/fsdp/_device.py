"""Streams and events of one device: the collectives' ordering on an accelerator.

[Note: streams]
FSDP2's pattern (``torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py``),
without ``record_stream``. On an accelerator the all-gathers run on their own
stream and the reduce-scatters on another, so that they overlap compute:

- **all-gather**: the stream first waits for the compute stream (the shard, which
  the optimizer wrote, is ready) and for the last reshard of any group (see below),
  then allocates the global storage, casts the shard (mixed precision) and issues
  the collective, all on the all-gather stream. ``work.wait()`` makes the compute
  stream wait for the result.
- **reshard** frees the global storage while compute kernels queued before it may
  still read it. The caching allocator gives a freed block back to the stream it
  was allocated on (the all-gather stream), so the all-gather stream waits on an
  event recorded on the compute stream at the reshard before it allocates again:
  no later gather can overwrite memory an earlier kernel still reads.
- **reduce-scatter**: under a ``reduce_dtype`` the gradients are first cast on the
  compute stream (as FSDP2's copy-in) and their compute-dtype storage is freed at
  once (both on the compute stream: safe). The reduce-scatter stream then waits for
  the compute stream and issues the collective. Its input (the cast, or without a
  ``reduce_dtype`` the global gradient storage itself, both allocated on the
  compute stream) lives in the pending reduce's record until ``wait``, and is
  released only after the compute stream waited for the collective.

On the CPU (and on ``meta``) there are no streams: every method is a no-op and the
collectives order themselves (gloo runs them on its own threads; ``wait`` joins).
One ``DeviceStreams`` exists per device, shared by every group on it, because a
block freed by one group can be reused by the next group's gather.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

__all__ = [
    "DeviceStreams",
    "can_pin_memory",
    "default_device_type",
    "mesh_device",
    "move_to_mesh_device",
    "new_group_like",
    "streams_for",
]


class DeviceStreams:
    """The all-gather and reduce-scatter streams of one device (None on the CPU).

    Args:
        device: the parameters' device.
    """

    def __init__(self, device: torch.device):
        self.device = device
        accelerator = torch.accelerator.current_accelerator() if device.type != "meta" else None
        self.accelerated = accelerator is not None and accelerator.type == device.type
        self.all_gather = torch.Stream(device=device) if self.accelerated else None
        self.reduce_scatter = torch.Stream(device=device) if self.accelerated else None
        self._last_reshard: torch.Event | None = None  # compute-stream event of the last free
        self._post_optim: torch.Event | None = None  # set_post_optim_event's, used once

    def wait_event(self, event: torch.Event) -> None:
        """The next gather waits on ``event`` instead of the whole compute stream
        (``FSDPModule.set_post_optim_event``)."""
        if self.accelerated:
            self._post_optim = event

    def _record(self) -> torch.Event | None:
        if not self.accelerated:
            return None
        event = torch.Event(device=self.device)
        event.record(torch.accelerator.current_stream(self.device))
        return event

    @contextlib.contextmanager
    def gathering(self):
        """Run the body (allocate, cast, issue the all-gather) on the all-gather stream."""
        if not self.accelerated:
            yield
            return
        ready, self._post_optim = self._post_optim or self._record(), None
        self.all_gather.wait_event(ready)
        if self._last_reshard is not None:
            self.all_gather.wait_event(self._last_reshard)
            self._last_reshard = None
        with self.all_gather:
            yield

    def resharded(self) -> None:
        """Call after freeing a global storage: later gathers wait for the kernels before."""
        if self.accelerated:
            self._last_reshard = self._record()

    @contextlib.contextmanager
    def reducing(self):
        """Run the body (cast, issue the reduce-scatter) on the reduce-scatter stream."""
        if not self.accelerated:
            yield
            return
        self.reduce_scatter.wait_event(self._record())
        with self.reduce_scatter:
            yield


# [Note: the mesh's device]
# FSDP2's rule, followed to the letter (``_init_default_mesh`` and ``_move_states_to_device``
# in ``torch/distributed/fsdp/_fully_shard/_fsdp_init.py``):
#
# - Without ``mesh=``, the mesh is over all ranks on torch's accelerator, the one torch was
#   built for (``torch._C._get_accelerator()``, which is ``current_accelerator()`` with no
#   runtime check: a CUDA build whose GPUs are hidden gets a CUDA mesh and fails there, as
#   FSDP2 does), else on the CPU. Not the parameters' device: a module built on the CPU
#   is sharded on the accelerator.
# - The call's parameters and its modules' buffers that are not on the mesh's device (the
#   accelerator's current device) move there before they are sharded; meta ones stay on
#   meta (deferred init), DTensors are left to their own mesh.
# - CPU offload pins its host storages when an accelerator is present (copies to it can
#   then be asynchronous); without one there is nothing to pin for (and torch cannot pin).


def default_device_type() -> str:
    """The device type of ``fully_shard``'s default mesh: see [Note: the mesh's device]."""
    acc = torch.accelerator.current_accelerator()
    return "cpu" if acc is None else acc.type


def can_pin_memory() -> bool:
    """Whether CPU offload pins host memory: an accelerator is present."""
    return torch.accelerator.is_available()


def mesh_device(mesh) -> torch.device:
    """The device of ``mesh`` on this process: the CPU, or the accelerator's current device."""
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(mesh.device_type, torch.accelerator.current_device_index())


def move_to_mesh_device(
    modules: Iterable[nn.Module],
    params: Iterable[nn.Parameter],
    mesh,
    is_managed: Callable[[nn.Module], bool],
) -> None:
    """Move ``params`` and the buffers of ``modules`` (and of their submodules that
    ``is_managed``) to ``mesh``'s device, in place; see [Note: the mesh's device].

    Args:
        modules: the modules of one ``fully_shard`` call.
        params: the parameters it shards.
        mesh: its mesh.
        is_managed: False for a submodule another ``fully_shard`` call holds (its subtree
            is that call's).
    """
    buffers: list[torch.Tensor] = []

    def visit(m: nn.Module) -> None:
        buffers.extend(b for b in m._buffers.values() if b is not None)
        for child in m.children():
            if is_managed(child):
                visit(child)

    for m in modules:
        visit(m)
    todo = [
        t for t in (*params, *buffers) if t.device.type != "meta" and not isinstance(t, DTensor)
    ]
    if not todo:
        return
    device = mesh_device(mesh)
    for t in todo:
        if t.device == device:
            continue
        if is_traceable_wrapper_subclass(t):  # its .data cannot be replaced: swap whole
            with torch.no_grad():
                moved = t.to(device)
                if isinstance(t, nn.Parameter):
                    moved = nn.Parameter(moved, requires_grad=t.requires_grad)
            torch.utils.swap_tensors(t, moved)
        else:
            t.data = t.to(device)


_STREAMS: dict[torch.device, DeviceStreams] = {}


def streams_for(device: torch.device) -> DeviceStreams:
    """The ``DeviceStreams`` of ``device`` (one per device, shared by its groups)."""
    device = torch.device(device)
    if device not in _STREAMS:
        _STREAMS[device] = DeviceStreams(device)
    return _STREAMS[device]


def new_group_like(ranks: list[int], parent) -> dist.ProcessGroup:
    """``dist.new_group(ranks)`` with the timeout of ``parent`` (torch's default otherwise
    waits 30 minutes, whatever ``init_process_group(timeout=)`` said)."""
    timeout = None
    for device in getattr(parent, "_device_types", ()):
        try:
            timeout = parent._get_backend(device).options._timeout
            break
        except (AttributeError, RuntimeError):
            continue
    return dist.new_group(ranks, timeout=timeout)
