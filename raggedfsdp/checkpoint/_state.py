"""What a checkpoint holds: the flat DCP state dict of a model and optimizer, its
structure record, the checks of a checkpoint against a live model, and staging.

[Note: checkpoint keys]
DCP sees one flat dict of tensors, keyed by FQN::

    model.<fqn>                 every tensor of model.state_dict() (a tied parameter once,
                                under its first name): RaggedShard DTensors for sharded
                                parameters, plain tensors for buffers and ignored params
    optim.<fqn>.<state key>     every tensor of the optimizer's per-parameter state
                                (exp_avg, step, 8-bit codes, ...): DTensors stay sharded

DTensors are saved as the global boxes each rank holds and loaded into whatever
placement the target has (another world size, another block policy), so no rank
ever holds a whole tensor. Everything that is not a tensor (param groups with FQNs
for parameter ids, non-tensor state such as a ``None`` momentum, the step and the
user's extras) is the structure record, ``train_state.pt``, written by rank 0. It also
names the optimizer's class (``module.QualName``), so that ``load`` refuses, before
changing anything, an optimizer of another class: its state would not fit, or would
fit silently and mean something else (AdamW's moments in an SGD).
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import cast

import torch
from torch import Tensor, nn
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.tensor import DTensor

__all__ = [
    "LiveState",
    "check_against",
    "class_name",
    "collect",
    "first_nonfinite",
    "local_nbytes",
    "read_structure",
    "snapshot",
    "stage",
    "structure_bytes",
]

_SHOWN = 5  # offending FQNs named in one error


def _model_key(fqn: str) -> str:
    return f"model.{fqn}"


def _optim_key(fqn: str, key: str) -> str:
    return f"optim.{fqn}.{key}"


def _reshard_fsdp(model: nn.Module) -> None:
    """Make every fully_shard module hold its sharded parameters (a no-op when it does)."""
    from raggedfsdp.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


@dataclass
class LiveState:
    """The tensors of a model and optimizer as a checkpoint sees them (no copies).

    Attributes:
        model: FQN -> live tensor (a DTensor for sharded parameters), tied names once.
        aliases: tied name -> the FQN it is saved under.
        optim_params: FQNs of the optimizer's parameters, one list per param group.
        optim_state: FQN -> {state key: live value} for parameters that have state.
        optim_groups: the optimizer's param groups without their ``params``.
        optim_class: the optimizer's class as ``module.QualName``.
        optim_bases: the same for every class of its MRO (a subclass loads its base's).
    """

    model: dict[str, Tensor]
    aliases: dict[str, str]
    params: dict[str, Tensor]
    optim_params: list[list[str]] | None = None
    optim_state: dict[str, dict] | None = None
    optim_groups: list[dict] | None = None
    optim_class: str | None = None
    optim_bases: tuple[str, ...] = ()

    def tensors(self) -> dict[str, Tensor]:
        """The flat DCP state dict (see [Note: checkpoint keys])."""
        out = {_model_key(fqn): _detach(t) for fqn, t in self.model.items()}
        for fqn, state in (self.optim_state or {}).items():
            for key, value in state.items():
                if isinstance(value, Tensor):
                    out[_optim_key(fqn, key)] = _detach(value)
        return out

    def structure(self, step: int, extra) -> dict:
        """The structure record (everything that is not a sharded tensor)."""
        optim = None
        if self.optim_params is not None:
            assert self.optim_groups is not None and self.optim_state is not None  # set together
            optim = {
                "class": self.optim_class,
                "param_groups": [
                    {**hyper, "params": names}
                    for hyper, names in zip(self.optim_groups, self.optim_params)
                ],
                "tensor_keys": {
                    fqn: sorted(k for k, v in state.items() if isinstance(v, Tensor))
                    for fqn, state in self.optim_state.items()
                },
                "objects": {
                    fqn: {k: v for k, v in state.items() if not isinstance(v, Tensor)}
                    for fqn, state in self.optim_state.items()
                },
            }
        return {
            "step": step,
            "extra": extra,
            "model_keys": list(self.model),
            "aliases": dict(self.aliases),
            "optim": optim,
        }


def _detach(t: Tensor) -> Tensor:
    return t.detach()


def class_name(cls: type) -> str:
    """``module.QualName`` of ``cls``."""
    return f"{cls.__module__}.{cls.__qualname__}"


def first_nonfinite(tensors: dict[str, Tensor]) -> str | None:
    """The first key whose (local) floating-point tensor holds a nan or an inf, or None.

    One reduction per tensor and one host sync for all of them.
    """
    keys = [k for k, t in tensors.items() if _local(t).is_floating_point() and _local(t).numel()]
    if not keys:
        return None
    bad = torch.stack([~torch.isfinite(_local(tensors[k])).all() for k in keys])
    found = bad.nonzero()
    return keys[int(found[0, 0])] if found.numel() else None


def local_nbytes(tensors: dict[str, Tensor]) -> int:
    """Bytes this rank writes for ``tensors`` (its local shards)."""
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors.values())


def collect(model: nn.Module, optimizer: torch.optim.Optimizer | None, where: str) -> LiveState:
    """The live tensors of ``model`` and ``optimizer``, keyed by FQN.

    Raises:
        ValueError: the optimizer holds a parameter that is not the model's.
        NotImplementedError: a non-tensor entry in the model's state dict.
    """
    _reshard_fsdp(model)
    model_tensors: dict[str, Tensor] = {}
    aliases: dict[str, str] = {}
    first_name: dict[int, str] = {}
    for fqn, value in model.state_dict(keep_vars=True).items():
        if not isinstance(value, Tensor):
            raise NotImplementedError(
                f"{where}: model state {fqn!r} is a {type(value).__name__}, not a tensor; "
                "checkpoints hold tensors only (pass such values in extra=)"
            )
        if id(value) in first_name:  # a tied parameter: saved once, under its first name
            aliases[fqn] = first_name[id(value)]
            continue
        first_name[id(value)] = fqn
        model_tensors[fqn] = value
    params: dict[str, Tensor] = {
        first_name[id(p)]: p for p in model.parameters() if id(p) in first_name
    }
    live = LiveState(model_tensors, aliases, params)
    if optimizer is None:
        return live
    names = {id(p): fqn for fqn, p in params.items()}
    sd = optimizer.state_dict()
    flat = [p for group in optimizer.param_groups for p in group["params"]]
    strangers = [i for i, p in enumerate(flat) if id(p) not in names]
    if strangers:
        p = flat[strangers[0]]
        raise ValueError(
            f"{where}: the optimizer holds {len(strangers)} parameters that are not the "
            f"model's (the first has shape {tuple(p.shape)}); build the optimizer from "
            "model.parameters() after fully_shard"
        )
    index_fqn = [names[id(p)] for p in flat]
    live.optim_params = [[index_fqn[i] for i in g["params"]] for g in sd["param_groups"]]
    live.optim_groups = [{k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]]
    live.optim_state = {index_fqn[i]: dict(state) for i, state in sd["state"].items()}
    live.optim_class = class_name(type(optimizer))
    live.optim_bases = tuple(class_name(c) for c in type(optimizer).__mro__)
    return live


def structure_bytes(structure: dict, where: str) -> bytes:
    """``torch.save`` of the structure record, checked to load back with ``weights_only``.

    Raises:
        ValueError: ``extra`` (or an optimizer's non-tensor state) holds an object that
            ``torch.load(weights_only=True)`` cannot read back.
    """
    buf = io.BytesIO()
    try:
        torch.save(structure, buf)  # an object that does not pickle fails here
        data = buf.getvalue()
        torch.load(io.BytesIO(data), weights_only=True)
    except Exception as err:  # pickle refuses the type; say which and how to fix it
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(
            f"{where}: extra (or the optimizer's non-tensor state) holds an object that "
            f"torch.load(weights_only=True) cannot read back ({first}); keep extra to "
            "tensors, numbers, strings, None and lists / tuples / dicts of them"
        ) from None
    return data


def read_structure(data: bytes) -> dict:
    return torch.load(io.BytesIO(data), weights_only=True)


# ---- snapshot (async save) ----------------------------------------------------------------
def snapshot(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """A CPU copy of every tensor, taken now: later steps cannot leak into it.

    DTensors keep their spec (mesh, placements, global shape): DCP's boxes come from
    the spec and the local tensor only.
    """
    out: dict[str, Tensor] = {}
    for key, t in tensors.items():
        if isinstance(t, DTensor):
            local = t._local_tensor.detach().to("cpu", copy=True)
            out[key] = DTensor(local, t._spec, requires_grad=False)
        else:
            out[key] = t.detach().to("cpu", copy=True)
    return out


# ---- checks against a checkpoint ----------------------------------------------------------
def _names(items: list[str], quote: bool = True) -> str:
    shown = ", ".join(repr(s) if quote else s for s in items[:_SHOWN])
    more = f" and {len(items) - _SHOWN} more" if len(items) > _SHOWN else ""
    return f"[{shown}{more}]"


def check_against(live: LiveState, structure: dict, metadata: Metadata, loading_optim: bool):
    """Every way the checkpoint does not fit the live model / optimizer, as sentences.

    Returns:
        A list of problems, each naming the first offending FQNs; empty when it fits.
    """
    md = metadata.state_dict_metadata
    problems = []
    saved_model = set(structure["model_keys"])
    missing = [f for f in live.model if f not in saved_model or _model_key(f) not in md]
    unexpected = [f for f in structure["model_keys"] if f not in live.model]
    if missing:
        problems.append(f"model keys missing from the checkpoint: {_names(missing)}")
    if unexpected:
        problems.append(f"checkpoint keys the model does not have: {_names(unexpected)}")
    problems += _tensor_mismatches(
        [(f, live.model[f], md[_model_key(f)]) for f in live.model if f not in missing]
    )
    if not loading_optim:
        return problems
    assert live.optim_params is not None and live.optim_state is not None  # loading_optim
    saved = structure["optim"]
    if saved is None:
        problems.append("the checkpoint holds no optimizer state; pass optimizer=None")
        return problems
    saved_class = saved.get("class")  # None: written before the class was recorded
    if saved_class is not None and saved_class not in live.optim_bases:
        problems.append(
            f"the checkpoint's optimizer is a {saved_class}, this one a {live.optim_class}; "
            f"build the optimizer as {saved_class.rpartition('.')[2]} (or pass optimizer=None "
            "to load the model only)"
        )
        return problems
    saved_groups = [g["params"] for g in saved["param_groups"]]
    if len(saved_groups) != len(live.optim_params):
        problems.append(
            f"the optimizer has {len(live.optim_params)} param groups, the checkpoint "
            f"{len(saved_groups)}; build the optimizer with the same groups"
        )
        return problems
    for i, (ours, theirs) in enumerate(zip(live.optim_params, saved_groups)):
        if ours != theirs:
            absent = [f for f in ours if f not in theirs]
            extra = [f for f in theirs if f not in ours]
            detail = (
                f"missing from the checkpoint {_names(absent)}"
                if absent
                else f"not in the optimizer {_names(extra)}"
                if extra
                else "in another order"
            )
            problems.append(f"optimizer param group {i}: parameters {detail}")
    if problems:
        return problems
    pairs = []
    for fqn, keys in saved["tensor_keys"].items():
        state = live.optim_state.get(fqn)
        absent = [k for k in keys if _optim_key(fqn, k) not in md]
        if absent:
            problems.append(f"optimizer state {fqn!r} keys {absent} are missing from the files")
            continue
        if state:
            ours = sorted(k for k, v in state.items() if isinstance(v, Tensor))
            if ours != keys:
                problems.append(
                    f"optimizer state {fqn!r} has keys {ours}, the checkpoint {keys}; "
                    "load with the optimizer class that saved it"
                )
                continue
            pairs += [(f"{fqn} [{k}]", state[k], md[_optim_key(fqn, k)]) for k in keys]
    return problems + _tensor_mismatches(pairs)


def _tensor_mismatches(pairs) -> list[str]:
    shapes, dtypes = [], []
    for name, t, saved in pairs:
        if not isinstance(saved, TensorStorageMetadata):
            shapes.append(f"{name!r} (the checkpoint holds a non-tensor)")
        elif tuple(saved.size) != tuple(t.shape):
            shapes.append(f"{name!r} checkpoint {tuple(saved.size)} vs live {tuple(t.shape)}")
        elif saved.properties.dtype != t.dtype:
            dtypes.append(f"{name!r} checkpoint {saved.properties.dtype} vs live {t.dtype}")
    problems = []
    if shapes:
        problems.append(f"shape mismatches: {_names(shapes, quote=False)}")
    if dtypes:
        problems.append(
            f"dtype mismatches: {_names(dtypes, quote=False)}; cast the model before loading"
        )
    return problems


# ---- priming a fresh optimizer ------------------------------------------------------------
def needs_priming(live: LiveState, structure: dict, metadata: Metadata) -> list[str]:
    """FQNs with saved state but no live state whose layout cannot be told from the parameter.

    State shaped like its parameter is laid out like it, and a scalar is read whole;
    anything else (8-bit scales: one per quantization block, sharded by the optimizer's
    own rule) needs the optimizer to create its state first.
    """
    md = metadata.state_dict_metadata
    out = []
    assert live.optim_state is not None  # collected with the optimizer
    for fqn, keys in structure["optim"]["tensor_keys"].items():
        if live.optim_state.get(fqn):
            continue
        shape = tuple(live.params[fqn].shape)
        if any(tuple(_tensor_md(md, _optim_key(fqn, k)).size) not in ((), shape) for k in keys):
            out.append(fqn)
    return out


@torch.no_grad()
def prime(optimizer: torch.optim.Optimizer, params: list[Tensor]) -> None:
    """Create ``params``' optimizer state: one step with zero gradients and every lr 0.

    As ``torch.distributed.checkpoint.state_dict`` does for a fresh optimizer; the
    parameters keep their values (a zero-lr step of AdamW, Muon or AdamW8bit adds
    exact zeros), and the created state is overwritten by the load.
    """
    grads = [p.grad for p in params]
    lrs = [g["lr"] for g in optimizer.param_groups]
    others = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    held = [p.grad for p in others]
    try:
        for p in others:
            p.grad = None  # only the primed parameters step
        for p in params:
            p.grad = torch.zeros_like(p)
        for g in optimizer.param_groups:
            g["lr"] = torch.zeros_like(g["lr"]) if isinstance(g["lr"], Tensor) else 0.0
        optimizer.step()
    finally:
        for g, lr in zip(optimizer.param_groups, lrs):
            g["lr"] = lr
        for p, grad in zip(others, held):
            p.grad = grad
        for p, grad in zip(params, grads):
            p.grad = grad


# ---- staging ------------------------------------------------------------------------------
def _empty_like(template: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """A fresh tensor laid out as ``template`` (same placement for a DTensor)."""
    if isinstance(template, DTensor):
        local = torch.empty_like(template._local_tensor, dtype=dtype)
        return DTensor.from_local(
            local,
            template.device_mesh,
            template.placements,
            shape=template.shape,
            stride=template.stride(),
        )
    return torch.empty_like(template, dtype=dtype)


def stage(live: LiveState, structure: dict, metadata: Metadata, loading_optim: bool):
    """Fresh tensors to load the checkpoint into, laid out like the live ones.

    Optimizer state that does not exist yet (a fresh optimizer) is laid out like its
    parameter when it has the parameter's shape, else read whole (a step counter).

    Returns:
        The flat DCP state dict of fresh tensors.
    """
    md = metadata.state_dict_metadata
    staged = {_model_key(f): _empty_like(t) for f, t in live.model.items()}
    if not loading_optim:
        return staged
    assert live.optim_state is not None  # loading_optim
    for fqn, keys in structure["optim"]["tensor_keys"].items():
        state = live.optim_state.get(fqn) or {}
        param = live.params[fqn]
        for key in keys:
            saved = _tensor_md(md, _optim_key(fqn, key))
            if key in state:
                template, dtype = state[key], None
            elif tuple(saved.size) == tuple(param.shape):
                template, dtype = param, saved.properties.dtype
            else:
                template = torch.empty(tuple(saved.size), device=_local(param).device)
                dtype = saved.properties.dtype
            staged[_optim_key(fqn, key)] = _empty_like(template, dtype)
    return staged


def _tensor_md(md: dict, key: str) -> TensorStorageMetadata:
    """The metadata of a tensor entry (every optimizer state key ``tensor_keys`` lists)."""
    return cast(TensorStorageMetadata, md[key])


def _local(t: Tensor) -> Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


@torch.no_grad()
def copy_into(live: LiveState, staged: dict[str, Tensor]) -> None:
    """Copy the staged model tensors into the live ones (in place: views stay views)."""
    for fqn, t in live.model.items():
        _local(t).copy_(_local(staged[_model_key(fqn)]))


def optimizer_state_dict(live: LiveState, structure: dict, staged: dict[str, Tensor]) -> dict:
    """The staged optimizer state in ``Optimizer.load_state_dict``'s format (ids, not FQNs)."""
    saved = structure["optim"]
    assert live.optim_params is not None  # collected with the optimizer
    index = {fqn: i for i, fqn in enumerate(f for g in live.optim_params for f in g)}
    state = {}
    for fqn, keys in saved["tensor_keys"].items():
        entry = {k: staged[_optim_key(fqn, k)] for k in keys}
        entry.update(saved["objects"].get(fqn, {}))
        state[index[fqn]] = entry
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [index[f] for f in names]}
        for g, names in zip(saved["param_groups"], live.optim_params)
    ]
    return {"state": state, "param_groups": groups}
