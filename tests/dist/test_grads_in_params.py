"""Gradients written over their parameters ([Note: gradients in place]): exact, and loud
where it cannot apply.

- Bit-identical to a group with a gradient storage of its own (``grads_in_params=False``),
  step after step (gradients and parameters), on the dense and the MoE model, fp32 and
  bf16 compute with fp32 reduce, resharding after forward or not, with a frozen
  parameter and one that one rank does not use in the group: what is not a gradient
  (padding, frozen or unused parameters) is zeroed before the reduce-scatter, and the
  parameters gathered for the next step are the optimizer's, not gradients.
- Where it does not apply (gradient accumulation without sync, no reshard after
  backward) the group falls back to its own gradient storage, still exact.
- A parameter used in two reentrant checkpointed regions gets two gradients in one
  backward: that raises, naming the parameter and the fix; with the fix it trains.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import init_device_mesh
from torch.utils.checkpoint import checkpoint

from raggedfsdp import MixedPrecisionPolicy, fully_shard
from raggedfsdp.fsdp import buffers_of
from raggedfsdp.models import get_config
from raggedfsdp.models.transformer import Transformer, lm_loss
from tests.harness import run_cases, spawn

pytestmark = pytest.mark.numerics

SEQ = 16
STEPS = 3


def _model(name: str, mesh, in_params: bool, mp: bool, raf: bool) -> nn.Module:
    model = Transformer(get_config(name), max_seq_len=SEQ, seed=0)
    model.norm.weight.requires_grad_(False)  # a frozen parameter in the root group
    kw = dict(mesh=mesh, grads_in_params=in_params, reshard_after_forward=raf)
    if mp:
        kw["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    for block in model.transformer_blocks():
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    return model


def _batch(name: str, rank: int, step: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randint(0, get_config(name).vocab_size, (2, SEQ), generator=g)
    return x, torch.roll(x, -1, dims=1)


def _check_exact(mesh, rank, name: str, mp: bool, raf: bool, microbatches: int = 1):
    models = {flag: _model(name, mesh, flag, mp, raf) for flag in (True, False)}
    opts = {
        flag: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)
        for flag, m in models.items()
    }
    for step in range(STEPS):
        for model in models.values():
            for k in range(microbatches):
                model.set_requires_gradient_sync(k == microbatches - 1)
                x, y = _batch(name, rank, step * microbatches + k)
                lm_loss(model(x), y).backward()
        grads = {flag: dict(m.named_parameters()) for flag, m in models.items()}
        for fqn, p in grads[False].items():
            q = grads[True][fqn]
            if p.grad is None:
                assert q.grad is None, fqn
                continue
            assert torch.equal(q.grad.to_local(), p.grad.to_local()), (step, fqn)
        # whole shard gradient storages: padding and frozen parameters reduced as zeros
        for a, b in zip(buffers_of(models[True]), buffers_of(models[False])):
            assert torch.equal(a.shard_grad, b.shard_grad), (step, a)
        for flag in models:
            opts[flag].step()
            opts[flag].zero_grad()
        for (fqn, p), q in zip(models[False].named_parameters(), models[True].parameters()):
            assert torch.equal(q.to_local(), p.to_local()), (step, fqn)
    for model in models.values():  # nothing outlives the step
        for b in buffers_of(model):
            assert b.unsharded.untyped_storage().nbytes() == 0
            assert b.unsharded_grad.untyped_storage().nbytes() == 0


def _check_no_reshard_after_backward(mesh, rank):
    """The parameters stay unsharded after backward: gradients go to their own storage."""
    model = _model("llama-tiny", mesh, True, False, True)
    ref = _model("llama-tiny", mesh, False, False, True)
    for m in (model, ref):
        m.set_reshard_after_backward(False)
        x, y = _batch("llama-tiny", rank, 0)
        lm_loss(m(x), y).backward()
    for (fqn, p), q in zip(ref.named_parameters(), model.parameters()):
        if p.grad is not None:
            assert torch.equal(q.grad.to_local(), p.grad.to_local()), fqn
    for b in buffers_of(model):  # the unsharded parameters are parameters still
        assert not b.unsharded_holds_grads
    for m in (model, ref):
        m.reshard()


class _TwoRegions(nn.Module):
    """One linear layer used in two reentrant checkpointed regions."""

    def __init__(self):
        super().__init__()
        self.shared, self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        x = checkpoint(lambda t: self.a(self.shared(t)), x, use_reentrant=True)
        return checkpoint(lambda t: self.b(self.shared(t)), x, use_reentrant=True).sum()


def _check_reentrant(mesh, rank):
    torch.manual_seed(0)
    net, ref = _TwoRegions(), _TwoRegions()
    ref.load_state_dict(net.state_dict())
    fully_shard(net, mesh=mesh)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank), requires_grad=True)
    with pytest.raises(
        RuntimeError,
        match=r"parameter 'shared\.(weight|bias)' received a second gradient in one backward "
        r"\(reentrant activation checkpointing .* grads_in_params=False",
    ):
        net(x).backward()
    dist.barrier()
    # the fix: a gradient storage of its own; the gradients average the ranks' own
    fixed = _TwoRegions()
    fixed.load_state_dict(ref.state_dict())
    fully_shard(fixed, mesh=mesh, grads_in_params=False)
    fixed(x).backward()
    ref(x).backward()
    for p in ref.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()
    # the same per-rank backward; over 2 ranks a + b is the same sum in either order and
    # halving it is exact, however the group divides: the same arithmetic, bit for bit
    for (fqn, p), q in zip(ref.named_parameters(), fixed.parameters()):
        assert torch.equal(q.grad.full_tensor(), p.grad), fqn


def _grid(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    run_cases(
        {
            "llama fp32, reshard after forward": partial(
                _check_exact, mesh, rank, "llama-tiny", False, True
            ),
            "llama bf16, no reshard after forward": partial(
                _check_exact, mesh, rank, "llama-tiny", True, False
            ),
            "moe fp32": partial(_check_exact, mesh, rank, "moe-tiny", False, True),
            "moe bf16": partial(_check_exact, mesh, rank, "moe-tiny", True, True),
            "accumulation without sync": partial(
                _check_exact, mesh, rank, "llama-tiny", False, True, 2
            ),
            "no reshard after backward": partial(_check_no_reshard_after_backward, mesh, rank),
            "reentrant checkpointing": partial(_check_reentrant, mesh, rank),
        }
    )


def test_grads_in_params():
    spawn(2, _grid, timeout=400)
