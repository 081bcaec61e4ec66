"""AdamW whose element-wise math runs once per buffer (flat), with torch's numbers.

[Note: flat optimizer state]
For parameters sharded by ``fully_shard``, the moments live in flat tensors laid
out like the buffer's shard storage (``S`` elements), and ``self.state[p]`` holds
``RaggedShard`` DTensor *views* of them, so ``state_dict`` and DCP see ordinary
per-parameter state. A buffer that [Note: whole-buffer steps] lets step whole
(``flat.py``) takes ~8 kernels plus one per run of equal weight decay, instead of
~8 per parameter; every other parameter steps alone over the same views (plain
tensors and DTensors of other placements over their own moments). Both paths
compute exactly what ``torch.optim.AdamW(foreach=False)`` computes: the same ops in
the same order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from raggedfsdp.fsdp import BufferView, buffer_of
from raggedfsdp.optim.flat import FlatOptimizer, WholeStep, check_hyper, like_param, local

__all__ = ["AdamW", "FlatAdamW"]


@dataclass(eq=False)
class _Moments:
    exp_avg: Tensor  # 1D, S elements, laid out like the buffer's shard storage
    exp_avg_sq: Tensor  # 1D, S elements


class FlatAdamW(FlatOptimizer):
    """The AdamW update over flat moments: the base of ``AdamW``, and of ``Muon`` for
    its AdamW groups. Its groups carry ``lr``, ``betas``, ``eps`` and ``weight_decay``.
    See [Note: flat optimizer state].
    """

    # ---- state ----------------------------------------------------------------------------
    def _moments(self, buf: BufferView) -> _Moments:
        fs = self._flat.get(buf)
        shard = buf.shard  # 1D, S elements
        if fs is None or fs.exp_avg.shape != shard.shape:
            fs = _Moments(torch.zeros_like(shard), torch.zeros_like(shard))
            self._flat[buf] = fs
        return fs

    def _init_state(self, p: Tensor, state: dict) -> None:
        found = buffer_of(p)
        if found is None:
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            return
        buf, s = found
        fs = self._moments(buf)
        state["exp_avg"] = like_param(s.view(fs.exp_avg), p)
        state["exp_avg_sq"] = like_param(s.view(fs.exp_avg_sq), p)

    def load_state_dict(self, state_dict) -> None:
        """Load, then move the loaded moments back into the flat buffers (views again)."""
        super().load_state_dict(state_dict)
        for p, state in list(self.state.items()):
            if "exp_avg" in state and buffer_of(p) is not None:
                self._reload(p, dict(state))

    # ---- step -----------------------------------------------------------------------------
    def _step_whole(self, whole: WholeStep) -> None:
        buf, h = whole.buffer, whole.group
        fs = self._moments(buf)
        lr, (beta1, beta2) = h["lr"], h["betas"]
        param, grad = buf.shard, buf.shard_grad  # 1D, S elements each
        _adam_math(param, grad, fs.exp_avg, fs.exp_avg_sq, whole.step, lr, beta1, beta2, h["eps"])

    def _step_param(self, p: Tensor, h: dict, step: float) -> None:
        state = self.state[p]
        lr, (beta1, beta2) = h["lr"], h["betas"]
        exp_avg, exp_avg_sq = local(state["exp_avg"]), local(state["exp_avg_sq"])
        assert p.grad is not None  # stepped only with a gradient
        _adam_math(local(p), local(p.grad), exp_avg, exp_avg_sq, step, lr, beta1, beta2, h["eps"])


class AdamW(FlatAdamW):
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
        check_hyper("AdamW", lr=lr, eps=eps, betas=betas, weight_decay=weight_decay)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)


def _adam_math(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps) -> None:
    """The moment updates and the parameter update, as torch's single-tensor AdamW."""
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr / bias_correction1
    denom = (exp_avg_sq.sqrt() / (bias_correction2**0.5)).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)
