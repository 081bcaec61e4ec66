"""Nothing lost, nothing silent, on 2 gloo ranks: every exception raised on one
rank inside ``checkpoint.save`` / ``load`` is raised on every rank (it used to leave the
others blocked in the next collective), and a nan in one rank's shard stops every rank's
save. One spawn runs every case; the model and optimizer stay as they were.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import init_device_mesh

from raggedfsdp import checkpoint, fully_shard
from raggedfsdp.models import get_config
from raggedfsdp.models.transformer import Transformer, lm_loss
from tests.harness import run_cases, spawn

SEQ = 16


class Boom(Exception):
    """An exception that does not pickle (its constructor needs two arguments)."""

    def __init__(self, where, detail):
        super().__init__(f"{where}: {detail}")


class _FlakySGD(torch.optim.SGD):
    """SGD that raises on one rank in ``state_dict`` / ``load_state_dict`` when armed."""

    fail: str | None = None  # "state_dict", "load_state_dict" or "unpicklable"

    def state_dict(self):
        if self.fail in ("state_dict", "unpicklable") and dist.get_rank() == 1:
            if self.fail == "unpicklable":
                raise Boom("rank 1", "state_dict failed")
            raise RuntimeError("rank 1: state_dict failed")
        return super().state_dict()

    def load_state_dict(self, state_dict):
        if self.fail == "load_state_dict" and dist.get_rank() == 1:
            raise RuntimeError("rank 1: load_state_dict failed")
        super().load_state_dict(state_dict)


def _model(world):
    model = Transformer(get_config("llama-tiny"), max_seq_len=SEQ, seed=0)
    mesh = init_device_mesh("cpu", (world,))
    for block in model.transformer_blocks():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = _FlakySGD(model.parameters(), lr=1e-2, momentum=0.9)
    x = torch.arange(2 * (SEQ + 1)).view(2, SEQ + 1).remainder(200)
    lm_loss(model(x[:, :-1]), x[:, 1:]).backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def _values(model, opt):
    """Clones of this rank's parameter shards and optimizer state: ``(params, state)``."""
    params = [p.to_local().clone() for p in model.parameters()]
    state = [s["momentum_buffer"].to_local().clone() for s in opt.state.values()]
    return params, state


def _same(a, b):
    assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _raises_everywhere(root, fail, call, error, message):
    model, opt = _model(dist.get_world_size())
    if call == "load":
        checkpoint.save(root, model, opt, step=1)
        model, opt = _model(dist.get_world_size())
        opt.step()  # other momentum than the saved one
    params, state = _values(model, opt)
    _FlakySGD.fail = fail
    try:
        with pytest.raises(error, match=message) as info:
            if call == "save":
                checkpoint.save(root, model, opt, step=2)
            else:
                checkpoint.load(root, model, opt)
    finally:
        _FlakySGD.fail = None
    if dist.get_rank() == 0:  # the copy of rank 1's error says where it came from
        assert "raised on rank 1 of 2" in "".join(getattr(info.value, "__notes__", []))
    now_params, now_state = _values(model, opt)
    _same(now_params, params)
    if fail != "load_state_dict" or dist.get_rank() == 1:  # rank 0's optimizer did load
        _same(now_state, state)
    left = sorted(p.name for p in root.iterdir()) if root.exists() else []
    assert left == ([] if call == "save" else ["step_00000001"]), left  # nothing written


def _nonfinite_on_one_rank(root):
    model, opt = _model(dist.get_world_size())
    checkpoint.save(root, model, opt, step=1)
    if dist.get_rank() == 1:
        local = next(p.to_local() for p in model.parameters() if p.to_local().numel())
        with torch.no_grad():
            local.view(-1)[-1] = float("nan")
    with pytest.raises(ValueError, match=r"save: 'model\..*' holds nan or inf on rank 1"):
        checkpoint.save(root, model, opt, step=2)
    assert sorted(p.name for p in root.iterdir()) == ["step_00000001"]


def _grid(rank, world, base):
    cases = {
        "save: RuntimeError on rank 1": partial(
            _raises_everywhere, base / "a", "state_dict", "save", RuntimeError, "rank 1: state_dict"
        ),
        "save: unpicklable error on rank 1": partial(
            _raises_everywhere, base / "b", "unpicklable", "save", (Boom, RuntimeError), "rank 1"
        ),
        "load: RuntimeError on rank 1 before reading": partial(
            _raises_everywhere, base / "c", "state_dict", "load", RuntimeError, "rank 1: state_"
        ),
        "load: RuntimeError on rank 1 after reading": partial(
            _raises_everywhere, base / "d", "load_state_dict", "load", RuntimeError, "load_state"
        ),
        "save: nan in rank 1's shard": partial(_nonfinite_on_one_rank, base / "e"),
    }
    run_cases(cases)


def test_an_error_on_one_rank_is_raised_on_every_rank(tmp_path):
    spawn(2, _grid, tmp_path, timeout=120)
