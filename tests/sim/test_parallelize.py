"""``parallelize``: the one recipe the application, the simulator and the benchmarks use,
here on 8 fake ranks: every block and the root sharded (torchtitan's grouping too), the
same modules under raggedfsdp and FSDP2, and bad input refused before any side effect."""

import pytest
import torch.distributed.fsdp as torch_fsdp

import raggedfsdp
from raggedfsdp import MeshSpec, parallelize, parse_mesh_spec
from raggedfsdp.models import Transformer, get_config
from raggedfsdp.tools.simulate import fake_world


def _sharded_modules(model) -> list[str]:
    return [n or "root" for n, m in model.named_modules() if isinstance(m, torch_fsdp.FSDPModule)]


@pytest.mark.parametrize("grouping", ["blocks", "torchtitan"])
def test_both_systems_shard_the_same_modules(grouping):
    got = {}
    with fake_world(8) as mesh:
        for name, fs in (("raggedfsdp", raggedfsdp.fully_shard), ("fsdp2", torch_fsdp.fully_shard)):
            model = Transformer(get_config("llama-tiny"), max_seq_len=16)
            split = parallelize(model, mesh, fully_shard=fs, grouping=grouping)
            got[name] = _sharded_modules(model)
            assert set(split) == {n for n, _ in model.named_parameters()}
            assert all(ranks == 8 for _, ranks in split.values())
    assert got["raggedfsdp"] == got["fsdp2"]
    blocks = [f"layers.{i}" for i in range(get_config("llama-tiny").n_layers)]
    extra = ["tok_embeddings", "norm", "output"] if grouping == "torchtitan" else []
    assert sorted(got["raggedfsdp"]) == sorted(["root", *extra, *blocks])


def test_bad_input_is_refused_before_any_sharding():
    with fake_world(8) as mesh:
        model = Transformer(get_config("llama-tiny"), max_seq_len=16)
        with pytest.raises(ValueError, match="grouping must be 'blocks' or 'torchtitan'"):
            parallelize(model, mesh, grouping="layers")
        spec = MeshSpec(world=8, tp=2)
        with pytest.raises(ValueError, match="grouping='torchtitan' takes no tp or ep"):
            parallelize(model, mesh, spec, grouping="torchtitan")
        assert _sharded_modules(model) == []


def test_the_mesh_spec_parser():
    assert parse_mesh_spec(None, 8) == MeshSpec(world=8)
    assert parse_mesh_spec("dp=4,tp=2", 8).dims == {"dp": 4, "tp": 2}
    assert parse_mesh_spec("replicate=2,shard=4", 8).shard == 4
    with pytest.raises(ValueError, match="does not divide"):
        parse_mesh_spec("tp=3", 8)
