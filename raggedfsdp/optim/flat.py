"""The scaffold of raggedfsdp's element-wise optimizers: one step, partitioned by buffer.

``FlatOptimizer`` collects the parameters of a step, partitions them by the
``fully_shard`` buffer they live in (``raggedfsdp.fsdp.buffer_of``), decides with
one rule which buffers step as a whole, and leaves the math to its subclasses
(``FlatAdamW``, ``AdamW8bit``; ``Muon`` for its AdamW groups): a hook for a whole
buffer and a hook for one parameter.

[Note: whole-buffer steps]
A parameter sharded by ``fully_shard`` is a view of its buffer's shard storage
(``BufferView.shard``, 1D, S elements) and, after a backward, its ``.grad`` a view
of ``shard_grad``. An element-wise optimizer whose state is laid out like ``shard``
can then run its math once over the buffer (a fixed number of kernels) instead
of once per parameter. A buffer B steps whole in a step exactly when

1. the parameters this step updates in B are B's trainable parameters, every one
   of them: a trainable parameter without a gradient, one stepped by another
   optimizer (or, in ``Muon``, by the Muon part of the same optimizer), or a
   frozen parameter that was handed a gradient keeps B per parameter;
2. no frozen parameter of B has state in this optimizer. A frozen parameter's
   gradient elements are zero, as padding's, so its state elements stay zero and
   the whole-buffer math leaves its elements exactly as they are; weight decay
   skips it (``decay_runs``);
3. ``B.grads_are_views()``: every trainable ``.grad`` is its view of ``shard_grad``;
4. the stepped parameters share ``lr``, ``betas`` and ``eps``, and ``eps > 0``
   (with ``eps = 0`` an element of zero gradient and zero moments, padding or a
   frozen parameter, would become 0 / 0). Weight decay may differ: it is applied
   by runs of equal decay;
5. they share one step count.

``why_not_whole`` is this rule. Every other parameter steps alone over the same
state (views). Both paths compute the same numbers: the same element-wise ops in
the same order on the same values, and weight decay as the same scalar multiply.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from raggedfsdp.fsdp import BufferView, ParamSlice, buffer_of

__all__ = [
    "FlatOptimizer",
    "Item",
    "WholeStep",
    "check_hyper",
    "decay_",
    "decay_runs",
    "like_param",
    "local",
    "name_of",
    "partition_by_buffer",
    "split_by_flag",
    "why_not_whole",
]

SHARED_KEYS = ("lr", "betas", "eps")  # hyper-parameters one whole-buffer update shares

Item = tuple[Tensor, dict]  # a parameter of the step and its param group


# ---------------------------------------------------------------------------------------------
# Small helpers shared by the optimizers
# ---------------------------------------------------------------------------------------------
def local(t: Tensor) -> Tensor:
    """The local tensor of a DTensor, or ``t`` itself."""
    return t._local_tensor if isinstance(t, DTensor) else t


def like_param(local_tensor: Tensor, p: Tensor) -> Tensor:
    """``local_tensor`` as a DTensor placed like ``p`` (itself for a plain ``p``)."""
    if not isinstance(p, DTensor):
        return local_tensor
    return DTensor.from_local(
        local_tensor, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
    )


def check_hyper(
    where: str,
    *,
    lr: float,
    eps: float,
    weight_decay: float,
    betas: Sequence[float] | None = None,
) -> None:
    """Raise ``ValueError`` naming ``where`` for an out-of-range shared hyper-parameter.

    Args:
        where: the optimizer (and group kind) the message names, e.g. ``"AdamW"``.
        lr, eps, weight_decay: must be >= 0.
        betas: each must be in [0, 1). Default None (not checked).
    """
    if not lr >= 0.0:
        raise ValueError(f"{where}: lr must be >= 0, got {lr}")
    if not eps >= 0.0:
        raise ValueError(f"{where}: eps must be >= 0, got {eps}")
    for i, b in enumerate(betas or ()):
        if not 0.0 <= b < 1.0:
            raise ValueError(f"{where}: betas[{i}] must be in [0, 1), got {b}")
    if not weight_decay >= 0.0:
        raise ValueError(f"{where}: weight_decay must be >= 0, got {weight_decay}")


# ---------------------------------------------------------------------------------------------
# The rule (see [Note: whole-buffer steps])
# ---------------------------------------------------------------------------------------------
def partition_by_buffer(items: Iterable[Item]) -> tuple[dict[BufferView, list[Item]], list[Item]]:
    """``({buffer: its items}, items of parameters in no buffer)``, in first-seen order."""
    by_buffer: dict[BufferView, list[Item]] = {}
    loose: list[Item] = []
    for p, group in items:
        found = buffer_of(p)
        if found is None:
            loose.append((p, group))
        else:
            by_buffer.setdefault(found[0], []).append((p, group))
    return by_buffer, loose


def why_not_whole(
    slices: Sequence[ParamSlice],
    grads_are_views: bool,
    groups: Mapping[Tensor, dict],
    step_of: Callable[[Tensor], float],
    has_state: Callable[[Tensor], bool],
) -> str | None:
    """Why a buffer cannot step whole, or None when it can: see [Note: whole-buffer steps].

    Args:
        slices: every parameter of the buffer (``BufferView.params``).
        grads_are_views: ``BufferView.grads_are_views()``.
        groups: the parameters of the buffer this step updates -> their param groups.
        step_of: a stepped parameter's step count so far.
        has_state: whether this optimizer holds state for a (frozen) parameter.
    """
    stepped = 0
    for s in slices:
        if s.requires_grad and s.param not in groups:
            return f"trainable parameter {s.fqn!r} is not stepped here"
        if not s.requires_grad and s.param in groups:
            return f"frozen parameter {s.fqn!r} has a gradient"
        if not s.requires_grad and has_state(s.param):
            return f"frozen parameter {s.fqn!r} has optimizer state"
        stepped += s.requires_grad
    if stepped != len(groups):
        raise AssertionError("why_not_whole: stepped parameters that are not in the buffer")
    if not grads_are_views:
        return "a gradient is not a view of the buffer's gradient storage"
    shared = {tuple(group[k] for k in SHARED_KEYS) for group in groups.values()}
    if len(shared) > 1:
        return "the parameters differ in lr, betas or eps"
    if any(not group["eps"] > 0 for group in groups.values()):
        return "eps is 0: padding and frozen elements would become 0 / 0"
    if len({float(step_of(p)) for p in groups}) > 1:
        return "the parameters differ in step count"
    return None


def decay_runs(slices: Sequence[ParamSlice], groups: Mapping[Tensor, dict]) -> list[tuple]:
    """``(start, stop, weight decay)`` runs of the shard storage that weight decay scales.

    Neighbouring stepped parameters of equal decay merge into one run (padding
    between them is zero: scaling it is harmless); a frozen parameter ends a run,
    and runs of decay 0 are left out (a factor of 1).
    """
    runs: list[list] = []
    last = None  # the decay of the previous parameter on this rank (None: frozen)
    for s in sorted(slices, key=lambda s: s.start):
        if s.stop == s.start:
            continue
        wd = groups[s.param]["weight_decay"] if s.param in groups else None
        if wd and wd == last:  # the previous parameter's run
            runs[-1][1] = s.stop
        elif wd:
            runs.append([s.start, s.stop, wd])
        last = wd
    return [tuple(r) for r in runs]


def decay_(shard: Tensor, runs: Sequence[tuple], lr: float) -> None:
    """Decoupled weight decay of ``shard`` (1D, S elements) by ``decay_runs``, in place.

    Each run is multiplied by the scalar ``1 - lr * wd``: the very op (and bits)
    of the per-parameter path and of ``torch.optim.AdamW``.
    """
    for start, stop, wd in runs:
        shard[start:stop].mul_(1 - lr * wd)


@dataclass(frozen=True)
class WholeStep:
    """One whole-buffer update, as the rule allowed it (step counted, weight decay applied).

    Args:
        buffer: the buffer; its ``shard`` and ``shard_grad`` (1D, S each) are stepped.
        group: the param group of one stepped parameter (the shared ``lr``, ``betas``, ``eps``).
        step: the step number of this update (1 for the first).
    """

    buffer: BufferView
    group: dict
    step: float


# ---------------------------------------------------------------------------------------------
# The scaffold
# ---------------------------------------------------------------------------------------------
class FlatOptimizer(torch.optim.Optimizer):
    """An optimizer whose element-wise math runs once per ``fully_shard`` buffer when it can.

    ``step`` collects the parameters that have a gradient, with their groups, and
    hands them to ``_step_items`` (by default: all to ``_step_flat``). ``_step_flat``
    partitions them by buffer and steps each buffer whole when
    [Note: whole-buffer steps] allows it, every other parameter one by one. The
    scaffold counts the steps (``state["step"]``, a CPU tensor as in ``torch.optim``)
    and applies the decoupled weight decay of every group (``1 - lr * weight_decay``,
    per parameter or per run of a buffer); a subclass adds its update:

    - ``_init_state(p, state)``: fill ``p``'s fresh state (it has ``"step"``);
    - ``_step_whole(whole)``: update a whole buffer;
    - ``_step_param(p, group, step)``: update one parameter;
    - ``_load_hint()``: what to tell a user whose loaded state does not fit;
    - ``_check_new(p)``: raise, before any step, for a parameter it cannot step.

    It keeps the flat state of each buffer in ``self._flat`` (keyed by ``BufferView``).

    Args:
        params: parameters or parameter groups, as for ``torch.optim.Optimizer``.
        defaults: the default hyper-parameters of a group.
    """

    def __init__(self, params, defaults: dict):
        self._flat: dict[BufferView, Any] = {}  # the subclass's flat state of each buffer
        super().__init__(params, defaults)

    # ---- hooks ----------------------------------------------------------------------------
    def _init_state(self, p: Tensor, state: dict) -> None:
        raise NotImplementedError

    def _step_whole(self, whole: WholeStep) -> None:
        raise NotImplementedError

    def _step_param(self, p: Tensor, group: dict, step: float) -> None:
        raise NotImplementedError

    def _load_hint(self) -> str:
        return ""

    def _check_new(self, p: Tensor) -> None:
        """Raise if ``p`` (without state yet) cannot be stepped; runs for every such
        parameter before any is touched, so a bad one leaves all unchanged."""

    # ---- step -----------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        items = [(p, g) for g in self.param_groups for p in g["params"] if p.grad is not None]
        for p, _ in items:
            if not self.state.get(p):
                self._check_new(p)
        self._step_items(items)
        return loss

    def _step_items(self, items: list[Item]) -> None:
        self._step_flat(items)

    def _step_flat(self, items: list[Item]) -> None:
        """Step ``items``: whole buffers where the rule allows, the rest one by one."""
        by_buffer, single = partition_by_buffer(items)
        for buf, members in by_buffer.items():
            if not self._step_buffer(buf, members):
                single.extend(members)
        for p, group in single:
            state = self._state(p)
            state["step"] += 1
            local(p).mul_(1 - group["lr"] * group["weight_decay"])
            self._step_param(p, group, state["step"].item())  # a CPU tensor: no device sync

    def _step_buffer(self, buf: BufferView, members: list[Item]) -> bool:
        """Step ``buf`` as a whole if [Note: whole-buffer steps] allows; whether it did."""
        slices = buf.params
        groups = dict(members)
        reason = why_not_whole(
            slices,
            buf.grads_are_views(),
            groups,
            lambda p: self._state(p)["step"].item(),
            lambda p: bool(self.state.get(p)),
        )
        if reason is not None:
            return False
        for p in groups:
            self._state(p)["step"] += 1
        step = self._state(members[0][0])["step"].item()
        group = members[0][1]
        decay_(buf.shard, decay_runs(slices, groups), group["lr"])
        self._step_whole(WholeStep(buf, group, step))
        return True

    # ---- state ----------------------------------------------------------------------------
    def _state(self, p: Tensor) -> dict:
        """``p``'s state, created on first use."""
        state = self.state[p]
        if not state:
            # torch.optim keeps the step count on the CPU (unless capturable / fused)
            state["step"] = torch.tensor(0.0, device="cpu")
            self._init_state(p, state)
        return state

    def _name(self, p: Tensor) -> str:
        """``p``'s name in its buffer, or its place in ``param_groups``."""
        found = buffer_of(p)
        if found is not None:
            return found[1].fqn
        for gi, g in enumerate(self.param_groups):
            for pi, q in enumerate(g["params"]):
                if q is p:
                    return f"param_groups[{gi}]['params'][{pi}]"
        return "<unknown>"

    def _reload(self, p: Tensor, loaded: dict) -> None:
        """Make ``p``'s state afresh in this optimizer's own storage and copy ``loaded`` in.

        Raises:
            ValueError: ``loaded`` holds other states, or states of other shapes.
        """
        self.state[p] = {}
        fresh = self._state(p)
        shapes = {k: tuple(local(v).shape) for k, v in fresh.items() if k != "step"}
        got = {k: tuple(local(v).shape) for k, v in loaded.items() if k != "step"}
        if shapes != got:
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: parameter {self._name(p)!r} has "
                f"states {got} in the state dict but {shapes} here{self._load_hint()}"
            )
        fresh["step"] = loaded["step"].detach().to(device="cpu", dtype=torch.float32, copy=True)
        for key, value in fresh.items():
            if key != "step":
                local(value).copy_(local(loaded[key]))


