"""The block policy ``python -m raggedfsdp train`` passes to ``fully_shard``, per optimizer.

``--block-rows R`` is the base block of every parameter; each optimizer may need more:

    --optim        policy
    adamw, sgd,    BlockPolicy(rows=R)
    flat-adamw
    adamw8bit      CombinedPolicy(BlockPolicy(rows=R), adamw8bit_block_policy()): whole
                   quantization blocks on every rank (AdamW8bit raises otherwise)
    muon           muon_block_policy(model, world, rows=R): R, and whole matrices on one
                   rank where that costs little padding
    shampoo        shampoo_auto_policy(model, world, base=BlockPolicy(rows=R), ...):
                   whole Shampoo blocks on every rank (communication-free) where that
                   costs little padding, else R (blocks preconditioned on owner ranks)

[Note: combined block policies]
A block that is a whole block of several policies is the lcm of their rows (a
parameter some policy keeps whole stays whole). When that lcm does not divide the
parameter's rows, ``fully_shard`` could not use it, so the parameter is kept whole:
always valid for every policy, at some cost in balance (``AdamW8bitBlockPolicy``'s own
fallback). ``R`` itself is checked against every parameter before any rank starts
(``check_block_rows``), so a bad ``--block-rows`` is an error, not a silent "whole".
A Muon with 8-bit states would combine ``muon_block_policy`` and
``adamw8bit_block_policy`` the same way.
"""

from __future__ import annotations

import math

from torch import nn

from raggedfsdp.fsdp import BlockPolicy
from raggedfsdp.optim import adamw8bit_block_policy, muon_block_policy, shampoo_auto_policy

__all__ = [
    "CombinedPolicy",
    "block_policy",
    "block_rows",
    "check_block_rows",
    "member_rows",
    "shampoo_layout",
]

WHOLE = "whole"


def member_rows(param) -> int:
    """Rows as ``fully_shard`` counts them: of ``[numel / last_dim, last_dim]``, per member
    of a stacked ``[E, out, in]`` tensor (see ``BlockPolicy``)."""
    if len(param.shape) <= 1:
        return math.prod(param.shape)  # a 1-D tensor's rows are its elements
    rows = math.prod(param.shape) // param.shape[-1]
    return rows // param.shape[0] if len(param.shape) >= 3 else rows


class CombinedPolicy:
    """Blocks that are whole blocks of every policy given. See [Note: combined block policies].

    Args:
        *policies: ``(fqn, param) -> rows or "whole"`` callables.
    """

    def __init__(self, *policies):
        self.policies = policies

    def __call__(self, fqn: str, param: nn.Parameter):
        rows = 1
        for policy in self.policies:
            got = policy(fqn, param)
            if got == WHOLE:
                return WHOLE
            rows = math.lcm(rows, got)
        return rows if member_rows(param) % rows == 0 else WHOLE


def block_rows(args):
    """``--block-rows`` as ``BlockPolicy`` takes it: an int, or ``"whole"``."""
    return args.block_rows if args.block_rows == WHOLE else int(args.block_rows)


def block_policy(args, model: nn.Module, world: int):
    """The policy for ``fully_shard`` (raggedfsdp backend) that ``args.optim`` can train with.

    Args:
        args: the checked arguments (``block_rows``, ``optim``).
        model: the model, before ``fully_shard`` (it may be on ``meta``).
        world: ranks of the mesh.
    """
    rows = block_rows(args)
    if args.optim == "muon":
        return muon_block_policy(model, world, rows=rows)
    if args.optim == "adamw8bit":
        return CombinedPolicy(BlockPolicy(rows=rows), adamw8bit_block_policy())
    if args.optim == "shampoo":
        return shampoo_layout(args, model, world).policy
    return BlockPolicy(rows=rows)


def shampoo_layout(args, model: nn.Module, world: int):
    """``--optim shampoo``'s layout (a ``ShampooLayoutChoice``: its policy and mode)."""
    return shampoo_auto_policy(
        model,
        world,
        block_size=args.shampoo_block_size,
        row_block=args.shampoo_row_block,
        whole_matrices=args.shampoo_grafting == "parameter",
        base=BlockPolicy(rows=block_rows(args)),
        max_buffers=args.max_buffers,
    )


def check_block_rows(args, model: nn.Module, world: int) -> None:
    """Raise ValueError if ``--block-rows`` does not fit every parameter of ``model``.

    A parameter with fewer rows than the block is kept whole (``BlockPolicy``'s
    ``whole_if_fewer_rows``); every other one must have a multiple of it.
    """
    rows = block_rows(args)
    params = [(n, p) for n, p in model.named_parameters()]
    base = BlockPolicy(rows=rows)
    for name, p in params:
        got = base(name, p)
        if got != WHOLE and member_rows(p) % got:
            fits = [
                r
                for r in range(1, 257)
                if all(member_rows(q) % r == 0 or member_rows(q) < r for _, q in params)
            ]
            raise ValueError(
                f"train: --block-rows {rows} does not divide the {member_rows(p)} rows of "
                f"{name!r} (shape {tuple(p.shape)}) of {args.model}; pass a block that divides "
                f"every parameter's rows (here: {', '.join(map(str, fits))}) or 'whole'"
            )
    policy = block_policy(args, model, world)  # raises on what the optimizer cannot use
    for name, p in params:
        policy(name, p)
