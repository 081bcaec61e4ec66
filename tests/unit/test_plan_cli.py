"""``python -m raggedfsdp plan``: listing, text and JSON reports, model files, errors."""

from __future__ import annotations

import json

import pytest

from raggedfsdp.cli.plan import main
from raggedfsdp.planner import default_alpha_bytes

JSON_KEYS = {
    "padding_ratio",
    "lower_bound_padding_ratio",
    "plan_seconds",
    "fsdp2_padding_ratio",
    "fsdp1_padding_ratio",
    "zero3_padding_ratio",
}


def run(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_list_prints_every_model_with_its_size(capsys):
    rc, out, _ = run(capsys, "--list")
    assert rc == 0
    for name, size in [
        ("llama3-8b", "8.03B"),
        ("llama3-70b", "70.55B"),
        ("llama3.1-405b", "405.85B"),
        ("gpt-oss-120b", "116.83B"),
        ("deepseek-v3", "671.03B"),
        ("qwen3-235b-a22b", "235.09B"),
        ("moe-2.4t", "2406.39B"),
    ]:
        line = next(ln for ln in out.splitlines() if ln.startswith(name + " "))
        assert size in line


def test_text_report(capsys):
    rc, out, _ = run(capsys, "--model", "deepseek-v3", "--world", "1024", "--block-rows", "128")
    assert rc == 0
    lines = out.splitlines()
    assert lines[0].startswith("raggedfsdp plan: deepseek-v3 (671.03B params), world 1024")
    kinds = [ln.split()[0] for ln in lines[2:7]]
    assert kinds == ["embed", "dense", "moe", "head", "total"]
    assert "plan time:" in out and "FSDP2" in out


def test_json_report(capsys):
    rc, out, _ = run(capsys, "--model", "gpt-oss-120b", "--world", "256", "--json")
    assert rc == 0
    report = json.loads(out)
    assert JSON_KEYS <= set(report)
    assert report["fsdp2_padding_ratio"] == pytest.approx(0.98, abs=0.01)
    assert report["lower_bound_padding_ratio"] <= report["padding_ratio"]
    assert report["padding_ratio"] < 0.01 < report["fsdp2_padding_ratio"]
    assert set(report["kinds"]) == {"embed", "moe", "head"}
    assert report["kinds"]["moe"]["groups"] == 36
    assert report["distinct_groups"] == 3


def test_json_model_file_and_png(capsys, tmp_path):
    model = tmp_path / "tiny.json"
    model.write_text(
        json.dumps(
            {
                "name": "tiny",
                "groups": [
                    {
                        "name": "layers",
                        "kind": "moe",
                        "repeat": 3,
                        "params": [
                            {"name": "experts", "shape": [6, 16, 8], "stack": True},
                            {"name": "w", "shape": [40, 8]},
                            {"name": "norm", "shape": [8]},
                        ],
                    }
                ],
            }
        )
    )
    png = tmp_path / "layout.png"
    rc, out, _ = run(
        capsys,
        "--model",
        str(model),
        "--world",
        "5",
        "--block-rows",
        "4",
        "--json",
        "--dtype",
        "float32",
        "--png",
        str(png),
        "--member-gaps",
    )
    assert rc == 0
    report = json.loads(out)
    assert report["model"] == "tiny" and report["groups"] == 3 and report["member_gaps"]
    assert report["png"]["group"] == "layers.0"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_exact_mode(capsys, tmp_path):
    model = tmp_path / "p.json"
    model.write_text(
        json.dumps(
            {
                "groups": [
                    {
                        "name": "g",
                        "params": [
                            {"name": f"t{i}", "shape": [n], "block_rows": "whole"}
                            for i, n in enumerate([3, 2, 3, 2, 2])
                        ],
                    }
                ]
            }
        )
    )
    rc, out, _ = run(
        capsys,
        "--model",
        str(model),
        "--world",
        "2",
        "--dtype",
        "float32",
        "--alignment-bytes",
        "4",
        "--exact",
        "--json",
    )
    assert rc == 0
    report = json.loads(out)
    assert report["exact"]["g"] == {"shard_size": 6, "proven_optimal": True}
    assert report["padding"] == 0


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--model", "llama5"], "unknown model 'llama5'; catalogued models: llama3-8b"),
        (["--model", "llama3-8b", "--world", "0"], "--world must be >= 1, got 0"),
        (["--world", "8"], "--model is required"),
        (["--model", "llama3-8b", "--block-rows", "zero"], "expected a number of rows"),
        (["--model", "llama3-8b", "--alignment-bytes", "3"], "not a positive multiple"),
        (["--model", "llama3-8b", "--png", "x.png", "--png-group", "nope"], "--png-group 'nope'"),
    ],
)
def test_errors(capsys, argv, match):
    rc, _, err = run(capsys, *argv)
    assert rc == 2
    assert match in err


