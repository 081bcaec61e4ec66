"""The simulator (``raggedfsdp.tools.simulate``) checked against bytes computed by hand.

One step of a 2-block model at world 64 on fake tensors, by raggedfsdp and by torch's
FSDP2: the tracker's sharded-parameter bytes must be the layout's (raggedfsdp: S per
buffer; FSDP2: each parameter's dim 0 padded to a multiple of the world), and the
collectives' bytes the plan's global sizes, so that the instrument can be trusted at
scales where nothing else can check it. The same on an HSDP mesh (replicate=4, shard=16),
where the layout is the shard group's and each group's shard gradients are all-reduced
once over the replicas; FSDP2's own FSDPMemTracker must agree with MemTracker.
"""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from raggedfsdp.cli.simulate import main
from raggedfsdp.tools.simulate import (
    SimConfig,
    build_model,
    buildable_config,
    fake_world,
    shard_model,
    simulate,
)
from raggedfsdp.tools.simulate_results import cross_check, plot_timeline

WORLD = 64
CFG = {"model": "moe-tiny", "world": WORLD, "layers": 2, "seq": 32, "warmup": 1}
F32, BF16 = 4, 2
REPLICATE = 4  # the HSDP mesh: (4, 16)


@pytest.fixture(scope="module")
def results():
    return {s: simulate(SimConfig(system=s, **CFG)) for s in ("raggedfsdp", "fsdp2")}


@pytest.fixture(scope="module")
def hsdp():
    return {
        s: simulate(SimConfig(system=s, replicate=REPLICATE, **CFG))
        for s in ("raggedfsdp", "fsdp2")
    }


