"""DBuffer: one flat buffer per param group; every parameter is a view into it.

[Note: zero-copy views]
A ``BufferLayout`` (the planner's) places each tensor of a group at an offset of a
global buffer of ``m * S`` elements, rank k owning ``[k * S, (k + 1) * S)``::

    global  |AAAAAAAA|AAAABBBB|B..CCCCC|CCCCCCC.|     m = 4, S = 8
    rank 0  |AAAAAAAA|                            shard storage = its 8 elements
    rank 2                    |B..CCCCC|

- **shard storage** (``S`` elements, persistent): the sharded parameter of each
  tensor is a view of it (a ``RaggedShard`` DTensor over a view: no copy).
- **global storage** (``m * S`` elements): allocated by ``global_params.alloc`` and freed
  by ``global_params.free`` as a whole (``untyped_storage().resize_``), so the unsharded
  parameters, views of it, stay valid for autograd across free / alloc.
- ``all_gather``: the shard storage (or one cast of it under mixed precision) is
  the all-gather input and the global storage its output: no copy-in, no copy-out.
- gradients go the other way: unsharded ``.grad``s are views of one flat global
  buffer, reduce-scattered in one collective into the shard gradient storage, whose
  views are the sharded ``.grad``s. That flat buffer is the global parameter storage
  itself (each gradient written over its parameter once autograd is done with it, see
  [Note: gradients in place] in ``fsdp/_grads.py``), or a global gradient
  storage of its own.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from raggedfsdp.planner import BufferLayout
from raggedfsdp.tensor.collectives import all_gather_single, reduce_scatter_single

__all__ = ["DBuffer", "FlatStorage"]


class FlatStorage:
    """A 1-D tensor whose storage is allocated and freed as a whole.

    Views taken of ``tensor`` stay valid across ``free`` / ``alloc``: they share the
    storage object, whose size alone changes. ``alias`` is a second tensor over the same
    storage with a version counter of its own: writes through it (and its views) do not
    bump the version that autograd checks on the views of ``tensor``.
    """

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device):
        self.tensor = torch.empty(numel, dtype=dtype, device=device)  # 1D, numel elements
        self.alias = torch.empty(0, dtype=dtype, device=device).set_(
            self.tensor.untyped_storage(), 0, (numel,), (1,)
        )  # 1D, numel elements: the same storage
        self._nbytes = self.tensor.untyped_storage().nbytes()
        self.free()

    @property
    def allocated(self) -> bool:
        return self.tensor.untyped_storage().nbytes() > 0

    def alloc(self, *, zero: bool = False) -> torch.Tensor:
        """Allocate the storage if it is freed (zero-filled then, with ``zero``)."""
        if not self.allocated:
            self.tensor.untyped_storage().resize_(self._nbytes)
            if zero:
                self.tensor.zero_()
        return self.tensor

    def free(self) -> None:
        if self.tensor.device.type != "meta" and self.allocated:
            self.tensor.untyped_storage().resize_(0)


class DBuffer:
    """The storages of one param group, laid out by a ``BufferLayout``.

    Args:
        layout: the group's plan (identical on every rank).
        rank: this rank's index on the mesh axis.
        dtype: the dtype of the parameters (shard storage, sharded gradients).
        device: where the global storages live (the compute device).
        compute_dtype: the dtype of the unsharded parameters and their gradients
            (mixed precision ``param_dtype``). Default: ``dtype``.
        shard_device: where the shard and shard gradient storages live: the CPU under
            CPU offload. Default: ``device``.
        pin_memory: pin the shard storages (CPU offload to an accelerator). Default False.
    """

    def __init__(
        self,
        layout: BufferLayout,
        rank: int,
        dtype: torch.dtype,
        device: torch.device,
        compute_dtype: torch.dtype | None = None,
        shard_device: torch.device | None = None,
        pin_memory: bool = False,
    ):
        self.layout = layout
        self.rank = rank
        self.dtype = dtype
        self.compute_dtype = compute_dtype or dtype
        shard_device = device if shard_device is None else shard_device
        S, m = layout.shard_size, layout.world_size
        self.shard = torch.zeros(S, dtype=dtype, device=shard_device)  # 1D, S elements
        if pin_memory:
            self.shard = self.shard.pin_memory()
        # 1D, S elements; freed while every sharded .grad is None (after zero_grad), so a
        # forward does not hold gradient memory FSDP2 would not hold either
        self.shard_grads = FlatStorage(S, dtype, shard_device)
        self.global_params = FlatStorage(m * S, self.compute_dtype, device)  # 1D, m*S
        self.global_grads = FlatStorage(m * S, self.compute_dtype, device)  # 1D, m*S

    @property
    def shard_grad(self) -> torch.Tensor:
        """The shard gradient storage (1D, S elements; size 0 while freed)."""
        return self.shard_grads.tensor

    # ---- views ----------------------------------------------------------------------------
    def local_view(self, flat: torch.Tensor, name: str) -> torch.Tensor:
        """``name``'s local tensor as a view of ``flat`` (1D, S elements, laid out as the
        shard storage): ``RaggedShard.local_shape``; a gapped stack's whole members are
        ``member_stride`` apart (see [Note: member gaps] in ``raggedfsdp.planner``)."""
        size, stride, offset = self.layout.local_view_args(name, self.rank)
        if self.layout[name].members == 1:
            return flat[offset : offset + math.prod(size)].view(size)
        return flat[offset:].as_strided(size, stride)

    def shard_view(self, name: str) -> torch.Tensor:
        """This rank's part of ``name`` in the shard storage, shaped as its local tensor:
        ``(rows, *rest)``, or ``(n, out, in)`` for a stack with member gaps (a strided
        view, whole members ``member_stride`` apart)."""
        return self.local_view(self.shard, name)

    def shard_grad_view(self, name: str) -> torch.Tensor:
        """This rank's part of ``name``'s gradient in the shard gradient storage."""
        return self.local_view(self.shard_grad, name)

    def _global_view(self, flat: torch.Tensor, name: str) -> torch.Tensor:
        size, stride, offset = self.layout.unsharded_view_args(name)
        return flat.as_strided(size, stride, offset)

    def global_view(self, name: str) -> torch.Tensor:
        """The unsharded ``name``: a view of the global parameter storage."""
        return self._global_view(self.global_params.tensor, name)

    def global_grad_view(self, name: str, *, in_params: bool = False) -> torch.Tensor:
        """The unsharded gradient of ``name``: a view of the global gradient storage, or
        with ``in_params`` of the global parameter storage (through its ``alias``)."""
        flat = self.global_params.alias if in_params else self.global_grads.tensor
        return self._global_view(flat, name)

    def global_spans(self, name: str) -> list[tuple[int, int]]:
        """The ``[start, stop)`` element ranges ``name`` covers in the global storages
        (one, or one per member of a stack with member gaps)."""
        t = self.layout[name]
        if t.members == 1:
            return [(t.offset, t.offset + t.numel)]
        starts = (t.offset + j * t.member_stride for j in range(t.members))
        return [(start, start + t.member_numel) for start in starts]

    # ---- collectives ----------------------------------------------------------------------
    def all_gather_input(self) -> torch.Tensor:
        """What the all-gather sends: the shard storage itself, or under mixed precision
        one cast of the whole shard (on the global storage's device)."""
        device = self.global_params.tensor.device
        inp = self.shard.to(device, non_blocking=True)  # the shard itself unless offloaded
        if self.compute_dtype != self.dtype:
            inp = inp.to(self.compute_dtype)  # one cast of the whole shard
        return inp

    def all_gather(self, group, *, async_op: bool) -> tuple[dist.Work | None, torch.Tensor]:
        """Fill the global parameter storage from every rank's shard: one collective.

        Returns:
            ``(work, input)``: keep ``input`` alive until the work is waited.
        """
        out = self.global_params.alloc()
        inp = self.all_gather_input()
        return all_gather_single(out, inp, group=group, async_op=async_op), inp

    def reduce_scatter_grads(
        self,
        out: torch.Tensor,
        group,
        op,
        reduce_dtype: torch.dtype,
        *,
        async_op: bool,
        source: torch.Tensor | None = None,
        before: Callable[[torch.Tensor], None] | None = None,
        comm=None,
    ) -> tuple[dist.Work | None, torch.Tensor | None]:
        """Reduce-scatter the global gradient storage (or ``source``, laid out like it)
        into ``out`` (S elements).

        Args:
            before: applied in place to the input (in the reduce dtype) before the
                collective: a division of the gradients before they are summed.
            comm: a custom reduce-scatter (FSDP2's ``ReduceScatter``), called with the
                same in-place input and output, synchronously as FSDP2 calls it.

        Returns:
            ``(work, input)``: the input when it is not the global gradient storage
            (a reduce-dtype cast, or ``source``); keep it alive until the work is waited.
        """
        inp = self.global_grads.tensor if source is None else source
        if reduce_dtype != inp.dtype:
            inp = inp.to(reduce_dtype)  # one cast of the whole buffer
        if before is not None:
            before(inp)
        if comm is None:
            work = reduce_scatter_single(out, inp, op=op, group=group, async_op=async_op)
        else:
            work = comm(output_tensor=out, input_tensor=inp, group=group, op=op)
        return work, None if inp is self.global_grads.tensor else inp
