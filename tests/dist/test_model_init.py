"""``Transformer.init_weights`` on sharded DTensor parameters gives the unsharded values.

See [Note: deterministic init] in ``raggedfsdp/models/transformer.py``: every rank draws
the same full value and keeps its part, so meta init then sharding (any placement, any
world size) matches building the model on one CPU.
"""

from functools import partial

import torch
from torch import nn
from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

from raggedfsdp import RaggedShard
from raggedfsdp.models import Transformer, get_config
from tests.harness import run_cases, spawn


def _placement(rows: int, world: int, i: int):
    if i % 2:
        return Shard(0)
    # one-row blocks, uneven, the middle ranks empty: (rows // 2, 0, ..., rest)
    units = [0] * world
    units[0] += rows // 2
    units[-1] += rows - rows // 2
    return RaggedShard((0,), tuple(units))


def _check(name: str, world: int) -> None:
    config = get_config(name)
    mesh = init_device_mesh("cpu", (world,))
    with torch.device("meta"):
        model = Transformer(config, max_seq_len=32)
    for i, (fqn, param) in enumerate(list(model.named_parameters())):
        module_name, _, attr = fqn.rpartition(".")
        placement = _placement(param.shape[0], world, i)
        local = distribute_tensor(torch.empty(param.shape), mesh, [placement], src_data_rank=None)
        setattr(model.get_submodule(module_name), attr, nn.Parameter(local))
    model.rope = torch.empty_like(model.rope, device="cpu")
    model.init_weights(5)
    reference = dict(Transformer(config, seed=5, max_seq_len=32).named_parameters())
    for fqn, param in model.named_parameters():
        assert torch.equal(param.full_tensor(), reference[fqn]), fqn
    assert (model.output.weight is model.tok_embeddings.weight) == config.tie_embeddings


def _grid(rank, world):
    run_cases({n: partial(_check, n, world) for n in ("moe-small", "llama-tiny-tied")})


def test_init_weights_on_sharded_params():
    spawn(3, _grid)
