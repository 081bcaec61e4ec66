"""The whole-buffer rule on real buffers: a whole-buffer step is the per-parameter step.

Two copies of one sharded model train side by side with the same batches: one
keeps the ``.grad``s that ``fully_shard`` makes (views of the flat gradient
storage, so buffers step whole where [Note: whole-buffer steps] allows), the
other replaces each ``.grad`` by a copy (no view: every parameter steps alone).
Parameters and optimizer states must stay bit-identical, for ``AdamW``,
``AdamW8bit`` and ``Muon``'s AdamW groups, with a frozen parameter in a buffer.
One spawn runs the grid.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
from torch.distributed.tensor import DTensor, init_device_mesh

from raggedfsdp import fully_shard
from raggedfsdp.fsdp import buffers_of
from raggedfsdp.models import get_config
from raggedfsdp.models.transformer import Transformer, lm_loss
from raggedfsdp.optim import AdamW, AdamW8bit, Muon, adamw8bit_block_policy, muon_param_groups
from tests.dist.test_fully_shard import SEQ, _micro_batches
from tests.harness import run_cases, spawn

pytestmark = pytest.mark.numerics

STEPS = 3
FROZEN = "layers.0.attention.wk.weight"  # in a block's buffer, between other matrices


def _model(mesh, policy=None):
    model = Transformer(get_config("llama-tiny"), max_seq_len=SEQ, seed=0)
    model.get_parameter(FROZEN).requires_grad_(False)
    for block in model.transformer_blocks():
        fully_shard(block, mesh=mesh, block_policy=policy)
    fully_shard(model, mesh=mesh, block_policy=policy)
    return model


def _trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


OPTIMIZERS = {
    "adamw": (None, lambda m: AdamW(_trainable(m), lr=1e-2, weight_decay=0.1)),
    "adamw8bit": (
        adamw8bit_block_policy(),
        lambda m: AdamW8bit(_trainable(m), lr=1e-2, weight_decay=0.1),
    ),
    "muon": (None, lambda m: Muon(muon_param_groups(m, lr=1e-2, weight_decay=0.05), lr=0.02)),
}


def _record_whole(opt) -> list[bool]:
    """What ``_step_buffer`` answered, buffer by buffer, step by step."""
    answers = []
    step_buffer = opt._step_buffer
    opt._step_buffer = lambda *a: answers.append(step_buffer(*a)) or answers[-1]
    return answers


def _local_state(opt, p):
    return {
        k: (v._local_tensor if isinstance(v, DTensor) else v).clone()
        for k, v in opt.state[p].items()
    }


def _check_whole_is_per_parameter(mesh, rank, world, name):
    policy, make = OPTIMIZERS[name]
    whole, single = _model(mesh, policy), _model(mesh, policy)
    opts = make(whole), make(single)
    answers = [_record_whole(opt) for opt in opts]
    frozen_before = whole.get_parameter(FROZEN)._local_tensor.clone()
    for step in range(STEPS):
        for model, opt in zip((whole, single), opts):
            for x, y in _micro_batches(step, 1, rank, world):
                lm_loss(model(x), y).backward()
            if model is single:
                for p in _trainable(model):
                    p.grad = p.grad.detach().clone()  # no longer a view: per parameter
            opt.step()
            opt.zero_grad()
    assert any(answers[0]) and not any(answers[1]), answers
    assert torch.equal(whole.get_parameter(FROZEN)._local_tensor, frozen_before)
    for (n, p), q in zip(whole.named_parameters(), single.parameters()):
        assert torch.equal(p._local_tensor, q._local_tensor), n
        ours, theirs = _local_state(opts[0], p), _local_state(opts[1], q)
        assert ours.keys() == theirs.keys(), n
        for key in ours:
            assert torch.equal(ours[key], theirs[key]), (n, key)


def _check_muon_steps_whole_only_buffers_of_adamw_parameters(mesh, rank, world):
    """Muon's matrices share the blocks' buffers: those step per parameter; the root's
    buffer (embeddings, final norm, head: all AdamW) steps whole."""
    model = _model(mesh)
    opt = Muon(muon_param_groups(model), lr=0.02)
    answers = _record_whole(opt)
    for x, y in _micro_batches(0, 1, rank, world):
        lm_loss(model(x), y).backward()
    opt.step()
    n_buffers = len(buffers_of(model))  # a buffer per block, then the root's
    assert sorted(answers) == [False] * (n_buffers - 1) + [True], answers


def _grid(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    cases = {
        f"{name}: whole == per parameter": partial(
            _check_whole_is_per_parameter, mesh, rank, world, name
        )
        for name in OPTIMIZERS
    }
    cases["muon: whole buffers of AdamW parameters only"] = partial(
        _check_muon_steps_whole_only_buffers_of_adamw_parameters, mesh, rank, world
    )
    run_cases(cases)


@pytest.mark.parametrize("world", [2])
def test_whole_buffer_steps_match_per_parameter_steps(world):
    spawn(world, _grid, timeout=300)
