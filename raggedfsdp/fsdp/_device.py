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

import torch
import torch.distributed as dist

__all__ = ["DeviceStreams", "new_group_like", "streams_for"]


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