def test_block_larger_than_a_tensor_in_a_model_file(capsys, tmp_path):
    model = tmp_path / "m.json"
    model.write_text(
        json.dumps({"groups": [{"params": [{"name": "w", "shape": [10, 4], "block_rows": 16}]}]})
    )
    rc, _, err = run(capsys, "--model", str(model))
    assert rc == 2
    assert "'w' of shape (10, 4) has 10 rows, fewer than its block of 16 rows" in err


# ---- HSDP: --mesh replicate=R,shard=S (see [Note: HSDP in the plan]) -------------------------
def _plan_at(model: str, ranks: int, block_rows: int) -> list:
    """The layouts of ``model``'s groups planned at ``ranks`` directly, with the planner."""
    from raggedfsdp.models import CATALOGUE, param_groups
    from raggedfsdp.planner import TensorSpec, plan_buffer, with_block_rows

    return [
        plan_buffer(
            [
                with_block_rows(TensorSpec(name=p.fqn, shape=p.shape, stack=p.stack), block_rows)
                for p in g.params
            ],
            ranks,
        )
        for g in param_groups(CATALOGUE[model])
    ]


def test_mesh_plans_at_the_shard_group_and_counts_the_all_reduce(capsys):
    rc, out, _ = run(capsys, "--model", "llama3-8b", "--mesh", "replicate=4,shard=16",
                     "--block-rows", "128", "--reduce-dtype", "float32", "--max-buffers", "1",
                     "--json")  # fmt: skip
    assert rc == 0
    report = json.loads(out)
    layouts = _plan_at("llama3-8b", 16, 128)  # bfloat16 buffers: 2 bytes; float32 grads: 4
    assert report["mesh"] == {"replicate": 4, "shard": 16}
    assert (report["world_size"], report["shard_group_size"], report["replicate_size"]) == (
        64,
        16,
        4,
    )
    assert report["padding"] == sum(lay.padding for lay in layouts) > 0
    assert report["shard_bytes"] == sum(2 * lay.shard_size for lay in layouts)
    assert report["all_gather_bytes"] == sum(2 * 16 * lay.shard_size for lay in layouts)
    assert report["reduce_scatter_bytes"] == sum(4 * 16 * lay.shard_size for lay in layouts)
    assert report["hsdp_all_reduce_bytes"] == sum(4 * lay.shard_size for lay in layouts)
    assert (
        sum(k["hsdp_all_reduce_bytes"] for k in report["kinds"].values())
        == (report["hsdp_all_reduce_bytes"])
    )
    # the padding (ours and the peers') is the plain plan's over the 16 ranks of a group
    rc, out, _ = run(capsys, "--model", "llama3-8b", "--world", "16", "--block-rows", "128",
                     "--reduce-dtype", "float32", "--max-buffers", "1", "--json")  # fmt: skip
    plain = json.loads(out)
    for key in ("padding", "fsdp2_padding", "fsdp1_padding", "zero3_padding", "all_gather_bytes"):
        assert report[key] == plain[key], key
    assert plain["mesh"] is None and plain["hsdp_all_reduce_bytes"] == 0


