"""Muon's math, as ``torch.optim.Muon`` has it: Newton-Schulz and the learning rate.

Both are what torch computes, op for op, so that distributed Muon (``muon.py``) gives
torch's bits: the same Newton-Schulz on the same whole matrix, in bf16.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = [
    "DEFAULT_NS_COEFFICIENTS",
    "DEFAULT_NS_STEPS",
    "EPS",
    "NS_DTYPE",
    "adjust_lr",
    "newton_schulz",
    "zeropower_via_newtonschulz",
]

# torch.optim.Muon's constants (Keller Jordan's Muon).
EPS = 1e-7
DEFAULT_NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
DEFAULT_NS_STEPS = 5
NS_DTYPE = torch.bfloat16  # NS runs in bf16: pieces and results travel as bf16 (exact)


def zeropower_via_newtonschulz(
    x: Tensor, ns_coefficients: Sequence[float], ns_steps: int, eps: float
) -> Tensor:
    """Quintic Newton-Schulz orthogonalisation of a 2-D ``x``, as ``torch.optim.Muon``.

    The same ops in the same order as torch's ``_zeropower_via_newtonschulz``: cast
    to bf16, transpose a tall matrix, divide by the Frobenius norm (at least
    ``eps``), ``ns_steps`` times ``X <- a X + (b A + c A A) X`` with ``A = X X^T``.

    Args:
        x: the matrix ``(rows, cols)``; a bf16 ``x`` is divided in place.
        ns_coefficients: ``(a, b, c)``.
        ns_steps: iterations (< 100).
        eps: lower bound of the norm.

    Returns:
        The bf16 result ``(rows, cols)`` (a transposed view for a tall ``x``).
    """
    a, b, c = ns_coefficients
    ortho = x.bfloat16()
    tall = x.size(0) > x.size(1)
    if tall:
        ortho = ortho.T
    ortho.div_(ortho.norm().clamp(min=eps))
    for _ in range(ns_steps):
        gram = ortho @ ortho.T
        gram_update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        ortho = torch.addmm(ortho, gram_update, ortho, beta=a)
    return ortho.T if tall else ortho


def newton_schulz(x: Tensor, hyper: dict) -> Tensor:
    """``zeropower_via_newtonschulz`` of ``x`` with a Muon group's hyperparameters."""
    return zeropower_via_newtonschulz(x, hyper["ns_coefficients"], hyper["ns_steps"], hyper["eps"])


def adjust_lr(lr: float, adjust_lr_fn: str | None, rows: int, cols: int) -> float:
    """Muon's learning rate for a ``rows x cols`` matrix, as ``torch.optim.Muon``.

    ``None`` / ``"original"``: ``lr * sqrt(max(1, rows / cols))`` (Keller Jordan);
    ``"match_rms_adamw"``: ``lr * 0.2 * sqrt(max(rows, cols))`` (Moonshot).
    """
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        ratio = math.sqrt(max(1, rows / cols))
    elif adjust_lr_fn == "match_rms_adamw":
        ratio = 0.2 * math.sqrt(max(rows, cols))
    else:
        ratio = 1.0
    return lr * ratio
