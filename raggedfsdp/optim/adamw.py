"""AdamW whose element-wise math runs once per DBuffer (flat), with torch's numbers.

[Note: flat optimizer state]
For parameters sharded by ``fully_shard``, the moments live in flat tensors laid
out like the group's shard storage (``S`` elements), and ``self.state[p]`` holds
``RaggedShard`` DTensor *views* of them, so ``state_dict`` and DCP see ordinary
per-parameter state. When every trainable parameter of a buffer has a gradient,
the same step count, lr, betas and eps, one step is ~8 kernels over the whole
buffer instead of ~8 per parameter; weight decay may differ per parameter (a
per-element decay factor, the usual no-decay group for norms and biases). Anything
else (mixed step counts, a parameter without a gradient, other tensors) takes the
per-parameter path over the same views. Both paths compute exactly what
``torch.optim.AdamW(foreach=False)`` computes: the same ops in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from raggedfsdp.fsdp._param_group import ParamGroup, owner_of

__all__ = ["AdamW"]


@dataclass
class _FlatState:
    exp_avg: torch.Tensor  # 1D, S elements, like the group's shard storage
    exp_avg_sq: torch.Tensor  # 1D, S elements
    decay_key: tuple | None = None  # (lr, per-parameter weight decays) of `decay`
    decay: torch.Tensor | None = None  # 1D, S: 1 - lr * wd of the parameter at each element


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


class AdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay), flat over raggedfsdp buffers.

    Args:
        params: parameters or parameter groups, as for ``torch.optim.AdamW``.
        lr: learning rate. Default 1e-3.
        betas: coefficients of the moment averages. Default (0.9, 0.999).
        eps: added to the denominator. Default 1e-8.
        weight_decay: decoupled weight decay. Default 1e-2.

    Raises:
        ValueError: a hyperparameter out of range, naming it.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2):
        if not lr >= 0.0:
            raise ValueError(f"AdamW: lr must be >= 0, got {lr}")
        if not eps >= 0.0:
            raise ValueError(f"AdamW: eps must be >= 0, got {eps}")
        for i, b in enumerate(betas):
            if not 0.0 <= b < 1.0:
                raise ValueError(f"AdamW: betas[{i}] must be in [0, 1), got {b}")
        if not weight_decay >= 0.0:
            raise ValueError(f"AdamW: weight_decay must be >= 0, got {weight_decay}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self._flat: dict[int, _FlatState] = {}

    # ---- state ----------------------------------------------------------------------------
    def _flat_state(self, group: ParamGroup) -> _FlatState:
        fs = self._flat.get(id(group))
        if fs is None or fs.exp_avg.shape != group.dbuf.shard.shape:
            shard = group.dbuf.shard
            fs = _FlatState(torch.zeros_like(shard), torch.zeros_like(shard))
            self._flat[id(group)] = fs
        return fs

    def _state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if state:
            return state
        owner = owner_of(p)
        state["step"] = torch.tensor(0.0)
        if owner is None:
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            return state
        group, ref = owner
        fs = self._flat_state(group)
        for key, flat in (("exp_avg", fs.exp_avg), ("exp_avg_sq", fs.exp_avg_sq)):
            start, stop = group.layout.shard_range(ref.fqn, group.rank)
            local = flat[start:stop].view(_local(p).shape)
            state[key] = DTensor.from_local(
                local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
            )
        return state

    def load_state_dict(self, state_dict) -> None:
        """Load, then move the loaded moments back into the flat buffers (views again)."""
        super().load_state_dict(state_dict)
        for p, state in list(self.state.items()):
            if owner_of(p) is None:
                continue
            loaded = dict(state)
            self.state[p] = {}
            fresh = self._state(p)
            fresh["step"] = loaded["step"].detach().clone().float().cpu()
            for key in ("exp_avg", "exp_avg_sq"):
                _local(fresh[key]).copy_(_local(loaded[key]))

    # ---- step -----------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        hyper: dict[int, dict] = {}
        params = []
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    hyper[id(p)] = g
                    params.append(p)
        by_buffer: dict[int, tuple[ParamGroup, list]] = {}
        single = []
        for p in params:
            owner = owner_of(p)
            if owner is None:
                single.append(p)
            else:
                by_buffer.setdefault(id(owner[0]), (owner[0], []))[1].append(p)
        for group, members in by_buffer.values():
            if not self._step_buffer(group, members, hyper):
                single.extend(members)
        for p in single:
            self._step_param(p, hyper[id(p)])
        return loss

    def _step_buffer(self, group: ParamGroup, members: list, hyper: dict) -> bool:
        """One fused update of a whole buffer; False when the per-parameter path must run."""
        trainable = [ref for ref in group.refs if ref.requires_grad]
        if len(members) != len(trainable):
            return False
        if any(ref.sharded.grad is not ref.sharded_grad for ref in trainable):
            return False  # a gradient that is not a view of the flat gradient storage
        hp = [hyper[id(ref.sharded)] for ref in trainable]
        shared = {(h["lr"], h["betas"], h["eps"]) for h in hp}
        states = [self._state(ref.sharded) for ref in trainable]
        steps = {s["step"].item() for s in states}
        if len(shared) != 1 or len(steps) != 1:
            return False
        (lr, (beta1, beta2), eps), step = shared.pop(), steps.pop() + 1
        for s in states:
            s["step"] += 1
        fs = self._flat_state(group)
        param, grad = group.dbuf.shard, group.dbuf.shard_grad  # 1D, S elements each
        wds = tuple(h["weight_decay"] for h in hp)
        if len(set(wds)) == 1 and len(trainable) == len(group.refs):
            param.mul_(1 - lr * wds[0])
        else:
            param.mul_(self._decay(group, fs, trainable, lr, wds))
        _adam_math(param, grad, fs.exp_avg, fs.exp_avg_sq, step, lr, beta1, beta2, eps)
        return True

    def _decay(self, group, fs, trainable, lr, wds) -> torch.Tensor:
        key = (lr, wds)
        if fs.decay_key != key:  # frozen parameters and padding keep a factor of 1
            decay = torch.ones_like(group.dbuf.shard)
            for ref, wd in zip(trainable, wds):
                start, stop = group.layout.shard_range(ref.fqn, group.rank)
                decay[start:stop] = 1 - lr * wd  # the same fp32 value the scalar path uses
            fs.decay, fs.decay_key = decay, key
        return fs.decay

    def _step_param(self, p: torch.Tensor, h: dict) -> None:
        state = self._state(p)
        state["step"] += 1
        lr, (beta1, beta2), eps = h["lr"], h["betas"], h["eps"]
        param = _local(p)
        param.mul_(1 - lr * h["weight_decay"])
        exp_avg, exp_avg_sq = _local(state["exp_avg"]), _local(state["exp_avg_sq"])
        _adam_math(
            param, _local(p.grad), exp_avg, exp_avg_sq, state["step"].item(), lr, beta1, beta2, eps
        )


def _adam_math(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps) -> None:
    """The moment updates and the parameter update, as torch's single-tensor AdamW."""
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr / bias_correction1
    denom = (exp_avg_sq.sqrt() / (bias_correction2**0.5)).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)
