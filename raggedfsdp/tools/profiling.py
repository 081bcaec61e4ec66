"""Count the copies and the collectives of a training step: ``CopyCounter``, ``CommCounter``.

Both are ``TorchDispatchMode``s: enter one around a step and read what ran::

    with CopyCounter() as copies, CommCounter() as comms:
        loss_fn(model(x), y).backward()
        opt.step()
    copies.summary()        # {"aten.copy_.default": (count, bytes), ...}
    copies.touching(buffer_storages(model))   # the copies that read or wrote DBuffer storages
    comms.summary()         # {"all_gather": CommStats(count, input_bytes, output_bytes), ...}

or let ``measure_step(model, step_fn)`` run a step under both, then under torch's
``MemTracker``, and return the bytes communicated and copied and the peak memory.

Ops on tensor subclasses (DTensor) are not counted at the subclass level: the mode
returns ``NotImplemented``, the subclass runs its local ops, and those are counted,
on the storages that actually hold the data. Ops on fake tensors (DTensor's sharding
propagation) hold no data and are not counted.

[Note: what CopyCounter counts]
- **Copy-like ops** (``COPY_OPS``): ``aten.copy_``, ``_to_copy``, ``clone``, ``cat``,
  ``split_with_sizes_copy``, ``_foreach_copy_``, ``_chunk_cat`` (every overload) and
  FSDP2's custom ops ``fsdp.all_gather_copy_in``, ``fsdp.split_with_sizes_copy``,
  ``fsdp.chunk_cat``. Views (``split``, ``narrow``, ``view``) copy nothing and are not
  counted; neither are arithmetic ops that write a fresh tensor.
- **Bytes** are the bytes an op writes: its mutated arguments (``Tensor(a!)`` in
  the schema: ``copy_``'s ``self``, an ``out=``), else its outputs.
- **Storages** are keys of the untyped storages an op reads and writes
  (``storage_key``: the address of the storage object, not of its data, so the key of
  a DBuffer's global storage survives the ``resize_`` that frees and reallocates it).
- **FSDP2's custom ops** have Python kernels, and a mode is popped while it runs an op
  it intercepted, so their inner aten ops would be invisible. ``CopyCounter`` runs
  such an op (``WRAPPER_OPS``) itself: it re-enters the mode and redispatches the op
  straight to its backend kernel, so the inner ops (``_foreach_copy_``,
  ``split_with_sizes_copy.out``, ``_chunk_cat.out``) are counted too. Both appear in
  ``events``: the inner ones with ``within`` set to the custom op, the custom op with
  the bytes and storages of its inner copies. ``total_bytes`` counts each byte once
  (top-level events only).
- **Copies a collective backend makes.** gloo finishes a reduce-scatter by copying its
  result into the output tensor when the work is waited on (an ``aten.copy_`` on the
  caller's thread, after the collective op returned). The first copy that writes the
  very output tensor of a reduce-scatter seen earlier gets ``within`` set to that
  collective, so it is kept apart from the caller's copies (NCCL makes no such copy).
  Over one rank raggedfsdp issues no collective: the collective's result is its input,
  copied into its output (``raggedfsdp.tensor.collectives``); that copy gets ``within`` set to
  the collective it stands for, as gloo's own copies do.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch._C import DispatchKey, DispatchKeySet
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass_type
from torch.utils._pytree import tree_leaves

from raggedfsdp.tensor.collectives import one_rank_collective

__all__ = [
    "one_rank_collective",
    "COPY_OPS",
    "WRAPPER_OPS",
    "CommCounter",
    "CommEvent",
    "CommStats",
    "CopyCounter",
    "CopyEvent",
    "buffer_storages",
    "measure_step",
    "peak_memory",
    "storage_key",
]

WRAPPER_OPS = frozenset(
    {"fsdp::all_gather_copy_in", "fsdp::split_with_sizes_copy", "fsdp::chunk_cat"}
)
COPY_OPS = WRAPPER_OPS | frozenset(
    "aten::" + name
    for name in (
        "copy_",
        "_to_copy",
        "clone",
        "cat",
        "split_with_sizes_copy",
        "_foreach_copy_",
        "_foreach_copy",  # the .out overload's name
        "_chunk_cat",
    )
)


@functools.cache
def _backend_key(device_type: str) -> DispatchKey | None:
    """The backend dispatch key of a tensor on ``device_type`` (``CPU``, ``CUDA``, ``Meta``,
    an accelerator's own), as torch maps it; None where torch names none."""
    try:
        return getattr(DispatchKey, torch._C._dispatch_key_for_device(device_type), None)
    except RuntimeError:
        return None


def storage_key(t: torch.Tensor) -> int:
    """A key for ``t``'s untyped storage, shared by all its views and stable across ``resize_``.

    It is the address of the storage object, so once a storage is freed a new one may
    get its key: compare keys of storages that stay alive while counting (a DBuffer's).
    """
    return t.untyped_storage()._cdata


def _op_name(func) -> str:
    return str(func)  # "aten.copy_.default"


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _nbytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _bound_args(func, args, kwargs) -> list[tuple[Any, Any]]:
    """``(schema argument, value)`` for every argument that was passed."""
    by_name = dict(kwargs)
    out = []
    for i, arg in enumerate(func._schema.arguments):
        if i < len(args):
            out.append((arg, args[i]))
        elif arg.name in by_name:
            out.append((arg, by_name[arg.name]))
    return out


def _classify(types) -> str:
    """``"subclass"`` (DTensor: count its local ops), ``"fake"`` (no data: skip), or ``"real"``."""
    if any(is_traceable_wrapper_subclass_type(t) for t in types):
        return "subclass"
    if any(t not in (torch.Tensor, torch.nn.Parameter) for t in types):
        return "fake"  # FakeTensor (DTensor's sharding propagation), FunctionalTensor
    return "real"


# ---- copies ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class CopyEvent:
    """One copy-like op that ran.

    Args:
        op: the overload, e.g. ``"aten.copy_.default"``.
        nbytes: bytes written.
        reads: storage keys of the tensors read.
        writes: storage keys of the tensors written.
        within: the op this copy belongs to (an FSDP2 custom op that ran it, or a
            collective whose output it fills, see [Note: what CopyCounter counts]);
            None for a copy made by the caller's code.
    """

    op: str
    nbytes: int
    reads: frozenset[int]
    writes: frozenset[int]
    within: str | None = None

    @property
    def storages(self) -> frozenset[int]:
        return self.reads | self.writes


class CopyCounter(TorchDispatchMode):
    """Record every copy-like op run under it. See [Note: what CopyCounter counts].

    Args:
        ops: schema names of the ops to record. Default ``COPY_OPS``.
        wrappers: custom ops whose inner ops are counted too (their kernel is run
            with the mode re-entered). Default ``WRAPPER_OPS`` (FSDP2's).
    """

    def __init__(self, ops: Iterable[str] = COPY_OPS, wrappers: Iterable[str] = WRAPPER_OPS):
        super().__init__()
        self.ops = frozenset(ops)
        self.wrappers = frozenset(wrappers)
        self.events: list[CopyEvent] = []
        self._within: list[str] = []  # the wrappers now running, innermost last
        self._collective_outputs: list[tuple[weakref.ref, str]] = []

    def reset(self) -> None:
        """Forget the events recorded so far."""
        self.events.clear()
        self._collective_outputs.clear()

    # ---- queries --------------------------------------------------------------------------
    def top_level(self) -> list[CopyEvent]:
        """The events not run inside another recorded op (each byte appears once)."""
        return [e for e in self.events if e.within is None]

    def touching(self, storages: Iterable[torch.Tensor | int]) -> list[CopyEvent]:
        """The events that read or wrote any of ``storages`` (tensors or ``storage_key``s)."""
        keys = {s if isinstance(s, int) else storage_key(s) for s in storages}
        return [e for e in self.events if e.storages & keys]

    def summary(self, events: Iterable[CopyEvent] | None = None) -> dict[str, tuple[int, int]]:
        """``{op: (count, bytes written)}`` over ``events`` (default: all, inner ops included)."""
        out: dict[str, tuple[int, int]] = {}
        for e in self.events if events is None else events:
            count, nbytes = out.get(e.op, (0, 0))
            out[e.op] = (count + 1, nbytes + e.nbytes)
        return dict(sorted(out.items()))

    def total_bytes(self, events: Iterable[CopyEvent] | None = None) -> int:
        """Bytes written by ``events`` (default: the top-level ones, so none twice)."""
        return sum(e.nbytes for e in (self.top_level() if events is None else events))

    # ---- dispatch -------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = _classify(types)
        if kind == "subclass":
            return NotImplemented  # let DTensor run its local ops; count those
        if kind == "fake":
            return func(*args, **kwargs)
        name = func._schema.name
        if name in self.wrappers:
            return self._run_wrapper(func, args, kwargs)
        out = func(*args, **kwargs)
        if func.namespace in ("c10d", "_c10d_functional"):
            self._note_collective_outputs(func, args, kwargs)
        elif name in self.ops:
            reads, writes = self._reads_writes(func, args, kwargs, out)
            self._record(_op_name(func), reads, writes)
        return out

    def _reads_writes(self, func, args, kwargs, out):
        reads, writes = [], []
        for arg, value in _bound_args(func, args, kwargs):
            is_write = arg.alias_info is not None and arg.alias_info.is_write
            (writes if is_write else reads).extend(_tensors(value))
        if not writes:
            writes = _tensors(out)
        return reads, writes

    def _record(self, op: str, reads, writes) -> None:
        within = self._within[-1] if self._within else one_rank_collective()
        if within is None:
            within = self._filled_collective(writes)
        self.events.append(
            CopyEvent(
                op=op,
                nbytes=_nbytes(writes),
                reads=frozenset(map(storage_key, reads)),
                writes=frozenset(map(storage_key, writes)),
                within=within,
            )
        )

    def _run_wrapper(self, func, args, kwargs):
        op = _op_name(func)
        tensors = _tensors((args, kwargs))
        key = _backend_key(tensors[0].device.type) if tensors else None
        if key is None:  # no backend kernel to redispatch to: count the op alone
            out = func(*args, **kwargs)
            self._record(op, *self._reads_writes(func, args, kwargs, out))
            return out
        first = len(self.events)
        self._within.append(op)
        try:
            with self:
                out = func.redispatch(DispatchKeySet(key), *args, **kwargs)
        finally:
            self._within.pop()
        inner = [e for e in self.events[first:] if e.within == op]
        outer = CopyEvent(
            op=op,
            nbytes=sum(e.nbytes for e in inner),
            reads=frozenset().union(*(e.reads for e in inner)),
            writes=frozenset().union(*(e.writes for e in inner)),
            within=self._within[-1] if self._within else None,
        )
        self.events.insert(first, outer)
        return out

    # ---- copies a collective backend makes into its output ---------------------------------
    def _note_collective_outputs(self, func, args, kwargs) -> None:
        if _kind(func._opname) != "reduce_scatter":  # the only ones gloo finishes by a copy
            return
        op = _op_name(func)
        for arg, value in _bound_args(func, args, kwargs):
            if arg.name in _OUTPUT_ARGS:
                self._collective_outputs.extend((weakref.ref(t), op) for t in _tensors(value))
        self._collective_outputs = [(r, o) for r, o in self._collective_outputs if r() is not None]

    def _filled_collective(self, writes) -> str | None:
        if len(writes) != 1 or not self._collective_outputs:
            return None
        for i, (ref, op) in enumerate(self._collective_outputs):
            if ref() is writes[0]:
                del self._collective_outputs[i]  # the first copy into it is the backend's
                return op
        return None


# ---- collectives ----------------------------------------------------------------------------
_OUTPUT_ARGS = frozenset({"output_tensor", "output_tensors", "output_lists", "outputs", "output"})
_INPUT_ARGS = frozenset({"input_tensor", "input_tensors", "input_list", "inputs", "input"})
_INPLACE_ARGS = frozenset({"tensors"})  # all_reduce, broadcast, send / recv (not barrier)
_NOT_COLLECTIVES = frozenset({"wait_tensor", "_wrap_tensor_autograd"})
_KINDS = (  # (substring of the op name, kind); first match wins
    ("reduce_scatter", "reduce_scatter"),
    ("allgather", "all_gather"),
    ("all_gather", "all_gather"),
    ("allreduce", "all_reduce"),
    ("all_reduce", "all_reduce"),
    ("alltoall", "all_to_all"),
    ("all_to_all", "all_to_all"),
    ("broadcast", "broadcast"),
)


class CommEvent(NamedTuple):
    """One collective: the op, its kind, and the bytes of its input and output tensors."""

    op: str
    kind: str
    input_bytes: int
    output_bytes: int


class CommStats(NamedTuple):
    """The collectives of one kind: how many, and their input and output bytes summed."""

    count: int
    input_bytes: int
    output_bytes: int


def _kind(opname: str) -> str:
    for part, kind in _KINDS:
        if part in opname:
            return kind
    return opname.rstrip("_")  # barrier, gather, scatter, reduce, send, recv


class CommCounter(TorchDispatchMode):
    """Record every c10d collective run under it (``torch.distributed`` and functional).

    Kinds: ``all_gather``, ``reduce_scatter``, ``all_reduce``, ``all_to_all``,
    ``broadcast``, else the op's own name (``barrier``, ``gather``, ``send``, ...). Bytes
    are this rank's: an all-gather's output is the whole gathered buffer (padding
    included), a reduce-scatter's input the whole buffer, an all-reduce's input and
    output the same tensors. Coalesced and list forms add up their tensors.
    """

    def __init__(self):
        super().__init__()
        self.events: list[CommEvent] = []

    def reset(self) -> None:
        """Forget the events recorded so far."""
        self.events.clear()

    def summary(self) -> dict[str, CommStats]:
        """``{kind: CommStats(count, input bytes, output bytes)}``."""
        out: dict[str, CommStats] = {}
        for e in self.events:
            c, i, o = out.get(e.kind, CommStats(0, 0, 0))
            out[e.kind] = CommStats(c + 1, i + e.input_bytes, o + e.output_bytes)
        return dict(sorted(out.items()))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = _classify(types)
        if kind == "subclass":
            return NotImplemented
        out = func(*args, **kwargs)
        if kind == "fake":
            return out
        opname = func._opname
        if func.namespace in ("c10d", "_c10d_functional") and opname not in _NOT_COLLECTIVES:
            self.events.append(self._event(func, args, kwargs, out))
        return out

    @staticmethod
    def _event(func, args, kwargs, out) -> CommEvent:
        inputs, outputs = 0, 0
        for arg, value in _bound_args(func, args, kwargs):
            nbytes = _nbytes(_tensors(value))
            if arg.name in _OUTPUT_ARGS:
                outputs += nbytes
            elif arg.name in _INPUT_ARGS:
                inputs += nbytes
            elif arg.name in _INPLACE_ARGS:
                inputs += nbytes
                outputs += nbytes
        if func.namespace == "_c10d_functional":  # functional: the result is the output
            outputs = _nbytes(_tensors(out))
        return CommEvent(_op_name(func), _kind(func._opname), inputs, outputs)


# ---- raggedfsdp's storages --------------------------------------------------------------------
def buffer_storages(module: torch.nn.Module) -> set[int]:
    """Storage keys of every flat buffer under ``module`` (``raggedfsdp.fully_shard``'d modules).

    Each buffer has four (``BufferView.storages()``): the shard, the shard gradient, and
    the global parameter and gradient storages (the latter two keep their key while
    freed and reallocated).
    """
    from raggedfsdp.fsdp import buffers_of

    return {storage_key(t) for buf in buffers_of(module) for t in buf.storages()}


# ---- one training step, measured ----------------------------------------------------------------
def peak_memory(
    step_fn: Callable[[], object],
    *tracked: Any,
    tracker: Callable[[], Any] | None = None,
) -> dict[str, int]:
    """Peak memory of one call of ``step_fn`` on this rank, by ``MemTracker`` category.

    Args:
        step_fn: the code to measure (one training step).
        *tracked: modules, optimizers and tensors that exist before the step
            (``MemTracker.track_external``), so that their bytes count from the start.
        tracker: makes the ``MemTracker`` (a subclass, for a system it needs adapting
            to). Default ``torch.distributed._tools.mem_tracker.MemTracker``.

    Returns:
        ``{"Total": bytes, "PARAM": bytes, "GRAD": bytes, "ACT": ..., "OPT": ...}`` at the
        peak, on the device whose peak is the largest.
    """
    if tracker is None:
        from torch.distributed._tools.mem_tracker import MemTracker as tracker
    mem = tracker()
    mem.track_external(*tracked)
    with mem:
        step_fn()
    peaks = mem.get_tracker_snapshot("peak").values()
    peak = max(peaks, key=lambda by_kind: by_kind.get("Total", 0), default={})
    return {getattr(k, "name", k): int(v) for k, v in peak.items()}


def measure_step(
    model: torch.nn.Module,
    step_fn: Callable[[], object],
    backend: str | None = "raggedfsdp",
    *,
    tracker: Callable[[], Any] | None = None,
) -> dict[str, Any]:
    """Communication, copies and peak memory of one training step on this rank.

    Runs ``step_fn`` twice: once under ``CopyCounter`` and ``CommCounter``, once under
    ``peak_memory`` (with ``model`` tracked from the start). Call it on a step that does
    the same work each time (after a first, warm-up step).

    Args:
        model: the model the step trains.
        step_fn: runs one training step.
        backend: which copies are the FSDP's own (``copied_bytes_fsdp``):
            ``"raggedfsdp"``, those that read or write one of its buffers (the
            backend's copy into a reduce-scatter output apart); ``"fsdp2"``, its
            ``fsdp.*`` ops (copy-in, copy-out, reduce-scatter copy-in); None, none
            attributed (the key is left out). Default ``"raggedfsdp"``.
        tracker: passed to ``peak_memory``.

    Returns:
        ``copied_bytes_total`` (every top-level copy), ``copied_bytes_fsdp``,
        ``copies_by_op`` (``{op: [count, bytes]}``, top level), ``<kind>_bytes`` and
        ``<kind>_count`` per collective kind (bytes: an all-gather's output, any other
        collective's input), and ``peak_memory_bytes``.
    """
    if backend not in ("raggedfsdp", "fsdp2", None):
        raise ValueError(
            f"measure_step: backend must be 'raggedfsdp', 'fsdp2' or None, got {backend!r}"
        )
    with CopyCounter() as copies, CommCounter() as comms:
        step_fn()
    top = copies.top_level()
    out: dict[str, Any] = {"copied_bytes_total": copies.total_bytes()}
    if backend == "raggedfsdp":
        near = copies.touching(buffer_storages(model))
        out["copied_bytes_fsdp"] = copies.total_bytes([e for e in near if e.within is None])
    elif backend == "fsdp2":
        out["copied_bytes_fsdp"] = copies.total_bytes([e for e in top if e.op.startswith("fsdp.")])
    out["copies_by_op"] = {op: list(v) for op, v in copies.summary(top).items()}
    for kind, stats in comms.summary().items():
        out[f"{kind}_bytes"] = stats.output_bytes if kind == "all_gather" else stats.input_bytes
        out[f"{kind}_count"] = stats.count
    out["peak_memory_bytes"] = peak_memory(step_fn, model, tracker=tracker)["Total"]
    return out