def _groups(system: str, replicate: int | None = None) -> list[dict]:
    """Per group, from the system's own structures (built apart from ``simulate``)."""
    cfg = SimConfig(system=system, replicate=replicate, **CFG)
    shard = WORLD // (replicate or 1)  # the ranks a buffer is sharded over
    with fake_world(WORLD, replicate=replicate) as mesh:
        model, _ = build_model(cfg)
        shard_model(model, mesh, system, "bf16")
        if system == "raggedfsdp":
            from raggedfsdp.fsdp import buffers_of

            return _ragged_groups(model, buffers_of(model))
        out = []
        for m in [*model.layers, model]:
            own = [p for n, p in m.named_parameters() if m is not model or "layers." not in n]
            padded = sum(
                math.ceil(p.shape[0] / shard) * shard * math.prod(p.shape[1:]) for p in own
            )
            out.append({"S": padded // shard, "global": padded, "root": m is model})
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
    _check_gathers_and_scatters(r, groups, WORLD)


def _check_gathers_and_scatters(r, groups, shard: int) -> None:
    gathers = sorted(o for kind, _, o, n in r["comm_events"] if kind == "all_gather" and n == shard)
    # Blocks gather in forward and again in backward; the root keeps its parameters.
    want = sorted(g["global"] * BF16 for g in groups for _ in range(1 if g["root"] else 2))
    assert gathers == want
    scatters = sorted(
        i for kind, i, _, n in r["comm_events"] if kind == "reduce_scatter" and n == shard
    )
    assert scatters == sorted(g["global"] * F32 for g in groups)
    assert r["comm"]["all_gather"][0] == len(want) and r["comm"]["reduce_scatter"][0] == len(groups)


@pytest.mark.parametrize("system", ["raggedfsdp", "fsdp2"])
def test_roles_add_up_to_the_peak(results, system):
    r = results[system]
    assert r["peak"]["total"] > 0
    assert sum(r["roles"].values()) == r["peak"]["total"]
    assert r["allocations"] >= r["distinct_sizes"] > 0
    assert r["layout"]["padding_elems"] >= 0


@pytest.mark.parametrize("system", ["raggedfsdp", "fsdp2"])
def test_timeline_by_role_adds_up_and_reaches_the_peak(results, system):
    t = results[system]["timeline"]
    assert 0 < len(t["at"]) <= 400 and t["at"] == sorted(t["at"]) and t["at"][-1] < t["ops"]
    for i, total in enumerate(t["total"]):
        assert sum(t["roles"][role][i] for role in t["roles"]) == total
    assert max(t["total"]) == results[system]["peak"]["total"]
    assert 0 == t["phases"]["forward"] < t["phases"]["backward"] < t["phases"]["optimizer"]


# ---- HSDP: a (replicate, shard) mesh ------------------------------------------------------------
@pytest.mark.parametrize("system", ["raggedfsdp", "fsdp2"])
def test_hsdp_sharded_bytes_are_the_shard_groups_layout(hsdp, system):
    r, groups = hsdp[system], _groups(system, REPLICATE)
    assert r["mesh"] == {"replicate": REPLICATE, "shard": WORLD // REPLICATE}
    assert r["roles"]["sharded_params"] == sum(g["S"] for g in groups) * F32
    assert sorted(g["shard_bytes"] for g in r["layout"]["groups"]) == sorted(
        g["S"] * F32 for g in groups
    )
    assert r["roles"]["optimizer"] == 2 * sum(g["S"] for g in groups) * F32 + _steps(r)


@pytest.mark.parametrize("system", ["raggedfsdp", "fsdp2"])
def test_hsdp_collectives(hsdp, system):
    r, groups = hsdp[system], _groups(system, REPLICATE)
    shard = WORLD // REPLICATE
    _check_gathers_and_scatters(r, groups, shard)
    # One all-reduce of each group's shard gradients (fp32) over the replicas...
    reduces = {n: sorted(i for k, i, o, m in r["comm_events"] if k == "all_reduce" and m == n)
               for n in (REPLICATE, shard)}  # fmt: skip
    want = [g["S"] * F32 for g in groups]
    # ... and nothing else: no collective for ranks to agree on which parameters got a
    # gradient ([Note: unused parameters] in fsdp/_state.py), as FSDP2.
    assert reduces == {REPLICATE: sorted(want), shard: []}
    assert r["comm"]["all_reduce"][0] == len(groups)


@pytest.mark.parametrize("which", ["results", "hsdp"])
def test_fsdp_mem_tracker_agrees_with_mem_tracker(request, which):
    r = request.getfixturevalue(which)["fsdp2"]
    assert "error" not in r["fsdp_mem_tracker"], r["fsdp_mem_tracker"]
    assert r["fsdp_mem_tracker"]["peak"]["total"] > 0
    assert abs(cross_check(r)) < 0.02
    assert request.getfixturevalue(which)["raggedfsdp"]["fsdp_mem_tracker"] is None


def test_plot_timeline(hsdp, tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "t.png"
    plot_timeline([hsdp["raggedfsdp"], hsdp["fsdp2"]], str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_json():
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        argv = ["--model", "llama-tiny", "--mesh", "shard=4,replicate=2", "--seq", "8", "--json"]
        main([*argv, "--system", "fsdp2"])
    r = json.loads(out.getvalue())
    assert r["config"]["world"] == 8 and r["peak"]["total"] > 0
    assert r["mesh"] == {"replicate": 2, "shard": 4} and "all_reduce" in r["comm"]


@pytest.mark.parametrize(
    "argv, match",
    [
        (
            ["--mesh", "replicate=4"],
            "--mesh 'replicate=4': the 'shard' dim is missing; give both, e.g. --mesh replicate=2,",
        ),
        (
            ["--mesh", "replicate=2,shard=4", "--world", "16"],
            r"--world 16 and --mesh replicate=2,shard=4 \(2 x 4 = 8 ranks\) disagree; drop --world",
        ),
        (
            ["--mesh", "replicate=2,tp=4"],
            "the 'tp' dim \\(tensor parallel\\) is not supported yet; simulate takes HSDP",
        ),
        (["--mesh", "replicate=0,shard=4"], "the size of 'replicate' must be an int"),
        (["--time-shard", "--png", "x.png"], "--png draws a simulated step"),
        (["--optim", "shampoo"], r"--optim shampoo steps raggedfsdp's .* --system raggedfsdp"),
    ],
)
def test_cli_mesh_errors_come_before_any_work(capsys, argv, match):
    assert main(["--model", "llama-tiny", *argv]) == 2
    out, stderr = capsys.readouterr()
    assert out == "" and stderr.startswith("raggedfsdp simulate: error: --")
    assert re.search(match, stderr), stderr


def test_errors():
    # DeepSeek-V3 builds (MLA attention); cut to 2 blocks it keeps one dense, one MoE
    c, note = buildable_config("deepseek-v3", layers=2, width=64)
    assert (c.attention, c.n_layers, c.n_dense_layers) == ("mla", 2, 1)
    assert "2 of 61 blocks (1 dense)" in note and c.kv_lora_rank == 512 // 64
    with pytest.raises(ValueError, match="system must be one of"):
        SimConfig(model="llama-tiny", system="fsdp1")
    with pytest.raises(ValueError, match="0 <= rank < world"):
        SimConfig(model="llama-tiny", world=4, rank=4)
    with pytest.raises(ValueError, match=r"replicate=3 does not divide world=64; the HSDP mesh"):
        SimConfig(model="llama-tiny", world=64, replicate=3)
    with pytest.raises(ValueError, match=r"optim='shampoo' steps raggedfsdp's RaggedShard"):
        SimConfig(model="llama-tiny", system="fsdp2", optim="shampoo")
    config, note = buildable_config("gpt-oss-120b", layers=2)
    assert not config.fused_gate_up and "unfused experts" in note and config.n_layers == 2
    assert torch.get_default_device().type == "cpu"


def test_shampoo_peak_is_adamws_plus_its_state(results):
    """Shampoo in the owner mode (moe-tiny's matrices span ranks at world 64): the step
    adds two all-to-alls (a rank receives what it sends), and its peak is at most AdamW's
    plus Shampoo's own state: gathering blocks on their owners costs no more than the
    AdamW moments it does without."""
    adamw, shampoo = results["raggedfsdp"], simulate(SimConfig(optim="shampoo", **CFG))
    count, sent, received = shampoo["comm"]["all_to_all"]
    assert count == 2 and sent == received > 0
    state = shampoo["roles"]["optimizer"]
    assert state > adamw["roles"]["optimizer"]
    assert shampoo["peak"]["total"] <= adamw["peak"]["total"] + state
