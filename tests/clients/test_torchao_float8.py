"""torchao's float8 training with FSDP float8 all-gather trains on raggedfsdp as on FSDP2.

``convert_to_float8_training(model, config=Float8LinearConfig(emulate=True,
enable_fsdp_float8_all_gather=True))`` wraps each linear's weight in torchao's
``WeightWithDynamicFloat8CastTensor``, whose ``fsdp_pre_all_gather`` casts the local shard
to ``float8_e4m3fn`` (the scale from an amax all-reduced over the shard mesh, or one
``precompute_float8_dynamic_scale_for_fsdp`` computed after the optimizer step) and whose
``fsdp_post_all_gather`` wraps the gathered codes as a ``Float8TrainingTensor``
(``emulate``: the matmuls dequantize, as a CPU needs). raggedfsdp gathers those weights
through the same hooks (see [Note: tensor-subclass all-gather] in
``raggedfsdp/fsdp/_subclass.py``).

Each case trains the same model on the same data with torch's FSDP2 and with raggedfsdp,
in the same two gloo ranks. The losses and the final master weights are compared
bitwise: both give the hooks the same rows of the same weights; the amax all-reduce is a
max (exact, whatever the split), the cast is elementwise, so both gather the same codes
and scales; each rank then runs the same kernels on the same unsharded weights, and the
average of two ranks' gradients is the same sum in either order, halved exactly.
"""

from __future__ import annotations

import functools
import importlib.util

import pytest
import torch
import torch.distributed.fsdp as torch_fsdp
from torch import nn
from torch.distributed.tensor import DTensor, init_device_mesh

from tests.harness import run_cases, spawn

pytestmark = [
    pytest.mark.numerics,
    pytest.mark.skipif(
        importlib.util.find_spec("torchao") is None,
        reason="torchao is not installed: `make test-clients` installs the clients extra",
    ),
]

WORLD = 2
STEPS = 3
DIMS = (32, 64, 32, 16)  # float8 matmuls take dims that are multiples of 16


def _model():
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    layers = []
    for d_in, d_out in zip(DIMS, DIMS[1:]):
        layers += [nn.Linear(d_in, d_out), nn.ReLU()]
    model = nn.Sequential(*layers[:-1])
    config = Float8LinearConfig(emulate=True, enable_fsdp_float8_all_gather=True)
    return convert_to_float8_training(model, config=config)


def _linears(model):
    return [m for m in model if isinstance(m, nn.Linear)]


def _full(p: DTensor) -> torch.Tensor:
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    local = p._local_tensor
    if isinstance(local, WeightWithDynamicFloat8CastTensor):
        local = local._tensor
    dt = DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
    return dt.full_tensor()


def _count_hooks():
    """Count every call of torchao's two hooks (this process's class, patched once)."""
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor as W

    if not hasattr(W, "_calls"):
        W._calls = {"pre": 0, "post": 0}
        pre, post = W.fsdp_pre_all_gather, W.fsdp_post_all_gather

        @functools.wraps(pre)
        def counted_pre(self, mesh):
            W._calls["pre"] += 1
            return pre(self, mesh)

        @functools.wraps(post)
        def counted_post(self, *args, **kwargs):
            W._calls["post"] += 1
            return post(self, *args, **kwargs)

        W.fsdp_pre_all_gather, W.fsdp_post_all_gather = counted_pre, counted_post
    W._calls.update(pre=0, post=0)
    return W._calls


def _train(fully_shard, rank, mesh, per_linear: bool, precompute: bool) -> dict:
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    from raggedfsdp.tools.profiling import CommCounter

    model = _model()
    if per_linear:
        for lin in _linears(model):
            fully_shard(lin, mesh=mesh)
    fully_shard(model, mesh=mesh)
    calls = _count_hooks()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(1)
    losses = []
    with CommCounter() as comms:
        for _ in range(STEPS):
            if precompute:
                precompute_float8_dynamic_scale_for_fsdp(model)
            x = torch.randn(2 * WORLD, 6, DIMS[0], generator=gen)[2 * rank : 2 * rank + 2]
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
    return {
        "model": model,
        "losses": torch.stack(losses),
        "params": {n: _full(p.detach()) for n, p in model.named_parameters()},
        "calls": dict(calls),
        "gathered bytes": sum(e.output_bytes for e in comms.events if e.kind == "all_gather"),
    }


def _against_fsdp2(rank, world, per_linear: bool, precompute: bool):
    import raggedfsdp
    from raggedfsdp.fsdp import buffers_of

    mesh = init_device_mesh("cpu", (world,))
    want = _train(torch_fsdp.fully_shard, rank, mesh, per_linear, precompute)
    got = _train(raggedfsdp.fully_shard, rank, mesh, per_linear, precompute)
    assert torch.equal(got["losses"], want["losses"]), (got["losses"], want["losses"])
    for name, w in want["params"].items():
        g = got["params"][name]
        assert torch.equal(g, w), f"{name} differs from FSDP2's by {(g - w).abs().max():.3g}"
    gathers = STEPS * (2 if per_linear else 1)  # blocks reshard after forward; the root not
    assert want["calls"] == got["calls"] == {"pre": 3 * gathers, "post": 3 * gathers}, (
        want["calls"],
        got["calls"],
    )
    model = got["model"]
    weights = [lin.weight for lin in _linears(model)]
    units = [w.placements[-1].local_units for w in weights]
    # every rank holds rows of every weight (torchao's amax takes none badly): in one
    # group, each weight gets a buffer of its own
    assert all(0 not in u for u in units), units
    # What raggedfsdp's all-gathers carried: the weights as float8 (one byte an element),
    # the biases' buffers as fp32, whole (each rank's input padded to the largest's).
    plain, wrapped = 0, 0
    for buf in buffers_of(model):
        if buf.subclass_all_gather:
            wrapped += len(buf.params)
        else:
            plain += buf.world_size * buf.layout.shard_size * buf.dtype.itemsize
    assert wrapped == len(weights), wrapped
    float8 = WORLD * sum(max(u) * w.numel() // w.shape[0] for u, w in zip(units, weights))
    # one weight per buffer: each rank's input is its rows
    assert got["gathered bytes"] == gathers * (plain + float8), (got["gathered bytes"], plain)
    fp32 = WORLD * sum(w.numel() for w in weights) * 4
    assert got["gathered bytes"] < gathers * (plain + fp32) / 2, got["gathered bytes"]


def _cases(rank, world):
    run_cases(
        {
            "a group per linear, scales from the amax all-reduce": functools.partial(
                _against_fsdp2, rank, world, True, False
            ),
            "one group, scales from the amax all-reduce": functools.partial(
                _against_fsdp2, rank, world, False, False
            ),
            "one group, precomputed scales": functools.partial(
                _against_fsdp2, rank, world, False, True
            ),
        }
    )


def test_torchao_float8_all_gather_against_fsdp2():
    spawn(WORLD, _cases, timeout=300)
