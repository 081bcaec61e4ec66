"""``python -m raggedfsdp simulate``: one rank of an N-rank training step, on fake tensors.

Real model shapes at real world sizes, in one process on the CPU: the model (a catalogue
name, a JSON config file or ``hf:DIR``, a Hugging Face config; see [Note: simulated model
sources] in ``raggedfsdp/tools/model_sources.py``) is built on ``meta`` with K transformer
blocks (embeddings and head included),
``fully_shard``-ed as a user would (each block, then the root) by raggedfsdp or by
torch's FSDP2 over torch's fake process group of ``world`` ranks, materialised with
``to_empty`` under ``FakeTensorMode`` (no byte is allocated, no value is read), and
stepped (forward, backward, optimizer step) under a memory tracker::

    python -m raggedfsdp simulate --model llama3-70b --world 1024 --layers 2 --ac
    python -m raggedfsdp simulate --model gpt-oss-120b --world 256 --system both --json
    python -m raggedfsdp simulate --model llama3-70b --mesh replicate=4,shard=64 --png t.png
    python -m raggedfsdp simulate --model gpt2 --seq 1024 --world 8,64,1024,16384 --png s.png

A comma list of world sizes sweeps them: per world size, both systems' per-rank peak and
their ratio, the padding and the bytes all-gathered per step (``sweep``, ``sweep_row``).

``--mesh replicate=R,shard=S`` simulates HSDP: both systems ``fully_shard`` over a 2-D
``DeviceMesh`` ``(R, S)`` named ``("replicate", "shard")`` of the fake process group
(``R * S`` ranks): all-gather and reduce-scatter within a shard group of S ranks, then
an all-reduce of the shard gradients over the R replicas (counted as ``all_reduce``).

    from raggedfsdp.tools.simulate import SimConfig, simulate
    result = simulate(SimConfig(model="llama3-70b", world=1024, system="raggedfsdp"))
    result["peak"]["total"], result["roles"], result["comm"], result["timeline"]

[Note: what the simulation measures]
- **Memory** is ``MemTracker``'s (``torch.distributed._tools.mem_tracker``): every
  storage created, resized or freed on this rank, fake or not, in bytes (the CPU
  rule: no rounding to the caching allocator's blocks). So it is *allocated* memory
  per rank, not reserved memory on a device (no fragmentation, no allocator cache).
  The peak is given twice: by MemTracker's own categories (PARAM, GRAD, ACT, TEMP,
  OPT, ...) and by role, classifying each storage alive at the peak after the step,
  when it is known what each storage was: sharded parameters (the storages of the
  sharded parameters before the step), optimizer state, sharded gradients (the
  ``.grad`` storages after backward), unsharded gradients (MemTracker's GRAD
  otherwise), unsharded parameters (its PARAM otherwise: the parameters a module
  holds while it runs), communication buffers (any other storage a collective read
  or wrote), activations (the rest: ACT, BUFFER, OTH) and backward temporaries
  (TEMP). raggedfsdp's unsharded parameters *are* its all-gather output (zero copy);
  FSDP2's all-gather output is a separate buffer that it copies out of. raggedfsdp
  writes each gradient over its unsharded parameter ([Note: gradients in place]): such
  a storage counts once, as what MemTracker last saw it hold (GRAD once a gradient is
  in it).
- **DTensor's sharding propagation** runs each op on global-shape fake tensors in the
  active fake mode (``detect_fake_mode()``), which here is the simulation's, so
  MemTracker would count those global tensors as this rank's. The simulation marks
  propagation (``ShardingPropagator._propagate_tensor_meta_non_cached``) and the
  tracker skips what runs inside it.
- **Collectives** are ``raggedfsdp.tools.profiling.CommCounter``'s (fake tensors counted as
  real ones: their bytes are their shapes'), per kind, with each event's bytes and the
  ranks of its process group.
- **Timeline**: the total after every op of the measured step, and the bytes by role
  (the same classification, replayed from the log) after at most 400 of them: in each
  of 400 equal runs of ops, the op where the total is highest, so the peak is drawn.
- **FSDP2's own tracker** (``FSDPMemTracker``) measures one more step of FSDP2, as a
  cross-check of the peak, used as torch ships it (it skips ops run under a fake mode
  other than the one active when it was entered; DTensor's propagation, cached since
  the warm-up, runs no op in either measured step). It subclasses MemTracker, so it
  sees the same storages and differs in its categories (all-gather and reduce-scatter
  buffers, sharded and unsharded parameters and gradients): it checks the step and the
  classification more than the counting. Where it fails, its error is the result.
- **Allocations** are storages created or resized from empty during the step, and
  their distinct sizes: the pressure on a caching allocator.
- **MoE routing** is data dependent (``bincount().tolist()``); on fake tensors each
  MoE layer routes its tokens evenly over its experts instead (same shapes as a
  balanced router; no value read).
- **Models the trainable modules do not build** run as their nearest buildable
  variant (``buildable_config``): GPT-OSS with torchtitan's unfused experts
  ``w1, w2, w3 [E, F, D]`` in place of ``gate_up_proj [E, D, 2F]``, ``down_proj``, no
  expert biases and no attention sinks (0.01% of its parameters).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from raggedfsdp.tools.model_sources import (
    blocks_of,
    build_model,
    buildable_config,
    check_model,
    logits_of,
    shard_model,
)

__all__ = [
    "GROUPINGS",
    "SimConfig",
    "blocks_of",
    "build_model",
    "buildable_config",
    "fake_world",
    "shard_model",
    "simulate",
    "time_fully_shard",
]

SYSTEMS = ("raggedfsdp", "fsdp2")
GROUPINGS = ("blocks", "torchtitan")
OPTIMS = ("adamw", "shampoo", "none")
ROLES = (
    "sharded_params",
    "unsharded_params",
    "comm_buffers",
    "sharded_grads",
    "unsharded_grads",
    "optimizer",
    "activations",
    "temporaries",
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SimConfig:
    """One simulated step.

    Args:
        model: a catalogue name (``raggedfsdp.models.get_config``), a JSON config file
            (``*.json``, ``raggedfsdp.models.load_config_json``) or ``hf:DIR`` (a Hugging
            Face ``DIR/config.json``). See [Note: simulated model sources].
        world: ranks of the fake process group. Default 64.
        layers: transformer blocks built (K); None: the model's own count. Default 2.
        system: ``"raggedfsdp"`` or ``"fsdp2"``. Default ``"raggedfsdp"``.
        optim: ``"adamw"`` (``torch.optim.AdamW``, foreach, for both systems),
            ``"shampoo"`` (``raggedfsdp.optim.Shampoo``, square 1024 blocks, roots due in
            the measured step; raggedfsdp only) or ``"none"``. Default ``"adamw"``.
        mp: ``"bf16"`` (bf16 compute, fp32 master weights and reductions) or
            ``"fp32"``. Default ``"bf16"``.
        batch: sequences per rank. Default 1.
        seq: tokens per sequence. Default 4096.
        ac: activation checkpointing per block (``checkpoint_wrapper``). Default True.
        rank: the simulated rank. Default 0.
        warmup: unmeasured steps first (the optimizer state exists, as in steady
            state). Default 1.
        width: divide the model's widths (dim, heads, FFN) by this, for tests.
            Default 1.
        replicate: HSDP over a mesh ``(replicate, world // replicate)`` named
            ``("replicate", "shard")``; None: a 1-D mesh of ``world`` ranks (FSDP).
            Default None.
        grouping: ``"blocks"`` (``fully_shard`` each block, then the root) or
            ``"torchtitan"`` (the embedding, each block, ``[norm, output]``, then the
            root, resharding after forward as torchtitan does by default: not the last
            block, nor ``[norm, output]``). Default ``"blocks"``.
        fsdp_tracker: FSDP2 only: one more step under torch's ``FSDPMemTracker``, a
            cross-check of the peak. Default True.
    """

    model: str
    world: int = 64
    layers: int | None = 2
    system: str = "raggedfsdp"
    optim: str = "adamw"
    mp: str = "bf16"
    batch: int = 1
    seq: int = 4096
    ac: bool = True
    rank: int = 0
    warmup: int = 1
    width: int = 1
    replicate: int | None = None
    grouping: str = "blocks"
    fsdp_tracker: bool = True

    def __post_init__(self) -> None:
        if self.system not in SYSTEMS:
            raise ValueError(f"SimConfig: system must be one of {SYSTEMS}, got {self.system!r}")
        if self.optim not in OPTIMS:
            raise ValueError(f"SimConfig: optim must be one of {OPTIMS}, got {self.optim!r}")
        if self.optim == "shampoo" and self.system != "raggedfsdp":
            raise ValueError(
                "SimConfig: optim='shampoo' steps raggedfsdp's RaggedShard parameters only; "
                "pass system='raggedfsdp'"
            )
        if self.grouping not in GROUPINGS:
            raise ValueError(
                f"SimConfig: grouping must be one of {GROUPINGS}, got {self.grouping!r}"
            )
        if self.mp not in ("bf16", "fp32"):
            raise ValueError(f"SimConfig: mp must be 'bf16' or 'fp32', got {self.mp!r}")
        if self.world < 1 or not 0 <= self.rank < self.world:
            raise ValueError(
                f"SimConfig: need world >= 1 and 0 <= rank < world, got {self.world}, {self.rank}"
            )
        for name in ("batch", "seq", "width"):
            if getattr(self, name) < 1:
                raise ValueError(f"SimConfig: {name} must be >= 1, got {getattr(self, name)}")
        if self.layers is not None and self.layers < 1:
            raise ValueError(f"SimConfig: layers must be >= 1 or None, got {self.layers}")
        if self.replicate is not None and (self.replicate < 1 or self.world % self.replicate):
            raise ValueError(
                f"SimConfig: replicate={self.replicate} does not divide world={self.world}; "
                "the HSDP mesh is (replicate, world // replicate): pass a divisor of world, "
                "or None for a 1-D mesh"
            )
        check_model(self.model, self.seq, self.grouping, self.width)

    @property
    def mesh(self) -> dict[str, int] | None:
        """``{"replicate": R, "shard": S}`` for HSDP, None for a 1-D mesh."""
        if self.replicate is None:
            return None
        return {"replicate": self.replicate, "shard": self.world // self.replicate}

    @property
    def shard_ranks(self) -> int:
        """Ranks a buffer is sharded over (S): the shard dim's size, or ``world``."""
        return self.world // (self.replicate or 1)


# ================================================================================================
# The world
# ================================================================================================
@contextlib.contextmanager
def fake_world(world: int, rank: int = 0, replicate: int | None = None) -> Iterator[Any]:
    """torch's fake process group of ``world`` ranks as ``rank``; yields its CPU mesh.

    Args:
        world: ranks.
        rank: this process's rank. Default 0.
        replicate: None: a 1-D mesh of ``world`` ranks; else the 2-D HSDP mesh
            ``(replicate, world // replicate)`` named ``("replicate", "shard")``.
            Default None.

    The mesh is built here, outside any ``FakeTensorMode`` (its rank tensor is real).
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        if replicate is None:
            yield init_device_mesh("cpu", (world,))
        else:
            yield init_device_mesh(
                "cpu", (replicate, world // replicate), mesh_dim_names=("replicate", "shard")
            )
    finally:
        dist.destroy_process_group()


# ================================================================================================
# The instruments
# ================================================================================================
class _Propagation:
    """Marks DTensor's sharding propagation (global-shape fake ops) while patched in."""

    depth = 0

    @classmethod
    @contextlib.contextmanager
    def patched(cls) -> Iterator[None]:
        from torch.distributed.tensor._sharding_prop import ShardingPropagator

        original = ShardingPropagator._propagate_tensor_meta_non_cached

        def marked(self, op_schema):
            cls.depth += 1
            try:
                return original(self, op_schema)
            finally:
                cls.depth -= 1

        ShardingPropagator._propagate_tensor_meta_non_cached = marked
        try:
            yield
        finally:
            ShardingPropagator._propagate_tensor_meta_non_cached = original


def _local_tensors(tree) -> list[torch.Tensor]:
    """The plain tensors in ``tree`` (a DTensor's local tensor)."""
    from torch.utils._pytree import tree_leaves

    return [
        t.to_local() if hasattr(t, "to_local") else t
        for t in tree_leaves(tree)
        if isinstance(t, torch.Tensor)
    ]


def _mem_tracker():
    """``MemTracker`` that skips sharding propagation and logs every storage's changes.

    Each storage it tracks gets a serial number (``serial_of``); ``log`` holds
    ``(serial, bytes, MemTracker category)`` after each change, and ``peak_at`` the log's
    length when the peak was reached, so the storages alive at the peak are a replay
    of the log, classified once the step is over (``roles``). While ``counting``, each op
    appends the total to ``timeline`` and the log's length to ``marks``: the storages
    alive after any op are a replay too (``_role_timeline``).
    """
    from torch.distributed._tools.common_utils import get_untyped_storages
    from torch.distributed._tools.mem_tracker import MemTracker, _UpdateType

    class SimTracker(MemTracker):
        def __init__(self):
            super().__init__()
            self.counting = False
            self.alloc_sizes: Counter[int] = Counter()
            self.log: list[tuple[int, int, str]] = []
            self.peak_at = 0
            self.timeline: list[int] = []  # total bytes after each op of the step
            self.marks: list[int] = []  # len(log) after each op of the step
            self._best = -1
            self._serials = iter(range(1 << 62))

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if _Propagation.depth:
                return func(*args, **(kwargs or {}))
            return super().__torch_dispatch__(func, types, args, kwargs)

        def serial_of(self, t: torch.Tensor) -> set[int]:
            """Serials of the tracked storages of ``t``."""
            found = (self._WINFO.get(st) for st in get_untyped_storages(t))
            return {self._serial(w[0]) for w in found if w is not None}

        def _serial(self, winfo) -> int:
            if not hasattr(winfo, "sim_serial"):
                winfo.sim_serial = next(self._serials)
            return winfo.sim_serial

        def _update_snap(self, u_type, winfo, old_mem_consumed=None, old_reftype=None):
            super()._update_snap(u_type, winfo, old_mem_consumed, old_reftype)
            live = 0 if u_type == _UpdateType.DEL else winfo.mem_consumed
            self.log.append((self._serial(winfo), live, winfo.reftype.name))
            if self.counting and (
                u_type == _UpdateType.ADD
                or (u_type == _UpdateType.SIZE and not old_mem_consumed and winfo.mem_consumed)
            ):
                self.alloc_sizes[winfo.mem_consumed] += 1

        def _update_peak_stats(self, peak_state):
            super()._update_peak_stats(peak_state)
            total = sum(s["Total"] for s in self._curr_mem_snap.values())
            if self.counting:
                self.timeline.append(total)
                self.marks.append(len(self.log))
            if total > self._best:
                self._best, self.peak_at = total, len(self.log)

        def at_peak(self) -> dict[int, tuple[int, str]]:
            """``{serial: (bytes, category)}`` of the storages alive at the peak."""
            live: dict[int, tuple[int, str]] = {}
            for serial, nbytes, reftype in self.log[: self.peak_at]:
                live[serial] = (nbytes, reftype)
            return {k: v for k, v in live.items() if v[0]}

    return SimTracker()


def _group_ranks(func, args, kwargs) -> int:
    """Ranks of the process group a c10d op runs over (0 if it names none)."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    named = dict(zip((a.name for a in func._schema.arguments), args)) | (kwargs or {})
    for name, value in named.items():
        if isinstance(value, torch.ScriptObject):  # c10d ops: the ProcessGroup itself
            return dist.ProcessGroup.unbox(value).size()
        if name == "group_name":  # functional collectives: the group's name
            return _resolve_process_group(value).size()
    return 0


def _comm_counter(tracker):
    """``CommCounter`` that counts collectives on fake tensors and notes the serials (in
    ``tracker``) of the storages they read and write, and each one's group size (in
    ``ranks``, parallel to ``events``). Enter it inside ``tracker``."""
    from torch._subclasses.fake_tensor import FakeTensor

    from raggedfsdp.tools.profiling import CommCounter

    class FakeCommCounter(CommCounter):
        def __init__(self):
            super().__init__()
            self.serials: set[int] = set()
            self.ranks: list[int] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen = tuple(torch.Tensor if issubclass(t, FakeTensor) else t for t in types)
            n = len(self.events)
            out = super().__torch_dispatch__(func, seen, args, kwargs)
            if len(self.events) > n:
                self.ranks.append(_group_ranks(func, args, kwargs))
                for t in _local_tensors((args, kwargs, out)):
                    self.serials |= tracker.serial_of(t)
            return out

    return FakeCommCounter()


def _role(serial: int, reftype: str, sharded, grads, opt_state, comm) -> str:
    """The role of one storage. See [Note: what the simulation measures]."""
    if serial in sharded:
        return "sharded_params"
    if serial in opt_state or reftype == "OPT":
        return "optimizer"
    if serial in grads:
        return "sharded_grads"
    if reftype == "GRAD":
        return "unsharded_grads"
    if reftype == "PARAM":
        return "unsharded_params"
    if serial in comm:
        return "comm_buffers"
    if reftype == "TEMP":
        return "temporaries"
    return "activations"


def _classify(at_peak, *known) -> dict[str, int]:
    """Bytes by role of the storages alive at the peak (``known``: ``_role``'s sets)."""
    out = dict.fromkeys(ROLES, 0)
    for serial, (nbytes, reftype) in at_peak.items():
        out[_role(serial, reftype, *known)] += nbytes
    return out


def _role_timeline(tracker, known, phases: dict[str, int], n: int = 400) -> dict[str, Any]:
    """Bytes by role after at most ``n`` ops of the measured step, replayed from the log.

    In each of ``n`` equal runs of ops, the op where the total is highest (so the peak is
    one of them). Returns ``ops`` (ops in the step), ``at`` (the op indices), ``total``
    and ``roles`` (``{role: bytes at each}``), and ``phases`` (``{name: first op}``).
    """
    xs = tracker.timeline
    edges = [round(i * len(xs) / n) for i in range(n + 1)] if len(xs) > n else range(len(xs) + 1)
    at = [max(range(a, b), key=xs.__getitem__) for a, b in zip(edges, edges[1:]) if b > a]
    roles: dict[str, list[int]] = {role: [] for role in ROLES}
    totals = dict.fromkeys(ROLES, 0)
    live: dict[int, tuple[int, str]] = {}  # serial -> (bytes, role)
    done = 0
    for op in at:
        for serial, nbytes, reftype in tracker.log[done : tracker.marks[op]]:
            if (old := live.pop(serial, None)) is not None:
                totals[old[1]] -= old[0]
            if nbytes:
                live[serial] = (nbytes, _role(serial, reftype, *known))
                totals[live[serial][1]] += nbytes
        done = tracker.marks[op]
        for role in ROLES:
            roles[role].append(totals[role])
    return {
        "ops": len(xs),
        "at": at,
        "total": [xs[i] for i in at],
        "roles": roles,
        "phases": phases,
    }


# ================================================================================================
# What each system's layout says
# ================================================================================================
def _layout_facts(model: nn.Module, system: str, world: int) -> dict[str, Any]:
    """Per-group sizes from the system's own layout: the instrument's expected values.

    ``world``: the ranks a buffer is sharded over (the shard dim's, under HSDP)."""
    groups = []
    if system == "raggedfsdp":
        from raggedfsdp.fsdp import buffers_of

        for buf in buffers_of(model):
            lay = buf.layout
            groups.append(
                {
                    "params": len(buf.params),
                    "numel": lay.total_numel,
                    "shard_elems": lay.shard_size,
                    "global_elems": lay.global_size,
                    "padding": lay.padding,
                    "shard_bytes": lay.shard_size * buf.dtype.itemsize,
                    "gather_bytes": lay.global_size * buf.compute_dtype.itemsize,
                }
            )
    else:
        blocks = blocks_of(model)
        in_blocks = {id(p) for b in blocks for p in b.parameters()}
        for m in [*blocks, model]:
            own = [p for p in m.parameters() if m is not model or id(p) not in in_blocks]
            local = sum(p.to_local().numel() for p in own)
            padded = sum(
                math.ceil(p.shape[0] / world) * world * math.prod(p.shape[1:]) for p in own
            )
            groups.append(
                {
                    "params": len(own),
                    "numel": sum(p.numel() for p in own),
                    "shard_elems": padded // world,
                    "local_elems": local,
                    "global_elems": padded,
                    "padding": padded - sum(p.numel() for p in own),
                    "shard_bytes": padded // world * (own[0].dtype.itemsize if own else 0),
                }
            )
    return {
        "groups": groups,
        "params": sum(g["params"] for g in groups),
        "padding_elems": sum(g["padding"] for g in groups),
        "numel": sum(g["numel"] for g in groups),
    }


# ================================================================================================
# One simulated step
# ================================================================================================
def _optimizer(model: nn.Module, optim: str) -> torch.optim.Optimizer | None:
    """The simulated step's optimizer (see ``SimConfig.optim``)."""
    if optim == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    if optim == "shampoo":  # roots at every step from the first: the measured step has them
        from raggedfsdp.optim import Shampoo

        return Shampoo(
            model.parameters(), lr=1e-4, precondition_frequency=1, start_preconditioning_step=1
        )
    return None


def simulate(cfg: SimConfig) -> dict[str, Any]:
    """Build, shard and step ``cfg.model`` as rank ``cfg.rank`` of ``cfg.world``; measure it.

    Returns:
        A JSON-able dict: ``config``, ``mesh`` (``{"replicate": R, "shard": S}``, None
        for a 1-D mesh), ``note`` (what was changed to build the model), ``params``
        (elements), ``layout`` (per-group sizes from the system's layout), ``peak``
        (MemTracker's categories at the peak, bytes), ``roles`` (bytes by role at the
        same peak), ``comm`` (``{kind: [count, input bytes, output bytes]}``),
        ``comm_events`` (``[kind, input bytes, output bytes, group ranks]`` per
        collective), ``allocations`` and ``distinct_sizes`` (during the measured step),
        ``timeline`` (see ``_role_timeline``), ``fsdp_mem_tracker`` (FSDP2 with
        ``cfg.fsdp_tracker`` only, else None:
        ``{"peak": {category: bytes}}`` or ``{"error": ...}``), ``shard_s``,
        ``warmup_s``, ``step_s``, ``fsdp_tracker_s`` (wall seconds).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    gc.collect()
    with fake_world(cfg.world, cfg.rank, cfg.replicate) as mesh:
        model, note = build_model(cfg)
        t0 = time.perf_counter()
        shard_model(model, mesh, cfg.system, cfg.mp, cfg.grouping)
        shard_s = time.perf_counter() - t0
        n_params = sum(p.numel() for p in model.parameters())
        facts = _layout_facts(model, cfg.system, cfg.shard_ranks)
        vocab = model.config.vocab_size
        with FakeTensorMode(allow_non_fake_inputs=True), _Propagation.patched():
            model.to_empty(device="cpu")
            opt = _optimizer(model, cfg.optim)
            tokens = torch.randint(0, vocab, (cfg.batch, cfg.seq + 1), device="cpu")

            def step(zero: bool = True, mark=lambda phase: None) -> None:
                from raggedfsdp.models import lm_loss

                loss = lm_loss(logits_of(model(tokens[:, :-1])), tokens[:, 1:])
                mark("backward")
                loss.backward()
                if opt is not None:
                    mark("optimizer")
                    opt.step()
                    if zero:
                        opt.zero_grad(set_to_none=True)

            t0 = time.perf_counter()
            for _ in range(cfg.warmup):
                step()
            warmup_s = time.perf_counter() - t0
            tracker = _mem_tracker()
            tracker.track_external(model, *([opt] if opt is not None else []))
            comms = _comm_counter(tracker)

            def serials(tree) -> set[int]:
                return set().union(*map(tracker.serial_of, _local_tensors(tree)))

            sharded = serials(list(model.parameters()))
            phases = {"forward": 0}
            t0 = time.perf_counter()
            with tracker, comms:
                tracker.counting = True
                # keep the .grads to know their storages
                step(zero=False, mark=lambda phase: phases.setdefault(phase, len(tracker.timeline)))
                tracker.counting = False
            step_s = time.perf_counter() - t0
            grads = serials([p.grad for p in model.parameters() if p.grad is not None])
            opt_state = serials(list(opt.state.values())) if opt is not None else set()
            peak = next(iter(tracker.get_tracker_snapshot("peak").values()), {})
            known = (sharded, grads, opt_state, comms.serials)
            roles = _classify(tracker.at_peak(), *known)
            timeline = _role_timeline(tracker, known, phases)
            if opt is not None:
                opt.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            tracked = cfg.system == "fsdp2" and cfg.fsdp_tracker
            cross = _fsdp_mem_tracker(model, opt, step) if tracked else None
            cross_s = time.perf_counter() - t0
        result = {
            "config": dataclasses.asdict(cfg),
            "mesh": cfg.mesh,
            "note": note,
            "params": n_params,
            "layout": facts,
            "peak": {getattr(k, "name", str(k)).lower(): int(v) for k, v in peak.items()},
            "roles": roles,
            "comm": {k: list(v) for k, v in comms.summary().items()},
            "comm_events": [
                [e.kind, e.input_bytes, e.output_bytes, ranks]
                for e, ranks in zip(comms.events, comms.ranks)
            ],
            "allocations": sum(tracker.alloc_sizes.values()),
            "distinct_sizes": len(tracker.alloc_sizes),
            "timeline": timeline,
            "fsdp_mem_tracker": cross,
            "shard_s": shard_s,
            "warmup_s": warmup_s,
            "step_s": step_s,
            "fsdp_tracker_s": cross_s if cross is not None else None,
        }
    gc.collect()
    return result


def _fsdp_mem_tracker(model: nn.Module, opt, step) -> dict[str, Any]:
    """One more ``step`` of an FSDP2 ``model`` under torch's ``FSDPMemTracker``: its peak
    by its own categories, or the error it raised (a result too, not a crash)."""
    try:
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

        fmt = FSDPMemTracker(model, opt)
        with fmt:
            step(zero=False)
        peak = next(iter(fmt.get_tracker_snapshot("peak").values()), {})
        return {"peak": {getattr(k, "name", str(k)).lower(): int(v) for k, v in peak.items()}}
    except Exception as e:  # the cross-check failing is what it measured
        return {"error": f"{type(e).__name__}: {e}"}
    finally:
        if opt is not None:
            opt.zero_grad(set_to_none=True)


def time_fully_shard(
    model: str, world: int, system: str = "raggedfsdp", replicate: int | None = None
) -> dict[str, Any]:
    """Wall time of ``fully_shard`` of the whole catalogue ``model`` (all blocks, on ``meta``)
    over a fake process group of ``world`` ranks (HSDP with ``replicate`` replicas if not
    None), and what it keeps (Python objects)."""
    cfg = SimConfig(
        model=model, world=world, layers=None, system=system, ac=False, seq=16, replicate=replicate
    )
    gc.collect()
    with fake_world(world, replicate=replicate) as mesh:
        m, note = build_model(cfg)
        gc.collect()
        before = len(gc.get_objects())
        t0 = time.perf_counter()
        shard_model(m, mesh, system, "bf16")
        seconds = time.perf_counter() - t0
        gc.collect()
        objects = len(gc.get_objects()) - before
        blocks = len(blocks_of(m))
        del m
    gc.collect()
    return {
        "model": model,
        "world": world,
        "mesh": cfg.mesh,
        "system": system,
        "blocks": blocks,
        "note": note,
        "seconds": seconds,
        "gc_objects": objects,
    }
