"""FSDP2's tensor-subclass all-gather protocol on RaggedShard buffers.

[Note: tensor-subclass all-gather]
A parameter whose tensor defines ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``
(torchao's float8 weights, NF4, TransformerEngine) is gathered as the subclass asks,
not as its own bytes, as in FSDP2 (torch 2.13's ``_fsdp_param.py``); a tensor subclass
without the hooks is gathered as its values, as FSDP2's default path gathers it:

- It keeps its class. ``fully_shard`` plans such parameters into buffers of their own
  (never beside plain ones, which stay zero-copy views), and where one buffer would
  leave a rank none of a parameter that has a row for every rank, one buffer each
  (the hooks run on every rank's rows, and torchao's amax cannot take none; FSDP2's
  even chunks never leave a rank empty either). The sharded parameter is a
  ``RaggedShard`` DTensor whose local tensor is either
  - the subclass rebuilt by ``__tensor_unflatten__`` around this rank's rows of the
    shard storage, where it can be (the hooks, one plain inner tensor holding its
    values as they are, a 4-argument ``__tensor_unflatten__``): an optimizer that
    updates it (or the buffer) updates the other; or
  - otherwise (two inner tensors, as torch's TwoTensor; no hooks; no
    ``__tensor_flatten__``; a ``__tensor_unflatten__`` of another signature, which
    FSDP2 never calls) this rank's rows of the parameter taken by the subclass's own
    ops (``param[r0:r1].clone()``, as FSDP2's chunk), *held* by the parameter: its span
    of the shard storage is unused, ``buffer_of`` does not find it, and optimizers step
    it on its own (its ``.grad`` is still a view of the buffer's gradient storage).
- ``unshard`` calls ``fsdp_pre_all_gather(shard_mesh, outer_size, outer_stride, module,
  mp_policy)`` (or FSDP2's older ``fsdp_pre_all_gather(mesh)``) on each local shard:
  rows ``r0:r1`` of the parameter, possibly none, a different count on each rank (an
  input padded to FSDP2's even chunk, ``ceil(rows / world)`` rows, as FSDP2 asks of
  hooks where its chunks are uneven, is cut to the rank's rows first). The
  hooks are read at each gather, as FSDP2 reads them, so hooks set on a local tensor
  after ``fully_shard`` count. Without hooks the input is the local tensor copied into a
  plain tensor by the subclass's own ``copy_`` (FSDP2's copy-in), cast to
  ``param_dtype``; an input a hook returns as a subclass is copied the same way. Every
  all-gather input must have those rows as dim 0 (its other dims the same on every
  rank); where every rank holds as many rows, any shape is taken, as FSDP2 does. All the
  buffer's inputs are copied into one byte buffer per rank, padded to the largest rank's
  (each rank knows every rank's rows from the layout), and gathered in one collective.
- ``wait_for_unshard`` copies each input's pieces, rank after rank, into one output of
  the parameter's full rows (the same tensor every step, its storage freed at reshard
  as FSDP2 frees its all-gather outputs) and calls ``fsdp_post_all_gather(outputs,
  metadata, param_dtype)`` (without hooks the output is the parameter); the module holds
  an ``nn.Parameter`` of what it returns (``as_strided`` to the parameter's shape, as
  FSDP2). Later gathers call it with ``out=`` that parameter, after reallocating the
  inner tensors it said to free.
- Gradients are plain tensors, as FSDP2's: the group's gradient storage takes them as
  it takes every other ([Note: gradient storage]; never written over the parameters,
  which are not views of the buffer), so the reduce-scatter, the sharded ``.grad`` and
  optimizers are unchanged. A gradient that is itself a subclass (a TwoTensor's) is
  copied into a plain tensor by its ``copy_``, as FSDP2 copies it into its
  reduce-scatter input.

What it costs against a plain parameter of the same buffer kind: the subclass's own
``fsdp_pre_all_gather`` work (a cast or a quantization: one new tensor per input), one
copy-in of each input into the send buffer, and one copy-out of the gathered bytes into
each output, as FSDP2 makes them; a plain parameter has neither copy (the shard is the
send buffer, the unsharded parameter a view of the receive buffer). Its gradients cost
what a plain parameter's cost under ``grads_in_params=False``: a zeroed view of the
gradient storage that autograd adds into (no copy unless a ``.grad`` is replaced). A
module holding both kinds has two buffers, so one more all-gather and reduce-scatter
per gather than FSDP2's one per group. A held parameter's span of the shard storage is
memory FSDP2 does not spend (its rows once more, over the ranks). What it saves is the
subclass's point: torchao's float8 inputs are a quarter of fp32's bytes on the wire.
``Float8BlockAllGather`` stays the copy-free way to gather FP8 (no amax all-reduce).

Not supported, refused by ``fully_shard`` naming the parameter: a parameter of 3 or more
dims (RaggedShard cuts its flattened leading dims, not dim 0), FP8 block all-gather of
it, CPU offload, tensor parallelism. Hooks set after ``fully_shard`` on the local tensor
of a *plain* parameter (a view of a plain buffer) are refused at the first forward.
``reshard_after_forward=int`` reshards such buffers fully (FSDP2 refuses it for them).
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.utils._python_dispatch import TraceableWrapperSubclass, is_traceable_wrapper_subclass

from raggedfsdp.fsdp._mesh import shard_mesh
from raggedfsdp.tensor.collectives import all_gather_single

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

    from raggedfsdp.fsdp._policy import MixedPrecisionPolicy
    from raggedfsdp.fsdp._records import ParamRef

__all__ = ["SubclassGather", "is_plain", "subclass_params", "values_of"]

_PRE, _POST = "fsdp_pre_all_gather", "fsdp_post_all_gather"
_ALIGN = 16  # bytes: every piece of the send buffer starts aligned for any dtype's view


def is_plain(t: torch.Tensor) -> bool:
    """A tensor whose values are all there is to it (a mode's tensor counts as plain)."""
    if type(t) in (torch.Tensor, nn.Parameter):
        return True
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor

    return isinstance(t, (FakeTensor, FunctionalTensor))


def values_of(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values as a plain tensor (detached): its one inner tensor for a subclass
    whose sharded parameter is a view of the buffer (``SubclassGather.holds`` False)."""
    if is_plain(t):
        return t.detach()
    names, _ = cast(
        TraceableWrapperSubclass, t
    ).__tensor_flatten__()  # torchao's adds a precomputed scale after the first
    return getattr(t, names[0]).detach()


def subclass_params(refs, originals, specs, *, fp8_selected, offload) -> set[int]:
    """Indices of the tensor-subclass parameters, gathered through FSDP2's protocol or,
    without its hooks, as their plain values (see [Note: tensor-subclass all-gather]).
    Runs before ``fully_shard`` changes anything.

    Raises:
        NotImplementedError: a tensor subclass this path cannot keep (named).
        ValueError: hooks FSDP2 would reject too (one of the two, a wrong signature).
    """
    chosen = set()
    for i, (ref, p, spec) in enumerate(zip(refs, originals, specs)):
        local = p.to_local() if ref.tp is not None else p
        if is_plain(local):
            continue
        what = f"fully_shard: parameter {ref.fqn!r} is a {type(local).__name__}"
        pre, post = hasattr(local, _PRE), hasattr(local, _POST)
        if pre != post:
            raise ValueError(
                f"{what} with only {_PRE if pre else _POST}; FSDP2's all-gather protocol "
                "needs both hooks: define both"
            )
        if pre:
            _pre_all_gather_args(local, what)
        _check_supported(ref, local, spec, what, i in fp8_selected, offload)
        chosen.add(i)
    return chosen


def _pre_all_gather_args(t: torch.Tensor, what: str) -> int:
    """How many arguments ``t.fsdp_pre_all_gather`` takes: 5, or FSDP2's older 1 (mesh)."""
    n = len(inspect.signature(getattr(t, _PRE)).parameters)
    if n not in (1, 5):
        raise ValueError(
            f"{what} whose {_PRE} takes {n} arguments; FSDP2's protocol is {_PRE}(self, mesh, "
            "outer_size, outer_stride, module, mp_policy) (or the older (self, mesh))"
        )
    return n


def _check_supported(ref, local: torch.Tensor, spec, what: str, fp8: bool, offload: bool) -> None:
    if ref.tp is not None and ref.tp.model_parallel:
        # a DTensor on the SPMD mesh's data-parallel dims alone is gathered as a classic one
        raise NotImplementedError(
            f"{what} inside a tensor-parallel DTensor; the all-gather protocol under FSDP x TP "
            "is not supported yet: fully_shard such modules without tensor parallelism"
        )
    if offload:
        raise NotImplementedError(
            f"{what} (FSDP2's all-gather protocol) with CPU offload, not supported yet: "
            "drop offload_policy for this module, or pass the parameter in ignored_params"
        )
    if fp8:
        raise NotImplementedError(
            f"{what} (FSDP2's all-gather protocol), and MixedPrecisionPolicy.all_gather "
            "(Float8BlockAllGather) selects it too; one parameter has one gather: leave "
            "all_gather unset for this module, or use a plain weight with Float8BlockAllGather"
        )
    if local.dim() > 2 or spec.stack:
        raise NotImplementedError(
            f"{what} of {local.dim()}-D shape {tuple(local.shape)}; RaggedShard cuts its "
            "flattened leading dims, and the all-gather protocol takes dim-0 rows: reshape "
            "it to 2-D, or pass it in ignored_params"
        )


@dataclass(eq=False)
class _Piece:
    """Where one all-gather input lies: the same on every rank (from the layout)."""

    dtype: torch.dtype
    shapes: list[tuple[int, ...]]  # each rank's input shape
    out_shape: tuple[int, ...]  # the output: the ranks' inputs concatenated on dim 0
    sizes: list[int]  # bytes each rank sends
    offsets: list[int] = field(default_factory=list)  # where they start in its send buffer


def _viewable(t: torch.Tensor) -> bool:
    """Whether ``t``'s sharded parameter can be the subclass rebuilt around a view of the
    buffer: the hooks, one plain inner tensor holding its values as they are, and
    ``__tensor_unflatten__(inner, ctx, outer_size, outer_stride)`` to rebuild it."""
    if not (hasattr(t, _PRE) and is_traceable_wrapper_subclass(t)):
        return False
    names, _ = t.__tensor_flatten__()
    inner = getattr(t, names[0]) if len(names) == 1 else None
    if inner is None or not is_plain(inner):
        return False
    if inner.shape != t.shape or inner.dtype != t.dtype:
        return False
    return len(inspect.signature(type(t).__tensor_unflatten__).parameters) == 4


@dataclass(eq=False)
class _Entry:
    """One parameter's protocol state."""

    ref: ParamRef
    inner_name: str  # "" where the sharded parameter holds rows of its own (held)
    ctx: Any  # __tensor_flatten__'s context
    cls: type
    module: nn.Module  # the module holding it (FSDP2 passes the same)
    original: torch.Tensor | None = None  # held: the parameter, until its rows are taken
    held: torch.Tensor | None = None  # held: this rank's rows (the subclass's own tensor)
    rows: tuple[int, ...] = ()  # rows each rank holds (from the layout, at the first gather)
    metadata: Any = None  # fsdp_pre_all_gather's, until fsdp_post_all_gather takes it
    pieces: list[_Piece] = field(default_factory=list)  # one per all-gather input
    outputs: list[torch.Tensor] = field(default_factory=list)  # one per input, kept
    inner: tuple = ()  # (tensor, bytes): what fsdp_post_all_gather said to free at reshard


class SubclassGather:
    """The all-gather of one buffer of protocol parameters (see [Note: tensor-subclass
    all-gather]).

    Args:
        refs: the buffer's parameters (placed before the first gather).
        originals: the parameters as ``fully_shard`` got them (same order as ``refs``).
        mesh: the buffer's mesh, its last dim the shard dim.
        mp_policy: the group's mixed precision.
        device, dtype: the buffer's compute device and dtype; ``move_to`` follows them
            when ``to_empty`` or ``Module._apply`` changes them.
    """

    def __init__(
        self,
        refs: list[ParamRef],
        originals,
        mesh: DeviceMesh,
        mp_policy: MixedPrecisionPolicy,
        device: torch.device,
        dtype: torch.dtype,
    ):
        self.shard_mesh = shard_mesh(mesh)  # its last dim, named or not
        self.rank, self.world = mesh.get_local_rank(mesh.ndim - 1), mesh.size(mesh.ndim - 1)
        self.device, self.dtype = device, dtype
        mp = self._mp = mp_policy
        self.mp_policy = TorchMixedPrecisionPolicy(  # the class FSDP2 hands the hook
            param_dtype=mp.param_dtype,
            reduce_dtype=mp.reduce_dtype,
            output_dtype=mp.output_dtype,
            cast_forward_inputs=mp.cast_forward_inputs,
        )
        self.entries: dict[str, _Entry] = {}
        for ref, p in zip(refs, originals):
            if _viewable(p):
                (name,), ctx = cast(TraceableWrapperSubclass, p).__tensor_flatten__()
                entry = _Entry(ref, name, ctx, type(p), ref.uses[0][0])
            else:
                entry = _Entry(ref, "", None, type(p), ref.uses[0][0], original=p)
            self.entries[ref.fqn] = entry

    def move_to(self, device: torch.device, dtype: torch.dtype) -> None:
        """The buffer's device and dtype changed (``to_empty``, ``Module._apply``)."""
        self.device, self.dtype = device, dtype

    def holds(self, ref: ParamRef) -> bool:
        """Whether ``ref``'s sharded parameter holds rows of its own, not a view of the
        buffer (the shard storage's span of it is unused; optimizers step it apart)."""
        return not self.entries[ref.fqn].inner_name

    @property
    def param_dtype(self) -> torch.dtype:
        """What ``fsdp_post_all_gather`` is told to produce (FSDP2's rule)."""
        mp, dtype = self._mp, self.dtype
        return mp.param_dtype if mp.param_dtype is not None and dtype.is_floating_point else dtype

    def wrap(self, ref: ParamRef, local: torch.Tensor) -> torch.Tensor:
        """The sharded parameter's local tensor: the subclass around ``local`` (a view of
        the shard storage: rows x rest), or the rows it holds (``holds``), taken from the
        parameter by the subclass's own ops at the first call, as FSDP2 chunks it."""
        e = self.entries[ref.fqn]
        if e.inner_name:
            cls = cast(type[TraceableWrapperSubclass], e.cls)
            return cls.__tensor_unflatten__(
                {e.inner_name: local}, e.ctx, local.size(), local.stride()
            )
        if e.held is None:
            assert e.original is not None and ref.placement is not None  # set at __init__
            r0, r1 = ref.placement.local_row_range(ref.shape, self.rank)
            e.held, e.original = e.original.detach()[r0:r1].clone(), None
        return e.held

    def held_rows(self, ref: ParamRef) -> torch.Tensor | None:
        """The rows ``ref``'s sharded parameter holds (``holds``), else None."""
        return self.entries[ref.fqn].held

    def adopt(self, ref: ParamRef, local: torch.Tensor) -> None:
        """``local`` is ``ref``'s held rows now (``Module._apply`` made new ones)."""
        self.entries[ref.fqn].held = local

    # ---- unshard --------------------------------------------------------------------------
    def start(self, process_group, gather=None):
        """Call every ``fsdp_pre_all_gather``, copy the inputs in and start the all-gather
        (``gather(output, input, group)``, the group's own: a custom one where it is set).

        Returns:
            ``(work, send, received)``: the collective and its two byte buffers (1D uint8:
            the largest rank's bytes, and ``world`` times that).
        """
        inputs = []
        for e in self.entries.values():
            if not e.rows:
                ranges = (
                    e.ref.placement.local_row_range(e.ref.shape, r) for r in range(self.world)
                )
                e.rows = tuple(b - a for a, b in ranges)
            ins, e.metadata = self._pre_all_gather(e)
            ins = tuple(self._unpadded(e, _plain_copy(x)) for x in ins)
            e.pieces = [self._piece(e, x) for x in ins]
            inputs.append(ins)
        # Every rank's send buffer, from the layout alone: piece after piece, each aligned.
        ends = [0] * self.world
        for e in self.entries.values():
            for piece in e.pieces:
                piece.offsets = ends
                ends = [_aligned(end + n) for end, n in zip(ends, piece.sizes)]
        width = max(*ends, _ALIGN)
        send = torch.empty(width, dtype=torch.uint8, device=self.device)  # 1D, bytes
        with torch.no_grad():
            for e, ins in zip(self.entries.values(), inputs):
                for piece, x in zip(e.pieces, ins):
                    at = piece.offsets[self.rank]
                    send[at : at + piece.sizes[self.rank]].copy_(
                        x.detach().reshape(-1).view(torch.uint8)
                    )  # the copy-in
        received = torch.empty(self.world * width, dtype=torch.uint8, device=self.device)
        if gather is None:
            work = all_gather_single(received, send, group=process_group, async_op=True)
        else:
            work = gather(received, send, process_group)
        return work, send, received

    def _pre_all_gather(self, e: _Entry):
        local = cast("DTensor", e.ref.param)._local_tensor
        if not hasattr(local, _PRE):  # gathered as its values, as FSDP2's default path
            return (_plain_copy(local).to(self.param_dtype),), None
        try:  # hooks may be added after fully_shard: read at each gather, as FSDP2
            if _pre_all_gather_args(local, f"fully_shard: parameter {e.ref.fqn!r}") == 1:
                return getattr(local, _PRE)(self.shard_mesh)
            return getattr(local, _PRE)(
                self.shard_mesh,
                e.ref.shape,
                _contiguous_stride(e.ref.shape),
                e.module,
                self.mp_policy,
            )
        except Exception as err:
            if e.rows[self.rank]:
                raise
            raise RuntimeError(
                f"fully_shard: {_PRE} of parameter {e.ref.fqn!r} ({e.cls.__name__}) failed on "
                f"rank {self.rank}, which holds none of its rows (RaggedShard packs whole "
                f"rows: {list(e.rows)} per rank); a subclass whose hook cannot take an empty "
                "shard needs rows on every rank: fully_shard its module apart, or (torchao "
                "float8) call precompute_float8_dynamic_scale_for_fsdp after each step"
            ) from err

    def _unpadded(self, e: _Entry, x):
        """This rank's rows of an input padded as FSDP2 asks where its chunks are uneven:
        ``ceil(rows / world)`` rows on every rank, its own first (torch's padded-chunk
        rule). Every rank decides alike: from the input's shape and the layout."""
        chunk, mine = -(-sum(e.rows) // self.world), e.rows[self.rank]
        padded = isinstance(x, torch.Tensor) and x.dim() >= 1 and x.shape[0] == chunk
        if padded and mine != chunk and len(set(e.rows)) > 1 and max(e.rows) <= chunk:
            return x[:mine]
        return x

    def _piece(self, e: _Entry, x) -> _Piece:
        where = f"fully_shard: {_PRE} of parameter {e.ref.fqn!r} ({e.cls.__name__}) returned"
        if not isinstance(x, torch.Tensor) or not is_plain(x):
            raise TypeError(
                f"{where} an all-gather input of type {type(x).__name__}: expected plain tensors"
            )
        if x.device != self.device:
            raise RuntimeError(
                f"{where} an all-gather input on {x.device}, not on the buffer's device "
                f"{self.device}"
            )
        size = x.element_size()
        if x.dim() >= 1 and x.shape[0] == e.rows[self.rank]:  # dim 0: this rank's rows
            rest = tuple(x.shape[1:])
            shapes = [(n, *rest) for n in e.rows]
        elif len(set(e.rows)) == 1:  # even rows: every rank's input has this shape
            shapes = [tuple(x.shape) if x.dim() else (1,)] * self.world
        else:
            raise RuntimeError(
                f"{where} an all-gather input of shape {tuple(x.shape)} on rank {self.rank}, "
                f"which holds {e.rows[self.rank]} of its rows; RaggedShard's shards are uneven "
                f"({list(e.rows)} rows per rank): each input must have the shard's rows as dim 0"
            )
        out_shape = (sum(s[0] for s in shapes), *shapes[0][1:])
        return _Piece(x.dtype, shapes, out_shape, [math.prod(s) * size for s in shapes])

    def finish(self, received: torch.Tensor) -> None:
        """Copy each input's pieces, rank after rank, into its output: the copy-out."""
        width = received.numel() // self.world
        for e in self.entries.values():
            got = [(p.out_shape, p.dtype) for p in e.pieces]
            if e.ref.unsharded is None:  # the first gather, or after to() / a load: new ones
                e.outputs = [torch.empty(s, dtype=d, device=self.device) for s, d in got]
                e.inner = ()
            elif got != [(tuple(t.shape), t.dtype) for t in e.outputs]:  # out= refills them
                raise RuntimeError(
                    f"fully_shard: {_PRE} of parameter {e.ref.fqn!r} ({e.cls.__name__}) "
                    f"changed its all-gather inputs between gathers ({got}); they must keep "
                    "their shapes and dtypes"
                )
            for t in e.outputs:
                _alloc(t, t.numel() * t.element_size())
            for t, nbytes in e.inner:
                _alloc(t, nbytes)
            # [Note: version counter] in _param_group.py: refilling is not a modification.
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(tuple(e.outputs)):
                for out, p in zip(e.outputs, e.pieces):
                    parts = [
                        received[r * width + p.offsets[r] :][: p.sizes[r]]
                        .view(p.dtype)
                        .view(p.shapes[r])
                        for r in range(self.world)
                    ]
                    torch.cat(parts, dim=0, out=out)

    def post_all_gather(self, ref: ParamRef) -> torch.Tensor | None:
        """``fsdp_post_all_gather`` of ``ref``: its new unsharded value (``as_strided`` to
        its shape) when the module holds none yet, else None (``out=`` refilled it)."""
        e = self.entries[ref.fqn]
        local = cast("DTensor", ref.param)._local_tensor
        outputs, metadata, e.metadata = tuple(e.outputs), e.metadata, None
        if not hasattr(local, _POST):  # the gathered values are the parameter
            if ref.unsharded is not None:  # a view of outputs[0], refilled
                return None
            return torch.as_strided(outputs[0], ref.shape, _contiguous_stride(ref.shape), 0)
        if ref.unsharded is not None:
            getattr(local, _POST)(outputs, metadata, self.param_dtype, out=ref.unsharded)
            return None
        value, inner = getattr(local, _POST)(outputs, metadata, self.param_dtype)
        e.inner = tuple((t, t.untyped_storage().nbytes()) for t in inner)
        return torch.as_strided(value, ref.shape, _contiguous_stride(ref.shape), 0)

    # ---- reshard --------------------------------------------------------------------------
    def free(self) -> None:
        """Free the outputs and the inner tensors ``fsdp_post_all_gather`` named."""
        for e in self.entries.values():
            for t in (*e.outputs, *(t for t, _ in e.inner)):
                _free(t)


def _plain_copy(x):
    """An all-gather input a hook returned as a tensor subclass, copied into a plain
    tensor by the subclass's own ``copy_`` (as FSDP2's copy-in); anything else as it is."""
    if not isinstance(x, torch.Tensor) or is_plain(x):
        return x
    return torch.empty(x.shape, dtype=x.dtype, device=x.device).copy_(x)


def _contiguous_stride(shape) -> tuple[int, ...]:
    return torch.empty(shape, device="meta").stride()


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _alloc(t: torch.Tensor, nbytes: int) -> None:
    if t.device.type != "meta" and t.untyped_storage().nbytes() < nbytes:
        t.untyped_storage().resize_(nbytes)


def _free(t: torch.Tensor) -> None:
    if t.device.type != "meta" and t.untyped_storage().nbytes() > 0:
        t.untyped_storage().resize_(0)