def test_mesh_bytes_of_a_small_model_by_hand(capsys, tmp_path):
    """One [6, 4] float32 tensor over shard=2: S = 12 elements, no padding; a rank holds
    48 bytes, gathers 96, reduce-scatters 96, all-reduces 48 over its 3 replicas."""
    model = tmp_path / "m.json"
    group = {"name": "g", "params": [{"name": "w", "shape": [6, 4]}]}
    model.write_text(json.dumps({"groups": [group]}))
    argv = ["--model", str(model), "--dtype", "float32", "--alignment-bytes", "4", "--json"]
    rc, out, _ = run(capsys, *argv, "--mesh", "shard=2,replicate=3", "--world", "6")
    assert rc == 0
    report = json.loads(out)
    [kind] = report["kinds"].values()
    assert kind["shard_sizes"] == [12] and report["padding"] == 0
    assert [report[k] for k in ("shard_bytes", "all_gather_bytes", "reduce_scatter_bytes",
                                "hsdp_all_reduce_bytes")] == [48, 96, 96, 48]  # fmt: skip
    rc, out, _ = run(capsys, *argv, "--mesh", "replicate=1,shard=2")  # no replicas: nothing
    assert json.loads(out)["hsdp_all_reduce_bytes"] == 0


def test_mesh_text_report(capsys):
    argv = ["--model", "deepseek-v3", "--block-rows", "16"]
    rc, out, _ = run(capsys, *argv, "--mesh", "replicate=8,shard=128")
    assert rc == 0
    lines = out.splitlines()
    assert lines[0].startswith(
        "raggedfsdp plan: deepseek-v3 (671.03B params), mesh replicate=8 x shard=128 (1024 "
        "ranks; buffers planned over the 128 ranks of a shard group)"
    )
    # total: groups, buffers, collectives, params, padding, pad %, bound %, 1-buffer pad %, ...
    total = next(ln for ln in lines if ln.startswith("total")).split()
    assert float(total[8]) < 1.0  # one buffer per group: 0.7% over 128 ranks
    assert float(total[6]) <= float(total[8])
    assert "HSDP all-reduce over 8 replicas: " in out and "bytes per rank per step:" in out
    rc, out, _ = run(capsys, *argv, "--world", "1024")
    total = next(ln for ln in out.splitlines() if ln.startswith("total")).split()
    assert float(total[8]) > 50.0  # 54% over 1024 in one buffer per group,
    assert float(total[6]) < 3.0  # 2.27% in up to 4 (multi-buffer groups)
    assert "HSDP" not in out


def test_multi_buffer_plan_report(capsys):
    """deepseek-v3, 16-row blocks, 1024 ranks: one buffer per group pads 54%; up to 2 or
    4 buffers pad under 3%, each buffer's bound summed and every count consistent."""
    argv = ["--model", "deepseek-v3", "--block-rows", "16", "--world", "1024", "--json"]
    _, out, _ = run(capsys, *argv, "--max-buffers", "1")
    one = json.loads(out)
    _, out, _ = run(capsys, *argv)
    multi = json.loads(out)
    assert one["max_buffers"] == 1 and multi["max_buffers"] == 4
    assert one["buffers"] == one["groups"] == multi["groups"] == 63
    assert 63 < multi["buffers"] <= 4 * 63
    assert multi["collectives_per_step"] == 3 * multi["buffers"]
    assert one["padding_ratio"] == pytest.approx(0.5401, abs=1e-4)
    assert multi["single_buffer_padding_ratio"] == one["padding_ratio"]
    assert multi["single_buffer_lower_bound_padding_ratio"] == one["lower_bound_padding_ratio"]
    assert multi["lower_bound_padding_ratio"] <= multi["padding_ratio"] < 0.03
    assert multi["padding"] < one["padding"] and multi["params"] == one["params"]
    _, out, _ = run(capsys, *argv, "--max-buffers", "2")  # the goal: <= 3%, <= 2 each
    two = json.loads(out)
    assert two["padding_ratio"] < 0.03 and two["buffers"] <= 2 * 63


