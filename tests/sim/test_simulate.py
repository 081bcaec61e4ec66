"""The simulator (``raggedfsdp.simulate``) checked against bytes computed by hand.

One step of a 2-block model at world 64 on fake tensors, by raggedfsdp and by torch's
FSDP2: the tracker's sharded-parameter bytes must be the layout's (raggedfsdp: S per
buffer; FSDP2: each parameter's dim 0 padded to a multiple of the world), and the
collectives' bytes the plan's global sizes, so that the instrument can be trusted at
scales where nothing else can check it.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from raggedfsdp.simulate import (
    SimConfig,
    build_model,
    buildable_config,
    fake_world,
    main,
    shard_model,
    simulate,
)

WORLD = 64
CFG = {"model": "moe-tiny", "world": WORLD, "layers": 2, "seq": 32, "warmup": 1}
F32, BF16 = 4, 2


@pytest.fixture(scope="module")
def results():
    return {s: simulate(SimConfig(system=s, **CFG)) for s in ("raggedfsdp", "fsdp2")}


def _groups(system: str) -> list[dict]:
    """Per group, from the system's own structures (built apart from ``simulate``)."""
    cfg = SimConfig(system=system, **CFG)
    with fake_world(WORLD) as mesh:
        model, _ = build_model(cfg)
        shard_model(model, mesh, system, "bf16")
        if system == "raggedfsdp":
            from raggedfsdp.fsdp import buffers_of

            return _ragged_groups(model, buffers_of(model))
        out = []
        for m in [*model.layers, model]:
            own = [p for n, p in m.named_parameters() if m is not model or "layers." not in n]
            padded = sum(
                math.ceil(p.shape[0] / WORLD) * WORLD * math.prod(p.shape[1:]) for p in own
            )
            out.append({"S": padded // WORLD, "global": padded, "root": m is model})
        return out


def _ragged_groups(model, bufs) -> list[dict]:
    """Per buffer: its layout's S and global size, and whether it is the root's."""
    root_params = {id(p) for n, p in model.named_parameters() if not n.startswith("layers.")}
    return [
        {
            "S": b.layout.shard_size,
            "global": b.layout.global_size,
            "root": any(id(s.param) in root_params for s in b.params),
        }
        for b in bufs
    ]


@pytest.mark.parametrize("system", ["raggedfsdp", "fsdp2"])
def test_sharded_parameter_bytes_are_the_layouts(results, system):
    r, groups = results[system], _groups(system)
    assert r["roles"]["sharded_params"] == sum(g["S"] for g in groups) * F32
    assert r["roles"]["optimizer"] == 2 * sum(g["S"] for g in groups) * F32 + _steps(r)


def _steps(r) -> int:
    """AdamW's ``step`` counters: one fp32 scalar per parameter (on the CPU, tracked too)."""
    return r["layout"]["params"] * F32


@pytest.mark.parametrize("system", ["raggedfsdp", "fsdp2"])
def test_collective_bytes_are_the_plans_global_sizes(results, system):
    r, groups = results[system], _groups(system)
    gathers = sorted(o for kind, _, o in r["comm_events"] if kind == "all_gather")
    # Blocks gather in forward and again in backward; the root keeps its parameters.
    want = sorted(g["global"] * BF16 for g in groups for _ in range(1 if g["root"] else 2))
    assert gathers == want
    scatters = sorted(i for kind, i, _ in r["comm_events"] if kind == "reduce_scatter")
    assert scatters == sorted(g["global"] * F32 for g in groups)


@pytest.mark.parametrize("system", ["raggedfsdp", "fsdp2"])
def test_roles_add_up_to_the_peak(results, system):
    r = results[system]
    assert r["peak"]["total"] > 0
    assert sum(r["roles"].values()) == r["peak"]["total"]
    assert r["allocations"] >= r["distinct_sizes"] > 0
    assert r["layout"]["padding_elems"] >= 0


def test_cli_json():
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(["--model", "llama-tiny", "--world", "8", "--seq", "8", "--system", "fsdp2", "--json"])
    r = json.loads(out.getvalue())
    assert r["config"]["world"] == 8 and r["peak"]["total"] > 0


def test_errors():
    with pytest.raises(NotImplementedError, match="MLA attention"):
        buildable_config("deepseek-v3")
    with pytest.raises(ValueError, match="system must be one of"):
        SimConfig(model="llama-tiny", system="fsdp1")
    with pytest.raises(ValueError, match="0 <= rank < world"):
        SimConfig(model="llama-tiny", world=4, rank=4)
    config, note = buildable_config("gpt-oss-120b", layers=2)
    assert not config.fused_gate_up and "unfused experts" in note and config.n_layers == 2
    assert torch.get_default_device().type == "cpu"