def name_of(p: Tensor, fallback: str) -> str:
    """The fully qualified name of sharded parameter ``p`` (``fallback`` for another tensor)."""
    found = buffer_of(p)
    return found[1].fqn if found is not None else fallback


def split_by_flag(
    optimizer: torch.optim.Optimizer,
    param_group: Mapping[str, Any],
    flag: str,
    predicate: Callable[[str, Tensor], bool],
    who: str,
    defaults: Mapping[bool, Mapping[str, Any]],
) -> dict | None:
    """A parameter group of an optimizer whose parameters take one of two updates (Muon's
    and Shampoo's matrices, or their AdamW part), chosen by the group's boolean ``flag``.

    Returns:
        The group when it has ``flag``: its ``params`` a list, the flag a bool, and the
        hyper-parameters it does not set taken from ``defaults[flag]``. None when it had
        no ``flag``: then it was split by ``predicate(name, param)`` into a group per
        value of the flag, each added through ``optimizer.add_param_group``.

    Raises:
        ValueError: a group with no parameters.
    """
    group = dict(param_group)
    params = group["params"]
    params = [params] if isinstance(params, Tensor) else list(params)
    if flag in group:
        group["params"] = params
        group[flag] = bool(group[flag])
        for k, v in defaults[group[flag]].items():
            group.setdefault(k, v)
        return group
    first = len(optimizer.param_groups)
    split: dict[bool, list[Tensor]] = {True: [], False: []}
    for p in params:
        split[bool(predicate(name_of(p, ""), p))].append(p)
    for value in (True, False):
        if split[value]:
            optimizer.add_param_group({**group, "params": split[value], flag: value})
    if len(optimizer.param_groups) == first:
        raise ValueError(f"{who}: a parameter group has no parameters")
    return None
