"""ParamGroup: the parameters of one ``fully_shard`` call, one DBuffer, one collective each way."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from raggedfsdp.dbuffer import DBuffer
from raggedfsdp.fsdp._buffers import OWNER_ATTR, BufferView
from raggedfsdp.fsdp._policy import MixedPrecisionPolicy, resolve_block_rows
from raggedfsdp.placement import RaggedShard
from raggedfsdp.planner import TensorSpec, plan_buffer

__all__ = ["ParamGroup", "ParamRef", "ShardedState", "owner_of"]


def owner_of(param: torch.Tensor) -> tuple[ParamGroup, ParamRef] | None:
    """The ``(ParamGroup, ParamRef)`` of a sharded parameter, or None for other tensors."""
    owner = getattr(param, OWNER_ATTR, None)
    if owner is None:
        return None
    group, index = owner
    return group, group.refs[index]


class ShardedState(enum.Enum):
    SHARDED = "sharded"  # modules hold the RaggedShard parameters
    UNSHARDED = "unsharded"  # modules hold views of the global storage


@dataclass(eq=False)
class ParamRef:
    """One parameter of a group and every module attribute that holds it."""

    fqn: str
    uses: list[tuple[nn.Module, str]]  # (module, attribute); tied parameters have several
    shape: torch.Size
    requires_grad: bool
    placement: RaggedShard | None = None
    sharded: nn.Parameter | None = None  # DTensor(RaggedShard) over a shard-storage view
    unsharded: nn.Parameter | None = None  # plain tensor over a global-storage view
    sharded_grad: DTensor | None = None  # DTensor over a shard-gradient view (cached)
    got_grad: bool = False  # this rank accumulated a gradient into it this backward
    hooks: list = field(default_factory=list)

    def register(self, param: nn.Parameter) -> None:
        for module, name in self.uses:
            module._parameters[name] = param


class ParamGroup:
    """One buffer's worth of parameters: shard, unshard, reshard, reduce gradients.

    Args:
        refs: the group's parameters (module order).
        mesh: a 1-D DeviceMesh.
        mp_policy: mixed precision.
        block_policy: rows per block, see ``BlockPolicy``.
        alignment_bytes: planner alignment.
    """

    def __init__(
        self, refs, originals, mesh, mp_policy: MixedPrecisionPolicy, block_policy, alignment_bytes
    ):
        self.refs: list[ParamRef] = refs
        self.view = BufferView(self)  # the public handle (raggedfsdp.fsdp.buffers_of)
        self.mesh = mesh
        self.process_group = mesh.get_group(0)
        self.rank, self.world = mesh.get_local_rank(0), mesh.size(0)
        dtypes = {p.dtype for p in originals}
        if len(dtypes) != 1:
            raise NotImplementedError(
                f"fully_shard: parameters {[r.fqn for r in refs]} mix dtypes "
                f"{sorted(map(str, dtypes))}; "
                "one group holds one dtype: cast the module, or fully_shard the parts separately"
            )
        self.dtype = dtypes.pop()
        self.device = originals[0].device
        self.mp_policy = mp_policy
        self.compute_dtype = mp_policy.param_dtype or self.dtype
        self.reduce_dtype = mp_policy.reduce_dtype or self.compute_dtype
        specs = []
        for ref, p in zip(refs, originals):
            if p.dim() == 0:
                raise NotImplementedError(
                    f"fully_shard: parameter {ref.fqn!r} is 0-d; RaggedShard cuts dims: pass it "
                    "in ignored_params or make it shape (1,)"
                )
            rows = resolve_block_rows(block_policy, ref.fqn, p)
            specs.append(
                TensorSpec(name=ref.fqn, shape=tuple(p.shape), block_rows=rows, stack=p.dim() >= 3)
            )
        self.layout = plan_buffer(
            specs, self.world, dtype=self.dtype, alignment_bytes=alignment_bytes
        )
        self.dbuf = DBuffer(self.layout, self.rank, self.dtype, self.device, self.compute_dtype)
        for ref, p in zip(refs, originals):
            ref.placement = self.layout.ragged_shard(ref.fqn)
            if self.device.type != "meta":
                full = p.detach().contiguous()
                self.dbuf.shard_view(ref.fqn).copy_(ref.placement.local_view(full, self.rank))
            self._make_sharded(ref)
            ref.register(ref.sharded)
        self.state = ShardedState.SHARDED
        self._gather_work: dist.Work | None = None
        self._gather_version = 0
        self._post_forward_shard: torch.Tensor | None = None  # reshard_after_forward=int
        self._post_forward_group = None
        self._post_forward_rank = 0
        self.needs_post_backward = False
        self._grads_unsynced = False  # unsharded grads kept across no-sync microbatches
        self._reduce: tuple | None = None  # (work, target, accumulate) until finalized
        self.requires_gradient_sync = True
        self.gradient_divide_factor: float | None = None

    # ---- construction ---------------------------------------------------------------------
    def _make_sharded(self, ref: ParamRef) -> None:
        local = self.dbuf.shard_view(ref.fqn)
        stride = torch.empty(ref.shape, device="meta").stride()
        dt = DTensor.from_local(local, self.mesh, [ref.placement], shape=ref.shape, stride=stride)
        if ref.sharded is None:
            ref.sharded = nn.Parameter(dt, requires_grad=ref.requires_grad)
        else:  # re-point an existing parameter (after to_empty / _apply), keeping its identity
            ref.sharded._local_tensor = dt._local_tensor
        setattr(ref.sharded, OWNER_ATTR, (self, self.refs.index(ref)))

    def reset_after_apply(self) -> None:
        """Rebuild the storages after ``Module._apply`` (``to_empty``, ``to``, ``float``).

        ``_apply`` gives each parameter new local data; copy it into fresh shard
        storage on its device and make the parameters views again.
        """
        current = {ref.fqn: ref.uses[0][0]._parameters[ref.uses[0][1]] for ref in self.refs}
        first = next(iter(current.values()))
        local0 = first._local_tensor if isinstance(first, DTensor) else first
        if (local0.device, local0.dtype) == (self.dbuf.shard.device, self.dtype):
            return
        self.device, self.dtype = local0.device, local0.dtype
        self.compute_dtype = self.mp_policy.param_dtype or self.dtype
        self.reduce_dtype = self.mp_policy.reduce_dtype or self.compute_dtype
        self.dbuf = DBuffer(self.layout, self.rank, self.dtype, self.device, self.compute_dtype)
        for ref in self.refs:
            new = current[ref.fqn]
            self.dbuf.shard_view(ref.fqn).copy_(
                new._local_tensor if isinstance(new, DTensor) else new
            )
            if ref.sharded is not new:
                ref.sharded = None  # _apply made a new Parameter: adopt a fresh one
            self._make_sharded(ref)
            ref.unsharded, ref.sharded_grad = None, None
            ref.register(ref.sharded)

    # ---- unshard / reshard ----------------------------------------------------------------
    def unshard(self, async_op: bool = False) -> None:
        """Start (or do) the all-gather of the global storage; ``wait_for_unshard`` ends it."""
        if self.state is ShardedState.UNSHARDED or self._gather_work is not None:
            return
        if self.device.type == "meta":
            raise RuntimeError(
                f"fully_shard: parameters {[r.fqn for r in self.refs][:3]}... are still on the "
                "meta device; call module.to_empty(device=...) and initialise them before forward"
            )
        # [Note: version counter] autograd saved the unsharded parameters in forward;
        # refilling their storage for backward is the point, so the all-gather must not
        # bump their version counter. gloo writes the output on its own thread (the bump
        # can land any time before wait()), so the version is restored after the wait.
        self._gather_version = self.dbuf.global_params.tensor._version
        if self._post_forward_shard is not None:  # reshard_after_forward=int: a smaller gather
            out = self.dbuf.global_params.alloc()
            work = dist.all_gather_single(
                out, self._post_forward_shard, group=self._post_forward_group, async_op=True
            )
        else:
            work = self.dbuf.all_gather(self.process_group, async_op=True)
        self._gather_work = work
        if not async_op:
            self.wait_for_unshard()

    def wait_for_unshard(self) -> None:
        if self._gather_work is None:
            assert self.state is ShardedState.UNSHARDED, "wait_for_unshard before unshard"
            return
        self._gather_work.wait()
        self._gather_work = None
        torch._C._autograd._unsafe_set_version_counter(
            (self.dbuf.global_params.tensor,), (self._gather_version,)
        )  # see [Note: version counter]
        self._post_forward_shard = None
        for ref in self.refs:
            if ref.unsharded is None:
                ref.unsharded = nn.Parameter(
                    self.dbuf.global_view(ref.fqn), requires_grad=ref.requires_grad
                )
                if ref.requires_grad:
                    ref.hooks.append(
                        ref.unsharded.register_post_accumulate_grad_hook(_mark_got_grad(ref))
                    )
            ref.register(ref.unsharded)
        self.state = ShardedState.UNSHARDED

    def reshard(self, keep_group=None) -> None:
        """Free the global storage; the modules hold the sharded parameters again.

        Args:
            keep_group: ``(process group, position, ranks)`` of a smaller group to keep
                the parameters sharded over (``reshard_after_forward=int``); None frees all.
        """
        if self._gather_work is not None:
            self.wait_for_unshard()
        if self.state is ShardedState.SHARDED:
            return
        if keep_group is not None:
            group, position, size = keep_group
            piece = self.dbuf.global_params.tensor.numel() // size
            self._post_forward_shard = self.dbuf.global_params.tensor[
                position * piece : (position + 1) * piece
            ].clone()
            self._post_forward_group = group
        self.dbuf.global_params.free()
        for ref in self.refs:
            ref.register(ref.sharded)
        self.state = ShardedState.SHARDED

    # ---- gradients ------------------------------------------------------------------------
    def release_dropped_grads(self) -> None:
        """Free the shard gradient storage if every sharded ``.grad`` was dropped."""
        if self._reduce is None and all(ref.sharded.grad is None for ref in self.refs):
            self.dbuf.shard_grads.free()

    def prepare_grads(self) -> None:
        """Point every unsharded ``.grad`` at the flat global gradient storage (pre-backward)."""
        self.needs_post_backward = True
        grads = self.dbuf.global_grads
        if not grads.allocated:
            grads.alloc().zero_()
        for ref in self.refs:
            if ref.requires_grad and ref.unsharded is not None and ref.unsharded.grad is None:
                ref.unsharded.grad = self.dbuf.global_grad_view(ref.fqn)

    def post_backward(self, reshard: bool) -> None:
        """The group's gradients are complete: start the reduce-scatter (or keep them)."""
        self.needs_post_backward = False
        if reshard:
            self.reshard()
        if not self.requires_gradient_sync:
            self._grads_unsynced = True
            return
        self._grads_unsynced = False
        if not self.dbuf.global_grads.allocated:
            return
        accumulate = any(ref.sharded.grad is not None for ref in self.refs)
        direct = not accumulate and self.reduce_dtype == self.dtype
        # The reduce-scatter writes every element (padding too) on the direct path;
        # otherwise only parameters' parts are written: start from zeros.
        self.dbuf.shard_grads.alloc(zero=not direct)
        target = (
            self.dbuf.shard_grad
            if direct
            else self.dbuf.shard_grad.new_empty(self.layout.shard_size, dtype=self.reduce_dtype)
        )
        op = dist.ReduceOp.AVG if self.gradient_divide_factor is None else dist.ReduceOp.SUM
        work = self.dbuf.reduce_scatter_grads(
            target, self.process_group, op, self.reduce_dtype, async_op=True
        )
        self._reduce = (work, target, direct)

    @property
    def reduce_pending(self) -> bool:
        return self._reduce is not None

    def wait_reduce(self) -> None:
        """Wait for the reduce-scatter and free the unsharded gradients (the whole buffer)."""
        if self._reduce is None or self._reduce[0] is None:
            return
        work, target, direct = self._reduce
        work.wait()
        self._reduce = (None, target, direct)
        for ref in self.refs:
            if ref.unsharded is not None:
                ref.unsharded.grad = None
        self.dbuf.global_grads.free()

    def local_grad_flags(self) -> list[bool]:
        return [ref.got_grad for ref in self.refs]

    def finalize_grads(self, got_grad: list[bool]) -> None:
        """Wait for the reduce-scatter and set the sharded ``.grad``s (views of shard grads)."""
        self.wait_reduce()
        _, target, direct = self._reduce
        self._reduce = None
        if self.gradient_divide_factor is not None:
            target.div_(self.gradient_divide_factor)
        if not direct and all(ref.sharded.grad is None for ref in self.refs):
            # only a dtype differs (reduce_dtype != param dtype): one cast of the buffer
            self.dbuf.shard_grad.copy_(target)
            direct = True
        for ref, any_rank_got_grad in zip(self.refs, got_grad):
            ref.got_grad = False
            if not ref.requires_grad or not any_rank_got_grad:
                if not direct and ref.sharded.grad is None:
                    # keep the buffer's norm exact: no stale values where .grad is None
                    self.dbuf.shard_grad_view(ref.fqn).zero_()
                continue
            if ref.sharded_grad is None:
                ref.sharded_grad = DTensor.from_local(
                    self.dbuf.shard_grad_view(ref.fqn),
                    self.mesh,
                    [ref.placement],
                    shape=ref.shape,
                    stride=ref.sharded.stride(),
                )
            existing = ref.sharded.grad
            if not direct:
                start, stop = self.layout.shard_range(ref.fqn, self.rank)
                part = target[start:stop].view(ref.sharded_grad._local_tensor.shape)
                if existing is None:
                    ref.sharded_grad._local_tensor.copy_(part)
                else:
                    existing._local_tensor.add_(part)
                    continue
            ref.sharded.grad = ref.sharded_grad


def _mark_got_grad(ref: ParamRef):
    def hook(_param):
        ref.got_grad = True

    return hook
