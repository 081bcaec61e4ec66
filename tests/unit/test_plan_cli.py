"""``python -m raggedfsdp plan``: listing, text and JSON reports, model files, errors."""

from __future__ import annotations

import json

import pytest

from raggedfsdp.planner._cli import main

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