def test_exact_splits(capsys, tmp_path):
    """--exact with --max-buffers 2 solves every split of a small group: 16- and 7-row
    blocks in one buffer pad 1 MiB at 4 ranks; apart they pad nothing, for one more
    buffer (``default_alpha_bytes(4)``, about 0.4 MB), and the exact split is the
    planner's. A group of over 10 tensors is reported unsolved."""
    group = [{"name": f"a{i}", "shape": [64, 16384], "block_rows": 16} for i in range(2)]
    group += [{"name": f"b{i}", "shape": [56, 16384], "block_rows": 7} for i in range(2)]
    large = [{"name": f"c{i}", "shape": [8, 4], "block_rows": 1} for i in range(11)]
    model = tmp_path / "p.json"
    model.write_text(
        json.dumps({"groups": [{"name": "g", "params": group}, {"name": "h", "params": large}]})
    )
    argv = ["--model", str(model), "--world", "4", "--dtype", "float32", "--json", "--exact"]
    _, out, _ = run(capsys, *argv, "--max-buffers", "1")
    one = json.loads(out)
    assert one["exact"]["g"] == {"shard_size": 1 << 20, "proven_optimal": True}
    rc, out, _ = run(capsys, *argv, "--max-buffers", "2")
    assert rc == 0
    two = json.loads(out)
    assert two["exact"]["g"] == {
        "solved": True,
        "buffers": 2,
        "shard_sizes": [2 * 64 * 16384 // 4, 2 * 56 * 16384 // 4],
        "cost_bytes": default_alpha_bytes(4),  # no padding, one more buffer
        "planner_cost_bytes": default_alpha_bytes(4),
        "proven_optimal": True,
    }
    assert two["exact"]["h"] == {"solved": False, "tensors": 11, "proven_optimal": False}
    assert one["padding"] >= (1 << 20) // 4 and two["padding"] < one["padding"]


@pytest.mark.parametrize(
    "mesh, extra, match",
    [
        ("replicate=2", [], "--mesh 'replicate=2': the 'shard' dim is missing; give both, e.g. "
         "--mesh replicate=2,shard=4"),
        ("replicate=2,shard=0", [], "the size of 'shard' must be an int >= 1, got '0'"),
        ("replicate=two,shard=2", [], "the size of 'replicate' must be an int >= 1, got 'two'"),
        ("replicate:2,shard=2", [], "expected name=size pairs separated by commas, got "
         "'replicate:2'"),
        ("dp=2,shard=2", [], "unknown dim 'dp'; expected some of replicate, shard"),
        ("shard=2,shard=2", [], "'shard' is given twice"),
        ("tp=2,shard=4", [], "the 'tp' dim (tensor parallel) is not supported yet; plan takes HSDP "
         "meshes: pass replicate=R,shard=S"),
        ("replicate=2,ep=4", [], "the 'ep' dim (expert parallel) is not supported yet"),
        ("replicate=2,shard=4", ["--world", "4"], "--world 4 and --mesh replicate=2,shard=4 "
         "(2 x 4 = 8 ranks) disagree; drop --world (the mesh gives it) or make it 8"),
        ("replicate=2,shard=4", ["--reduce-dtype", "float7"], "--reduce-dtype: planner: dtype "
         "'float7' is unknown"),
    ],
)  # fmt: skip
def test_mesh_errors_come_before_any_output(capsys, mesh, extra, match):
    rc, out, err = run(capsys, "--model", "llama3-8b", "--mesh", mesh, *extra)
    assert rc == 2
    assert match in err and out == ""
